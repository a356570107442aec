"""How many OpenMP threads the engine worker's frames use on a CPU, chosen frame by frame by measuring them.

Why: with N OpenMP threads on an N-core machine, every op that enters the OpenMP pool (a matmul, but also an
attention softmax or a norm of one row) waits at its end for all N threads. When another thread or process keeps
one core busy (the engine's own codec thread, the HTTP server, a browser, another program), one of them is
descheduled and every such op waits for the scheduler: on a 2-vCPU Zen 4 under load an int8 frame took 570 ms at
2 threads and 269 ms at 1 (aten::bmm 300 us per call instead of 11). On an idle machine 2 threads read the
weights faster. Which one wins is a fact of the moment, not of the machine, so it is measured all the time.

`ThreadGovernor` keeps a running average of the frame's wall time per option and per situation (the batch's
row count, and whether the engine's codec thread is decoding meanwhile) and runs each frame with the option
that is fastest there; now and then (`explore_every` frames, backing off while the other option keeps losing)
one frame runs with another option so that its average follows the machine's load. Options:
  1           one thread for everything;
  N           N threads for everything (N = the process's intra-op threads at start, when > 1);
  "matmul"    N threads inside the linear layers only, one thread for every other op (norms, attention of a few
              queries, sampling, copies: ops of a few microseconds that the pool only slows down), when the
              runner's model has its linear layers wrapped (`serial_between_matmuls`).
Every option runs the same kernels, only split differently between threads (a kernel that splits a sum between
threads may round it differently: the engine leaves fp32, whose parity is bit for bit, on the process's threads).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

MATMUL = "matmul"   # option: N threads inside the linear layers only
PROMISING = 0.9     # an explored option whose frame took < 90 % of the best's average is explored often again


@dataclass
class RunningAverage:
    """An exponential moving average of measured times and how many went in (the governor's per-option figures, the
    codec choice's per-bucket ones)."""
    ema: float | None = None
    n: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.ema = x if self.ema is None else (1 - alpha) * self.ema + alpha * x
        self.n += 1


@dataclass
class _Situation:
    stats: dict = field(default_factory=dict)   # option -> RunningAverage
    frames: int = 0
    interval: int = 0                           # frames between explorations (backs off)
    next_explore: int = 0
    turn: int = 0                               # which non-best option the next exploration tries


PREDICTOR, TALKER = "predictor", "talker"   # the halves of a split frame, chosen and timed apart


def situation(rows: int, codec_busy: bool, part: str | None = None) -> tuple:
    """The governor's situation key: the batch as 1-2 rows or more (the kernels' row buckets), whether the
    engine's codec thread is decoding meanwhile, and (a split frame) which half: PREDICTOR or TALKER. A whole frame
    is (rows, busy); a half is (rows, busy, part). The halves are governed apart because the worker hands chunks to
    the codec thread between them: a frame that starts with the codec idle often runs its talker step beside a
    decode, and that step's best threads (and its time) are the busy situation's, not the frame's."""
    key = (1 if rows <= 2 else 4, bool(codec_busy))
    return key if part is None else key + (part,)


class ThreadGovernor:
    """Chooses the worker's threads per frame by the measured wall time of frames run each way."""

    def __init__(self, threads: int | None = None, matmul_option: bool = False, explore_every: int = 8,
                 max_interval: int = 128, alpha: float = 0.3, warm_frames: int = 1):
        self.threads = int(threads or torch.get_num_threads())
        opts: list = [1]
        if self.threads > 1:
            opts += [self.threads] + ([MATMUL] if matmul_option else [])
        self.options = opts
        self.explore_every, self.max_interval = explore_every, max_interval
        self.alpha, self.warm_frames = alpha, warm_frames
        self._sit: dict = {}
        self.current = self.options[-1] if len(self.options) > 1 else 1
        self.lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return len(self.options) > 1

    def _situation(self, key) -> _Situation:
        s = self._sit.get(key)
        if s is None:
            s = self._sit[key] = _Situation(interval=self.explore_every)
        return s

    def choose(self, key) -> object:
        """The option for the next frame in situation `key` (e.g. (rows, codec busy))."""
        if not self.enabled:
            return 1
        with self.lock:
            s = self._situation(key)
            s.frames += 1
            for o in self.options:            # every option measured a few times first
                st = s.stats.get(o)
                if st is None or st.n < self.warm_frames:
                    return o
            best = self.best(key)
            if s.frames >= s.next_explore:
                others = [o for o in self.options if o != best]
                o = others[s.turn % len(others)]
                s.turn += 1
                s.next_explore = s.frames + s.interval
                return o
            return best

    def best(self, key):
        s = self._sit.get(key)
        if s is None:
            return self.options[-1]
        known = {o: st.ema for o, st in s.stats.items() if st.ema is not None}
        return min(known, key=known.get) if known else self.options[-1]

    def record(self, key, option, seconds: float) -> None:
        """The wall time of a frame run with `option` in situation `key`."""
        if not self.enabled:
            return
        with self.lock:
            s = self._situation(key)
            before = self.best(key)
            st = s.stats.setdefault(option, RunningAverage())
            if option == before or st.ema is None:
                st.add(seconds, self.alpha)
                return
            # an exploration: its average is old, so the new frame weighs half; explore often again while the
            # option looks as fast as the best (or is it now), back off while it keeps losing
            best_ema = s.stats[before].ema
            st.add(seconds, max(self.alpha, 0.5))
            promising = seconds < PROMISING * best_ema or self.best(key) != before
            s.interval = self.explore_every if promising else min(2 * s.interval, self.max_interval)

    def entry(self) -> dict[str, str]:
        """Its entry in `TTSEngine.paths()` ("threads"): the options, and the fastest of each situation so far."""
        with self.lock:
            best = {k: self.best(k) for k, s in self._sit.items() if s.stats}
        why = "; ".join(f"{situation_name(k)}: {option_name(o)}" for k, o in best.items())
        return {"path": "chosen per frame: " + " / ".join(option_name(o) for o in self.options),
                "how": "measured now", "why": f"fastest so far: {why}" if why else "no frame run yet"}

    def snapshot(self) -> dict:
        """{situation: {option: (average ms, frames)}} for benchmarks and logs."""
        with self.lock:
            return {k: {o: (round(1000 * st.ema, 1), st.n) for o, st in s.stats.items()} for k, s in self._sit.items()}


def option_name(option) -> str:
    return "1 thread" if option == 1 else "threads in the matmuls only" if option == MATMUL else f"{option} threads"


def situation_name(key: tuple) -> str:
    """"1-2 rows, codec busy, talker" for situation (1, True, "talker")."""
    return ", ".join([f"{'1-2' if key[0] == 1 else '3+'} rows"] + (["codec busy"] if key[1] else []) + list(key[2:]))


class MatmulThreads:
    """While `serial` is on (in the thread that set it), the wrapped linear layers run with `threads` intra-op
    threads and everything else with one (see `serial_between_matmuls`)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._local = threading.local()

    @property
    def serial(self) -> bool:
        return getattr(self._local, "on", False)

    def set(self, on: bool) -> None:
        self._local.on = on

    def call(self, fn, *args, **kw):
        """fn(*args, **kw), with `threads` intra-op threads (and one put back after) while `serial` is on in this
        thread; else as it is. The linear layers' wrappers, the fused step and the predictor frame run through it."""
        if not self.serial:
            return fn(*args, **kw)
        torch.set_num_threads(self.threads)
        try:
            return fn(*args, **kw)
        finally:
            torch.set_num_threads(1)


def serial_between_matmuls(model: nn.Module, threads: int) -> MatmulThreads:
    """Wrap the forward of every linear layer of `model` (torch.nn.Linear and the quantised *Linear modules) so
    that, while the returned switch is on in the calling thread, it runs with `threads` intra-op threads and puts
    one thread back after: the other ops of a frame then never enter the OpenMP pool. Off: the layer runs as
    before (one attribute read more per call)."""
    switch = getattr(model, "_matmul_threads", None)
    if switch is not None:   # wrapped before: the same switch
        switch.threads = threads
        return switch
    switch = MatmulThreads(threads)
    model._matmul_threads = switch
    for m in model.modules():
        if not (isinstance(m, nn.Linear) or type(m).__name__.endswith("Linear")) or "forward" in m.__dict__:
            continue
        m.forward = _wrapped(m.forward, switch)
    return switch


def _wrapped(forward, switch: MatmulThreads):
    def run(x, *args, **kw):
        return switch.call(forward, x, *args, **kw)
    return run
