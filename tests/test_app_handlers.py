"""The Gradio app's handlers, called directly on tiny random checkpoints (no server, no browser)."""
from __future__ import annotations

import os
import pickle
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import numpy as np
import pytest
import soundfile as sf
import torch

import app as app_mod
from ui import layout
from ui import speak as speak_mod
from ui.app import TTSApp
from ui.config import ROOT, SENTENCE_PAUSE_S, SR, AppConfig
from ui.handlers import guard
from ui.text import chunk_text, split_sentences, to_int16
from serving.limits import Limits
from serving.text_prep import spoken_form
from tts_engine import TTSError
from tests.live_server import tiny_checkpoint
from tts_engine.voices import blend as B
from tts_engine.voices.presets import PresetLibrary, load_presets
from tts_engine.voices.voice import Voice

OLIVER = ROOT / "presets" / "oliver.flac"
OLIVER_TEXT = "Good morning. I hope you slept well, because today we have a great deal of work to do."


def _needs_clone_modules():
    pytest.importorskip("tts_engine.voices.speaker_encoder", reason="speaker encoder not written yet")
    pytest.importorskip("tts_engine.codec.encoder", reason="codec encoder not written yet")
    pytest.importorskip("tts_engine.audio", reason="tts_engine.audio not written yet")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("app_ckpts")
    return {role: str(tiny_checkpoint(d / role, kind=role, size="1b7" if role == "voice_design" else "0b6", seed=0))
            for role in ("custom_voice", "base", "voice_design")}


@pytest.fixture(scope="module")
def app(tiny_dirs, tmp_path_factory):
    # live_audio=True: the handlers also yield every chunk to the `live` output (Gradio's streaming player, used
    # where ffmpeg is installed); called directly here, nothing is encoded, so this runs without ffmpeg
    cfg = AppConfig(checkpoints=dict(tiny_dirs), device="cpu", cache_dir=tmp_path_factory.mktemp("app_cache"),
                    limits=Limits(max_text_chars=800, max_new_tokens=40, max_queue=16), live_audio=True)
    a = TTSApp(cfg)
    a.build()
    yield a
    a.close()


def drain(gen, limit: int = 10_000) -> list[dict]:
    out = []
    for i, d in enumerate(gen):
        out.append(d)
        assert i < limit
    return out


def live_chunks(app, outs):
    return [d[app.c.live] for d in outs if app.c.live in d]


def final_of(app, outs):
    finals = [d for d in outs if app.c.final in d and d[app.c.final] is not None]
    assert len(finals) == 1, "exactly one lossless result, at the end"
    assert finals[0] is outs[-1]
    return finals[0]


def req(name="s"):
    return SimpleNamespace(session_hash=name)


class Recorder:
    """Wraps engine.stream and records every call's arguments."""

    def __init__(self, engine):
        self.engine, self.orig, self.calls = engine, engine.stream, []

    def __call__(self, text, **kw):
        self.calls.append(dict(kw, text=text))
        return self.orig(text, **kw)


# --- text and audio helpers -------------------------------------------------------------------------------

def test_sentence_split_and_chunking():
    assert split_sentences("Hello there. How are you? I'm fine!") == ["Hello there.", "How are you?", "I'm fine!"]
    assert split_sentences("Pi is 3.14 today.\nNew line") == ["Pi is 3.14 today.", "New line"]
    assert split_sentences('He said "stop." Then left.') == ['He said "stop."', "Then left."]
    assert split_sentences("你好。今天天气很好！我们走吧") == ["你好。", "今天天气很好！", "我们走吧"]
    text = " ".join(f"Sentence number {i} is here." for i in range(30))
    pieces = chunk_text(text, max_chars=80)
    assert len(pieces) > 3 and all(len(p) <= 80 for p in pieces)
    assert " ".join(pieces) == text                          # order and content kept, cut only between sentences
    assert all(p.endswith(".") for p in pieces)
    long = "word " * 100
    assert all(len(p) <= 60 for p in chunk_text(long, max_chars=60))
    assert chunk_text("Short.") == ["Short."]


def test_int16_conversion_has_one_fixed_scale():
    quiet = np.full(100, 0.1, np.float32)
    loud = np.full(100, 0.8, np.float32)
    assert to_int16(quiet)[0] == int(0.1 * 32767) and to_int16(loud)[0] == int(0.8 * 32767)  # no per-chunk peak norm
    assert to_int16(np.array([2.0, -2.0], np.float32)).tolist() == [32767, -32767]
    assert to_int16(quiet).dtype == np.int16


# --- generation ------------------------------------------------------------------------------------------

def test_preset_streams_chunks_then_lossless_wav(app):
    outs = drain(app.preset("Hello there. How are you?", "ryan", "english", "", {}, seed=7, randomize=False,
                            max_new_tokens=20, request=req()))
    chunks = live_chunks(app, outs)
    assert len(chunks) >= 2, "audio arrives in several chunks before the end"
    assert all(sr == SR and pcm.dtype == np.int16 for sr, pcm in chunks)
    final = final_of(app, outs)
    sr, wav = final[app.c.final]
    assert sr == SR and wav.dtype == np.int16
    assert np.array_equal(wav, np.concatenate([c for _, c in chunks]))      # the WAV is exactly what streamed
    status = final[app.c.status]
    for part in ("Done", "first audio", "RTF", "s of audio", "seed 7"):
        assert part in status
    assert final[app.c.seed] == 7
    assert outs[0][app.c.final] is None and outs[0][app.c.seed] == 7        # the old result is cleared first
    again = final_of(app, drain(app.preset("Hello there. How are you?", "ryan", "english", "", {}, seed=7,
                                           randomize=False, max_new_tokens=20)))
    assert np.array_equal(again[app.c.final][1], wav)                        # same seed -> same audio


def test_randomize_draws_a_new_seed_and_reports_it(app):
    seeds = set()
    for _ in range(2):
        outs = drain(app.preset("Hi.", "vivian", "auto", "", {}, seed=7, randomize=True, max_new_tokens=6))
        seeds.add(outs[-1][app.c.seed])
    assert 7 not in seeds and len(seeds) == 2


def test_long_text_is_split_and_streamed_in_order_with_one_voice_and_seed(app, monkeypatch):
    eng = app.engine("custom_voice")
    rec = Recorder(eng)
    monkeypatch.setattr(eng, "stream", rec)
    text = " ".join(f"This is sentence number {i}, spoken in order." for i in range(12))
    outs = drain(app.preset(text, "aiden", "english", "", {}, seed=3, randomize=False, max_new_tokens=4))
    pieces = chunk_text(spoken_form(text, "english"))      # as the model reads them: numbers read out
    assert len(pieces) > 1 and [c["text"] for c in rec.calls] == pieces
    assert {c["seed"] for c in rec.calls} == {3} and {c["voice"] for c in rec.calls} == {"aiden"}
    assert f"part {len(pieces)}/{len(pieces)}" in outs[-1][app.c.status]


class Logged:
    """Wraps engine.stream: logs ("submit", k) when group k is submitted and ("end", k) when its stream is
    exhausted, and keeps every chunk each group produced."""

    def __init__(self, engine):
        self.orig, self.log, self.chunks, self.streams = engine.stream, [], [], []

    def __call__(self, text, **kw):
        k = len(self.chunks)
        self.log.append(("submit", k))
        self.made_before = getattr(self, "made_before", []) + [sum(map(len, self.chunks[-1])) if self.chunks else 0]
        self.chunks.append([])
        stream = self.orig(text, **kw)
        self.streams.append(stream)
        return self._wrap(k, stream)

    def _wrap(self, k, stream):
        log, chunks = self.log, self.chunks[k]

        class Handle:
            position = property(lambda _: stream.position)
            cancel = stream.cancel

            def __iter__(_):
                for x in stream:
                    chunks.append(x)
                    yield x
                log.append(("end", k))
        return Handle()


def test_long_text_is_gapless_next_group_generates_while_the_current_one_streams(app, monkeypatch):
    """Group k+1 is submitted while group k still streams (so it is ready when k ends); the listener gets
    exactly the groups' audio with the chosen pause between them, through the one emit point."""
    eng = app.engine("custom_voice")
    logged = Logged(eng)
    monkeypatch.setattr(eng, "stream", logged)
    text = " ".join(f"This is sentence number {i}, spoken in order." for i in range(12))
    pieces = chunk_text(text)
    assert len(pieces) >= 3
    sink = RecordingSink()
    outs = drain(app.speaker.speak("custom_voice", eng, speak_mod.SpeechJob(
        text=text, voice="aiden", language="english", instruct=None, seed=3, sampling={}, max_new_tokens=6),
        req("gapless"), sink=sink))
    log = logged.log
    assert [k for ev, k in log if ev == "submit"] == list(range(len(pieces)))
    # (the second group: once the first has made SUBMIT_NEXT_AFTER_S of audio, or ended, as these short groups do;
    # the next test) every later one while the one before still streams
    for k in range(1, len(pieces) - 1):
        assert log.index(("submit", k + 1)) < log.index(("end", k)), f"group {k + 1} was not queued ahead"
    pause = np.zeros(int(SR * SENTENCE_PAUSE_S), np.int16)
    groups = [np.concatenate([to_int16(x) for x in ch]) for ch in logged.chunks]
    want = np.concatenate([x for g in groups for x in (pause, g)][1:])
    final = final_of(app, outs)[app.c.final][1]
    assert np.array_equal(final, want), "the WAV is the groups' audio with one pause between groups, nothing else"
    assert np.array_equal(np.concatenate(sink.pcm), want)
    assert not live_chunks(app, outs), "with the page's own player (a sink), Gradio's live output stays empty"
    assert sink.closed and "gapless" not in app.active.by_session


def test_the_second_group_is_queued_once_the_first_has_made_its_first_chunks(app, monkeypatch):
    """The first group's small first chunks (what the listener hears while nothing is buffered yet) are made
    alone; the second group is submitted while the first still streams, once it has made SUBMIT_NEXT_AFTER_S (on an
    engine faster than real time; a slower one batches the next group at once: `_slow`, made False here)."""
    monkeypatch.setattr(speak_mod, "_slow", lambda made, first: False)
    eng = app.engine("custom_voice")
    logged = Logged(eng)
    monkeypatch.setattr(eng, "stream", logged)
    text = " ".join(f"This is sentence number {i}, spoken in order." for i in range(12))
    drain(app.speaker.speak("custom_voice", eng, speak_mod.SpeechJob(
        text=text, voice="aiden", language="english", instruct=None, seed=3, sampling={}, max_new_tokens=40),
        req("second-group"), sink=RecordingSink()))
    log = logged.log
    assert log.index(("submit", 1)) < log.index(("end", 0)), "group 1 was not queued ahead"
    assert log.index(("submit", 2)) < log.index(("end", 1)), "group 2 was not queued ahead"
    made = logged.made_before[1]
    assert speak_mod.SUBMIT_NEXT_AFTER_S * SR <= made < sum(map(len, logged.chunks[0])), made


def test_an_engine_slower_than_real_time_batches_the_second_group_at_once():
    t = time.perf_counter()
    assert speak_mod._slow(3 * 1920, (t - 0.5, 1920))            # 0.16 s made in 0.5 s: slow
    assert not speak_mod._slow(7 * 1920, (t - 0.1, 1920))        # 0.48 s made in 0.1 s: fast
    assert not speak_mod._slow(1920, (t - 0.5, 1920))            # only the first chunk: not known yet


def test_stop_cancels_the_running_and_the_queued_ahead_group(app, monkeypatch):
    eng = app.engine("custom_voice")
    logged = Logged(eng)
    monkeypatch.setattr(eng, "stream", logged)
    r = req("stop-ahead")
    text = " ".join(f"This is sentence number {i}, spoken in order." for i in range(12))
    gen = app.preset(text, "ryan", "auto", "", {}, seed=1, randomize=False, max_new_tokens=40, request=r)
    for d in gen:
        if app.c.live in d and len(logged.streams) == 2:
            break
    assert len(logged.streams) == 2, "the second group is queued ahead while the first one streams"
    assert len(app.active.by_session["stop-ahead"]) == 2
    assert "2 request(s) cancelled" in app.stop(r)
    assert all(s.seq.cancelled.is_set() or s._finished for s in logged.streams)
    outs = drain(gen)
    assert len(logged.streams) == 2, "nothing new is submitted after Stop"
    assert "stopped by the listener" in str(final_of(app, outs)[app.c.status])
    assert "stop-ahead" not in app.active.by_session
    deadline = time.time() + 10
    while not eng.scheduler.idle() and time.time() < deadline:
        time.sleep(0.02)
    assert eng.scheduler.idle(), "no request is left running or queued"


def test_a_full_queue_delays_the_next_group_instead_of_failing(app, monkeypatch):
    from tts_engine import EngineBusyError

    eng = app.engine("custom_voice")
    orig, calls = eng.stream, []

    def stream(text, **kw):
        calls.append(text)
        if len(calls) == 2:                     # the first try to queue group 2 ahead finds the queue full
            raise EngineBusyError("too many requests are waiting")
        return orig(text, **kw)
    monkeypatch.setattr(eng, "stream", stream)
    text = " ".join(f"This is sentence number {i}, spoken in order." for i in range(8))
    pieces = chunk_text(spoken_form(text, "auto"))          # as the model reads them: numbers read out
    # (groups long enough that the second is tried while the first streams: after SUBMIT_NEXT_AFTER_S of it)
    outs = drain(app.preset(text, "ryan", "auto", "", {}, seed=2, randomize=False, max_new_tokens=20))
    assert calls[:3] == [pieces[0], pieces[1], pieces[1]] and calls[2:] == pieces[1:]
    assert f"part {len(pieces)}/{len(pieces)}" in final_of(app, outs)[app.c.status]


class RecordingSink:
    """A live player as speak.Sink: records what it is given; `cancelled` turns True after `stop_after` writes."""

    def __init__(self, stop_after: int | None = None):
        self.pcm, self.closed, self.stop_after = [], False, stop_after

    def write(self, pcm):
        assert pcm.dtype == np.int16
        self.pcm.append(pcm.copy())

    def close(self):
        self.closed = True

    @property
    def cancelled(self):
        return self.stop_after is not None and len(self.pcm) >= self.stop_after


def test_a_cancelled_sink_ends_the_generation(app):
    eng = app.engine("custom_voice")
    sink = RecordingSink(stop_after=2)
    outs = drain(app.speaker.speak("custom_voice", eng, speak_mod.SpeechJob(
        text="A long sentence that would take a while to speak in full.", voice="ryan", language="auto",
        instruct=None, seed=1, sampling={}, max_new_tokens=40), req("sink-stop"), sink=sink))
    final = final_of(app, outs)
    assert len(sink.pcm) == 2 and sink.closed
    assert np.array_equal(final[app.c.final][1], np.concatenate(sink.pcm))
    assert "stopped by the listener" in final[app.c.status] and "sink-stop" not in app.active.by_session
    deadline = time.time() + 10
    while not eng.scheduler.idle() and time.time() < deadline:
        time.sleep(0.02)
    assert eng.scheduler.idle()


def test_queue_position_is_shown_while_waiting(app, monkeypatch):
    class FakeStream:
        seed = 1

        def __init__(self):
            self.positions = [2, 1, None]
            self.cancelled = False

        @property
        def position(self):
            return self.positions.pop(0) if self.positions else None

        def __iter__(self):
            yield np.full(4800, 0.25, np.float32)
            yield np.full(4800, -0.25, np.float32)

        def cancel(self):
            self.cancelled = True

    fake = FakeStream()
    eng = app.engine("custom_voice")
    monkeypatch.setattr(eng, "stream", lambda text, **kw: fake)
    monkeypatch.setattr(speak_mod.time, "sleep", lambda s: None)
    outs = drain(app.preset("Hi.", "ryan", "auto", "", {}, seed=1, randomize=False))
    statuses = [d[app.c.status] for d in outs if app.c.status in d]
    assert any("position in queue: 3 (2 ahead)" in s for s in statuses)
    assert any("position in queue: 2 (1 ahead)" in s for s in statuses)
    assert fake.cancelled   # the handle is always released
    assert final_of(app, outs)[app.c.final][1].tolist() == to_int16(np.r_[np.full(4800, .25), np.full(4800, -.25)]
                                                                    .astype(np.float32)).tolist()


def test_stop_cancels_the_engine_request(app):
    eng = app.engine("custom_voice")
    r = req("stopper")
    gen = app.preset("A long sentence that would take a while to speak in full.", "ryan", "auto", "", {},
                     seed=1, randomize=False, max_new_tokens=40, request=r)
    got = []
    for d in gen:
        if app.c.live in d:
            got.append(d[app.c.live][1])
            break
    assert app.active.by_session.get("stopper"), "the running stream is tracked for its session"
    assert "cancelled" in app.stop(r)
    rest = drain(gen)
    frames = (sum(len(x) for x in got) + sum(len(d[app.c.live][1]) for d in rest if app.c.live in d)) / 1920
    assert frames < 39, "generation ended early"
    assert "stopper" not in app.active.by_session
    import time
    deadline = time.time() + 10
    while not eng.scheduler.idle() and time.time() < deadline:
        time.sleep(0.02)
    assert eng.scheduler.idle(), "the engine slot is free again"


def test_instruct_only_where_supported(app):
    assert app.voices.supports_instruct("ryan") is False            # tiny CustomVoice is 0.6B: no instructions
    outs = drain(app.preset("Hi.", "ryan", "auto", "Speak happily.", {}, seed=1, randomize=False, max_new_tokens=4))
    assert "instruction ignored" in outs[-1][app.c.status]
    assert app.roles["voice_design"].supports_instruct
    outs = drain(app.design("Hello.", "A deep calm voice.", "english", seed=2, randomize=False, max_new_tokens=6))
    assert final_of(app, outs)[app.c.final][1].size > 0


# --- voices: clone, files, presets, blend -----------------------------------------------------------------

def test_clone_keeps_the_voice_in_the_session_and_offers_a_file(app, tmp_path):
    _needs_clone_modules()
    outs = drain(app.clone(str(OLIVER), OLIVER_TEXT, False, "Ollie", "safetensors", "Testing my clone.", "english",
                           {}, seed=5, randomize=False, max_new_tokens=8))
    final = final_of(app, outs)
    session = final[app.c.session]
    assert session["Ollie"].kind == "icl"
    v = Voice.load(final[app.c.voice_file])
    assert v.kind == "icl" and torch.equal(v.embedding, session["Ollie"].embedding)
    assert any(val == "my:Ollie" for _, val in final[app.c.p_voice]["choices"])       # offered in the other tabs
    assert all(any(val == "my:Ollie" for _, val in final[dd]["choices"]) for dd in app.c.slot_voice)
    # reuse in the preset tab and in a blend
    outs = drain(app.preset("Again.", "my:Ollie", "auto", "", session, seed=1, randomize=False, max_new_tokens=6))
    assert final_of(app, outs)[app.c.final][1].size > 0
    # x-vector only (and: no transcript -> x-vector only, said in the status)
    outs = drain(app.clone(str(OLIVER), "", False, "Ollie2", "json", "Hi.", "auto", session, seed=1,
                           randomize=False, max_new_tokens=4))
    final = final_of(app, outs)
    assert final[app.c.session]["Ollie2"].kind == "xvector" and "x-vector-only" in final[app.c.status]
    assert final[app.c.voice_file].endswith(".json") and Voice.load(final[app.c.voice_file]).kind == "xvector"
    # load a voice file back into a fresh session
    res = app.load_voice(final[app.c.voice_file], "Loaded", {})
    assert res[app.c.session]["Loaded"].kind == "xvector" and "Loaded" in res[app.c.status]


def test_bad_input_gives_clear_messages_not_tracebacks(app, tmp_path):
    _needs_clone_modules()

    def err(fn, *a, **k):
        with pytest.raises(gr.Error) as e:
            res = guard(fn)(*a, **k)
            if hasattr(res, "__next__"):
                drain(res)
        msg = str(e.value.message if hasattr(e.value, "message") else e.value)
        assert "Traceback" not in msg
        return msg

    assert "Enter some text" in err(app.preset, "   ", "ryan")
    assert "too long" in err(app.preset, "x" * 801, "ryan") and "800" in err(app.preset, "x" * 801, "ryan")
    assert "Unknown voice" in err(app.preset, "Hi.", "nobody")
    assert "language" in err(app.preset, "Hi.", "ryan", "klingon")
    assert "reference clip" in err(app.clone, None, "", False, "x", "json", "Hi.")
    notaudio = tmp_path / "notes.wav"
    notaudio.write_text("this is not audio")
    assert "audio" in err(app.clone, str(notaudio), "", True, "x", "json", "Hi.")
    m4a = tmp_path / "phone.m4a"                     # a compressed clip only ffmpeg reads
    m4a.write_bytes(b"\x00\x00\x00\x20ftypM4A \x00\x00\x02\x00M4A isomiso2" + bytes(200))
    if shutil.which("ffmpeg") is None:
        assert "`ffmpeg`, which is not installed" in err(app.clone, str(m4a), "", True, "x", "json", "Hi.")
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(24000 * 2, np.float32), 24000)
    assert "silent" in err(app.clone, str(silent), "", True, "x", "json", "Hi.")
    short = tmp_path / "short.wav"
    sf.write(short, np.random.default_rng(0).standard_normal(2400).astype(np.float32) * 0.1, 24000)
    assert "too short" in err(app.clone, str(short), "", True, "x", "json", "Hi.")
    assert "names" in err(app.clone, str(OLIVER), "", True, "../evil", "json", "Hi.")
    # voice files: wrong model width, a pickle, wrong checkpoint kind mixed in a blend
    wrong = tmp_path / "wrong.safetensors"
    Voice(kind="xvector", embedding=torch.ones(32), model_type="base").save(wrong)
    assert "different model" in err(app.load_voice, str(wrong))
    pk = tmp_path / "voice.safetensors"
    pk.write_bytes(pickle.dumps({"embedding": [1.0] * 64}))
    assert "not" in err(app.load_voice, str(pk)) and "pickle" in err(app.load_voice, str(pk))
    assert "different checkpoints" in err(app.blend, "Hi.", 2, "ryan", None, 50, "preset:emma", None, 50)
    assert "number of voices to 2" in err(app.blend_sweep, "Hi.", 3, "ryan", None, 50, "aiden", None, 50,
                                          "vivian", None, 50)
    assert "upload a voice file" in err(app.blend, "Hi.", 2, "file", None, 50, "ryan", None, 50)
    assert "weight" in err(app.blend, "Hi.", 3, "ryan", None, 0, "aiden", None, 0, "vivian", None, 0)
    assert "Describe the voice" in err(app.design, "Hi.", "  ")
    # the app still works after all that
    outs = drain(app.preset("Still here.", "ryan", "auto", "", {}, seed=1, randomize=False, max_new_tokens=4))
    assert final_of(app, outs)[app.c.final][1].size > 0


def test_blend_uses_slerp_for_two_and_nlerp_for_more(app, monkeypatch):
    eng = app.engine("custom_voice")
    rec = Recorder(eng)
    monkeypatch.setattr(eng, "stream", rec)
    drain(app.blend("Blend.", 2, "ryan", None, 50, "vivian", None, 50, a_to_b=30, seed=4, randomize=False,
                    max_new_tokens=4))
    want = B.slerp(eng.preset_embedding("ryan"), eng.preset_embedding("vivian"), 0.3)
    got = rec.calls[-1]["voice"]
    assert got.kind == "embedding" and np.allclose(got.embedding.numpy(), want, atol=1e-6)
    drain(app.blend("Blend.", 3, "ryan", None, 10, "vivian", None, 30, "aiden", None, 60, seed=4, randomize=False,
                    max_new_tokens=4))
    want = B.nlerp([eng.preset_embedding(s) for s in ("ryan", "vivian", "aiden")], [1, 3, 6])
    assert np.allclose(rec.calls[-1]["voice"].embedding.numpy(), want, atol=1e-6)
    assert layout.shares(3, 10, 30, 60, 0, 30) == ("10 %", "30 %", "60 %", "", "A 70 % · B 30 %")


def test_blend_export_round_trips_and_is_reusable(app):
    res = app.blend_export(2, "ryan", None, 50, "serena", None, 50, a_to_b=75, blend_name="RySe",
                           file_format="safetensors", session={})
    path = res[app.c.export_file]
    v = Voice.load(path)
    eng = app.engine("custom_voice")
    assert v.kind == "embedding" and v.model_type == "custom_voice" and v.name == "RySe"
    assert np.allclose(v.embedding.numpy(), B.slerp(eng.preset_embedding("ryan"), eng.preset_embedding("serena"), .75),
                       atol=1e-6)
    assert [r["share"] for r in v.meta["blend"]] == [25, 75]
    session = res[app.c.session]
    outs = drain(app.preset("Blended.", "my:RySe", "auto", "", session, seed=1, randomize=False, max_new_tokens=4))
    assert final_of(app, outs)[app.c.final][1].size > 0
    # an exported file used as a blend slot ("file")
    outs = drain(app.blend("Hi.", 2, "file", path, 50, "ryan", None, 50, seed=1, randomize=False, max_new_tokens=4))
    assert final_of(app, outs)[app.c.final][1].size > 0


def test_sweep_renders_five_points_with_one_seed_and_sentence(app, monkeypatch):
    eng = app.engine("custom_voice")
    rec = Recorder(eng)
    monkeypatch.setattr(eng, "stream", rec)
    outs = drain(app.blend_sweep("First sentence here. Second one.", 2, "ryan", None, 50, "aiden", None, 50,
                                 seed=9, randomize=False, max_new_tokens=6))
    assert len(rec.calls) == 5
    assert {c["seed"] for c in rec.calls} == {9} and {c["text"] for c in rec.calls} == {"First sentence here. Second one."}
    pts = B.sweep(eng.preset_embedding("ryan"), eng.preset_embedding("aiden"))
    for call, p in zip(rec.calls, pts):
        assert np.allclose(call["voice"].embedding.numpy(), p, atol=1e-6)
    last = outs[-1]
    assert all(last[p] is not None and last[p][1].dtype == np.int16 for p in app.c.sweep)
    assert "Sweep done" in last[app.c.status]


def test_base_presets_are_listed_cloned_on_first_use_and_cached(app, tmp_path, monkeypatch):
    _needs_clone_modules()
    presets = load_presets(ROOT / "presets")
    assert {p.id for p in presets} >= {"emma", "oliver"}
    for p in presets:
        assert p.transcript and p.source and p.licence and p.clip.is_file() and p.clip.stat().st_size < 400_000
    assert any(v == "preset:emma" for _, v in app.voices.choices(None))
    eng = app.engine("base")
    outs = drain(app.preset("Hallo.", "preset:greta", "german", "", {}, seed=1, randomize=False, max_new_tokens=4))
    assert final_of(app, outs)[app.c.final][1].size > 0
    assert app.voices.presets.cache_path(eng, app.voices.presets.get("greta")).exists()
    lib = PresetLibrary(ROOT / "presets", tmp_path / "cache")
    v = lib.voice(eng, "emma")
    assert v.kind == "icl" and lib.cache_path(eng, lib.get("emma")).exists()
    lib2 = PresetLibrary(ROOT / "presets", tmp_path / "cache")
    monkeypatch.setattr(eng, "clone_voice", lambda *a, **k: pytest.fail("should come from the disk cache"))
    assert torch.equal(lib2.voice(eng, "emma").embedding, v.embedding)


def test_offline_fallback_uses_random_tiny_weights_with_a_banner(tmp_path):
    cfg = AppConfig(checkpoints={"custom_voice": "qwen3-tts-live-tests/no-such-model", "base": "",
                                 "voice_design": ""}, device="cpu", cache_dir=tmp_path)
    a = TTSApp(cfg)
    try:
        assert a.random_roles == ["custom_voice"]
        text = a.models.banner_text()
        for part in ("random weights", "noise", "hf download", "--custom-voice-model"):
            assert part.lower() in text.lower()
        assert "random weights" in a.status("Done", role="custom_voice")
        demo = a.build()
        assert a.c.banner.visible and demo is not None
        assert a.models.has("custom_voice") and not a.models.has("base")
    finally:
        a.close()
    cfg.offline_fallback = False
    with pytest.raises(TTSError, match="Hugging Face Hub"):
        TTSApp(cfg)


def test_command_line_flags_and_environment(monkeypatch):
    a = app_mod.parse_args([])
    assert (a.host, a.port, a.share, a.tiny) == ("0.0.0.0", 7860, False, False)
    assert a.custom_voice == "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" and a.base == "Qwen/Qwen3-TTS-12Hz-0.6B-Base"
    assert not a.voice_design and a.ssl_certfile is None
    monkeypatch.setenv("TTS_PORT", "9000")
    monkeypatch.setenv("TTS_DEVICE", "cpu")
    monkeypatch.setenv("TTS_DTYPE", "bf16")
    monkeypatch.setenv("TTS_BASE_MODEL", "/models/base")
    monkeypatch.setenv("TTS_VOICE_DESIGN_MODEL", "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign")
    monkeypatch.setenv("TTS_SHARE", "1")
    a = app_mod.parse_args([])
    assert (a.port, a.device, a.dtype, a.base, a.share) == (9000, "cpu", "bf16", "/models/base", True)
    assert a.voice_design == "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"
    a = app_mod.parse_args(["--port", "8000", "--custom-voice-model", "/x", "--ssl-certfile", "c.pem",
                            "--ssl-keyfile", "k.pem", "--tiny"])
    assert (a.port, a.custom_voice, a.ssl_certfile, a.ssl_keyfile, a.tiny) == (8000, "/x", "c.pem", "k.pem", True)
    cfg = app_mod.config_from_args(a)
    assert cfg.checkpoints["custom_voice"] == "/x" and cfg.tiny


def test_every_event_has_a_stable_api_name(app):
    demo = app.build()
    names = {fn.api_name for fn in demo.fns.values()}
    assert {"preset", "clone", "blend", "blend_sweep", "blend_export", "design", "load_voice", "stop"} <= names
    assert None not in names
    public = {fn.api_name for fn in demo.fns.values() if fn.api_visibility == "public"}
    assert {"preset", "clone", "blend"} <= public
    for fn in demo.fns.values():
        if fn.api_name in ("preset", "clone", "blend"):
            assert "Parameters:" in fn.api_description
    # the Stop button cancels every generation event (and its handler cancels the engine streams)
    by_name = {fn.api_name: i for i, fn in demo.fns.items()}
    gen = {by_name[n] for n in ("preset", "clone", "blend", "blend_sweep", "design")}
    stop_btn = app.c.stop_btn._id
    assert any(fn.is_cancel_function and gen <= set(fn.cancels) and stop_btn in [t[0] for t in fn.targets]
               for fn in demo.fns.values())


def test_files_expire_and_sessions_do_not_see_each_other(app, tmp_path):
    """Uploaded/generated files are pruned after file_ttl_seconds; a voice made in one browser session is
    not offered to another."""
    _needs_clone_modules()
    old = app.files.dir / "old-entry"
    old.mkdir()
    (old / "x.wav").write_bytes(b"RIFF")
    past = time.time() - app.limits.file_ttl_seconds - 10
    os.utime(old, (past, past))
    fresh = app.files.save_voice(Voice(kind="embedding", embedding=torch.ones(64), model_type="base"), "v", "json")
    assert not old.exists() and Path(fresh).exists()
    session_a = {"Mine": Voice(kind="embedding", embedding=torch.ones(64), model_type="base", name="Mine")}
    assert "my:Mine" in [v for _, v in app.voices.choices(session_a)]
    assert "my:Mine" not in [v for _, v in app.voices.choices({})]
    with pytest.raises(TTSError, match="no voice named"):
        app.voices.resolve("my:Mine", {})


def test_without_ffmpeg_the_live_output_is_a_plain_empty_audio(tiny_dirs, tmp_path, monkeypatch):
    """Gradio's streaming gr.Audio needs ffmpeg: without it the `live` output is a normal (hidden) gr.Audio that is
    never sent audio; status updates still stream and the lossless WAV comes at the end."""
    from ui import config as config_mod

    monkeypatch.setattr(config_mod.shutil, "which", lambda name: None)
    cfg = AppConfig(checkpoints={"custom_voice": tiny_dirs["custom_voice"], "base": "", "voice_design": ""},
                    device="cpu", cache_dir=tmp_path, limits=Limits(max_new_tokens=20))
    assert cfg.gradio_live_audio is False
    a = TTSApp(cfg)
    try:
        a.build()
        assert a.c.live.streaming is False and a.c.final.streaming is False
        outs = drain(a.preset("Hello there. How are you?", "ryan", "english", "", {}, seed=7, randomize=False))
        assert not any(a.c.live in d for d in outs)
        assert sum(1 for d in outs if str(d.get(a.c.status, "")).startswith("**Streaming**")) >= 2
        sr, wav = final_of(a, outs)[a.c.final]
        assert sr == SR and wav.dtype == np.int16 and wav.size > 0
    finally:
        a.close()
    monkeypatch.setattr(config_mod.shutil, "which", lambda name: "/usr/bin/" + name)
    assert AppConfig().gradio_live_audio is True and AppConfig(live_audio=False).gradio_live_audio is False


def test_preset_with_a_live_token_streams_to_the_page_player_only(app):
    """The page's player hands its token in as the last input: the audio goes into that token's live stream
    (ui/live_player.py), the same samples as the final WAV; Gradio's live output stays empty."""
    import secrets

    tok = secrets.token_hex(16)
    outs = drain(app.preset("Hello there.", "ryan", "english", "", {}, seed=7, randomize=False, max_new_tokens=20,
                            live_token=tok, request=req("live-sess")))
    final = final_of(app, outs)[app.c.final][1]
    slot = app.live._slots[tok]          # waits for its reader (the page's fetch) for reader_wait_s
    assert slot.writer_done and slot.session == "live-sess"
    assert b"".join(slot.chunks) == final.astype("<i2").tobytes()
    assert not live_chunks(app, outs)
    assert app.live.open(tok, "live-sess") is None      # single use
    app.live._slots.pop(tok)
