"""Listening tests through gradio_client on the launched app (tiny random checkpoints): a whole ABX test and a whole
MUSHRA test (start, fetch every stimulus, answer, report: CSV and JSON), the exported JSON loaded again makes the
same test, each trial's stimuli are loudness-matched within 0.5 LU, and bad input (unknown voice or model, a precision
this device cannot hold, too many stimuli or trials, answers to an unknown or finished test) comes back as a readable
error that changes nothing."""
from __future__ import annotations

import contextlib
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from live_server import free_port
from serving import listen as ls


@contextlib.contextmanager
def listen_app(folder: Path, max_new_tokens: int = 30):
    """The Gradio app on tiny random CustomVoice and Base checkpoints, launched on loopback; short renders (at most
    `max_new_tokens` frames). Yields (app, client)."""
    from gradio_client import Client

    from serving.limits import Limits
    from tts_engine import make_tiny
    from ui.app import TTSApp
    from ui.config import AppConfig

    ck = {r: str(make_tiny(folder / r, kind=r, size="0b6", seed=0)) for r in ("custom_voice", "base")}
    ck["voice_design"] = ""
    app = TTSApp(AppConfig(checkpoints=ck, device="cpu", dtype="fp32", quantize="none", cache_dir=folder / "cache",
                           limits=Limits(max_text_chars=500, max_new_tokens=max_new_tokens)))
    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=16)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **app.launch_kwargs())
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    try:
        yield app, client
    finally:
        with contextlib.suppress(Exception):
            client.close()
        demo.close()
        app.close()
