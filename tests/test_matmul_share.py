"""How our W8A8 / W4A8 calls share their output blocks between torch's threads (cpu_ext.cpp `share_units`,
cpu_ext.py `share`, `set_share`, `_choose_share`):

- claimed chunks (each thread claims its own part in order, then what is left of the others') and the fixed split
  give the same bits, at every CPU level this CPU runs (AVX2, AVX-512 without VNNI, VNNI): W8A8 outputs and exact
  int32 sums, W4A8 outputs, for row counts across the kernels' row groups and shapes of many chunks and of one;
  and a whole fused stack (split team mode: one shared matmul at a time) gives the same bits either way;
- the mode: TTS_MATMUL_SHARE forces it; "auto" with kernel tuning off is split (as before); with tuning on it is
  measured once (`measure_share`) and remembered per machine; the libraries built beside cpu_ext.cpp (fused step,
  predictor frame) follow `set_share`."""
from __future__ import annotations

import copy

import pytest
import torch

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import fused_step
from tts_engine.cpu import kernels
from tts_engine.model.quant import int4_quantize

from test_cpu_ext_kernels import require_kernels
from test_fused_step import CFG, filled_cache, make_stack


@pytest.fixture
def two_threads():
    """Two torch threads (the claimed path needs two), the share mode and thread count restored afterwards."""
    require_kernels()
    threads, was = torch.get_num_threads(), cpu_ext.share()
    level = cpu_ext.level()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
    cpu_ext.set_share(was)
    cpu_ext.set_level(level)


def both_modes(f):
    """{mode: f()} with the calls split, then claimed."""
    out = {}
    for mode in ("split", "claim"):
        cpu_ext.set_share(mode)
        out[mode] = f()
    return out


@torch.inference_mode()
def test_claimed_and_split_calls_give_the_same_bits_at_every_level(two_threads):
    lib = cpu_ext.library()
    g = torch.Generator().manual_seed(21)
    cases = []
    for N, K in [(37, 64), (1040, 192), (4096, 1024), (2000, 320)]:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        s127 = torch.rand(N, generator=g) * 1e-4
        q4, sz = int4_quantize(torch.randn(N, K, generator=g) * 0.05, 64)
        cases.append((N, K, cpu_ext.pack(q), s127, cpu_ext.pack4(q4, sz)))
    # the big shapes really take several chunks per thread (the small ones one: the caller alone)
    U = 4096 // 16
    assert lib.ttsx_claim_chunk(U, 16 * 1024, 2) * 4 <= U and lib.ttsx_claim_chunk(3, 16 * 64, 2) >= 3
    for lvl in range(1, cpu_ext.cpu_level() + 1):
        cpu_ext.set_level(lvl)
        for N, K, p8, s127, p4 in cases:
            for M in (1, 2, 3, 4, 5, 9):
                for dt in (torch.float32, torch.bfloat16):
                    x = (torch.randn(M, K, generator=g) * 3).to(dt)

                    def run():
                        acc = torch.zeros(M, N, dtype=torch.int32)
                        return cpu_ext.w8a8(x, p8, s127, N, acc=acc), acc, cpu_ext.w4a8(x, p4, N)
                    got = both_modes(run)
                    for a, b in zip(got["split"], got["claim"]):
                        assert torch.equal(a, b), (cpu_ext.level_name(), N, K, M, dt)


@pytest.mark.parametrize("mode,dtype", [("w8a8", torch.float32), ("w4a8", torch.bfloat16), ("bf16", torch.bfloat16)])
@torch.inference_mode()
def test_a_fused_stack_gives_the_same_bits_split_or_claimed(two_threads, own_kernels, mode, dtype):
    """The fused step's split team mode shares each matmul as the standalone calls do (fused_step.cpp linear)."""
    lib = fused_step.library()
    team = fused_step.set_team("split")
    try:
        stack = make_stack(mode, dtype)
        base = filled_cache(stack, dtype)
        plan = fused_step.StackPlan(stack)
        x = torch.randn(4, CFG.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
        rows, pos = torch.tensor([0, 1, 2, 0]), torch.tensor([12, 12, 5, 13])

        def run():
            c = copy.deepcopy(base)
            return plan.run(x, c, rows, pos), c.k, c.v
        got = both_modes(run)
        assert lib.ttsx_set_share(1) == 1   # the fused step's library followed set_share ("claim" last)
        for a, b in zip(got["split"], got["claim"]):
            assert torch.equal(a, b), mode
    finally:
        fused_step.set_team(team)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """load(**env) -> cpu_ext loaded afresh (as a new process would) with these variables, a private cache folder;
    the state before is back afterwards."""
    require_kernels()
    saved = dict(cpu_ext._state)
    built_dir = kernels.cache_root() / "cpu_ext"   # the libraries built so far: not built again in the new folder
    for d in (tmp_path, tmp_path / "another"):
        d.mkdir(exist_ok=True)
        (d / "cpu_ext").symlink_to(built_dir, target_is_directory=True)
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    kernels.reset_kernel_table()

    def load(**env):
        for k in (cpu_ext.SHARE_ENV, kernels.TUNE_ENV):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        cpu_ext.reset()
        assert cpu_ext.available(), cpu_ext.why_unavailable()
        return cpu_ext.share()
    yield load
    cpu_ext._state.clear()
    cpu_ext._state.update(saved)
    saved["lib"].ttsx_set_share(cpu_ext.SHARES[saved.get("share", "split")])
    cpu_ext._sync_loaded()
    kernels.reset_kernel_table()


def test_the_mode_is_forced_by_env_and_split_without_tuning(fresh, monkeypatch):
    monkeypatch.setattr(cpu_ext, "measure_share", lambda *a, **k: pytest.fail("no trial may run here"))
    assert fresh(TTS_MATMUL_SHARE="claim") == "claim"
    assert cpu_ext.library().ttsx_set_share(1) == 1                     # the library's own mode
    assert fresh(TTS_MATMUL_SHARE="0") == "split"
    assert fresh(TTS_MATMUL_SHARE="on", TTS_KERNEL_TUNE="0") == "claim"
    assert fresh(TTS_KERNEL_TUNE="0") == "split" and "not measured" in cpu_ext._state["share_why"]


def test_auto_measures_once_and_remembers(fresh, monkeypatch, tmp_path):
    calls = []

    def fake(*a, **k):
        calls.append(1)
        return {"split": 2.0, "claim": 1.0}
    monkeypatch.setattr(cpu_ext, "measure_share", fake)
    if torch.get_num_threads() < 2:
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert fresh() == "claim" and calls == [1] and "claim 1000.0 ms" in cpu_ext._state["share_why"]
    assert fresh() == "claim" and calls == [1] and cpu_ext._state["share_why"].startswith("measured before")
    monkeypatch.setattr(cpu_ext, "measure_share", lambda *a, **k: 1 / 0)   # a failing trial: split, no error
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "another"))     # nothing remembered there
    kernels.reset_kernel_table()
    cpu_ext.reset()
    assert cpu_ext.share() == "split" and "trial failed" in cpu_ext._state["share_why"]


def test_a_bounded_start_splits_now_and_measures_while_idle(fresh, monkeypatch):
    """TTS_START_TRIALS=bounded (a fresh start): split at once, the trial later while no engine serves, remembered
    for the next start."""
    from tts_engine.cpu import deferred_trials

    calls = []

    def fake(*a, **k):
        calls.append(1)
        return {"split": 2.0, "claim": 1.0}
    monkeypatch.setattr(cpu_ext, "measure_share", fake)
    monkeypatch.setattr(deferred_trials, "QUIET_S", 0.1)
    monkeypatch.setitem(deferred_trials._state, "served", True)        # (as after the first frame)
    monkeypatch.setattr(deferred_trials, "_probes", [])     # (engines of earlier tests: not this test's requests)
    monkeypatch.setattr(deferred_trials, "_engaged", {})
    if torch.get_num_threads() < 2:
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv(deferred_trials.ENV, "bounded")
    assert fresh() == "split" and cpu_ext._state["share_why"] == "default until measured while idle"
    assert deferred_trials.wait(30) and calls == [1]
    assert fresh() == "claim" and calls == [1] and cpu_ext._state["share_why"].startswith("measured before")


@torch.inference_mode()
def test_the_trial_times_both_modes_and_restores_the_mode(two_threads):
    cpu_ext.set_share("claim")
    t = cpu_ext.measure_share(total_bytes=8 << 20, rounds=2)
    assert set(t) == {"split", "claim"} and all(0 < v < 10 for v in t.values())
    assert cpu_ext.share() == "claim"
