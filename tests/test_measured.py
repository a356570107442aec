"""tts_engine/cpu/measured.py: one mechanism for every measured choice (time the candidates, check they agree, keep the
fastest, remember it, fall back with one log line) and the records `TTSEngine.paths()` lists."""
import json
import logging

import pytest

from tts_engine.cpu import measured as m


def test_a_choice_is_recalled_for_its_own_key_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    key = {"machine": {"cpu": "x"}, "dims": [1, 2]}
    p = m.path_for("things", key, prefix="talker-")
    assert p.parent == tmp_path / "things" and p.name.startswith("talker-") and p.suffix == ".json"
    assert m.path_for("things", dict(reversed(list(key.items()))), prefix="talker-") == p   # key order does not count
    assert m.recall(p, key, ("a", "b")) is None                      # nothing yet
    m.remember(p, key, "b", "b 1 ms vs a 2 ms")
    assert m.recall(p, key, ("a", "b")) == {"choice": "b", "why": "b 1 ms vs a 2 ms"}
    assert m.recall(p, {"machine": {"cpu": "y"}, "dims": [1, 2]}, ("a", "b")) is None   # another machine
    assert m.recall(p, key, ("a", "c")) is None                      # a choice no longer offered
    assert not list(p.parent.glob("*.tmp"))


def test_a_damaged_file_or_an_unwritable_folder_is_no_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    p = m.path_for("things", {"k": 1})
    p.parent.mkdir(parents=True)
    p.write_text("{not json", encoding="utf-8")
    assert m.recall(p, {"k": 1}, ("a",)) is None
    p.write_text(json.dumps(["a list"]), encoding="utf-8")
    assert m.recall(p, {"k": 1}, ("a",)) is None
    blocked = tmp_path / "file"
    blocked.write_text("x")
    m.remember(blocked / "sub" / "c.json", {"k": 1}, "a", "why")   # its folder cannot be made: logged, not raised


def test_the_switch_that_forces_a_choice(monkeypatch):
    for v, want in (("0", "off"), (" OFF ", "off"), ("false", "off"), ("1", "on"), ("yes", "on"), ("auto", "auto"),
                    ("", "auto"), ("maybe", "auto")):
        monkeypatch.setenv("TTS_SOME_CHOICE", v)
        assert m.setting("TTS_SOME_CHOICE") == want, v
        assert m.MeasuredChoice("x", ("a", "b"), env="TTS_SOME_CHOICE").mode() == want, v
    monkeypatch.delenv("TTS_SOME_CHOICE")
    assert m.setting("TTS_SOME_CHOICE") == "auto"
    assert m.MeasuredChoice("x", ("a", "b")).mode() == "auto"   # no variable: always measured


def _choice(key=None, **kw):
    return m.MeasuredChoice("thing", ("ref", "fast"), env="TTS_SOME_CHOICE", key=key, folder="things",
                            label="the thing", fallback="the reference", **kw)


def test_the_faster_candidate_is_kept_by_median(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    c = _choice()
    assert c.chosen is None and c.measuring and c.record.how == m.MEASURING
    c.times["ref"] += [3.0, 2.0, 100.0]     # one stall: the median does not follow it
    c.times["fast"] += [1.0, 50.0, 1.5]
    with caplog.at_level(logging.INFO, logger="tts_engine"):
        assert c.decide(names={"ref": "the reference"}, note="the same bits") == "fast"
    assert c.chosen == "fast" and c.record.path == "fast" and c.record.how == m.MEASURED
    assert "the reference 3000.00 ms" in c.record.why and "fast 1500.00 ms" in c.record.why
    assert c.record.why.endswith("the same bits") and "the thing: fast" in caplog.text
    assert c.entry() == {"path": "fast", "how": "measured now", "why": c.record.why}
    slow = _choice()
    slow.times["ref"] += [1.0]
    slow.times["fast"] += [2.0]
    assert slow.decide() == "ref"
    tie = _choice()
    tie.times["ref"] += [1.0]
    tie.times["fast"] += [1.0]
    assert tie.decide() == "ref"             # a tie: the reference
    few = _choice()
    few.times["ref"] += [2.0, 2.0]
    few.times["fast"] += [1.0]               # timed too few times to count
    assert few.decide(min_samples=2) == "ref"


def test_the_trial_times_every_candidate_on_the_same_input_in_turn(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    c = m.MeasuredChoice("thing", ("ref", "a", "b"))
    calls = []
    run = {n: (lambda n: lambda x: calls.append((n, x)) or x)(n) for n in ("ref", "a", "b")}
    assert c.trial(run, 3, inputs=lambda i: (10 * i,), check=lambda want, got: None if got == want else "differs")
    assert calls == [("ref", 0), ("a", 0), ("b", 0), ("a", 10), ("b", 10), ("ref", 10),
                     ("b", 20), ("ref", 20), ("a", 20)]   # the same input per round, the order rotating
    assert all(len(v) == 3 for v in c.times.values())


def test_a_candidate_that_disagrees_is_refused_with_one_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    key = {"k": 1}
    c = _choice(key)
    run = {"ref": lambda x: x, "fast": lambda x: x + 1}
    with caplog.at_level(logging.INFO, logger="tts_engine"):
        assert not c.trial(run, 4, inputs=lambda i: (i,), check=lambda want, got: None if got == want else
                           f"{got} where {want}")
        c.fall_back("later again")           # a later failure: no second line
    assert c.chosen == "ref" and c.record.how == m.FELL_BACK and c.record.why == "1 where 0"
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert "the thing not used, the reference from now on: 1 where 0" in caplog.text
    assert not c.file.exists()               # a fallback is not remembered: the next start measures again
    # of three candidates, the one that disagrees is left out and the others still race (one line)
    caplog.clear()
    c3 = m.MeasuredChoice("three", ("ref", "good", "bad"))
    with caplog.at_level(logging.INFO, logger="tts_engine"):
        assert c3.trial({"ref": lambda: 1, "good": lambda: 1, "bad": lambda: 2}, 2,
                        check=lambda want, got: None if got == want else "differs")
    assert "bad" not in c3.times and len(c3.times["good"]) == 2 and caplog.text.count("differs") == 1
    # a candidate that raises is refused the same way; the reference raising falls back at once
    boom = _choice()
    assert not boom.trial({"ref": lambda: 0, "fast": lambda: 1 // 0}, 2)
    assert boom.record.how == m.FELL_BACK and "ZeroDivisionError" in boom.record.why


def test_a_choice_is_remembered_and_recalled(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    key = {"machine": "x", "v": 1}
    c = _choice(key, prefix="p-")
    c.times["ref"].append(2.0)
    c.times["fast"].append(1.0)
    c.decide()
    assert c.file.parent == tmp_path / "things" and c.file.name.startswith("p-")
    again = _choice(key, prefix="p-")
    assert again.recall() and again.chosen == "fast" and not again.times["fast"]
    assert again.record == m.Record("fast", m.REMEMBERED, c.record.why)
    other = _choice({"machine": "y", "v": 1}, prefix="p-")      # another key: measured again
    assert not other.recall() and other.chosen is None
    c.file.write_text("{damaged", encoding="utf-8")
    assert not _choice(key, prefix="p-").recall()
    c.file.write_text(json.dumps({"key": key, "choice": "gone", "why": ""}), encoding="utf-8")
    assert not _choice(key, prefix="p-").recall()                # a candidate no longer offered
    assert not _choice().recall()                                 # no key: never remembered


def test_a_forced_choice_says_which_variable(monkeypatch):
    monkeypatch.setenv("TTS_SOME_CHOICE", "1")
    c = _choice()
    c.force("fast")
    assert c.entry() == {"path": "fast", "how": "forced by TTS_SOME_CHOICE", "why": "TTS_SOME_CHOICE=1"}
    with pytest.raises(ValueError):
        c.force("unknown")
    d = _choice()
    d.default("ref", "the fast path cannot run here")
    assert d.entry() == {"path": "ref", "how": "default", "why": "the fast path cannot run here"}


def test_machine_wide_choices_are_listed_per_process(monkeypatch):
    """`made()` (the app's footer, and every engine's `paths()`): the machine-wide choices of this process;
    per-engine choices stay with their engine."""
    monkeypatch.setattr(m, "_made", {})
    m.note("codec int8 threshold", "64", m.REMEMBERED, "timed before\nsecond line")
    wide = m.MeasuredChoice("matmul share", ("split", "claim"), process=True)
    wide.times["split"].append(2.0)
    wide.times["claim"].append(1.0)
    wide.decide()
    own = m.MeasuredChoice("talker stack", ("eager", "fused"))
    own.force("fused")
    assert list(m.made()) == ["codec int8 threshold", "matmul share"]
    assert m.made()["codec int8 threshold"] == {"path": "64", "how": "remembered", "why": "timed before"}
    assert m.made()["matmul share"]["path"] == "claim"


def test_entries_of_records_choices_and_dicts_read_alike():
    assert m.entry_of(m.Record("eager", m.DEFAULT, "CPU only")) == {"path": "eager", "how": "default",
                                                                     "why": "CPU only"}
    assert m.entry_of({"path": "cuda graphs", "how": "default"}) == {"path": "cuda graphs", "how": "default",
                                                                     "why": ""}
    assert m.describe({"path": "fused", "how": "remembered", "why": "1 ms"}) == "fused (remembered: 1 ms)"
    assert m.describe({"path": "eager", "how": "", "why": ""}) == "eager"


# --- TTSEngine.paths(): every part of a frame, what serves it, how and why ---------------------------------------------
FRAME_PARTS = ("frame", "talker stack", "predictor stack", "predictor frame", "talker step", "compiled predictor",
               "threads", "codec thread")
HOWS = ("measured now", "remembered", "default", "fell back", "measuring")


def _well_formed(paths: dict) -> None:
    for part, e in paths.items():
        assert set(e) == {"path", "how", "why"} and all(isinstance(v, str) for v in e.values()), (part, e)
        assert e["path"] and (e["how"] in HOWS or e["how"].startswith("forced by ")), (part, e)


@pytest.fixture(scope="module")
def tiny_small(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("paths") / "cv", kind="custom_voice", seed=0, arch="small")


def test_paths_lists_every_part_of_a_cpu_frame(tiny_small, own_kernels, monkeypatch):
    """A quantised bf16 engine with the fused step and the predictor frame forced on and the talker step measured:
    every part is listed with what serves it, how that came and why; the codec's and the kernel table's machine-wide
    choices follow once they are made."""
    from tts_engine import TTSEngine
    from tts_engine.cpu import fused_step, predictor_frame, talker_step

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(predictor_frame.ENV, "1")
    monkeypatch.delenv(talker_step.ENV, raising=False)
    eng = TTSEngine.from_pretrained(str(tiny_small), device="cpu", dtype="bf16", quantize="w8a8", max_batch=2,
                                    max_seq_len=128)
    try:
        eng.synthesize("Hello there.", voice=eng.speakers[0], seed=1, max_new_tokens=4)
        paths = eng.paths()
        _well_formed(paths)
        assert list(paths)[:1] == ["frame"] and set(FRAME_PARTS) <= set(paths), list(paths)
        assert paths["frame"] == {"path": "eager", "how": "default", "why": "CUDA graphs need a GPU"}
        assert paths["compiled predictor"]["path"] == "eager" and paths["compiled predictor"]["how"] == "default"
        for part in ("talker stack", "predictor stack"):   # forced on, or fell back (no compiler here): with the reason
            assert paths[part] in ({"path": "fused", "how": f"forced by {fused_step.ENV}", "why": f"{fused_step.ENV}=1"},
                                   {"path": "eager", "how": "fell back", "why": paths[part]["why"]}), paths[part]
        if paths["predictor stack"]["path"] == "fused":
            assert paths["predictor frame"] == {"path": "frame", "how": f"forced by {predictor_frame.ENV}",
                                                "why": f"{predictor_frame.ENV}=1"}
        if paths["talker stack"]["path"] == "fused":    # not forced: measured at load, the same ids a bug detector
            assert paths["talker step"]["how"] in ("measured now", "fell back"), paths["talker step"]
            assert eng.runner.path_entries["talker step"] is eng.runner.talker_step.choice
        assert paths["threads"]["path"].startswith("chosen per frame") and paths["threads"]["how"] == "measured now"
        codec = paths["codec"]   # the dtype forced (tests/conftest.py), the convolution path measured
        assert codec["path"].startswith("bf16 ") and codec["how"] == "forced by TTS_CODEC_DTYPE", codec
        assert codec["why"].startswith("TTS_CODEC_DTYPE=model, ms per frame bf16 "), codec
        assert paths["kernel table"]["how"] == "forced by TTS_KERNEL_TUNE", paths["kernel table"]
    finally:
        eng.close()


def test_paths_follow_a_fallback_while_serving(tiny_small, own_kernels, monkeypatch):
    """The records are live: a fused call that raises in a request turns its stack's entry to "fell back", with
    the error, and no request fails."""
    from tts_engine import TTSEngine
    from tts_engine.cpu import fused_step, talker_step

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(talker_step.ENV, "0")   # the talker's stack through its fused step, not inside the whole step
    eng = TTSEngine.from_pretrained(str(tiny_small), device="cpu", dtype="bf16", quantize="w8a8", max_batch=1,
                                    max_seq_len=128)
    try:
        fused = eng.model.talker.model.fused
        if fused is None:
            pytest.skip(f"the fused step does not serve here: {eng.paths()['talker stack']}")

        def boom(*a):
            raise RuntimeError("kaputt")
        monkeypatch.setattr(fused.plan, "run", boom)
        assert eng.synthesize("Hello there.", voice=eng.speakers[0], seed=1, max_new_tokens=4).size > 0
        assert eng.paths()["talker stack"] == {"path": "eager", "how": "fell back", "why": "RuntimeError: kaputt"}
    finally:
        eng.close()


def test_fp32_engines_say_why_no_fast_path_serves(tiny_small, monkeypatch):
    from tts_engine import TTSEngine

    monkeypatch.delenv("TTS_GOVERN_THREADS", raising=False)
    eng = TTSEngine.from_pretrained(str(tiny_small), device="cpu", dtype="fp32", max_batch=1, max_seq_len=64)
    try:
        paths = eng.paths()
        _well_formed(paths)
        assert set(FRAME_PARTS) <= set(paths), list(paths)
        for part, path in (("talker stack", "eager"), ("predictor stack", "eager"), ("predictor frame", "loop"),
                           ("talker step", "python")):
            assert paths[part]["path"] == path and paths[part]["why"], (part, paths[part])
        assert "threads" in paths["threads"]["path"] and paths["codec thread"]["path"] == "in the worker"
    finally:
        eng.close()


def test_a_backend_adds_its_parts_through_the_runner(tiny_small):
    """The seam for another backend (a GPU's): entries written to `runner.path_entries` (a dict of the three keys, or
    an object with `.entry()`) are listed by `paths()`, live."""
    from tts_engine import TTSEngine

    eng = TTSEngine.from_pretrained(str(tiny_small), device="cpu", dtype="fp32", max_batch=1, max_seq_len=64)
    try:
        eng.runner.path_entries["gpu attention"] = {"path": "flash", "how": "default", "why": "sm90"}
        choice = m.MeasuredChoice("gpu sampler", ("torch", "triton"))
        eng.runner.path_entries["gpu sampler"] = choice
        assert eng.paths()["gpu attention"] == {"path": "flash", "how": "default", "why": "sm90"}
        assert eng.paths()["gpu sampler"]["how"] == "measuring"
        choice.default("torch", "no triton here")
        assert eng.paths()["gpu sampler"] == {"path": "torch", "how": "default", "why": "no triton here"}
    finally:
        eng.close()
