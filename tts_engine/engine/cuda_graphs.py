"""CUDA graphs for the per-frame step (GPU only; the switch is `TTSEngine(use_cuda_graphs=...)`).

One graph per (batch bucket, length bucket) replays `ModelRunner.frame(b, L, general=True)`: the talker step,
the whole 15-step code-predictor loop with on-device sampling, the frame embedding, the repetition-penalty
state update and the end-of-speech flag. Its inputs are the runner's persistent state tensors (read and written
in place), so a replay needs no argument copies; rows B..b-1 of a bucket are free rows that compute
throw-away values. Attention reads the first L cache positions (L = the length bucket), not the whole cache.
Graphs share one memory pool and are captured on first use (or all at once with `capture_all`).
"""
from __future__ import annotations

import bisect

import torch

from .model_runner import ModelRunner


class GraphedFrames:
    def __init__(self, runner: ModelRunner, batch_buckets=(1, 2, 4, 8, 16, 32, 64, 128), len_step: int = 256):
        self.runner = runner
        bb = sorted({b for b in batch_buckets if b < runner.rows} | {runner.rows})
        self.batch_buckets = bb
        self.len_buckets = sorted({min(L, runner.max_len) for L in range(len_step, runner.max_len + len_step, len_step)})
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def _bucket(self, buckets, n):
        return buckets[bisect.bisect_left(buckets, n)]

    def _state(self):
        r = self.runner
        return [r.pos, r.step, r.seen, r.hidden, r.c0]

    def capture(self, b: int, L: int):
        """Warm up on a side stream (restoring the state it touches), then record one frame."""
        saved = [t.clone() for t in self._state()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self.runner.frame(b, L, general=True)
                for t, s in zip(self._state(), saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool), torch.inference_mode():
            codes, done = self.runner.frame(b, L, general=True)
        self.pool = g.pool()
        # KV entries written during warm-up sit at each row's next position, which the next real frame rewrites
        self.graphs[(b, L)] = (g, codes, done)
        return self.graphs[(b, L)]

    def capture_all(self) -> None:
        for b in self.batch_buckets:
            for L in self.len_buckets:
                if (b, L) not in self.graphs:
                    self.capture(b, L)

    def run(self, B: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._bucket(self.batch_buckets, B)
        L = self._bucket(self.len_buckets, read_len)
        entry = self.graphs.get((b, L)) or self.capture(b, L)
        g, codes, done = entry
        g.replay()
        return codes[:B].clone(), done[:B].clone()   # the graph's outputs are overwritten by the next replay
