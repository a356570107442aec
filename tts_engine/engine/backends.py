"""The seam between the model runner and a device's fast paths.

`attach_backend(runner, **options)` picks the backend of the runner's device and lets it attach its fast paths:
  CPU   `tts_engine.cpu.backend.CpuBackend(**options).attach(runner)` (options: compile_predictor, govern_threads);
  CUDA  `tts_engine.gpu.backend.attach(runner)` where that module imports (absent or raising: one log line, and
        the runner serves its plain path, eager or CUDA graphs).
The backend is recorded as `runner.backend`: an object with, optionally, `step_scope(rows)` and
`outside_step_scope()` (context managers around a frame step and around the codes' hand-over between its halves). It
writes what serves each part of a frame into `runner.path_entries` ({part: a `cpu.measured.MeasuredChoice` / `Record`
or a {"path", "how", "why"} dict}, listed by `TTSEngine.paths()`), and may set, only when it attaches, the runner's
`talker_step` (a one-call talker step) and the model's hooks (`DecoderStack.fused`, `CodePredictor.frame`,
`CodePredictor.compiled`).
A runner built with `fast_paths=False` gets none of them: the plain PyTorch path of model/.
"""
from __future__ import annotations

import logging

log = logging.getLogger("tts_engine")


def attach_backend(runner, **options):
    """Attach the fast paths of `runner.device`'s backend to `runner` -> the backend (None: the plain path)."""
    if runner.device.type == "cpu":
        from tts_engine.cpu.backend import CpuBackend

        return CpuBackend(**options).attach(runner)
    if runner.device.type == "cuda":
        try:
            from tts_engine.gpu import backend as gpu_backend
        except ImportError as e:
            log.info("tts_engine: no GPU fast paths (%s); the eager / CUDA graph path serves", e)
            return None
        try:
            got = gpu_backend.attach(runner)
        except Exception as e:   # a fast path that fails to attach must not fail the engine
            log.warning("tts_engine: GPU fast paths not attached, the eager / CUDA graph path serves: %s",
                        f"{type(e).__name__}: {e}".splitlines()[0][:300])
            return None
        if got is not None:
            runner.backend = got
            runner.path_entries["gpu frame"] = got   # (live: `entry()`)
        return got
    return None
