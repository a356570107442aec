"""bench/engine_step.py: every variant times the same span (the engine's "talker step", `TTSEngine.wrap`) once per frame, with the
option the governor ran it with, and leaves the engine as it was."""
from __future__ import annotations

import pytest
import torch

from bench.engine_step import VARIANTS, StepTimer, _pred, run_block, summarize
from tts_engine.engine.engine import TTSEngine


@pytest.fixture(scope="module")
def engine(tiny_cv_folder):
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="bf16", max_batch=1,
                                    overlap_codec=True, govern_threads=True)
    eng.speakers_for_bench = eng.speakers
    yield eng
    eng.close()
    torch.set_num_threads(prev)


def test_every_variant_times_one_step_per_frame_and_restores_the_engine(engine):
    timer = StepTimer(engine)
    w = engine.worker
    codec, gov = w.codec, w.governor
    assert codec is not None and gov is not None
    for v in VARIANTS:
        steps, preds = run_block(engine, timer, v, 5, 1)
        assert len(steps) == 5, v                        # one talker step per frame
        # (alone: one predictor frame for the first codes, then one per step; alone_no_predictor: only that one)
        assert len(preds) == {"alone": 6, "alone_no_predictor": 1}.get(v, 5), v
        assert all(r["wall"] > 0 and r["call"] >= 0 for r in steps)
        options = {r["option"] for r in steps}
        if v in ("no_governor", "bare") or v.startswith("alone"):
            assert options == {"2"}, v                   # the process's threads: nothing governs them
        if v in ("codec_in_worker", "bare") or v.startswith("alone"):
            assert not any(r["codec_busy"] for r in steps), v
        assert w.codec is codec and w.governor is gov   # put back after the block
    s = summarize(steps, 1_000_000, [10.0, 12.0])
    assert s["n"] == 5 and s["read"] == 11.0 and s["pct"] == pytest.approx(100 * s["GBps"] / 11.0)
    assert _pred([{"wall": 0.002, "option": "1"}, {"wall": 0.004, "option": "2"}]).startswith("3.0 (1: 1 x 2.0")
    assert engine.runner.host_len[0] == 0               # the alone blocks released their row
