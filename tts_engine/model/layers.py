"""Qwen3 decoder building blocks shared by the talker and the code predictor.

Plain PyTorch, explicit shapes. Notation: B batch rows, T new positions this call, S cache positions read,
D model width, H query heads, Hkv key/value heads, hd head_dim.

Numerics follow the official Qwen3-TTS code: RMSNorm upcasts to fp32 and multiplies by the weight after
casting back; q/k RMSNorm per head *before* RoPE; rotate-half RoPE with positions shared by all three
M-RoPE axes (which makes M-RoPE exactly 1-D RoPE).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tts_engine.config import DecoderStackConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, computed in fp32 and cast back before the weight (the official
    order). fp32 input skips the two no-op casts (fewer calls per frame, the same arithmetic)."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


_inv_freq_cache: dict = {}


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [B, T] (int64) -> cos, sin [B, 1, T, hd] in `dtype` (computed in fp32)."""
    key = (head_dim, theta, positions.device)
    inv_freq = _inv_freq_cache.get(key)
    if inv_freq is None:  # built once per (head_dim, theta, device)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
                                    .float() / head_dim))
        _inv_freq_cache[key] = inv_freq
    freqs = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., hd] -> [-sin[..., :hd/2], sin[..., hd/2:]]: with it `apply_rope` needs no negation per call."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit (negating a factor is exact), as a swap of the two halves
    (one flip of a size-2 dim) times the pre-signed sin: 2 calls fewer than chunk/neg/cat."""
    hd = x.shape[-1]
    swapped = x.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed


def small_query_attention(device: torch.device, dtype: torch.dtype, T: int) -> bool:
    """Decode-time attention (1-2 query positions) on a CPU in a 16-bit dtype runs as two small fp32 matmuls and
    a softmax (`Attention._attend_small`): PyTorch's CPU flash kernel is slow for so few queries in bf16 (its
    cost grows ~20 us per key and layer at one thread on a Zen 4: 2-3x the matmul form at 17 keys, 4-15x at
    100-400). fp32 keeps scaled_dot_product_attention (bit-for-bit parity), and so does a GPU (CUDA graphs)."""
    return device.type == "cpu" and dtype != torch.float32 and T <= 2


class KVCache:
    """Static KV cache for one decoder stack: k, v [layers, rows, Hkv, max_len, hd].

    Row r holds one sequence; `write` puts new keys at explicit per-row positions, so rows of
    different lengths share one tensor. Born in the model runner, lives as long as the engine.
    """

    def __init__(self, n_layers: int, rows: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device, dtype):
        shape = (n_layers, rows, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Attention(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qkv_proj = None   # q, k, v in one matmul: set by `fuse_projections`
        self.qk_norm_weight = None   # [H + Hkv, hd]: q_norm's weight per query head, k_norm's per key head

    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj, v_proj by one Linear with their rows stacked (one matmul instead of three), and
        let q and k be normed together (the same per-head arithmetic, one call instead of two). Peak memory grows
        by one layer's q/k/v while the stacked copy is built; the three are dropped after. Idempotent."""
        if self.qkv_proj is not None:
            return
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        self.qkv_proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.qkv_proj.weight = nn.Parameter(w, requires_grad=False)
        del self.q_proj, self.k_proj, self.v_proj
        self.qk_norm_weight = torch.cat([self.q_norm.weight.detach().expand(self.n_heads, self.hd),
                                         self.k_norm.weight.detach().expand(self.n_kv, self.hd)])

    def forward(self, x, cos, sin, k_cache, v_cache, rows, write_pos, attn_mask, read_len, r_idx=None,
                write_start: int | None = None):
        """x [B, T, D]; cos and sin (pre-signed: `signed_sin`) [B, 1, T, hd]; k_cache/v_cache [R, Hkv, L, hd]
        (one layer); rows: cache rows of this batch, a slice (contiguous rows: cache views, no copies) or an
        index tensor [B]; write_pos [B, T] positions where the new keys go; r_idx [B, T] the cache row of each
        new key (index rows only; built once per stack call by `DecoderStack.run`); write_start: when every row
        writes at the same positions write_start..write_start+T-1 (the code predictor), a host int (a plain
        slice copy); attn_mask: as `DecoderStack.positions` makes it for this (device, dtype, T); only the
        first read_len cache positions are read."""
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv, self.hd
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, hd)
            qk = rms_norm(qkv[:, :, :H + Hkv], self.qk_norm_weight, self.eps).transpose(1, 2)  # [B, H+Hkv, T, hd]
            q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=1)
            v = qkv[:, :, H + Hkv:].transpose(1, 2)
        else:
            q = self.q_norm(self.q_proj(x).view(B, T, H, hd)).transpose(1, 2)  # [B, H, T, hd]
            k = self.k_norm(self.k_proj(x).view(B, T, Hkv, hd)).transpose(1, 2)  # [B, Hkv, T, hd]
            v = self.v_proj(x).view(B, T, Hkv, hd).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # scatter the new keys/values into the static cache at (row, :, pos)
        if isinstance(rows, slice):
            k_cache, v_cache = k_cache[rows], v_cache[rows]            # views [B, Hkv, L, hd]
            rows = slice(None)
        if write_start is not None and isinstance(rows, slice):
            k_cache[:, :, write_start:write_start + T] = k
            v_cache[:, :, write_start:write_start + T] = v
        else:
            if r_idx is None:
                r_idx = (torch.arange(B, device=x.device) if isinstance(rows, slice) else rows)[:, None].expand(B, T)
            k_cache[r_idx, :, write_pos] = k.transpose(1, 2)  # [B, T, Hkv, hd]
            v_cache[r_idx, :, write_pos] = v.transpose(1, 2)
        keys = k_cache[rows, :, :read_len]    # [B, Hkv, S, hd] (a view when rows is a slice)
        vals = v_cache[rows, :, :read_len]
        if small_query_attention(x.device, x.dtype, T):
            out = self._attend_small(q, keys, vals, attn_mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=attn_mask, enable_gqa=H != Hkv)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * hd))

    def _attend_small(self, q, keys, vals, add_mask):
        """softmax(q k^T / sqrt(hd) + add_mask) v for a few query positions, in fp32, the query heads of one
        key head stacked as rows of one matmul: q [B, H, T, hd], keys/vals [B, Hkv, S, hd], add_mask None (every
        key visible) or [B, 1, g*T, S] fp32 (0 / -inf) -> [B, H, T, hd] in q's dtype. fp32 because the 16-bit
        batched matmul of a CPU loops over the heads one call each, while the fp32 one is a single BLAS batch
        (faster here, and closer to fp32 than the bf16 flash kernel)."""
        B, H, T, hd = q.shape
        Hkv = keys.shape[1]
        qg = q.reshape(B, Hkv, (H // Hkv) * T, hd).float()     # query head h = kv * g + i reads key head kv
        scores = torch.matmul(qg, keys.float().transpose(-1, -2)).mul_(hd ** -0.5)   # [B, Hkv, g*T, S]
        if add_mask is not None:
            scores.add_(add_mask)
        out = torch.matmul(scores.softmax(dim=-1), vals.float())                    # [B, Hkv, g*T, hd]
        return out.to(q.dtype).view(B, H, T, hd)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = None   # gate and up in one matmul: set by `fuse_projections`

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one Linear with their rows stacked (one matmul instead of two).
        Idempotent."""
        if self.gate_up_proj is not None:
            return
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
        self.gate_up_proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.gate_up_proj.weight = nn.Parameter(w, requires_grad=False)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate).mul_(up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, rows, write_pos, attn_mask, read_len, r_idx=None,
                write_start: int | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, rows, write_pos,
                               attn_mask, read_len, r_idx, write_start)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`layers` + final `norm` (state-dict names as in the official `*.model`). `fused`: a fast-path hook set only
    by a device backend when it attaches (CPU: cpu/fused_step.py's `FusedStep`), serving the decode-sized calls of
    `run` (None: the eager layers below)."""

    fused = None

    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up of every layer as one matmul each (`Attention.fuse_projections`,
        `MLP.fuse_projections`)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def positions(self, start: torch.Tensor, T: int, read_len: int, dtype: torch.dtype):
        """start [B] -> (pos [B, T], cos, signed sin [B, 1, T, hd] in `dtype`, mask). The mask is the causal
        mask [B, 1, T, read_len] bool for scaled_dot_product_attention, or, where `small_query_attention`
        holds, None when every row sees all read_len keys (one check on the host: a CPU tensor) or else the
        additive fp32 mask [B, 1, g*T, read_len] of `Attention._attend_small`."""
        t = torch.arange(T, device=start.device)
        pos = start[:, None] + t[None, :]                                   # [B, T]
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        key_idx = torch.arange(read_len, device=start.device)
        mask = (key_idx[None, None, :] <= pos[:, :, None])[:, None]        # [B, 1, T, S]
        if small_query_attention(start.device, dtype, T):
            if bool(mask.all()):
                mask = None
            else:
                g = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
                mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf")).repeat(1, 1, g, 1)
        return pos, cos, signed_sin(sin), mask

    def run(self, x: torch.Tensor, cache: KVCache, rows, start: torch.Tensor,
            read_len: int, positions=None, write_start: int | None = None) -> torch.Tensor:
        """x [B, T, D] new inputs for cache rows `rows` [B], whose first new position is `start` [B].

        Each row sees its own cache positions < start + t (causal). `read_len` >= max(start) + T is the
        number of cache positions read (a host-side int, so no device sync). `positions`: the result of
        `self.positions(start, T, read_len, x.dtype)` when the caller keeps it (the code predictor reuses its
        15 per-frame position sets); write_start: host int when every row's start equals it. Returns normed
        hidden [B, T, D]."""
        B, T, _ = x.shape
        if self.fused is not None and self.fused.takes(B, T) and torch.is_tensor(start):
            return self.fused.run(x, cache, rows, start, lambda: self._run_eager(x, cache, rows, start, read_len,
                                                                                positions, write_start))
        return self._run_eager(x, cache, rows, start, read_len, positions, write_start)

    def _run_eager(self, x, cache, rows, start, read_len, positions, write_start):
        B, T, _ = x.shape
        pos, cos, sin, mask = positions if positions is not None else self.positions(start, T, read_len, x.dtype)
        r_idx = None
        if write_start is None or not isinstance(rows, slice):
            r_idx = (torch.arange(B, device=x.device) if isinstance(rows, slice) else rows)[:, None].expand(B, T)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], rows, pos, mask, read_len, r_idx, write_start)
        return self.norm(x)
