"""Per-frame overhead of the talker step and the code predictor (issue 14): the fewer-call forms of RoPE, the
q/k norm and the fused projections compute what the plain forms compute (bit for bit where the arithmetic is
the same), the small-query attention of CPU 16-bit decoding agrees with scaled_dot_product_attention, and an
engine's codes do not depend on how its rows are batched."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tts_engine.config import DecoderStackConfig
from tts_engine.model.layers import (Attention, DecoderStack, KVCache, RMSNorm, apply_rope, rope_cos_sin,
                                     rotate_half, signed_sin, small_query_attention)


def _cfg(layers=2, heads=4, kv=2, hd=16, d=48):
    return DecoderStackConfig(hidden_size=d, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=kv, head_dim=hd, rope_theta=10000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_signed_sin_is_the_rotate_half_form_bit_for_bit(dtype):
    torch.manual_seed(0)
    pos = torch.tensor([[0, 1, 2], [7, 8, 9]])
    cos, sin = rope_cos_sin(pos, 32, 1e6, dtype)
    x = torch.randn(2, 5, 3, 32).to(dtype)
    assert torch.equal(apply_rope(x, cos, signed_sin(sin)), x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_qk_norm_equals_separate_norms_bit_for_bit(dtype):
    torch.manual_seed(0)
    a = Attention(_cfg()).to(dtype)
    with torch.no_grad():
        a.q_norm.weight.normal_()
        a.k_norm.weight.normal_()
    q, k = torch.randn(3, 2, 4, 16).to(dtype) * 3, torch.randn(3, 2, 2, 16).to(dtype) * 3
    want_q, want_k = a.q_norm(q), a.k_norm(k)
    a.fuse_projections()
    from tts_engine.model.layers import rms_norm

    got = rms_norm(torch.cat([q, k], dim=2), a.qk_norm_weight, a.eps)
    assert torch.equal(got[:, :, :4], want_q) and torch.equal(got[:, :, 4:], want_k)


def test_rms_norm_fp32_shortcut_is_the_official_formula():
    torch.manual_seed(0)
    n = RMSNorm(24)
    with torch.no_grad():
        n.weight.normal_()
    x = torch.randn(5, 24) * 4
    want = n.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + n.eps)).to(torch.float32)
    assert torch.equal(n(x), want)


def _stack_outputs(stack, dtype, steps, fuse):
    """Run a prompt of 5 positions then `steps` decode positions through `stack` for 2 rows of different
    lengths; returns the decode outputs [steps, 2, D]."""
    torch.manual_seed(1)
    if fuse:
        stack.fuse_projections()
    c = stack.cfg
    cache = KVCache(c.num_hidden_layers, 2, c.num_key_value_heads, 32, c.head_dim, "cpu", dtype)
    with torch.inference_mode():
        stack.run(torch.randn(1, 5, c.hidden_size).to(dtype), cache, slice(0, 1), torch.tensor([0]), 5)
        stack.run(torch.randn(1, 3, c.hidden_size).to(dtype), cache, slice(1, 2), torch.tensor([0]), 3)
        lens, outs = [5, 3], []
        for _ in range(steps):
            x = torch.randn(2, 1, c.hidden_size).to(dtype)
            outs.append(stack.run(x, cache, slice(0, 2), torch.tensor(lens), max(lens) + 1)[:, 0])
            lens = [n + 1 for n in lens]
    return torch.stack(outs)


@pytest.mark.parametrize("heads, kv", [(4, 2), (4, 4)])
def test_bf16_decode_attention_agrees_with_sdpa(heads, kv, monkeypatch):
    """CPU bf16 decoding (1 query) takes the matmul-softmax attention, with a mask for the shorter row: its
    outputs stay within bf16 rounding of the scaled_dot_product_attention path (the same fused weights)."""
    import tts_engine.model.layers as layers

    torch.manual_seed(0)
    ref_stack = DecoderStack(_cfg(heads=heads, kv=kv)).to(torch.bfloat16)
    state = {k: v.clone() for k, v in ref_stack.state_dict().items()}
    assert small_query_attention(torch.device("cpu"), torch.bfloat16, 1)
    got = _stack_outputs(ref_stack, torch.bfloat16, 6, fuse=True).float()
    monkeypatch.setattr(layers, "small_query_attention", lambda device, dtype, T: False)
    sdpa_stack = DecoderStack(_cfg(heads=heads, kv=kv)).to(torch.bfloat16)
    sdpa_stack.load_state_dict(state)
    want = _stack_outputs(sdpa_stack, torch.bfloat16, 6, fuse=True).float()
    rel = (got - want).norm() / want.norm()
    assert rel < 2e-2, rel
    # and the mask matters: the two rows see different numbers of keys
    assert not torch.allclose(got[:, 0], got[:, 1])


def test_small_query_attention_masks_what_sdpa_masks():
    torch.manual_seed(0)
    a = Attention(_cfg(heads=4, kv=2))
    B, H, Hkv, T, S, hd = 2, 4, 2, 2, 6, 16
    q = torch.randn(B, H, T, hd).bfloat16()
    k, v = torch.randn(B, Hkv, S, hd).bfloat16(), torch.randn(B, Hkv, S, hd).bfloat16()
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    mask[0, :, 0, 5] = False
    mask[1, :, :, 3:] = False
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    add = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")).repeat(1, 1, H // Hkv, 1)
    got = a._attend_small(q, k, v, add).float()
    assert (got - want).abs().max() < 3e-2
    none = a._attend_small(q, k, v, None).float()
    assert (none - want).abs().max() > 0.05   # masking changes the answer: the test can fail


def test_fp32_keeps_sdpa_and_unfused_layers():
    assert not small_query_attention(torch.device("cpu"), torch.float32, 1)
    assert not small_query_attention(torch.device("cpu"), torch.bfloat16, 3)
    assert not small_query_attention(torch.device("meta"), torch.bfloat16, 1)


@pytest.mark.parametrize("dtype, quantize", [("bf16", None), ("fp32", None), ("bf16", "int8")])
def test_engine_serves_batched_rows_of_different_lengths(tmp_path_factory, dtype, quantize):
    """Three requests of different prompt lengths share the step (masks, fused projections, the small-query
    attention): each gets its frames, and the rows are not copies of one another."""
    from tts_engine import TTSEngine
    from tests.live_server import tiny_checkpoint

    ck = str(tiny_checkpoint(tmp_path_factory.mktemp("step") / "cv", kind="custom_voice", size="0b6", seed=0))
    eng = TTSEngine.from_pretrained(ck, device="cpu", dtype=dtype, quantize=quantize, max_batch=3)
    try:
        fused = eng.model.talker.model.layers[0].self_attn.qkv_proj is not None
        assert fused == (dtype != "fp32" or quantize is not None)   # fp32 keeps the official layout
        texts = ["Hello there, this is one test.", "Short.", "A somewhat longer sentence goes here now."]
        streams = [eng.stream(t, voice=eng.speakers[0], greedy=True, max_new_tokens=10,
                              sampling={"ignore_eos": True}) for t in texts]
        for s in streams:
            assert sum(len(c) for c in s) > 0
        again = eng.stream(texts[0], voice=eng.speakers[0], greedy=True, max_new_tokens=10,
                           sampling={"ignore_eos": True})
        list(again)
    finally:
        eng.close()
    for s in streams:
        assert s.codes.shape == (9, 16) and int(s.codes.min()) >= 0
    assert len({tuple(s.codes[:, 0].tolist()) for s in streams}) > 1
    assert again.codes.shape == (9, 16)   # a row freed by a batch serves again


@pytest.fixture(scope="module")
def tiny_cv(tmp_path_factory):
    from tests.live_server import tiny_checkpoint

    return str(tiny_checkpoint(tmp_path_factory.mktemp("step_cv") / "cv", kind="custom_voice", size="0b6", seed=0))


def _greedy_codes(eng):
    s = eng.stream("Hello there, this is one test.", voice=eng.speakers[0], greedy=True, max_new_tokens=8,
                   sampling={"ignore_eos": True})
    list(s)
    return s.codes


def test_compiled_predictor_failures_fall_back_to_eager(tiny_cv, monkeypatch, caplog):
    """A compile that raises leaves the engine serving eagerly with one log line; a compiled pass that raises
    later turns it off for good, and the request still gets its codes (the eager ones)."""
    import logging

    from tts_engine import TTSEngine
    from tts_engine.cpu import compiled_predictor

    def broken_compile(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler here")
        return run

    monkeypatch.setattr(compiled_predictor.torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        eng = TTSEngine.from_pretrained(tiny_cv, device="cpu", dtype="bf16", max_batch=1, compile_predictor=True)
    try:
        p = eng.paths()["compiled predictor"]
        assert p["path"] == "eager" and p["how"] == "fell back", p
        assert p["why"].startswith("RuntimeError: no C++ compiler here"), p
        assert not eng.model.talker.code_predictor.compiled.ok
        assert any("serving eagerly" in r.message for r in caplog.records)
        eager = _greedy_codes(eng)
        # a pass that raises mid-request (after a warm-up that worked)
        cp = eng.model.talker.code_predictor
        cp.compiled = compiled_predictor.CompiledPredictorPass(cp, torch.device("cpu"), torch.bfloat16)
        cp.compiled.ok = True
        assert torch.equal(_greedy_codes(eng), eager)
        assert not cp.compiled.ok and cp.compiled.status.startswith("off (RuntimeError")
    finally:
        eng.close()


def test_compiled_pass_starts_in_the_background_and_matches_the_eager_step(tiny_cv, monkeypatch):
    """With a warm-up slower than the budget the engine starts eagerly and turns the pass on when the compile is
    done. The graph's function itself (run here without inductor) computes the eager step's logits."""
    import threading

    from tts_engine import TTSEngine
    from tts_engine.cpu import compiled_predictor

    release = threading.Event()

    def slow_identity_compile(fn, **kw):
        def run(*a, **k):
            release.wait(30)
            return fn(*a, **k)
        return run

    monkeypatch.setattr(compiled_predictor.torch, "compile", slow_identity_compile)
    monkeypatch.setattr(compiled_predictor, "COMPILE_BUDGET_S", 0.2)
    eng = TTSEngine.from_pretrained(tiny_cv, device="cpu", dtype="bf16", max_batch=1, compile_predictor=True)
    try:
        cp = eng.model.talker.code_predictor
        p = eng.paths()["compiled predictor"]
        assert p["path"] == "eager" and p["why"].startswith("compiling") and not cp.compiled.ok, p
        eager = _greedy_codes(eng)           # served eagerly meanwhile
        release.set()
        cp.compiled.thread.join(30)
        p = eng.paths()["compiled predictor"]
        assert p["path"] == "compiled" and p["why"].startswith("warm-up") and cp.compiled.ok, p
        with torch.inference_mode():
            x = torch.randn(1, 1, eng.model.talker.cfg.hidden_size).bfloat16()
            got = cp.step(x, eng.runner.cp_cache, None, 4, 3)
            keep, cp.compiled = cp.compiled, None
            want = cp.step(x, eng.runner.cp_cache, None, 4, 3)
            cp.compiled = keep
        assert ((got - want).norm() / want.norm()) < 1e-2
        assert _greedy_codes(eng).shape == eager.shape
    finally:
        eng.close()


def test_compiled_predictor_is_off_by_default_and_for_fp32(tiny_cv, monkeypatch):
    from tts_engine import TTSEngine

    monkeypatch.delenv("TTS_COMPILE_PREDICTOR", raising=False)
    eng = TTSEngine.from_pretrained(tiny_cv, device="cpu", dtype="bf16", max_batch=1)
    p = eng.paths()["compiled predictor"]
    assert (p["path"], p["how"]) == ("eager", "default") and eng.model.talker.code_predictor.compiled is None, p
    eng.close()
    eng = TTSEngine.from_pretrained(tiny_cv, device="cpu", dtype="fp32", max_batch=1, compile_predictor=True)
    p = eng.paths()["compiled predictor"]
    assert p["path"] == "eager" and p["why"].startswith("CPU 16-bit or quantised"), p
    eng.close()


@pytest.mark.skipif(os.environ.get("TTS_TEST_COMPILE") != "1",
                    reason="a real inductor compile takes 1-3 min on 2 cores; TTS_TEST_COMPILE=1 runs it")
def test_compiled_predictor_gives_the_eager_codes(tiny_cv, tmp_path, monkeypatch):
    from tts_engine import TTSEngine
    from tts_engine.cpu import compiled_predictor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compiled_predictor, "COMPILE_BUDGET_S", 3600.0)
    eng = TTSEngine.from_pretrained(tiny_cv, device="cpu", dtype="bf16", max_batch=1, compile_predictor=True)
    try:
        assert eng.paths()["compiled predictor"]["path"] == "compiled", eng.paths()["compiled predictor"]
        cp = eng.model.talker.code_predictor
        compiled = _greedy_codes(eng)
        with torch.inference_mode():
            x = torch.randn(1, 1, eng.model.talker.cfg.hidden_size).bfloat16()
            got = cp.step(x, eng.runner.cp_cache, None, 4, 3)
            keep, cp.compiled = cp.compiled, None
            want = cp.step(x, eng.runner.cp_cache, None, 4, 3)
        assert ((got - want).norm() / want.norm()) < 2e-2
        assert torch.equal(compiled, _greedy_codes(eng))
        cp.compiled = keep
    finally:
        eng.close()
