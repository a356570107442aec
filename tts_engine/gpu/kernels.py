"""Triton kernels of the fused GPU frame. Raw kernels only: `ops` holds the launch wrappers, the eager
references and the dispatch between them.

Numerics follow the eager code in `model/layers.py` and `model/sampling.py`:
- every value the eager code rounds to the activation dtype is rounded here too, at the same place, with
  round-to-nearest-even (`_round`; done with integer bit operations for bf16 because Triton's interpreter truncates
  in its fp32 -> bf16 cast), so the stored results are what PyTorch's own bf16 ops give up to the order of fp32 sums;
- RMSNorm: variance in fp32, normalised value cast back to the activation dtype *before* the weight multiply;
- q/k RMSNorm per head, then RoPE in fp32 (angles, cos/sin and the rotation in fp32, one rounding at the end: the
  eager code rounds cos/sin and the two products to the activation dtype first; in fp32 both are the same ops);
- no FMA contraction (the launches pass enable_fp_fusion=False): a*b + c rounds a*b first, as PyTorch's separate
  ops do; divisions correctly rounded (tl.div_rn: Triton's `/` on fp32 is a 2-ulp approximation on a GPU);
- attention: fp32 scores, an online softmax in fp32, fp32 accumulation (with 16-bit activations the GPU compiler
  turns the probabilities x values product into a TF32 dot: see `decode_attn_kernel`);
- the sampler: the same repetition penalty, masks, temperature, top-k (by rank), top-p and the float64 Gumbel-max draw
  over `sampling.uniforms` as `sampling.choose`, found without a sort (see `sample_kernel`).

Imported only where triton is importable (`ops` guards the import). Which kind of kernel object the decorators make
(compiled for a GPU, or Triton's interpreter running on CPU tensors) is fixed when this module is imported: Triton
reads TRITON_INTERPRET then. `INTERPRET` records it.
"""
from __future__ import annotations

import collections

import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)
# launches of each kernel through `ops` (bench/census.py counts them: `LAUNCHES.clear()`, `LAUNCHES.total()`)
LAUNCHES: collections.Counter = collections.Counter()

# activation dtype codes (constexpr ACT)
ACT_FP32, ACT_BF16, ACT_FP16 = 0, 1, 2


def _helper(fn):
    """A device helper: @triton.jit when compiling for a GPU; under the interpreter the plain Python function (the
    interpreter re-patches triton.language on every call of a jit function, ~4 ms each: a kernel calling helpers in
    a loop would take seconds per program). The reductions below call tl.reduce / tl.associative_scan with the
    standard combine functions directly for the same reason (tl.sum & co. are jit functions; the interpreter has
    numpy fast paths for these combine functions)."""
    return fn if INTERPRET else triton.jit(fn)


@_helper
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@_helper
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@_helper
def _min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@_helper
def _argmax(x, N: tl.constexpr):
    """Index of the first maximum of the 1-D x [N] (as torch.argmax)."""
    _, i = tl.reduce((x, tl.arange(0, N)), 0, tl.standard._argmax_combine_tie_break_left)
    return i


@_helper
def _cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@_helper
def _round(x, ACT: tl.constexpr):
    """fp32 x -> the fp32 value of x cast to the activation dtype (round to nearest, ties to even). Storing the
    result into a tensor of that dtype is then exact on a GPU and in the interpreter alike."""
    if ACT == 1:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        x = bits.to(tl.float32, bitcast=True)
    elif ACT == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


# --- (a) residual add + RMSNorm ---------------------------------------------------------------------------------------
@triton.jit
def add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps, sx, sr, so, sro,
                       HAS_RES: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: s = x + res (rounded to the activation dtype, written to res_out), then
    out = w * cast(s * rsqrt(mean(s^2) + eps)) with the variance in fp32. Without a residual: s = x, nothing written
    to res_out."""
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < D
    x = tl.load(x_ptr + row * sx + o, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * sr + o, mask=m, other=0.0).to(tl.float32)
        x = _round(x + r, ACT)
        tl.store(res_out_ptr + row * sro + o, x.to(res_out_ptr.dtype.element_ty), mask=m)
    var = tl.div_rn(_sum(x * x, 0), D.to(tl.float32))
    h = _round(x * tl.rsqrt(var + eps), ACT)
    w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    y = _round(w * h, ACT)
    tl.store(out_ptr + row * so + o, y.to(out_ptr.dtype.element_ty), mask=m)


# --- (b) q/k RMSNorm + RoPE + KV-cache write --------------------------------------------------------------------------
@triton.jit
def qk_rope_write_kernel(qkv_ptr, qw_ptr, kw_ptr, inv_freq_ptr, pos_ptr, rows_ptr, q_ptr, kc_ptr, vc_ptr,
                         T, s_qkv, s_q, kc_r, kc_h, kc_p, vc_r, vc_h, vc_p, eps,
                         H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, NHP: tl.constexpr,
                         ACT: tl.constexpr):
    """One token (b*T + t) per program, all its heads at once ([NHP, HD], NHP = H + HKV padded to a power of 2):
    head h < H is query head h, h >= H key head kh = h - H (its value head kh is copied alongside). qkv [B*T,
    (H + 2 HKV) * HD] (the concatenated projection's output, rows s_qkv apart); q out [B*T, H, HD] (rows s_q
    apart); the caches are one layer's [R, HKV, L, HD] (strides given, HD contiguous); the new key/value go to
    (rows[b], kh, pos[b, t])."""
    tok = tl.program_id(0)
    b = tok // T
    HALF: tl.constexpr = HD // 2
    hh = tl.arange(0, NHP)
    hm = (hh < H + HKV)[:, None]
    isq = (hh < H)[:, None]
    o = tl.arange(0, HD)
    op = (o + HALF) % HD           # the partner of each element in rotate-half
    base = qkv_ptr + tok.to(tl.int64) * s_qkv
    x = tl.load(base + hh[:, None] * HD + o[None, :], mask=hm, other=0.0).to(tl.float32)
    xp = tl.load(base + hh[:, None] * HD + op[None, :], mask=hm, other=0.0).to(tl.float32)
    w = tl.where(isq, tl.load(qw_ptr + o).to(tl.float32)[None, :], tl.load(kw_ptr + o).to(tl.float32)[None, :])
    wp = tl.where(isq, tl.load(qw_ptr + op).to(tl.float32)[None, :], tl.load(kw_ptr + op).to(tl.float32)[None, :])
    rstd = tl.rsqrt(tl.div_rn(_sum(x * x, 1), HD * 1.0) + eps)[:, None]
    y = _round(w * _round(x * rstd, ACT), ACT)        # the normed heads, as the eager RMSNorm returns them
    yp = _round(wp * _round(xp * rstd, ACT), ACT)
    p = tl.load(pos_ptr + tok)
    ang = (p.to(tl.float32) * tl.load(inv_freq_ptr + (o % HALF)))[None, :]
    rot = tl.where((o < HALF)[None, :], -yp, yp)
    out = _round(y * tl.cos(ang) + rot * tl.sin(ang), ACT)
    tl.store(q_ptr + tok.to(tl.int64) * s_q + hh[:, None] * HD + o[None, :], out.to(q_ptr.dtype.element_ty),
             mask=isq & hm)
    row = tl.load(rows_ptr + b).to(tl.int64)
    p64 = p.to(tl.int64)
    kh = (hh - H)[:, None]
    ism = (~isq) & hm
    tl.store(kc_ptr + row * kc_r + kh * kc_h + p64 * kc_p + o[None, :], out.to(kc_ptr.dtype.element_ty), mask=ism)
    v = tl.load(base + (hh[:, None] + HKV) * HD + o[None, :], mask=ism)
    tl.store(vc_ptr + row * vc_r + kh * vc_h + p64 * vc_p + o[None, :], v.to(vc_ptr.dtype.element_ty), mask=ism)


# --- (c) decode attention over each row's real length -----------------------------------------------------------------
@triton.jit
def decode_attn_kernel(q_ptr, kc_ptr, vc_ptr, rows_ptr, qpos_ptr, out_ptr, acc_ptr, ml_ptr,
                       T, split_len, sm_scale, s_qt, s_qh, kc_r, kc_h, kc_p, vc_r, vc_h, vc_p, s_ot, s_oh,
                       G: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ACT: tl.constexpr):
    """Program (batch row b, key head kvh, split sp): the G*T query rows of key head kvh (row m = g*T + t: query head
    kvh*G + g at new position t) against keys 0..qpos[b, t] of cache row rows[b]: each row reads its own length, not
    the static buffer. Keys are cut into SPLITS ranges of split_len (flash-decoding); with one split the output is
    written here, else the partial (acc, max, sum) for `attn_combine_kernel`. Scores (q . k) * sm_scale, online
    softmax and accumulation in fp32."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    mi = tl.arange(0, BLOCK_M)
    g = mi // T
    t = mi % T
    mvalid = mi < G * T
    tok = (b * T + t).to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=mvalid[:, None],
                other=0.0).to(tl.float32)
    qp = tl.load(qpos_ptr + tok, mask=mvalid, other=-1)
    n_keys = _max(qp, 0) + 1
    row = tl.load(rows_ptr + b).to(tl.int64)
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, n_keys)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HD], 0.0, tl.float32)
    kbase = kc_ptr + row * kc_r + kvh * kc_h
    vbase = vc_ptr + row * vc_r + kvh * vc_h
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < hi
        n64 = n.to(tl.int64)
        k = tl.load(kbase + n64[:, None] * kc_p + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
        s = _sum(q[:, None, :] * k[None, :, :], 2) * sm_scale            # [BLOCK_M, BLOCK_N]
        vis = (n[None, :] <= qp[:, None]) & nm[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, _max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that sees no key yet: no NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + _sum(p, 1)
        # Triton folds sum(x[:, :, None] * y[None, :, :], 1) into a tensor-core dot, in TF32 for fp32 operands
        # (its CombineBroadcastMulReducePattern). With 16-bit activations that keeps the probabilities finer than
        # the eager path's own bf16 rounding of them, so that form stays; in fp32 it would be ~1e-3 off (seen on an
        # H200), so fp32 reduces over the last axis, a form the pattern does not match.
        if ACT == 0:
            vt = tl.load(vbase + n64[None, :] * vc_p + d[:, None], mask=nm[None, :], other=0.0).to(tl.float32)
            pv = _sum(p[:, None, :] * vt[None, :, :], 2)                    # [BLOCK_M, HD]
        else:
            v = tl.load(vbase + n64[:, None] * vc_p + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
            pv = _sum(p[:, :, None] * v[None, :, :], 1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS == 1:
        out = _round(tl.div_rn(acc, tl.where(l_i > 0, l_i, 1.0)[:, None]), ACT)
        tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mvalid[:, None])
    else:
        pidx = (((b * HKV + kvh) * SPLITS + sp) * BLOCK_M + mi).to(tl.int64)
        tl.store(acc_ptr + pidx[:, None] * HD + d[None, :], acc)
        tl.store(ml_ptr + pidx * 2, m_i)
        tl.store(ml_ptr + pidx * 2 + 1, l_i)


@triton.jit
def attn_combine_kernel(acc_ptr, ml_ptr, out_ptr, T, s_ot, s_oh,
                        G: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr,
                        SPLITS: tl.constexpr, ACT: tl.constexpr):
    """Program (b, kvh): merges the SPLITS partial softmaxes of `decode_attn_kernel` (rescaled to the largest max)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mi = tl.arange(0, BLOCK_M)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HD)
    pidx = (((b * HKV + kvh) * SPLITS + sp[:, None]) * BLOCK_M + mi[None, :]).to(tl.int64)   # [SPLITS, BLOCK_M]
    m = tl.load(ml_ptr + pidx * 2)
    l_ = tl.load(ml_ptr + pidx * 2 + 1)
    mx = _max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(m - mx[None, :])
    L = _sum(w * l_, 0)
    acc = tl.load(acc_ptr + pidx[:, :, None] * HD + d[None, None, :])
    out = _round(tl.div_rn(_sum(w[:, :, None] * acc, 0), tl.where(L > 0, L, 1.0)[:, None]), ACT)
    g = mi // T
    t = mi % T
    tok = (b * T + t).to(tl.int64)
    head = kvh * G + g
    tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(mi < G * T)[:, None])


# --- (d) SiLU(gate) * up ----------------------------------------------------------------------------------------------
@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, I, s_in, s_out, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """gu [N, 2I] (the concatenated gate/up projection's output) -> out [N, I] = cast(silu(gate)) * up, rounded as the
    eager `F.silu(gate).mul_(up)` rounds (silu computed in fp32 as x / (1 + exp(-x)))."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < I
    g = tl.load(gu_ptr + row * s_in + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_in + I + col, mask=m, other=0.0).to(tl.float32)
    s = _round(tl.div_rn(g, 1.0 + tl.exp(-g)), ACT)
    tl.store(out_ptr + row * s_out + col, _round(s * u, ACT).to(out_ptr.dtype.element_ty), mask=m)


# --- the talker's input: the frame's 16 code embeddings summed + the text track ---------------------------------------
@triton.jit
def frame_embed_kernel(codes_ptr, s_codes, off_ptr, table_ptr, s_tab, trail_ptr, s_tr_r, s_tr_p, tlen_ptr, pad_ptr,
                       step_ptr, rows_ptr, out_ptr, s_out, D, cap,
                       NB: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """out[b] = sum_k table[codes[b, k] + off[k]] (fp32 sum in k order, rounded once: as torch's sum over the 16) +
    (trailing[row, g] if g < trailing_len[row] else tts_pad), g = step[row] - 1 (`ModelRunner._trailing_at`)."""
    b = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < D
    row = tl.load(rows_ptr + b).to(tl.int64)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for k in tl.static_range(NB):
        c = tl.load(codes_ptr + b.to(tl.int64) * s_codes + k) + tl.load(off_ptr + k)
        acc += tl.load(table_ptr + c.to(tl.int64) * s_tab + col, mask=m, other=0.0).to(tl.float32)
    e = _round(acc, ACT)
    gpos = tl.load(step_ptr + row) - 1
    n = tl.load(tlen_ptr + row)
    gi = tl.minimum(gpos, cap - 1)
    gi = tl.where(gi < 0, gi + cap, gi)          # torch's negative index (a free row of a padded batch)
    tv = tl.load(trail_ptr + row * s_tr_r + gi.to(tl.int64) * s_tr_p + col, mask=m, other=0.0).to(tl.float32)
    pv = tl.load(pad_ptr + col, mask=m, other=0.0).to(tl.float32)
    add = tl.where(gpos < n, tv, pv)
    tl.store(out_ptr + b.to(tl.int64) * s_out + col, _round(e + add, ACT).to(out_ptr.dtype.element_ty), mask=m)


# --- (e) the sampler --------------------------------------------------------------------------------------------------
# (the constants of sampling._mix / sampling.uniforms, written out: a jit function reads no module globals)
@_helper
def _mix(x):
    """sampling._mix: splitmix64's finaliser on int64, wrapping, logical shifts emulated with masks."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


@_helper
def _key(x):
    """fp32 -> int64 whose order is the float order (-0.0 made +0.0 first: torch compares them equal)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def sample_kernel(logits_ptr, s_log, V, rows_ptr, step_ptr, frame_off, book,
                  do_sample_ptr, top_k_ptr, top_p_ptr, temp_ptr, seed_ptr, k_cap,
                  seen_ptr, s_seen, penalty_ptr, suppress_ptr, ignore_eos_ptr, eos_id, min_new,
                  ids_ptr, s_ids,
                  emb_ptr, emb_off, s_emb, xn_ptr, s_xn, DE,
                  h_ptr, s_h, hid_ptr, s_hid, DH, c0_ptr, maxnew_ptr, done_ptr, pos_ptr, max_pos,
                  PENALTY: tl.constexpr, BAN: tl.constexpr, SAMPLE: tl.constexpr, TOP_P: tl.constexpr,
                  EMB: tl.constexpr, C0_STATE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_H: tl.constexpr, NW: tl.constexpr, ITERS: tl.constexpr):
    """One batch row per program, the whole vocabulary in registers (V <= BLOCK_V).

    Logits (any float dtype, compared in fp32) -> [PENALTY: HF repetition penalty over seen[row]] -> [BAN: the
    suppressed ids, and EOS while step < min_new or ignore_eos] -> greedy argmax (first maximum), or for rows with
    do_sample (SAMPLE): the k = min(top_k, k_cap) (k_cap where top_k <= 0) best by rank -> / temperature -> [TOP_P:
    drop the low tail whose ascending cumulative probability <= 1 - top_p, the most likely kept] -> the Gumbel-max
    draw argmax(val (float64) - log(-log(u))) with u = sampling.uniforms(seed, step[row] + frame_off, book, id).

    No sort: the k-th largest logit is found by an NW-way search over the int keys of the floats (ITERS passes of NW
    counts each; NW = 2 is a bisection, 33 passes);
    ids equal to it are kept lowest id first until k are kept (torch.topk keeps an unspecified subset of equal
    values). The top-p cut is a second bisection over the kept values' keys for the largest value whose cumulative
    mass from below is <= 1 - top_p; equal values are kept or dropped together (torch's unstable sort may split
    them), and the mass is a tree sum in fp32 (torch: a cumsum in ascending order).

    Epilogues: ids[b * s_ids] = id; EMB: xn[b] = emb[emb_off + id] (the next predictor input); C0_STATE: the talker's
    `_after_c0` and pos update (seen[row, id] = True, step += 1, c0 = id, hidden[row] = h[b], done[b] =
    id == eos or step >= max_new[row], pos[row] = min(pos + 1, max_pos))."""
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    o = tl.arange(0, BLOCK_V)
    vm = o < V
    x = tl.load(logits_ptr + b.to(tl.int64) * s_log + o, mask=vm, other=float("-inf")).to(tl.float32)
    st = tl.load(step_ptr + row)
    if PENALTY:
        seen = tl.load(seen_ptr + row * s_seen + o, mask=vm, other=0)
        pen = tl.load(penalty_ptr + b)
        x = tl.where(seen != 0, tl.where(x < 0, x * pen, tl.div_rn(x, pen)), x)
    if BAN:
        sup = tl.load(suppress_ptr + o, mask=vm, other=0)
        blk = (st < min_new) | (tl.load(ignore_eos_ptr + b) != 0)
        x = tl.where((sup != 0) | ((o == eos_id) & blk), float("-inf"), x)
    x = tl.where(vm, x, float("-inf"))
    choice = _argmax(x, BLOCK_V)
    if SAMPLE:
        if tl.load(do_sample_ptr + b) != 0:
            temp = tl.load(temp_ptr + b)
            kk = tl.load(top_k_ptr + b)
            kk = tl.where(kk > 0, tl.minimum(kk, k_cap), k_cap)
            jw = tl.arange(0, NW).to(tl.int64)
            key = _key(x)
            lo = _min(tl.where(vm, key, 2147483647), 0)
            hi = _max(tl.where(vm, key, -2147483648), 0)
            for _ in range(ITERS):   # the largest t with count(key >= t) >= k (the k-th largest key), NW-way
                step = (hi - lo + NW) // NW
                t = lo + jw * step
                cnt = _sum(((key[None, :] >= t[:, None]) & vm[None, :]).to(tl.int32), 1)
                jb = _max(tl.where((cnt >= kk) & (t <= hi), jw, 0), 0)
                lo = lo + jb * step
                hi = tl.minimum(hi, lo + step - 1)
            gt = (key > lo) & vm
            eq = (key == lo) & vm
            need = kk - _sum(gt.to(tl.int32), 0)
            keep = gt | (eq & (_cumsum(eq.to(tl.int32), 0) <= need))
            vals = tl.where(keep, tl.div_rn(x, temp), float("-inf"))
            if TOP_P:
                tp = tl.load(top_p_ptr + b)
                if tp < 1.0:
                    mx = _max(vals, 0)
                    e = tl.where(keep, tl.exp(vals - mx), 0.0)
                    prob = tl.div_rn(e, _sum(e, 0))
                    thr = 1.0 - tp
                    vkey = _key(vals)
                    lo2 = _min(tl.where(keep, vkey, 2147483647), 0) - 1
                    hi2 = _max(tl.where(keep, vkey, -2147483648), 0)
                    for _ in range(ITERS):   # the largest t with mass(vals <= t) <= 1 - top_p, NW-way
                        step2 = (hi2 - lo2 + NW) // NW
                        t2 = lo2 + jw * step2
                        mass = _sum(tl.where(keep[None, :] & (vkey[None, :] <= t2[:, None]), prob[None, :], 0.0), 1)
                        jb2 = _max(tl.where((mass <= thr) & (t2 <= hi2), jw, 0), 0)
                        lo2 = lo2 + jb2 * step2
                        hi2 = tl.minimum(hi2, lo2 + step2 - 1)
                    top = _argmax(vals, BLOCK_V)
                    keep = keep & ((vkey > lo2) | (o == top))
            hk = _mix(tl.load(seed_ptr + b) * -7046029254386353131 + (st + frame_off) * 1000003 + book)
            hx = _mix(hk + o.to(tl.int64) * -7046029254386353131)
            u = (((hx >> 11) & 9007199254740991).to(tl.float64) + 0.5) / 9007199254740992.0
            score = tl.where(keep, vals.to(tl.float64) - tl.log(-tl.log(u)), float("-inf"))
            choice = _argmax(score, BLOCK_V)
    tl.store(ids_ptr + b.to(tl.int64) * s_ids, choice.to(tl.int64))
    if EMB:
        eo = tl.arange(0, BLOCK_E)
        em = eo < DE
        erow = (emb_off + choice).to(tl.int64)
        tl.store(xn_ptr + b.to(tl.int64) * s_xn + eo, tl.load(emb_ptr + erow * s_emb + eo, mask=em), mask=em)
    if C0_STATE:
        tl.store(seen_ptr + row * s_seen + choice, tl.full([], 1, tl.int1))
        st1 = st + 1
        tl.store(step_ptr + row, st1)
        tl.store(c0_ptr + row, choice.to(tl.int64))
        ho = tl.arange(0, BLOCK_H)
        hm = ho < DH
        tl.store(hid_ptr + row * s_hid + ho, tl.load(h_ptr + b.to(tl.int64) * s_h + ho, mask=hm), mask=hm)
        tl.store(done_ptr + b, (choice == eos_id) | (st1 >= tl.load(maxnew_ptr + row)))
        tl.store(pos_ptr + row, tl.minimum(tl.load(pos_ptr + row) + 1, max_pos))


# --- (f) small-M matrix-vector products with their neighbours fused in ----------------------------------------------
@triton.jit
def norm_gemv_kernel(x_ptr, res_ptr, lnw_ptr, w_ptr, out_ptr, res_out_ptr, hn_ptr,
                     M, N, K, sx, sr, sro, shn, so, eps,
                     qw_ptr, kw_ptr, inv_freq_ptr, pos_ptr, rows_ptr, kc_ptr, vc_ptr, T,
                     kc_r, kc_h, kc_p, vc_r, vc_h, vc_p,
                     NORM: tl.constexpr, WRITE_H: tl.constexpr, EPI: tl.constexpr, H: tl.constexpr,
                     HKV: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """y = a @ W^T for the M <= BLOCK_M rows of a (a decode step's few tokens), W [*, K] row-major, with

    prologue NORM: 0: a = x; 1: a = RMSNorm(x) (weight lnw, variance in fp32, rounded as `add_rmsnorm_kernel`);
      2: s = round(res + x), a = RMSNorm(s), and program 0 writes s to res_out (the residual stream). WRITE_H:
      program 0 also writes a to hn (the stack's normed output, e.g. the talker's hidden state). Every program
      computes the row's variance itself (a first pass over x: the rows are few and short next to W);
    epilogue EPI: 0 (plain): out[m, n] = round(y[m, n]), N columns, BLOCK_N per program;
      1 (SiLU * up): W is the concatenated [gate; up] (2N rows): out[m, n] = round(cast(silu(gate)) * up), as
      `silu_mul_kernel` (each program takes the gate rows n and the up rows N + n together);
      2 (q/k RMSNorm + RoPE + KV write): W is the concatenated q/k/v projection, one head per program (BLOCK_N =
      head_dim / 2, the two halves of the head as two accumulators, so rotate-half pairs element j with j of the
      other half); query heads (h < H) go normed and rotated to out [M, H, HD], key heads to the key cache, value
      heads (rounded, as the projection's output) to the value cache, at (rows[m // T], head, pos[m]), as
      `qk_rope_write_kernel`; qw/kw are the per-head norm weights.

    The products accumulate in fp32 elementwise over the K tiles ([BLOCK_M, BLOCK_N, BLOCK_K] partial sums) and are
    summed once at the end; every value is rounded to the activation dtype where the eager ops round it."""
    pid = tl.program_id(0)
    mi = tl.arange(0, BLOCK_M)
    mm = mi < M
    m64 = mi.to(tl.int64)
    kb = tl.arange(0, BLOCK_K)
    nb = tl.arange(0, BLOCK_N)
    if EPI == 2:
        n_a = pid * (2 * BLOCK_N) + nb        # the head's first half
        n_b = n_a + BLOCK_N                   # its second half
    else:
        n_a = pid * BLOCK_N + nb
        n_b = n_a + N                         # (EPI 1: the up rows)
    if EPI == 2:
        nm = n_a >= 0
    else:
        nm = n_a < N
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM != 0:
        ss = tl.full([BLOCK_M], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + kb
            msk = mm[:, None] & (kk < K)[None, :]
            xv = tl.load(x_ptr + m64[:, None] * sx + kk[None, :], mask=msk, other=0.0).to(tl.float32)
            if NORM == 2:
                xv = _round(xv + tl.load(res_ptr + m64[:, None] * sr + kk[None, :], mask=msk, other=0.0)
                            .to(tl.float32), ACT)
            ss += _sum(xv * xv, 1)
        rstd = tl.rsqrt(tl.div_rn(ss, K.to(tl.float32)) + eps)
    first = (tl.full([BLOCK_M, BLOCK_K], 0, tl.int32) + pid) == 0     # program 0 writes the prologue's rows
    acc_a = tl.full([BLOCK_M, BLOCK_N, BLOCK_K], 0.0, tl.float32)
    if EPI != 0:
        acc_b = tl.full([BLOCK_M, BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + kb
        km = kk < K
        msk = mm[:, None] & km[None, :]
        xv = tl.load(x_ptr + m64[:, None] * sx + kk[None, :], mask=msk, other=0.0).to(tl.float32)
        if NORM != 0:
            if NORM == 2:
                xv = _round(xv + tl.load(res_ptr + m64[:, None] * sr + kk[None, :], mask=msk, other=0.0)
                            .to(tl.float32), ACT)
                tl.store(res_out_ptr + m64[:, None] * sro + kk[None, :], xv.to(res_out_ptr.dtype.element_ty),
                         mask=msk & first)
            lw = tl.load(lnw_ptr + kk, mask=km, other=0.0).to(tl.float32)
            xv = _round(lw[None, :] * _round(xv * rstd[:, None], ACT), ACT)
            if WRITE_H:
                tl.store(hn_ptr + m64[:, None] * shn + kk[None, :], xv.to(hn_ptr.dtype.element_ty),
                         mask=msk & first)
        wm = nm[:, None] & km[None, :]
        wa = tl.load(w_ptr + n_a.to(tl.int64)[:, None] * K + kk[None, :], mask=wm, other=0.0).to(tl.float32)
        acc_a += xv[:, None, :] * wa[None, :, :]
        if EPI != 0:
            wb = tl.load(w_ptr + n_b.to(tl.int64)[:, None] * K + kk[None, :], mask=wm, other=0.0).to(tl.float32)
            acc_b += xv[:, None, :] * wb[None, :, :]
    ya = _round(_sum(acc_a, 2), ACT)                          # [BLOCK_M, BLOCK_N]: the projection's output
    if EPI == 0:
        tl.store(out_ptr + m64[:, None] * so + n_a[None, :], ya.to(out_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])
    elif EPI == 1:
        yb = _round(_sum(acc_b, 2), ACT)
        s = _round(tl.div_rn(ya, 1.0 + tl.exp(-ya)), ACT)
        tl.store(out_ptr + m64[:, None] * so + n_a[None, :], _round(s * yb, ACT).to(out_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])
    else:
        HD: tl.constexpr = 2 * BLOCK_N
        yb = _round(_sum(acc_b, 2), ACT)
        head = tl.full([BLOCK_M, BLOCK_N], 0, tl.int32) + pid
        isq = head < H
        isk = (head >= H) & (head < H + HKV)
        isv = head >= H + HKV
        r = tl.rsqrt(tl.div_rn(_sum(ya * ya, 1) + _sum(yb * yb, 1), HD * 1.0) + eps)[:, None]
        wa_n = tl.where(isq, tl.load(qw_ptr + nb).to(tl.float32)[None, :], tl.load(kw_ptr + nb).to(tl.float32)[None, :])
        wb_n = tl.where(isq, tl.load(qw_ptr + BLOCK_N + nb).to(tl.float32)[None, :],
                        tl.load(kw_ptr + BLOCK_N + nb).to(tl.float32)[None, :])
        za = _round(wa_n * _round(ya * r, ACT), ACT)
        zb = _round(wb_n * _round(yb * r, ACT), ACT)
        p = tl.load(pos_ptr + mi, mask=mm, other=0)
        ang = p.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + nb)[None, :]
        c, sn = tl.cos(ang), tl.sin(ang)
        oa = _round(za * c + (-zb) * sn, ACT)
        ob = _round(zb * c + za * sn, ACT)
        qo = out_ptr + m64[:, None] * so + pid * HD + nb[None, :]
        tl.store(qo, oa.to(out_ptr.dtype.element_ty), mask=mm[:, None] & isq)
        tl.store(qo + BLOCK_N, ob.to(out_ptr.dtype.element_ty), mask=mm[:, None] & isq)
        row = tl.load(rows_ptr + mi // T, mask=mm, other=0).to(tl.int64)
        p64 = p.to(tl.int64)
        kh = (pid - H).to(tl.int64)
        ko = kc_ptr + (row * kc_r + kh * kc_h + p64 * kc_p)[:, None] + nb[None, :]
        tl.store(ko, oa.to(kc_ptr.dtype.element_ty), mask=mm[:, None] & isk)
        tl.store(ko + BLOCK_N, ob.to(kc_ptr.dtype.element_ty), mask=mm[:, None] & isk)
        vh = (pid - H - HKV).to(tl.int64)
        vo = vc_ptr + (row * vc_r + vh * vc_h + p64 * vc_p)[:, None] + nb[None, :]
        tl.store(vo, ya.to(vc_ptr.dtype.element_ty), mask=mm[:, None] & isv)
        tl.store(vo + BLOCK_N, yb.to(vc_ptr.dtype.element_ty), mask=mm[:, None] & isv)
