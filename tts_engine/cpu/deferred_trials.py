"""Measured choices that do not fit in a fresh start: a default serves now (one log line), the trial runs later, in a
background thread, while no engine of this process serves a request, and its result is remembered for the next start
(and for a part loaded later in this process, e.g. another engine's codec decoder).

A fresh start (empty cache folder: a Space without persistent storage, a new machine) must answer its first request
within ~10 s of its model being loaded; the trials of a start that fit are the kernel table's, quantize=auto's
and the fused paths' (a few seconds together); the codec decoder's conv choice (timing five decoders, the int8
threshold and the int8 quality check: ~70 s for the 0.6B codec on a busy 2-vCPU Zen 4) does not, and is deferred
here (cpu/codec_dtype.py). TTS_START_TRIALS=all runs every trial at start instead (tests, benchmarks that want the
measured paths from the first request), `bounded` (default) defers.

A request that comes while a job times stops it at its next `check()` (the timing loops call it between timings: the
CPU goes back to the request at once); the job runs again at the next quiet moment.

"While no engine serves": each engine's worker calls `mark_busy()` at every frame it runs (and the kernel table at
every timing); a job starts once the process has served its first frame (an engine that is still loading times its
own choices: nothing may run beside them) and QUIET_S seconds passed without one, runs on a niced thread, and where a frame ran meanwhile its timings are thrown away and
it runs again at the next quiet moment (RETRIES times at most; then it is left for the next start, one log line).
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

_jobs: deque = deque()
_lock = threading.Lock()
_state: dict = {"last_busy": 0.0, "served": False, "thread": None, "done": []}


class Interrupted(Exception):
    """A frame was served (or a load-time trial timed) while a deferred trial ran: its timings are thrown away."""


_local = threading.local()   # .started: when this thread's deferred job started (None outside one)


def check() -> None:
    """Between two timings of a trial: inside a deferred job, raise `Interrupted` once an engine served a frame since
    the job started; anywhere else nothing (the load-time trials call the same loops)."""
    t0 = getattr(_local, "started", None)
    if t0 is not None and _state["last_busy"] >= t0:
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
    """Seconds since the last frame or timing (0 before the first frame: the start is not over)."""
    return time.monotonic() - _state["last_busy"] if _state["served"] else 0.0


def defer(name: str, measure: Callable[[], object], commit: Callable[[object], None]) -> None:
    """Run measure() later while no engine serves, then commit(its result) (remember it) where no frame ran during
    it; both run in the trials' thread and must not raise into it (a raise is logged, the job dropped)."""
    with _lock:
        _jobs.append((name, measure, commit))
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
            name, measure, commit = _jobs[0]
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
                break
            finally:
                _local.started = None
            if _state["last_busy"] < t0:
                try:
                    commit(got)
                except Exception as e:   # noqa: BLE001
                    log.warning("tts_engine: deferred trial %s not kept (%s: %s)", name, type(e).__name__, e)
                else:
                    log.info("tts_engine: deferred trial %s measured while idle in %.1f s", name, time.monotonic() - t0)
                    _state["done"].append(name)
                break
            log.info("tts_engine: deferred trial %s stopped for a request (try %d of %d); again when idle",
                     name, attempt, RETRIES)
        else:
            log.info("tts_engine: deferred trial %s left for the next start (requests kept coming)", name)
        with _lock:
            _jobs.popleft()
