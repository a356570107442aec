"""CUDA graphs for the per-frame step (GPU only; the switch is `TTSEngine(use_cuda_graphs=...)`).

One graph per (batch bucket, length bucket) replays `ModelRunner.frame(b, L, general=True)`: the talker step,
the whole 15-step code-predictor loop with on-device sampling, the frame embedding, the repetition-penalty
state update and the end-of-speech flag. Its inputs are the runner's persistent state tensors (read and written
in place), so a replay needs no argument copies; rows B..b-1 of a bucket are free rows that compute
throw-away values. Attention reads the first L cache positions (L = the length bucket), not the whole cache.

Graphs share one memory pool and are captured at engine start-up (`capture_all`, the engine's warm-up), never
inside a user's request unless start-up capture was turned off. Whatever a capture or a replay raises is the
caller's to handle: the model runner then switches to the eager path for good (`ModelRunner.disable_graphs`).
"""
from __future__ import annotations

import bisect

import torch

from tts_engine.engine.model_runner import ModelRunner

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LEN_STEP = 512


def buckets(rows: int, max_len: int, batch_buckets=BATCH_BUCKETS, len_step: int = LEN_STEP):
    """(batch buckets, length buckets) of an engine with `rows` cache rows of `max_len` positions."""
    bb = sorted({b for b in batch_buckets if b < rows} | {rows})
    lb = sorted({min(L, max_len) for L in range(len_step, max_len + len_step, len_step)})
    return bb, lb


class GraphedFrames:
    def __init__(self, runner: ModelRunner, batch_buckets=BATCH_BUCKETS, len_step: int = LEN_STEP):
        self.runner = runner
        self.batch_buckets, self.len_buckets = buckets(runner.rows, runner.max_len, batch_buckets, len_step)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def _bucket(self, bucket_list, n):
        return bucket_list[bisect.bisect_left(bucket_list, n)]

    def _state(self):
        r = self.runner
        return [r.pos, r.step, r.seen, r.hidden, r.c0]

    def capture(self, b: int, L: int):
        """Warm up eagerly on a side stream (restoring the state it touches, also when it raises), then record
        one frame. KV entries written during warm-up sit at each row's next position, which the next real
        frame rewrites."""
        saved = [t.clone() for t in self._state()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side), torch.inference_mode():
                self.runner.frame(b, L, general=True)
        finally:
            for t, s in zip(self._state(), saved):
                t.copy_(s)
            torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool), torch.inference_mode():
            codes, done = self.runner.frame(b, L, general=True)
        self.pool = g.pool()
        self.graphs[(b, L)] = (g, codes, done)
        return self.graphs[(b, L)]

    def capture_all(self) -> None:
        for b in self.batch_buckets:
            for L in self.len_buckets:
                if (b, L) not in self.graphs:
                    self.capture(b, L)
        torch.cuda.synchronize()

    def run(self, B: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._bucket(self.batch_buckets, B)
        L = self._bucket(self.len_buckets, read_len)
        entry = self.graphs.get((b, L)) or self.capture(b, L)
        g, codes, done = entry
        g.replay()
        return codes[:B].clone(), done[:B].clone()   # the graph's outputs are overwritten by the next replay


class EagerBuckets(GraphedFrames):
    """The graphs' exact computation without graphs: each frame runs `ModelRunner.frame` eagerly at the padded
    (batch bucket, length bucket) shape that a graph would replay. `--check` compares graph replays with it
    (same kernels, same shapes: codes must be identical), and CPU tests use it to run the bucketed path."""

    def capture(self, b: int, L: int):
        self.graphs[(b, L)] = None
        return None

    def capture_all(self) -> None:
        for b in self.batch_buckets:
            for L in self.len_buckets:
                self.capture(b, L)

    def run(self, B: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._bucket(self.batch_buckets, B)
        L = self._bucket(self.len_buckets, read_len)
        with torch.inference_mode():
            codes, done = self.runner.frame(b, L, general=True)
        return codes[:B].clone(), done[:B].clone()
