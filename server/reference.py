"""Reference clips from users, checked the same way for the UI and the API."""
from __future__ import annotations

import numpy as np

from tts_engine import TTSError
from tts_engine.audio import duration_seconds, load_audio, trim_reference

from .limits import Limits

SILENCE_PEAK = 1e-3


def prepare_reference(source, limits: Limits) -> tuple[tuple[np.ndarray, int], list[str]]:
    """-> ((wav, sr), notices). Raises TTSError for clips nobody can clone from."""
    wav, sr = load_audio(source)
    notices = []
    dur = duration_seconds(wav, sr)
    if dur < limits.min_reference_seconds:
        raise TTSError(f"the reference clip is too short ({dur:.2f} s); use {limits.min_reference_seconds:g} s "
                       "or more (3-10 s of clear speech works best)")
    wav, trimmed = trim_reference(wav, sr, limits.max_reference_seconds)
    if trimmed:
        notices.append(f"the reference clip was {dur:.1f} s long; only its first "
                       f"{limits.max_reference_seconds:g} s are used")
    if float(np.abs(wav).max()) < SILENCE_PEAK:
        raise TTSError("the reference clip is silent")
    return (wav, sr), notices
