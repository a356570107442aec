"""ui/model_loader.py with stand-in load and warm-up steps: roles load one after another in the background, a
request waits for a role still loading (and says which), failures are reported and do not block, a role queued
after the thread finished still loads, and the blocking `load_now` raises a failure."""
from __future__ import annotations

import threading
import time

import pytest

from ui.model_loader import FAILED, READY, ModelLoader


class Steps:
    def __init__(self, fail=()):
        self.release = {r: threading.Event() for r in ("custom_voice", "base", "voice_design")}
        self.order: list[str] = []
        self.fail = set(fail)

    def load(self, role):
        self.order.append(role)
        assert self.release[role].wait(10)
        if role in self.fail:
            raise RuntimeError(f"{role} weights are broken")

    def warm(self, role):
        self.order.append(role + ":warm")


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_roles_load_in_order_and_requests_wait_for_them():
    steps = Steps()
    loader = ModelLoader(steps.load, steps.warm)
    loader.start(["custom_voice", "base"])
    assert _until(lambda: loader.roles["custom_voice"].stage == "loading the weights")
    snap = loader.snapshot()
    assert snap["loading"] and not snap["ready"]
    assert "Loading the CustomVoice model: step 1/2" in loader.summary() and "then 1 more" in loader.summary()

    waited = {}

    def request():
        waited["ok"] = loader.wait("custom_voice", timeout=10)
        waited["at"] = time.monotonic()
    t = threading.Thread(target=request)
    t.start()
    assert _until(lambda: loader.waiting_for(t.ident) is not None)
    assert loader.waiting_for(t.ident).role == "custom_voice"
    time.sleep(0.1)
    assert t.is_alive(), "the request must wait while its model loads"
    released = time.monotonic()
    steps.release["custom_voice"].set()
    t.join(5)
    assert waited["ok"] and waited["at"] >= released
    assert loader.roles["custom_voice"].stage == READY
    assert loader.wait("voice_design") is True          # never queued here: no wait
    steps.release["base"].set()
    assert _until(lambda: loader.snapshot()["ready"])
    # the request waiting for CustomVoice started at once instead of behind a warm-up; nobody waited for Base
    assert steps.order == ["custom_voice", "base", "base:warm"]
    assert loader.summary() == "✅ Models ready: CustomVoice, Base"


def test_the_warm_up_runs_only_where_no_request_waits_for_the_model():
    """The warm-up synthesis is for a later click's latency only: a model nobody waits for is warmed up before it
    is ready; where a request is waiting when the weights are in, it is skipped and that request goes first."""
    steps = Steps()
    loader = ModelLoader(steps.load, steps.warm)
    steps.release["base"].set()
    loader.start(["base"])
    assert _until(lambda: loader.roles["base"].stage == READY)   # (nobody waits for it)
    assert steps.order == ["base", "base:warm"] and loader.roles["base"].stage == READY
    loader.start(["custom_voice"])
    assert _until(lambda: loader.roles["custom_voice"].stage == "loading the weights")
    t = threading.Thread(target=lambda: loader.wait("custom_voice", timeout=10))
    t.start()
    assert _until(lambda: loader.awaited("custom_voice"))
    steps.release["custom_voice"].set()
    t.join(5)
    assert not t.is_alive() and loader.roles["custom_voice"].stage == READY
    assert steps.order == ["base", "base:warm", "custom_voice"] and not loader.awaited("custom_voice")


def test_a_failure_is_reported_and_does_not_block():
    steps = Steps(fail={"custom_voice"})
    loader = ModelLoader(steps.load, steps.warm)
    steps.release["custom_voice"].set()
    steps.release["base"].set()
    loader.start(["custom_voice", "base"])
    assert loader.wait("custom_voice", timeout=5)
    assert loader.roles["custom_voice"].stage == FAILED
    assert _until(lambda: loader.roles["base"].stage == READY)
    snap = loader.snapshot()
    assert not snap["ready"] and not snap["loading"]
    assert "CustomVoice model failed to load: RuntimeError: custom_voice weights are broken" in loader.summary()


def test_a_role_queued_after_the_thread_ended_still_loads():
    steps = Steps()
    for r in steps.release.values():
        r.set()
    loader = ModelLoader(steps.load, steps.warm)
    loader.start(["custom_voice"])
    assert _until(lambda: loader._thread is None)
    loader.start(["voice_design"])
    assert loader.wait("voice_design", timeout=5) and loader.roles["voice_design"].stage == READY


def test_load_now_blocks_and_raises_a_failure():
    steps = Steps(fail={"base"})
    for r in steps.release.values():
        r.set()
    loader = ModelLoader(steps.load, steps.warm)
    with pytest.raises(RuntimeError, match="base weights are broken"):
        loader.load_now(["custom_voice", "base"])
    assert loader.roles["custom_voice"].stage == READY


class _Engine:
    """A stand-in engine for `Models.warm_up`: its load (`load_state`) and a stream that counts its chunks; `arrive`:
    after that many chunks another request is in the engine."""

    speakers, hidden_size = ["ryan"], 8

    def __init__(self, busy=0, arrive=None):
        self.busy, self.arrive, self.chunks, self.cancelled = busy, arrive, 0, False

    def load_state(self):
        return {"running": self.busy, "waiting": 0}

    def stream(self, text, **kw):
        assert kw["max_new_tokens"] == 8 and kw["first_chunk_frames"] == (1, 1)
        self.busy += 1
        engine = self

        class Stream:
            def __iter__(self):
                for _ in range(4):
                    engine.chunks += 1
                    if engine.chunks == engine.arrive:
                        engine.busy += 1
                    yield b"pcm"

            def cancel(self):
                engine.cancelled = True
        return Stream()


@pytest.mark.parametrize("busy,arrive,chunks", [(0, None, 4), (1, None, 0), (0, 2, 2)])
def test_the_warm_up_yields_to_a_request_in_the_engine(busy, arrive, chunks, caplog):
    """`Models.warm_up`: a whole short synthesis on an idle engine; none where a request is already in the engine
    (an API request waits for the engine, not the loader); cut short at the next chunk when one comes meanwhile."""
    from types import SimpleNamespace

    from ui.roles import Models

    eng = _Engine(busy, arrive)
    with caplog.at_level("INFO", logger="qwen3_tts_live"):
        Models.warm_up(SimpleNamespace(registry=SimpleNamespace(get=lambda role: eng)), "custom_voice")
    assert eng.chunks == chunks and eng.cancelled == (arrive is not None)
    assert ("skipped" in caplog.text) == (busy > 0) and ("cut short" in caplog.text) == (arrive is not None)
