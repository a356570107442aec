"""The Dialogue tab: the script format (text and table), its limits, and /dialogue driven by gradio_client on the
launched app (tiny random checkpoints): lines in order, each with its speaker's voice on its own engine, one WAV
per line that is exactly its slice of the whole WAV, the pause between turns, Stop."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import soundfile as sf

from tts_engine import TTSError
from ui import dialogue_script as S
from ui.dialogue_tab import assign_names

from live_server import tiny_gradio_app


# --- the script, pure ---------------------------------------------------------------------------------------

def test_script_text_and_table_round_trip():
    text = "Ryan: Hello: how are you?\n\n  Vivian [whispering] : Fine.\nryan：好的。"
    lines = S.parse_script(text)
    assert [(x.speaker, x.instruct, x.text) for x in lines] == [
        ("Ryan", "", "Hello: how are you?"), ("Vivian", "whispering", "Fine."), ("ryan", "", "好的。")]
    assert S.speakers(lines) == ["Ryan", "Vivian"]            # case-insensitive, first spelling kept
    rows = S.to_rows(lines)
    assert rows[1] == ["Vivian", "whispering", "Fine."]
    again = S.from_rows(rows + [["", "", ""], [None, float("nan"), None]])   # empty rows dropped
    assert S.format_script(again) == "Ryan: Hello: how are you?\nVivian [whispering]: Fine.\nryan: 好的。"
    assert S.parse_script(S.format_script(again)) == again


def test_script_limits_are_clear_messages():
    with pytest.raises(TTSError, match="line 2 of the script"):
        S.parse_script("Ryan: Hi.\nno speaker here")
    assert S.parse_script("Ryan: Hi.\nno speaker here", strict=False)[1].speaker == ""
    with pytest.raises(TTSError, match="write the dialogue first"):
        S.check_lines([], 100)
    many = [S.Line(f"P{i % 2}", "Hi.") for i in range(S.MAX_LINES + 1)]
    with pytest.raises(TTSError, match=f"{S.MAX_LINES + 1} lines; the limit is {S.MAX_LINES}"):
        S.check_lines(many, 10_000)
    crowd = [S.Line(f"P{i}", "Hi.") for i in range(S.MAX_SPEAKERS + 1)]
    with pytest.raises(TTSError, match=f"{S.MAX_SPEAKERS + 1} speakers .* the limit is {S.MAX_SPEAKERS}"):
        S.check_lines(crowd, 10_000)
    with pytest.raises(TTSError, match="too long: 12 characters"):
        S.check_lines([S.Line("A", "Hello world!")], 10)
    with pytest.raises(TTSError, match="line 1 .*has no text"):
        S.check_lines([S.Line("A", "")], 10)
    with pytest.raises(TTSError, match="between 0 and"):
        S.check_pause(9)
    assert S.check_pause(None) == S.DEFAULT_PAUSE_S


def test_speaker_slots_keep_their_names():
    assert assign_names(["", "", "", ""], ["A", "B"]) == ["A", "B", "", ""]
    # B stays in slot 2 (and keeps its voice) when A is renamed C
    assert assign_names(["A", "B", "", ""], ["C", "B"]) == ["C", "B", "", ""]
    assert assign_names(["A", "B", "", ""], ["b", "D", "a"]) == ["A", "B", "D", ""]


# --- /dialogue over gradio_client ------------------------------------------------------------------------------

class Recorder:
    """Wraps an engine's `stream` and records (engine role, text, voice) of every request, in submission order."""

    def __init__(self):
        self.calls, self._lock = [], threading.Lock()

    def wrap(self, role, engine):
        orig = engine.stream

        def stream(text, **kw):
            v = kw.get("voice")
            with self._lock:
                self.calls.append((role, text, v if isinstance(v, str) else getattr(v, "name", None)))
            return orig(text, **kw)
        engine.stream = stream


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    rec = Recorder()

    def wrap(app):
        for role in ("custom_voice", "base"):
            rec.wrap(role, app.engine(role))
    folder = tmp_path_factory.mktemp("dialogue_ckpts")
    with tiny_gradio_app(folder, max_text_chars=1500, before_build=wrap) as (app, client):
        yield app, client, rec


SCRIPT = ("Ryan: First line, spoken by Ryan.\n"
          "Emma [cheerful]: Second line, spoken by Emma.\n"
          "Ryan: Third line, Ryan again.")


def test_dialogue_lines_in_order_with_their_voices_and_one_wav_per_line(served):
    app, client, rec = served
    rec.calls.clear()
    # slot 1 names Emma explicitly; Ryan takes the unnamed slot 2 (the first speaker no slot names)
    res = client.predict(script=SCRIPT, speaker_1="emma", voice_1="preset:emma", speaker_2="", voice_2="ryan",
                         pause=0.5, seed=4, randomize=False, max_new_tokens=16, api_name="/dialogue")
    _live, whole, status, seed, files = res
    assert seed == 4 and "Done" in status and "3 lines" in status
    assert "Ryan = ryan (CustomVoice)" in status and "Emma = preset:emma (Base)" in status
    # Emma's instruction is dropped with a note: the tiny Base checkpoint does not follow instructions
    assert "instruction ignored for Emma" in status
    # every line went to its speaker's engine, in the script's order, each submitted once
    assert [(r, t) for r, t, _v in rec.calls] == [("custom_voice", "First line, spoken by Ryan."),
                                                  ("base", "Second line, spoken by Emma."),
                                                  ("custom_voice", "Third line, Ryan again.")]
    assert [v for _r, _t, v in rec.calls][0::2] == ["ryan", "ryan"]
    # one WAV per line, in order; the whole WAV is line 1, 0.5 s of silence, line 2, 0.5 s, line 3
    assert [f.rsplit("/", 1)[1] for f in files] == ["01_Ryan.wav", "02_Emma.wav", "03_Ryan.wav"]
    all_, sr = sf.read(whole, dtype="int16")
    assert sr == 24000 and sf.info(whole).subtype == "PCM_16"
    lines = [sf.read(f, dtype="int16")[0] for f in files]
    assert all(len(x) > 0 for x in lines)
    pause = np.zeros(12000, np.int16)
    assert np.array_equal(all_, np.concatenate([lines[0], pause, lines[1], pause, lines[2]]))


def test_dialogue_refuses_bad_scripts_with_clear_messages(served):
    from gradio_client.exceptions import AppError

    _app, client, _rec = served
    with pytest.raises(AppError, match="5 speakers .* the limit is 4"):
        client.predict(script="\n".join(f"P{i}: Hi." for i in range(5)), voice_1="ryan", api_name="/dialogue")
    with pytest.raises(AppError, match="41 lines; the limit is 40"):
        client.predict(script="\n".join(f"P{i % 2}: Hi." for i in range(41)), voice_1="ryan", voice_2="aiden",
                       api_name="/dialogue")
    with pytest.raises(AppError, match="[Ll]ine 2 of the script"):
        client.predict(script="Ryan: Hi.\nHello?", voice_1="ryan", api_name="/dialogue")
    with pytest.raises(AppError, match="voice of Bob: unknown voice 'nobody'"):
        client.predict(script="Ann: Hi.\nBob: Hey.", voice_1="ryan", voice_2="nobody", api_name="/dialogue")
    with pytest.raises(AppError, match="[Cc]hoose a voice for Bob"):
        client.predict(script="Ann: Hi.\nBob: Hey.", voice_1="ryan", voice_2="", api_name="/dialogue")


def test_dialogue_stop_ends_it_and_frees_the_engines(served):
    app, client, rec = served
    rec.calls.clear()
    script = "\n".join(f"{'Ann' if i % 2 else 'Bob'}: This is line number {i} of a long conversation."
                       for i in range(12))
    job = client.submit(script=script, voice_1="ryan", voice_2="aiden", pause=0.2, max_new_tokens=400,
                        api_name="/dialogue")
    t0 = time.monotonic()
    while not any(str(o[2]).startswith("**Streaming**") for o in job.outputs()):
        assert time.monotonic() - t0 < 60, "no audio streamed"
        time.sleep(0.05)
    assert "request(s) cancelled" in client.predict(api_name="/stop")
    final = job.result(timeout=60)
    eng = app.engine("custom_voice")
    deadline = time.monotonic() + 20
    while not eng.scheduler.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.scheduler.idle() and not app.active.by_session
    assert "stopped by the listener" in final[2]
    # at most the running line and the one submitted ahead of it were ever requested
    assert len(rec.calls) <= 3, rec.calls
    assert final[4] is None or len(final[4]) < 12
