"""Our C++ libraries built together, before an engine's first measured choice, instead of one by one when each is
first used.

`cpu_ext.cpp` and the three files that include it (`fused_step.cpp`, `predictor_frame.cpp`, `talker_step.cpp`) are
compiled once per source, torch and compiler into the cache folder (`cpu_ext.build`). On a cold cache (a fresh
machine, a Space without persistent storage) each was compiled when first used: one after another, on one core,
6-26 s each on a busy 2-core Zen 4, in the middle of the first request. `build_all` starts those not built yet at
once, one compiler per core (`cpu_ext.build` lets one thread compile a library and the others wait for it), and
returns when all are done, so that the measured choices that follow (kernel table, fused step, predictor frame,
talker step) are not timed beside a compiler. A library switched off (its environment variable, `TTS_CPU_EXT=0`)
is not built, nor one this process has already built or loaded (once per process, whatever the cache folder is
later: tests change it per test); a failure is left for the library's own first use to report (nothing here
raises)."""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from tts_engine.cpu import cpu_ext

log = logging.getLogger("tts_engine")


_done: set = set()   # sources this process built or loaded already (a later engine, another cache folder: skipped)


def _loaded(src) -> bool:
    """This process already has `src`'s library (built here, or loaded on first use)."""
    if src in _done:
        return True
    if src == cpu_ext.SOURCE:
        return "lib" in cpu_ext._state
    from tts_engine.cpu import fused_step
    from tts_engine.cpu import predictor_frame
    from tts_engine.cpu import talker_step

    for m in (fused_step, predictor_frame, talker_step):
        if src == m.SOURCE:
            return getattr(m.library, "_lib", None) is not None
    return False


def wanted(includers: bool = True) -> list:
    """The sources whose libraries this process may load: cpu_ext.cpp, and (`includers`: the engine may run the
    fused step, i.e. bf16, W8A8 or W4A8) each includer not switched off."""
    if not cpu_ext.enabled():
        return []
    from tts_engine.cpu import fused_step
    from tts_engine.cpu import predictor_frame
    from tts_engine.cpu import talker_step

    out = [cpu_ext.SOURCE]
    if includers and fused_step.setting() != "off":
        out.append(fused_step.SOURCE)
        if predictor_frame.setting() != "off":
            out.append(predictor_frame.SOURCE)
        if talker_step.setting() != "off":
            out.append(talker_step.SOURCE)
    return out


def build_all(includers: bool = True, workers: int | None = None) -> dict[str, float]:
    """Build every wanted library not built yet, `workers` compilers at once (default: one per core, at most 4).
    -> {source name: seconds of its build call} (about 0 for those already built; failed ones are left out)."""
    sources = [s for s in wanted(includers) if not _loaded(s)]
    if not sources:
        return {}
    took: dict[str, float] = {}

    def one(src):
        t = time.perf_counter()
        try:
            cpu_ext.build(source=src)
        except Exception as e:   # noqa: BLE001 - the library's own first use reports it
            log.debug("tts_engine: %s not built ahead (%s)", src.name, e)
            return
        _done.add(src)
        took[src.name] = time.perf_counter() - t

    t0 = time.perf_counter()
    n = workers or max(1, min(len(sources), os.cpu_count() or 1, 4))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="tts-cpu-build") as ex:
        list(ex.map(one, sources))
    if any(s > 0.5 for s in took.values()):
        log.info("tts_engine: C++ libraries built in %.1f s, %d at once (%s)", time.perf_counter() - t0, n,
                 ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
    return took
