"""Float32 PCM -> the response formats of the speech API (wav, pcm, flac, mp3). Every format is encoded by
libsndfile (through soundfile; MP3 needs libsndfile >= 1.1, which the soundfile wheels bundle): no ffmpeg."""
from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf

SAMPLE_RATE = 24000
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg"}
STREAMABLE = ("wav", "pcm")


def available_formats() -> list[str]:
    formats = ["wav", "pcm", "flac"]
    if "MP3" in sf.available_formats():
        formats.append("mp3")
    return formats


def to_int16(wav: np.ndarray) -> np.ndarray:
    return (np.clip(wav, -1.0, 1.0) * 32767.0).astype("<i2")


def encode(wav: np.ndarray, fmt: str, sr: int = SAMPLE_RATE) -> bytes:
    if fmt == "pcm":
        return to_int16(wav).tobytes()
    buf = io.BytesIO()
    if fmt == "wav":
        sf.write(buf, wav, sr, format="WAV", subtype="PCM_16")
    elif fmt == "flac":
        sf.write(buf, wav, sr, format="FLAC", subtype="PCM_16")
    elif fmt == "mp3":
        sf.write(buf, wav, sr, format="MP3")
    else:
        raise ValueError(fmt)
    return buf.getvalue()


def streaming_wav_header(sr: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header whose sizes say 'unknown length' (0xFFFFFFFF), for chunked streaming."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sr, sr * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))
