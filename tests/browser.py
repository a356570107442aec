"""Test helper: headless Debian chromium through Selenium, and the live player's metrics read from the page.

`LAN_HOST` resolves to 127.0.0.1 inside the browser (`--host-resolver-rules`), but it is not a loopback name, so
a page opened as http://LAN_HOST:PORT/ is not a secure context: no AudioWorklet, no crypto.randomUUID - the
same as the app opened over plain HTTP from another machine on the network."""
from __future__ import annotations

import contextlib
import os
import shutil
import time

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
LAN_HOST = "lan-address.test"


def require_browser() -> None:
    """Skip the calling test module when chromium/chromedriver/selenium are missing (fail under CI)."""
    missing = [n for n, p in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not p or not os.path.exists(p)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"missing for the browser test: {', '.join(missing)} (.ci/run installs them)", pytrace=False)
        pytest.skip(f"missing for the browser test: {', '.join(missing)}", allow_module_level=True)


def chrome():
    """A headless chromium. No autoplay flag: the player must start its audio inside the click, as with a user."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--mute-audio",
              "--window-size=1280,1400", "--disable-background-timer-throttling",
              "--disable-renderer-backgrounding", "--disable-backgrounding-occluded-windows",
              f"--host-resolver-rules=MAP {LAN_HOST} 127.0.0.1"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    drv.set_page_load_timeout(60)
    drv.set_script_timeout(30)
    return drv


@contextlib.contextmanager
def chrome_session():
    """`chrome()`, quit on exit."""
    drv = chrome()
    try:
        yield drv
    finally:
        drv.quit()


def wait(cond, timeout, what, step=0.03):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metrics(drv) -> dict:
    """The live player's metrics of its current run (window.liveTTS.metrics)."""
    return drv.execute_script("return window.liveTTS ? window.liveTTS.metrics : null") or {}


def runs(drv) -> list[dict]:
    return drv.execute_script("return window.liveTTS ? window.liveTTS.runs : []") or []


def open_page(drv, url: str, button: str = "#preset-generate") -> None:
    from selenium.webdriver.common.by import By

    drv.get(url)
    wait(lambda: drv.find_elements(By.CSS_SELECTOR, button), 30, "the page to load")
    wait(lambda: drv.execute_script("return !!window.liveTTS && !!window.__gradio_session_hash__"), 30,
         "the live player to load")


def status(drv) -> str:
    """The app's status line (#status)."""
    return drv.execute_script("const s = document.querySelector('#status'); return s ? s.innerText : '';")


def set_text(drv, css: str, text: str, settle: float = 0.3) -> None:
    """Type `text` into the textarea/input `css` as a user would (an input event), then let Gradio take it."""
    box = drv.find_element("css selector", css)
    drv.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input', "
                       "{bubbles: true}))", box, text)
    time.sleep(settle)


def tab(drv, label: str) -> None:
    """Show the app's tab whose button says `label`."""
    for b in drv.find_elements("css selector", "button[role='tab']"):
        if label in b.text:
            b.click()
            time.sleep(0.5)
            return
    raise AssertionError(f"no tab {label!r}")


@contextlib.contextmanager
def tiny_app(folder, max_new_tokens: int):
    """The app on tiny random checkpoints (CustomVoice only; --tiny mode, so the page shows the random-weights
    banner), weights loaded first, served as `python app.py` serves it (FastAPI + /v1 + the live route + Gradio) on
    loopback. Yields (url, app)."""
    from serving.limits import Limits
    from tests.live_server import serve
    from ui import AppConfig, TTSApp
    from ui.server import create_server

    app = TTSApp(AppConfig(tiny=True, device="cpu", cache_dir=folder,
                           checkpoints={"custom_voice": "x", "base": "", "voice_design": ""},
                           limits=Limits(max_new_tokens=max_new_tokens)))
    try:
        app.preload()   # load the weights first: click -> sound then measures streaming, not model loading
        demo = app.build()
        demo.queue(default_concurrency_limit=app.concurrency, max_size=16)
        with serve(create_server(app, demo)) as url:
            yield url, app
    finally:
        app.close()


def click(drv, css: str) -> None:
    from selenium.webdriver.common.by import By

    drv.find_element(By.CSS_SELECTOR, css).click()


def start(drv, button: str = "#preset-generate") -> str:
    """Click Generate; -> the new run's token (as in metrics()["token"]) once the player has started it."""
    n = len(runs(drv))
    click(drv, button)
    return wait(lambda: (runs(drv)[n:] or [None])[0], 5, "the click to start a run")["token"]


def current(drv, token: str) -> dict:
    """Metrics of run `token` ({} while another run is current)."""
    m = metrics(drv)
    return m if m.get("token") == token else {}


def play_once(drv, button: str = "#preset-generate", timeout: float = 60, step: float = 0.03) -> dict:
    """Click Generate, wait for the run to end (polling the page every `step` s); -> its metrics. Asserts that it
    played sound."""
    tok = start(drv, button)
    m = wait(lambda: (lambda m: m if m.get("state") in ("ended", "stopped", "error", "idle") else None)(
        current(drv, tok)), timeout, "the live stream to play to its end", step=step)
    assert m["state"] == "ended", m
    assert_sound(m)
    return m


def assert_sound(m: dict) -> None:
    """The player played samples that were not silence, and its output (an AnalyserNode) carried them."""
    assert m["samplesPlayed"] > 2400, m
    assert m["rms"] > 1e-3, f"the played samples are silence: {m}"
    assert m["analyserRms"] > 1e-3, f"the player's output is silent: {m}"
    assert m["clickToSoundMs"] is not None and m["clickToSoundMs"] > 0, m
