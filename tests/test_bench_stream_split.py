"""bench/stream_split.py: the per-frame split of a real stream adds up to its wall time, sees the codec
thread when the engine has one, and leaves the engine as it was."""
from __future__ import annotations

import pytest

from bench.stream_split import PARTS, split_line, stream_split
from tts_engine.engine.engine import TTSEngine


@pytest.fixture(scope="module")
def engine(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=1,
                                    overlap_codec=True)
    eng.speakers_for_bench = eng.speakers
    yield eng
    eng.close()


def _parts_sum(s):
    return sum(s[k] for k in ("code_predictor_ms", "talker_step_ms", "between_halves_ms", "emit_ms", "prefill_ms",
                              "glue_ms", "outside_steps_ms"))


def test_parts_add_up_to_the_wall_time_and_the_codec_thread_is_seen(engine):
    s = stream_split(engine, 6)
    assert set(PARTS) <= {k[:-3] for k in s if k.endswith("_ms")}
    assert _parts_sum(s) == pytest.approx(s["wall_ms"], rel=0.25)   # (a step may end after the reader)
    assert s["code_predictor_ms"] > 0 and s["talker_step_ms"] > 0 and s["prefill_ms"] > 0
    assert 0 < s["talker_stack_ms"] <= s["talker_step_ms"]
    assert s["glue_ms"] >= 0 and s["codec_thread_ms"] > 0   # 6 frames in chunks 1, ...: later chunks on the thread
    assert "glue" in split_line(s, "x")


def test_without_codec_thread_the_chunks_decode_in_the_worker(engine):
    engine.worker.overlap_codec(False)
    try:
        s = stream_split(engine, 16)   # (16 frames: one late step of ~10 ms under CI's load is not 25 % of the wall)
    finally:
        engine.worker.overlap_codec(True)
    assert s["codec_thread_ms"] == 0 and s["between_halves_ms"] > 0
    assert _parts_sum(s) == pytest.approx(s["wall_ms"], rel=0.25)   # (a step may end after the reader)


def test_the_engine_is_left_unwrapped(engine):
    before = (dict(vars(engine.worker)), dict(vars(engine.runner)), dict(vars(engine.model.talker.model)))
    stream_split(engine, 3)
    after = (dict(vars(engine.worker)), dict(vars(engine.runner)), dict(vars(engine.model.talker.model)))
    assert [set(a) for a in after] == [set(b) for b in before]
    assert all(a[k] is b[k] for a, b in zip(after, before) for k in ("_step", "_emit", "_advance", "run") if k in a)
