"""The take guard (serving/take_guard.py): length bound, transcript check, redo with another seed, best of N; on
tiny random checkpoints, which never end speech (every unbounded take is a runaway), and with a stub transcriber
given through `TakeGuard(transcriber=...)`."""
from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from serving import take_guard as tg
from serving.limits import Limits
from serving.take_guard import TakeGuard
from tts_engine import TTSError

SR = 24000
LONG = "This sentence is long enough that its takes are capped by the maximum length the test sets."


class StubTranscriber:
    """Answers each call with the next of `answers` (the last one repeated); records the clips' lengths."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), []

    def transcribe(self, wav, sr, language=None):
        self.calls.append((len(wav), sr, language))
        return SimpleNamespace(text=self.answers[min(len(self.calls), len(self.answers)) - 1])


# --- the checks -------------------------------------------------------------------------------------------------

def test_bound_and_checks():
    assert tg.frame_bound("Hi.") == int(tg.MIN_BOUND_S * tg.FRAME_HZ)
    long = "word " * 60
    assert tg.frame_bound(long) == int(np.ceil((2.0 + 2.5 * len(long) / 14.0) * 12.5))
    assert tg.frame_bound(long, 40) == 40
    g = TakeGuard()
    run = g.check(np.zeros(49 * 1920, np.float32), "Hi.", seed=1, limit=500, frames=49)
    assert run.problem == "runaway" and not run.ok and "runaway, cut at 3.9 s" in run.describe()
    capped = g.check(np.zeros(39 * 1920, np.float32), "Hi.", seed=1, limit=40, frames=39)
    assert capped.ok and capped.capped        # the user's own maximum: not judged on length
    short = g.check(np.zeros(1920, np.float32), long, seed=1, limit=2000, frames=1)
    assert short.problem == "too short"
    ok = g.check(np.zeros(30 * 1920, np.float32), "Hello there, how are you?", seed=1, limit=500, frames=30)
    assert ok.ok and ok.header().startswith("pass,seed=1,")
    t = TakeGuard(transcriber=StubTranscriber("hello there how are you"))
    assert t.check(np.zeros(30 * 1920, np.float32), "Hello there, how are you?", 1, 500, 30).cer == 0.0
    t = TakeGuard(transcriber=lambda wav, sr, lang: "completely unrelated words")   # a plain function works too
    bad = t.check(np.zeros(30 * 1920, np.int16), "Hello there, how are you?", 1, 500, 30)
    assert bad.problem == "transcript" and bad.cer > tg.MAX_CER
    assert tg.char_error_rate("Hello, World!", "hello world") == 0.0
    with pytest.raises(TTSError, match="between 0 and 5"):
        TakeGuard(retries=9)
    with pytest.raises(TTSError, match="between 1 and 5"):
        TakeGuard(best_of=0)
    assert len({TakeGuard.next_seed(7, k) for k in range(4)}) == 4


def test_the_servers_whisper_checks_takes_when_asked(asr_env, monkeypatch):
    monkeypatch.setenv(tg.ASR_ENV, "1")
    guard = TakeGuard.from_env()
    assert guard.transcriber is asr_env.shared()
    rng = np.random.default_rng(0)
    c = guard.check((rng.standard_normal(30 * 1920) * 0.1).astype(np.float32), "Hello there, how are you?", 1, 500,
                    30, language="english")
    # a random tiny Whisper writes anything but the text: the transcript check runs and fails the take
    assert c.cer is not None and c.transcript is not None and (c.problem == "transcript") == (c.cer > tg.MAX_CER)
    monkeypatch.delenv(tg.ASR_ENV)
    assert TakeGuard.from_env().transcriber is None


# --- on an engine -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_cv_folder):
    from tts_engine import TTSEngine

    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=2)
    yield eng
    eng.close()


def _submit(engine, text):
    return lambda seed, bound: engine.stream(text, voice="ryan", language="english", seed=seed,
                                             max_new_tokens=bound, first_chunk_frames=(1, 1))


def _idle(engine, wait=10.0) -> bool:
    deadline = time.monotonic() + wait
    while not engine.scheduler.idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.scheduler.idle()


def test_a_runaway_is_cut_at_the_bound_flagged_redone_and_frees_its_slot(engine):
    limit = 400                                    # the frame limit a runaway would otherwise run to
    takes = TakeGuard(retries=2).stream(_submit(engine, "Hi."), "Hi.", seed=11, limit=limit, language="english")
    items = list(takes)
    redos = [x for x in items if isinstance(x, tg.Redo)]
    audio = [x for x in items if not isinstance(x, tg.Redo)]
    bound = tg.frame_bound("Hi.", limit)
    assert bound < limit
    assert [c.problem for c in takes.checks] == ["runaway"] * 3 and len(redos) == 2
    assert [c.seed for c in takes.checks] == [TakeGuard.next_seed(11, k) for k in range(3)]
    assert all(c.frames == bound - 1 for c in takes.checks)        # cut at the bound, far before the limit
    assert sum(map(len, audio)) == 3 * (bound - 1) * 1920
    assert "still failing after 3 takes" in takes.summary() and "runaway" in takes.summary()
    assert takes.header().startswith("fail=runaway,") and takes.header().endswith("takes=3")
    assert _idle(engine), "the runaway's engine row is free again"


def test_best_of_n_keeps_the_lowest_error(engine):
    stub = StubTranscriber("something else entirely", LONG, "this sentence is long enough")
    takes = TakeGuard(best_of=3, transcriber=stub).stream(_submit(engine, LONG), LONG, seed=3, limit=20)
    audio = list(takes)
    assert len(takes.checks) == 3 and len(stub.calls) == 3
    assert takes.kept is takes.checks[1] and takes.kept.cer == 0.0 and takes.kept.seed == TakeGuard.next_seed(3, 1)
    assert not any(isinstance(x, tg.Redo) for x in audio)
    assert sum(map(len, audio)) == stub.calls[1][0]          # only the kept take is yielded
    assert "best of 3: kept take 2" in takes.summary()
    assert _idle(engine)


# --- the page ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_cv_folder):
    from ui.app import TTSApp
    from ui.config import AppConfig

    cfg = AppConfig(checkpoints={"custom_voice": str(tiny_cv_folder)}, device="cpu",
                    cache_dir=tmp_path_factory.mktemp("guard_app"), live_audio=True,
                    limits=Limits(max_text_chars=800, max_new_tokens=200, max_queue=16))
    a = TTSApp(cfg)
    a.build()
    yield a
    a.close()


def _run(app, text, session, **kw):
    outs = list(app.preset(text, "ryan", "english", "", {}, randomize=False, request=SimpleNamespace(
        session_hash=session), **kw))
    live = [d[app.c.live][1] for d in outs if app.c.live in d]
    return outs, live


def test_page_redoes_a_take_the_transcriber_rejects_and_keeps_the_second(app):
    stub = StubTranscriber("nothing like the text at all", LONG)
    app.take_guard = TakeGuard(retries=2, transcriber=stub)      # the documented way to give the page a transcriber
    try:
        outs, live = _run(app, LONG, "stub", seed=21, max_new_tokens=20)
    finally:
        app.take_guard = TakeGuard.from_env()
    status = outs[-1][app.c.status]
    assert len(stub.calls) == 2
    assert "redone" in status and "transcript off" in status and f"seed {TakeGuard.next_seed(21, 1)}" in status
    assert any("Redoing part 1" in str(d.get(app.c.status, "")) for d in outs)
    wav = outs[-1][app.c.final][1]
    first, second = stub.calls[0][0], stub.calls[1][0]
    # the listener heard both takes; the WAV keeps the second only
    heard = np.concatenate(live)
    assert len(heard) == first + second and len(wav) == second and np.array_equal(wav, heard[first:])


def test_page_runaway_is_flagged_in_the_status_and_redone(app):
    session = SimpleNamespace(session_hash="runaway")
    app.text_settings(None, True, "redo", 1, request=session)
    outs, live = _run(app, "Hi.", "runaway", seed=4)
    status = outs[-1][app.c.status]
    bound = tg.frame_bound("Hi.", 200)
    assert "still failing after 2 takes" in status and "runaway, cut at" in status
    assert len(outs[-1][app.c.final][1]) == (bound - 1) * 1920          # one take, cut at the bound
    assert sum(map(len, live)) == 2 * (bound - 1) * 1920
    assert _idle(app.engine("custom_voice"))
    # off: no bound, the take runs to the maximum length
    app.text_settings(None, True, "off", 0, request=session)
    outs, _ = _run(app, "Hi.", "runaway", seed=4, max_new_tokens=60)
    assert len(outs[-1][app.c.final][1]) == 59 * 1920


# --- the API ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from tests.live_server import tiny_api

    with tiny_api(tmp_path_factory.mktemp("guard_api"), ("custom_voice",),
                  Limits(max_text_chars=300, max_new_tokens=300, max_per_client=8)) as (url, registry, _):
        yield url


def test_api_reports_the_take_check(api):
    body = {"input": "Hi.", "voice": "ryan", "seed": 5, "response_format": "pcm", "take_retries": 1}
    r = httpx.post(f"{api}/v1/audio/speech", json=body, timeout=120)
    bound = tg.frame_bound("Hi.", 300)
    assert r.status_code == 200 and len(r.content) // 2 == (bound - 1) * 1920
    assert r.headers["x-take-check"].startswith("fail=runaway,") and r.headers["x-take-check"].endswith("takes=2")
    r = httpx.post(f"{api}/v1/audio/speech", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200 and r.headers["x-take-check"].startswith("streamed:")
    assert len(r.content) // 2 == (bound - 1) * 1920
    r = httpx.post(f"{api}/v1/audio/speech", json={**body, "input": LONG, "max_new_tokens": 10, "best_of": 2},
                   timeout=120)
    assert r.status_code == 200 and "capped" in r.headers["x-take-check"] and "takes=2" in r.headers["x-take-check"]
    for field, value in (("take_retries", 9), ("best_of", 0)):
        r = httpx.post(f"{api}/v1/audio/speech", json={**body, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
