"""The model runner: owns the device-side state of every running sequence and advances them one frame.

Row r of each tensor belongs to one sequence (a cache slot). Born here, freed here:
  talker KV cache  [layers, R, Hkv, max_len, hd]   positions of the prompt and every frame
  predictor cache  [layers, R, Hkv, 17, hd]          scratch, rewritten every frame
  pos [R]      next talker cache position (= the row's length)
  step [R]     number of codebook-0 ids drawn so far
  seen [R, V]  codebook-0 ids drawn so far (repetition penalty)
  hidden [R, D], c0 [R]  talker hidden and codebook-0 id that the next frame starts from
  trailing [R, cap, D], trailing_len [R]  the text track fed alongside generated frames
  params (RowParams over all R rows)   each row's sampling settings and seed
The host mirrors only what it can know without asking the device (each row's length), so a frame runs
with no host synchronisation; the caller reads the `done` flags once per emitted chunk.

`frame(b, read_len)` is the whole per-frame device computation for rows 0..b-1 with static shapes and
no host-dependent control flow; on a GPU it is captured as a CUDA graph per (batch bucket, length bucket)
(`cuda_graphs.GraphedFrames`), elsewhere it runs eagerly. Rows are kept dense (0..B-1) by `move_row`.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from tts_engine.errors import TTSError
from tts_engine.cpu import fused_step
from tts_engine.cpu import predictor_frame
from tts_engine.cpu import talker_step
from tts_engine.cpu.kernels import onednn_off, onednn_on, onednn_outside
from tts_engine.model.prompt import Prompt
from tts_engine.model.sampling import C0Processor, RowParams, SamplingParams, choose_residual, host_facts
from tts_engine.model.talker import Talker

GRAPH_TOP_K_CAP = 64   # the captured sampler scores this many candidates; larger top_k runs eagerly
_GENERAL = {"any_sample": True, "k_max": GRAPH_TOP_K_CAP, "any_top_p": True}
GENERAL_FACTS = {"c0": _GENERAL, "sub": _GENERAL}
log = logging.getLogger("tts_engine")
ATEN_GEMV_MAX_ROWS = 2   # bf16 on a CPU: up to this many rows, PyTorch's own gemv beats oneDNN's (see below)


@contextlib.contextmanager
def aten_bf16_gemv(on: bool):
    """On a CPU, a bf16 linear with 1-2 input rows reads its weights ~1.7x faster through PyTorch's own
    matrix-vector kernel than through oneDNN's (measured on a 2-core Zen 4: 3072x1024, 1 row, 0.23 vs 0.39 ms;
    from 4 rows on oneDNN wins), so the per-frame step of a small bf16 batch turns oneDNN off while it runs.
    The switch is process-wide (another thread running a linear meanwhile only takes the other kernel)."""
    if not on:
        yield
        return
    with onednn_off():
        yield


class ModelRunner:
    def __init__(self, talker: Talker, tts_pad: torch.Tensor, rows: int, max_len: int, eos_id: int,
                 trailing_cap: int = 1024):
        self.talker = talker
        w = talker.model.norm.weight   # device and activation dtype (linear layers may be quantised)
        self.device, self.dtype = w.device, w.dtype
        self.rows, self.max_len = rows, max_len
        D, V = talker.cfg.hidden_size, talker.cfg.vocab_size
        self.n_books = talker.cfg.num_code_groups
        self.eos_id = eos_id
        self.cache = talker.new_cache(rows, max_len, self.device, self.dtype)
        self.cp_cache = talker.code_predictor.new_cache(rows, self.device, self.dtype)
        z = dict(device=self.device)
        self.pos = torch.zeros(rows, dtype=torch.long, **z)
        self.step = torch.zeros(rows, dtype=torch.long, **z)
        self.max_new = torch.zeros(rows, dtype=torch.long, **z)
        self.seen = torch.zeros(rows, V, dtype=torch.bool, **z)
        self.hidden = torch.zeros(rows, D, dtype=self.dtype, **z)
        self.c0 = torch.zeros(rows, dtype=torch.long, **z)
        self._true = torch.ones((), dtype=torch.bool, **z)
        self.trailing = torch.zeros(rows, trailing_cap, D, dtype=self.dtype, **z)
        self.trailing_len = torch.zeros(rows, dtype=torch.long, **z)
        self.tts_pad = tts_pad.to(self.dtype)
        self.host_len = [0] * rows
        self.params: list[SamplingParams | None] = [None] * rows
        self.rp = RowParams.stack([SamplingParams()] * rows, self.device)   # all rows, written at prefill
        self._dense_views: dict = {}   # (b, general) -> RowParams of rows 0..b-1 (`_dense_params`)
        self.c0_proc = C0Processor(V, eos_id, min_new_tokens=2, device=self.device)
        self.row_index = torch.arange(rows, device=self.device)
        self.graphs = None   # GraphedFrames on CUDA (set by the engine), else None
        # eager only: `decode` calls on_frame_codes(codes [B, 16]) once the frame's codes are complete, before the
        # talker step (outside the bf16 gemv switch); the worker decodes completed chunks there
        self.on_frame_codes = None
        # what serves each part of a frame, and why: {part: an object with .entry() (a cpu.measured.MeasuredChoice or
        # Record) or a {"path", "how", "why"} dict}, written by whatever attaches a path (the CPU's below, a GPU
        # backend's, the engine's CUDA graphs); `TTSEngine.paths()` lists them
        self.path_entries: dict = {}
        # quantised CPU stacks: the fused decode step where it runs and is measured faster (model/fused_step.py; its
        # trial runs now, timing the eager path as a one-row decode runs it)
        if self.device.type == "cpu":
            with aten_bf16_gemv(self._gemv(1)):
                self.path_entries.update(fused_step.attach(talker))
        # ... and the code predictor's 15 passes of a frame in one call of it (model/predictor_frame.py), its trial
        # run now too, so that no request sees it
        if self.device.type == "cpu":
            self.path_entries.update(predictor_frame.attach(talker))
            self._measure_predictor_frame()
        # ... and the talker's whole step around its fused stack in one call of it (model/talker_step.py), its trial
        # run now too (on row 0, put back afterwards)
        self.talker_step = None
        if self.device.type == "cpu":
            self._attach_talker_step()
        self.prefix_cache = None   # a prefix_cache.PrefixCache (set by the engine): prompts' voice parts kept

    def compile_predictor(self) -> str:
        """Serve one-row code-predictor passes through a compiled graph (`model.compiled_predictor`), compiled now
        as a warm-up; CPU engines with fused projections only (16-bit or quantised). -> its status line. A failure
        leaves the eager path serving."""
        from tts_engine.cpu.compiled_predictor import CompiledPredictorPass

        cp = self.talker.code_predictor
        if self.device.type != "cpu" or cp.model.layers[0].self_attn.qkv_proj is None:
            self.path_entries["compiled predictor"] = {"path": "eager", "how": "default",
                                                       "why": "CPU 16-bit or quantised engines only"}
            return "off (CPU 16-bit or quantised engines only)"
        try:
            cp.compiled = CompiledPredictorPass(cp, self.device, self.dtype)
        except Exception as e:   # e.g. no C++ compiler: never an outage
            log.warning("compiled code predictor not used: %s", e)
            self.path_entries["compiled predictor"] = {"path": "eager", "how": "fell back", "why": type(e).__name__}
            return f"off ({type(e).__name__})"
        self.path_entries["compiled predictor"] = cp.compiled
        cp.compiled.warm_up(self.cp_cache)
        return cp.compiled.status

    def disable_graphs(self, reason: str) -> None:
        """Serve eagerly from now on (a capture or a replay raised): one log line, never an outage."""
        if self.graphs is not None:
            log.warning("CUDA graphs turned off, serving on the eager path from now on: %s", reason)
        self.graphs = None
        self.path_entries["frame"] = {"path": "eager", "how": "fell back", "why": reason}

    # --- bookkeeping -----------------------------------------------------------------------------
    def _host_facts(self, b: int, general: bool) -> dict:
        """The sampler's host facts for rows 0..b-1; `general` gives the captured superset."""
        if general:
            return GENERAL_FACTS
        return host_facts([p for p in self.params[:b] if p is not None])

    def graph_compatible(self, b: int) -> bool:
        """Rows 0..b-1 can use the captured frame (their top-k fits the captured candidate count)."""
        return all(p is None or (0 < p.top_k <= GRAPH_TOP_K_CAP and 0 < p.subtalker_top_k <= GRAPH_TOP_K_CAP)
                   for p in self.params[:b])

    def _write_params(self, row: int, p: SamplingParams) -> None:
        one = RowParams.stack([p], self.device)
        for k, v in one.__dict__.items():
            if k != "host":
                getattr(self.rp, k)[row] = v[0]
        self.params[row] = p
        self._dense_views.clear()

    def _set_trailing(self, row: int, trailing: torch.Tensor) -> None:
        n = trailing.shape[0]
        if n > self.trailing.shape[1]:
            raise TTSError(f"the text is too long for one request ({n} tokens after the first; the limit is "
                           f"{self.trailing.shape[1]}). Split it into sentences.")
        self.trailing[row, :n] = trailing.to(self.dtype)
        self.trailing_len[row] = n

    def move_row(self, src: int, dst: int) -> None:
        """Move a running sequence's state from row `src` to row `dst` (keeps active rows dense)."""
        if src == dst:
            return
        L = self.host_len[src]
        self.cache.k[:, dst, :, :L] = self.cache.k[:, src, :, :L]
        self.cache.v[:, dst, :, :L] = self.cache.v[:, src, :, :L]
        for t in (self.pos, self.step, self.max_new, self.seen, self.hidden, self.c0, self.trailing_len):
            t[dst] = t[src]
        n = self.trailing.shape[1]
        self.trailing[dst, :n] = self.trailing[src, :n]
        for k, v in self.rp.__dict__.items():
            if k != "host":
                v[dst] = v[src]
        self.host_len[dst], self.params[dst] = self.host_len[src], self.params[src]
        self._dense_views.clear()
        self.release(src)

    def release(self, row: int) -> None:
        self.params[row] = None
        self._dense_views.clear()
        self.host_len[row] = 0
        self.pos[row] = 0

    # --- the two kinds of step ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, row: int, prompt: Prompt, params: SamplingParams) -> torch.Tensor:
        """Run a new sequence's prompt into cache row `row` and draw its first codebook-0 id.
        Returns done [1] (bool, on device)."""
        L = prompt.prefill.shape[0]
        if L + 2 > self.max_len:
            raise TTSError(f"the prompt is too long ({L} positions; this engine holds {self.max_len}). "
                           "Use a shorter text or reference clip.")
        self._set_trailing(row, prompt.trailing)
        self._write_params(row, params)
        r = self.row_index[row:row + 1]
        h, logits = self._prefill_talker(row, prompt.prefill.to(self.dtype), prompt.prefix_len)
        self.pos[row] = L
        self.host_len[row] = L
        self.step[row] = 0
        self.seen[row] = False
        self.max_new[row] = min(params.max_new_tokens, self.max_len - L + 1)
        rp = RowParams(**{k: (v[row:row + 1] if k != "host" else host_facts([params]))
                          for k, v in self.rp.__dict__.items()})
        c0 = self.c0_proc(logits, self.seen[r], self.step[r], rp)
        return self._after_c0(r, h, c0)

    def _prefill_talker(self, row: int, x: torch.Tensor, prefix_len: int):
        """The talker over a prompt's input embeddings x [L, D] into cache row `row` (positions 0..L-1) -> (hidden,
        logits) of the last position. With a prefix cache the first `prefix_len` positions (the voice's part,
        `Prompt.prefix_len`) and the rest are two calls: the first is skipped when this prefix's keys/values are in
        the cache (copied from it), else it runs and they are kept. Hit or miss, the same computations give the
        same bits, so a request's output never depends on what ran before it. (A prefix's keys computed inside a
        whole-prompt call would not do: their attention sums over the prompt's length, so they round differently
        for every text length.)"""
        L, rows = x.shape[0], slice(row, row + 1)
        pc, P = self.prefix_cache, prefix_len
        if pc is None or not pc.enabled or not 0 < P < L:
            return self.talker.forward_embeds(x[None], self.cache, rows, torch.zeros(1, dtype=torch.long,
                                                                                     device=self.device), L,
                                              write_start=0)
        key = pc.key(x[:P])
        kv = pc.get(key)
        if kv is not None:
            self.cache.k[:, row, :, :P] = kv[0]
            self.cache.v[:, row, :, :P] = kv[1]
        else:
            self.talker.model.run(x[None, :P], self.cache, rows, torch.zeros(1, dtype=torch.long, device=self.device),
                                  P, write_start=0)
            pc.put(key, self.cache.k[:, row, :, :P], self.cache.v[:, row, :, :P])
        return self.talker.forward_embeds(x[None, P:], self.cache, rows,
                                          torch.full((1,), P, dtype=torch.long, device=self.device), L, write_start=P)

    def _after_c0(self, r: torch.Tensor, h: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        self.seen.index_put_((r, c0), self._true)   # a device value: no host copy inside a graph capture
        self.step[r] += 1
        self.hidden[r] = h
        self.c0[r] = c0
        return (c0 == self.eos_id) | (self.step[r] >= self.max_new[r])

    @torch.inference_mode()
    def decode(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete one frame for each row in `rows` and start the next.

        Returns (codes [B, 16] of the completed frame, done [B]): done means the id drawn for the next
        frame is end-of-speech (or the row reached max_new_tokens), so this frame is the row's last. With
        `on_frame_codes` set (and no CUDA graphs) the hook gets the codes between the two halves (`complete`,
        `advance`: the same computations).
        Dense rows 0..B-1 take the static path (a CUDA graph where captured); other row sets, eager."""
        B = len(rows)
        read_len = max(self.host_len[i] for i in rows) + 1
        if read_len > self.max_len:
            raise RuntimeError("talker cache overflow")  # unreachable: max_new bounds the length
        with aten_bf16_gemv(self._gemv(B)):
            codes, done = self._decode(rows, B, read_len)
        for i in rows:
            self.host_len[i] += 1
        return codes, done

    # --- the same frame in two halves (CPU eager: a chunk's audio can be decoded between them) --------------------
    @torch.inference_mode()
    def complete(self, rows: list[int]) -> torch.Tensor:
        """First half of `decode`: the code predictor completes the current frame of each row in `rows` ->
        codes [B, 16]. Changes no row state (only the predictor's scratch cache): call `advance` with these codes
        next, before any other step of these rows. Eager only (no CUDA graph)."""
        r, _, rp = self._rows_view(rows)
        with aten_bf16_gemv(self._gemv(len(rows))):
            return self._predict_residuals(self.hidden[r], self.c0[r], self.step[r] - 1, rp)

    @torch.inference_mode()
    def advance(self, rows: list[int], codes: torch.Tensor) -> torch.Tensor:
        """Second half of `decode`: the talker step that consumes the completed frame `codes` [B, 16] and draws
        each row's next codebook-0 id -> done [B] (as `decode`'s)."""
        B = len(rows)
        read_len = max(self.host_len[i] for i in rows) + 1
        if read_len > self.max_len:
            raise RuntimeError("talker cache overflow")  # unreachable: max_new bounds the length
        r, cache_rows, rp = self._rows_view(rows)
        with aten_bf16_gemv(self._gemv(B)):
            done = self._advance(r, cache_rows, rp, read_len, codes)
        for i in rows:
            self.host_len[i] += 1
        return done

    def _gemv(self, B: int) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.bfloat16 and B <= ATEN_GEMV_MAX_ROWS

    def _rows_view(self, rows: list[int]):
        """(row index tensor, cache rows (a slice where contiguous), RowParams) of `rows`, as `frame` and
        `_frame_rows` build them."""
        B = len(rows)
        if rows == list(range(B)):
            return self.row_index[:B], slice(0, B), self._dense_params(B, general=False)
        r = torch.tensor(rows, device=self.device)
        rp = RowParams(**{k: (v[r] if k != "host" else host_facts([self.params[i] for i in rows]))
                          for k, v in self.rp.__dict__.items()})
        contiguous = rows == list(range(rows[0], rows[0] + B))
        return r, (slice(rows[0], rows[0] + B) if contiguous else r), rp

    def _decode(self, rows: list[int], B: int, read_len: int):
        if rows == list(range(B)):
            codes = None
            if self.graphs is not None and self.graph_compatible(B):
                try:
                    codes, done = self.graphs.run(B, read_len)
                except Exception as e:  # a capture or replay that fails must not fail the request
                    self.disable_graphs(f"{type(e).__name__}: {e}".splitlines()[0][:300])
            if codes is None:
                codes, done = self.frame(B, read_len, general=False)
        else:
            codes, done = self._frame_rows(rows, read_len)
        return codes, done

    def frame(self, b: int, read_len: int, general: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for rows 0..b-1 (static shapes: capturable). `general` fixes the sampler's host facts to
        the captured superset (any sampling, top-k <= GRAPH_TOP_K_CAP, top-p on)."""
        return self._frame_core(self.row_index[:b], slice(0, b), self._dense_params(b, general), read_len)

    def _dense_params(self, b: int, general: bool) -> RowParams:
        """RowParams of rows 0..b-1 (views of `rp`, and the rows' host facts), built once per batch composition
        rather than every frame: the rows' settings change only in `_write_params`, `move_row` and `release`, which
        forget the views."""
        rp = self._dense_views.get((b, general))
        if rp is None:
            rp = self._dense_views[(b, general)] = RowParams(
                **{k: (v[:b] if k != "host" else self._host_facts(b, general)) for k, v in self.rp.__dict__.items()})
        return rp

    def _frame_rows(self, rows: list[int], read_len: int):
        r = torch.tensor(rows, device=self.device)
        rp = RowParams(**{k: (v[r] if k != "host" else host_facts([self.params[i] for i in rows]))
                          for k, v in self.rp.__dict__.items()})
        B = len(rows)
        contiguous = rows == list(range(rows[0], rows[0] + B))
        return self._frame_core(r, slice(rows[0], rows[0] + B) if contiguous else r, rp, read_len)

    def _frame_core(self, r, cache_rows, rp: RowParams, read_len: int):
        frame_idx = self.step[r] - 1                        # index of the frame being completed
        codes = self._predict_residuals(self.hidden[r], self.c0[r], frame_idx, rp)   # [B, 16]
        if self.on_frame_codes is not None and self.graphs is None:   # (never inside a CUDA graph capture)
            self._hand_over(codes)
        return codes, self._advance(r, cache_rows, rp, read_len, codes)

    def _hand_over(self, codes: torch.Tensor) -> None:
        """on_frame_codes(codes) with oneDNN as it is outside every thread's bf16 gemv switch (the codec decodes
        there: its linear layers need oneDNN), read from the switch itself: another engine's worker may hold oneDNN
        off while this frame runs."""
        if torch._C._get_mkldnn_enabled() or not onednn_outside():
            self.on_frame_codes(codes)
            return
        with onednn_on():
            self.on_frame_codes(codes)

    def _advance(self, r, cache_rows, rp: RowParams, read_len: int, codes: torch.Tensor) -> torch.Tensor:
        """The talker step consuming `codes` [B, 16] -> done [B]; where the step in one C++ call serves
        (`talker_step`), the same computations there."""
        step = self.talker_step
        if step is not None and step.takes(r.shape[0]):
            return step.run(r, rp, codes, lambda: self._advance_python(r, cache_rows, rp, read_len, codes))
        return self._advance_python(r, cache_rows, rp, read_len, codes)

    @torch.inference_mode()
    def _attach_talker_step(self) -> None:
        """Attach `talker_step.TalkerStep` where it runs and run its trial (`TalkerStep.measure`, on row 0 before
        any request holds it). Never raises."""
        self.talker_step, self.path_entries["talker step"] = talker_step.attach(self)
        step = self.talker_step
        if step is None or step.state != "trial":
            return
        rp = RowParams(**{k: (v[:1] if k != "host" else host_facts([SamplingParams()]))
                          for k, v in self.rp.__dict__.items()})

        def python_step(r, rp, codes):
            return self._advance_python(r, slice(0, 1), rp, int(self.pos[0]) + 1, codes)

        with aten_bf16_gemv(self._gemv(1)):
            step.measure(self, rp, python_step)

    def _advance_python(self, r, cache_rows, rp: RowParams, read_len: int, codes: torch.Tensor) -> torch.Tensor:
        frame_idx = self.step[r] - 1
        x = self.talker.frame_embed(codes) + self._trailing_at(r, frame_idx)         # [B, D]
        h, logits = self.talker.forward_embeds(x[:, None], self.cache, cache_rows, self.pos[r], read_len)
        # (padding rows of a captured batch bucket also advance; the clamp keeps their writes in bounds)
        self.pos[r] = (self.pos[r] + 1).clamp(max=self.max_len - 1)
        c0 = self.c0_proc(logits, self.seen[r], self.step[r], rp)
        return self._after_c0(r, h, c0)

    def _trailing_at(self, r: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        n = self.trailing_len[r]
        vec = self.trailing[r, g.clamp(max=self.trailing.shape[1] - 1)]
        return torch.where((g < n)[:, None], vec, self.tts_pad[None])

    def _predict_residuals(self, h: torch.Tensor, c0: torch.Tensor, frame_idx: torch.Tensor,
                           rp: RowParams) -> torch.Tensor:
        """Code predictor: [h, C(c0)] -> codebooks 1..15, one KV-cached step each. Returns [B, 16]. Where the
        predictor's frame in one C++ call serves (`predictor_frame`), the same computations there."""
        frame = getattr(self.talker.code_predictor, "frame", None)
        if frame is not None and frame.takes(h.shape[0]):
            return frame.run(h, c0, frame_idx, rp, self.cp_cache,
                             lambda: self._predict_residuals_loop(h, c0, frame_idx, rp))
        return self._predict_residuals_loop(h, c0, frame_idx, rp)

    @torch.inference_mode()
    def _measure_predictor_frame(self) -> None:
        """Run the predictor frame's trial (`PredictorFrame`, state "trial": both paths timed on the same input, the
        choice remembered) at load, on random inputs in row 0 of the predictor's cache (every frame rewrites the
        positions it reads, so nothing stays behind), as a one-row frame runs. Never raises."""
        frame = getattr(self.talker.code_predictor, "frame", None)
        if frame is None or frame.state != "trial" or not frame.takes(1):
            return
        g = torch.Generator().manual_seed(0)
        D, V = self.hidden.shape[1], self.talker.cfg.vocab_size
        h = torch.randn(1, D, generator=g).to(self.dtype)
        c0 = torch.randint(0, min(V, 2048), (1,), generator=g)
        frame_idx = torch.zeros(1, dtype=torch.long)
        rp = RowParams(**{k: (v[:1] if k != "host" else host_facts([SamplingParams()]))
                          for k, v in self.rp.__dict__.items()})
        try:
            with aten_bf16_gemv(self._gemv(1)):
                while frame.state == "trial":
                    frame.run(h, c0, frame_idx, rp, self.cp_cache,
                              lambda: self._predict_residuals_loop(h, c0, frame_idx, rp))
        except Exception as e:   # (run() already falls back on its own failures; anything else: off, one line)
            frame.disable(f"{type(e).__name__}: {e}")

    def _predict_residuals_loop(self, h: torch.Tensor, c0: torch.Tensor, frame_idx: torch.Tensor,
                                rp: RowParams) -> torch.Tensor:
        """`_predict_residuals` from Python: one `CodePredictor.step` and one `choose_residual` per codebook."""
        cp = self.talker.code_predictor
        x = torch.stack([h, self.talker.codec_embed(c0)], dim=1)                # [B, 2, D]
        out = [c0]
        for j in range(self.n_books - 1):
            logits = cp.step(x, self.cp_cache, None, start=0 if j == 0 else j + 1, head=j)  # [B, 2048]
            c = choose_residual(logits, frame_idx, j + 1, rp)
            out.append(c)
            if j + 1 < self.n_books - 1:
                x = cp.model.codec_embedding[j](c)[:, None]                      # [B, 1, D]
        return torch.stack(out, dim=-1)
