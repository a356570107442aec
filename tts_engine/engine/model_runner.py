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
with no host synchronisation; the caller learns a frame's codes and `done` flags from one copy (`read_back`: pinned
and event-gated on a GPU, read while the device runs the next frame). `prefill_batch` runs the prompts of requests
admitted together in one call.

A frame is two halves: `complete` (the code predictor draws codebooks 1..15 of the current frame) and `advance`
(the talker consumes the frame and draws the next codebook-0 id); `decode` is the two in a row. `frame(b, read_len)`
is the same for rows 0..b-1 with static shapes and no host-dependent control flow: on a GPU it is captured as a CUDA
graph per (batch bucket, length bucket) (`cuda_graphs.GraphedFrames`). Rows are kept dense (0..B-1) by `move_row`.

The device's fast paths are attached once, at the end of `__init__`, by its backend (`backends.attach_backend`: on
a CPU `tts_engine.cpu.backend.CpuBackend`); what they replace is written here, in plain PyTorch: `_advance_python`
(the talker step) and `_predict_residuals_loop` (the predictor's 15 passes), which the one-call steps fall back to.
`path_entries` says what serves each part now.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from tts_engine.errors import TTSError
from tts_engine.engine.backends import attach_backend
from tts_engine.model.prompt import Prompt
from tts_engine.model.sampling import C0Processor, RowParams, SamplingParams, choose_residual, host_facts
from tts_engine.model.talker import Talker

GRAPH_TOP_K_CAP = 64   # the captured sampler scores this many candidates; larger top_k runs eagerly
_GENERAL = {"any_sample": True, "k_max": GRAPH_TOP_K_CAP, "any_top_p": True}
GENERAL_FACTS = {"c0": _GENERAL, "sub": _GENERAL}
log = logging.getLogger("tts_engine")
READ_BACK_SLOTS = 4   # pinned host buffers in turn: a frame's copy is read within the next frame or two


class ReadBack:
    """What the host learns from one frame: a handle whose `wait()` gives int64 [B, 17] (the frame's 16 codes per
    row, then its end flag as 0/1), as a numpy array the caller owns. On a GPU the copy went out non-blocking into a
    pinned buffer behind an event, so `wait()` blocks only until that copy is done (the device may already run the
    next frame); elsewhere the array is there at once."""
    __slots__ = ("_array", "_event", "_host")

    def __init__(self, array=None, event=None, host=None):
        self._array, self._event, self._host = array, event, host

    def wait(self) -> np.ndarray:
        if self._array is None:
            self._event.synchronize()
            self._array = self._host.numpy().copy()   # (the pinned slot is reused a few frames later)
        return self._array


class ModelRunner:
    def __init__(self, talker: Talker, tts_pad: torch.Tensor, rows: int, max_len: int, eos_id: int,
                 trailing_cap: int = 1024, fast_paths: bool = True, **backend_options):
        """fast_paths: let the device's backend attach its fast paths (`backends.attach_backend`, with
        `backend_options`: on a CPU compile_predictor and govern_threads, see `cpu.backend.CpuBackend`); False
        serves the plain PyTorch path of model/ (eager, or CUDA graphs where the engine captures them)."""
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
        self.prefill_graphs = None   # gpu.prefill_graph.PrefillGraphs on CUDA (set by its backend), else None
        # eager only: `decode` calls on_frame_codes(codes [B, 16]) once the frame's codes are complete, before the
        # talker step (inside `outside_step_scope`); the worker decodes completed chunks there
        self.on_frame_codes = None
        self.prefix_cache = None   # a prefix_cache.PrefixCache (set by the engine): prompts' voice parts kept
        # what serves each part of a frame, and why: {part: an object with .entry() (a cpu.measured.MeasuredChoice or
        # Record) or a {"path", "how", "why"} dict}, written by whatever attaches a path (the backend, the engine's
        # CUDA graphs, `disable_graphs`); `TTSEngine.paths()` lists them
        self.path_entries: dict = {}
        self._staging = None   # GPU: [rows, 17] int64 on the device and READ_BACK_SLOTS pinned host copies of it
        self._slot = 0
        self._plain_read_back = False   # True where the device cannot pin host memory: a plain copy per frame
        # set by the backend where it attaches (engine/backends.py); these defaults are the plain path
        self.backend = None
        self.talker_step = None                # the talker step in one call
        if fast_paths:
            attach_backend(self, **backend_options)


    def disable_graphs(self, reason: str) -> None:
        """Serve eagerly from now on (a capture or a replay raised): one log line, never an outage."""
        if self.graphs is not None:
            log.warning("CUDA graphs turned off, serving on the eager path from now on: %s", reason)
        self.graphs = None
        self.path_entries["frame"] = {"path": "eager", "how": "fell back", "why": reason}

    # --- what the host reads of a frame ---------------------------------------------------------------------------
    def read_back(self, codes: torch.Tensor, done: torch.Tensor | None = None) -> ReadBack:
        """Start the copy of a frame's codes [B, 16] and end flags [B] (None: not known yet, read as 0) to the host:
        one device-to-host copy for the frame, into a pinned buffer behind an event on a GPU (nothing waits here);
        -> its `ReadBack`."""
        B = codes.shape[0]
        if self.device.type != "cuda" or self._plain_read_back:
            out = np.zeros((B, 17), dtype=np.int64)
            out[:, :16] = codes.cpu().numpy()
            if done is not None:
                out[:, 16] = done.cpu().numpy()
            return ReadBack(out)
        if self._staging is None:
            try:
                self._staging = (torch.zeros(self.rows, 17, dtype=torch.long, device=self.device),
                                 [torch.zeros(self.rows, 17, dtype=torch.long).pin_memory()
                                  for _ in range(READ_BACK_SLOTS)])
            except RuntimeError as e:   # no pinned memory here (ZeroGPU's stand-in device before a GPU is granted)
                log.info("tts_engine: frames read back without pinned memory: %s", f"{e}".splitlines()[0][:200])
                self._plain_read_back = True
                return self.read_back(codes, done)
        dev, hosts = self._staging
        dev[:B, :16].copy_(codes)
        dev[:B, 16].copy_(done) if done is not None else dev[:B, 16].zero_()
        host = hosts[self._slot][:B]
        self._slot = (self._slot + 1) % READ_BACK_SLOTS
        host.copy_(dev[:B], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return ReadBack(host=host, event=event)

    # --- bookkeeping -----------------------------------------------------------------------------
    def _host_facts(self, b: int, general: bool) -> dict:
        """The sampler's host facts for rows 0..b-1; `general` gives the captured superset."""
        if general:
            return GENERAL_FACTS
        return host_facts([p for p in self.params[:b] if p is not None])

    def graph_compatible(self, b: int) -> bool:
        """Rows 0..b-1 can use the captured frame (their top-k fits the captured candidate count); kept per batch
        composition, as the `_dense_params` views are."""
        ok = self._dense_views.get(("graph", b))
        if ok is None:
            ok = self._dense_views[("graph", b)] = all(
                p is None or (0 < p.top_k <= GRAPH_TOP_K_CAP and 0 < p.subtalker_top_k <= GRAPH_TOP_K_CAP)
                for p in self.params[:b])
        return ok

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
        rp = self.rp.select(slice(row, row + 1), host_facts([params]))
        c0 = self.c0_proc(logits, self.seen[r], self.step[r], rp)
        return self._after_c0(r, h, c0)

    def check_prompt(self, prompt: Prompt) -> None:
        """TTSError when `prompt` does not fit a row (too long for the cache, or its text track too long)."""
        L = prompt.prefill.shape[0]
        if L + 2 > self.max_len:
            raise TTSError(f"the prompt is too long ({L} positions; this engine holds {self.max_len}). "
                           "Use a shorter text or reference clip.")
        n = prompt.trailing.shape[0]
        if n > self.trailing.shape[1]:
            raise TTSError(f"the text is too long for one request ({n} tokens after the first; the limit is "
                           f"{self.trailing.shape[1]}). Split it into sentences.")

    @torch.inference_mode()
    def prefill_batch(self, rows: list[int], prompts: list[Prompt], params: list[SamplingParams]) -> torch.Tensor:
        """`prefill` of several new sequences in one talker call: their prompts (ragged) right-padded to the longest
        and run together, each row attending to its own positions only (the padding's keys land past a row's end,
        where its frames overwrite them before any read). With a prefix cache, each row's voice prefix is copied
        from it (or run alone and kept, as in `prefill`) and the rest of all rows is one call from each row's own
        start. Every prompt must pass `check_prompt`. Returns done [B] (bool, on device)."""
        if len(rows) == 1:
            return self.prefill(rows[0], prompts[0], params[0])
        for p in prompts:
            self.check_prompt(p)
        B = len(rows)
        xs = [p.prefill.to(self.dtype) for p in prompts]
        Ls = [x.shape[0] for x in xs]
        pc = self.prefix_cache
        starts = [p.prefix_len if pc is not None and pc.enabled and 0 < p.prefix_len < L else 0
                  for p, L in zip(prompts, Ls)]
        T = max(L - P for L, P in zip(Ls, starts))
        if max(P + T for P in starts) > self.max_len:   # (the padding would run past the cache: one at a time)
            return torch.cat([self.prefill(r, p, q) for r, p, q in zip(rows, prompts, params)])
        for row, p, q in zip(rows, prompts, params):
            self._set_trailing(row, p.trailing)
            self._write_params(row, q)
        for row, x, P in zip(rows, xs, starts):
            if P:
                self._prefix_into(row, x, P)
        x = torch.zeros(B, T, xs[0].shape[1], dtype=self.dtype, device=self.device)
        for i, (xi, P) in enumerate(zip(xs, starts)):
            x[i, :Ls[i] - P] = xi[P:]
        r = torch.tensor(rows, device=self.device)
        start = torch.tensor(starts, dtype=torch.long, device=self.device)
        cache_rows = slice(rows[0], rows[0] + B) if rows == list(range(rows[0], rows[0] + B)) else r
        same = len(set(starts)) == 1
        stack = self.talker.model if self.prefill_graphs is None else self.prefill_graphs   # (GPU: graphed buckets)
        hs = stack.run(x, self.cache, cache_rows, start, max(Ls), write_start=starts[0] if same else None)
        last = torch.tensor([L - P - 1 for L, P in zip(Ls, starts)], device=self.device)
        h = hs[torch.arange(B, device=self.device), last]
        logits = self.talker.codec_head(h).float()
        L_t = torch.tensor(Ls, dtype=torch.long, device=self.device)
        self.pos[r] = L_t
        for row, L in zip(rows, Ls):
            self.host_len[row] = L
        self.step[r] = 0
        self.seen[r] = False
        self.max_new[r] = torch.tensor([min(q.max_new_tokens, self.max_len - L + 1) for q, L in zip(params, Ls)],
                                       dtype=torch.long, device=self.device)
        rp = self.rp.select(r, host_facts(params))
        c0 = self.c0_proc(logits, self.seen[r], self.step[r], rp)
        return self._after_c0(r, h, c0)

    def _prefix_into(self, row: int, x: torch.Tensor, P: int) -> None:
        """The voice prefix x[:P] of a prompt into cache row `row`: copied from the prefix cache, else run alone
        (as `_prefill_talker` runs it) and kept."""
        pc = self.prefix_cache
        key = pc.key(x[:P])
        kv = pc.get(key)
        if kv is not None:
            self.cache.k[:, row, :, :P] = kv[0]
            self.cache.v[:, row, :, :P] = kv[1]
            return
        self.talker.model.run(x[None, :P], self.cache, slice(row, row + 1),
                              torch.zeros(1, dtype=torch.long, device=self.device), P, write_start=0)
        pc.put(key, self.cache.k[:, row, :, :P], self.cache.v[:, row, :, :P])

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
        """Complete one frame for each row in `rows` and start the next: `advance(rows, complete(rows))`, or one
        replay of the captured frame where CUDA graphs serve (dense rows 0..B-1 whose sampling the capture covers).

        Returns (codes [B, 16] of the completed frame, done [B]): done means the id drawn for the next
        frame is end-of-speech (or the row reached max_new_tokens), so this frame is the row's last. With
        `on_frame_codes` set (eager only) the hook gets the codes between the two halves."""
        B = len(rows)
        if self.graphs is not None and rows == list(range(B)) and self.graph_compatible(B):
            read_len = self._read_len(rows)
            try:
                codes, done = self.graphs.run(B, read_len)
            except Exception as e:  # a capture or replay that fails must not fail the request
                self.disable_graphs(f"{type(e).__name__}: {e}".splitlines()[0][:300])
            else:
                self._grown(rows)
                return codes, done
        codes = self.complete(rows)
        if self.on_frame_codes is not None and self.graphs is None:
            self._hand_over(codes)
        return codes, self.advance(rows, codes)

    # --- a frame in two halves (eager: a chunk's audio can be decoded between them) -------------------------------
    @torch.inference_mode()
    def complete(self, rows: list[int]) -> torch.Tensor:
        """First half of a frame: the code predictor completes the current frame of each row in `rows` ->
        codes [B, 16]. Changes no row state (only the predictor's scratch cache): call `advance` with these codes
        next, before any other step of these rows. Eager only (no CUDA graph)."""
        r, _, rp = self.rows_view(rows)
        with self.step_scope(len(rows)):
            return self._predict_residuals(self.hidden[r], self.c0[r], self.step[r] - 1, rp)

    @torch.inference_mode()
    def advance(self, rows: list[int], codes: torch.Tensor) -> torch.Tensor:
        """Second half of a frame: the talker step that consumes the completed frame `codes` [B, 16] and draws
        each row's next codebook-0 id -> done [B] (as `decode`'s)."""
        read_len = self._read_len(rows)
        r, cache_rows, rp = self.rows_view(rows)
        with self.step_scope(len(rows)):
            done = self._advance(r, cache_rows, rp, read_len, codes)
        self._grown(rows)
        return done

    def _read_len(self, rows: list[int]) -> int:
        """Talker cache positions a step of `rows` reads (the longest row's, with the new frame). max_new bounds a
        row's length; a row whose end the host has not read yet (`EngineWorker.pipelined`) may run one frame past
        it, at its last position (the device clamps `pos`), so the read stops at the cache's end."""
        return min(max(map(self.host_len.__getitem__, rows)) + 1, self.max_len)

    def _grown(self, rows: list[int]) -> None:
        hl, cap = self.host_len, self.max_len
        for i in rows:
            if hl[i] < cap:
                hl[i] += 1

    def _hand_over(self, codes: torch.Tensor) -> None:
        """on_frame_codes(codes), in the backend's `outside_step_scope` (on a CPU: oneDNN as it is outside every
        thread's step, since the codec decodes there)."""
        scope = getattr(self.backend, "outside_step_scope", None)
        with scope() if scope is not None else contextlib.nullcontext():
            self.on_frame_codes(codes)

    def rows_view(self, rows: list[int]) -> tuple[torch.Tensor, slice | torch.Tensor, RowParams]:
        """(row index tensor, cache rows (a slice where contiguous), RowParams) of `rows`: what a step of these rows
        reads. Dense rows 0..B-1 give the views `frame` uses."""
        B = len(rows)
        if rows == list(range(B)):
            return self.row_index[:B], slice(0, B), self._dense_params(B, general=False)
        r = torch.tensor(rows, device=self.device)
        rp = self.rp.select(r, host_facts([self.params[i] for i in rows]))
        contiguous = rows == list(range(rows[0], rows[0] + B))
        return r, (slice(rows[0], rows[0] + B) if contiguous else r), rp

    def default_params(self, b: int) -> RowParams:
        """RowParams of rows 0..b-1 with the host facts of default sampling (the backends' trials at attach)."""
        return self.rp.select(slice(0, b), host_facts([SamplingParams()]))

    def frame(self, b: int, read_len: int, general: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for rows 0..b-1 with static shapes and no host bookkeeping: what `cuda_graphs` captures.
        `general` fixes the sampler's host facts to the captured superset (any sampling, top-k <=
        GRAPH_TOP_K_CAP, top-p on)."""
        r, rp = self.row_index[:b], self._dense_params(b, general)
        codes = self._predict_residuals(self.hidden[r], self.c0[r], self.step[r] - 1, rp)   # [B, 16]
        return codes, self._advance(r, slice(0, b), rp, read_len, codes)

    def _dense_params(self, b: int, general: bool) -> RowParams:
        """RowParams of rows 0..b-1 (views of `rp`, and the rows' host facts), built once per batch composition
        rather than every frame: the rows' settings change only in `_write_params`, `move_row` and `release`, which
        forget the views."""
        rp = self._dense_views.get((b, general))
        if rp is None:
            rp = self._dense_views[(b, general)] = self.rp.select(slice(0, b), self._host_facts(b, general))
        return rp

    def _advance(self, r, cache_rows, rp: RowParams, read_len: int, codes: torch.Tensor) -> torch.Tensor:
        """The talker step consuming `codes` [B, 16] -> done [B]; where the step in one C++ call serves
        (`talker_step`), the same computations there."""
        step = self.talker_step
        if step is not None and step.takes(r.shape[0]):
            return step.run(r, rp, codes, lambda: self._advance_python(r, cache_rows, rp, read_len, codes))
        return self._advance_python(r, cache_rows, rp, read_len, codes)

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

    # --- for tools and benchmarks: documented, stable -------------------------------------------------------------
    # bench/ uses these, never the private methods above (tests/test_bench_public_api.py checks it); each calls the
    # internals in one line, so a change inside the runner changes only that line.

    def set_params(self, row: int, params: SamplingParams) -> None:
        """Give `row` these sampling settings (as `prefill` does), for a tool that fills a row's state itself."""
        self._write_params(row, params)

    def step_scope(self, b: int):
        """The context a frame step of `b` rows runs in: the backend's (CPU: oneDNN off for 1-2 bf16 rows,
        `cpu.backend.aten_bf16_gemv`), else none; for a tool that runs a step's parts itself. (`rows_view`, above,
        is public too.)"""
        scope = getattr(self.backend, "step_scope", None)
        return scope(b) if scope is not None else contextlib.nullcontext()

    def predict_residuals(self, h: torch.Tensor, c0: torch.Tensor, frame_idx: torch.Tensor,
                          rp: RowParams) -> torch.Tensor:
        """The code predictor's half of a frame on given inputs (talker hidden h [B, D], codebook-0 ids c0 [B], frame
        indices [B], the rows' RowParams) -> codes [B, 16], as the engine serves it (the frame in one C++ call where it
        serves, else the Python loop). Uses the predictor's scratch cache only."""
        return self._predict_residuals(h, c0, frame_idx, rp)

    def text_vectors(self, r: torch.Tensor, frame_idx: torch.Tensor) -> torch.Tensor:
        """The text-track vectors fed beside frame `frame_idx` of rows `r` -> [B, D] (tts_pad past a row's text)."""
        return self._trailing_at(r, frame_idx)

    def finish_step(self, r: torch.Tensor, h: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        """The end of a talker step: rows `r` take codebook-0 ids `c0` drawn from hidden `h` as their next frame's
        start (seen ids, step count, hidden, c0) -> done [B]."""
        return self._after_c0(r, h, c0)

    @torch.inference_mode()
    def replay_talker_step(self, rows: list[int], codes: torch.Tensor) -> None:
        """Run again the talker step that the last `decode` / `advance` of `rows` ran, as the engine serves it (the
        C++ step where it serves, else the Python path), from the state it started in and on the same `codes`
        [B, 16]; the rows' state is put back after (the cache positions it rewrites get the same values). For
        timing the served step on its own."""
        idx = torch.tensor(rows, device=self.device)
        saved = {n: getattr(self, n)[idx].clone() for n in ("pos", "step", "seen", "hidden", "c0")}
        self.pos[idx] -= 1
        self.step[idx] -= 1
        r, cache_rows, rp = self.rows_view(rows)
        try:
            with self.step_scope(len(rows)):
                self._advance(r, cache_rows, rp, max(self.host_len[i] for i in rows), codes)
        finally:
            for n, v in saved.items():
                getattr(self, n)[idx] = v
