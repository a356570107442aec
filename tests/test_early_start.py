"""A click's generation starts from whichever reaches the server first: the page player's own request
(`POST /live/{token}` with the form values) or the Gradio event (ui/early_start.py). The app on tiny checkpoints,
served as `python app.py` serves it, driven by httpx (the player's request) and gradio_client (the Gradio event,
with its own session hash): one engine request per click either way, the streamed PCM equals the final WAV the
event reports, bad input gives the same message on both sides, another session cannot attach, Stop ends a run the
player started, and values that need Gradio's upload handling wait for the event (the player's request is told
so at once and reads the event's run with a GET). Also: a click made while the
model still loads in the background reports "Loading the … model" and then plays."""
from __future__ import annotations

import secrets
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

TEXT = "Hello there. This is a short test."
LONG = " ".join(f"This is sentence number {i}, which keeps the engine busy for a while." for i in range(12))


def _form(text=TEXT, seed=7, randomize=False, max_new=24):
    """The Preset tab's form values in the order of its inputs (without the token), as the page sends them."""
    return [text, "ryan", "auto", "", None, seed, randomize, 0.9, 50, 1.0, 1.05, max_new, 1.0]


def _token() -> str:
    return secrets.token_hex(16)


def _app(tmp, preload=True):
    from serving.limits import Limits
    from ui import AppConfig, TTSApp

    app = TTSApp(AppConfig(tiny=True, device="cpu", cache_dir=tmp,
                           checkpoints={"custom_voice": "x", "base": "", "voice_design": ""},
                           limits=Limits(max_new_tokens=200, max_text_chars=2000)))
    if preload:
        app.preload()
    return app


def _count_requests(app) -> list:
    """Patch the engine so that every engine request is recorded."""
    eng = app.engine("custom_voice")
    calls = []
    orig = eng.stream

    def stream(*a, **kw):
        calls.append(time.monotonic())
        return orig(*a, **kw)
    eng.stream = stream
    return calls


def _serve(app):
    from gradio_client import Client

    from tests.live_server import serve
    from ui.server import create_server

    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=16)
    ctx = serve(create_server(app, demo))
    url = ctx.__enter__()
    client = Client(url + "/", verbose=False)
    return ctx, url, client


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app = _app(tmp_path_factory.mktemp("early"))
    calls = _count_requests(app)
    ctx, url, client = _serve(app)
    yield app, url, client, calls
    client.close()
    ctx.__exit__(None, None, None)
    app.close()


def _post(url, token, session, form, api="preset", out=None, timeout=60):
    """The player's request: -> (status, body bytes); `out` (a dict) receives them when run in a thread."""
    with httpx.stream("POST", f"{url}/live/{token}", params={"session": session, "api": api},
                      json={"data": form}, timeout=timeout) as r:
        body = b"".join(r.iter_raw())
    if out is not None:
        out["status"], out["body"] = r.status_code, body
    return r.status_code, body


def _in_thread(fn, *a, **kw):
    out = {}
    t = threading.Thread(target=lambda: fn(*a, out=out, **kw), daemon=True)
    t.start()
    return t, out


def _wait(cond, timeout=30.0, what="a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _event(client, token, text=TEXT, seed=7, randomize=False, max_new=24):
    """The Gradio event of the same click (gradio_client leaves out gr.State inputs)."""
    return client.predict(text, "ryan", "auto", "", seed, randomize, 0.9, 50, 1.0, 1.05, max_new, 1.0, token,
                          api_name="/preset")


def _wav_pcm(path) -> bytes:
    audio, sr = sf.read(path, dtype="int16")
    assert sr == 24000
    return audio.astype("<i2").tobytes()


def test_the_players_request_starts_it_and_the_event_reports(served):
    app, url, client, calls = served
    n = len(calls)
    tok, session = _token(), client.session_hash
    t, out = _in_thread(_post, url, tok, session, _form())
    _wait(lambda: len(calls) == n + 1, what="the player's request to start the engine request")
    final = _event(client, tok)                       # the Gradio event comes later and only reports
    t.join(60)
    assert out["status"] == 200 and len(out["body"]) > 4800
    assert len(calls) == n + 1, "one engine request for the click"
    wav, status, seed = final[1], final[2], final[3]
    assert _wav_pcm(wav) == out["body"], "the event's lossless WAV is the audio the player streamed"
    assert status.startswith("**Done**") and seed == 7
    _wait(lambda: len(app.live) == 0 and len(app.early) == 0, 5, "nothing left behind")


def test_the_event_first_then_the_players_request_reads(served):
    app, url, client, calls = served
    n = len(calls)
    tok, session = _token(), client.session_hash
    job = client.submit(TEXT, "ryan", "auto", "", 3, False, 0.9, 50, 1.0, 1.05, 24, 1.0, tok, api_name="/preset")
    _wait(lambda: len(calls) == n + 1, what="the event to start the engine request")
    status, body = _post(url, tok, session, _form(seed=3))
    final = job.result(timeout=60)
    assert status == 200 and len(calls) == n + 1, "the late request read the event's run, it started none"
    assert _wav_pcm(final[1]) == body


def test_bad_input_gets_the_same_message_on_both_sides(served):
    app, url, client, calls = served
    n = len(calls)
    tok, session = _token(), client.session_hash
    status, body = _post(url, tok, session, _form(text="   "))
    assert status == 422 and b"enter some text" in body.lower()
    with pytest.raises(Exception) as e:
        _event(client, tok, text="   ")
    assert "enter some text" in str(e.value).lower()
    assert len(calls) == n


def test_another_session_cannot_attach(served):
    app, url, client, calls = served
    n = len(calls)
    tok = _token()
    t, out = _in_thread(_post, url, tok, "someone-else", _form(seed=5))
    _wait(lambda: len(calls) == n + 1, what="the run of the other session")
    final = _event(client, tok, seed=5)               # the client's session is not "someone-else"
    t.join(60)
    assert len(calls) == n + 2, "the event made its own run instead of reporting another session's"
    assert out["status"] == 200 and len(out["body"]) > 4800   # the other session's stream was not disturbed
    assert final[2].startswith("**Done**")


def test_stop_ends_a_run_the_player_started(served):
    app, url, client, calls = served
    n = len(calls)
    tok, session = _token(), client.session_hash
    t, out = _in_thread(_post, url, tok, session, _form(text=LONG, max_new=200))
    _wait(lambda: len(calls) > n, what="the run to start")
    time.sleep(0.5)
    client.predict(api_name="/stop")
    t.join(30)
    assert not t.is_alive() and out["status"] == 200
    _wait(lambda: app.engine("custom_voice").scheduler.idle(), 10, "the engine to be idle after Stop")
    # twelve sentences at up to 200 frames each would be far longer than what came before Stop
    assert len(out["body"]) / 2 / 24000 < 60


def test_a_request_that_may_not_start_it_is_told_at_once_and_reads_the_events_run(served):
    """The page holds the click's Gradio event until its stream request has audio (assets/live_player.js): a stream
    request that may not start the run must answer at once (202) instead of waiting for that event."""
    app, url, client, calls = served
    n = len(calls)
    tok, session = _token(), client.session_hash
    t0 = time.monotonic()
    status, body = _post(url, tok, session, _form()[:-1], timeout=10)   # values that do not match the endpoint
    assert status == 202 and b'"started":false' in body.replace(b" ", b""), (status, body)
    assert time.monotonic() - t0 < 5 and len(calls) == n, "answered without waiting, nothing started"
    t, out = _in_thread(_get, url, tok, session)                        # the page then reads with a GET
    final = _event(client, tok)                                         # and sends the event
    t.join(60)
    assert out["status"] == 200 and _wav_pcm(final[1]) == out["body"] and len(calls) == n + 1


def _get(url, token, session, out=None, timeout=60):
    with httpx.stream("GET", f"{url}/live/{token}", params={"session": session}, timeout=timeout) as r:
        body = b"".join(r.iter_raw())
    out["status"], out["body"] = r.status_code, body


def test_values_that_need_gradio_wait_for_the_event(served):
    app, _url, _client, _calls = served
    started, why = app.early.start("preset", _token(), "s", _form()[:-1])
    assert not started and "match" in why
    started, why = app.early.start("nope", _token(), "s", _form())
    assert not started
    if "clone" in app.early._apis:
        form = [{"path": "/etc/passwd"}] + [None] * (len(app.early._apis["clone"][1]) - 2)
        started, why = app.early.start("clone", _token(), "s", form)
        assert not started and "upload" in why


def test_a_click_while_the_model_loads_reports_it_and_then_plays(tmp_path):
    app = _app(tmp_path, preload=False)
    load = app.models.loader._load

    gate = threading.Event()

    def slow_load(role):                      # loading takes until the test lets it finish
        gate.wait(60)
        return load(role)
    app.models.loader._load = slow_load
    app.load_in_background()
    ctx, url, client = _serve(app)
    try:
        snap = httpx.get(url + "/live/models").json()
        assert snap["loading"] and not snap["ready"] and "Loading the CustomVoice model" in snap["summary"]
        tok = _token()
        t, out = _in_thread(_post, url, tok, client.session_hash, _form())
        job = client.submit(TEXT, "ryan", "auto", "", 7, False, 0.9, 50, 1.0, 1.05, 24, 1.0, tok,
                            api_name="/preset")
        statuses = []
        for u in job:
            statuses.append(u[2])
            if "Loading the CustomVoice model: step" in u[2] and not gate.is_set():
                time.sleep(0.5)
                assert not out, "nothing may stream before the model is ready"
                gate.set()
        final = job.result(timeout=120)
        t.join(60)
        assert any("Loading the CustomVoice model: step" in s for s in statuses), statuses
        assert final[2].startswith("**Done**")
        assert out["status"] == 200 and _wav_pcm(final[1]) == out["body"]
        _wait(lambda: httpx.get(url + "/live/models").json()["ready"], 60, "every model to be ready")
        assert "Models ready: CustomVoice" in httpx.get(url + "/live/models").json()["summary"]
    finally:
        gate.set()
        client.close()
        ctx.__exit__(None, None, None)
        app.close()


def test_design_and_blend_start_early_too(served):
    app, url, client, _calls = served
    session = client.session_hash
    speakers = app.models.speakers()
    a, b = speakers[0], speakers[1 % len(speakers)]
    cases = {
        # Voice design: text, description, language, seed, randomize, sampling..., max frames, speed
        "design": ([TEXT, "A calm, low voice.", "auto", 11, False, 0.9, 50, 1.0, 1.05, 24, 1.0],
                   dict(text=TEXT, description="A calm, low voice.", language="auto", seed=11, randomize=False,
                        max_new_tokens=24)),
        # Blend: text, n, four (voice, file, weight) slots, A-to-B, language, session, seed, randomize, ...
        "blend": ([TEXT, 2, a, None, 50, b, None, 50, a, None, 50, b, None, 50, 30, "auto", None, 11, False,
                   0.9, 50, 1.0, 1.05, 24, 1.0],
                  dict(text=TEXT, n_voices=2, voice_1=a, voice_2=b, voice_3=a, voice_4=b, a_to_b=30,
                       language="auto", seed=11, randomize=False, max_new_tokens=24)),
    }
    for api, (form, kwargs) in cases.items():
        tok = _token()
        t, out = _in_thread(_post, url, tok, session, form, api=api)
        _wait(lambda: any(r.token == tok for r in list(app.early._runs.values())), 10, f"{api} to start early")
        final = client.predict(**kwargs, live_token=tok, api_name=f"/{api}")
        t.join(60)
        assert out["status"] == 200, (api, out)
        assert _wav_pcm(final[1]) == out["body"], api
        assert final[2].startswith("**Done**"), final[2]
