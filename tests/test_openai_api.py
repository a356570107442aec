"""The OpenAI-compatible speech API, driven by the official `openai` client against a server on loopback."""
from __future__ import annotations

import base64
import io
import time

import numpy as np
import openai
import pytest
import soundfile as sf

from serving.limits import Limits
from tests.live_server import tiny_api



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = Limits(max_text_chars=300, max_new_tokens=12, max_per_client=8)
    with tiny_api(tmp_path_factory.mktemp("api"), ("custom_voice", "base", "voice_design"), limits) as (url, registry, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        yield client, registry, int(url.rsplit(":", 1)[1])


def _wav(data: bytes):
    wav, sr = sf.read(io.BytesIO(data))
    return wav, sr


def test_preset_voice_wav_flac_pcm_mp3(server):
    client, _, _ = server
    for fmt in ("wav", "flac", "mp3"):
        r = client.audio.speech.create(model="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", voice="ryan",
                                       input="Hello from the API.", response_format=fmt)
        wav, sr = _wav(r.content)
        assert sr == 24000 and len(wav) > 0
    r = client.audio.speech.create(model="tts", voice="vivian", input="Raw samples.", response_format="pcm")
    assert len(r.content) % 2 == 0 and len(r.content) % (1920 * 2) == 0 and len(r.content) > 0


def test_mp3_without_an_mp3_encoder_is_a_clear_400(server, monkeypatch):
    from server import audio_formats

    client, _, _ = server
    monkeypatch.setattr(audio_formats.sf, "available_formats", lambda: {"WAV": "", "FLAC": "", "OGG": ""})
    with pytest.raises(openai.BadRequestError, match="mp3 is not available") as e:
        client.audio.speech.create(model="tts", voice="ryan", input="Hi.", response_format="mp3")
    assert "no MP3 encoder" in str(e.value) and e.value.body["param"] == "response_format"


def test_streaming_sends_audio_as_generated(server):
    client, _, _ = server
    with client.audio.speech.with_streaming_response.create(
            model="tts", voice="aiden", input="Streaming, please.", response_format="wav",
            extra_body={"stream": True, "seed": 3}) as resp:
        assert resp.headers["content-type"].startswith("audio/wav")
        pieces = [p for p in resp.iter_bytes() if p]
    body = b"".join(pieces)
    assert body[:4] == b"RIFF" and len(pieces) >= 1
    pcm = np.frombuffer(body[44:], dtype="<i2")
    assert len(pcm) % 1920 == 0 and len(pcm) > 0


def test_base_clone_from_ref_audio_and_embedding_and_voice_design(server):
    client, registry, _ = server
    t = np.arange(24000) / 24000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24000, format="WAV")
    b64 = "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()
    r = client.audio.speech.create(model="base", voice="x", input="Cloned.", response_format="wav",
                                   extra_body={"task_type": "Base", "ref_audio": b64, "ref_text": "A tone.",
                                               "language": "english"})
    assert _wav(r.content)[1] == 24000
    emb = registry.get("base").voice_from_embedding(np.random.default_rng(0).standard_normal(64)).embedding
    r = client.audio.speech.create(model="base", voice="x", input="From a vector.",
                                   extra_body={"speaker_embedding": emb.tolist(), "x_vector_only_mode": True})
    assert len(_wav(r.content)[0]) > 0
    r = client.audio.speech.create(model="Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign", voice="x", input="Designed.",
                                   extra_body={"instructions": "A calm narrator."})
    assert len(_wav(r.content)[0]) > 0


def test_voices_list(server):
    client, _, port = server
    import httpx

    r = httpx.get(f"http://127.0.0.1:{port}/v1/audio/voices")
    assert r.status_code == 200 and "ryan" in r.json()["voices"]


@pytest.mark.parametrize("kwargs,status,text", [
    (dict(input="   ", voice="ryan"), 400, "empty"),
    (dict(input="x" * 400, voice="ryan"), 400, "limit is 300"),
    (dict(input="Hi", voice="nobody"), 400, "unknown voice"),
    (dict(input="Hi", voice="ryan", speed=4.5), 400, "speed must be between 0.25 and 4.0"),
    (dict(input="Hi", voice="ryan", response_format="mpeg"), 400, "response_format must be one of"),
    (dict(input="Hi", voice="ryan", extra_body={"language": "klingon"}), 400, "unsupported language"),
    (dict(input="Hi", voice="x", extra_body={"ref_audio": "https://example.com/a.wav"}), 400, "URLs"),
    (dict(input="Hi", voice="x", extra_body={"ref_audio": base64.b64encode(b"not audio").decode()}), 400,
     "not a readable audio"),
    (dict(input="Hi", voice="x", extra_body={"speaker_embedding": [1e30] * 64}), 400, "unusable norm"),
    (dict(input="Hi", voice="x", extra_body={"speaker_embedding": [0.1] * 7}), 400, "needs 64"),
])
def test_errors_are_openai_shaped(server, kwargs, status, text):
    client, _, _ = server
    kwargs.setdefault("model", "tts")
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.speech.create(**kwargs)
    e = info.value
    assert e.status_code == status
    body = e.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert text in body["error"]["message"]


def test_disconnect_mid_stream_frees_the_slot(server):
    client, registry, port = server
    import httpx

    eng = registry.get("custom_voice")
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/audio/speech",
                      json={"model": "tts", "voice": "serena", "input": "A long one.", "stream": True,
                            "response_format": "pcm", "max_new_tokens": 12}, timeout=60) as r:
        next(r.iter_bytes())        # got audio, then hang up
    deadline = time.time() + 10
    while eng.scheduler.running and time.time() < deadline:
        time.sleep(0.02)
    assert not eng.scheduler.running and len(eng.scheduler.free_rows) == eng.max_batch


def test_models_list_as_openai_clients_read_it(server):
    """`GET /v1/models` (OpenAI's `client.models.list()`): one entry per configured checkpoint, its id the `model` a
    speech request names."""
    client, registry, _ = server
    got = {m.id: m for m in client.models.list()}
    assert set(got) == {c for c in registry.checkpoints.values() if c}
    for role, ckpt in registry.checkpoints.items():
        if ckpt:
            assert got[ckpt].object == "model" and got[ckpt].owned_by == "qwen3-tts-live"
    ckpt = registry.checkpoints["custom_voice"]
    r = client.audio.speech.create(model=ckpt, voice="ryan", input="Named by its id.", response_format="pcm")
    assert len(r.content) > 0


def test_health_says_what_is_loaded_and_how_full_each_queue_is(server):
    import json
    import urllib.request

    _, registry, port = server
    registry.get("custom_voice")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        assert r.status == 200
        body = json.loads(r.read())
    assert body["status"] == "ok"
    cv = body["engines"]["custom_voice"]
    assert cv["loaded"] is True and cv["model"] == registry.checkpoints["custom_voice"]
    assert cv["running"] == 0 and cv["waiting"] == 0 and cv["max_waiting"] >= 1 and cv["rows"] >= 1
    assert cv["queue_full"] is False and cv["precision"]
    assert set(body["engines"]) == {r for r, c in registry.checkpoints.items() if c}
