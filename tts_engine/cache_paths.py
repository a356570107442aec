"""The project's cache folder, where everything measured or made on this machine is kept: the matmul kernel table
(`kernels/`), the codec decoder's dtype choice (`choices/`), the compiled predictor (`inductor/`), the quality
checks of `--quantize auto` (`quality/`), tiny checkpoints, preset voice prompts, uploaded voices and the
benchmarks' random checkpoints.

$TTS_CACHE_DIR, else $XDG_CACHE_HOME/qwen3-tts-live (~/.cache/qwen3-tts-live). The app's `--cache-dir` sets
TTS_CACHE_DIR for its process (`use`), so every cache follows it, and so do the processes it starts.

What is measured or built per machine (the kernel table, the remembered choices, the quality records, our compiled
C++ libraries: `choices_root`) is worth keeping across restarts: on a Hugging Face Space (SPACE_ID set) with
persistent storage (`/data`, a writable folder) it goes to `/data/qwen3-tts-live` unless TTS_CACHE_DIR names a
folder, so a Space that restarts does not time and compile it all again; a Space without persistent storage keeps
it in the cache folder (lost with the container). Nothing a user uploads goes there."""
from __future__ import annotations

import os
from pathlib import Path

ENV = "TTS_CACHE_DIR"
PERSISTENT = Path("/data")    # Hugging Face Spaces' persistent storage, where the Space has it
SPACE_ENV = "SPACE_ID"        # set by Hugging Face on a Space


def cache_root() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen3-tts-live"


def persistent_root() -> Path | None:
    """/data/qwen3-tts-live on a Space whose persistent storage is mounted and writable, else None."""
    if not os.environ.get(SPACE_ENV) or not PERSISTENT.is_dir() or not os.access(PERSISTENT, os.W_OK | os.X_OK):
        return None
    return PERSISTENT / "qwen3-tts-live"


def choices_root() -> Path:
    """Where measured choices and built libraries are kept: TTS_CACHE_DIR when set, else a Space's persistent
    storage (`persistent_root`), else the cache folder."""
    if os.environ.get(ENV):
        return cache_root()
    return persistent_root() or cache_root()


def use(folder: str | os.PathLike) -> None:
    """Keep this process's caches (and its children's) under `folder`."""
    os.environ[ENV] = str(Path(folder).expanduser())
