"""The model runner: owns the device-side state of every running sequence and advances them one frame.

Row r of each tensor belongs to one sequence (a cache slot). Born here, freed here:
  talker KV cache  [layers, R, Hkv, max_len, hd]   positions of the prompt and every frame
  predictor cache  [layers, R, Hkv, 17, hd]          scratch, rewritten every frame
  pos [R]      next talker cache position (= the row's length)
  step [R]     number of codebook-0 ids drawn so far
  seen [R, V]  codebook-0 ids drawn so far (repetition penalty)
  hidden [R, D], c0 [R]  talker hidden and codebook-0 id that the next frame starts from
  trailing [R, cap, D], trailing_len [R]  the text track fed alongside generated frames
The host mirrors only what it can know without asking the device (each row's length), so a frame
runs with no host synchronisation; the caller reads the `done` flags once per emitted chunk.
"""
from __future__ import annotations

import torch

from ..errors import TTSError
from ..model.prompt import Prompt
from ..model.sampling import C0Processor, RowParams, SamplingParams, choose_residual
from ..model.talker import Talker


class ModelRunner:
    def __init__(self, talker: Talker, tts_pad: torch.Tensor, rows: int, max_len: int, eos_id: int):
        self.talker = talker
        w = talker.codec_head.weight
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
        self.trailing = torch.zeros(rows, 1, D, dtype=self.dtype, **z)
        self.trailing_len = torch.zeros(rows, dtype=torch.long, **z)
        self.tts_pad = tts_pad.to(self.dtype)
        self.host_len = [0] * rows
        self.params: list[SamplingParams | None] = [None] * rows
        self.c0_proc = C0Processor(V, eos_id, min_new_tokens=2, device=self.device)
        self._rp_cache: tuple[tuple, RowParams] | None = None

    # --- bookkeeping -----------------------------------------------------------------------------
    def _row_params(self, rows: list[int]) -> RowParams:
        key = tuple(rows) + tuple(id(self.params[r]) for r in rows)
        if self._rp_cache is None or self._rp_cache[0] != key:
            self._rp_cache = (key, RowParams.stack([self.params[r] for r in rows], self.device))
        return self._rp_cache[1]

    def capacity_frames(self, prompt_len: int) -> int:
        return self.max_len - prompt_len

    def _set_trailing(self, row: int, trailing: torch.Tensor) -> None:
        n = trailing.shape[0]
        if n > self.trailing.shape[1]:
            grown = torch.zeros(self.rows, max(n, 2 * self.trailing.shape[1]), self.trailing.shape[2],
                                dtype=self.dtype, device=self.device)
            grown[:, :self.trailing.shape[1]] = self.trailing
            self.trailing = grown
        self.trailing[row, :n] = trailing.to(self.dtype)
        self.trailing_len[row] = n

    # --- the two kinds of step ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, row: int, prompt: Prompt, params: SamplingParams) -> torch.Tensor:
        """Run a new sequence's prompt into cache row `row` and draw its first codebook-0 id.
        Returns done [1] (bool, on device)."""
        L = prompt.prefill.shape[0]
        if L + 2 > self.max_len:
            raise TTSError(f"the prompt is too long ({L} positions; this engine holds {self.max_len}). "
                           "Use a shorter text or reference clip.")
        self.params[row] = params
        r = torch.tensor([row], device=self.device)
        h, logits = self.talker.forward_embeds(prompt.prefill[None].to(self.dtype), self.cache, r,
                                               torch.zeros(1, dtype=torch.long, device=self.device), L)
        self.pos[row] = L
        self.host_len[row] = L
        self.step[row] = 0
        self.seen[row] = False
        frames_cap = self.max_len - L
        self.max_new[row] = min(params.max_new_tokens, frames_cap + 1)
        self._set_trailing(row, prompt.trailing)
        rp = self._row_params([row])
        c0 = self.c0_proc(logits, self.seen[r], self.step[r], rp)
        return self._after_c0(r, h, c0)

    def _after_c0(self, r: torch.Tensor, h: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        self.seen[r, c0] = True
        self.step[r] += 1
        self.hidden[r] = h
        self.c0[r] = c0
        return (c0 == self.eos_id) | (self.step[r] >= self.max_new[r])

    @torch.inference_mode()
    def decode(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete one frame for each row in `rows` and start the next.

        Returns (codes [B, 16] of the completed frame, done [B]): done means the id drawn for the next
        frame is end-of-speech (or the row reached max_new_tokens), so this frame is the row's last."""
        B = len(rows)
        r = torch.tensor(rows, device=self.device)
        contiguous = rows == list(range(rows[0], rows[0] + B))
        cache_rows = slice(rows[0], rows[0] + B) if contiguous else r   # views instead of gathers
        rp = self._row_params(rows)
        frame_idx = self.step[r] - 1                        # index of the frame being completed
        codes = self._predict_residuals(self.hidden[r], self.c0[r], frame_idx, rp)   # [B, 16]
        x = self.talker.frame_embed(codes) + self._trailing_at(r, frame_idx)         # [B, D]
        read_len = max(self.host_len[i] for i in rows) + 1
        if read_len > self.max_len:
            raise RuntimeError("talker cache overflow")  # unreachable: max_new bounds the length
        h, logits = self.talker.forward_embeds(x[:, None], self.cache, cache_rows, self.pos[r], read_len)
        self.pos[r] += 1
        for i in rows:
            self.host_len[i] += 1
        c0 = self.c0_proc(logits, self.seen[r], self.step[r], rp)
        done = self._after_c0(r, h, c0)
        return codes, done

    def _trailing_at(self, r: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        n = self.trailing_len[r]
        vec = self.trailing[r, g.clamp(max=self.trailing.shape[1] - 1)]
        return torch.where((g < n)[:, None], vec, self.tts_pad[None])

    def _predict_residuals(self, h: torch.Tensor, c0: torch.Tensor, frame_idx: torch.Tensor,
                           rp: RowParams) -> torch.Tensor:
        """Code predictor: [h, C(c0)] -> codebooks 1..15, one KV-cached step each. Returns [B, 16]."""
        cp = self.talker.code_predictor
        rows = None  # the predictor's scratch cache: rows 0..B-1 (views)
        x = torch.stack([h, self.talker.codec_embed(c0)], dim=1)                # [B, 2, D]
        out = [c0]
        for j in range(self.n_books - 1):
            logits = cp.step(x, self.cp_cache, rows, start=0 if j == 0 else j + 1, head=j)  # [B, 2048]
            c = choose_residual(logits, frame_idx, j + 1, rp)
            out.append(c)
            if j + 1 < self.n_books - 1:
                x = cp.model.codec_embedding[j](c)[:, None]                      # [B, 1, D]
        return torch.stack(out, dim=-1)

    def release(self, row: int) -> None:
        self.params[row] = None
        self.host_len[row] = 0
