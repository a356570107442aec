"""The project's cache folder, where everything measured or made on this machine is kept: the matmul kernel table
(`kernels/`), the codec decoder's dtype choice (`choices/`), the compiled predictor (`inductor/`), the quality
checks of `--quantize auto` (`quality/`), tiny checkpoints, preset voice prompts, uploaded voices and the
benchmarks' random checkpoints.

$TTS_CACHE_DIR, else $XDG_CACHE_HOME/qwen3-tts-live (~/.cache/qwen3-tts-live). The app's `--cache-dir` sets
TTS_CACHE_DIR for its process (`use`), so every cache follows it, and so do the processes it starts."""
from __future__ import annotations

import os
from pathlib import Path

ENV = "TTS_CACHE_DIR"


def cache_root() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen3-tts-live"


def use(folder: str | os.PathLike) -> None:
    """Keep this process's caches (and its children's) under `folder`."""
    os.environ[ENV] = str(Path(folder).expanduser())
