"""No cold first click, in a real browser (headless chromium) on the real app (tiny checkpoints, served as
`python app.py` serves it: the models load in the background while the page is already served).

1. A click made while the model still loads: the status line says "Loading the CustomVoice model" (with its
   step), the page's models indicator says it is loading, and the click plays as soon as the model is ready.
2. The first click made 20 s after the server starts answering plays like the later clicks: the page reports
   the models ready, and each of five clicks plays sound (not silence) that the player's own request started
   (no Gradio round trip before the engine request).
Function only: the timings are printed (tests/click_to_sound.py measures them), never asserted."""
from __future__ import annotations

import statistics
import threading
import time

import httpx

from tests import browser as B

B.require_browser()


def _app(tmp, gate: threading.Event | None = None):
    from serving.limits import Limits
    from ui import AppConfig, TTSApp

    app = TTSApp(AppConfig(tiny=True, device="cpu", cache_dir=tmp,
                           checkpoints={"custom_voice": "x", "base": "", "voice_design": ""},
                           limits=Limits(max_new_tokens=60)))
    if gate is not None:
        load = app.models.loader._load

        def slow(role):                       # a bigger model: loading takes until the test lets it finish
            gate.wait(60)
            return load(role)
        app.models.loader._load = slow
    app.load_in_background()                  # what `python app.py` does before serving
    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=16)
    return app, demo


def _answering(url) -> float:
    B.wait(lambda: httpx.get(url + "/live/models", timeout=2).status_code == 200, 30, "the server to answer")
    return time.monotonic()


def _models(drv) -> str:
    return drv.execute_script("const s = document.querySelector('#model-state'); return s ? s.innerText : '';")


def test_a_click_while_the_model_loads_says_so_and_then_plays(tmp_path, drv):
    from tests.live_server import serve
    from ui.server import create_server

    gate = threading.Event()
    app, demo = _app(tmp_path, gate)
    try:
        with serve(create_server(app, demo)) as url:
            _answering(url)
            B.open_page(drv, url + "/")
            B.wait(lambda: "Loading the CustomVoice model" in _models(drv), 10, "the page to say the model loads")
            tok = B.start(drv)
            seen = B.wait(lambda: (lambda s: s if "Loading the CustomVoice model: step" in s else None)(B.status(drv)),
                          15, "the status line to say the model loads, with its step")
            assert B.current(drv, tok).get("state") == "buffering", seen
            gate.set()                        # the model finishes loading: the click plays
            m = B.wait(lambda: (lambda m: m if m.get("state") in ("ended", "stopped", "error", "idle") else None)(
                B.current(drv, tok)), 90, "the click to play once the model is ready")
            assert m["state"] == "ended", m
            B.assert_sound(m)
            B.wait(lambda: B.status(drv).startswith("Done"), 30, "the status line to say Done")
            B.wait(lambda: "Models ready" in _models(drv), 60, "the page to say the models are ready")
            print(f"\n[cold start] click during loading: sound {m['clickToSoundMs']:.0f} ms after the click")
    finally:
        gate.set()
        app.close()


def test_first_click_20_s_after_start_plays_like_the_later_ones(tmp_path, drv):
    from tests.live_server import serve
    from ui.server import create_server

    app, demo = _app(tmp_path)
    try:
        with serve(create_server(app, demo)) as url:
            t_answer = _answering(url)
            B.open_page(drv, url + "/")
            B.wait(lambda: "Models ready" in _models(drv), 60, "the page to report the models ready")
            assert drv.execute_script("return window.liveModels.ready") is True
            time.sleep(max(0.0, t_answer + 20 - time.monotonic()))
            times = []
            for k in range(5):
                m = B.play_once(drv)
                assert m["early"] is True, m          # the player's request started the generation
                B.wait(lambda: B.status(drv).startswith("Done"), 30, "the status line to say Done")
                times.append(m["clickToSoundMs"])
            assert len(app.live) == 0
            B.wait(lambda: len(app.early) == 0, 5, "no run left behind")
            print(f"\n[cold start] click -> sound (ms), first click 20 s after start: "
                  f"{', '.join(f'{t:.0f}' for t in times)}; first {times[0]:.0f}, median of the next four "
                  f"{statistics.median(times[1:]):.0f}")
    finally:
        app.close()
