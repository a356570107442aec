"""Reference-audio input: reading any audio the user gives us, safely, as float32 mono.

Accepted: a file path, the raw bytes of an audio file, or an array with its rate as (np.ndarray, sr) or
Gradio's (sr, np.ndarray). Multi-channel audio is averaged to mono (as the official wrapper); integer PCM is
scaled to [-1, 1]. Every failure is a `TTSError` with a readable message.
"""
from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np

from .errors import TTSError

MIN_SR, MAX_SR = 4000, 384000


def _to_float_mono(a: np.ndarray, channels_last: bool = True) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind == "i":
        a = a.astype(np.float32) / float(np.iinfo(a.dtype).max + 1)
    elif a.dtype.kind == "u":
        info = np.iinfo(a.dtype)
        a = (a.astype(np.float32) - (info.max + 1) / 2) / ((info.max + 1) / 2)
    elif a.dtype.kind != "f":
        raise TTSError("the audio samples are not numbers")
    a = a.astype(np.float32)
    if a.ndim == 2:
        # (samples, channels) from soundfile/Gradio; (channels, samples) when the first axis is tiny
        a = a.mean(axis=-1) if (channels_last and a.shape[1] <= 8) or a.shape[0] > a.shape[1] else a.mean(axis=0)
    elif a.ndim != 1:
        raise TTSError(f"audio must be mono or multi-channel samples, got an array of shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def load_audio(source) -> tuple[np.ndarray, int]:
    """-> (float32 mono waveform, sample rate)."""
    if isinstance(source, tuple) and len(source) == 2:
        a, b = source
        if isinstance(a, (int, np.integer)) and isinstance(b, np.ndarray):
            a, b = b, a  # Gradio's (sr, array)
        if not isinstance(a, np.ndarray):
            raise TTSError("audio tuples must be (array, sample_rate)")
        wav, sr = _to_float_mono(a), int(b)
    elif isinstance(source, (bytes, bytearray)):
        wav, sr = _read(io.BytesIO(bytes(source)), "the uploaded audio")
    elif isinstance(source, (str, Path)):
        p = Path(source)
        if not p.is_file():
            raise TTSError(f"audio file not found: {p.name}")
        wav, sr = _read(p, p.name)
    else:
        raise TTSError("unsupported audio input: give a file, its bytes, or (array, sample_rate)")
    if not (MIN_SR <= sr <= MAX_SR):
        raise TTSError(f"unsupported sample rate {sr} Hz")
    if wav.size == 0:
        raise TTSError("the audio is empty")
    if not np.isfinite(wav).all():
        raise TTSError("the audio contains invalid (NaN or infinite) samples")
    return wav, sr


def _read(f, name: str) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:
        a, sr = sf.read(f, dtype="float32", always_2d=False)
        return _to_float_mono(a), int(sr)
    except Exception:
        pass
    try:  # formats libsndfile cannot read (mp3, m4a...): librosa via audioread/ffmpeg
        import librosa

        if isinstance(f, io.BytesIO):
            f.seek(0)
        a, sr = librosa.load(f, sr=None, mono=True)
        return _to_float_mono(a), int(sr)
    except Exception:
        raise TTSError(f"{name} is not a readable audio file") from None


@functools.lru_cache(maxsize=16)
def get_resampler(orig_sr: int, target_sr: int):
    """A resampling function for one rate pair (bounded cache); librosa's default (soxr_hq), as the official."""
    import librosa

    def run(wav: np.ndarray) -> np.ndarray:
        return librosa.resample(y=wav.astype(np.float32), orig_sr=orig_sr, target_sr=target_sr)

    return run


def resample(wav: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    if orig_sr == target_sr:
        return wav
    return get_resampler(int(orig_sr), int(target_sr))(wav)


def duration_seconds(wav: np.ndarray, sr: int) -> float:
    return float(len(wav)) / float(sr)


def trim_reference(wav: np.ndarray, sr: int, max_seconds: float) -> tuple[np.ndarray, bool]:
    """Keep the first `max_seconds` of a reference clip; says whether it cut anything."""
    n = int(max_seconds * sr)
    return (wav[:n], True) if len(wav) > n else (wav, False)
