"""Reference-audio I/O (tts_engine.audio): every bad input is a TTSError; layouts, integer PCM, Gradio tuples,
the librosa fallback, resampling (== librosa.resample, bounded cache) and the app helpers."""
from __future__ import annotations

import io
import shutil
import subprocess

import librosa
import numpy as np
import pytest
import soundfile as sf

import tts_engine.audio as audio
from tts_engine.audio import duration_seconds, get_resampler, load_audio, resample, trim_reference
from tts_engine.errors import TTSError


def _tone(n=4800, sr=24000, f=220.0, amp=0.5):
    return (amp * np.sin(2 * np.pi * f * np.arange(n) / sr)).astype(np.float32)


# --- bad input ---------------------------------------------------------------------------------------------

def test_bad_inputs_raise_tts_error(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("this is not audio\n" * 50)
    fake_wav = tmp_path / "fake.wav"                       # a text file with an audio name
    fake_wav.write_text("RIFF? no.")
    empty_wav = tmp_path / "empty.wav"
    sf.write(empty_wav, np.zeros(0, np.float32), 24000)    # a valid header with zero frames
    nan_wav = tmp_path / "nan.wav"
    sf.write(nan_wav, np.full(1000, np.nan, np.float32), 24000, subtype="FLOAT")
    cases = [
        (str(tmp_path / "missing.wav"), "not found"),
        (tmp_path / "missing.flac", "not found"),
        ("", "empty path"),
        (str(tmp_path), "not a file"),
        (str(text), "not a readable audio"),
        (fake_wav, "not a readable audio"),
        (b"", "empty"),
        (b"definitely not audio" * 10, "not a readable audio"),
        (text.read_bytes(), "not a readable audio"),
        (str(empty_wav), "empty"),
        (empty_wav.read_bytes(), "empty"),
        (str(nan_wav), "invalid"),
        ((np.full(100, np.nan, np.float32), 24000), "invalid"),
        ((np.array([0.1, np.inf, 0.0], np.float32), 24000), "invalid"),
        ((np.zeros(0, np.float32), 24000), "empty"),
        ((np.zeros((0, 2), np.float32), 24000), "empty"),
        ((np.zeros(100, np.float32), 10), "sample rate"),
        ((np.zeros(100, np.float32), 10 ** 9), "sample rate"),
        ((np.zeros(100, np.float32), 22050.5), "sample rate"),
        ((np.zeros(100, np.float32), float("nan")), "sample rate"),
        ((np.zeros(100, np.float32), True), "sample rate"),
        ((np.zeros(100, np.float32), "24000"), "sample rate"),
        ((np.zeros((2, 3, 100), np.float32), 24000), "shape"),
        ((np.array(["a", "b"]), 24000), "not numbers"),
        (([0.1, 0.2], 24000), "numpy array"),
        ((np.zeros(100, np.float32),), "tuples"),
        (np.zeros(100, np.float32), "sample rate"),
        (12345, "unsupported audio input"),
        (None, "unsupported audio input"),
    ]
    for bad, msg in cases:
        with pytest.raises(TTSError, match=msg):
            load_audio(bad)


# --- layouts and sample formats ----------------------------------------------------------------------------

def test_stereo_becomes_the_channel_mean(tmp_path):
    left, right = _tone(2400, f=200.0), _tone(2400, f=330.0, amp=0.25)
    st = np.stack([left, right], axis=1)                   # (samples, channels), as soundfile and Gradio give
    want = (left + right) / 2
    p = tmp_path / "st.wav"
    sf.write(p, st, 16000, subtype="FLOAT")
    for src in (str(p), p, p.read_bytes(), (st, 16000), (16000, st), (st.T.copy(), 16000)):
        wav, sr = load_audio(src)
        assert sr == 16000 and wav.dtype == np.float32 and wav.shape == (2400,)
        np.testing.assert_allclose(wav, want, atol=1e-7)
    wav, _ = load_audio(str(p))                            # files: exactly what the official librosa.load gives
    np.testing.assert_array_equal(wav, librosa.load(str(p), sr=None, mono=True)[0])


def test_integer_pcm_is_scaled_to_unit_range():
    i16 = np.array([0, 16384, -16384, 32767, -32768], np.int16)
    wav, sr = load_audio((i16, 8000))
    assert sr == 8000 and wav.dtype == np.float32
    np.testing.assert_array_equal(wav, [0.0, 0.5, -0.5, 32767 / 32768, -1.0])
    wav, _ = load_audio((np.array([2 ** 30, -2 ** 31], np.int32), 8000))
    np.testing.assert_array_equal(wav, [0.5, -1.0])
    wav, _ = load_audio((np.array([128, 0, 192], np.uint8), 8000))
    np.testing.assert_array_equal(wav, [0.0, -1.0, 0.5])
    wav, _ = load_audio((np.array([0.25, -0.5], np.float64), 8000))
    assert wav.dtype == np.float32 and wav.tolist() == [0.25, -0.5]


def test_gradio_tuple_order():
    st = (np.stack([_tone(800), _tone(800, f=440.0)], axis=1) * 32767).astype(np.int16)
    a, sr_a = load_audio((24000, st))                       # gr.Audio(type="numpy") gives (sr, int16 [N, C])
    b, sr_b = load_audio((st, 24000))
    c, sr_c = load_audio((np.int64(24000), st))
    assert sr_a == sr_b == sr_c == 24000 and a.shape == (800,)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    mono, _ = load_audio((24000, st[:, 0]))
    np.testing.assert_array_equal(mono, st[:, 0] / np.float32(32768))


def test_bytes_and_file_objects_read_like_paths(tmp_path):
    p = tmp_path / "a.flac"
    sf.write(p, _tone(3000), 22050)
    want, sr = load_audio(str(p))
    assert sr == 22050
    for src in (p.read_bytes(), bytearray(p.read_bytes()), io.BytesIO(p.read_bytes())):
        wav, sr2 = load_audio(src)
        assert sr2 == 22050
        np.testing.assert_array_equal(wav, want)


def test_librosa_fallback_when_soundfile_cannot_read(tmp_path, monkeypatch):
    p = tmp_path / "a.wav"
    sf.write(p, _tone(2000), 24000)
    monkeypatch.setattr(audio, "_soundfile", lambda f: audio._SF_FAILED)
    for src in (str(p), p.read_bytes()):
        wav, sr = load_audio(src)
        assert sr == 24000
        np.testing.assert_allclose(wav, _tone(2000), atol=1e-4)   # PCM_16 round trip
    with pytest.raises(TTSError, match="not a readable audio"):
        load_audio(b"still not audio")


# the first bytes of an AAC .m4a file (an MP4 'ftyp' box): neither libsndfile nor audioread without ffmpeg reads it
M4A_HEAD = b"\x00\x00\x00\x20ftypM4A \x00\x00\x02\x00M4A isomiso2\x00\x00\x00\x08free" + bytes(200)


def test_m4a_without_ffmpeg_names_the_missing_program(tmp_path, monkeypatch):
    p = tmp_path / "clip.m4a"
    p.write_bytes(M4A_HEAD)
    monkeypatch.setattr(audio.shutil, "which", lambda name: None)          # as on a machine without ffmpeg
    for src in (str(p), p.read_bytes()):
        with pytest.raises(TTSError, match="not a readable audio") as e:
            load_audio(src)
        assert "`ffmpeg`" in str(e.value) and "not installed" in str(e.value)
    monkeypatch.setattr(audio.shutil, "which", lambda name: "/usr/bin/" + name)   # ffmpeg there: plain message
    with pytest.raises(TTSError, match="not a readable audio") as e:
        load_audio(b"still not audio" * 20)
    assert "not installed" not in str(e.value)


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg not installed")
def test_m4a_through_ffmpeg(tmp_path):
    src, dst = tmp_path / "a.wav", tmp_path / "a.m4a"
    sf.write(src, _tone(24000), 24000)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(src), str(dst)], check=True, timeout=60)
    for s in (str(dst), dst.read_bytes()):
        wav, sr = load_audio(s)
        assert sr == 24000 and wav.dtype == np.float32 and abs(len(wav) - 24000) < 2048


# --- resampling -------------------------------------------------------------------------------------------

def test_resample_is_the_official_librosa_call():
    x = (np.random.default_rng(0).standard_normal(16001) * 0.1).astype(np.float32)
    for orig, target in ((16000, 24000), (44100, 24000), (24000, 16000), (22050, 24000)):
        y = resample(x, orig, target)
        assert y.dtype == np.float32 and len(y) == int(np.ceil(len(x) * target / orig))
        np.testing.assert_array_equal(y, librosa.resample(y=x.astype(np.float32), orig_sr=orig, target_sr=target))
    assert resample(x, 24000, 24000) is x
    np.testing.assert_array_equal(resample(x.astype(np.float64), 16000, 24000), resample(x, 16000, 24000))
    with pytest.raises(TTSError):
        resample(x, 0, 24000)
    with pytest.raises(TTSError):
        resample(np.array([np.nan, 0.0, 0.1] * 100, np.float32), 16000, 24000)


def test_resampler_cache_is_bounded():
    assert get_resampler.cache_info().maxsize == 16
    assert get_resampler(16000, 24000) is get_resampler(16000, 24000)
    x = _tone(1000)
    for sr in range(8000, 8000 + 40 * 100, 100):           # 40 distinct rate pairs
        resample(x, sr, 24000)
    assert get_resampler.cache_info().currsize <= 16
    assert get_resampler(8000 + 39 * 100, 24000) is get_resampler(8000 + 39 * 100, 24000)


# --- helpers ----------------------------------------------------------------------------------------------

def test_duration_and_trim():
    wav = _tone(24000 * 3)
    assert duration_seconds(wav, 24000) == 3.0
    cut, trimmed = trim_reference(wav, 24000, 2.5)
    assert trimmed and len(cut) == 60000 and np.shares_memory(cut, wav)
    same, trimmed = trim_reference(wav, 24000, 3.0)
    assert not trimmed and same is wav
    assert trim_reference(wav, 24000, None) == (wav, False)
    with pytest.raises(TTSError):
        trim_reference(wav, 24000, 0)
    with pytest.raises(TTSError):
        duration_seconds(wav, 0)
