"""Reference clips from users, checked the same way for the UI and the API."""
from __future__ import annotations

import numpy as np

from tts_engine import TTSError
from tts_engine.audio import duration_seconds, load_audio, trim_reference

from serving.limits import Limits

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


def transcribe_reference(ref: tuple[np.ndarray, int], device=None,
                         language: str | None = None) -> tuple[str | None, list[str]]:
    """The words of a reference clip by the speech-recognition model (tts_engine/asr.py), for a caller that sent
    `ref_audio` without `ref_text` and asked for a transcript -> (text or None, notices). Without the model (or
    without words) the clone falls back to x-vector only, with a notice saying why."""
    from tts_engine import asr

    try:
        text = asr.shared(device=device).transcribe(ref[0], ref[1], language).text
    except TTSError as e:
        return None, [f"no transcript ({e}); cloned x-vector only"]
    if not text:
        return None, ["no words were recognised in ref_audio; cloned x-vector only"]
    return text, ["ref_text transcribed from ref_audio"]
