"""The fused step's two ways of using the threads (tts_engine/cpu/csrc/fused_step.cpp): run_stack (one at::parallel_for
per matmul) and run_team (the whole stack in one parallel region, a barrier after each matmul), and its profile.

- The team paths (claim, barrier) give the split path's hidden states and KV cache entries bit for bit, at 1, 2, 4 and 16 entries,
  for W8A8 (fp32 and bf16 activations), W4A8 and bf16 stacks, at 2 and 3 threads (3: a thread with no kv head).
- The profile (fused_step.profile) counts every call and matmul, and its stages add up to the calls' time.
- The matmuls-alone entry (benchmarks) runs and is counted; rows given as a slice skip the host-side bounds check
  (built once per shape), index rows are still checked.
Skips where the fused step cannot run (no AVX-512 VNNI / g++), as tests/test_fused_step.py."""
from __future__ import annotations

import copy

import pytest
import torch

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import fused_step

from test_fused_step import CFG, filled_cache, fused_lib, make_stack  # noqa: F401 (fixtures)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def team_restored(fused_lib):  # noqa: F811
    yield
    fused_step.set_team(fused_step.team_setting())


def entries(M: int):
    """M entries over 3 cache rows: rows at different positions, and (M >= 2) two positions of one row."""
    rows = torch.tensor([i % 3 for i in range(M)], dtype=torch.int64)
    pos = torch.tensor([12 + i // 3 for i in range(M)], dtype=torch.int64)
    return rows, pos


CASES = [("w8a8", torch.float32), ("w8a8", torch.bfloat16), ("w4a8", torch.bfloat16), ("bf16", torch.bfloat16)]


@pytest.mark.parametrize("mode,dtype", CASES)
@pytest.mark.parametrize("nthreads", [2, 3])
@torch.inference_mode()
def test_team_path_gives_the_split_path_bit_for_bit(fused_lib, own_kernels, threads, team_restored, mode, dtype,  # noqa: F811
                                                    nthreads):
    if mode == "w4a8" and not cpu_ext.has_w4a8():
        pytest.skip("no W4A8 kernel here")
    torch.set_num_threads(nthreads)
    stack = make_stack(mode, dtype)
    plan = fused_step.StackPlan(stack)
    base = filled_cache(stack, dtype, max_len=48)
    for M in (1, 2, 4, 16):
        rows, pos = entries(M)
        x = torch.randn(M, CFG.hidden_size, generator=torch.Generator().manual_seed(M)).to(dtype)
        got = {}
        for team in ("split", "barrier", "claim"):
            fused_step.set_team(team)
            c = copy.deepcopy(base)
            got[team] = (plan.run(x, c, rows, pos), c.k, c.v)
        for team in ("barrier", "claim"):
            for a, b in zip(got["split"], got[team]):
                assert torch.equal(a, b), f"{mode} {dtype} M={M}: the {team} path differs"
        assert not torch.equal(got["claim"][1], base.k)   # it wrote the cache


@pytest.mark.parametrize("nthreads", [2, 4])
@torch.inference_mode()
def test_threads_dropped_at_once_still_give_the_same_numbers(fused_lib, own_kernels, threads, team_restored, nthreads):  # noqa: F811
    """With no spinning, a claim-mode writer drops every thread it finds behind (on 2 cores with 4 threads, many):
    the others finish the stack and the numbers stay the split path's."""
    torch.set_num_threads(nthreads)
    stack = make_stack("w8a8", torch.bfloat16)
    plan = fused_step.StackPlan(stack)
    base = filled_cache(stack, torch.bfloat16, max_len=48)
    rows, pos = entries(4)
    x = torch.randn(4, CFG.hidden_size, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    fused_step.set_team("split")
    c0 = copy.deepcopy(base)
    want = plan.run(x, c0, rows, pos)
    was = fused_lib.ttsf_set_spin(0)
    try:
        fused_step.set_team("claim")
        for _ in range(20):
            c = copy.deepcopy(base)
            assert torch.equal(plan.run(x, c, rows, pos), want)
            assert torch.equal(c.k, c0.k) and torch.equal(c.v, c0.v)
    finally:
        fused_lib.ttsf_set_spin(was)


@pytest.mark.parametrize("team", ["split", "barrier", "claim"])
@torch.inference_mode()
def test_profile_counts_every_call_and_its_stages_add_up(fused_lib, own_kernels, threads, team_restored, team):  # noqa: F811
    torch.set_num_threads(2)
    stack = make_stack("w8a8", torch.bfloat16)
    plan = fused_step.StackPlan(stack)
    cache = filled_cache(stack, torch.bfloat16)
    fused_step.set_team(team)
    rows, pos = entries(2)
    x = torch.randn(2, CFG.hidden_size).to(torch.bfloat16)
    plan.run(x, cache, rows, pos)   # not counted: the profile is off
    with fused_step.profile() as prof:
        for _ in range(5):
            plan.run(x, cache, rows, pos)
    ns = prof.ns
    assert ns["calls"] == 5 and ns["matmuls"] == 5 * 4 * CFG.num_hidden_layers
    stages = sum(ns[s] for s in fused_step.STAGES[:12])
    assert 0 < stages <= ns["call"] and stages >= 0.8 * ns["call"], ns
    assert all(ns[s] > 0 for s in ("qkv", "attn", "o_proj", "gate_up", "down"))
    assert 0 <= ns["busy_min"] <= ns["busy_max"] and ns["busy_max"] > 0
    if team == "split":   # the caller's matmul walls hold both threads' kernel times (a team's thread may start
        assert ns["busy_max"] <= sum(ns[s] for s in ("qkv", "o_proj", "gate_up", "down"))   # before thread 0)
    with fused_step.profile() as again:   # off again after the block: nothing counted in between
        pass
    plan.run(x, cache, rows, pos)
    assert again.ns["calls"] == 0


@pytest.mark.parametrize("mode", ["w8a8", "w4a8", "bf16"])
@torch.inference_mode()
def test_matmuls_alone_entry_runs_every_matmul(fused_lib, own_kernels, threads, mode):  # noqa: F811
    if mode == "w4a8" and not cpu_ext.has_w4a8():
        pytest.skip("no W4A8 kernel here")
    torch.set_num_threads(2)
    plan = fused_step.StackPlan(make_stack(mode, torch.bfloat16))
    for team in fused_step.TEAM_MODES.values():
        with fused_step.profile() as prof:
            assert fused_lib.ttsf_matmuls(plan.dims.data_ptr(), plan.layers.data_ptr(), 1, 3, team) == 0
        assert prof.ns["calls"] == 3 and prof.ns["matmuls"] == 3 * 4 * CFG.num_hidden_layers


@torch.inference_mode()
def test_slice_rows_are_built_once_and_index_rows_still_checked(fused_lib, own_kernels):  # noqa: F811
    stack = make_stack("w8a8", torch.bfloat16)
    f = fused_step.FusedStep(fused_step.StackPlan(stack), "test", force=True)
    cache = filled_cache(stack, torch.bfloat16)
    x = torch.randn(2, 1, CFG.hidden_size).to(torch.bfloat16)
    start = torch.tensor([12, 12])
    f.run(x, cache, slice(1, 3), start, eager=None)
    r1 = f._entries(slice(1, 3), start, 2, 1, 3)
    r2 = f._entries(slice(1, 3), start + 1, 2, 1, 3)
    assert r1[0] is r2[0] and r1[2] and torch.equal(r1[0], torch.tensor([1, 2]))
    assert torch.equal(r2[1], start + 1)
    assert f._entries(slice(2, 4), start, 2, 1, 3)[2] is False   # past the cache's rows: checked on the host
    with pytest.raises(ValueError, match="do not fit"):
        f.plan.run(x.reshape(2, -1), cache, torch.tensor([0, 3]), start)


def test_team_setting_reads_the_env(monkeypatch):
    monkeypatch.delenv(fused_step.TEAM_ENV, raising=False)
    assert fused_step.team_setting() == fused_step.TEAM_MODES["split"]   # the default: today's split
    for v, want in (("claim", "claim"), ("1", "claim"), ("on", "claim"), ("barrier", "barrier"), ("0", "split"),
                    ("off", "split"), ("nonsense", "split")):
        monkeypatch.setenv(fused_step.TEAM_ENV, v)
        assert fused_step.team_setting() == fused_step.TEAM_MODES[want], v


def test_profile_bench_prints_every_stage(fused_lib, own_kernels, tmp_path, threads):  # noqa: F811
    """`python -m bench fused_profile` on a small config: a table per stack with every stage, the
    matmuls' GB/s and the plain read."""
    import json

    from bench import fused_profile as bench_fused_profile

    stack = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"talker_config": {**stack, "code_predictor_config": stack}}))
    out = tmp_path / "t.md"
    assert bench_fused_profile.main(["--config", str(cfg), "--modes", "w8a8", "--rounds", "1", "--frames", "1",
                                     "--rotate-mb", "1", "--read-mb", "8", "--out", str(out)]) == 0
    text = out.read_text()
    for name in ("talker, w8a8", "predictor, w8a8", "plain read", "| qkv |", "| attn |", "| down |",
                 "hand-offs", "matmuls alone"):
        assert name in text, name
