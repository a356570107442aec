"""The fused frame's "gemv" variant (tts_engine/gpu/frame.py: at <= ops.GEMV_MAX_ROWS rows per stack, our
matrix-vector kernels with the residual add + RMSNorm, SiLU*up and q/k norm + RoPE + KV write fused in) against the
eager frame, and the measured choice between the variants (tts_engine/gpu/variants.py), on tiny random checkpoints
with the Triton kernels run by Triton's interpreter on CPU tensors (as tests/test_gpu_frame.py).

- fp32 codes, done flags and state equal the eager frame's: greedy at batch 1 over two frames, seeded sampling at
  batch 4 on rows that are not 0..B-1, the 1.7B layout; a stack pass above GEMV_MAX_ROWS rows runs the "gemm" layers;
- the same structure on the eager references is the eager frame;
- (launches per frame by formula, 5 per decoder layer instead of 9: tests/test_census.py counts them);
- the choice: timed candidates -> the faster serves and is remembered; a candidate that fails or disagrees -> the
  reference ("gemm") with one log line; on a CPU (no timing there) "gemm" by default, the variable forces either."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable: the fused GPU frame cannot be run or tested here")

from tts_engine.gpu import backend, ops, variants  # noqa: E402
from tts_engine.gpu.frame import FusedFrame  # noqa: E402

from test_gpu_kernels import interpreted_kernels  # noqa: E402
from test_gpu_frame import compare, make_runner, prepare  # noqa: E402
from bench.gpu_frame import restore, snapshot  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    with interpreted_kernels(), ops.force_interpreter(False):
        yield


@pytest.fixture(scope="module")
def runner(tiny_cv_folder):
    return make_runner(tiny_cv_folder, rows=10)


@pytest.fixture(scope="module")
def ckpt_1b7(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("gpu_variants_17") / "cv17", kind="custom_voice", size="1b7", seed=1)


def gemv_frame(run) -> FusedFrame:
    ff = FusedFrame(run)
    ff.variant = "gemv"
    return ff


class Spy:
    """Counts the gemv ops' launches (they must serve, not fall through to the gemm layers)."""

    def __init__(self, monkeypatch):
        self.n = 0
        for name in ("norm_linear", "norm_gate_up_silu", "norm_qkv_rope_write"):
            real = getattr(ops, name)

            def wrap(*a, _real=real, **k):
                self.n += 1
                return _real(*a, **k)
            monkeypatch.setattr(ops, name, wrap)


@torch.inference_mode()
@pytest.mark.parametrize("rows,n,greedy", [([0], 2, True), ([1, 3, 4, 6], 1, False)],
                         ids=["batch1-greedy", "batch4-seeded-sampling-rows-not-dense"])
def test_gemv_frame_codes_equal_eager(runner, rows, n, greedy, monkeypatch):
    prepare(runner, rows, greedy=greedy, seed=len(rows) + 40)
    spy = Spy(monkeypatch)
    want = compare(runner, rows, n, fused_frame=gemv_frame(runner))
    Lt, Lc = len(runner.talker.model.layers), len(runner.talker.code_predictor.model.layers)
    steps = runner.n_books - 1
    # per layer 4 gemv ops (qkv, o, gate_up, down) and one head per stack pass: every pass took the gemv path
    assert spy.n == n * (steps * (4 * Lc + 1) + 4 * Lt + 1), spy.n
    assert (want[0][..., 1:] != want[0][..., 1:2]).any()   # the codes differ from each other (not a constant)


@torch.inference_mode()
def test_gemv_frame_1b7_layout(ckpt_1b7):
    run = make_runner(ckpt_1b7, rows=2)
    prepare(run, [0], greedy=True, seed=3)
    compare(run, [0], 1, fused_frame=gemv_frame(run))


@torch.inference_mode()
def test_passes_above_the_gemv_rows_run_the_gemm_layers(runner, monkeypatch):
    """With GEMV_MAX_ROWS = 2 and 2 rows, the predictor's first step (4 rows: 2 positions each) runs the gemm layers
    and every other pass (2 rows) the gemv ones, in the same frame, with the eager frame's codes."""
    monkeypatch.setattr(ops, "GEMV_MAX_ROWS", 2)
    prepare(runner, [0, 1], greedy=True, seed=47)
    spy = Spy(monkeypatch)
    compare(runner, [0, 1], 1, fused_frame=gemv_frame(runner))
    Lt, Lc = len(runner.talker.model.layers), len(runner.talker.code_predictor.model.layers)
    assert spy.n == (runner.n_books - 2) * (4 * Lc + 1) + 4 * Lt + 1, spy.n


@torch.inference_mode()
def test_the_gemv_structure_on_the_references_is_the_eager_frame(runner):
    prepare(runner, [0, 1, 2], greedy=False, seed=48)
    compare(runner, [0, 1, 2], 2, fused_frame=gemv_frame(runner), interp=False)


# --- the measured choice -------------------------------------------------------------------------------------------
@pytest.fixture()
def choices_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(variants.ENV, raising=False)
    return tmp_path


@torch.inference_mode()
def test_on_a_cpu_the_gemm_variant_serves_by_default(runner, choices_dir):
    ff = FusedFrame(runner)
    ch = variants.choose(runner, ff, backend.frame_trial, interp=True)
    assert ff.variant == "gemm" and ch.record.how == "default" and "GPU" in ch.record.why


def checked(seen):
    """A stand-in for backend.frame_trial where a test is about the choice, not the check (the compare tests above
    check the gemv frame's codes; the disagreement test below runs the real check): notes the variant it checked."""
    def check(run, frame):
        seen.append(frame.variant)
        return "same codes (stand-in check)"
    return check


@torch.inference_mode()
def test_the_variable_forces_a_variant(runner, choices_dir, monkeypatch):
    monkeypatch.setenv(variants.ENV, "1")
    ff, seen = FusedFrame(runner), []
    ch = variants.choose(runner, ff, checked(seen), interp=True)
    assert ff.variant == "gemv" and ch.record.how == f"forced by {variants.ENV}"
    assert seen == ["gemv"]   # forced, still checked against the eager frame first
    monkeypatch.setenv(variants.ENV, "0")
    ff = FusedFrame(runner)
    ch = variants.choose(runner, ff, checked(seen), interp=True)
    assert ch.record.path == "gemm" and ff.variant == "gemm" and seen == ["gemv"]


@torch.inference_mode()
def test_the_faster_variant_serves_and_is_remembered(runner, choices_dir, caplog):
    """A trial with the timings given (the GPU's graph replays replaced by fixed times): checked against gemm first,
    then the faster by median; a second attach recalls the answer without a trial."""
    prepare(runner, [0], greedy=True, seed=2)
    start = snapshot(runner)
    fake = {"gemm": 5.0e-3, "gemv": 3.0e-3}
    ff, seen = FusedFrame(runner), []
    with caplog.at_level(logging.WARNING, logger="tts_engine"), ops.force_interpreter():
        ch = variants.choose(runner, ff, checked(seen), interp=True, timer=lambda v, frame: fake[v])
    assert ff.variant == "gemv" and ch.record.how == "measured now", ch.record
    assert seen == ["gemv"] and "gemv by median" in ch.record.why and "stand-in check" in ch.record.why
    assert not caplog.records
    after = snapshot(runner)
    for k in start:
        assert torch.equal(after[k], start[k]) if isinstance(start[k], torch.Tensor) else after[k] == start[k], k
    ff2 = FusedFrame(runner)
    ch2 = variants.choose(runner, ff2, checked(seen), interp=True, timer=lambda v, frame: 1 / 0)
    assert ff2.variant == "gemv" and ch2.record.how == "remembered" and seen == ["gemv"]   # no second check
    restore(runner, start)


@torch.inference_mode()
def test_a_variant_that_disagrees_or_fails_leaves_gemm_with_one_log_line(runner, choices_dir, monkeypatch, caplog):
    prepare(runner, [0], greedy=True, seed=3)
    real = ops.norm_gate_up_silu

    def wrong(*a, **k):
        act, s = real(*a, **k)
        return act * 1.5, s

    monkeypatch.setattr(ops, "norm_gate_up_silu", wrong)
    ff = FusedFrame(runner)
    with caplog.at_level(logging.WARNING, logger="tts_engine"), ops.force_interpreter():
        ch = variants.choose(runner, ff, backend.frame_trial, interp=True, timer=lambda v, frame: 1e-3)
    assert ff.variant == "gemm" and ch.record.how == "fell back", ch.record
    assert len(caplog.records) == 1 and "gemv" in caplog.records[0].getMessage()
    monkeypatch.setattr(ops, "norm_gate_up_silu", real)
    ff = FusedFrame(runner)
    caplog.clear()

    def boom(v, frame):
        if v == "gemv":
            raise RuntimeError("out of resources: shared memory")
        return 1e-3

    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        ch = variants.choose(runner, ff, backend.frame_trial, interp=True, timer=boom)
    assert ff.variant == "gemm" and ch.record.how == "fell back" and "out of resources" in ch.record.why
    assert len(caplog.records) == 1
