"""Float32 PCM -> the response formats of the speech API (wav, pcm, flac, mp3, opus, aac).

wav, pcm, flac, mp3 and opus (in Ogg) are encoded by libsndfile through soundfile (MP3 needs libsndfile >= 1.1,
Opus >= 1.0.29; the soundfile wheels bundle 1.2). aac (ADTS) is encoded by ffmpeg, and only where an `ffmpeg`
executable is on PATH (the Docker image has one); without it `aac` is refused with a message that says so."""
from __future__ import annotations

import io
import shutil
import struct
import subprocess

import numpy as np
import soundfile as sf

SAMPLE_RATE = 24000
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg", "aac": "audio/aac"}
ALL_FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac")
STREAMABLE = ("wav", "pcm")


class FormatUnavailable(Exception):
    """A known format this server cannot encode; the message says what it needs."""


def ffmpeg() -> str | None:
    return shutil.which("ffmpeg")


def unavailable_reason(fmt: str) -> str | None:
    """None when `fmt` can be encoded here, else why not (for a 400 that names what is missing)."""
    if fmt == "mp3" and "MP3" not in sf.available_formats():
        return ("response_format mp3 is not available on this server: its libsndfile has no MP3 encoder "
                "(libsndfile 1.1 or newer, as in the soundfile wheels, has one). Use wav, pcm, flac or opus.")
    if fmt == "opus" and "OPUS" not in sf.available_subtypes("OGG"):
        return ("response_format opus is not available on this server: its libsndfile has no Opus encoder "
                "(libsndfile 1.0.29 or newer has one). Use wav, pcm or flac.")
    if fmt == "aac" and ffmpeg() is None:
        return ("response_format aac needs ffmpeg, and this server has no ffmpeg on its PATH. Install ffmpeg, "
                "or use wav, pcm, flac, mp3 or opus (opus is the compressed format served without ffmpeg).")
    return None


def available_formats() -> list[str]:
    return [f for f in ALL_FORMATS if unavailable_reason(f) is None]


def to_int16(wav: np.ndarray) -> np.ndarray:
    return (np.clip(wav, -1.0, 1.0) * 32767.0).astype("<i2")


def encode(wav: np.ndarray, fmt: str, sr: int = SAMPLE_RATE) -> bytes:
    if fmt == "pcm":
        return to_int16(wav).tobytes()
    if fmt == "aac":
        return _aac(wav, sr)
    buf = io.BytesIO()
    if fmt == "wav":
        sf.write(buf, wav, sr, format="WAV", subtype="PCM_16")
    elif fmt == "flac":
        sf.write(buf, wav, sr, format="FLAC", subtype="PCM_16")
    elif fmt == "mp3":
        sf.write(buf, wav, sr, format="MP3")
    elif fmt == "opus":          # Opus takes 8/12/16/24/48 kHz: 24 kHz as generated
        sf.write(buf, wav, sr, format="OGG", subtype="OPUS")
    else:
        raise ValueError(fmt)
    return buf.getvalue()


def _aac(wav: np.ndarray, sr: int) -> bytes:
    exe = ffmpeg()
    if exe is None:
        raise FormatUnavailable(unavailable_reason("aac"))
    cmd = [exe, "-hide_banner", "-loglevel", "error", "-f", "s16le", "-ar", str(sr), "-ac", "1", "-i", "pipe:0",
           "-c:a", "aac", "-b:a", "64k", "-f", "adts", "pipe:1"]
    try:
        done = subprocess.run(cmd, input=to_int16(wav).tobytes(), capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FormatUnavailable(f"ffmpeg could not encode aac: {e}") from None
    if done.returncode != 0 or not done.stdout:
        raise FormatUnavailable("ffmpeg could not encode aac: " + done.stderr.decode(errors="replace")[-300:])
    return done.stdout


def streaming_wav_header(sr: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header whose sizes say 'unknown length' (0xFFFFFFFF), for chunked streaming."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sr, sr * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))
