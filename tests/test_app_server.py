"""The app's single server: the Gradio UI at / and the OpenAI-compatible speech API at /v1 on the same engines."""
from __future__ import annotations

import io

import httpx
import openai
import pytest
import soundfile as sf
from gradio_client import Client

from app import AppConfig, TTSApp, create_server
from tests.live_server import serve


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    d = tmp_path_factory.mktemp("appserver")
    app = TTSApp(AppConfig(tiny=True, device="cpu", cache_dir=d))
    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=app.limits.max_queue)
    with serve(create_server(app, demo)) as base:
        yield base
    app.close()


def test_ui_and_speech_api_share_one_server(url):
    page = httpx.get(url + "/", timeout=30)
    assert page.status_code == 200 and "gradio" in page.text.lower()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)
    r = client.audio.speech.create(model="tts", voice="ryan", input="From the app's own server.",
                                   response_format="wav", extra_body={"max_new_tokens": 6})
    wav, sr = sf.read(io.BytesIO(r.content))
    assert sr == 24000 and len(wav) > 0
    assert "ryan" in httpx.get(url + "/v1/audio/voices", timeout=30).json()["voices"]


def test_gradio_api_still_works_when_mounted(url):
    c = Client(url + "/", verbose=False)
    out = c.predict(text="Hello through the mounted UI.", voice="ryan", max_new_tokens=6, api_name="/preset")
    assert out[1]  # the lossless WAV
