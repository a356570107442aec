"""Nothing lost at the edges (tiny checkpoints, real servers on loopback): a full queue answers 503 with
`Retry-After` and an OpenAI-shaped body over HTTP; the speech WebSocket and the page say "busy, position N" and
wait instead of failing; a client that hangs up, and the page's Stop, free the stream's row within a frame."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from websockets.sync.client import connect

from serving.busy_line import LINE
from serving.limits import Limits
from tests.live_server import tiny_api, tiny_checkpoint
from tts_engine import EngineBusyError

LONG = 3000         # frames: a tiny random checkpoint never ends its speech, so a request runs this long


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One row, one place in the queue, real-time admission; no take guard (its length bound would end these
    long-running requests, which stand for streams whose listeners are still listening)."""
    from serving.take_guard import TakeGuard

    limits = Limits(max_text_chars=300, max_new_tokens=LONG, max_per_client=8)
    kw = {"max_batch": 1, "max_waiting": 1, "admission": "realtime"}
    with tiny_api(tmp_path_factory.mktemp("adm"), ("custom_voice",), limits, engine_kw=kw,
                  take_guard=TakeGuard(enabled=False)) as (url, registry, _):
        yield url, registry, registry.get("custom_voice")


def _wait(cond, timeout=30.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def _body(**kw):
    return {"model": "tts", "voice": "ryan", "input": "Hello there.", "response_format": "pcm", "stream": True, **kw}


def _idle(eng):
    _wait(lambda: eng.scheduler.idle())


def test_a_full_queue_answers_503_with_retry_after_as_openai_clients_expect(server):
    url, _, eng = server
    _idle(eng)
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=_body(max_new_tokens=LONG), timeout=60) as running:
        audio = running.iter_bytes()                            # (kept: a dropped iterator hangs up)
        next(audio)                                             # the one row is taken
        queued = threading.Thread(target=lambda: httpx.post(f"{url}/v1/audio/speech", timeout=120,
                                                            json=_body(max_new_tokens=4, stream=False)))
        queued.start()
        _wait(lambda: eng.load_state()["waiting"] == 1)         # the one place in the queue is taken
        r = httpx.post(f"{url}/v1/audio/speech", json=_body(max_new_tokens=4), timeout=60)
        assert r.status_code == 503
        retry = int(r.headers["Retry-After"])
        assert 1 <= retry <= 120
        err = r.json()["error"]
        assert err["code"] == "server_busy" and err["type"] == "server_error" and "busy" in err["message"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as info:
            client.audio.speech.create(model="tts", voice="ryan", input="Refused.", response_format="pcm")
        assert info.value.status_code == 503 and info.value.response.headers["Retry-After"]
        health = httpx.get(f"{url}/health").json()
        assert health["queue_full"] is True and health["loaded"] is True
        cv = health["engines"]["custom_voice"]
        assert cv["queue_full"] is True and cv["admission"] == "realtime" and cv["retry_after_s"] >= 1
    queued.join(60)                                            # the queued request was served, not lost
    assert not queued.is_alive()
    _idle(eng)
    assert httpx.get(f"{url}/health").json()["queue_full"] is False


def test_a_client_that_hangs_up_frees_its_row_within_a_frame(server):
    url, _, eng = server
    _idle(eng)
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=_body(max_new_tokens=LONG), timeout=60) as r:
        audio = r.iter_bytes()
        next(audio)
        seq = eng.scheduler.running[0]
        time.sleep(0.2)
        assert eng.scheduler.running == [seq], "still running while the client is connected"
    del audio                                                   # hang up
    t_hangup = time.perf_counter()
    steps = eng.worker.steps
    _wait(lambda: not eng.scheduler.running, timeout=10)
    # freed at the next frame boundary after the server saw the hang-up: long before the stream would end
    assert len(seq.request.codes) < LONG // 2
    assert time.perf_counter() - t_hangup < 5.0
    assert eng.scheduler.counts()["rows"] == 1 and eng.worker.steps - steps < LONG // 2


def test_a_client_that_hangs_up_while_queued_leaves_the_queue(server):
    url, _, eng = server
    _idle(eng)
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=_body(max_new_tokens=LONG), timeout=60) as running:
        audio = running.iter_bytes()
        next(audio)
        with pytest.raises(httpx.ReadTimeout):                  # gives up while queued behind the running stream
            httpx.post(f"{url}/v1/audio/speech", json=_body(max_new_tokens=4), timeout=1.0)
        _wait(lambda: eng.load_state()["waiting"] == 0, timeout=5)
        assert len(eng.scheduler.running) == 1                 # the running stream goes on
        next(audio)


def test_the_websocket_says_busy_with_its_position_and_waits(server):
    url, _, eng = server
    _idle(eng)
    ws_url = url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=_body(max_new_tokens=LONG), timeout=60) as running:
        audio = running.iter_bytes()
        next(audio)
        queued = threading.Thread(target=lambda: httpx.post(f"{url}/v1/audio/speech", timeout=120,
                                                            json=_body(max_new_tokens=4, stream=False)))
        queued.start()
        _wait(lambda: eng.load_state()["waiting"] == 1)
        with connect(ws_url, max_size=None) as ws:
            ws.send(json.dumps({"type": "session.config", "voice": "ryan", "response_format": "pcm",
                                "stream_audio": True, "max_new_tokens": 4}))
            ws.send(json.dumps({"type": "input.text", "text": "Waiting in line."}))
            ws.send(json.dumps({"type": "input.done"}))
            msgs = []
            while True:
                m = ws.recv(timeout=60)
                if isinstance(m, str):
                    msgs.append(json.loads(m))
                    if msgs[-1]["type"] == "busy" and msgs[-1]["position"] == 2:
                        break                                  # the queued request, then us
            running.close()                                    # the running stream ends: the line moves
            while msgs[-1]["type"] != "session.done":
                m = ws.recv(timeout=60)
                if isinstance(m, str):
                    msgs.append(json.loads(m))
        types = [m["type"] for m in msgs]
        assert "error" not in types
        done = [m for m in msgs if m["type"] == "audio.done"]
        assert len(done) == 1 and done[0]["error"] is False and done[0]["total_bytes"] > 0
    queued.join(60)
    assert len(LINE) == 0


# --- the page ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from ui.app import TTSApp
    from ui.config import AppConfig

    d = tmp_path_factory.mktemp("adm_app")
    ck = {"custom_voice": str(tiny_checkpoint(d / "cv", kind="custom_voice", size="0b6", seed=0)), "base": "",
          "voice_design": ""}
    cfg = AppConfig(checkpoints=ck, device="cpu", cache_dir=d / "cache", live_audio=True,
                    limits=Limits(max_text_chars=800, max_new_tokens=LONG, max_queue=1),
                    engine_options={"max_batch": 1})
    a = TTSApp(cfg)
    a.build()
    yield a
    a.close()


def test_the_page_says_busy_with_its_position_and_starts_when_its_turn_comes(app, monkeypatch):
    eng = app.engine("custom_voice")
    assert eng.load_state()["admission"] == "realtime"          # the app's default
    blocker = eng.stream("Running.", voice="ryan", max_new_tokens=LONG)
    next(blocker)
    queued = eng.stream("Queued.", voice="ryan", max_new_tokens=3)
    with pytest.raises(EngineBusyError):                        # the engine's queue is full
        eng.stream("One more.", voice="ryan", max_new_tokens=3)
    gen = app.preset("Me too, please.", "ryan", "auto", "", {}, seed=1, randomize=False, max_new_tokens=3,
                     request=SimpleNamespace(session_hash="busy-page"))
    statuses = []
    for d in gen:
        statuses.append(str(d.get(app.c.status, "")))
        if "Busy, position 2" in statuses[-1]:
            break
    assert len(LINE) == 1
    for _ in range(3):                                          # updates while it waits
        assert "Busy, position 2" in str(next(gen).get(app.c.status, ""))
    blocker.cancel()
    outs = list(gen)
    final = outs[-1]
    assert final[app.c.final] is not None and "Done" in final[app.c.status]
    assert any("Streaming" in str(d.get(app.c.status, "")) for d in outs)
    list(queued)
    assert len(LINE) == 0


def test_stop_on_the_page_frees_the_row_within_a_frame(app):
    eng = app.engine("custom_voice")
    _idle(eng)
    r = SimpleNamespace(session_hash="stop-frame")
    gen = app.preset("A long answer that the listener stops.", "ryan", "auto", "", {}, seed=1, randomize=False,
                     max_new_tokens=LONG, request=r)
    for d in gen:
        if app.c.live in d:
            break
    assert eng.scheduler.running
    real = eng.worker.step
    steps = []

    def counted():                                             # the worker's steps from Stop on
        steps.append(1)
        real()
    eng.worker.step = counted
    try:
        app.stop(r)
        _wait(lambda: not eng.scheduler.running, timeout=10)
        assert len(steps) <= 2      # the step in flight when Stop came, and the next frame boundary frees the row
    finally:
        del eng.worker.step
    assert eng.scheduler.counts()["rows"] == 1
    list(gen)
