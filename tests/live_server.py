"""Test helper: run a FastAPI app with uvicorn on a free loopback port in a background thread; or a checkout's
`python app.py --tiny` as a process of its own (the measuring scripts tests/click_to_sound.py, tests/stream_gaps.py)."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import uvicorn


_TINY_MADE: dict = {}


def tiny_checkpoint(folder: Path, kind: str, size: str = "0b6", seed: int = 0) -> Path:
    """`make_tiny(folder, kind, size, seed)`: written once per (kind, size, seed) in this process, then copied (make_tiny
    is deterministic, so the copy has the same bytes; a copy costs milliseconds, writing one a second of CPU)."""
    import atexit
    import shutil

    from tts_engine.tiny import make_tiny

    key = (kind, size, seed)
    if key not in _TINY_MADE:
        first = Path(tempfile.mkdtemp(prefix="tiny-ckpt-"))
        atexit.register(shutil.rmtree, first, True)
        _TINY_MADE[key] = make_tiny(first / kind, kind=kind, size=size, seed=seed)
    shutil.copytree(_TINY_MADE[key], folder, dirs_exist_ok=True)
    return Path(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app, timeout: float = 30):
    """Yields the base URL (http://127.0.0.1:PORT) while the app runs; stops it afterwards."""
    port = free_port()
    # at the end, connections a client keeps open (gradio_client's event stream) are closed after 1 s, not waited for
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        timeout_graceful_shutdown=1))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.time() + timeout
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    if not srv.started:
        raise RuntimeError("server did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=10)


@contextlib.contextmanager
def tiny_api(folder, roles, limits, engine_kw: dict | None = None, voices: dict | None = None, take_guard=None):
    """Our speech API on tiny random checkpoints of `roles`, on loopback. Yields (url, registry, checkpoints).
    `voices`: VoiceStore arguments for uploaded voices (default: a `voices` folder under `folder`, no admin key);
    `take_guard`: the API's (default: the server's, from the environment)."""
    from fastapi import FastAPI

    from server.openai_api import install
    from serving.registry import EngineRegistry
    from serving.voice_store import VoiceStore

    ck = {role: str(tiny_checkpoint(folder / role, kind=role, size="1b7" if role == "voice_design" else "0b6"))
          for role in roles}
    registry = EngineRegistry(ck, device="cpu", offline_fallback=False, engine_kw=engine_kw)
    registry.uploaded = VoiceStore(**({"folder": folder / "voices", "admin_key": ""} | (voices or {})))
    app = FastAPI()
    install(app, registry, limits, take_guard=take_guard)
    try:
        with serve(app) as url:
            yield url, registry, ck
    finally:
        registry.close()


@contextlib.contextmanager
def tiny_gradio_app(folder: Path, max_text_chars: int, before_build=None, max_new_tokens: int = 600, **config):
    """The Gradio app on tiny random custom_voice and base checkpoints (0.6b shape, seed 0; no voice design),
    launched on a free loopback port and driven by gradio_client. before_build(app): called before the UI is built
    (e.g. to wrap engines); `config`: more AppConfig fields (dtype, quantize, ...). Yields (app, client); closes both
    afterwards."""
    from gradio_client import Client

    from serving.limits import Limits
    from ui.app import TTSApp
    from ui.config import AppConfig

    ck = {r: str(tiny_checkpoint(folder / r, kind=r, size="0b6", seed=0)) for r in ("custom_voice", "base")}
    ck["voice_design"] = ""
    app = TTSApp(AppConfig(checkpoints=ck, device="cpu", cache_dir=folder / "cache",
                           limits=Limits(max_text_chars=max_text_chars, max_new_tokens=max_new_tokens), **config))
    if before_build is not None:
        before_build(app)
    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=16)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **app.launch_kwargs())
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    try:
        yield app, client
    finally:
        try:
            client.close()
        except Exception:
            pass
        demo.close()
        app.close()


@contextlib.contextmanager
def app_process(root: Path, port: int, extra=(), cache_prefix: str = "app-"):
    """`python app.py --tiny` of checkout `root` on 127.0.0.1:`port` (a fresh temporary cache folder, output
    discarded), started now and stopped on exit. Yields its base URL; `wait_answering` waits for it to answer."""
    srv = subprocess.Popen([sys.executable, str(root / "app.py"), "--tiny", "--host", "127.0.0.1", "--port",
                            str(port), "--cache-dir", tempfile.mkdtemp(prefix=cache_prefix), *extra],
                           cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.terminate()
        try:
            srv.wait(20)
        except subprocess.TimeoutExpired:
            srv.kill()


def wait_answering(url: str, timeout: float) -> float:
    """Wait until `url`/ answers 200; -> time.monotonic() then. Exits the script after `timeout` s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(url + "/", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic()
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"the server did not answer within {timeout} s")
