"""What the model reads (serving/text_prep.py): pause tags, the pronunciation dictionary, numbers read out; checked
on the pure functions, on the token ids the engine receives from the page's handlers, and on the audio of pauses in
the page's stream and WAV and in the speech API's answers (tiny random checkpoints)."""
from __future__ import annotations

import io
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile as sf

from serving import text_prep as tp
from serving.limits import Limits
from tts_engine import TTSError


# --- pause tags -------------------------------------------------------------------------------------------------

def test_pause_tags_cut_the_text_with_their_lengths():
    p = tp.prepare("One. [pause 1s] Two. [Pause 500ms] Three [pause 0.25 s]", "english")
    assert [(s.text, s.pause_s) for s in p.segments] == [("One.", 1.0), ("Two.", 0.5), ("Three", 0.25)]
    assert p.preview == "One. [pause 1s] Two. [pause 0.5s] Three [pause 0.25s]"
    lead = tp.prepare("[pause 2s] Hi [pause 1s][pause 1s] there")
    assert lead.lead_s == 2.0 and [s.pause_s for s in lead.segments] == [2.0, None]
    ssml = tp.prepare('<speak>A <break time="500ms"/> B <break time=\'1.5s\' /> C <break strength="strong"/> D</speak>',
                      ssml=True)
    assert [s.pause_s for s in ssml.segments] == [0.5, 1.5, 0.75, None]
    # SSML only in the API: the page reads a <break> as text
    assert len(tp.prepare('A <break time="500ms"/> B').segments) == 1


@pytest.mark.parametrize("text, match", [
    ("a [pause -1s] b", r"between 0 and 10 s, got -1 s"),
    ("a [pause 99s] b", r"between 0 and 10 s, got 99 s"),
    ("a [pause 1s b", r"unclosed or malformed pause tag '\[pause 1s b'"),
    ("a [pause] b", r"give a length in s or ms"),
    ("a [pause 2 minutes] b", r"give a length in s or ms"),
    ("[pause 1s]", r"nothing to say"),
])
def test_bad_pause_tags_get_a_clear_message(text, match):
    with pytest.raises(tp.TextPrepError, match=match) as e:
        tp.prepare(text)
    assert isinstance(e.value, TTSError)


def test_bad_ssml_breaks_get_a_clear_message():
    for text, match in [('a <break time="500ms"> b', "unclosed or malformed"), ("a <break/> b", "give its length"),
                        ('a <break time="-2s"/> b', "between 0 and 10 s"), ('a <break strength="huge"/> b', "strength")]:
        with pytest.raises(tp.TextPrepError, match=match):
            tp.prepare(text, ssml=True)


# --- the dictionary ------------------------------------------------------------------------------------------------

def test_dictionary_whole_words_phrases_and_case():
    lx = tp.parse_lexicon("# comment\nQwen = Kwen\nSQL = sequel\ngif = jif\nNew York = Noo York\ne.g. = for instance\n"
                          "New = Nu")
    out = lx.apply("Qwen knows SQL, sql, GIF and Gif in New  York, New Jersey, e.g. here. Qwenny, SQLite")
    assert out == "Kwen knows sequel, sql, jif and jif in Noo York, Nu Jersey, for instance here. Qwenny, SQLite"
    # the page's table (rows, empty rows skipped), a JSON object, later dictionaries win
    table = tp.parse_lexicon([["Qwen", "Chwen"], ["", ""], ["tomato", "tomahto"]])
    assert len(table) == 2 and tp.Lexicon.merged(lx, table).apply("Qwen TOMATO") == "Chwen tomahto"
    assert tp.parse_lexicon('{"AI": "A.I."}').apply("AI, ai") == "A.I., ai"
    for bad in ('{"x": ', [["word", ""]], "just a line without separator"):
        with pytest.raises(tp.TextPrepError):
            tp.parse_lexicon(bad)


def test_the_server_dictionary_comes_from_its_file(tmp_path, monkeypatch):
    f = tmp_path / "lexicon.txt"
    f.write_text("Nginx = engine x\n", encoding="utf-8")
    monkeypatch.setenv(tp.LEXICON_ENV, str(f))
    assert tp.server_lexicon().apply("Nginx runs") == "engine x runs"
    f.write_text("not a dictionary line\n", encoding="utf-8")
    assert len(tp.server_lexicon()) == 0 or tp.server_lexicon().apply("Nginx") == "Nginx"   # bad file: not used


# --- numbers and abbreviations ------------------------------------------------------------------------------------

def test_numbers_dates_times_currencies_read_out_per_language():
    en = tp.spoken_form("Dr. Smith paid $5 and 12.50 EUR on 2024-03-05 at 9:30 pm, 15% more than the 3rd time; "
                        "1,234 km.", "english")
    assert en == ("Doctor Smith paid five dollars and twelve euro, fifty cents on March fifth, twenty twenty-four at "
                  "nine thirty p.m., fifteen percent more than the third time; one thousand, two hundred and "
                  "thirty-four kilometers.")
    de = tp.spoken_form("Es kostet 1.234,50 € und 15 % mehr, z.B. um 9:30.", "german")
    assert "eintausendzweihundertvierunddreißig Euro und fünfzig Cent" in de and "fünfzehn Prozent" in de
    assert "zum Beispiel" in de and "neun Uhr dreißig" in de
    assert tp.spoken_form("Il a 21 ans.", "french") == "Il a vingt et un ans."
    assert tp.spoken_form("我有3个苹果", "chinese") == "我有3个苹果"          # num2words has no Chinese: unchanged
    assert tp.spoken_form("Привет 5 друзей", "auto") == "Привет пять друзей"
    assert tp.spoken_form("I have 3 cats, MP3 files and COVID-19.", "auto") == \
        "I have three cats, MP3 files and COVID-nineteen."
    assert tp.spoken_form("I have 3 cats.", "english", read_out=False) == "I have 3 cats."
    assert tp.spoken_form("In 1999 we had 1999 apples.", "english") == \
        "In nineteen ninety-nine we had one thousand, nine hundred and ninety-nine apples."
    # the dictionary comes first: its respellings win over the number reading
    assert tp.spoken_form("Call 911 now", "english", tp.Lexicon({"911": "nine one one"})) == "Call nine one one now"


# --- on the engine: the token ids the model receives ------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from tests.live_server import tiny_checkpoint
    from ui.app import TTSApp
    from ui.config import AppConfig

    d = tmp_path_factory.mktemp("text_prep_app")
    cfg = AppConfig(checkpoints={"custom_voice": str(tiny_checkpoint(d / "cv", kind="custom_voice", size="0b6", seed=0))},
                    device="cpu", cache_dir=d / "cache", live_audio=True,
                    limits=Limits(max_text_chars=800, max_new_tokens=12, max_queue=16))
    a = TTSApp(cfg)
    a.build()
    yield a
    a.close()


def _req(name):
    return SimpleNamespace(session_hash=name)


def _drain(gen):
    return list(gen)


def test_dictionary_and_numbers_change_the_token_ids_not_the_text_shown(app, monkeypatch):
    engine = app.engine("custom_voice")
    tok = engine.model.tokenizer
    seen = []
    real = tok.assistant_ids

    def spy(text):
        ids = real(text)
        seen.append(ids.flatten().tolist())
        return ids
    monkeypatch.setattr(tok, "assistant_ids", spy)
    text = "Qwen has 3 cats."
    base = real("Qwen has 3 cats.").flatten().tolist()
    want = real("Kwen has three cats.").flatten().tolist()
    assert base != want

    app.text_settings([["Qwen", "Kwen"]], True, "off", 0, request=_req("tok"))
    assert app.preview(text, "english", request=_req("tok")) == "Kwen has three cats."
    outs = _drain(app.preset(text, "ryan", "english", "", {}, seed=1, randomize=False, request=_req("tok")))
    assert seen == [want]
    assert outs[-1][app.c.final] is not None
    # switched off: digits reach the model as digits; no dictionary: the word as written
    seen.clear()
    app.text_settings(None, False, "off", 0, request=_req("tok"))
    _drain(app.preset(text, "ryan", "english", "", {}, seed=1, randomize=False, request=_req("tok")))
    assert seen == [base]
    with pytest.raises(Exception, match="between 0 and 10 s"):
        _drain(app.preset("Hi [pause 99s] there", "ryan", "english", "", {}, request=_req("tok")))


def test_dialogue_lines_use_the_session_dictionary_and_pause_tags(app, monkeypatch):
    tok = app.engine("custom_voice").model.tokenizer
    seen, real = [], tok.assistant_ids
    monkeypatch.setattr(tok, "assistant_ids", lambda text: seen.append(text) or real(text))
    app.text_settings([["Qwen", "Kwen"]], True, "off", 0, request=_req("dlg"))
    outs = _drain(app.dialogue("Ann: Qwen is 2 days old. [pause 0.5s] Really.\nBob: Hi.", voice_1="ryan",
                               voice_2="aiden", pause=0.2, language="english", seed=1, randomize=False,
                               request=_req("dlg")))
    assert seen == ["Kwen is two days old.", "Really.", "Hi."]
    assert outs[-1][app.c.final] is not None
    # a tag that ends a line adds its silence to the pause before the next line: 0.2 s + 1 s of zeros, exactly
    outs = _drain(app.dialogue("Ann: One. [pause 1s]\nBob: Two.", voice_1="ryan", voice_2="aiden", pause=0.2,
                               language="english", seed=1, randomize=False, request=_req("dlg")))
    live = [d[app.c.live][1] for d in outs if app.c.live in d]
    assert [len(x) for x in live if len(x) and not x.any()] == [28800]


# --- pauses in the sound: the page's stream and WAV ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["off", "redo"])
def test_a_pause_tag_is_exactly_that_many_zero_samples_in_the_stream_and_the_wav(app, mode):
    session = _req(f"pause-{mode}")
    app.text_settings(None, True, mode, 2, request=session)
    outs = _drain(app.preset("One. [pause 1s] Two.", "ryan", "english", "", {}, seed=5, randomize=False,
                             request=session))
    live = [pcm for d in outs if app.c.live in d for _sr, pcm in [d[app.c.live]]]
    wav = outs[-1][app.c.final][1]
    assert np.array_equal(np.concatenate(live), wav), "the stream and the WAV are the same samples"
    silent = [i for i, x in enumerate(live) if len(x) and not x.any()]
    assert len(silent) == 1 and len(live[silent[0]]) == 24000
    before = sum(len(x) for x in live[:silent[0]])
    assert before > 0 and len(wav) - before - 24000 > 0, "speech on both sides of the pause"
    assert not wav[before:before + 24000].any()
    # a trailing tag is silence at the end
    outs = _drain(app.preset("One. [pause 0.5s]", "ryan", "english", "", {}, seed=5, randomize=False,
                             request=session))
    wav2 = outs[-1][app.c.final][1]
    assert not wav2[-12000:].any() and wav2[:-12000].any()


# --- pauses in the sound: the speech API ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from tests.live_server import tiny_api

    with tiny_api(tmp_path_factory.mktemp("text_prep_api"), ("custom_voice",),
                  Limits(max_text_chars=300, max_new_tokens=12, max_per_client=8)) as (url, registry, _):
        yield url


def _pcm(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, np.int16)


def test_api_pauses_are_exact_zero_runs_in_stream_and_wav(api):
    body = {"input": "One. [pause 1s] Two.", "voice": "ryan", "seed": 3, "response_format": "pcm"}
    whole = _pcm(httpx.post(f"{api}/v1/audio/speech", json=body, timeout=120))
    streamed = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "stream": True}, timeout=120))
    r = httpx.post(f"{api}/v1/audio/speech", json={**body, "response_format": "wav"}, timeout=120)
    wav, sr = sf.read(io.BytesIO(r.content), dtype="int16")
    assert sr == 24000
    # each part alone: where the pause starts, and how long the answer is (random weights never end speech: every
    # take runs to max_new_tokens, so the lengths are exact; the samples may differ where the engine batched the
    # second part with the first)
    one = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "input": "One."}, timeout=120))
    two = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "input": "Two."}, timeout=120))
    assert len(one) > 0 and len(two) > 0
    for x in (whole, streamed, wav):
        assert len(x) == len(one) + 24000 + len(two)
        assert not x[len(one):len(one) + 24000].any() and x[:len(one)].any() and x[len(one) + 24000:].any()
    ssml = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "input": 'One. <break time="250ms"/> Two.'},
                           timeout=120))
    assert not ssml[len(one):len(one) + 6000].any() and len(ssml) == len(whole) - 18000
    checks = r.headers["x-take-check"].split("; ")        # one per part: capped by max_new_tokens, not failed
    assert len(checks) == 2 and all(c.startswith("pass,seed=3,") and "capped" in c for c in checks)


@pytest.mark.parametrize("inp, match", [("a [pause -1s] b", "got -1 s"), ("a [pause 99s] b", "got 99 s"),
                                        ("a [pause 1s b", "unclosed"), ('a <break time="1s"> b', "unclosed")])
def test_api_bad_tags_are_400_naming_input(api, inp, match):
    r = httpx.post(f"{api}/v1/audio/speech", json={"input": inp, "voice": "ryan"}, timeout=60)
    assert r.status_code == 400 and match in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "input"


def test_api_lexicon_field_and_bad_entries(api):
    body = {"input": "Qwen", "voice": "ryan", "seed": 3, "response_format": "pcm"}
    a = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "lexicon": {"Qwen": "Kwen"}}, timeout=120))
    b = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "input": "Kwen"}, timeout=120))
    assert np.array_equal(a, b), "the respelling is what the model read"
    r = httpx.post(f"{api}/v1/audio/speech", json={**body, "lexicon": {"Qwen": ""}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lexicon"
    big = {f"w{i}": "x" for i in range(tp.REQUEST_LEXICON_MAX + 1)}
    r = httpx.post(f"{api}/v1/audio/speech", json={**body, "lexicon": big}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lexicon" and "TTS_LEXICON_FILE" in r.text
    n1 = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "input": "3"}, timeout=120))
    n2 = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "input": "three"}, timeout=120))
    n3 = _pcm(httpx.post(f"{api}/v1/audio/speech", json={**body, "input": "3", "read_numbers": False}, timeout=120))
    assert np.array_equal(n1, n2) and not np.array_equal(n1, n3)
