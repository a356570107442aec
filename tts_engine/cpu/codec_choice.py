"""Where a CPU engine decodes the chunks of a running batch: on the codec thread (overlapped with the next frames)
or in the worker between frames, chosen per batch size by measuring both as the engine runs (`CodecChoice`).

Why measured: the codec thread pays when the speech-tokenizer decoder (compute bound) and the frames (memory bound)
share the cores well, and costs when it takes a core that a frame of several rows needed, or when another process
already keeps a core busy (the frames then wait on each other's OpenMP threads). On a 2-vCPU Zen 4 the codec thread
measured +30 % x real time at one stream and, at four, anything from +0 to +40 % audio seconds per wall second
from run to run; which one wins is a fact of the batch size and of the moment, so it is measured all the time.

The worker reports, per batch-size bucket (`bucket`): every frame's wall time, split by whether the codec thread was
decoding meanwhile (f_busy) or not (f_idle), and every decode it chose, on the codec thread (c_thread) or in the worker
(c_here), all as seconds per frame of one row (a decode of n frames of G rows counts n x G). The cost of one row's
frame each way:
  here:    f_idle + c_here                              (the decode adds to the worker's time)
  thread:  c_thread + (1 - c_thread / f_busy) f_idle    while the codec keeps up (c_thread < f_busy): a share
           c_thread / f_busy of the frames run beside a decode, the others alone;
           c_thread                                     when it does not (the codec bounds the throughput).
`choose` gives the cheaper one, after each has been measured (`warm` decodes each), and now and then (`explore_every`
choices, backing off to `max_interval` unless it comes out below `promising` x the best's cost or becomes the best)
the other one, so that its figures follow the machine's load. A chunk can only decode in the worker while the codec thread is idle (a sequence's chunks must stay in
order): while it is busy `choose` says "thread" and counts nothing.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tts_engine.cpu.threads import RunningAverage

THREAD = "thread"
HERE = "here"


def bucket(rows: int) -> int:
    """The batch-size bucket: 1, 2, 3-4 (4), 5-8 (8), more (16)."""
    for b in (1, 2, 4, 8):
        if rows <= b:
            return b
    return 16


@dataclass
class _Bucket:
    f_idle: RunningAverage = field(default_factory=RunningAverage)
    f_busy: RunningAverage = field(default_factory=RunningAverage)
    c: dict = field(default_factory=lambda: {THREAD: RunningAverage(), HERE: RunningAverage()})
    choices: int = 0
    interval: int = 0
    next_explore: int = 0


class CodecChoice:
    """Chooses, per batch-size bucket, where the next chunks decode, by the measured cost of a row's frame each way."""

    def __init__(self, explore_every: int = 4, max_interval: int = 32, alpha: float = 0.3, warm: int = 1,
                 promising: float = 0.9):
        self.explore_every, self.max_interval = explore_every, max_interval
        self.alpha, self.warm, self.promising = alpha, warm, promising
        self._b: dict[int, _Bucket] = {}
        self.lock = threading.Lock()

    def _bucket(self, rows: int) -> _Bucket:
        k = bucket(rows)
        b = self._b.get(k)
        if b is None:
            b = self._b[k] = _Bucket(interval=self.explore_every, next_explore=self.explore_every)
        return b

    # --- what the worker measured ------------------------------------------------------------------------------
    def record_frame(self, rows: int, codec_busy: bool, seconds: float) -> None:
        """A frame of `rows` rows took `seconds` (wall); the codec thread was decoding meanwhile or not."""
        if rows < 1:
            return
        with self.lock:
            b = self._bucket(rows)
            (b.f_busy if codec_busy else b.f_idle).add(seconds / rows, self.alpha)

    def record_decode(self, rows: int, where: str, seconds: float, row_frames: int) -> None:
        """A decode chosen for a batch of `rows` rows ran `where` and took `seconds` for `row_frames` frames of audio
        (frames x sequences decoded)."""
        if rows < 1 or row_frames < 1:
            return
        with self.lock:
            b = self._bucket(rows)
            before = self._best(b)
            b.c[where].add(seconds / row_frames, self.alpha if where == before else max(self.alpha, 0.5))
            if before is not None and where != before:   # an exploration: soon again if it looks better, else less often
                costs = self._costs(b)
                better = costs is not None and (costs[where] < self.promising * costs[before] or
                                                self._best(b) != before)
                b.interval = self.explore_every if better else min(2 * b.interval, self.max_interval)

    # --- the choice --------------------------------------------------------------------------------------------
    def choose(self, rows: int, codec_busy: bool) -> str:
        """Where the chunks of a batch of `rows` rows emitted now decode: THREAD or HERE."""
        if codec_busy:
            return THREAD   # (a chunk decoded here could overtake one of its sequence still on the thread)
        with self.lock:
            b = self._bucket(rows)
            b.choices += 1
            for w in (THREAD, HERE):   # each measured first
                if b.c[w].n < self.warm:
                    return w
            best = self._best(b)
            if b.choices >= b.next_explore:
                b.next_explore = b.choices + b.interval
                return HERE if best == THREAD else THREAD
            return best

    def costs(self, rows: int) -> dict | None:
        """{THREAD: s, HERE: s}: the modelled cost of one row's frame each way (None until both are measured)."""
        with self.lock:
            return self._costs(self._bucket(rows))

    def _costs(self, b: _Bucket) -> dict | None:
        ct, ch = b.c[THREAD].ema, b.c[HERE].ema
        fi, fb = b.f_idle.ema, b.f_busy.ema
        if ct is None or ch is None or (fi is None and fb is None):
            return None
        fi = fb if fi is None else fi
        fb = fi if fb is None else fb
        thread = ct if ct >= fb else ct + (1 - ct / fb) * fi
        return {THREAD: thread, HERE: fi + ch}

    def _best(self, b: _Bucket) -> str | None:
        c = self._costs(b)
        return None if c is None else min(c, key=c.get)

    def entry(self) -> dict[str, str]:
        """Its entry in `TTSEngine.paths()` ("codec thread"): the cheaper way of each batch-size bucket so far."""
        best = {k: v["best"] for k, v in self.snapshot().items() if v["best"]}
        why = "; ".join(f"{k} rows: {'codec thread' if w == THREAD else 'in the worker'}" for k, w in best.items())
        return {"path": "chosen per batch size: codec thread / in the worker", "how": "measured now",
                "why": f"cheaper so far: {why}" if why else "no chunk decoded yet"}

    def snapshot(self) -> dict:
        """{bucket: {"thread_ms": .., "here_ms": .., "f_idle_ms": .., "f_busy_ms": .., "c_thread_ms": .., "c_here_ms":
        .., "best": ..}} (ms per frame of one row), for benchmarks and logs."""
        def ms(v):
            return None if v is None else round(1000 * v, 2)

        with self.lock:
            out = {}
            for k, b in sorted(self._b.items()):
                c = self._costs(b) or {}
                out[k] = {"thread_ms": ms(c.get(THREAD)), "here_ms": ms(c.get(HERE)), "f_idle_ms": ms(b.f_idle.ema),
                          "f_busy_ms": ms(b.f_busy.ema), "c_thread_ms": ms(b.c[THREAD].ema),
                          "c_here_ms": ms(b.c[HERE].ema), "best": self._best(b),
                          "decodes": {w: a.n for w, a in b.c.items()}}
            return out
