"""Issue 5's bad inputs, each against a launched API server: what the user gets back."""
from __future__ import annotations

import base64
import io
import pickle

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from serving.limits import Limits
from serving.registry import check_name
from tests.live_server import tiny_api
from tts_engine import TTSError
from tts_engine.voices.voice import Voice

LIMITS = Limits(max_text_chars=200, max_new_tokens=4, max_upload_bytes=4 * 2**20, max_reference_seconds=8.0,
                max_per_client=16)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with tiny_api(tmp_path_factory.mktemp("bad"), ["custom_voice", "base"], LIMITS) as (url, _, _):
        yield url


def _clip(seconds: float, sr: int = 24000, channels: int = 1, silent: bool = False, fmt="WAV") -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    x = np.zeros_like(t) if silent else 0.3 * np.sin(2 * np.pi * 220 * t)
    if channels == 2:
        x = np.stack([x, 0.5 * x], axis=1)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sr, format=fmt)
    return buf.getvalue()


def _post(url, **body):
    body.setdefault("model", "tts")
    body.setdefault("input", "Hello there.")
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=120)


def _clone(url, data: bytes, **kw):
    return _post(url, task_type="Base", ref_audio=base64.b64encode(data).decode(), ref_text="A tone.", **kw)


@pytest.mark.parametrize("body,status,text", [
    (dict(input="", voice="ryan"), 400, "empty"),
    (dict(input=" \n\t ", voice="ryan"), 400, "empty"),
    (dict(input="x" * 201, voice="ryan"), 400, "the limit is 200"),
    (dict(voice="ryan", language="elvish"), 400, "unsupported language"),
    (dict(voice="../../etc/passwd"), 400, "no paths"),
])
def test_text_language_voice(api, body, status, text):
    r = _post(api, **body)
    assert r.status_code == status and text in r.json()["error"]["message"]


@pytest.mark.parametrize("data,text", [
    (b"this is not audio at all", "not a readable audio"),
    (_clip(1.0)[:30], "not a readable audio"),                              # a corrupt (truncated) WAV
    (_clip(0.1), "too short"),
    (_clip(1.0, silent=True), "silent"),
])
def test_reference_clips_rejected_clearly(api, data, text):
    r = _clone(api, data)
    assert r.status_code == 400 and text in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("data", [_clip(1.0, channels=2), _clip(1.0, sr=8000), _clip(1.0, sr=44100),
                                  _clip(1.0, sr=96000)])
def test_reference_clips_of_any_layout_work(api, data):
    r = _clone(api, data)
    assert r.status_code == 200 and sf.read(io.BytesIO(r.content))[1] == 24000


def test_long_reference_is_trimmed_with_notice(api):
    r = _clone(api, _clip(20.0, sr=16000))       # 20 s > the 8 s limit of this server (10 min works alike)
    assert r.status_code == 200 and "only its first 8 s" in r.headers["x-notice"]


def test_ten_minute_reference_is_trimmed_with_notice(api):
    r = _clone(api, _clip(600.0, sr=8000, fmt="FLAC"))   # 10 minutes (FLAC keeps the upload small)
    assert r.status_code == 200 and "600.0 s long; only its first 8 s" in r.headers["x-notice"]


def test_oversized_upload_refused_before_reading(api):
    big = base64.b64encode(b"\0" * (6 * 2**20)).decode()
    r = _post(api, task_type="Base", ref_audio=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_voice_files_and_names(tmp_path):
    for bad in ("../x", "a/b", "a\\b", "..", "", " " * 3):
        with pytest.raises(TTSError):
            check_name(bad)
    assert check_name("My voice (2)") == "My voice (2)"
    p = tmp_path / "v.pt"
    p.write_bytes(pickle.dumps({"items": []}))
    with pytest.raises(TTSError, match="pickled"):
        Voice.load(p)
    with pytest.raises(TTSError, match="NaN"):
        Voice(kind="embedding", embedding=torch.tensor([float("inf")] * 64))
