"""When our one C++ library (`cpu_ext.LIBRARY`, every source of csrc/) is built: at install, else never in front of
a request.

- At install: `python -m tts_engine.cpu.build` (the Dockerfile and the README's install line run it) compiles it for
  this torch into the cache folder (`cpu_ext.build_dirs`); the app then loads it in milliseconds.
- At engine load (`prepare`, before any measured choice): a built library is loaded; where none is built yet,
  `TTS_CPU_BUILD` says what happens:
    wait        compile it now, then load (the engine's first request waits for the compiler: 10-30 s of one core);
    background  compile it in a background thread while the engine serves on the plain PyTorch paths; once it is
                loaded, the engine's own thread gives the model runner its fast paths at the next frame boundary
                where no row is held (`attach_later`);
    auto        (default) background on a Hugging Face Space (SPACE_ID set: a Gradio-SDK Space has no install step
                and no persistent build), wait elsewhere (scripts, benchmarks and tests get the same paths every run).
  With `TTS_CPU_EXT=0`, or where the library cannot be built (no compiler, not x86-64 Linux), the plain paths serve
  for good, with one log line (`cpu_ext.library`).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from tts_engine.cpu import cpu_ext

log = logging.getLogger("tts_engine")

ENV = cpu_ext.BUILD_ENV
policy = cpu_ext.build_policy                 # "wait" or "background" (module doc)
start_background = cpu_ext.start_background   # the background build, once per process
pending = cpu_ext.background_pending          # a background build (or its load) is under way


def prepare() -> str:
    """Before a CPU engine's load measures anything: load the library where it is built, else build it now or start
    the background build (`policy`) -> what happened, one line (also in `engine.paths()`, "cpu library"). Never
    raises."""
    line = _prepare()
    if line != "loaded before":
        from tts_engine.cpu import measured

        lib = cpu_ext._state.get("lib")
        how = measured.FELL_BACK if line.startswith("off") else measured.DEFAULT
        measured.note("cpu library", "our C++ kernels" if lib else "plain PyTorch", how, line)
    return line


def _prepare() -> str:
    if not cpu_ext.enabled():
        return f"off ({cpu_ext.ENABLE_ENV}=0)"
    if "lib" in cpu_ext._state:
        return "loaded before"
    if pending():
        return "building in the background"
    if cpu_ext.built() is not None or policy() == "wait":
        t, n = time.perf_counter(), len(cpu_ext.builds)
        lib = cpu_ext.library()
        how = "built and loaded" if len(cpu_ext.builds) > n else "loaded"
        return f"{how} in {time.perf_counter() - t:.1f} s" if lib is not None else f"off ({cpu_ext.why_unavailable()})"
    start_background()
    return "building in the background"


def wait(timeout: float | None = None) -> bool:
    """Wait for a background build to end -> whether the library is loaded now (tests, benchmarks)."""
    t = cpu_ext._bg.get("thread")
    if t is not None:
        t.join(timeout)
    return not pending() and "lib" in cpu_ext._state and cpu_ext._state["lib"] is not None


def attach_later(runner, attach: Callable) -> Callable[[bool], bool] | None:
    """Where the library is being built in the background: a function for the engine's own thread to call at every
    frame boundary, poll(no_row_held) -> True once done (then it is called no more); None where nothing waits. When
    the library is loaded and no row is held (the trials use row 0 and time the step), it runs attach(runner) once
    (`CpuBackend.attach_kernels`); where the build failed, the plain paths stay (already logged)."""
    if runner.device.type != "cpu" or not pending():
        return None

    def poll(no_row_held: bool) -> bool:
        if pending():
            return False
        if cpu_ext.library() is None:
            return True
        if not no_row_held:
            return False
        t = time.perf_counter()
        try:
            attach(runner)
        except Exception as e:   # noqa: BLE001 - a fast path that fails to attach: the plain paths stay
            log.warning("tts_engine: fast paths not attached after the background build: %s: %s", type(e).__name__, e)
            return True
        log.info("tts_engine: fast paths attached after the background build in %.2f s", time.perf_counter() - t)
        return True

    return poll
