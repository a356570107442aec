"""The fused CPU decode step (tts_engine/cpu/fused_step.py, fused_step.cpp): one C++ call for every layer of a
W8A8 / W4A8 / bf16 decoder stack.

- Against the eager path on the same quantised weights: hidden states and the KV cache entries it writes agree
  (fp32 activations: to float rounding; bf16: to bf16 rounding), for rows at different positions, rows given as an
  index tensor, two positions of one row (the code predictor's first pass), and the AVX2 code paths (W8A8 and W4A8:
  the same bits); bf16 stacks
  (nn.Linear bf16 weights read in place) on each of the bf16 matmul's ISA paths (AVX-512 BF16, AVX-512F, AVX2).
- In an engine: greedy codes with the fused step match the eager engine's on most frames; the step is really used.
- Choosing and falling back: the trial times both paths when the step is built, before any request (a lossy
  engine's first request decodes as its later ones), and the choice is remembered; a wrong result, an exception, a
  missing library or TTS_FUSED_STEP=0 leave the eager path serving; fp32 engines never get it.

Where the CPU has AVX-512 VNNI and g++ is on PATH the fused step must build and run (a failure fails here, it is not
skipped); elsewhere these tests skip, and the fallback tests still run."""
from __future__ import annotations

import copy
import logging
import statistics

import pytest
import torch
import torch.nn.functional as F

from tts_engine.config import DecoderStackConfig
from tts_engine.cpu import cpu_ext
from tts_engine.cpu import fused_step
from tts_engine.cpu.measured import entry_of
from tts_engine.model.layers import DecoderStack, KVCache
from tts_engine.model.quant import quantize_module

from test_cpu_ext_kernels import built

CFG = DecoderStackConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32)


@pytest.fixture
def fused_lib():
    return built(fused_step.library, "the fused step")


def make_stack(mode: str, dtype=torch.float32, seed: int = 0) -> DecoderStack:
    """A random stack in `dtype`, projections fused and quantised as `quant.quantize_talker` does ("bf16": left
    as bf16 nn.Linear layers, as the bf16 engine runs them)."""
    torch.manual_seed(seed)
    stack = DecoderStack(CFG)
    with torch.no_grad():
        for n, p in stack.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if n.endswith("norm.weight") else p.normal_(0, 0.05)
    stack.to(dtype)
    stack.fuse_projections()
    if mode != "bf16":
        quantize_module(stack.layers, mode)
    return stack.eval()


def filled_cache(stack, dtype, rows=3, max_len=40, filled=12) -> KVCache:
    """A cache whose rows hold `filled` eagerly written positions."""
    c = CFG
    cache = KVCache(c.num_hidden_layers, rows, c.num_key_value_heads, max_len, c.head_dim, "cpu", dtype)
    x = torch.randn(rows, filled, c.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    stack._run_eager(x, cache, slice(0, rows), torch.zeros(rows, dtype=torch.long), filled, None, None)
    return cache


def cos_rows(a, b):
    return F.cosine_similarity(a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1]), dim=-1)


CASES = [("w8a8", torch.float32), ("w8a8", torch.bfloat16), ("w4a8", torch.bfloat16), ("bf16", torch.bfloat16)]


@pytest.mark.parametrize("mode,dtype", CASES)
@pytest.mark.parametrize("layout", ["rows at different positions", "index rows", "two positions of one row"])
@torch.inference_mode()
def test_fused_step_matches_eager(fused_lib, own_kernels, mode, dtype, layout):
    if mode == "w4a8" and not cpu_ext.has_w4a8():
        pytest.skip("no W4A8 kernel here")
    stack = make_stack(mode, dtype)
    plan = fused_step.StackPlan(stack)
    ce = filled_cache(stack, dtype)
    cf = copy.deepcopy(ce)
    D = CFG.hidden_size
    g = torch.Generator().manual_seed(2)
    if layout == "rows at different positions":
        x, rows, start, T = torch.randn(3, 1, D, generator=g), slice(0, 3), torch.tensor([12, 5, 9]), 1
    elif layout == "index rows":
        x, rows, start, T = torch.randn(2, 1, D, generator=g), torch.tensor([2, 0]), torch.tensor([12, 7]), 1
    else:
        x, rows, start, T = torch.randn(1, 2, D, generator=g), slice(1, 2), torch.tensor([12]), 2
    x = x.to(dtype)
    B = x.shape[0]
    ye = stack._run_eager(x, ce, rows, start, int(start.max()) + T, None, None)
    row_idx = torch.arange(3)[rows] if isinstance(rows, slice) else rows
    rows_e = row_idx[:, None].expand(B, T).reshape(-1)
    pos_e = (start[:, None] + torch.arange(T)).reshape(-1)
    yf = plan.run(x.reshape(B * T, D), cf, rows_e, pos_e).view(B, T, D)
    assert yf.dtype == dtype and yf.shape == ye.shape
    new_k = [(c.k[:, rows_e, :, pos_e], c.v[:, rows_e, :, pos_e]) for c in (cf, ce)]   # [layers, B T, Hkv, hd]
    if dtype == torch.float32:   # the same arithmetic up to float summation order
        torch.testing.assert_close(yf, ye, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(new_k[0], new_k[1], atol=2e-4, rtol=2e-4)
    else:                        # fp32 between the matmuls vs bf16 after every op
        assert cos_rows(yf, ye).min() > 0.9995
        assert min(cos_rows(a, b).min() for a, b in zip(*new_k)) > 0.999
    # nothing but the entries' own positions was written
    touched = torch.zeros(3, CFG.num_key_value_heads, ce.max_len, dtype=torch.bool)
    touched[rows_e, :, pos_e] = True
    untouched = ~touched[None, :, :, :, None].expand_as(ce.k)
    assert torch.equal(cf.k[untouched], ce.k[untouched]) and torch.equal(cf.v[untouched], ce.v[untouched])


@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
@torch.inference_mode()
def test_avx2_path_gives_the_same_numbers(fused_lib, own_kernels, mode):
    """The AVX2 matmul paths (what a CPU without VNNI runs; TTS_CPU_ISA=avx2 picks them, forced here through the plan)
    compute the same exact int32 sums (W8A8) and per-group sums (W4A8) with the same fp32 epilogue as the VNNI ones:
    the stack's output is the same bits (everything else in the step is the same code at the same CPU level)."""
    if cpu_ext.isa() != "avx512-vnni":
        pytest.skip("compares the AVX-512 VNNI path with the AVX2 one")
    stack = make_stack(mode)
    plan = fused_step.StackPlan(stack)
    c1 = filled_cache(stack, torch.float32)
    c2 = copy.deepcopy(c1)
    x = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    rows, pos = torch.tensor([0, 1, 2]), torch.tensor([12, 12, 5])
    y1 = plan.run(x, c1, rows, pos)
    plan.dims[7] = 1   # fused_step.cpp Dim ISA_: 1 = AVX2
    y2 = plan.run(x, c2, rows, pos)
    assert torch.equal(y2, y1) and torch.equal(c2.k, c1.k) and torch.equal(c2.v, c1.v)


@torch.inference_mode()
def test_bf16_plan_reads_the_weights_in_place_and_every_isa_path_gives_the_same_numbers(fused_lib, own_kernels):
    """A bf16 stack's plan points at the nn.Linear weights themselves (no copy), and the bf16 matmul's paths this
    CPU runs (3 AVX-512 BF16 vdpbf16ps, 2 AVX-512F widening to fp32, 1 AVX2 + FMA; forced through the plan) give
    the same hidden states and cache entries up to fp32 summation order."""
    stack = make_stack("bf16", torch.bfloat16)
    plan = fused_step.StackPlan(stack)
    assert plan.wbits == 16
    a = stack.layers[1].self_attn
    assert int(plan.layers[1, 1]) == a.qkv_proj.weight.data_ptr()
    assert int(plan.layers[1, 10]) == stack.layers[1].mlp.down_proj.weight.data_ptr()
    best = int(plan.dims[7])
    assert best in (1, 2, 3) and best == fused_lib.ttsf_bf16_isa()
    base = filled_cache(stack, torch.bfloat16)
    x = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rows, pos = torch.tensor([0, 1, 2, 0, 1]), torch.tensor([12, 12, 12, 13, 13])
    got = {}
    for isa in range(best, 0, -1):
        plan.dims[7] = isa
        c = copy.deepcopy(base)
        got[isa] = (plan.run(x, c, rows, pos).float(), c.k.float(), c.v.float())
    plan.dims[7] = best
    for isa, (y, k, v) in got.items():
        for a_, b_ in zip((y, k, v), got[best]):   # bf16 outputs: equal, or one bf16 rounding apart
            torch.testing.assert_close(a_, b_, atol=1e-2, rtol=1e-2)
            assert (a_ == b_).float().mean() > 0.98, isa
    plan.dims[7] = 0
    with pytest.raises(RuntimeError, match="refused"):
        plan.run(x, copy.deepcopy(base), rows, pos)


@pytest.mark.parametrize("M", [1, 3, 4, 8, 16])
def test_bf16_matmul_tiles_match_a_plain_matmul_at_every_row_count(fused_lib, M):
    """The bf16 matmul alone (its tiles of 1-8 activation rows, 2 weight rows at a time from 3 rows on, passes of 8
    beyond 8 rows) on each ISA path this CPU runs: fp32 products of the bf16-rounded activations and the bf16
    weight, equal to a plain fp32 matmul of the same values up to summation order. K = 1056 is not a multiple of
    the unrolled step (the remainder loop runs); N = 48 is 6 groups of 8 weight rows."""
    g = torch.Generator().manual_seed(M)
    w = torch.randn(48, 1056, generator=g).to(torch.bfloat16)
    x = torch.randn(M, 1056, generator=g) * 3
    want = x.to(torch.bfloat16).double() @ w.double().t()
    for isa in range(fused_lib.ttsf_bf16_isa(), 0, -1):
        got = fused_step.bf16_matmul(w, x, isa)
        assert got.shape == (M, 48)
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-5, msg=f"ISA path {isa}")
    with pytest.raises(RuntimeError, match="refused"):
        fused_step.bf16_matmul(w[:44], x, 1)   # N not a multiple of 8


def test_plan_refuses_a_path_above_the_cpu_level(fused_lib, own_kernels):
    """A plan whose matmul path is above what the kernels run at (a forced level, or a bad plan) is refused by the
    C++ (-1: nothing run, no illegal instruction), never executed."""
    stack = make_stack("w8a8")
    plan = fused_step.StackPlan(stack)
    cache = filled_cache(stack, torch.float32)
    plan.dims[7] = 7   # no such W8A8 path (1 AVX2, 3 AVX-512 without VNNI, 2 VNNI)
    with pytest.raises(Exception):
        plan.run(torch.randn(1, CFG.hidden_size), cache, torch.tensor([0]), torch.tensor([12]))
    if cpu_ext.cpu_level() >= 3:   # the VNNI path at a level forced below VNNI (3 and 1 still run there)
        was = cpu_ext.set_level(2)
        try:
            plan.dims[7] = 2
            with pytest.raises(Exception):
                plan.run(torch.randn(1, CFG.hidden_size), cache, torch.tensor([0]), torch.tensor([12]))
            for ok in (3, 1):
                plan.dims[7] = ok
                plan.run(torch.randn(1, CFG.hidden_size), cache, torch.tensor([0]), torch.tensor([12]))
        finally:
            cpu_ext.set_level(was)


def test_plan_declines_dense_and_unfused_stacks():
    stack = DecoderStack(CFG)
    with pytest.raises(ValueError, match="not fused"):
        fused_step.StackPlan(stack)
    stack.fuse_projections()
    with pytest.raises(ValueError, match="not W8A8 / W4A8"):
        fused_step.StackPlan(stack)   # fp32 stays eager (parity)


# --- choosing, remembering, falling back --------------------------------------------------------------------------
def _step_once(stack, cache, pos):
    x = torch.randn(1, 1, CFG.hidden_size, generator=torch.Generator().manual_seed(pos)).to(cache.k.dtype)
    with torch.inference_mode():
        return stack.run(x, cache, slice(0, 1), torch.tensor([pos]), pos + 1)


@pytest.mark.parametrize("mode,dtype", [("w8a8", torch.float32), ("bf16", torch.bfloat16)])
def test_the_trial_runs_when_built_and_the_choice_is_remembered(fused_lib, own_kernels, monkeypatch, mode, dtype):
    """Nothing remembered: building the step times both paths at once, on its own scratch cache (the caller's cache
    is not touched), chooses the faster by median, serves that from the first call, and remembers it."""
    monkeypatch.delenv(fused_step.ENV, raising=False)
    stack = make_stack(mode, dtype)
    cache = filled_cache(stack, dtype, rows=1)
    before = (cache.k.detach().clone(), cache.v.detach().clone())
    stack.fused = fused_step.FusedStep(fused_step.StackPlan(stack), "test")
    f = stack.fused
    assert len(f.times["fused"]) == len(f.times["eager"]) == fused_step.TRIAL_PAIRS
    assert f.state in ("on", "off") and f.min_cos > 0.999
    assert f.state == ("on" if statistics.median(f.times["fused"]) < statistics.median(f.times["eager"]) else "off")
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.v, before[1])
    calls = _count_plan_calls(monkeypatch)
    _step_once(stack, cache, 12)
    assert calls["n"] == (1 if f.state == "on" else 0)   # the chosen path alone, from the first call
    again = fused_step.FusedStep(fused_step.StackPlan(stack), "test")
    assert again.state == f.state and again.record.how == "remembered" and not again.times["fused"]
    assert f.record.how == "measured now" and again.record == type(f.record)(f.record.path, "remembered", f.record.why)
    assert list((own_kernels / "fused_step").glob("test-*.json"))


def test_a_wrong_result_in_the_trial_turns_it_off(fused_lib, own_kernels, monkeypatch, caplog):
    stack = make_stack("w8a8")
    plan = fused_step.StackPlan(stack)
    monkeypatch.setattr(plan, "run", lambda x, *a: torch.randn_like(x))
    cache = filled_cache(stack, torch.float32, rows=1)
    ref = copy.deepcopy(cache)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        stack.fused = fused_step.FusedStep(plan, "test")
        y = _step_once(stack, cache, 12)
    assert stack.fused.state == "off" and stack.fused.record.how == "fell back" and "differ" in stack.fused.record.why
    assert "eager from now on" in caplog.text
    stack.fused = None
    torch.testing.assert_close(y, _step_once(stack, ref, 12))   # the eager result was served


def test_an_exception_later_falls_back_to_eager_for_good(fused_lib, own_kernels, monkeypatch, caplog):
    monkeypatch.setenv(fused_step.ENV, "1")
    stack = make_stack("w8a8")
    plan = fused_step.StackPlan(stack)
    stack.fused = fused_step.FusedStep(plan, "test", force=True)
    cache = filled_cache(stack, torch.float32, rows=1)
    ref = copy.deepcopy(cache)
    calls = []

    def boom(*a):
        calls.append(1)
        raise RuntimeError("kaputt")
    monkeypatch.setattr(plan, "run", boom)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        y = _step_once(stack, cache, 12)
        _step_once(stack, cache, 13)
    assert calls == [1] and stack.fused.state == "off" and "kaputt" in stack.fused.record.why
    assert caplog.text.count("eager from now on") == 1
    fused = stack.fused
    stack.fused = None
    torch.testing.assert_close(y, _step_once(stack, ref, 12))
    assert fused.state == "off"


def test_refused_input_raises_instead_of_writing_out_of_bounds(fused_lib, own_kernels):
    stack = make_stack("w8a8")
    plan = fused_step.StackPlan(stack)
    cache = filled_cache(stack, torch.float32, rows=1, max_len=16)
    before = cache.k.clone()
    with pytest.raises(RuntimeError, match="refused"):
        plan.run(torch.randn(1, CFG.hidden_size), cache, torch.tensor([0]), torch.tensor([16]))
    with pytest.raises(ValueError, match="rows"):
        plan.run(torch.randn(1, CFG.hidden_size), cache, torch.tensor([1]), torch.tensor([3]))
    assert torch.equal(cache.k, before)


def test_attach_declines_without_the_library(monkeypatch, own_kernels):
    """No compiler / no kernels: every stack stays eager, with the reason, and nothing raises."""
    monkeypatch.delenv(fused_step.ENV, raising=False)

    def no_lib():
        raise RuntimeError("no C++ compiler (g++) on PATH")
    monkeypatch.setattr(fused_step, "library", no_lib)
    talker = _FakeTalker(make_stack("w8a8") if cpu_ext.available() else DecoderStack(CFG))
    got = fused_step.attach(talker)
    assert talker.model.fused is None and talker.code_predictor.model.fused is None
    got = {k: entry_of(v) for k, v in got.items()}
    assert list(got) == ["talker stack", "predictor stack"], got
    assert all(e["path"] == "eager" and e["why"] for e in got.values()), got
    if cpu_ext.available():   # a quantised stack the library would serve: a failure, said as one
        assert all(e["how"] == "fell back" and "no C++ compiler" in e["why"] for e in got.values()), got


def test_env_switch_turns_it_off(monkeypatch, own_kernels):
    monkeypatch.setenv(fused_step.ENV, "0")
    talker = _FakeTalker(DecoderStack(CFG))
    off = {"path": "eager", "how": f"forced by {fused_step.ENV}", "why": f"{fused_step.ENV}=0"}
    assert {k: entry_of(v) for k, v in fused_step.attach(talker).items()} == {"talker stack": off,
                                                                             "predictor stack": off}


class _FakeTalker:
    def __init__(self, stack):
        self.model = stack
        self.code_predictor = type("CP", (), {"model": copy.deepcopy(stack)})()


# --- in an engine ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("fused") / "cv", kind="custom_voice", seed=0, arch="small")


def _count_plan_calls(monkeypatch) -> dict:
    calls = {"n": 0}
    real = fused_step.StackPlan.run

    def counting(self, *a):
        calls["n"] += 1
        return real(self, *a)
    monkeypatch.setattr(fused_step.StackPlan, "run", counting)
    return calls


@pytest.mark.parametrize("mode", ["w8a8", "w4a8", "bf16"])
def test_engine_greedy_codes_mostly_match_the_eager_engine(fused_lib, own_kernels, small_ckpt, mode, monkeypatch):
    """Greedy codes of the eager engine, then both paths teacher-forced on them one position per call (as the
    engine decodes): the fused step's argmax matches the eager one's on most codes (random weights have nearly
    flat logits, so a free-running comparison would drift apart after the first near-tie) and its hidden states and
    logits are close."""
    from tts_engine.cpu import talker_quality as quality
    from tts_engine.loader import Qwen3TTSModel

    if mode == "w4a8" and not cpu_ext.has_w4a8():
        pytest.skip("no W4A8 kernel here")
    model = Qwen3TTSModel.from_pretrained(str(small_ckpt), device="cpu", dtype="bf16",
                                          quantize=None if mode == "bf16" else mode)
    talker, pad = model.talker, model.prompts.tts_pad
    prompts = quality.build_prompts(model, 2)
    monkeypatch.setenv(fused_step.ENV, "0")
    codes = quality.generate_codes(model, prompts, 10)                   # [2, 10, 16], eager
    eager = quality.teacher_forced_stepwise(talker, pad, prompts, codes)
    monkeypatch.setenv(fused_step.ENV, "1")
    on = {"path": "fused", "how": "forced by TTS_FUSED_STEP", "why": "TTS_FUSED_STEP=1"}
    assert {k: entry_of(v) for k, v in fused_step.attach(talker).items()} == {"talker stack": on, "predictor stack": on}
    calls = _count_plan_calls(monkeypatch)
    fused = quality.teacher_forced_stepwise(talker, pad, prompts, codes)
    assert calls["n"] == 2 * 9 + 3 * 15   # talker: 9 one-position calls per prompt; predictor: 20 frames, 8 a call
    rep = quality.compare(eager, fused, "fused vs eager")
    assert rep.hidden_cos_min > 0.999 and rep.c0_logits_cos_min > 0.999 and rep.cp_logits_cos_min > 0.999, rep
    assert rep.c0_top1 >= 0.75 and rep.cp_top1 >= 0.85, rep   # measured on a Zen 4: 0.90 and 0.96 (20 frames)


def test_fp32_engines_never_get_it(own_kernels, small_ckpt, monkeypatch):
    from tts_engine.engine.engine import TTSEngine

    monkeypatch.setenv(fused_step.ENV, "1")
    engine = TTSEngine.from_pretrained(str(small_ckpt), device="cpu", dtype="fp32", max_batch=1, max_seq_len=64)
    try:
        assert engine.model.talker.model.fused is None
        assert engine.model.talker.code_predictor.model.fused is None
        paths = engine.paths()
        assert all(paths[p]["path"] == "eager" for p in ("talker stack", "predictor stack")), paths
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["w8a8", "bf16"])
def test_engine_speaks_with_the_fused_step(fused_lib, own_kernels, small_ckpt, monkeypatch, mode):
    import numpy as np

    from tts_engine.engine.engine import TTSEngine

    monkeypatch.setenv(fused_step.ENV, "1")
    kw = dict(dtype="bf16") if mode == "bf16" else dict(quantize=mode)
    engine = TTSEngine.from_pretrained(str(small_ckpt), device="cpu", max_batch=2, max_seq_len=256, **kw)
    try:
        paths = engine.paths()
        forced = {"path": "fused", "how": "forced by TTS_FUSED_STEP", "why": "TTS_FUSED_STEP=1"}
        assert paths["talker stack"] == paths["predictor stack"] == forced, paths
        wav = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=1, max_new_tokens=6)
        assert wav.dtype == np.float32 and wav.size > 0 and np.isfinite(wav).all()
        assert engine.model.talker.model.fused.state == "on"
    finally:
        engine.close()


def test_governor_matmul_option_gives_the_fused_call_its_threads(fused_lib, own_kernels, monkeypatch):
    """Under the thread governor's "matmul" option (one thread outside the linear layers) the fused call, which
    holds every matmul of the stack, runs with the option's threads and puts one thread back after."""
    from tts_engine.cpu.threads import MatmulThreads

    stack = make_stack("w8a8")
    plan = fused_step.StackPlan(stack)
    switch = MatmulThreads(2)
    stack.fused = fused_step.FusedStep(plan, "test", threads_switch=lambda: switch, force=True)
    seen = []
    real = plan.run
    monkeypatch.setattr(plan, "run", lambda *a: (seen.append(torch.get_num_threads()), real(*a))[1])
    cache = filled_cache(stack, torch.float32, rows=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        switch.set(True)
        _step_once(stack, cache, 12)
        assert seen == [2] and torch.get_num_threads() == 1
        switch.set(False)
        _step_once(stack, cache, 13)
        assert seen == [2, 1]
    finally:
        switch.set(False)
        torch.set_num_threads(before)


def _win(monkeypatch, winner: str) -> None:
    """The trial measures `winner` faster (the other path's times 1 s slower), whatever the clock said."""
    real = fused_step.FusedStep._decide

    def decide(self):
        loser = "eager" if winner == "fused" else "fused"
        self.times[loser] = [t + 1.0 for t in self.times[loser]]
        real(self)
    monkeypatch.setattr(fused_step.FusedStep, "_decide", decide)


def _greedy_codes(engine, frames: int) -> torch.Tensor:
    s = engine.stream("Hello there, how are you today?", voice=engine.speakers[0], greedy=True,
                      max_new_tokens=frames, sampling={"ignore_eos": True})
    list(s)
    return s.codes


@pytest.mark.parametrize("winner", ["fused", "eager"])
def test_the_trial_never_changes_a_request(fused_lib, own_kernels, small_ckpt, monkeypatch, winner):
    """TTS_FUSED_STEP unset and nothing remembered (a fresh cache folder): the trial that chooses between the fused
    and the eager step must not show in any request. A bf16-activation W8A8 engine's first two identical greedy
    requests give the same codes, and the same as an engine that serves the chosen path from its first call
    (TTS_FUSED_STEP=1 / 0): neither the results nor the KV cache entries of the trial's losing path reach a request."""
    from tts_engine.engine.engine import TTSEngine
    from tts_engine.loader import Qwen3TTSModel

    monkeypatch.delenv(fused_step.ENV, raising=False)
    _win(monkeypatch, winner)
    model = Qwen3TTSModel.from_pretrained(str(small_ckpt), device="cpu", dtype="bf16", quantize="w8a8")
    kw = dict(max_batch=1, max_seq_len=256, govern_threads=False)
    engine = TTSEngine(model, **kw)
    try:
        first, second = _greedy_codes(engine, 24), _greedy_codes(engine, 24)
        paths = engine.paths()
    finally:
        engine.close()
    assert all(paths[p]["path"] == winner and paths[p]["how"] == "measured now"
               for p in ("talker stack", "predictor stack")), paths
    assert len(list((own_kernels / "fused_step").glob("*.json"))) == 2   # the choice is remembered per stack
    monkeypatch.setenv(fused_step.ENV, "1" if winner == "fused" else "0")
    engine = TTSEngine(model, **kw)
    try:
        forced = _greedy_codes(engine, 24)
    finally:
        engine.close()
    assert first.shape[0] >= 20, first.shape
    assert torch.equal(first, second) and torch.equal(first, forced)
