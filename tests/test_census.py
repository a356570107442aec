"""The kernel census (`python -m bench census`): one frame of the GPU's path counted on a CPU, bounded.

A count, not a timing: the same code gives the same number on every machine."""
import pytest

from bench import census


def test_the_eager_frame_count_is_bounded_and_the_same_at_every_batch():
    one = census.count_cpu("0.6b", 1)
    four = census.count_cpu("0.6b", 4)
    assert one["triton"] == 0
    # the frame's code has no per-row Python: the launch count does not grow with the batch
    assert one["launches"] == four["launches"]
    # 28 talker layers + 15 x 5 predictor layers; a change that adds launches per layer shows here
    assert 4000 < one["launches"] <= 6000, one["top"]


def test_the_census_counts_what_runs():
    """Two more predictor layers add launches to each of the 15 predictor steps: the count must see them."""
    import tts_engine.tiny as tiny

    base = census.count_cpu("tiny", 1)["launches"]
    old = dict(tiny.ARCHS["tiny"])
    try:
        tiny.ARCHS["tiny"]["cp_layers"] = old["cp_layers"] + 2
        more = census.count_cpu("tiny", 1)["launches"]
    finally:
        tiny.ARCHS["tiny"].clear()
        tiny.ARCHS["tiny"].update(old)
    assert more > base + 15 * 2 * 10, (base, more)


def test_the_cli_writes_json(tmp_path):
    out = tmp_path / "census.json"
    assert census.main(["--arch", "tiny", "--batches", "1,4", "--json", str(out)]) == 0
    import json

    got = json.loads(out.read_text())
    assert set(got["eager"]) == {"1", "4"} and got["eager"]["1"]["launches"] > 0


def _fused_formula(talker_layers: int, predictor_layers: int, steps: int = 15) -> int:
    """Launches of the fused GPU frame (tts_engine/gpu, see tests/test_gpu_frame.py::test_launches_per_frame): per
    decoder layer 5 Triton kernels and 4 GEMMs; per predictor step one more norm, one head GEMM and one sampler; the
    talker step adds the frame embedding, its first norm, the codec head and its sampler, plus a few small ops."""
    triton = steps * (1 + 5 * predictor_layers + 1) + (3 + 5 * talker_layers)
    gemms = steps * (4 * predictor_layers + 1) + 4 * talker_layers + 1
    return triton + gemms


def test_the_fused_frame_census_matches_its_formula_and_meets_the_target():
    pytest.importorskip("triton")
    from tts_engine.tiny import ARCHS

    got = census.count_cpu("tiny", 1, fused=True)
    a = ARCHS["tiny"]
    want = _fused_formula(a["layers"], a["cp_layers"])
    assert want <= got["launches"] <= want + 8, got
    # the target for 0.6B at batch 1: <= 1,000 launches per frame (the eager frame: ~5,900)
    big = ARCHS["0.6b"]
    assert _fused_formula(big["layers"], big["cp_layers"]) + 8 <= 1000


def _gemv_formula(talker_layers: int, predictor_layers: int, steps: int = 15) -> int:
    """Launches of the fused frame's gemv variant at <= 8 rows per stack (tts_engine/gpu/frame.py): per decoder
    layer 5 kernels (norm + qkv + q/k norm + RoPE + KV write, attention, o, norm + gate_up + SiLU*up, down); per
    predictor step the head (with the final norm) and the sampler; the talker step adds the frame embedding, its
    head and its sampler. No cuBLAS GEMM left (the 1.7B layout's projection between the widths aside)."""
    return steps * (5 * predictor_layers + 2) + 5 * talker_layers + 3


def test_the_gemv_variant_census_matches_its_formula_and_meets_its_target():
    pytest.importorskip("triton")
    from tts_engine.tiny import ARCHS

    got = census.count_cpu("tiny", 1, fused=True, variant="gemv")
    gemm = census.count_cpu("tiny", 1, fused=True, variant="gemm")
    a = ARCHS["tiny"]
    want = _gemv_formula(a["layers"], a["cp_layers"])
    assert want <= got["launches"] <= want + 8, got
    assert got["triton"] == want and gemm["launches"] - got["launches"] >= 4 * (15 * a["cp_layers"] + a["layers"])
    # issue 27's targets for 0.6B at batch 1: <= 600 launches per frame (the gemm variant: 984)
    big = ARCHS["0.6b"]
    assert _gemv_formula(big["layers"], big["cp_layers"]) + 8 <= 600
