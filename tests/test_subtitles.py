"""Subtitles (serving/subtitles.py): SRT / WebVTT written and read back, malformed SRT refused with the line; and
every take's subtitles: one cue per sentence group, timed from the samples the generation loop emitted for it."""
from __future__ import annotations

import pytest
import soundfile as sf

from serving.subtitles import Cue, cues_from_spans, parse_srt, to_srt, to_vtt
from tts_engine import TTSError

from live_server import tiny_gradio_app


def test_srt_and_vtt_round_trip():
    cues = [Cue(0.5, 1.25, "Hello there."), Cue(3723.004, 3724.5, "Two\n\nlines --> here")]
    srt = to_srt(cues)
    assert "00:00:00,500 --> 00:00:01,250" in srt and "01:02:03,004 --> 01:02:04,500" in srt
    back = parse_srt(srt)
    assert [(q.start, q.end) for q in back] == [(0.5, 1.25), (3723.004, 3724.5)]
    assert back[1].text == "Two lines → here"       # no blank line inside a cue, no "-->" in its text
    vtt = to_vtt(cues)
    assert vtt.startswith("WEBVTT\n\n") and "00:00:00.500 --> 00:00:01.250" in vtt
    assert "estimated" in to_vtt(cues, estimated=True)
    assert cues_from_spans([("a", 0, 24000), ("b", 24000, 24000), ("c", 30000, 36000)], 24000) == [
        Cue(0.0, 1.0, "a"), Cue(1.25, 1.5, "c")]


@pytest.mark.parametrize("text, msg", [
    ("", "empty"), ("hello\nworld", "malformed at line 1"),
    ("1\n00:00:02,000 --> 00:00:01,000\nBack.\n", "ends before it starts"),
    ("1\n00:00:01,000 --> 00:00:02,000\n\n", "no text"),
    ("1\n00:00:05,000 --> 00:00:06,000\nB\n\n2\n00:00:01,000 --> 00:00:02,000\nA\n", "not in time order"),
    ("1\n00:00:01,000 --> 00:00:02,000\nA\n\nx\n", "malformed at line 5"),
    ("\x00\x01", "not text")])
def test_malformed_srt_is_refused_with_where(text, msg):
    with pytest.raises(TTSError, match=msg):
        parse_srt(text)


def test_every_take_has_subtitles_timed_from_its_groups(tmp_path):
    text = "First sentence group here. " * 6 + "A last one."
    with tiny_gradio_app(tmp_path, max_text_chars=1500) as (app, client):
        _live, wav, status, _seed = client.predict(text=text, voice="ryan", seed=5, randomize=False,
                                                   max_new_tokens=10, api_name="/preset")
        from gradio_client import handle_file
        srt, vtt = client.predict(handle_file(wav), api_name="/ui_take_subtitles")
    audio, sr = sf.read(wav)
    from ui.text import chunk_text

    cues = parse_srt(open(srt, encoding="utf-8").read())
    assert [q.text for q in cues] == chunk_text(text)                 # one cue per sentence group
    assert all(a.end <= b.start for a, b in zip(cues, cues[1:]))      # ordered, the pauses between them
    assert cues[0].start == 0 and abs(cues[-1].end - len(audio) / sr) < 0.002
    assert open(vtt, encoding="utf-8").read().startswith("WEBVTT")


def test_speech_api_links_its_subtitles(tmp_path):
    import io
    import json
    import urllib.error
    import urllib.request

    from serving.limits import Limits
    from live_server import tiny_api

    def post(body: dict):
        req = urllib.request.Request(url + "/v1/audio/speech", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    text = "The first sentence. A second one follows! And a third?"
    with tiny_api(tmp_path, ("custom_voice",), Limits(max_new_tokens=200)) as (url, _registry, _ck):
        status, headers, body = post({"input": text, "voice": "ryan", "seed": 3, "max_new_tokens": 10,
                                      "subtitles": "srt"})
        assert status == 200 and headers["X-Seed"] == "3", body[:200]
        path = headers["X-Subtitles"]
        assert path.startswith("/v1/audio/subtitles/") and path.endswith(".srt") and path in headers["Link"]
        with urllib.request.urlopen(url + path) as r:
            cues = parse_srt(r.read().decode())
        with urllib.request.urlopen(url + path[:-4] + ".vtt") as r:
            assert r.read().decode().startswith("WEBVTT")
        audio, sr = sf.read(io.BytesIO(body))
        assert [q.text for q in cues] == ["The first sentence.", "A second one follows!", "And a third?"]
        assert all(a.end < b.start for a, b in zip(cues, cues[1:])) and cues[-1].end <= len(audio) / sr + 1e-3
        for bad, msg in [({"subtitles": "ass"}, "subtitles must be srt or vtt"),
                         ({"subtitles": "vtt", "stream": True, "response_format": "pcm"}, "whole answers")]:
            status, _h, body = post({"input": text, "voice": "ryan", **bad})
            assert status == 400 and msg in json.loads(body)["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/v1/audio/subtitles/" + "0" * 32 + ".srt")
        assert e.value.code == 404


def test_word_level_cues_are_estimated_and_inside_their_group(tmp_path, asr_env):
    from gradio_client import handle_file

    text = "First group of words here. " * 6 + "And the last."
    with tiny_gradio_app(tmp_path, max_text_chars=1500) as (app, client):
        _live, wav, _status, _seed = client.predict(text=text, voice="ryan", seed=5, randomize=False,
                                                    max_new_tokens=10, api_name="/preset")
        exact, _ = client.predict(handle_file(wav), api_name="/ui_take_subtitles")
        srt, vtt = client.predict(final=handle_file(wav), api_name="/take_words")
    groups = parse_srt(open(exact, encoding="utf-8").read())
    words = parse_srt(open(srt, encoding="utf-8").read())
    assert words[0].text == "[word timings estimated by speech recognition]"
    assert "NOTE word timings estimated" in open(vtt, encoding="utf-8").read()
    # every word lies inside one sentence group's exact span
    for w in words[1:]:
        assert any(g.start - 0.002 <= w.start <= w.end <= g.end + 0.002 for g in groups), w
