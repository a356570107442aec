"""The live player's server side (ui/live_player.py): per-token slots between a handler (a thread, as Gradio runs
it) and the route `GET /live/{token}` (uvicorn on loopback, a real HTTP client)."""
from __future__ import annotations

import secrets
import threading
import time

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from tests.live_server import serve
from ui import live_player as lp

SESSION = "sess-a"


def _token() -> str:
    return secrets.token_hex(16)


def _pcm(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-32768, 32767, n, dtype=np.int16)


@pytest.fixture
def live():
    streams = lp.LiveStreams(handler_wait_s=2.0, reader_wait_s=1.0, poll_s=0.05)
    app = FastAPI()
    lp.install(app, streams)
    with serve(app) as url:
        yield url, streams


def _get(url, token, session=SESSION, timeout=10.0) -> httpx.Response:
    return httpx.get(f"{url}/live/{token}", params={"session": session}, timeout=timeout)


def _writer(sink, chunks, delay=0.02):
    def run():
        with sink:
            for c in chunks:
                time.sleep(delay)
                sink.write(c)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_handler_first_bytes_equal_and_nothing_left(live):
    url, streams = live
    tok = _token()
    chunks = [_pcm(2400 + k, k) for k in range(5)]
    sink = streams.open(tok, SESSION, expected_seconds=1.0)
    assert sink is not None and not sink.cancelled
    t = _writer(sink, chunks)
    r = _get(url, tok)
    t.join(5)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["x-live-sample-rate"] == "24000"
    assert r.headers["x-live-expected-seconds"] == "1.00"
    assert r.content == np.concatenate(chunks).astype("<i2").tobytes()
    assert not sink.cancelled
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_route_first_waits_for_the_handler(live):
    url, streams = live
    tok = _token()
    out = {}
    reader = threading.Thread(target=lambda: out.setdefault("r", _get(url, tok)), daemon=True)
    reader.start()
    assert _wait_until(lambda: len(streams) == 1), "the route should have created the slot"
    chunks = [_pcm(1000, k) for k in range(4)]
    sink = streams.open(tok, SESSION)
    assert sink is not None
    _writer(sink, chunks).join(5)
    reader.join(10)
    assert out["r"].status_code == 200
    assert out["r"].content == np.concatenate(chunks).tobytes()
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_first_bytes_come_before_the_handler_ends(live):
    url, streams = live
    tok = _token()
    sink = streams.open(tok, SESSION)
    release = threading.Event()

    def handler():
        with sink:
            sink.write(_pcm(480, 1))
            release.wait(5)
            sink.write(_pcm(480, 2))
    threading.Thread(target=handler, daemon=True).start()
    with httpx.stream("GET", f"{url}/live/{tok}", params={"session": SESSION}, timeout=5) as r:
        it = r.iter_raw()
        first = next(it)                  # arrives while the handler still holds the rest back
        assert len(first) == 960
        release.set()
        rest = b"".join(it)
    assert len(first) + len(rest) == 1920
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_second_reader_refused(live):
    url, streams = live
    tok = _token()
    sink = streams.open(tok, SESSION)
    sink.write(_pcm(480, 1))
    with httpx.stream("GET", f"{url}/live/{tok}", params={"session": SESSION}, timeout=5) as r:
        it = r.iter_raw()                 # (kept: a dropped iterator closes the response)
        next(it)
        second = _get(url, tok)
        assert second.status_code == 409
        sink.close()
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


@pytest.mark.parametrize("case", ["wrong_session", "malformed", "unknown_after_wait", "spent"])
def test_refused_tokens(live, case):
    url, streams = live
    tok = _token()
    if case == "wrong_session":
        sink = streams.open(tok, SESSION)
        sink.write(_pcm(480, 1))
        assert _get(url, tok, session="sess-b").status_code == 404
        sink.close()
        assert _get(url, tok).content == _pcm(480, 1).tobytes()     # the owner still gets it
    elif case == "malformed":
        assert _get(url, "short").status_code == 404
        assert _get(url, "x" * 30 + "!").status_code in (404, 422)
        assert streams.open("not a token", SESSION) is None
    elif case == "unknown_after_wait":   # nobody generates for it: the route gives up after handler_wait_s
        t0 = time.monotonic()
        assert _get(url, tok).status_code == 404
        assert 1.5 < time.monotonic() - t0 < 6
    elif case == "spent":                # single use: the same token is never opened or read again
        with streams.open(tok, SESSION) as sink:
            sink.write(_pcm(480, 1))
        assert _get(url, tok).status_code == 200
        assert _get(url, tok, timeout=10).status_code == 404
        assert streams.open(tok, SESSION) is None
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_handler_of_another_session_is_refused(live):
    url, streams = live
    tok = _token()
    out = {}
    reader = threading.Thread(target=lambda: out.setdefault("r", _get(url, tok, session="sess-b")), daemon=True)
    reader.start()
    assert _wait_until(lambda: len(streams) == 1)
    assert streams.open(tok, SESSION) is None          # the route claimed sess-b; this handler is sess-a
    reader.join(5)
    assert out["r"].status_code == 404
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_no_token_means_no_stream(live):
    _, streams = live
    assert streams.open("", SESSION) is None
    assert streams.open(None, SESSION) is None
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_abandoned_slot_expires_and_cancels_the_handler(live):
    url, streams = live
    tok = _token()
    sink = streams.open(tok, SESSION)
    sink.write(_pcm(480, 1))
    assert not sink.cancelled
    time.sleep(1.2)                                       # reader_wait_s = 1
    assert sink.cancelled
    sink.write(_pcm(480, 2))                              # a no-op now
    sink.close()
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"
    assert _get(url, tok).status_code == 404


def test_client_abort_cancels(live):
    url, streams = live
    tok = _token()
    sink = streams.open(tok, SESSION)
    stop = threading.Event()

    def handler():
        with sink:
            while not sink.cancelled and not stop.is_set():
                sink.write(_pcm(2400, 1))
                time.sleep(0.05)
    t = threading.Thread(target=handler, daemon=True)
    t.start()
    with httpx.stream("GET", f"{url}/live/{tok}", params={"session": SESSION}, timeout=5) as r:
        it = r.iter_raw()
        next(it)
        time.sleep(0.3)
        assert not sink.cancelled         # still reading
    # the connection is closed: the handler learns it through sink.cancelled
    assert _wait_until(lambda: sink.cancelled, 5), "an aborted reader must cancel the generation"
    stop.set()
    t.join(5)
    assert not t.is_alive()
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_client_abort_while_waiting_for_the_handler(live):
    url, streams = live
    tok = _token()

    def reader():
        try:
            httpx.get(f"{url}/live/{tok}", params={"session": SESSION}, timeout=0.3)
        except httpx.TimeoutException:
            pass
    reader()
    assert _wait_until(lambda: len(streams) == 0, 3), "the abandoned route-side slot must go"
    assert streams.open(tok, SESSION) is None           # and its token is spent


def test_backpressure_bounds_memory_and_keeps_every_byte():
    streams = lp.LiveStreams(max_buffer_s=0.1, write_block_s=5, poll_s=0.05)   # 2400 samples buffered at most
    app = FastAPI()
    lp.install(app, streams)
    tok = _token()
    chunks = [_pcm(1200, k) for k in range(20)]
    peak = []
    sink = streams.open(tok, SESSION)

    def handler():
        with sink:
            for c in chunks:
                sink.write(c)
                peak.append(sink._slot.buffered)
    t = threading.Thread(target=handler, daemon=True)
    with serve(app) as url:
        t.start()
        got = b""
        with httpx.stream("GET", f"{url}/live/{tok}", params={"session": SESSION}, timeout=10) as r:
            for part in r.iter_raw():
                got += part
                time.sleep(0.01)
        t.join(5)
    assert got == np.concatenate(chunks).tobytes()
    assert max(peak) <= 2 * 2400 * 2
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_a_reader_that_never_drains_cancels_after_write_block():
    streams = lp.LiveStreams(max_buffer_s=0.05, write_block_s=0.3, reader_wait_s=0.2)
    sink = streams.open(_token(), SESSION)
    t0 = time.monotonic()
    for k in range(5):                    # nobody reads: blocked writes give up, the slot is cancelled
        sink.write(_pcm(1200, k))
    assert sink.cancelled
    assert time.monotonic() - t0 < 3
    sink.close()
    assert _wait_until(lambda: len(streams) == 0, 3), "the slot must not outlive its stream"


def test_rate_is_learnt_and_sent(live):
    """The rate learnt is the stream's audio over the wall time between its first and last write: bracketed here by
    clock readings around those writes (a loaded machine stretches the sleeps, so no fixed figure is expected)."""
    url, streams = live
    streams.reader_wait_s = 30.0                      # (the GETs come after the writes, on a busy machine too)
    tok = _token()
    with streams.open(tok, SESSION) as sink:         # 1 s of audio in ~0.25 s: rate ~4 on an idle machine
        for k in range(5):
            before = time.monotonic()
            sink.write(_pcm(4800, k))
            after = time.monotonic()
            if k == 0:
                first_before, first_after = before, after
            time.sleep(0.06)
    audio = 5 * 4800 / 24000
    assert streams.rate is not None
    assert audio / (after - first_before) <= streams.rate <= audio / (before - first_after)
    assert streams.rate < 1 / 0.24                    # 4 sleeps of 0.06 s at least between the first and last write
    r = _get(url, tok)
    assert r.status_code == 200
    tok2 = _token()
    with streams.open(tok2, SESSION) as sink:
        sink.write(_pcm(480, 1))
    assert float(_get(url, tok2).headers["x-live-rate"]) == pytest.approx(streams.rate, abs=1e-3)


def test_first_chunks_are_sent(live):
    """The handler says how large the stream's first chunks will be (the player's start rule uses it)."""
    url, streams = live
    streams.reader_wait_s = 30.0                      # (the GETs come after both writes, on a busy machine too)
    tok, plain = _token(), _token()
    with streams.open(tok, SESSION, chunks_s=[0.08, 0.08, 0.16]) as sink:
        sink.write(_pcm(1920, 1))
    with streams.open(plain, SESSION) as sink:
        sink.write(_pcm(1920, 2))
    assert _get(url, tok).headers["x-live-chunks"] == "0.080,0.080,0.160"
    assert "x-live-chunks" not in _get(url, plain).headers


def test_player_scripts_are_served(live):
    url, _ = live
    for name in ("player.js", "worklet.js"):
        r = httpx.get(f"{url}/live/{name}")
        assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    assert "registerProcessor('live-pcm-player'" in httpx.get(f"{url}/live/worklet.js").text
    assert "window.liveTTS" in httpx.get(f"{url}/live/player.js").text


def test_expected_seconds():
    assert lp.expected_seconds("Hello there, how are you today?") == pytest.approx(31 / 14)
    assert lp.expected_seconds("你好世界") == pytest.approx(4 / 4.5)
