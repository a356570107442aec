"""tts_engine/cpu/remembered_choice.py: a measured choice kept per key in the cache folder."""
import json

from tts_engine.cpu import remembered_choice as rc


def test_a_choice_is_recalled_for_its_own_key_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    key = {"machine": {"cpu": "x"}, "dims": [1, 2]}
    p = rc.path_for("things", key, prefix="talker-")
    assert p.parent == tmp_path / "things" and p.name.startswith("talker-") and p.suffix == ".json"
    assert rc.path_for("things", dict(reversed(list(key.items()))), prefix="talker-") == p   # key order does not count
    assert rc.recall(p, key, ("a", "b")) is None                      # nothing yet
    rc.remember(p, key, "b", "b 1 ms vs a 2 ms")
    assert rc.recall(p, key, ("a", "b")) == {"choice": "b", "why": "b 1 ms vs a 2 ms"}
    assert rc.recall(p, {"machine": {"cpu": "y"}, "dims": [1, 2]}, ("a", "b")) is None   # another machine
    assert rc.recall(p, key, ("a", "c")) is None                      # a choice no longer offered
    assert not list(p.parent.glob("*.tmp"))


def test_a_damaged_file_or_an_unwritable_folder_is_no_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    p = rc.path_for("things", {"k": 1})
    p.parent.mkdir(parents=True)
    p.write_text("{not json", encoding="utf-8")
    assert rc.recall(p, {"k": 1}, ("a",)) is None
    p.write_text(json.dumps(["a list"]), encoding="utf-8")
    assert rc.recall(p, {"k": 1}, ("a",)) is None
    blocked = tmp_path / "file"
    blocked.write_text("x")
    rc.remember(blocked / "sub" / "c.json", {"k": 1}, "a", "why")   # its folder cannot be made: logged, not raised


def test_the_switch_that_forces_a_choice(monkeypatch):
    for v, want in (("0", "off"), (" OFF ", "off"), ("false", "off"), ("1", "on"), ("yes", "on"), ("auto", "auto"),
                    ("", "auto"), ("maybe", "auto")):
        monkeypatch.setenv("TTS_SOME_CHOICE", v)
        assert rc.setting("TTS_SOME_CHOICE") == want, v
    monkeypatch.delenv("TTS_SOME_CHOICE")
    assert rc.setting("TTS_SOME_CHOICE") == "auto"


def test_each_choice_is_listed_with_how_it_came(tmp_path, monkeypatch):
    """`made()` (the app's footer): what this process chose, measured now or remembered from an earlier start."""
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rc, "_made", {})
    key = {"k": 1}
    p = rc.path_for("fused_step", key, prefix="talker-")
    rc.remember(p, key, "fused", "timed")
    assert rc.made() == {"fused_step talker": "fused (measured now)"}
    q = rc.path_for("codec_int8", key)
    assert rc.recall(q, key, ("64",)) is None and "codec_int8" not in rc.made()
    rc.remember(q, key, "64", "timed")
    monkeypatch.setattr(rc, "_made", {})
    assert rc.recall(q, key, ("64",))["choice"] == "64"
    assert rc.made() == {"codec_int8": "64 (remembered)"}
