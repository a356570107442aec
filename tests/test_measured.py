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
