"""A fresh start answers at once (issue 26, "no compiler on the first click"): with nothing remembered and
TTS_START_TRIALS=bounded, the fused stacks, the predictor frame and the talker step serve the path expected to win
as soon as their agreement check at load has passed ("default", "measurement pending" in `engine.paths()`); their
timed trials run later in the deferred-trials thread on scratch state, a run disturbed by a request is thrown away
and repeated, and each verdict is remembered and applied by the engine's own thread at a frame boundary with no row
held. TTS_START_TRIALS=all still measures everything at load. Figures: `python -m bench startup` (never here)."""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np
import pytest

from tts_engine.cpu import deferred_trials, fused_step, measured, predictor_frame, talker_step

from test_cpu_ext_kernels import built

PARTS = ("talker stack", "predictor stack", "predictor frame", "talker step")
DEFAULTS = {"talker stack": "fused", "predictor stack": "fused", "predictor frame": "frame-team",
            "talker step": "step"}
TRIAL = "tts-deferred-trials"   # the deferred trials' thread


def _until(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def fresh(monkeypatch, own_kernels):
    """A process at a fresh bounded start: an empty cache folder (own_kernels), no deferred job queued, no frame
    served yet, the fused paths on auto; the codec's conv path forced (its own deferred trial stays out of these)."""
    built(talker_step.library, "the talker step")
    monkeypatch.setattr(deferred_trials, "QUIET_S", 0.3)
    monkeypatch.setattr(deferred_trials, "_state", {"last_busy": 0.0, "served": False, "thread": None, "done": []})
    monkeypatch.setattr(deferred_trials, "_jobs", collections.deque())
    monkeypatch.setenv(deferred_trials.ENV, "bounded")
    for env in (fused_step.ENV, predictor_frame.ENV, talker_step.ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TTS_CODEC_CONV", "aten")
    yield deferred_trials
    deferred_trials.mark_busy()   # (jobs still queued run now, on their scratch state, and end)
    assert deferred_trials.wait(120)


def _engine(folder):
    from tts_engine import TTSEngine

    return TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", quantize="w8a8", max_batch=2,
                                     max_seq_len=128)


def _speak(engine, seed=3):
    wav = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=seed, max_new_tokens=8)
    assert wav.dtype == np.float32 and wav.size > 0 and np.isfinite(wav).all()
    return wav


def _pending(paths) -> bool:
    return all(paths[p]["how"] == "default" and measured.PENDING in paths[p]["why"] for p in PARTS)


def test_a_fresh_start_serves_checked_defaults_and_applies_the_measured_verdicts_later(fresh, tiny_cv_folder,
                                                                                      own_kernels):
    engine = _engine(tiny_cv_folder)
    try:
        paths = engine.paths()
        assert {p: paths[p]["path"] for p in PARTS} == DEFAULTS, paths
        assert _pending(paths), paths
        assert "checked against" in paths["talker stack"]["why"] and "at load" in paths["talker step"]["why"]
        runner = engine.runner
        assert not runner.talker.model.fused.times["fused"] and not runner.talker_step.times["step"]   # nothing timed
        assert fresh.pending() == ["fused talker step", "fused predictor step", "code predictor frame",
                                   "talker step in one call"]
        assert not list(own_kernels.glob("fused_step/*.json")) and engine.worker.between_frames is not None
        for name in ("pos", "step", "seen", "hidden", "c0", "trailing_len", "max_new"):   # the check left row 0 so
            assert not getattr(runner, name).any(), name
        _speak(engine)                                   # served at once on the defaults; the trials wait for quiet
        assert fresh.wait(120) and fresh._state["done"] == [
            "fused talker step", "fused predictor step", "code predictor frame", "talker step in one call"]
        # remembered at once; applied by the worker at its next idle frame boundary
        for folder in ("fused_step", "predictor_frame", "talker_step"):
            assert list(own_kernels.glob(f"{folder}/*.json")), folder
        assert _until(lambda: all(engine.paths()[p]["how"] in ("measured now", "fell back") for p in PARTS)), \
            engine.paths()
        assert _until(lambda: engine.worker.between_frames is None)
        paths = engine.paths()
        assert all("by median" in paths[p]["why"] for p in PARTS if paths[p]["how"] == "measured now"), paths
        assert len(runner.talker_step.times["step"]) == talker_step.TRIAL_PAIRS
        _speak(engine)
    finally:
        engine.close()
    again = _engine(tiny_cv_folder)   # the next start reads the verdicts: nothing checked, timed or deferred
    try:
        got = again.paths()
        fused = {"talker stack": "talker step", "predictor stack": "predictor frame"}
        for stack, part in fused.items():
            for p in (stack, part) if paths[stack]["path"] == "fused" else (stack,):
                if paths[p]["how"] == "measured now":
                    assert got[p] == {**paths[p], "how": "remembered"}, (p, got, paths)
        if all(paths[p]["how"] == "measured now" for p in PARTS):
            assert fresh.pending() == [] and again.worker.between_frames is None
    finally:
        again.close()


def test_a_verdict_against_the_default_switches_the_path_at_a_free_frame_boundary(fresh, tiny_cv_folder,
                                                                                  monkeypatch):
    """The deferred trial finds the eager talker stack faster (the fused one made slow in the trials' thread only):
    the switch waits for a frame boundary with no row held, then the stack serves eagerly, measured now."""
    real = fused_step.FusedStep._fused

    def slow_in_the_trial(self, *a):
        if threading.current_thread().name == TRIAL and self.name == "talker":
            time.sleep(0.05)
        return real(self, *a)

    monkeypatch.setattr(fused_step.FusedStep, "_fused", slow_in_the_trial)
    monkeypatch.setenv(talker_step.ENV, "0")   # (the talker stack through its own fused step, not the whole step)
    engine = _engine(tiny_cv_folder)
    try:
        fused = engine.model.talker.model.fused
        assert fused.state == "on" and engine.paths()["talker stack"]["how"] == "default"
        boundary = engine.runner.backend.deferred
        held = threading.Event()
        real_poll = boundary.poll
        monkeypatch.setattr(boundary, "poll", lambda no_row_held: real_poll(no_row_held and not held.is_set()))
        held.set()                                       # as if a row were held: nothing applies
        _speak(engine)
        assert fresh.wait(120) and "fused talker step" in fresh._state["done"]
        time.sleep(0.3)
        assert fused.state == "on" and engine.paths()["talker stack"]["how"] == "default"
        held.clear()                                     # the row is free: the next boundary applies it
        assert _until(lambda: fused.state == "off")
        entry = engine.paths()["talker stack"]
        assert entry["path"] == "eager" and entry["how"] == "measured now" and "eager by median" in entry["why"]
        _speak(engine)
    finally:
        engine.close()


def test_a_request_during_a_deferred_trial_is_served_as_without_it(fresh, tiny_cv_folder, monkeypatch, caplog):
    """A request that comes while a deferred trial times runs beside it and gets the audio of the same paths forced
    on with no trial at all (the forced predictor frame splits its threads, the default runs as one team: the same
    codes); the trial's run is thrown away at its next check and run again when idle."""
    for env in (fused_step.ENV, predictor_frame.ENV, talker_step.ENV):
        monkeypatch.setenv(env, "1")
    forced = _engine(tiny_cv_folder)
    try:
        _speak(forced, seed=11)                          # (the same two requests, no trial beside them)
        want = _speak(forced)
    finally:
        forced.close()
    for env in (fused_step.ENV, predictor_frame.ENV, talker_step.ENV):
        monkeypatch.delenv(env)
    inside, runs = threading.Event(), []
    real = fused_step.FusedStep._run_trial

    def until_a_request(self, choice, pairs):
        if threading.current_thread().name != TRIAL or self.name != "talker":
            return real(self, choice, pairs)
        runs.append(1)
        if len(runs) > 1:
            return real(self, choice, pairs)
        inside.set()                                     # the first deferred run times pair after pair until a
        t0 = time.monotonic()                            # request's frame stops it at its next check
        while time.monotonic() - t0 < 60:
            real(self, choice, 1)
        pytest.fail("the deferred trial was never stopped")

    monkeypatch.setattr(fused_step.FusedStep, "_run_trial", until_a_request)
    engine = _engine(tiny_cv_folder)
    try:
        assert _pending(engine.paths())
        with caplog.at_level(logging.INFO, logger="tts_engine"):
            _speak(engine, seed=11)                      # the first frame: the trials start once it is quiet
            assert inside.wait(60)
            got = _speak(engine)                         # served while the talker stack's trial times
            assert fresh.wait(120)
        assert got.tobytes() == want.tobytes()
        assert len(runs) == 2 and "fused talker step stopped for a request" in caplog.text
        assert fresh._state["done"][0] == "fused talker step"
        assert _until(lambda: engine.paths()["talker stack"]["how"] in ("measured now", "fell back"))
    finally:
        engine.close()


def test_a_check_at_load_that_disagrees_falls_back_and_defers_nothing(fresh, tiny_cv_folder, monkeypatch, caplog):
    monkeypatch.setattr(fused_step.FusedStep, "_check", lambda self, eager, fused: "its hidden states differ")
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        engine = _engine(tiny_cv_folder)
    try:
        paths = engine.paths()
        for part in ("talker stack", "predictor stack"):
            assert paths[part] == {"path": "eager", "how": "fell back", "why": "its hidden states differ"}, paths
        assert paths["talker step"]["path"] == "python" and fresh.pending() == []
        assert caplog.text.count("eager from now on") == 2   # one line per stack
        _speak(engine)
    finally:
        engine.close()


def test_all_measures_every_trial_at_load(fresh, tiny_cv_folder, monkeypatch):
    monkeypatch.setenv(deferred_trials.ENV, "all")
    engine = _engine(tiny_cv_folder)
    try:
        paths = engine.paths()
        assert all(paths[p]["how"] in ("measured now", "fell back") for p in PARTS), paths
        assert len(engine.model.talker.model.fused.times["fused"]) == fused_step.TRIAL_PAIRS
        assert fresh.pending() == [] and engine.worker.between_frames is None
    finally:
        engine.close()


def test_verdicts_wait_for_a_boundary_with_no_row_held(fresh):
    """`AtBoundary`: a verdict measured undisturbed is applied by `poll` only with no row held; a trial that
    failed applies nothing; the poll says done once nothing is left; the engines' jobs go before the others."""
    fresh.mark_busy()
    applied = []
    fresh.defer("next start's", lambda: None, lambda got: None)
    b = deferred_trials.AtBoundary()
    b.defer("mine", lambda: 7, lambda got: (lambda: applied.append(got)))
    b.defer("broken", lambda: 1 / 0, lambda got: pytest.fail("a failed trial has no verdict"))
    assert fresh.pending() == ["next start's", "mine", "broken"]   # (the first one may be running already)
    assert b.waiting() and b.poll(True) is False
    assert fresh.wait(60)
    assert b.poll(False) is False and applied == []
    assert b.poll(True) is True and applied == [7] and not b.waiting()


def test_an_engine_holding_a_request_counts_as_busy(fresh, monkeypatch):
    """A prompt being prefilled serves no frame yet: an engine that holds a request (`watch`: the CPU backend's probe
    of its runner's rows) keeps the deferred trials from starting, and stops one under way at its next check."""
    monkeypatch.setattr(deferred_trials, "_probes", [])
    held, runs, kept = [True], [], []
    deferred_trials.watch(lambda: held[0])
    fresh.mark_busy()

    def measure():
        runs.append(time.monotonic())
        if len(runs) == 1:
            held[0] = True                               # a request came: its prefill runs, no frame yet
        fresh.check()
        return len(runs)

    fresh.defer("held", measure, kept.append)
    time.sleep(fresh.QUIET_S + 0.5)
    assert runs == [] and fresh.pending() == ["held"]    # not while a request is held
    held[0] = False
    assert _until(lambda: len(runs) == 1)
    time.sleep(fresh.QUIET_S + 0.3)
    assert len(runs) == 1                                # stopped, and not again while the request is held
    held[0] = False
    assert fresh.wait(30) and kept == [2]
    deferred_trials.watch(lambda: None)                  # an engine that is gone is no longer asked
    fresh.quiet_for()
    assert len(deferred_trials._probes) == 1


def test_the_cpu_backend_watches_its_runner(fresh, tiny_cv_folder, monkeypatch):
    monkeypatch.setattr(deferred_trials, "_probes", [])
    engine = _engine(tiny_cv_folder)
    try:
        probe = deferred_trials._probes[-1]
        assert probe() is False
        stream = engine.stream("Hello there.", voice=engine.speakers[0], seed=1, max_new_tokens=64)
        next(iter(stream))
        assert probe() is True                           # a row is held while the request runs
        stream.cancel()
        assert _until(lambda: probe() is False)
    finally:
        engine.close()
