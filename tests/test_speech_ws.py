"""`/v1/audio/speech/stream` (WebSocket) in vLLM-Omni's protocol, driven by the `websockets` client against a
real server on loopback (tiny checkpoints).

Message names and fields from vLLM-Omni's docs/serving/speech_api.md ("Streaming Text Input (WebSocket)") and
its vllm_omni/entrypoints/openai/serving_speech_stream.py: session.config / input.text / input.done /
session.close in; audio.start, binary audio, audio.done, session.done and error out."""
from __future__ import annotations

import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from serving.limits import Limits
from tests.live_server import tiny_api

MAX_FRAMES = 1500


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = Limits(max_text_chars=300, max_new_tokens=MAX_FRAMES, max_per_client=8)
    with tiny_api(tmp_path_factory.mktemp("ws"), ("custom_voice", "base"), limits) as (url, registry, _):
        yield url.replace("http://", "ws://") + "/v1/audio/speech/stream", registry


def send(ws, **msg):
    ws.send(json.dumps(msg))


def collect(ws, until="session.done", timeout=120):
    """Messages until one of type `until`: a list of dicts and bytes, in arrival order."""
    out = []
    deadline = time.time() + timeout
    while True:
        m = ws.recv(timeout=max(0.1, deadline - time.time()))
        if isinstance(m, bytes):
            out.append(m)
            continue
        m = json.loads(m)
        out.append(m)
        if m["type"] == until:
            return out


def sentences(msgs) -> list[dict]:
    """Per sentence: its start and done events and the audio between them; checks the order of events."""
    out, cur = [], None
    for m in msgs:
        if isinstance(m, bytes):
            assert cur is not None, "audio outside a sentence"
            cur["audio"] += m
            cur["frames"] += 1
        elif m["type"] == "audio.start":
            assert cur is None, "a sentence started before the previous one was done"
            cur = {"start": m, "audio": b"", "frames": 0}
        elif m["type"] == "audio.done":
            assert cur is not None and m["sentence_index"] == cur["start"]["sentence_index"]
            cur["done"] = m
            out.append(cur)
            cur = None
    assert cur is None
    return out


def test_text_pieces_become_sentences_spoken_in_order(server):
    url, _ = server
    with connect(url) as ws:
        send(ws, type="session.config", voice="ryan", response_format="pcm", stream_audio=True,
             max_new_tokens=6, seed=1)
        for piece in ("Hello there", ". How are", " you? Fine", " thanks"):
            send(ws, type="input.text", text=piece)
        send(ws, type="input.done")
        msgs = collect(ws)
    assert msgs[-1] == {"type": "session.done", "utterance_index": 0, "total_sentences": 3}
    got = sentences(msgs)
    assert [s["start"]["sentence_text"] for s in got] == ["Hello there.", "How are you?", "Fine thanks"]
    assert [s["start"]["sentence_index"] for s in got] == [0, 1, 2]
    for s in got:
        assert s["start"]["format"] == "pcm" and s["start"]["sample_rate"] == 24000
        assert s["done"]["error"] is False and s["done"]["total_bytes"] == len(s["audio"]) > 0
        assert len(s["audio"]) % (1920 * 2) == 0     # whole 80 ms frames of int16: nothing inserted
        assert s["frames"] >= 1


def test_a_sentence_is_spoken_before_the_utterance_ends(server):
    url, _ = server
    with connect(url) as ws:
        send(ws, type="session.config", voice="aiden", response_format="pcm", stream_audio=True, max_new_tokens=4)
        send(ws, type="input.text", text="First sentence. Second")
        early = collect(ws, until="audio.done")       # no input.done sent yet
        assert sentences(early)[0]["start"]["sentence_text"] == "First sentence."
        send(ws, type="input.text", text=" one.")
        send(ws, type="input.done")
        rest = collect(ws)
        assert [s["start"]["sentence_text"] for s in sentences(rest)] == ["Second one."]
        # the connection stays open for the next utterance, with the same config
        send(ws, type="input.text", text="Again.")
        send(ws, type="input.done")
        again = collect(ws)
        assert again[-1] == {"type": "session.done", "utterance_index": 1, "total_sentences": 1}
        assert sentences(again)[0]["start"]["utterance_index"] == 1


class Recorder:
    """Wraps engine.stream: logs ("submit", text) and ("end", text) in order; keeps the streams."""

    def __init__(self, engine, monkeypatch):
        self.log, self.streams, self.lock = [], [], threading.Lock()
        real = engine.stream

        def stream(text, **kw):
            s = real(text, **kw)
            with self.lock:
                self.log.append(("submit", text))
                self.streams.append(s)
            return Proxy(s, text, self)

        monkeypatch.setattr(engine, "stream", stream)


class Proxy:
    def __init__(self, s, text, rec):
        self.s, self.text, self.rec = s, text, rec

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.s)
        except StopIteration:
            with self.rec.lock:
                self.rec.log.append(("end", self.text))
            raise

    def cancel(self):
        self.s.cancel()


def test_the_next_sentence_is_in_the_engine_while_one_is_spoken(server, monkeypatch):
    url, registry = server
    rec = Recorder(registry.get("custom_voice"), monkeypatch)
    with connect(url) as ws:
        send(ws, type="session.config", voice="serena", response_format="wav", stream_audio=True, max_new_tokens=6)
        send(ws, type="input.text", text="One. Two. Three. Four.")
        send(ws, type="input.done")
        msgs = collect(ws)
    got = sentences(msgs)
    assert [s["start"]["sentence_text"] for s in got] == ["One.", "Two.", "Three.", "Four."]
    assert all(s["audio"][:4] == b"RIFF" for s in got)      # wav: a header opens each sentence's audio
    log = rec.log
    pos = {e: i for i, e in enumerate(log)}
    assert [t for k, t in log if k == "submit"] == ["One.", "Two.", "Three.", "Four."]
    assert pos[("submit", "Two.")] < pos[("end", "One.")]          # queued while One. was spoken
    assert pos[("end", "One.")] < pos[("submit", "Three.")]        # at most two per socket in the engine
    assert pos[("submit", "Three.")] < pos[("end", "Two.")]
    assert pos[("submit", "Four.")] < pos[("end", "Three.")]


def test_closing_the_socket_cancels_what_is_running(server, monkeypatch):
    url, registry = server
    engine = registry.get("custom_voice")
    rec = Recorder(engine, monkeypatch)
    with connect(url) as ws:
        send(ws, type="session.config", voice="vivian", response_format="pcm", stream_audio=True)   # MAX_FRAMES each
        send(ws, type="input.text", text="A long first sentence. A second one. A third. A fourth.")
        first = ws.recv(timeout=60)
        assert json.loads(first)["type"] == "audio.start"
        assert isinstance(ws.recv(timeout=60), bytes)                 # audio is flowing; hang up
    deadline = time.time() + 20
    while (engine.scheduler.running or engine.scheduler.waiting) and time.time() < deadline:
        time.sleep(0.02)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert len(engine.scheduler.free_rows) == engine.max_batch
    submitted = [t for k, t in rec.log if k == "submit"]
    assert submitted == ["A long first sentence.", "A second one."]    # the rest never reached the engine
    assert all(s.seq.cancelled.is_set() for s in rec.streams)
    assert all(len(s.request.codes) < MAX_FRAMES for s in rec.streams)
    time.sleep(0.3)
    assert [t for k, t in rec.log if k == "submit"] == submitted


def test_whole_sentence_frames_and_a_cloned_voice(server):
    url, _ = server
    t = np.arange(24000) / 24000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 24000, format="WAV")
    ref = "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()
    with connect(url) as ws:
        send(ws, type="session.config", task_type="Base", ref_audio=ref, ref_text="A tone.", response_format="wav",
             max_new_tokens=5, language="english")
        send(ws, type="input.text", text="Cloned over a socket. Twice.")
        send(ws, type="input.done")
        got = sentences(collect(ws))
    assert len(got) == 2
    for s in got:                       # stream_audio false: one frame per sentence, a whole WAV file
        assert s["frames"] == 1
        wav, sr = sf.read(io.BytesIO(s["audio"]))
        assert sr == 24000 and len(wav) > 0


def test_session_close_finishes_then_closes(server):
    url, _ = server
    with connect(url) as ws:
        send(ws, type="session.config", voice="ryan", stream_audio=True, max_new_tokens=4)
        send(ws, type="input.text", text="Last words. ")
        send(ws, type="input.done")
        send(ws, type="session.close")
        msgs = collect(ws)
        assert len(sentences(msgs)) == 1
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)


@pytest.mark.parametrize("first,text", [
    ({"type": "input.text", "text": "Hi."}, "expected session.config"),
    ({"type": "session.config", "voice": "nobody"}, "unknown voice"),
    ({"type": "session.config", "voice": "ryan", "split_granularity": "word"}, "split_granularity"),
    ({"type": "session.config", "voice": "ryan", "stream_audio": True, "response_format": "flac"}, "response_format"),
    ({"type": "session.config", "voice": "ryan", "seed": "abc"}, "invalid session config"),
])
def test_a_bad_first_message_gets_an_error_then_the_socket_closes(server, first, text):
    url, _ = server
    with connect(url) as ws:
        ws.send(json.dumps(first))
        m = json.loads(ws.recv(timeout=30))
        assert m["type"] == "error" and text in m["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)


def test_errors_later_in_a_session_are_not_fatal(server):
    url, _ = server
    with connect(url) as ws:
        send(ws, type="session.config", voice="ryan", max_new_tokens=4, stream_audio=True)
        ws.send("not json")
        assert "invalid JSON" in json.loads(ws.recv(timeout=10))["message"]
        send(ws, type="input.text", text=42)
        assert "string" in json.loads(ws.recv(timeout=10))["message"]
        send(ws, type="bogus")
        assert "unknown message type" in json.loads(ws.recv(timeout=10))["message"]
        send(ws, type="input.text", text="Half a sentence")
        send(ws, type="session.config", voice="aiden")
        assert "in progress" in json.loads(ws.recv(timeout=10))["message"]
        send(ws, type="input.done")
        msgs = collect(ws)
        assert [s["start"]["sentence_text"] for s in sentences(msgs)] == ["Half a sentence"]
        send(ws, type="session.config", voice="aiden", max_new_tokens=4)   # between utterances: fine
        send(ws, type="input.text", text="New voice.")
        send(ws, type="input.done")
        assert sentences(collect(ws))[0]["done"]["error"] is False


def test_a_failing_sentence_is_reported_and_the_next_ones_still_speak(server, monkeypatch):
    from tts_engine import TTSError

    url, registry = server
    engine = registry.get("custom_voice")
    real = engine.stream

    def stream(text, **kw):
        if text == "Bad one.":
            raise TTSError("this sentence cannot be spoken")
        return real(text, **kw)

    monkeypatch.setattr(engine, "stream", stream)
    with connect(url) as ws:
        send(ws, type="session.config", voice="ryan", stream_audio=True, max_new_tokens=4)
        send(ws, type="input.text", text="Good one. Bad one. Good again.")
        send(ws, type="input.done")
        msgs = collect(ws)
    errors = [m for m in msgs if isinstance(m, dict) and m["type"] == "error"]
    assert len(errors) == 1 and "cannot be spoken" in errors[0]["message"]
    got = sentences(msgs)
    assert [(s["start"]["sentence_text"], s["done"]["error"]) for s in got] == [
        ("Good one.", False), ("Bad one.", True), ("Good again.", False)]
    assert got[1]["audio"] == b"" and got[2]["audio"]


def test_timeouts_wait_for_the_config_and_never_cut_speech_short(server, monkeypatch):
    from server import speech_ws

    url, _ = server
    monkeypatch.setattr(speech_ws, "CONFIG_TIMEOUT_S", 0.3)
    monkeypatch.setattr(speech_ws, "IDLE_TIMEOUT_S", 0.3)
    with connect(url) as ws:                       # no config: an error, then the socket closes
        assert "session.config" in json.loads(ws.recv(timeout=10))["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    with connect(url) as ws:                       # idle only once everything sent has been spoken
        send(ws, type="session.config", voice="ryan", stream_audio=True, max_new_tokens=40)
        send(ws, type="input.text", text="One sentence that takes a while. And another one after it.")
        send(ws, type="input.done")
        msgs = collect(ws)
        assert [s["done"]["error"] for s in sentences(msgs)] == [False, False]
        assert "idle timeout" in json.loads(ws.recv(timeout=10))["message"]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)


def test_each_sentence_is_exactly_what_the_engine_says_for_it(server):
    """Nothing inserted, dropped or reordered: with a seed, each sentence's audio over the socket is the engine's
    own audio for that sentence (a request's audio depends only on its seed, not on what shares its batch)."""
    from server.audio_formats import to_int16

    url, registry = server
    engine = registry.get("custom_voice")
    texts = ["First things first.", "Then the second.", "And a third."]
    with connect(url) as ws:
        send(ws, type="session.config", voice="ryan", response_format="pcm", stream_audio=True, max_new_tokens=6,
             seed=7, language="english")
        send(ws, type="input.text", text=" ".join(texts))
        send(ws, type="input.done")
        got = sentences(collect(ws))
    assert [s["start"]["sentence_text"] for s in got] == texts
    for s, text in zip(got, texts):
        alone = engine.synthesize(text, voice="ryan", seed=7, max_new_tokens=6, language="english")
        assert s["audio"] == to_int16(alone).tobytes()


def test_a_socket_takes_one_of_its_clients_places(server):
    import contextlib

    url, _ = server
    limit = 8                      # the fixture's max_per_client
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connect(url)) for _ in range(limit)]
        for ws in socks:
            send(ws, type="session.config", voice="ryan")
        with connect(url) as extra:
            m = json.loads(extra.recv(timeout=10))
            assert m["type"] == "error" and "too many concurrent requests" in m["message"]
            with pytest.raises(ConnectionClosed):
                extra.recv(timeout=10)
    deadline = time.time() + 10
    while True:                    # the places are given back when the sockets close
        try:
            with connect(url) as ws:
                send(ws, type="session.config", voice="ryan", max_new_tokens=4, stream_audio=True)
                send(ws, type="input.text", text="Back.")
                send(ws, type="input.done")
                if json.loads(ws.recv(timeout=30))["type"] == "audio.start":
                    break
        except ConnectionClosed:
            pass
        assert time.time() < deadline, "the places were not given back"
        time.sleep(0.1)


def test_pause_tags_the_dictionary_and_numbers_in_a_session(server):
    """What the page and /v1/audio/speech read (serving/text_prep.py), the socket reads too: a pause tag gives exactly
    its silence, the session's dictionary and number reading change what the engine is asked to say (not the
    sentence text reported back), and a bad tag is a non-fatal error for its sentence."""
    from server.audio_formats import to_int16
    from serving import text_prep

    url, registry = server
    engine = registry.get("custom_voice")
    with connect(url) as ws:
        send(ws, type="session.config", voice="ryan", response_format="pcm", stream_audio=True, max_new_tokens=6,
             seed=7, language="english", lexicon={"Qwen": "chwen"})
        got = []
        for text in ("Qwen costs 5 dollars.", "[pause 1s] Again."):   # one utterance each: each alone in the engine
            send(ws, type="input.text", text=text)
            send(ws, type="input.done")
            got += sentences(collect(ws))
        send(ws, type="input.text", text="Wait [pause 99s] here.")
        send(ws, type="input.done")
        bad = collect(ws)
    said = text_prep.prepare("Qwen costs 5 dollars.", "english", text_prep.Lexicon({"Qwen": "chwen"})).spoken
    assert "chwen" in said and "five" in said
    assert [s["start"]["sentence_text"] for s in got] == ["Qwen costs 5 dollars.", "[pause 1s] Again."]
    alone = [to_int16(engine.synthesize(t, voice="ryan", seed=7, max_new_tokens=6, language="english"))
             for t in (said, "Again.")]

    def same(pcm: bytes, want: np.ndarray) -> None:   # the engine's audio for that text (a chunk decoded beside
        got_ = np.frombuffer(pcm, np.int16)          # another stream's may round 1-2 LSB apart in fp32)
        assert len(got_) == len(want) and np.abs(got_.astype(np.int32) - want).max() <= 2

    same(got[0]["audio"], alone[0])
    assert got[1]["audio"][:2 * 24000] == bytes(2 * 24000)          # exactly one second of silence, then the words
    same(got[1]["audio"][2 * 24000:], alone[1])
    errors = [m for m in bad if isinstance(m, dict) and m["type"] == "error"]
    assert errors and "pause" in errors[0]["message"]
