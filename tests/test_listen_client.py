"""Listening tests through gradio_client on the launched app (tiny random checkpoints): a whole ABX test and a whole
MUSHRA test (start, fetch every stimulus, answer, report: CSV and JSON), the exported JSON loaded again makes the
same test, each trial's stimuli are loudness-matched within 0.5 LU, and bad input (unknown voice or model, a precision
this device cannot hold, too many stimuli or trials, answers to an unknown or finished test) comes back as a readable
error that changes nothing."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from live_server import tiny_gradio_app
from serving import listen as ls
from tts_engine import TTSError


def listen_app(folder: Path, max_new_tokens: int = 30):
    """The Gradio app on tiny random CustomVoice and Base checkpoints in fp32 (precision stimuli load their own
    engines), launched on loopback; short renders (at most `max_new_tokens` frames). Yields (app, client)."""
    return tiny_gradio_app(folder, max_text_chars=500, max_new_tokens=max_new_tokens, dtype="fp32", quantize="none")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with listen_app(tmp_path_factory.mktemp("listen_client")) as served:
        yield served


def _samples(path) -> np.ndarray:
    x, sr = sf.read(path, dtype="float32")
    info = sf.info(path)
    assert sr == 24000 and info.subtype == "PCM_16" and info.channels == 1 and x.size > 2400
    return x


def _lufs(x: np.ndarray) -> float:
    return ls.integrated_loudness(x)


def _stimuli(client, tid, trial, labels) -> dict[str, np.ndarray]:
    return {lab: _samples(client.predict(tid, trial, lab, api_name="/listen_stimulus")) for lab in labels}


def _wait_released(app, timeout=60):
    import time

    deadline = time.monotonic() + timeout
    while app.listen.service.pool.count() and time.monotonic() < deadline:
        time.sleep(0.1)
    return app.listen.service.pool.count()


def test_the_api_has_the_four_endpoints_with_the_issues_arguments(served):
    _app, client = served
    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    names = {k: [p["parameter_name"] for p in v["parameters"]] for k, v in api.items()}
    assert names["/listen_start"] == ["kind", "text", "configs", "trials"]
    assert names["/listen_stimulus"] == ["test_id", "trial", "label"]
    assert names["/listen_answer"] == ["test_id", "trial", "answer"]
    assert names["/listen_report"] == ["test_id"]
    assert names["/listen_load"] == ["definition"]
    assert len(api["/listen_start"]["returns"]) == 2 and len(api["/listen_report"]["returns"]) == 3


def test_a_whole_abx_test_of_precisions(served):
    """fp32 (the app's own engine) against int8 (an extra engine, loaded for the test and let go once it is
    rendered); every X is found by comparing samples, so all 4 answers are right: p = 1/16."""
    app, client = served
    # (a fixed seed: on random tiny weights two configurations may happen to sample the same codes for some seeds,
    # which would make X equal to both; with this seed they differ, every time)
    configs = json.dumps([{"precision": "fp32", "voice": "ryan", "seed": 3}, {"precision": "int8", "voice": "ryan",
                                                                            "seed": 3}])
    tid, plan = client.predict("abx", "The first sentence. And the second one!", configs, 4,
                               api_name="/listen_start")
    plan = json.loads(plan)
    assert plan == [["A", "B", "X"]] * 4
    for t in range(1, 5):
        s = _stimuli(client, tid, t, plan[t - 1])
        levels = [_lufs(x) for x in s.values()]
        assert max(levels) - min(levels) <= 0.5, levels             # loudness-matched within 0.5 LU
        assert max(np.max(np.abs(x)) for x in s.values()) <= 10 ** (ls.PEAK_CEILING_DB / 20) + 1e-3
        same = [lab for lab in "AB" if s[lab].shape == s["X"].shape and np.array_equal(s[lab], s["X"])]
        assert len(same) == 1, "X must be exactly one of A and B"
        progress = client.predict(tid, t, same[0], api_name="/listen_answer")
        assert (f"{t}/4 answered" in progress) if t < 4 else progress.startswith("**Finished**")
    assert _wait_released(app) == 0, "the extra int8 engine must be let go once the test is rendered"
    summary, csv_path, json_path = client.predict(tid, api_name="/listen_report")
    assert "ABX" in summary and "precision fp32 vs precision int8" in summary and "0.0625" in summary
    rows = list(csv.DictReader(open(csv_path, encoding="utf-8")))
    assert len(rows) == 4 and [r["correct"] for r in rows] == ["1"] * 4
    assert [float(r["p_value"]) for r in rows] == [0.5, 0.25, 0.125, 0.0625]
    whole = json.load(open(json_path, encoding="utf-8"))
    assert whole["results"]["pairs"][0]["correct"] == 4 and whole["factor"] == "precision"
    assert [p["shuffle_seed"] for p in whole["plan"]] == [int(r["shuffle_seed"]) for r in rows]
    assert all(abs(g) < 60 for tr in whole["loudness"]["trials"] for g in tr["gains_db"].values())

    # a finished test takes no more answers, and nothing changes
    with pytest.raises(Exception, match="finished"):
        client.predict(tid, 2, "A", api_name="/listen_answer")
    assert client.predict(tid, api_name="/listen_report")[0] == summary


def test_a_whole_mushra_test_with_hidden_reference_and_anchor_and_its_export_run_again(served):
    app, client = served
    # speeds: stimuli that cannot come out equal (random tiny weights may give two voices the same codes)
    configs = json.dumps([{"speed": 1.0, "reference": True, "seed": 5}, {"speed": 1.1, "seed": 5},
                          {"speed": 1.25, "seed": 5}])
    tid, plan = client.predict("mushra", "", configs, 3, api_name="/listen_start")
    plan = json.loads(plan)
    assert plan == [["R", "A", "B", "C", "D"]] * 3
    sent = []
    for t in range(1, 4):
        s = _stimuli(client, tid, t, plan[t - 1])
        levels = [_lufs(x) for x in s.values()]
        assert max(levels) - min(levels) <= 0.5, levels
        hidden = [lab for lab in "ABCD" if s[lab].shape == s["R"].shape and np.array_equal(s[lab], s["R"])]
        assert len(hidden) == 1

        def high(x):
            spec = np.abs(np.fft.rfft(x)) ** 2
            return spec[int(len(spec) * 4500 / 12000):].sum() / spec.sum()
        anchor = min((lab for lab in "ABCD" if lab not in hidden), key=lambda lab: high(s[lab]))
        assert high(s[anchor]) < 0.01 < high(s["R"])                   # the 3.5 kHz low-pass anchor
        scores = {lab: 50.0 + 10 * t + 5 * i for i, lab in enumerate("ABCD")}
        scores[hidden[0]], scores[anchor] = 100.0, 20.0 + t
        sent.append(scores)
        client.predict(tid, t, json.dumps(scores), api_name="/listen_answer")
    summary, csv_path, json_path = client.predict(tid, api_name="/listen_report")
    whole = json.load(open(json_path, encoding="utf-8"))
    rows = {r["stimulus"]: r for r in whole["results"]["stimuli"]}
    ref = rows["hidden reference (speed 1)"]
    assert (ref["mean"], ref["low"], ref["high"]) == (100.0, 100.0, 100.0)
    anchor = rows["anchor (low-pass 3.5 kHz)"]
    half = 4.302652729911275 / math.sqrt(3)                              # t(0.975, 2) * s (= 1) / sqrt(3)
    assert anchor["mean"] == 22.0 and anchor["high"] - 22.0 == pytest.approx(half)
    for name in ("speed 1.1", "speed 1.25"):                         # recomputed from the revealed plan
        got = [sent[p["trial"] - 1][lab] for p in whole["plan"] for lab, n in p["stimuli"].items() if n == name]
        mean, lo, hi = ls.t_interval(got)
        assert rows[name]["mean"] == pytest.approx(mean) and rows[name]["low"] == pytest.approx(lo)
    assert "speed 1" not in rows                                      # the open reference is not rated
    assert "hidden reference" in summary and "anchor" in summary
    lines = list(csv.DictReader(open(csv_path, encoding="utf-8")))
    assert len(lines) == 3 and float(lines[0]["score: hidden reference (speed 1)"]) == 100.0

    # the exported JSON, loaded again: the same test (texts, seeds, configurations, shuffles, audio)
    from gradio_client import handle_file

    tid2, plan2 = client.predict(handle_file(json_path), api_name="/listen_load")
    assert tid2 != tid and json.loads(plan2) == plan
    whole2 = json.load(open(client.predict(tid2, api_name="/listen_report")[2], encoding="utf-8"))
    assert whole2["definition"] == whole["definition"]
    assert [p["shuffle_seed"] for p in whole2["plan"]] == [p["shuffle_seed"] for p in whole["plan"]]
    assert "stimuli" not in whole2["plan"][0]                           # nothing answered yet: still blind
    a, b = (_samples(client.predict(x, 1, "R", api_name="/listen_stimulus")) for x in (tid, tid2))
    assert a.shape == b.shape and np.allclose(a, b, atol=2 / 32767)


def test_bad_input_gets_a_clear_message_and_changes_nothing(served):
    app, client = served
    svc = app.listen.service
    before = dict(svc.tests)
    ok = json.dumps([{"speed": 1.0}, {"speed": 1.2}])
    cases = [
        (("abx", "", json.dumps([{"voice": "nobody"}, {"voice": "ryan"}]), 2), "unknown voice 'nobody'"),
        (("abx", "", json.dumps([{"model": "no/such-model"}, {}]), 2), "unknown model 'no/such-model'"),
        (("abx", "", json.dumps([{"precision": "fp16"}, {"precision": "fp32"}]), 2), "fp16 needs a GPU"),
        (("abx", "", json.dumps([{"precision": "int9"}, {}]), 2), "unknown precision"),
        (("mushra", "", json.dumps([{"speed": 1 + i / 10} for i in range(7)]), 2), "2 to 6"),
        (("abx", "", ok, 21), "1 to 20"),
        (("abx", "", ok, 0), "1 to 20"),
        (("abc", "", ok, 2), "not in the list of choices: \\[.ab., .abx., .mushra.\\]"),   # (the Radio says it)
        (("ab", "", json.dumps([{"speed": 1.0, "voice": "ryan"}, {"speed": 1.2, "voice": "vivian"}]), 2),
         "one factor at a time"),
        (("ab", "", "not json", 2), "not valid JSON"),
    ]
    for args, message in cases:
        with pytest.raises(Exception, match=message) as e:
            client.predict(*args, api_name="/listen_start")
        assert "Traceback" not in str(e.value)
        assert dict(svc.tests) == before and svc.pool.count() == 0, args
    with pytest.raises(Exception, match="no listening test 'nope'"):
        client.predict("nope", 1, "A", api_name="/listen_answer")
    with pytest.raises(Exception, match="no listening test"):
        client.predict("nope", api_name="/listen_report")

    tid, _plan = client.predict("ab", "Just one.", ok, 2, api_name="/listen_start")
    test = svc.get(tid)
    for args, message in [((tid, 3, "A"), "trials 1 to 2"), ((tid, 1, "C"), "A, B or none"),
                          ((tid, 1, '{"A": 3}'), "A, B or none")]:
        with pytest.raises(Exception, match=message):
            client.predict(*args, api_name="/listen_answer")
        assert test.answers == {}
    with pytest.raises(Exception, match="there is no 'Q'"):
        client.predict(tid, 1, "Q", api_name="/listen_stimulus")
    assert "1/2 answered" in client.predict(tid, 1, "none", api_name="/listen_answer")
    with pytest.raises(Exception, match="Trial 1 is answered already"):
        client.predict(tid, 1, "A", api_name="/listen_answer")
    assert test.answers[1].answer == "none" and len(test.answers) == 1
    with pytest.raises(Exception, match="not a listening test exported by this app"):
        from gradio_client import handle_file

        p = Path(app.files.dir) / "not_a_test.json"
        p.write_text('{"hello": 1}')
        client.predict(handle_file(str(p)), api_name="/listen_load")


def test_takes_of_the_session_and_its_own_voices(served):
    """The page's two other sources (not scriptable through gradio_client, which has no session): a test of takes
    (their recorded WAVs) and a rendered test with a voice of the session."""
    app, client = served
    h = app.listen
    pcm = [(np.sin(np.arange(24000) * f / 24000 * 2 * np.pi) * a * 32767).astype(np.int16)
           for f, a in ((220, 0.5), (330, 0.05))]
    history = [{"n": k + 1, "kind": "preset", "text": "Hello.", "voice": v, "seed": 5,
                "path": app.files.save_wav(x, f"take_{k + 1}")}
               for k, (v, x) in enumerate(zip(("ryan", "vivian"), pcm))]
    with pytest.raises(TTSError, match="no take #7"):
        h.listen_takes("abx", "1, 7", 2, False, history)
    with pytest.raises(TTSError, match="once"):
        h.listen_takes("abx", "1, 1", 2, False, history)
    tid, plan = h.listen_takes("abx", "2, 1", 2, False, history)
    assert json.loads(plan) == [["A", "B", "X"]] * 2
    test = app.listen.service.get(tid)
    assert [s.name for s in test.stimuli] == ["take #2 (vivian, seed 5)", "take #1 (ryan, seed 5)"]
    s = _stimuli(client, tid, 1, ["A", "B", "X"])
    assert abs(_lufs(s["A"]) - _lufs(s["B"])) <= 0.5                      # 26 dB apart before matching

    from ui.session import remember

    voice = app.voices.presets.voice(app.engine("base"), next(iter(app.voices.presets)).id)
    session = remember(None, "Me", voice)
    with pytest.raises(TTSError, match="unknown voice 'my:Me'"):
        h.listen_start("ab", "Hi there.", json.dumps([{"voice": "my:Me"}, {"voice": "ryan"}]), 1)
    tid, _plan = h.listen_start("ab", "Hi there.", json.dumps([{"voice": "my:Me"}, {"voice": "ryan"}]), 1,
                                session=session)
    files = app.listen.service.files_of(app.listen.service.get(tid), 1, timeout=120)
    assert sorted(files) == ["A", "B"]


def test_what_cannot_be_rendered_here_is_refused_with_its_reason():
    """On ZeroGPU a test cannot be rendered in the background (takes still can be compared); against a remote speech
    server its model, precision and temperature are its own."""
    from types import SimpleNamespace

    from ui.listen_tab import AppSource

    zero = AppSource(SimpleNamespace(zerogpu=True, cfg=SimpleNamespace(backend=None)))
    with pytest.raises(TTSError, match="ZeroGPU.*compare takes"):
        zero.check_factor("voice")
    remote = AppSource(SimpleNamespace(zerogpu=False, cfg=SimpleNamespace(backend="http://gpu-box:8000")))
    remote.check_factor("voice")
    remote.check_factor("speed")
    for factor in ("model", "precision", "temperature"):
        with pytest.raises(TTSError, match=f"its {factor} is its own"):
            remote.check_factor(factor)
    with pytest.raises(TTSError, match="models and precision are its own"):
        remote.check({"voice": "ryan", "precision": "int8"})
