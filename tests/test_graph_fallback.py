"""The GPU fast path cannot take the engine down (CPU tests, simulated failures): a CUDA-graph capture that raises
at start-up, or a replay that raises mid-request, turns graphs off for good with one log line and the requests
are served eagerly with the same codes; `--check` passes on the bucketed path and fails when it is wrong."""
from __future__ import annotations

import io
import logging

import pytest
import torch

from tts_engine import TTSEngine, TTSError
from tts_engine.engine.cuda_graphs import EagerBuckets, buckets
from bench.check import run_check
from tts_engine.tiny import make_tiny

REQ = dict(text="Hello there, how are you doing today?", voice="ryan", seed=1, greedy=True, max_new_tokens=14,
           sampling={"ignore_eos": True})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("graphs") / "cv", kind="custom_voice", size="0b6", seed=0))


def _codes(engine, **kw):
    s = engine.stream(**{**REQ, **kw})
    for _ in s:
        pass
    return s.codes


@pytest.fixture(scope="module")
def eager_codes(ckpt):
    eng = TTSEngine.from_pretrained(ckpt, device="cpu", max_batch=2, use_cuda_graphs=False)
    try:
        assert not eng.uses_cuda_graphs and eng.paths()["frame"]["path"] == "eager"
        return _codes(eng)
    finally:
        eng.close()


class CaptureFails(EagerBuckets):
    def capture_all(self):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class ReplayFailsOnce(EagerBuckets):
    """Replays (eagerly, same shapes) and raises on the 4th frame, as a broken replay would."""

    def __init__(self, runner):
        super().__init__(runner)
        self.calls = 0

    def run(self, B, read_len):
        self.calls += 1
        if self.calls == 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().run(B, read_len)


def test_capture_failure_at_start_serves_eagerly(ckpt, eager_codes, caplog):
    eng = TTSEngine.from_pretrained(ckpt, device="cpu", max_batch=2, use_cuda_graphs=False)
    try:
        with caplog.at_level(logging.WARNING, logger="tts_engine"):
            eng.start_graphs(CaptureFails(eng.runner))
        lines = [r for r in caplog.records if "CUDA graphs turned off" in r.getMessage()]
        assert len(lines) == 1 and "capture failed" in lines[0].getMessage()
        frame = eng.paths()["frame"]
        assert not eng.uses_cuda_graphs and frame["how"] == "fell back" and "capture failed" in frame["why"]
        assert torch.equal(_codes(eng), eager_codes)
    finally:
        eng.close()


def test_replay_failure_mid_request_falls_back_for_good(ckpt, eager_codes, caplog):
    eng = TTSEngine.from_pretrained(ckpt, device="cpu", max_batch=2, use_cuda_graphs=False)
    try:
        graphs = ReplayFailsOnce(eng.runner)
        eng.start_graphs(graphs)
        assert eng.uses_cuda_graphs and eng.paths()["frame"]["path"] == "cuda graphs"
        with caplog.at_level(logging.WARNING, logger="tts_engine"):
            first = _codes(eng)                     # the failing replay happens inside this request
        assert torch.equal(first, eager_codes)      # the request completes with the codes of the eager path
        frame = eng.paths()["frame"]
        assert not eng.uses_cuda_graphs and frame["how"] == "fell back" and "illegal memory access" in frame["why"]
        assert sum("CUDA graphs turned off" in r.getMessage() for r in caplog.records) == 1
        calls = graphs.calls
        assert torch.equal(_codes(eng), eager_codes)
        assert graphs.calls == calls                # off for good: no more replays
    finally:
        eng.close()


def test_bucketed_path_gives_the_eager_codes(ckpt, eager_codes):
    eng = TTSEngine.from_pretrained(ckpt, device="cpu", max_batch=2, use_cuda_graphs=False)
    try:
        eng.start_graphs(EagerBuckets(eng.runner))
        assert torch.equal(_codes(eng), eager_codes)
        assert eng.uses_cuda_graphs   # (the stand-in counts as graphs: it took the bucketed path)
    finally:
        eng.close()


def test_graphs_on_cpu_is_a_clear_error(ckpt):
    with pytest.raises(TTSError, match="CUDA graphs need a CUDA device"):
        TTSEngine.from_pretrained(ckpt, device="cpu", use_cuda_graphs=True)


def test_buckets_cover_every_batch_and_length():
    bb, lb = buckets(rows=16, max_len=4096)
    assert bb == [1, 2, 4, 8, 16] and lb[-1] == 4096 and lb[0] == 512
    bb, lb = buckets(rows=3, max_len=300)
    assert bb == [1, 2, 3] and lb == [300]


def test_check_passes_and_can_fail(ckpt, monkeypatch):
    out = io.StringIO()
    assert run_check(ckpt, torch.device("cpu"), None, 8, out=out) == 0
    assert "batch 4: bucketed static step vs exact eager: identical" in out.getvalue()
    assert "CHECK PASSED" in out.getvalue()

    orig = EagerBuckets.run

    def broken(self, B, read_len):   # a bucketed step that gets codebook 5 wrong
        codes, done = orig(self, B, read_len)
        codes[:, 5] ^= 1
        return codes, done

    monkeypatch.setattr(EagerBuckets, "run", broken)
    out = io.StringIO()
    assert run_check(ckpt, torch.device("cpu"), None, 8, out=out) == 1
    assert "DIFFER" in out.getvalue() and "CHECK FAILED" in out.getvalue()
