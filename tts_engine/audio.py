"""Reference-audio input: reading any audio the user gives us, safely, as float32 mono.

Accepted: a file path (str / Path), the raw bytes of an audio file (or a binary file object), or an array with
its rate as (np.ndarray, sr) or Gradio's (sr, np.ndarray). Multi-channel audio is averaged to mono (as the
official wrapper does); integer PCM is scaled to [-1, 1]. Files are read with soundfile (wav, flac, ogg, mp3,
...) and, failing that, with librosa/audioread (m4a, aac, ... when the program ffmpeg is installed;
without it the message says so).

Every failure is a `TTSError` with a message a person can act on.
"""
from __future__ import annotations

import functools
import io
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from tts_engine.errors import TTSError

MIN_SR, MAX_SR = 4000, 768000
_SF_FAILED = object()


# --- loading ----------------------------------------------------------------------------------------------

def load_audio(source) -> tuple[np.ndarray, int]:
    """-> (float32 mono waveform [S], sample rate). Raises TTSError for anything that is not usable audio."""
    if isinstance(source, tuple):
        wav, sr = _from_array_tuple(source)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise TTSError("the uploaded audio is empty (0 bytes), not a readable audio file")
        wav, sr = _read_bytes(data, "the uploaded audio")
    elif isinstance(source, (str, os.PathLike)):
        if isinstance(source, str) and not source.strip():
            raise TTSError("no audio file was given (empty path)")
        p = Path(source).expanduser()
        if not p.exists():
            raise TTSError(f"audio file not found: {source}")
        if not p.is_file():
            raise TTSError(f"{source} is not a file, not a readable audio file")
        wav, sr = _read_path(p, p.name)
    elif hasattr(source, "read"):
        data = source.read()
        if isinstance(data, str) or not data:
            raise TTSError("the uploaded audio is empty or not binary, not a readable audio file")
        wav, sr = _read_bytes(bytes(data), "the uploaded audio")
    elif isinstance(source, np.ndarray):
        raise TTSError("a bare array has no sample rate: pass (array, sample_rate)")
    else:
        raise TTSError(f"unsupported audio input ({type(source).__name__}): give a file path, its bytes, "
                       "or (array, sample_rate)")
    return _check(wav, sr)


def _check(wav: np.ndarray, sr: int) -> tuple[np.ndarray, int]:
    if not (MIN_SR <= sr <= MAX_SR):
        raise TTSError(f"unsupported sample rate {sr} Hz (expected {MIN_SR}..{MAX_SR} Hz)")
    if wav.size == 0:
        raise TTSError("the audio is empty (no samples)")
    if not np.isfinite(wav).all():
        raise TTSError("the audio contains invalid (NaN or infinite) samples")
    return wav, sr


def _sample_rate(v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TTSError(f"the sample rate must be a number of Hz, got {type(v).__name__}")
    if not math.isfinite(float(v)) or float(v) != int(v):
        raise TTSError(f"unsupported sample rate {v!r} Hz")
    return int(v)


def _from_array_tuple(t: tuple) -> tuple[np.ndarray, int]:
    if len(t) != 2:
        raise TTSError("audio tuples must be (array, sample_rate) or (sample_rate, array)")
    a, b = t
    if isinstance(b, np.ndarray) and not isinstance(a, np.ndarray):
        a, b = b, a  # Gradio's (sr, array)
    if not isinstance(a, np.ndarray):
        raise TTSError("audio tuples must be (array, sample_rate) with a numpy array of samples")
    sr = _sample_rate(b)
    if a.size == 0:
        raise TTSError("the audio is empty (no samples)")
    return _to_float_mono(a, layout="guess"), sr


def _to_float(a: np.ndarray) -> np.ndarray:
    kind = a.dtype.kind
    if kind == "i":
        return (a.astype(np.float64) / float(-np.iinfo(a.dtype).min)).astype(np.float32)
    if kind == "u":
        half = (int(np.iinfo(a.dtype).max) + 1) / 2
        return ((a.astype(np.float64) - half) / half).astype(np.float32)
    if kind == "f":
        return a.astype(np.float32, copy=False)
    raise TTSError(f"the audio samples are not numbers (dtype {a.dtype})")


def _to_float_mono(a: np.ndarray, layout: str) -> np.ndarray:
    """layout: 'frames_channels' (soundfile), or 'guess' for user arrays ((samples, channels) like Gradio,
    or (channels, samples) when the first axis is the short one)."""
    a = _to_float(np.asarray(a))
    if a.ndim == 2:
        if layout == "frames_channels":
            # what librosa.load(mono=True) does: [C, N] then the mean over channels
            a = np.mean(a.T, axis=0)
        elif a.shape[0] < a.shape[1] and a.shape[0] <= 16:
            a = np.mean(a, axis=0)
        else:
            a = np.mean(a, axis=-1)  # the official (array, sr) path
    elif a.ndim != 1:
        raise TTSError(f"audio must be a mono or multi-channel signal, got an array of shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _soundfile(f) -> tuple[np.ndarray, int] | object:
    import soundfile as sf

    try:
        a, sr = sf.read(f, dtype="float32", always_2d=True)
    except Exception:
        return _SF_FAILED
    return _to_float_mono(a, layout="frames_channels"), int(sr)


def _librosa(path: Path, name: str) -> tuple[np.ndarray, int]:
    try:
        import librosa

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, sr = librosa.load(str(path), sr=None, mono=True)
    except Exception:
        if shutil.which("ffmpeg") is None:
            raise TTSError(f"{name} is not a readable audio file: wav, flac, ogg and mp3 are read directly; other "
                           "formats (m4a, aac, webm, ...) need the program `ffmpeg`, which is not installed on "
                           "this server. Convert the clip to wav or flac, or install ffmpeg.") from None
        raise TTSError(f"{name} is not a readable audio file (supported: wav, flac, ogg, mp3, and what ffmpeg "
                       "reads)") from None
    return _to_float_mono(np.asarray(a), layout="frames_channels"), int(sr)


def _read_path(p: Path, name: str) -> tuple[np.ndarray, int]:
    got = _soundfile(str(p))
    return got if got is not _SF_FAILED else _librosa(p, name)


def _read_bytes(data: bytes, name: str) -> tuple[np.ndarray, int]:
    got = _soundfile(io.BytesIO(data))
    if got is not _SF_FAILED:
        return got
    fd, tmp = tempfile.mkstemp(prefix="tts_ref_")   # audioread/ffmpeg want a path
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return _librosa(Path(tmp), name)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


# --- resampling -------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def get_resampler(orig_sr: int, target_sr: int):
    """The resampling function for one rate pair, kept in a bounded cache (16 pairs).

    It is the official call, `librosa.resample(y=wav.astype(np.float32), orig_sr=..., target_sr=...)` with
    librosa's default res_type (soxr_hq): same samples, same length ceil(S * target / orig)."""
    import librosa

    resample_fn = functools.partial(librosa.resample, orig_sr=int(orig_sr), target_sr=int(target_sr))

    def run(wav: np.ndarray) -> np.ndarray:
        try:
            return resample_fn(y=np.asarray(wav).astype(np.float32))
        except Exception as e:  # librosa.ParameterError: non-finite or malformed buffer
            raise TTSError(f"could not resample the audio from {orig_sr} Hz to {target_sr} Hz: {e}") from None

    return run


def resample(wav: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample a mono float waveform; returns `wav` itself when the rates are equal (as the official)."""
    orig_sr, target_sr = _sample_rate(orig_sr), _sample_rate(target_sr)
    if orig_sr <= 0 or target_sr <= 0:
        raise TTSError(f"sample rates must be positive, got {orig_sr} -> {target_sr} Hz")
    if orig_sr == target_sr:
        return wav
    return get_resampler(orig_sr, target_sr)(wav)


# --- helpers for the app / API ----------------------------------------------------------------------------

def duration_seconds(wav: np.ndarray, sr: int) -> float:
    """Length of a mono clip in seconds."""
    if sr <= 0:
        raise TTSError(f"sample rates must be positive, got {sr}")
    return float(len(wav)) / float(sr)


def trim_reference(wav: np.ndarray, sr: int, max_seconds: float | None) -> tuple[np.ndarray, bool]:
    """Keep the first `max_seconds` of a reference clip -> (clip, whether anything was cut).
    `max_seconds` None means no limit."""
    if max_seconds is None:
        return wav, False
    if not (max_seconds > 0):
        raise TTSError(f"the reference length limit must be positive, got {max_seconds}")
    n = int(round(float(max_seconds) * sr))
    return (wav[:n], True) if len(wav) > n else (wav, False)
