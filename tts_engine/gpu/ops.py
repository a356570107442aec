"""One dispatcher per fused kernel: the Triton kernel (`kernels.py`) on CUDA tensors, else the eager PyTorch
reference, which is built from the functions the eager engine itself runs (`model/layers.py`,
`model/sampling.py`, `ModelRunner`'s own formulas), so that it stays the exact path the parity tests use.

`impl` on every op: None (automatic), "triton" (the kernel; raises where it cannot run) or "eager" (the
reference). Automatic picks the kernel for CUDA tensors, and for CPU tensors only inside `force_interpreter()` when
the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 when `kernels` was imported): the way tests run
every kernel on a machine without a GPU.

Shapes: B batch rows, T new positions, H query heads, Hkv key/value heads, hd head_dim, D width, V vocabulary.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from tts_engine.model.layers import apply_rope, rms_norm, rope_cos_sin, signed_sin
from tts_engine.model.sampling import choose_residual

try:
    from tts_engine.gpu import kernels as K
    IMPORT_ERROR = None
except Exception as e:   # no triton (or a broken one): every op runs its reference
    K = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}".splitlines()[0][:200]

_forced = False


def available() -> bool:
    """The Triton kernels can be launched here (triton imported)."""
    return K is not None


def interpreted() -> bool:
    """The kernels were built for Triton's interpreter (they run on CPU tensors, slowly)."""
    return K is not None and K.INTERPRET


def use_interpreter() -> bool:
    """Make this process's kernels Triton-interpreted ones (TRITON_INTERPRET=1, then `kernels` re-imported) where they
    are not: for tools that run the fused frame on a CPU (bench census, `check --interpret`, attach(force=True)).
    Process-wide: Triton reads the variable when kernels are decorated and again while the interpreter runs. -> True
    when the kernels are interpreted now."""
    if K is None:
        return False
    if not K.INTERPRET:
        import importlib
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        importlib.reload(K)
    return K.INTERPRET


@contextlib.contextmanager
def force_interpreter(on: bool = True):
    """Inside: automatic dispatch runs the Triton kernels on CPU tensors too (needs `interpreted()`)."""
    global _forced
    if on and not interpreted():
        raise RuntimeError("the Triton kernels were not built for the interpreter: set TRITON_INTERPRET=1 before "
                           "tts_engine.gpu.kernels is imported")
    old, _forced = _forced, on
    try:
        yield
    finally:
        _forced = old


def use_triton(t: torch.Tensor, impl: str | None = None) -> bool:
    if impl == "eager":
        return False
    if impl not in (None, "triton"):
        raise ValueError(f"impl must be None, 'triton' or 'eager', not {impl!r}")
    if K is None:
        if impl == "triton":
            raise RuntimeError(f"triton is not importable here ({IMPORT_ERROR})")
        return False
    if t.is_cuda or LaunchCount.record is not None:
        return True
    if impl == "triton":
        if not K.INTERPRET:
            raise RuntimeError("a Triton kernel on CPU tensors needs the interpreter (TRITON_INTERPRET=1)")
        return True
    return _forced and K.INTERPRET


class LaunchCount:
    """Whether a Triton launch is under way (`active`), and `record`: a list while `recording()` is on (launches are
    recorded, not run). The launches themselves are counted per kernel in `kernels.LAUNCHES`."""
    active = False
    record: list | None = None


def _no_dispatch_modes():
    """Inside an interpreted launch, PyTorch dispatch modes (an aten-op counter such as bench/census.py's) do not see
    the interpreter's own tensor copies: they are no GPU work."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
        return _disable_current_modes()
    except Exception:   # (a private helper of PyTorch's; without it the copies are counted)
        return contextlib.nullcontext()


class _Launcher:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            # no FMA contraction: a*b + c rounds a*b first, as PyTorch's separate ops do (fp32 parity with eager)
            kwargs.setdefault("enable_fp_fusion", False)
            if LaunchCount.record is not None:
                LaunchCount.record.append((self.kernel, grid, args, kwargs))
                return None
            K.LAUNCHES[self.kernel.__name__] += 1
            LaunchCount.active = True
            try:
                with _no_dispatch_modes() if K.INTERPRET else contextlib.nullcontext():
                    return self.kernel[grid](*args, **kwargs)
            finally:
                LaunchCount.active = False
        return run


@contextlib.contextmanager
def recording():
    """Inside: every op takes its Triton path on any tensors and records its launches (kernel, grid, args, kwargs)
    instead of running them (outputs are left uninitialised) -> the list. For compiling the kernels ahead of time
    without a GPU (`aot`)."""
    if K is None:
        raise RuntimeError(f"triton is not importable here ({IMPORT_ERROR})")
    old, LaunchCount.record = LaunchCount.record, []
    try:
        yield LaunchCount.record
    finally:
        LaunchCount.record = old


def _launch(kernel) -> _Launcher:
    return _Launcher(kernel)


def _act(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return 0
    if dtype == torch.bfloat16:
        return 1
    if dtype == torch.float16:
        return 2
    raise TypeError(f"unsupported activation dtype {dtype}")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as [N, D] with unit stride along D and one row stride (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _vec(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


# --- (a) residual add + RMSNorm ---------------------------------------------------------------------------------------
def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (s, rms_norm(s)) with s = residual + x (s = x without a residual): a decoder layer's `x + sublayer(...)`
    followed by the next RMSNorm, in one kernel."""
    if not use_triton(x, impl):
        s = x if residual is None else residual + x
        return s, rms_norm(s, weight, eps)
    shape, D = x.shape, x.shape[-1]
    x2 = _rows2d(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _rows2d(residual)
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2 = res_out = x2
    BLOCK = _pow2(D)
    _launch(K.add_rmsnorm_kernel)[(x2.shape[0],)](
        x2, r2, weight, out, res_out, D, float(eps), x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
        HAS_RES=residual is not None, ACT=_act(x.dtype), BLOCK=BLOCK, num_warps=4 if BLOCK <= 1024 else 8)
    s = x if residual is None else res_out.view(shape)
    return s, out.view(shape)


# --- (b) q/k RMSNorm + RoPE + KV-cache write --------------------------------------------------------------------------
_inv_freq: dict = {}


def inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """The fp32 inverse frequencies exactly as `layers.rope_cos_sin` computes them."""
    key = (head_dim, float(theta), torch.device(device))
    got = _inv_freq.get(key)
    if got is None:
        got = _inv_freq[key] = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
                                                .float() / head_dim))
    return got


def qk_norm_rope_write(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float, pos: torch.Tensor,
                       rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                       theta: float, impl: str | None = None) -> torch.Tensor:
    """qkv [B, T, (H + 2 Hkv) * hd] (q, k, v heads in that order), per-head RMSNorm weights q_w, k_w [hd], positions
    pos [B, T] (int64), cache rows [B] (int64), one layer's caches [R, Hkv, L, hd] -> q [B, T, H, hd] normed and
    rotated; the normed, rotated keys and the values are written to the caches at (rows[b], :, pos[b, t])."""
    B, T = qkv.shape[0], qkv.shape[1]
    hd = q_w.shape[0]
    H, Hkv = n_heads, n_kv
    if not use_triton(qkv, impl):
        qkv4 = qkv.view(B, T, H + 2 * Hkv, hd)
        q = rms_norm(qkv4[:, :, :H], q_w, eps).transpose(1, 2)              # [B, H, T, hd]
        k = rms_norm(qkv4[:, :, H:H + Hkv], k_w, eps).transpose(1, 2)
        cos, sin = rope_cos_sin(pos, hd, theta, qkv.dtype)
        sin = signed_sin(sin)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        r_idx = rows[:, None].expand(B, T)
        k_cache[r_idx, :, pos] = k.transpose(1, 2)
        v_cache[r_idx, :, pos] = qkv4[:, :, H + Hkv:]
        return q.transpose(1, 2)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and hd & (hd - 1) == 0
    qkv2 = _rows2d(qkv)
    q = torch.empty(B * T, H, hd, dtype=qkv.dtype, device=qkv.device)
    _launch(K.qk_rope_write_kernel)[(B * T,)](
        qkv2, q_w, k_w, inv_freq(hd, theta, qkv.device), _vec(pos.reshape(-1)), _vec(rows), q, k_cache, v_cache,
        T, qkv2.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(eps),
        H=H, HKV=Hkv, HD=hd, NHP=_pow2(H + Hkv), ACT=_act(qkv.dtype), num_warps=4)
    return q.view(B, T, H, hd)


# --- (c) decode attention ---------------------------------------------------------------------------------------------
def attention_splits(B: int, n_kv: int, read_len: int) -> int:
    """Key ranges per (row, key head) for `decode_attention` (a power of 2): enough programs to fill a GPU (~256)
    while each range keeps >= 128 keys."""
    want = max(1, math.ceil(256 / max(1, B * n_kv)))
    cap = max(1, read_len // 128)
    return min(_pow2(min(want, cap)) if min(want, cap) > 1 else 1, 32)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     qpos: torch.Tensor, read_len: int, impl: str | None = None, splits: int | None = None
                     ) -> torch.Tensor:
    """q [B, T, H, hd], one layer's caches [R, Hkv, L, hd], cache rows [B], query positions qpos [B, T] -> softmax(q
    k^T / sqrt(hd)) v [B, T, H * hd], query (b, t) attending to keys 0..qpos[b, t] of its row (causal; GQA: query
    head h reads key head h // (H / Hkv)). read_len (a host int >= max(qpos) + 1) bounds the keys the reference
    reads and sizes the kernel's key splits; the kernel itself reads each row's own length."""
    B, T, H, hd = q.shape
    Hkv = k_cache.shape[1]
    if not use_triton(q, impl):
        keys, vals = k_cache[rows, :, :read_len], v_cache[rows, :, :read_len]      # [B, Hkv, S, hd]
        mask = (torch.arange(read_len, device=q.device)[None, None, :] <= qpos[:, :, None])[:, None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask, enable_gqa=H != Hkv)
        return out.transpose(1, 2).reshape(B, T, H * hd)
    G = H // Hkv
    BLOCK_M = _pow2(G * T)
    BLOCK_N = max(1, min(64, 8192 // (BLOCK_M * hd)))   # the [BLOCK_M, BLOCK_N, hd] products stay in registers
    BLOCK_N = 1 << (BLOCK_N.bit_length() - 1)
    S = attention_splits(B, Hkv, read_len) if splits is None else splits
    assert S & (S - 1) == 0
    split_len = math.ceil(math.ceil(read_len / S) / BLOCK_N) * BLOCK_N
    qc = q if q.stride(3) == 1 and q.stride(0) == T * q.stride(1) else q.contiguous()   # token = b*T + t
    out = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    if S > 1:
        acc = torch.empty(B * Hkv * S * BLOCK_M, hd, dtype=torch.float32, device=q.device)
        ml = torch.empty(B * Hkv * S * BLOCK_M, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out
    _launch(K.decode_attn_kernel)[(B, Hkv, S)](
        qc, k_cache, v_cache, _vec(rows), _vec(qpos.reshape(-1)), out, acc, ml, T, split_len, hd ** -0.5,
        qc.stride(1), qc.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(1), out.stride(2),
        G=G, HKV=Hkv, HD=hd, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLITS=S, ACT=_act(q.dtype), num_warps=4)
    if S > 1:
        _launch(K.attn_combine_kernel)[(B, Hkv)](acc, ml, out, T, out.stride(1), out.stride(2), G=G, HKV=Hkv,
                                                 HD=hd, BLOCK_M=BLOCK_M, SPLITS=S, ACT=_act(q.dtype), num_warps=4)
    return out.view(B, T, H * hd)


# --- (d) SiLU(gate) * up ----------------------------------------------------------------------------------------------
def silu_mul(gu: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """gu [..., 2I] (gate then up, the concatenated projection's output) -> silu(gate) * up [..., I]."""
    if not use_triton(gu, impl):
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    I = gu.shape[-1] // 2
    g2 = _rows2d(gu)
    out = torch.empty(g2.shape[0], I, dtype=gu.dtype, device=gu.device)
    BLOCK = min(1024, _pow2(I))
    _launch(K.silu_mul_kernel)[(g2.shape[0], triton_cdiv(I, BLOCK))](
        g2, out, I, g2.stride(0), out.stride(0), ACT=_act(gu.dtype), BLOCK=BLOCK, num_warps=4)
    return out.view(*gu.shape[:-1], I)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- the talker's input embedding -------------------------------------------------------------------------------------
def frame_embed(codes: torch.Tensor, table: torch.Tensor, offsets: torch.Tensor, trailing: torch.Tensor,
                trailing_len: torch.Tensor, tts_pad: torch.Tensor, step: torch.Tensor, rows: torch.Tensor,
                impl: str | None = None) -> torch.Tensor:
    """codes [B, 16] -> the talker's next input [B, D]: the 16 code embeddings summed (`Talker.frame_embed`) + the
    text track at the frame's index g = step[row] - 1 (`ModelRunner._trailing_at`)."""
    if not use_triton(table, impl):
        x = table[codes + offsets].sum(-2)
        g = step[rows] - 1
        vec = trailing[rows, g.clamp(max=trailing.shape[1] - 1)]
        return x + torch.where((g < trailing_len[rows])[:, None], vec, tts_pad[None])
    B, NB = codes.shape
    D = table.shape[1]
    codes = _vec(codes)
    out = torch.empty(B, D, dtype=table.dtype, device=table.device)
    BLOCK = min(1024, _pow2(D))
    assert trailing.stride(-1) == 1 and table.stride(-1) == 1
    _launch(K.frame_embed_kernel)[(B, triton_cdiv(D, BLOCK))](
        codes, codes.stride(0), _vec(offsets), table, table.stride(0), trailing, trailing.stride(0),
        trailing.stride(1), _vec(trailing_len), _vec(tts_pad), step, _vec(rows), out, out.stride(0), D,
        trailing.shape[1], NB=NB, ACT=_act(table.dtype), BLOCK=BLOCK, num_warps=4)
    return out


# --- (e) the sampler --------------------------------------------------------------------------------------------------
# thresholds tried per pass of the sampler's k-th value / top-p searches (a power of 2): on a GPU 4 (17 passes of a
# [4, V] compare-and-count, in registers); under the interpreter 16 (9 passes: its cost is per operation, not per
# element)
SEARCH_WAYS, SEARCH_WAYS_INTERPRETED = 4, 16

def _launch_sample(logits, rows, step, frame_off: int, book: int, do_sample, top_k, top_p, temperature, seed,
                   facts: dict, ids, penalty=None, seen=None, suppress=None, ignore_eos=None, eos_id: int = -1,
                   min_new: int = 0, emb=None, state=None):
    B, V = logits.shape
    assert logits.stride(-1) == 1
    dummy_f, dummy_i = logits, rows
    k_cap = min(facts["k_max"] or V, V)
    nw = SEARCH_WAYS_INTERPRETED if K.INTERPRET else SEARCH_WAYS
    if emb is not None:
        table, offset, x_next = emb
        assert table.stride(-1) == 1 and x_next.stride(-1) == 1
        DE = table.shape[1]
    else:
        table, offset, x_next, DE = dummy_f, 0, dummy_f, 1
    if state is not None:
        h, hidden, c0, max_new, pos, max_pos, done = (state[k] for k in ("h", "hidden", "c0", "max_new", "pos",
                                                                          "max_pos", "done"))
        DH = h.shape[1]
        assert h.stride(-1) == 1 and hidden.stride(-1) == 1
    else:
        h = hidden = dummy_f
        c0 = max_new = pos = dummy_i
        done, max_pos, DH = dummy_i, 0, 1
    s_seen = seen.stride(0) if seen is not None else 0
    _launch(K.sample_kernel)[(B,)](
        logits, logits.stride(0), V, _vec(rows), step, int(frame_off), int(book),
        _vec(do_sample), _vec(top_k), _vec(top_p), _vec(temperature), _vec(seed), int(k_cap),
        seen if seen is not None else dummy_i, s_seen, _vec(penalty) if penalty is not None else dummy_f,
        suppress if suppress is not None else dummy_i, _vec(ignore_eos) if ignore_eos is not None else dummy_i,
        int(eos_id), int(min_new), ids, ids.stride(0),
        table, int(offset), table.stride(0), x_next, x_next.stride(0), DE,
        h, h.stride(0), hidden, hidden.stride(0), DH, c0, max_new, done, pos, int(max_pos),
        PENALTY=penalty is not None, BAN=suppress is not None, SAMPLE=bool(facts["any_sample"]),
        TOP_P=bool(facts["any_top_p"]), EMB=emb is not None, C0_STATE=state is not None,
        BLOCK_V=_pow2(V), BLOCK_E=_pow2(DE), BLOCK_H=_pow2(DH), NW=nw, ITERS=math.ceil(34 / (nw.bit_length() - 1)),
        num_warps=8 if V >= 2048 else 4)


def sample_residual(logits: torch.Tensor, rows: torch.Tensor, step: torch.Tensor, rp, book: int,
                    impl: str | None = None, ids: torch.Tensor | None = None, emb=None,
                    frame_off: int = -1) -> torch.Tensor:
    """The code predictor's codebook `book` (1..15) from logits [B, 2048] -> ids [B] (`sampling.choose_residual`
    with frame = step[rows] + frame_off: the runner's step - 1 is the frame being completed; a tensor of frame
    indices with rows 0..B-1 and frame_off 0 does too). ids: where to write them (e.g. a column of the frame's
    codes); emb = (table, offset, x_next [B, De]): also x_next[b] = table[offset + id] (the next step's input)."""
    if ids is None:
        ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    if not use_triton(logits, impl):
        c = choose_residual(logits.float(), step[rows] + frame_off, book, rp)
        ids.copy_(c)
        if emb is not None:
            table, offset, x_next = emb
            x_next.copy_(table[offset + c])
        return ids
    _launch_sample(logits, rows, step, frame_off, book, rp.sub_do_sample, rp.sub_top_k, rp.sub_top_p,
                   rp.sub_temperature, rp.seed, rp.host["sub"], ids, emb=emb)
    return ids


def sample_c0(logits: torch.Tensor, rows: torch.Tensor, rp, c0_proc, seen: torch.Tensor, step: torch.Tensor,
              impl: str | None = None, state: dict | None = None):
    """Codebook 0 from the talker's logits [B, V] -> ids [B] (`C0Processor`: repetition penalty over seen[rows],
    EOS blocked for the first min_new_tokens steps or with ignore_eos, suppressed ids, then `choose` with frame =
    step[rows]). With `state` (h [B, D], and the runner's hidden, c0, max_new, pos, max_pos, done [B] to fill) also
    the runner's `_after_c0` and position update -> (ids, done)."""
    if not use_triton(logits, impl):
        ids = c0_proc(logits.float(), seen[rows], step[rows], rp)
        if state is None:
            return ids
        seen.index_put_((rows, ids), torch.ones((), dtype=torch.bool, device=seen.device))
        step[rows] += 1
        state["hidden"][rows] = state["h"]
        state["c0"][rows] = ids
        state["done"].copy_((ids == c0_proc.eos_id) | (step[rows] >= state["max_new"][rows]))
        pos = state["pos"]
        pos[rows] = (pos[rows] + 1).clamp(max=state["max_pos"])
        return ids, state["done"]
    ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    _launch_sample(logits, rows, step, 0, 0, rp.do_sample, rp.top_k, rp.top_p, rp.temperature, rp.seed,
                   rp.host["c0"], ids, penalty=rp.penalty, seen=seen, suppress=c0_proc.suppress,
                   ignore_eos=rp.ignore_eos, eos_id=c0_proc.eos_id, min_new=c0_proc.min_new_tokens, state=state)
    return ids if state is None else (ids, state["done"])


# --- (f) small-M projections with their neighbours fused in (`kernels.norm_gemv_kernel`) ---------------------------
# At a decode step's few rows a projection is a matrix-vector product: one launch of our own kernel can then also do
# the residual add + RMSNorm before it and the SiLU*up or the q/k norm + RoPE + KV write after it (the fused frame's
# "gemv" variant, `frame.py`). Up to GEMV_MAX_ROWS rows (B * T); more rows go to cuBLAS and the separate kernels.
GEMV_MAX_ROWS = 8
_GEMV_REGS = 8192            # fp32 partial sums per program on a GPU ([BLOCK_M, BLOCK_N, BLOCK_K], both accumulators)
_GEMV_REGS_INTERPRETED = 1 << 16   # (the interpreter's cost is per operation: larger tiles, fewer of them)


def _floor2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _gemv_blocks(M: int, N: int, Kd: int, two: bool, block_n: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): every row in one tile; BLOCK_N small enough that a GPU gets ~128
    programs where N allows (a matrix-vector product is bound by reading W: it needs many SMs reading); BLOCK_K the
    rest of the register budget."""
    BM = _pow2(M)
    BN = block_n or max(2, min(64, _floor2(N // 128)))
    # one program per head (block_n given): few programs, so each takes twice the tile (8 warps) to keep more of W
    # in flight
    budget = _GEMV_REGS_INTERPRETED if K_INTERPRET() else _GEMV_REGS * (2 if block_n else 1)
    BK = max(16, min(1024, _pow2(Kd), _floor2(budget // (BM * BN * (2 if two else 1)))))
    regs = BM * BN * BK * (2 if two else 1)
    return BM, BN, BK, 8 if regs > _GEMV_REGS else 4


def K_INTERPRET() -> bool:
    return K is not None and K.INTERPRET


def gemv_fits(rows: int) -> bool:
    """A projection of `rows` rows (B * T) is served by `norm_linear` & co. in the gemv variant."""
    return 1 <= rows <= GEMV_MAX_ROWS


def _launch_gemv(x2, w, out, N, Kd, *, ln=None, r2=None, res_out=None, hn=None, eps=0.0, epi=0, rope=None,
                 block_n=None):
    M = x2.shape[0]
    assert x2.stride(-1) == 1 and w.stride(-1) == 1 and w.stride(0) == Kd and out.stride(-1) == 1
    BM, BN, BK, nw = _gemv_blocks(M, N, Kd, epi != 0, block_n)
    d = x2
    norm = 0 if ln is None else 1 if r2 is None else 2
    if rope is None:
        qw = kw = invf = d
        pos = rows = d
        kc = vc = d
        T = 1
        kst = vst = (0, 0, 0)
        H = Hkv = 0
        grid = (triton_cdiv(N, BN),)
    else:
        qw, kw, invf, pos, rows, kc, vc, T, H, Hkv = rope
        kst, vst = (kc.stride(0), kc.stride(1), kc.stride(2)), (vc.stride(0), vc.stride(1), vc.stride(2))
        grid = (H + 2 * Hkv,)
    _launch(K.norm_gemv_kernel)[grid](
        x2, r2 if r2 is not None else d, ln if ln is not None else d, w, out,
        res_out if res_out is not None else d, hn if hn is not None else d,
        M, N, Kd, x2.stride(0), r2.stride(0) if r2 is not None else 0,
        res_out.stride(0) if res_out is not None else 0, hn.stride(0) if hn is not None else 0, out.stride(0),
        float(eps), qw, kw, invf, pos, rows, kc, vc, T, *kst, *vst,
        NORM=norm, WRITE_H=hn is not None, EPI=epi, H=H, HKV=Hkv, ACT=_act(x2.dtype), BLOCK_M=BM, BLOCK_N=BN,
        BLOCK_K=BK, num_warps=nw)


def _norm_prologue_buffers(x: torch.Tensor, residual: torch.Tensor | None, ln, want_normed: bool):
    x2 = _rows2d(x)
    r2 = _rows2d(residual) if residual is not None else None
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if r2 is not None else None
    hn = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if want_normed and ln is not None else None
    return x2, r2, res_out, hn


def norm_linear(x: torch.Tensor, w: torch.Tensor, ln: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, eps: float = 1e-6, want_normed: bool = False,
                impl: str | None = None):
    """x [..., K] (rows of any stride), W [N, K] -> (y [..., N], s, hn): y = F.linear(a, W) where a = x (ln None),
    rms_norm(x, ln) (no residual) or rms_norm(s, ln) with s = residual + x (`add_rmsnorm`). s: the residual stream
    after the add (x without a residual, None without ln); hn: a when want_normed (a stack's normed output), else
    None. One launch."""
    if not use_triton(x, impl):
        s, a = (None, x) if ln is None else add_rmsnorm(x, residual, ln, eps, impl="eager")
        return F.linear(a, w), s, (a if want_normed and ln is not None else None)
    N, Kd = w.shape
    x2, r2, res_out, hn = _norm_prologue_buffers(x, residual, ln, want_normed)
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    _launch_gemv(x2, w, out, N, Kd, ln=ln, r2=r2, res_out=res_out, hn=hn, eps=eps)
    lead = x.shape[:-1]
    s = None if ln is None else x if residual is None else res_out.view(*lead, Kd)
    return out.view(*lead, N), s, (hn.view(*lead, Kd) if hn is not None else None)


def norm_gate_up_silu(x: torch.Tensor, residual: torch.Tensor | None, ln: torch.Tensor, eps: float,
                      wgu: torch.Tensor, impl: str | None = None):
    """The MLP's first half in one launch: s = residual + x, a = rms_norm(s, ln), -> (silu(a Wg^T) * (a Wu^T)
    [..., I], s) with wgu = [Wg; Wu] [2I, K] (`add_rmsnorm` + the gate/up GEMM + `silu_mul`)."""
    if not use_triton(x, impl):
        s, a = add_rmsnorm(x, residual, ln, eps, impl="eager")
        return silu_mul(F.linear(a, wgu), impl="eager"), s
    N2, Kd = wgu.shape
    I = N2 // 2
    x2, r2, res_out, _ = _norm_prologue_buffers(x, residual, ln, False)
    out = torch.empty(x2.shape[0], I, dtype=x.dtype, device=x.device)
    _launch_gemv(x2, wgu, out, I, Kd, ln=ln, r2=r2, res_out=res_out, eps=eps, epi=1)
    lead = x.shape[:-1]
    return out.view(*lead, I), (x if residual is None else res_out.view(*lead, Kd))


def norm_qkv_rope_write(x: torch.Tensor, residual: torch.Tensor | None, ln: torch.Tensor, eps: float,
                        wqkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, pos: torch.Tensor,
                        rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                        theta: float, impl: str | None = None):
    """The attention's first half in one launch: s = residual + x (x [B, T, D]), a = rms_norm(s, ln), qkv = a
    Wqkv^T, then `qk_norm_rope_write` -> (q [B, T, H, hd], s); the keys and values are written to the caches."""
    if not use_triton(x, impl):
        s, a = add_rmsnorm(x, residual, ln, eps, impl="eager")
        return qk_norm_rope_write(F.linear(a, wqkv), q_w, k_w, eps, pos, rows, k_cache, v_cache, n_heads, n_kv,
                                  theta, impl="eager"), s
    B, T, Kd = x.shape
    hd = q_w.shape[0]
    H, Hkv = n_heads, n_kv
    assert wqkv.shape[0] == (H + 2 * Hkv) * hd and hd & (hd - 1) == 0 and hd >= 4
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    x2, r2, res_out, _ = _norm_prologue_buffers(x, residual, ln, False)
    q = torch.empty(B * T, H, hd, dtype=x.dtype, device=x.device)
    rope = (q_w, k_w, inv_freq(hd, theta, x.device), _vec(pos.reshape(-1)), _vec(rows), k_cache, v_cache, T, H, Hkv)
    _launch_gemv(x2, wqkv, q.view(B * T, H * hd), (H + 2 * Hkv) * hd, Kd, ln=ln, r2=r2, res_out=res_out, eps=eps,
                 epi=2, rope=rope, block_n=hd // 2)
    return q.view(B, T, H, hd), (x if residual is None else res_out.view(B, T, Kd))
