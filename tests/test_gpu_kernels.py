"""The fused GPU kernels (tts_engine/gpu/kernels.py) against their eager PyTorch references (tts_engine/gpu/ops.py,
built from model/layers.py and model/sampling.py), run through Triton's interpreter on CPU tensors.

How TRITON_INTERPRET behaves (triton 3.9, checked): Triton reads it when a @triton.jit function is *decorated*
(when tts_engine.gpu.kernels is imported), not when triton itself is imported, so an earlier `import triton`
elsewhere does no harm; and its interpreter reads it again while a kernel runs (a launch without it fails an
assertion in triton's gluon import). So a module-scoped fixture sets it for this module's tests only and re-imports
the kernels module under it (importlib.reload re-decorates the kernels as interpreted ones; no subprocess needed),
then puts both back: other tests never see the variable. With TTS_GPU_TEST_DEVICE=cuda the same tests run the
compiled kernels on a GPU instead.

Every kernel: fp32 and bf16, batch 1, 4 and 64, odd lengths (1, 7, 17, 33). Tolerances:
- fp32: 1e-5 (abs and rel; the kernels sum in another order than PyTorch: observed <= 5e-7);
- bf16: the kernels round every value where the eager code rounds it (same formula), so the results are the eager
  ones except where an fp32 sum in another order lands the value on the other side of a bf16 rounding boundary:
  1 bf16 ulp (rel 2^-7) allowed, and >= 95 % of the elements must be bit-identical; RoPE rounds once instead of
  three times (the eager code rounds cos/sin and both products to bf16): up to 2 ulps allowed, and the kernel must
  be at least as close as eager to a float64 rotation;
- copies (the value cache, the residual of add+RMSNorm, the state updates of the sampler): exact;
- the sampler: the same ids as sampling.choose / C0Processor (exact) on fp32 logits; on bf16-valued logits, where
  equal logits at the top-k cut are common, ids can part where torch.topk keeps another of the equal values than the
  kernel (the lowest ids): counted and bounded, not required equal.
The whole file takes ~30-50 s of CPU here (the interpreter costs ~50 us per operation of a program)."""
from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable: the fused GPU kernels cannot be run or tested here")

from tts_engine.gpu import kernels, ops  # noqa: E402  (after the skip: they import triton)
from tts_engine.model.layers import apply_rope, rms_norm, rope_cos_sin, signed_sin  # noqa: E402
from tts_engine.model.sampling import C0Processor, RowParams, SamplingParams, host_facts  # noqa: E402

DEVICE = os.environ.get("TTS_GPU_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """TRITON_INTERPRET=1 for this module's tests only, the kernels module re-imported under it (and again after,
    without it), automatic dispatch forced to the kernels for CPU tensors."""
    if DEVICE != "cpu":
        yield
        return
    with interpreted_kernels():
        yield


@contextlib.contextmanager
def interpreted_kernels():
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    reloaded = not kernels.INTERPRET
    if reloaded:
        importlib.reload(kernels)
    try:
        assert ops.interpreted()
        with ops.force_interpreter():
            yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
        if reloaded:
            importlib.reload(kernels)


BF16_ULP = 2.0 ** -7


def rnd(g, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def close(got, want, dtype, ulps=1, same_frac=0.95, atol=1e-3):
    """fp32: within 1e-5; bf16: within `ulps` bf16 ulps (relative; `atol` absolute near zero), and at least
    `same_frac` of the elements bit-identical."""
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got, want, atol=atol, rtol=ulps * BF16_ULP * 1.01)
    frac = float((got == want).float().mean())
    assert frac >= same_frac, f"only {frac:.3f} of the elements are bit-identical"


DTYPES = [torch.float32, torch.bfloat16]


# --- (a) residual add + RMSNorm ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,D", [(1, 17, 80), (4, 7, 64), (64, 1, 80), (1, 33, 1024)])
def test_add_rmsnorm(dtype, B, T, D):
    g = torch.Generator().manual_seed(B * 100 + T)
    x, res = rnd(g, B, T, D, scale=3, dtype=dtype), rnd(g, B, T, D, dtype=dtype)
    w = (1 + 0.2 * rnd(g, D)).to(dtype)
    s, out = ops.add_rmsnorm(x, res, w, 1e-6)
    assert s.dtype == out.dtype == dtype and out.shape == x.shape
    assert torch.equal(s, res + x)                              # the residual: one rounded add, as eager
    close(out, rms_norm(res + x, w, 1e-6), dtype)
    s1, out1 = ops.add_rmsnorm(x, None, w, 1e-6)                # the first norm of a stack: no residual
    assert s1 is x
    close(out1, rms_norm(x, w, 1e-6), dtype)


def test_add_rmsnorm_rounds_before_the_weight():
    """bf16: the normalised value is cast to bf16 *before* the weight multiply (the official order), not after: a
    kernel that multiplied in fp32 and rounded once would differ from the reference in many elements."""
    g = torch.Generator().manual_seed(3)
    x = rnd(g, 64, 96, dtype=torch.bfloat16)
    w = (1 + 0.3 * rnd(g, 96)).to(torch.bfloat16)
    _, out = ops.add_rmsnorm(x, None, w, 1e-6)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    once = (w.float() * h).to(torch.bfloat16)
    assert (out != once).float().mean() > 0.02        # the order is visible at this size...
    close(out, rms_norm(x, w, 1e-6), torch.bfloat16)   # ...and the kernel follows the reference


# --- (b) q/k RMSNorm + RoPE + KV-cache write ------------------------------------------------------------------------
def rope_float64(y: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """The rotate-half rotation of y [B, H, T, hd] in float64 (angles from the same fp32 inverse frequencies)."""
    hd = y.shape[-1]
    ang = pos.double()[:, None, :, None] * ops.inv_freq(hd, theta, y.device).double()
    ang = torch.cat([ang, ang], -1)
    y = y.double()
    y1, y2 = y.chunk(2, -1)
    return y * ang.cos() + torch.cat([-y2, y1], -1) * ang.sin()


CASES_ROPE = [  # (B, T, H, Hkv, hd, lengths after the write): odd lengths, a 17-position write, the real head shape
    (1, 1, 4, 2, 32, [33]), (1, 17, 4, 2, 16, [17]), (4, 2, 4, 2, 32, [2, 7, 17, 33]), (64, 1, 4, 2, 16, None),
    (1, 1, 16, 8, 128, [7])]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,H,Hkv,hd,lens", CASES_ROPE)
def test_qk_norm_rope_write(dtype, B, T, H, Hkv, hd, lens):
    g = torch.Generator().manual_seed(B + T + hd)
    L, R, theta = 40, B + 3, 1e6
    lens = lens or torch.randint(T, L + 1, (B,), generator=g).tolist()
    pos = torch.tensor([[n - T + t for t in range(T)] for n in lens]).to(DEVICE)
    rows = torch.randperm(R, generator=g)[:B].to(DEVICE)
    qkv = rnd(g, B, T, (H + 2 * Hkv) * hd, scale=2, dtype=dtype)
    qw, kw = (1 + 0.2 * rnd(g, hd)).to(dtype), (1 + 0.2 * rnd(g, hd)).to(dtype)
    kc, vc = rnd(g, R, Hkv, L, hd, dtype=dtype), rnd(g, R, Hkv, L, hd, dtype=dtype)
    kc_e, vc_e, kc0, vc0 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = ops.qk_norm_rope_write(qkv, qw, kw, 1e-6, pos, rows, kc, vc, H, Hkv, theta)
    q_e = ops.qk_norm_rope_write(qkv, qw, kw, 1e-6, pos, rows, kc_e, vc_e, H, Hkv, theta, impl="eager")
    assert q.shape == (B, T, H, hd) and q.dtype == dtype
    written = torch.zeros(R, L, dtype=torch.bool)
    written[rows.cpu()[:, None].expand(B, T), pos.cpu()] = True
    assert torch.equal(vc, vc_e)                                          # values: copied exactly
    assert torch.equal(kc.transpose(1, 2)[~written.to(DEVICE)], kc0.transpose(1, 2)[~written.to(DEVICE)])
    assert torch.equal(vc.transpose(1, 2)[~written.to(DEVICE)], vc0.transpose(1, 2)[~written.to(DEVICE)])
    # bf16: eager rounds x*cos and rot*sin to bf16 before adding them, so near a cancellation its error is an ulp
    # of the products (|y| <= ~4: 2^-6), not of the result
    close(q, q_e, dtype, ulps=2, same_frac=0.7, atol=0.02)
    close(kc, kc_e, dtype, ulps=2, same_frac=0.9, atol=0.02)
    if dtype == torch.bfloat16:   # RoPE in fp32 and one rounding: at least as close as eager to a float64 rotation
        qn = rms_norm(qkv.view(B, T, H + 2 * Hkv, hd)[:, :, :H], qw, 1e-6).transpose(1, 2)
        exact = rope_float64(qn, pos, theta).transpose(1, 2)
        err_kernel = (q.double() - exact).abs().mean()
        err_eager = (q_e.double() - exact).abs().mean()
        assert err_kernel <= err_eager, (err_kernel, err_eager)


def test_qk_norm_rope_write_is_the_eager_layer():
    """The reference is the eager layer's own arithmetic (rms_norm per head, rope_cos_sin, signed sin, apply_rope)."""
    g = torch.Generator().manual_seed(5)
    B, T, H, Hkv, hd = 2, 3, 4, 2, 16
    qkv = rnd(g, B, T, (H + 2 * Hkv) * hd)
    qw, kw = 1 + 0.2 * rnd(g, hd), 1 + 0.2 * rnd(g, hd)
    pos = torch.tensor([[4, 5, 6], [0, 1, 2]], device=DEVICE)
    kc, vc = torch.zeros(2, Hkv, 8, hd, device=DEVICE), torch.zeros(2, Hkv, 8, hd, device=DEVICE)
    q = ops.qk_norm_rope_write(qkv, qw, kw, 1e-6, pos, torch.tensor([1, 0], device=DEVICE), kc, vc, H, Hkv, 1e4)
    cos, sin = rope_cos_sin(pos, hd, 1e4, torch.float32)
    qn = rms_norm(qkv.view(B, T, -1, hd)[:, :, :H], qw, 1e-6).transpose(1, 2)
    close(q, apply_rope(qn, cos, signed_sin(sin)).transpose(1, 2), torch.float32)
    kn = rms_norm(qkv.view(B, T, -1, hd)[:, :, H:H + Hkv], kw, 1e-6).transpose(1, 2)
    close(kc[1, :, 4:7], apply_rope(kn, cos, signed_sin(sin))[0], torch.float32)


# --- (c) decode attention ---------------------------------------------------------------------------------------------
CASES_ATTN = [  # (B, T, H, Hkv, hd, row lengths, splits): one key, a 17-position predictor call, odd lengths, 64 rows
    (1, 1, 4, 2, 16, [1], None), (1, 17, 4, 2, 16, [17], None), (4, 2, 4, 2, 32, [2, 7, 17, 33], None),
    (4, 1, 8, 1, 16, [1, 7, 17, 33], None), (64, 1, 4, 4, 16, None, None), (2, 1, 16, 8, 128, [300, 33], 4),
    (3, 2, 4, 2, 16, [2, 130, 257], 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,H,Hkv,hd,lens,splits", CASES_ATTN)
def test_decode_attention(dtype, B, T, H, Hkv, hd, lens, splits):
    g = torch.Generator().manual_seed(B * 7 + T)
    lens = lens or torch.randint(T, 41, (B,), generator=g).tolist()
    L, R = max(lens) + 5, B + 2
    read_len = max(lens)
    rows = torch.randperm(R, generator=g)[:B].to(DEVICE)
    qpos = torch.tensor([[n - T + t for t in range(T)] for n in lens], device=DEVICE)
    q = rnd(g, B, T, H, hd, scale=2, dtype=dtype)
    kc, vc = rnd(g, R, Hkv, L, hd, dtype=dtype), rnd(g, R, Hkv, L, hd, dtype=dtype)
    want = ops.decode_attention(q, kc, vc, rows, qpos, read_len, impl="eager")
    exact = ops.decode_attention(q.double(), kc.double(), vc.double(), rows, qpos, read_len, impl="eager")
    # keys past each row's length are never read: NaN there would poison the output of a kernel that read them
    for b, n in enumerate(lens):
        kc[rows[b], :, n:] = float("nan")
        vc[rows[b], :, n:] = float("nan")
    got = ops.decode_attention(q, kc, vc, rows, qpos, read_len, splits=splits)
    assert got.shape == (B, T, H * hd) and got.dtype == dtype
    if dtype == torch.float32:
        # against the float64 attention: on a GPU PyTorch's own fp32 attention (the eager path) may round through
        # TF32 (1e-3 apart from float64, seen on an H200), while the kernel computes in fp32 throughout (in fp32 it
        # avoids the product form Triton compiles into a TF32 dot)
        close(got, exact.float(), dtype)
        return
    # bf16: PyTorch's attention rounds the probabilities to bf16 before the value product (as flash attention does);
    # the kernel keeps them in fp32 and rounds once: it must be within one bf16 rounding of the float64 attention of
    # the same inputs, and no farther from it than eager
    got64, want64 = got.double().cpu(), want.double().cpu()
    exact = exact.cpu()
    assert torch.isfinite(got64).all()
    assert ((got64 - exact).abs() <= exact.abs() * BF16_ULP / 2 * 1.01 + 1e-5).all()
    assert (got64 - exact).abs().mean() <= (want64 - exact).abs().mean()
    close(got, want, dtype, ulps=2, same_frac=0.5, atol=4e-3)


def test_decode_attention_splits_agree():
    """The same attention with the keys cut in 1, 2, 4 and 8 ranges (flash-decoding and the combine kernel)."""
    g = torch.Generator().manual_seed(9)
    q = rnd(g, 2, 1, 4, 32)
    kc, vc = rnd(g, 2, 2, 520, 32), rnd(g, 2, 2, 520, 32)
    rows, qpos = torch.tensor([1, 0], device=DEVICE), torch.tensor([[513], [77]], device=DEVICE)
    want = ops.decode_attention(q, kc, vc, rows, qpos, 514, impl="eager")
    for s in (1, 2, 4, 8):
        close(ops.decode_attention(q, kc, vc, rows, qpos, 514, splits=s), want, torch.float32)
    assert ops.attention_splits(1, 8, 2048) > 1 and ops.attention_splits(64, 8, 2048) == 1
    assert ops.attention_splits(1, 8, 17) == 1


# --- (d) SiLU(gate) * up ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,I", [(1, 17, 96), (4, 7, 64), (64, 1, 96), (1, 1, 3072)])
def test_silu_mul(dtype, B, T, I):
    g = torch.Generator().manual_seed(B + T)
    gu = rnd(g, B, T, 2 * I, scale=3, dtype=dtype)
    got = ops.silu_mul(gu)
    assert got.shape == (B, T, I) and got.dtype == dtype
    gate, up = gu.chunk(2, dim=-1)
    close(got, torch.nn.functional.silu(gate) * up, dtype)


# --- the talker's input embedding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 4, 64])
def test_frame_embed(dtype, B):
    g = torch.Generator().manual_seed(B)
    D, R, cap = 80, B + 2, 7
    sizes = [3072] + [2048] * 15
    table = rnd(g, sum(sizes), D, dtype=dtype)
    offsets = torch.tensor([sum(sizes[:k]) for k in range(16)], device=DEVICE)
    codes = torch.stack([torch.randint(0, n, (B,), generator=g) for n in sizes], 1).to(DEVICE)
    trailing = rnd(g, R, cap, D, dtype=dtype)
    tlen = torch.randint(0, cap + 1, (R,), generator=g).to(DEVICE)
    step = torch.randint(0, cap + 3, (R,), generator=g).to(DEVICE)   # step 0 (a free row) and past the cap too
    step[0] = 0
    pad = rnd(g, D, dtype=dtype)
    rows = torch.randperm(R, generator=g)[:B].to(DEVICE)
    got = ops.frame_embed(codes, table, offsets, trailing, tlen, pad, step, rows)
    want = ops.frame_embed(codes, table, offsets, trailing, tlen, pad, step, rows, impl="eager")
    close(got, want, dtype)


# --- (e) the sampler --------------------------------------------------------------------------------------------------
def row_params(B: int, seed: int) -> list[SamplingParams]:
    """B rows: sampled and greedy, top_k 50 / 1 / 0 (all) / 10 / 3 / 2048 / 7, top_p < 1 on some, temperatures,
    repetition penalties, ignore_eos on one, per-row seeds."""
    ks, ps, ts = [50, 1, 0, 10, 50, 3, 2048, 7], [1.0, 0.8, 1.0, 0.5, 0.95, 1.0, 0.7, 0.9], [0.9, 1.0, 0.5, 1.3]
    return [SamplingParams(do_sample=i % 4 != 1, top_k=ks[i % 8], top_p=ps[(i + 3) % 8], temperature=ts[i % 4],
                           repetition_penalty=1.05 + 0.1 * (i % 3), subtalker_dosample=i % 4 != 1,
                           subtalker_top_k=ks[i % 8], subtalker_top_p=ps[i % 8], subtalker_temperature=ts[(i + 1) % 4],
                           seed=1000 * seed + 17 * i, ignore_eos=i % 5 == 2) for i in range(B)]


def stack(params, facts=None) -> RowParams:
    rp = RowParams.stack(params, DEVICE)
    if facts is not None:
        rp.host = facts
    return rp


GENERAL = {"any_sample": True, "k_max": 64, "any_top_p": True}   # the captured graphs' facts (model_runner)


@pytest.mark.parametrize("B,books,general", [(1, (1, 15), False), (4, (1, 8, 15), False), (4, (2,), True),
                                             (64, (1,), False)])
def test_sampler_residual_is_choose_residual(B, books, general):
    """Exact on fp32 logits: greedy rows, top-k by rank, temperature, top-p, the seeded Gumbel draw."""
    g = torch.Generator().manual_seed(B)
    params = row_params(B, B)
    if general:   # the graphs' facts: every row scores the 64 best (its top_k <= 64)
        params = [SamplingParams(**{**p.__dict__, "subtalker_top_k": min(max(p.subtalker_top_k, 1), 64)})
                  for p in params]
    rp = stack(params, {"c0": GENERAL, "sub": GENERAL} if general else None)
    R = B + 3
    rows = torch.randperm(R, generator=g)[:B].to(DEVICE)
    step = torch.randint(1, 500, (R,), generator=g).to(DEVICE)
    sampled = differs = 0
    for trial in range(2):
        logits = rnd(g, B, 2048, scale=2.5)
        for book in books:
            want = ops.sample_residual(logits, rows, step, rp, book, impl="eager")
            got = ops.sample_residual(logits, rows, step, rp, book)
            assert torch.equal(got, want), f"book {book}: {(got != want).sum()} of {B} ids differ"
            greedy = logits.argmax(-1)
            sampled += int(rp.sub_do_sample.sum())
            differs += int((rp.sub_do_sample & (want != greedy)).sum())
    assert B == 1 or differs > 0, "no sampled row drew anything but the argmax: the check would be vacuous"


@pytest.mark.parametrize("B", [1, 4, 64])
def test_sampler_c0_is_the_c0_processor_with_the_state_update(B):
    """Codebook 0: repetition penalty over seen, EOS blocked before min_new_tokens (or with ignore_eos), suppressed
    ids, then choose; and the runner's _after_c0 + position update in the same launch (seen, step, c0, hidden, done,
    pos: exact)."""
    g = torch.Generator().manual_seed(10 + B)
    V, D, R, eos = 3072, 48, B + 2, 2150
    proc = C0Processor(V, eos, 2, DEVICE)
    params = row_params(B, B)
    if B == 64:   # the interpreter's cost is per sampled row: half of them greedy
        params = [SamplingParams(**{**p.__dict__, "do_sample": p.do_sample and i % 2 == 0})
                  for i, p in enumerate(params)]
    rp = stack(params)
    rows = torch.randperm(R, generator=g)[:B].to(DEVICE)
    for trial in range(2):
        logits = rnd(g, B, V, scale=2)
        logits[:, eos] += 20 * trial                 # then EOS the best by far: blocked for the first two steps only
        logits[:, 2060] += 10                        # a suppressed id far ahead: never drawn
        state = {"seen": torch.rand(R, V, generator=g).to(DEVICE) < 0.05,
                 "step": torch.randint(0, 4, (R,), generator=g).to(DEVICE),
                 "hidden": rnd(g, R, D), "c0": torch.zeros(R, dtype=torch.long, device=DEVICE),
                 "max_new": torch.randint(1, 6, (R,), generator=g).to(DEVICE),
                 "pos": torch.randint(0, 40, (R,), generator=g).to(DEVICE)}
        state["pos"][rows[0]] = 39                                 # at the cap: stays
        h = rnd(g, B, D)
        outs = []
        for impl in ("eager", None):
            st = {k: v.clone() for k, v in state.items()}
            extra = dict(h=h, hidden=st["hidden"], c0=st["c0"], max_new=st["max_new"], pos=st["pos"], max_pos=39,
                         done=torch.empty(B, dtype=torch.bool, device=DEVICE))
            ids, done = ops.sample_c0(logits, rows, rp, proc, st["seen"], st["step"], impl=impl, state=extra)
            outs.append((ids.clone(), done.clone(), st))
        (ids_e, done_e, st_e), (ids_k, done_k, st_k) = outs
        assert torch.equal(ids_k, ids_e), f"{(ids_k != ids_e).sum()} of {B} ids differ"
        assert torch.equal(done_k, done_e)
        for k in state:
            assert torch.equal(st_k[k], st_e[k]), k
        assert not (ids_e == 2060).any()
        blocked = (state["step"][rows] < 2) | rp.ignore_eos
        assert not (ids_e[blocked] == eos).any()
        if trial == 1:
            assert (ids_e[~blocked] == eos).all()


def test_sampler_greedy_ties_take_the_first_maximum():
    logits = torch.zeros(3, 2048, device=DEVICE)
    logits[:, 5] = logits[:, 9] = 2.0
    rp = stack([SamplingParams(subtalker_dosample=False), SamplingParams(subtalker_top_k=1, seed=3),
                SamplingParams(subtalker_top_k=1, subtalker_top_p=0.1, seed=4)])
    rows, step = torch.arange(3, device=DEVICE), torch.ones(3, dtype=torch.long, device=DEVICE)
    assert ops.sample_residual(logits, rows, step, rp, 4).tolist() == [5, 5, 5]
    assert ops.sample_residual(logits, rows, step, rp, 4, impl="eager").tolist() == [5, 5, 5]


def test_sampler_bf16_logits():
    """bf16 logits straight from a bf16 head (the kernel reads them; eager casts them to fp32 first). Many logits
    are equal: where the k-th value is tied, torch.topk keeps an unspecified one of the equal ids, the kernel the
    lowest ids, so a draw can part; greedy rows and rows whose cut is not tied must agree. Bounded here."""
    g = torch.Generator().manual_seed(21)
    B, n, same, untied_bad = 16, 0, 0, 0
    rp = stack(row_params(B, 3))
    rows, step = torch.arange(B, device=DEVICE), torch.randint(1, 300, (B,), generator=g).to(DEVICE)
    for trial in range(3):
        logits = rnd(g, B, 2048, scale=2, dtype=torch.bfloat16)
        want = ops.sample_residual(logits.float(), rows, step, rp, 5, impl="eager")
        got = ops.sample_residual(logits, rows, step, rp, 5)
        lf = logits.float()
        for b in range(B):
            k = int(rp.sub_top_k[b]) if int(rp.sub_top_k[b]) > 0 else 2048
            kth = lf[b].topk(min(k, 2048)).values[-1]
            tied = int((lf[b] == kth).sum()) > 1 and k < 2048
            n += 1
            same += int(got[b] == want[b])
            if not bool(rp.sub_do_sample[b]) or not tied and float(rp.sub_top_p[b]) >= 1.0:
                untied_bad += int(got[b] != want[b])
    assert untied_bad == 0
    assert same >= 0.8 * n, f"{n - same} of {n} bf16 draws differ"


def test_sampler_host_facts_greedy_batch_skips_the_search():
    """A batch whose host facts say nobody samples takes the argmax for every row (the search is compiled out)."""
    g = torch.Generator().manual_seed(2)
    params = [SamplingParams(subtalker_dosample=False, seed=i) for i in range(4)]
    rp = stack(params)
    assert rp.host["sub"]["any_sample"] is False and host_facts(params)["sub"]["k_max"] == 50
    logits = rnd(g, 4, 2048)
    got = ops.sample_residual(logits, torch.arange(4, device=DEVICE), torch.ones(4, dtype=torch.long, device=DEVICE),
                              rp, 1)
    assert torch.equal(got, logits.argmax(-1))


# --- (f) small-M projections with their neighbours fused in ------------------------------------------------------
# (B, T, K, N): one token, a predictor first step (2 positions), 4 rows, 64 rows, odd widths; the gemv variant of the
# frame runs them at <= ops.GEMV_MAX_ROWS rows, the kernel itself takes any number
CASES_GEMV = [(1, 1, 80, 96), (1, 2, 64, 40), (4, 2, 33, 24), (64, 1, 80, 48), (1, 1, 1024, 256), (3, 1, 17, 7)]


def _f64(*ts):
    return [t.double() if t is not None else None for t in ts]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,K,N", CASES_GEMV)
def test_norm_linear(dtype, B, T, K, N):
    """y = (residual + x -> RMSNorm) W^T in one launch, the residual stream and the normed rows written by program 0;
    also without the norm (a plain projection: o, down) and with a norm but no residual (a stack's first layer)."""
    g = torch.Generator().manual_seed(B * 31 + K)
    x, res = rnd(g, B, T, K, scale=2, dtype=dtype), rnd(g, B, T, K, dtype=dtype)
    ln = (1 + 0.2 * rnd(g, K)).to(dtype)
    w = rnd(g, N, K, scale=K ** -0.5, dtype=dtype)
    for r, norm in ((res, ln), (None, ln), (None, None)):
        y, s, hn = ops.norm_linear(x, w, norm, r, 1e-6, want_normed=True)
        ye, se, hne = ops.norm_linear(x, w, norm, r, 1e-6, want_normed=True, impl="eager")
        assert y.shape == (B, T, N) and y.dtype == dtype
        if norm is None:
            assert s is None and hn is None
        else:
            assert torch.equal(s, se)                               # the residual: one rounded add, as eager
            close(hn, hne, dtype)                                   # the normed rows (the talker's hidden state)
        if dtype == torch.float32:   # against float64 (PyTorch's fp32 GEMM may round through TF32 on a GPU)
            close(y, ops.norm_linear(*_f64(x, w, norm, r), 1e-6, impl="eager")[0].float(), dtype)
        else:
            close(y, ye, dtype, ulps=1, same_frac=0.9)


def test_norm_linear_reads_strided_rows():
    """The head reads the last position of each row ([B, T, D] -> [:, -1], rows T * D apart) without a copy."""
    g = torch.Generator().manual_seed(4)
    m, res = rnd(g, 3, 2, 48), rnd(g, 3, 2, 48)
    ln, w = 1 + 0.2 * rnd(g, 48), rnd(g, 20, 48, scale=0.2)
    y, s, hn = ops.norm_linear(m[:, -1], w, ln, res[:, -1], 1e-6, want_normed=True)
    ye, se, hne = ops.norm_linear(m[:, -1].contiguous(), w, ln, res[:, -1].contiguous(), 1e-6, want_normed=True,
                                  impl="eager")
    close(y, ye, torch.float32)
    close(hn, hne, torch.float32)
    assert torch.equal(s, se)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,K,I", [(1, 1, 80, 96), (1, 2, 64, 40), (4, 2, 33, 24), (64, 1, 80, 48),
                                     (1, 1, 256, 768)])
def test_norm_gate_up_silu(dtype, B, T, K, I):
    g = torch.Generator().manual_seed(B * 13 + I)
    x, res = rnd(g, B, T, K, scale=2, dtype=dtype), rnd(g, B, T, K, dtype=dtype)
    ln = (1 + 0.2 * rnd(g, K)).to(dtype)
    wgu = rnd(g, 2 * I, K, scale=2 * K ** -0.5, dtype=dtype)
    act, s = ops.norm_gate_up_silu(x, res, ln, 1e-6, wgu)
    act_e, s_e = ops.norm_gate_up_silu(x, res, ln, 1e-6, wgu, impl="eager")
    assert act.shape == (B, T, I) and act.dtype == dtype
    assert torch.equal(s, s_e)
    if dtype == torch.float32:
        close(act, ops.norm_gate_up_silu(*_f64(x, res, ln), 1e-6, wgu.double(), impl="eager")[0].float(), dtype)
    else:   # a 1-ulp difference of gate or up (fp32 sums in another order) moves the product by up to 2 ulps
        close(act, act_e, dtype, ulps=2, same_frac=0.85)


CASES_QKV = [  # (B, T, K, H, Hkv, hd, lengths after the write)
    (1, 1, 64, 4, 2, 16, [33]), (1, 2, 48, 4, 2, 8, [2]), (4, 2, 33, 4, 2, 32, [2, 7, 17, 33]),
    (64, 1, 64, 4, 2, 16, None), (1, 1, 128, 16, 8, 128, [7])]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,K,H,Hkv,hd,lens", CASES_QKV)
def test_norm_qkv_rope_write(dtype, B, T, K, H, Hkv, hd, lens):
    """residual add + RMSNorm -> qkv projection -> q/k RMSNorm + RoPE -> q out, keys and values into the caches at
    (rows[b], :, pos[b, t]), in one launch (one program per head); nothing else of the caches touched."""
    g = torch.Generator().manual_seed(B + T + hd + K)
    L, R, theta = 40, B + 3, 1e6
    lens = lens or torch.randint(T, L + 1, (B,), generator=g).tolist()
    pos = torch.tensor([[n - T + t for t in range(T)] for n in lens]).to(DEVICE)
    rows = torch.randperm(R, generator=g)[:B].to(DEVICE)
    x, res = rnd(g, B, T, K, scale=2, dtype=dtype), rnd(g, B, T, K, dtype=dtype)
    ln = (1 + 0.2 * rnd(g, K)).to(dtype)
    wqkv = rnd(g, (H + 2 * Hkv) * hd, K, scale=2 * K ** -0.5, dtype=dtype)
    qw, kw = (1 + 0.2 * rnd(g, hd)).to(dtype), (1 + 0.2 * rnd(g, hd)).to(dtype)
    kc, vc = rnd(g, R, Hkv, L, hd, dtype=dtype), rnd(g, R, Hkv, L, hd, dtype=dtype)
    kc_e, vc_e, kc0, vc0 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    args = (qw, kw, pos, rows)
    q, s = ops.norm_qkv_rope_write(x, res, ln, 1e-6, wqkv, *args, kc, vc, H, Hkv, theta)
    q_e, s_e = ops.norm_qkv_rope_write(x, res, ln, 1e-6, wqkv, *args, kc_e, vc_e, H, Hkv, theta, impl="eager")
    assert q.shape == (B, T, H, hd) and q.dtype == dtype
    assert torch.equal(s, s_e)
    written = torch.zeros(R, L, dtype=torch.bool)
    written[rows.cpu()[:, None].expand(B, T), pos.cpu()] = True
    w_ = written.to(DEVICE)
    assert torch.equal(kc.transpose(1, 2)[~w_], kc0.transpose(1, 2)[~w_])
    assert torch.equal(vc.transpose(1, 2)[~w_], vc0.transpose(1, 2)[~w_])
    if dtype == torch.float32:
        kc64, vc64 = kc0.double(), vc0.double()
        q64, _ = ops.norm_qkv_rope_write(*_f64(x, res, ln), 1e-6, wqkv.double(), qw.double(), kw.double(), pos, rows,
                                         kc64, vc64, H, Hkv, theta, impl="eager")
        close(q, q64.float(), dtype)
        close(kc, kc64.float(), dtype)
        close(vc, vc64.float(), dtype)
        return
    # bf16: the projection's output may differ by an ulp (fp32 sums in another order); the norm and RoPE then as in
    # test_qk_norm_rope_write (eager rounds cos/sin and both products, the kernel once)
    close(vc, vc_e, dtype, ulps=1, same_frac=0.9)
    close(q, q_e, dtype, ulps=2, same_frac=0.6, atol=0.03)
    close(kc, kc_e, dtype, ulps=2, same_frac=0.8, atol=0.03)


def test_gemv_blocks_fit_a_gpu():
    """On a GPU the partial sums of a program fit its registers and a 0.6B projection spreads over >= ~128
    programs (a matrix-vector product is bound by reading W from memory); the interpreter takes larger tiles."""
    old = ops.K_INTERPRET
    try:
        ops.K_INTERPRET = lambda: False
        for M, N, K, two, bn in ((1, 1024, 1024, False, None), (1, 1024, 3072, False, None), (2, 3072, 1024, True,
                                                                                                None),
                                 (8, 2048, 1024, False, None), (1, 4096, 1024, True, 64), (8, 4096, 1024, True, 64)):
            BM, BN, BK, nw = ops._gemv_blocks(M, N, K, two, bn)
            assert BM >= M and BM * BN * BK * (2 if two else 1) <= ops._GEMV_REGS * (nw // 4)
            if bn is None:
                assert -(-N // BN) >= 128 or BN == 2
    finally:
        ops.K_INTERPRET = old


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's dispatch")
def test_dispatch():
    """Automatic dispatch: the reference for CPU tensors unless forced; impl= picks either explicitly."""
    x = torch.randn(2, 8)
    w = torch.ones(8)
    assert ops.use_triton(x)        # forced in this module
    with ops.force_interpreter(False):
        assert not ops.use_triton(x)
    assert ops.use_triton(x, "triton") and not ops.use_triton(x, "eager")
    with pytest.raises(ValueError):
        ops.use_triton(x, "fast")
    a, b = ops.add_rmsnorm(x, None, w, 1e-6, impl="eager"), ops.add_rmsnorm(x, None, w, 1e-6, impl="triton")
    close(b[1], a[1], torch.float32)


def test_every_kernel_variant_compiles_for_an_h100(tmp_path):
    """The interpreter accepts programs a GPU compiler refuses: every kernel variant the fused frame launches, at the
    0.6B shapes in bf16, goes through Triton's whole pipeline to an sm_90 cubin (the wheel's ptxas; no GPU needed), in
    a subprocess without TRITON_INTERPRET (tts_engine/gpu/aot.py). ~10 s of CPU."""
    import pathlib
    import subprocess
    import sys

    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="0")
    p = subprocess.run([sys.executable, "-m", "tts_engine.gpu.aot", "--arch", "0.6b", "--dtype", "bf16", "--sm", "90"],
                       cwd=pathlib.Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    import re

    m = re.search(r"(\d+)/(\d+) kernel variants compile for sm_90", p.stdout)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) >= 13, p.stdout
    # the gemv variant's projections: with and without a residual, each epilogue, 1 / 2 / 8 rows
    assert len(re.findall(r"^ok +sm_90 norm_gemv_kernel\(", p.stdout, re.M)) >= 12, p.stdout
