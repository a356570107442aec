"""Measured choices that do not fit in a fresh start: a default serves now (one log line), the trial runs later, in a
background thread, while no engine of this process serves a request, and its result is remembered for the next start
(and for a part loaded later in this process, e.g. another engine's codec decoder).

A fresh start (empty cache folder: a Space without persistent storage, a new machine) must answer its first request
within ~10 s of its model being loaded; the trials of a start that fit are the kernel table's 1-row timings and
quantize=auto's; the codec decoder's conv choice (timing five decoders, the int8 threshold and the int8 quality check:
~70 s for the 0.6B codec on a busy 2-vCPU Zen 4, cpu/codec_dtype.py), the kernel table's 4-row timings, the matmul
share and the timing of the fused stacks, predictor frame and talker step (~3 s each on a busy 2-vCPU Zen 4, their
agreement checks kept at load) do not, and are deferred here. TTS_START_TRIALS=all runs every trial at start instead (tests, benchmarks that want the
measured paths from the first request), `bounded` (default) defers.

A request that comes while a job times stops it at its next `check()` (the timing loops call it between timings: the
CPU goes back to the request at once); the job runs again at the next quiet moment.

"While no engine serves": each engine's worker calls `mark_busy()` at every frame it runs (and the kernel table at
every timing), and an engine that holds a request (a prompt being prefilled, a cache row held: `watch`) counts as
busy too (for STALE_S at most without a frame: a runner left holding a row must not stop the trials for ever); a
job starts once the process has served its first frame (an engine that is still loading times its own choices:
nothing may run beside them) and QUIET_S seconds passed without one, runs on a niced thread, and where a frame ran
meanwhile its timings are thrown away and it runs again at the next quiet moment (RETRIES times at most; then it
is left for the next start, one log line).
An engine's own paths (the fused stacks, the predictor frame, the talker step: `AtBoundary`) take the same road, ahead
of the jobs whose answer only the next start uses: a fresh start serves the path expected to win, checked against the
reference at load, and times the candidates here; the verdict is remembered when its run ends undisturbed and applied
by the engine's own thread at its next frame boundary with no row held (no stream changes path mid-way, nothing races
a frame).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger("tts_engine")

ENV = "TTS_START_TRIALS"
QUIET_S = 2.0     # seconds without a served frame before a deferred trial starts
RETRIES = 5       # runs of a job disturbed by a request before it is left for the next start
NICE = 10         # the trials' thread yields the CPU to the engines' threads

_jobs: deque = deque()   # (name, measure, commit, on_end, soon); the first is the one running
_lock = threading.Lock()
_state: dict = {"last_busy": 0.0, "served": False, "thread": None, "done": []}


class Interrupted(Exception):
    """A frame was served (or a load-time trial timed) while a deferred trial ran: its timings are thrown away."""


_local = threading.local()   # .started: when this thread's deferred job started (None outside one)
_probes: list = []           # () -> True / False / None: an engine holds a request now / not / the engine is gone
_engaged: dict = {}          # probe -> when it was first seen true in its current spell
STALE_S = 30.0               # a request held this long with no frame served is not being served (a runner left holding
                             # a row: an engine closed mid-stream, a test's runner): it stops counting as busy


def watch(probe) -> None:
    """Count an engine as busy whenever probe() is true (the CPU backend: a cache row of its runner is held, from the
    start of a prefill on); probe() None: the engine is gone, no longer asked."""
    with _lock:
        _probes.append(probe)


def _note_engaged() -> None:
    """An engine holding a request now counts as a frame-free busy moment (`mark_busy(frame=False)`)."""
    with _lock:
        probes = list(_probes)
    now = time.monotonic()
    for p in probes:
        try:
            got = p()
        except Exception:   # noqa: BLE001 - a probe that fails says nothing
            continue
        if got is None:
            with _lock:
                if p in _probes:
                    _probes.remove(p)
            _engaged.pop(p, None)
        elif not got:
            _engaged.pop(p, None)
        elif now - _engaged.setdefault(p, now) <= STALE_S:
            # held since moments ago (a prefill before its first frame; later frames mark busy themselves)
            _state["last_busy"] = now
            return


def check() -> None:
    """Between two timings of a trial: inside a deferred job, raise `Interrupted` once an engine served a frame since
    the job started or holds a request now; anywhere else nothing (the load-time trials call the same loops)."""
    t0 = getattr(_local, "started", None)
    if t0 is None:
        return
    _note_engaged()
    if _state["last_busy"] >= t0:
        raise Interrupted


def bounded() -> bool:
    """Trials that do not fit in a start are deferred (TTS_START_TRIALS=bounded, the default; `all`: run them now)."""
    v = os.environ.get(ENV, "bounded").strip().lower()
    return v not in ("all", "0", "off", "no", "false")


def mark_busy(frame: bool = True) -> None:
    """An engine served a frame now (its worker calls this at every frame), or (frame=False) a load-time trial
    timed something now."""
    _state["last_busy"] = time.monotonic()
    if frame:
        _state["served"] = True


def quiet_for() -> float:
    """Seconds since the last frame, timing or request held (0 before the first frame: the start is not over)."""
    if not _state["served"]:
        return 0.0
    _note_engaged()
    return time.monotonic() - _state["last_busy"]


def defer(name: str, measure: Callable[[], object], commit: Callable[[object], None],
          on_end: Callable[[], None] | None = None, soon: bool = False) -> None:
    """Run measure() later while no engine serves, then commit(its result) (remember it) where no frame ran during
    it; both run in the trials' thread and must not raise into it (a raise is logged, the job dropped). on_end():
    called once the job is over, kept or not. soon: before the queued jobs that are not `soon` (an engine's own
    paths, used in this process, before the choices only the next start uses)."""
    job = (name, measure, commit, on_end, soon)
    with _lock:
        at = len(_jobs)
        if soon:   # after the running job and the other soon ones
            at = next((i for i, j in enumerate(_jobs) if i > 0 and not j[4]), len(_jobs))
        _jobs.insert(at, job)
        t = _state["thread"]
        if t is None or not t.is_alive():
            t = threading.Thread(target=_run, name="tts-deferred-trials", daemon=True)
            _state["thread"] = t
            t.start()


def pending() -> list[str]:
    with _lock:
        return [name for name, *_ in _jobs]


def wait(timeout: float | None = None) -> bool:
    """Wait for every deferred job to end (tests, benchmarks) -> whether none is left."""
    t = _state["thread"]
    if t is not None:
        t.join(timeout)
    return not pending()


def _run() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)   # this thread (and the ones it starts)
    except (OSError, AttributeError):
        pass
    while True:
        with _lock:
            if not _jobs:
                _state["thread"] = None
                return
            job = _jobs[0]
        try:
            _one(*job[:3])
        finally:
            with _lock:
                _jobs.remove(job)
            if job[3] is not None:
                try:
                    job[3]()
                except Exception as e:   # noqa: BLE001
                    log.warning("tts_engine: deferred trial %s: %s: %s", job[0], type(e).__name__, e)


def _one(name: str, measure, commit) -> None:
    for attempt in range(1, RETRIES + 1):
        while quiet_for() < QUIET_S:
            time.sleep(0.2)
        t0 = _local.started = time.monotonic()
        try:
            got = measure()
        except Interrupted:
            got = None
        except Exception as e:   # noqa: BLE001 - a failed trial leaves the default serving
            log.warning("tts_engine: deferred trial %s failed (%s: %s); the default stays", name, type(e).__name__, e)
            return
        finally:
            _local.started = None
        _note_engaged()   # (a request that came since the last check: its prefill may not have reached a frame yet)
        if _state["last_busy"] < t0:
            try:
                commit(got)
            except Exception as e:   # noqa: BLE001
                log.warning("tts_engine: deferred trial %s not kept (%s: %s)", name, type(e).__name__, e)
            else:
                log.info("tts_engine: deferred trial %s measured while idle in %.1f s", name, time.monotonic() - t0)
                _state["done"].append(name)
            return
        log.info("tts_engine: deferred trial %s stopped for a request (try %d of %d); again when idle",
                 name, attempt, RETRIES)
    log.info("tts_engine: deferred trial %s left for the next start (requests kept coming)", name)


class AtBoundary:
    """The deferred trials of one engine's paths (module doc): `defer` queues a trial; its verdict, once measured
    undisturbed, waits here until the engine's own thread calls `poll(no_row_held)` at a frame boundary with no row
    held (the worker's `between_frames`, through the CPU backend), which applies it there."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = 0          # trials queued or running
        self._ready: list = []  # apply() callables of verdicts measured, waiting for a free frame boundary

    def defer(self, name: str, measure: Callable[[], object], verdict: Callable[[object], Callable[[], None] | None]
              ) -> None:
        """measure() -> its result (the trials' thread, while idle; `check()` between timings); verdict(result) ->
        apply() or None (the trials' thread, once a run ended undisturbed: remembers the answer); apply() runs in
        `poll`. Ahead of the trials whose answer only the next start uses."""
        with self._lock:
            self._open += 1

        def commit(got):
            apply = verdict(got)
            if apply is not None:
                with self._lock:
                    self._ready.append(apply)

        defer(name, measure, commit, on_end=self._ended, soon=True)

    def _ended(self) -> None:
        with self._lock:
            self._open -= 1

    def waiting(self) -> bool:
        """A trial still to run, or a verdict still to apply."""
        with self._lock:
            return bool(self._open or self._ready)

    def poll(self, no_row_held: bool) -> bool:
        """At a frame boundary of the engine's thread: with no row held, apply the verdicts measured so far -> True
        once nothing is left to run or apply (the caller then stops polling)."""
        if no_row_held:
            with self._lock:
                ready, self._ready = self._ready, []
            for apply in ready:
                try:
                    apply()
                except Exception as e:   # noqa: BLE001 - a verdict that cannot apply leaves the default serving
                    log.warning("tts_engine: a deferred trial's verdict not applied: %s: %s", type(e).__name__, e)
        return not self.waiting()
