"""The remote backend (`app.py --backend URL`) against a second local instance of our own API server."""
from __future__ import annotations

import numpy as np
import pytest

from serving.limits import Limits
from serving.remote_backend import RemoteSpeech, wav_bytes
from tests.live_server import tiny_api
from tts_engine import TTSEngine, TTSError


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    with tiny_api(tmp_path_factory.mktemp("remote"), ["custom_voice", "base"],
                  Limits(max_new_tokens=10, max_per_client=8)) as (url, _, ck):
        yield RemoteSpeech(url), ck


def test_remote_stream_equals_local_engine(remote):
    backend, ck = remote
    chunks = list(backend.stream("Hello over the wire.", voice="ryan", seed=5, max_new_tokens=8))
    remote_wav = np.concatenate(chunks)
    local = TTSEngine.from_pretrained(ck["custom_voice"], device="cpu")
    try:
        local_wav = local.synthesize("Hello over the wire.", voice="ryan", seed=5, max_new_tokens=8)
    finally:
        local.close()
    assert len(remote_wav) == len(local_wav) > 0
    assert np.abs(remote_wav - np.clip(local_wav, -1, 1)).max() <= 1.0 / 32767 + 1e-6   # int16 transport
    assert "ryan" in backend.voices()


def test_remote_clone_and_errors(remote):
    backend, _ = remote
    t = np.arange(24000) / 24000
    ref = wav_bytes((0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24000)
    wav = backend.synthesize("Cloned remotely.", ref_audio=ref, ref_text="A tone.", task_type="Base", max_new_tokens=6)
    assert len(wav) > 0
    with pytest.raises(TTSError, match="unknown voice"):
        backend.stream("Hi", voice="nobody")
    with pytest.raises(TTSError, match="cannot be reached"):
        RemoteSpeech("http://127.0.0.1:9").voices()
