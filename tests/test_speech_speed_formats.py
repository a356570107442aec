"""Issue 16 items 2 and 3: `speed` (a pitch-preserving time stretch), the opus and aac formats, and `speaker` as
another name for `voice`, driven by the official `openai` client against a tiny server on loopback."""
from __future__ import annotations

import io
from pathlib import Path

import librosa
import numpy as np
import openai
import pytest
import soundfile as sf

from server import audio_formats
from serving.limits import Limits
from serving.speed import StreamStretcher, change_speed
from tests.live_server import tiny_api

PRESET = Path(__file__).resolve().parent.parent / "presets" / "emma.flac"


def _f0(wav: np.ndarray, sr: int) -> float:
    f0, voiced, _ = librosa.pyin(wav, fmin=60, fmax=500, sr=sr, frame_length=1024)
    return float(np.nanmedian(f0[voiced]))


def _cents(a: float, b: float) -> float:
    return 1200 * abs(np.log2(b / a))


@pytest.fixture(scope="module")
def speech_clip():
    wav, sr = sf.read(PRESET, dtype="float32", always_2d=True)
    wav = wav.mean(axis=1)[: 4 * sr]                  # 4 s of a preset speaker keep pYIN quick
    return wav, sr, _f0(wav, sr)


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_changes_length_not_pitch(speech_clip, speed):
    wav, sr, f0 = speech_clip
    out = change_speed(wav, sr, speed)
    assert abs(len(out) / len(wav) - 1 / speed) < 0.01
    assert _cents(f0, _f0(out, sr)) < 60                # measured: within 30 cents (pYIN's 10-cent bins)
    assert np.isfinite(out).all() and 0.1 < np.abs(out).max() <= 1.0


def _envelope(y: np.ndarray, hop: int = 480) -> np.ndarray:
    n = len(y) // hop
    return np.sqrt((y[: n * hop].reshape(n, hop) ** 2).mean(axis=1))


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_streamed_stretch_is_gapless_and_keeps_pitch(speech_clip, speed):
    """Chunks as the engine sends them (1, 2, 4, 8, 12 frames, then 12s) through one real-time stretcher: the
    whole is as long as the offline stretch, at the same pitch, and no chunk seam leaves a hole in the speech."""
    wav, sr, f0 = speech_clip
    st, out, i = StreamStretcher(sr, speed), [], 0
    for frames in [1, 2, 4, 8] + [12] * 1000:
        if i >= len(wav):
            break
        n = frames * 640 * sr // 8000          # 80 ms frames at this clip's rate
        out.append(st.push(wav[i:i + n]))
        i += n
    out.append(st.finish())
    y = np.concatenate(out)
    offline = change_speed(wav, sr, speed)
    assert len(y) == round(len(wav) / speed) and abs(len(y) - len(offline)) <= 1
    assert _cents(f0, _f0(y, sr)) < 60
    a, b = _envelope(y), _envelope(offline)
    n = min(len(a), len(b))
    assert np.corrcoef(a[:n], b[:n])[0, 1] > 0.9              # the same words at the same places
    speech = b[:n] > 0.05                                       # where the offline stretch has speech, so does this
    assert a[:n][speech].min() > 0.2 * b[:n][speech].min()


def test_the_pitch_measure_catches_a_plain_resample(speech_clip):
    """What a player's "fast forward" does (resampling) moves the pitch by an octave at 2x: the check above sees it."""
    wav, sr, f0 = speech_clip
    chipmunk = librosa.resample(wav, orig_sr=sr, target_sr=sr // 2)   # half the samples, played at sr
    assert _cents(f0, _f0(chipmunk, sr)) > 1000


def test_speed_out_of_range_is_refused_not_capped():
    with pytest.raises(ValueError, match="between 0.25 and 4.0"):
        change_speed(np.zeros(100, np.float32), 24000, 4.5)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    limits = Limits(max_text_chars=300, max_new_tokens=12, max_per_client=8)
    with tiny_api(tmp_path_factory.mktemp("speed"), ("custom_voice",), limits) as (url, registry, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        c.registry = registry
        yield c


def _say(client, **kw) -> bytes:
    kw.setdefault("model", "tts-1")
    kw.setdefault("input", "Speed, please.")
    extra = {"seed": 7, **kw.pop("extra_body", {})}
    return client.audio.speech.create(extra_body=extra, **kw).content


@pytest.mark.parametrize("speed", [0.5, 2.0, 4.0])
def test_speed_through_the_openai_client(client, speed):
    plain, sr = sf.read(io.BytesIO(_say(client, voice="ryan", response_format="wav")))
    fast, sr2 = sf.read(io.BytesIO(_say(client, voice="ryan", response_format="wav", speed=speed)))
    assert sr == sr2 == 24000
    assert abs(len(fast) / len(plain) - 1 / speed) < 0.01


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_streamed_speed_through_the_openai_client(client, speed):
    plain = np.frombuffer(_say(client, voice="ryan", response_format="pcm"), "<i2")
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="ryan", input="Speed, please.", response_format="pcm", speed=speed,
            extra_body={"stream": True, "seed": 7}) as r:
        body = b"".join(r.iter_bytes())
    streamed = np.frombuffer(body, "<i2")
    assert len(streamed) == round(len(plain) / speed)


def test_opus_is_ogg_opus_at_24k(client):
    body = _say(client, voice="ryan", response_format="opus")
    assert body[:4] == b"OggS" and b"OpusHead" in body[:64]
    wav, sr = sf.read(io.BytesIO(body))
    plain, _ = sf.read(io.BytesIO(_say(client, voice="ryan", response_format="wav")))
    assert sr == 24000 and abs(len(wav) - len(plain)) < 0.02 * len(plain) + 960


@pytest.mark.skipif(audio_formats.ffmpeg() is not None, reason="this machine has ffmpeg: aac is served")
def test_aac_without_ffmpeg_is_a_400_that_names_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        _say(client, voice="ryan", response_format="aac")
    err = e.value.body
    assert err["param"] == "response_format" and "ffmpeg" in err["message"] and "opus" in err["message"]


@pytest.mark.skipif(audio_formats.ffmpeg() is None, reason="aac needs ffmpeg on PATH")
def test_aac_with_ffmpeg_is_adts(client):
    body = _say(client, voice="ryan", response_format="aac")
    assert len(body) > 100 and body[0] == 0xFF and body[1] & 0xF0 == 0xF0     # ADTS sync word


def test_speaker_is_another_name_for_voice(client, monkeypatch):
    engine = client.registry.get("custom_voice")
    asked, real = [], engine.stream
    monkeypatch.setattr(engine, "stream", lambda text, **kw: asked.append(kw["voice"]) or real(text, **kw))
    by_voice = _say(client, voice="ryan", response_format="pcm")
    by_speaker = _say(client, voice=openai.NOT_GIVEN, response_format="pcm", extra_body={"speaker": "ryan"})
    _say(client, voice="aiden", response_format="pcm")
    assert by_speaker == by_voice and asked == ["ryan", "ryan", "aiden"]


def test_a_clip_longer_than_rubber_bands_process_limit_is_stretched():
    """Rubber Band takes at most 2^19 samples (~22 s at 24 kHz) per call: a 30 s clip goes in several calls."""
    x = (0.2 * np.sin(2 * np.pi * 180 * np.arange(24000 * 30) / 24000)).astype(np.float32)
    y = change_speed(x, 24000, 1.25)
    assert len(y) == round(len(x) / 1.25) and np.isfinite(y).all()
    assert 0.1 < np.abs(y[len(y) // 2:len(y) // 2 + 24000]).max() <= 1.0   # sound throughout, not silence
