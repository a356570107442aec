"""The 12 Hz speech-tokenizer decoder: codes [B, 16, T] -> waveform [B, T * 1920] at 24 kHz.

Pipeline (names = official state-dict names below `decoder.`):
  quantizer   split RVQ (1 + 15 books) -> [B, codebook_dim, T]
  pre_conv    causal conv k=3 -> latent_dim
  pre_transformer  8 layers, RoPE, sliding window 72, LayerScale -> latent_dim
  upsample    2 x (causal ConvTranspose k=s=2, ConvNeXt block)          (x4)
  decoder     conv k7, 4 x [SnakeBeta, causal ConvTranspose (k=2r, s=r, right-trim r), 3 residual units],
              SnakeBeta, conv k7 -> 1 channel, clamp [-1, 1]        (x 8*5*4*3)

Everything is causal with no look-ahead, so decoding is written once, as a *stateful step*: every causal
conv keeps its last (k-1)*dilation input samples, every transposed conv its last input frame, the
transformer a window of the last 71 keys/values per layer and each row's position. The one-shot decode is
the step from an empty state, so streaming in any split equals the one-shot decode exactly (up to float
rounding). State rows are independent: a scheduler can select, drop and concatenate them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class CodecDecoderConfig:
    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 512
    latent_dim: int = 1024
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    num_quantizers: int = 16
    upsample_rates: tuple = (8, 5, 4, 3)
    upsampling_ratios: tuple = (2, 2)
    decoder_dim: int = 1536

    @classmethod
    def from_dict(cls, d: dict) -> "CodecDecoderConfig":
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("upsample_rates", "upsampling_ratios"):
            if k in kw:
                kw[k] = tuple(kw[k])
        if "head_dim" not in d:
            kw["head_dim"] = kw.get("hidden_size", 512) // kw.get("num_attention_heads", 16)
        return cls(**kw)

    @property
    def total_upsample(self) -> int:
        return int(np.prod(self.upsample_rates + self.upsampling_ratios))


# --- stateful building blocks -----------------------------------------------------------------------
# Each `step(x, hist)` takes new input [B, C, t] and the history the module keeps, and returns
# (output for exactly these t inputs, new history). `hist` of an empty state is all zeros, which is what
# the official left zero-padding feeds the convolution.

class CausalConv(nn.Module):
    """Causal Conv1d (stride 1): left zero padding of (k-1)*dilation. Param names: conv.{weight,bias}."""

    def __init__(self, c_in, c_out, k, dilation=1, groups=1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, k, dilation=dilation, groups=groups)
        self.ctx = (k - 1) * dilation
        self.c_in = c_in

    def step(self, x, hist):
        xx = torch.cat([hist, x], dim=-1) if self.ctx else x
        return self.conv(xx), (xx[..., xx.shape[-1] - self.ctx:] if self.ctx else hist)


class CausalTransConv(nn.Module):
    """ConvTranspose1d(k, stride s) with the official right-only trim of k - s. With k <= 2s each output
    block depends on the current and the previous input frame; the history is that previous frame."""

    def __init__(self, c_in, c_out, k, s):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, k, stride=s)
        self.k, self.s = k, s
        assert k <= 2 * s
        self.ctx = 1 if k > s else 0
        self.c_in = c_in

    def step(self, x, hist):
        t = x.shape[-1]
        if self.ctx == 0:
            return self.conv(x)[..., : t * self.s], hist
        y = self.conv(torch.cat([hist, x], dim=-1))            # [B, C, (t+1)*s + (k-s)]
        return y[..., self.s: self.s + t * self.s], x[..., -1:]


class SnakeBeta(nn.Module):
    """x + 1/(exp(beta)+1e-9) * sin^2(x * exp(alpha)), per channel."""

    def __init__(self, c):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(c))
        self.beta = nn.Parameter(torch.zeros(c))

    def forward(self, x):
        a = torch.exp(self.alpha)[None, :, None]
        b = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (b + 1e-9)) * torch.pow(torch.sin(x * a), 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def step(self, x, hist):
        h, hist = self.dwconv.step(x, hist)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h.transpose(1, 2)))))
        return x + (self.gamma * h).transpose(1, 2), hist


class ResidualUnit(nn.Module):
    def __init__(self, dim, dilation):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def step(self, x, hist):
        h, hist = self.conv1.step(self.act1(x), hist)
        h, _ = self.conv2.step(self.act2(h), None)
        return x + h, hist


class DecoderBlock(nn.Module):
    def __init__(self, c_in, c_out, rate):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(c_in), CausalTransConv(c_in, c_out, 2 * rate, rate),
                                    ResidualUnit(c_out, 1), ResidualUnit(c_out, 3), ResidualUnit(c_out, 9)])


# --- quantizer ----------------------------------------------------------------------------------------
class Codebook(nn.Module):
    def __init__(self, dim, size):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.randn(size, dim))


class VQ(nn.Module):
    def __init__(self, dim, size):
        super().__init__()
        self._codebook = Codebook(dim, size)


class RVQLayers(nn.Module):
    def __init__(self, n, dim, size):
        super().__init__()
        self.layers = nn.ModuleList(VQ(dim, size) for _ in range(n))


class RVQ(nn.Module):
    """Residual VQ group: input_proj (encoder side, unused here), codebooks, output_proj (1x1, no bias)."""

    def __init__(self, n, dim, io_dim, size):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = RVQLayers(n, dim, size)
        self._cache = None

    def codebooks(self) -> torch.Tensor:
        """[n, size, dim] codebook vectors (embedding_sum / clamp(cluster_usage, 1e-5)), cached; rebuilt when the
        parameters are replaced (loading assigns new tensors). Call `clear_cache()` after in-place edits."""
        ps = [layer._codebook for layer in self.vq.layers]
        key = tuple((p.embedding_sum.data_ptr(), p.cluster_usage.data_ptr()) for p in ps)
        if self._cache is None or self._cache[0] != key:
            books = torch.stack([p.embedding_sum / p.cluster_usage.clamp(min=1e-5)[:, None] for p in ps])
            self._cache = (key, books.detach())
        return self._cache[1]

    def clear_cache(self):
        self._cache = None

    def decode(self, codes):
        """codes [B, n, T] -> [B, io_dim, T]; summed in book order like the official."""
        books = self.codebooks()
        q = 0
        for i in range(codes.shape[1]):
            q = q + F.embedding(codes[:, i], books[i]).transpose(1, 2)
        return self.output_proj(q)


class SplitRVQ(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = RVQ(1, dim, cfg.codebook_dim, cfg.codebook_size)
        self.rvq_rest = RVQ(cfg.num_quantizers - 1, dim, cfg.codebook_dim, cfg.codebook_size)

    def decode(self, codes):
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# --- transformer ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerScale(nn.Module):
    def __init__(self, dim, init):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x):
        return self.scale * x


class SelfAttention(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PreTransformer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def step(self, x, pos, k_hist, v_hist, valid):
        """x [B, t, latent]; pos [B] position of x[:, 0]; k_hist/v_hist [L, B, Hkv, W-1, hd] past keys/values
        (after RoPE) with `valid` [B, W-1] marking which exist. Returns (y [B, t, latent], new k/v/valid)."""
        cfg = self.cfg
        B, t, _ = x.shape
        W1 = k_hist.shape[3]
        h = self.input_proj(x)
        qpos = pos[:, None] + torch.arange(t, device=x.device)[None]                 # [B, t]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64,
                                                       device=x.device).float() / cfg.head_dim))
        freqs = qpos.float()[..., None] * inv
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(h.dtype)[:, None], emb.sin().to(h.dtype)[:, None]   # [B, 1, t, hd]
        # key positions: the W-1 remembered ones then the t new ones
        kpos = torch.cat([pos[:, None] - W1 + torch.arange(W1, device=x.device)[None], qpos], dim=1)
        kvalid = torch.cat([valid, torch.ones(B, t, dtype=torch.bool, device=x.device)], dim=1)
        mask = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] > qpos[:, :, None] - cfg.sliding_window)
        mask = (mask & kvalid[:, None, :])[:, None]                                   # [B, 1, t, W-1+t]
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            r = layer.input_layernorm(h)
            q = a.q_proj(r).view(B, t, a.h, a.hd).transpose(1, 2)
            k = a.k_proj(r).view(B, t, a.hkv, a.hd).transpose(1, 2)
            v = a.v_proj(r).view(B, t, a.hkv, a.hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kk = torch.cat([k_hist[i], k], dim=2)
            vv = torch.cat([v_hist[i], v], dim=2)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=a.h != a.hkv)
            h = h + layer.self_attn_layer_scale(a.o_proj(o.transpose(1, 2).reshape(B, t, a.h * a.hd)))
            m = layer.mlp
            r = layer.post_attention_layernorm(h)
            h = h + layer.mlp_layer_scale(m.down_proj(F.silu(m.gate_proj(r)) * m.up_proj(r)))
            new_k.append(kk[:, :, kk.shape[2] - W1:])
            new_v.append(vv[:, :, vv.shape[2] - W1:])
        valid = kvalid[:, kvalid.shape[1] - W1:]
        return self.output_proj(self.norm(h)), torch.stack(new_k), torch.stack(new_v), valid


# --- state ------------------------------------------------------------------------------------------------
@dataclass
class CodecDecoderState:
    """Per-row streaming state. Every tensor has the batch (row) dimension first, except the transformer
    windows, which are [layers, B, ...]."""

    convs: list          # history tensors of each stateful conv, in module order, [B, C, ctx]
    k: torch.Tensor      # [L, B, Hkv, W-1, hd]
    v: torch.Tensor
    valid: torch.Tensor  # [B, W-1] bool
    pos: torch.Tensor    # [B] frames decoded so far

    def select(self, rows: torch.Tensor) -> "CodecDecoderState":
        return CodecDecoderState([c[rows] for c in self.convs], self.k[:, rows], self.v[:, rows],
                                 self.valid[rows], self.pos[rows])

    @staticmethod
    def concat(states: list["CodecDecoderState"]) -> "CodecDecoderState":
        return CodecDecoderState([torch.cat(cs) for cs in zip(*[s.convs for s in states])],
                                 torch.cat([s.k for s in states], 1), torch.cat([s.v for s in states], 1),
                                 torch.cat([s.valid for s in states]), torch.cat([s.pos for s in states]))


class CodecDecoder(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(cfg.latent_dim, cfg.latent_dim, f, f), ConvNeXtBlock(cfg.latent_dim)])
            for f in cfg.upsampling_ratios)
        dec = [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
        for i, r in enumerate(cfg.upsample_rates):
            dec.append(DecoderBlock(cfg.decoder_dim // 2 ** i, cfg.decoder_dim // 2 ** (i + 1), r))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        dec += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(dec)
        self._init_random()

    def _init_random(self):
        # A freshly built decoder (make-tiny) should make finite, audible noise: small SnakeBeta and layer
        # scales as trained models have, codebooks with positive usage.
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, SnakeBeta):
                    m.alpha.uniform_(-0.1, 0.1)
                    m.beta.uniform_(-0.1, 0.1)

    def _stateful(self) -> list[nn.Module]:
        """Modules with a conv history, in the order their states are stored."""
        mods = [self.pre_conv]
        for up in self.upsample:
            mods += [up[0], up[1].dwconv]
        mods.append(self.decoder[0])
        for blk in self.decoder[1:1 + len(self.cfg.upsample_rates)]:
            mods.append(blk.block[1])
            mods += [ru.conv1 for ru in blk.block[2:]]
        mods.append(self.decoder[-1])
        return mods

    def init_state(self, batch_size: int, device=None, dtype=None) -> CodecDecoderState:
        p = self.pre_conv.conv.weight
        device, dtype = device or p.device, dtype or p.dtype
        convs = [torch.zeros(batch_size, m.c_in, m.ctx, device=device, dtype=dtype) for m in self._stateful()]
        c = self.cfg
        W1 = c.sliding_window - 1
        kv = torch.zeros(c.num_hidden_layers, batch_size, c.num_key_value_heads, W1, c.head_dim,
                         device=device, dtype=dtype)
        return CodecDecoderState(convs, kv, kv.clone(), torch.zeros(batch_size, W1, dtype=torch.bool, device=device),
                                 torch.zeros(batch_size, dtype=torch.long, device=device))

    def decode_step(self, codes: torch.Tensor, state: CodecDecoderState) -> torch.Tensor:
        """codes [B, 16, t] -> [B, t * 1920]; advances `state` (its fields are replaced, rows independent)."""
        convs, i = list(state.convs), 0

        def run(mod, x):  # a stateful module: consume its history, store the new one
            nonlocal i
            y, convs[i] = mod.step(x, convs[i])
            i += 1
            return y

        t = codes.shape[-1]
        h = run(self.pre_conv, self.quantizer.decode(codes))                         # [B, latent, t]
        y, state.k, state.v, state.valid = self.pre_transformer.step(
            h.transpose(1, 2), state.pos, state.k, state.v, state.valid)
        h = y.transpose(1, 2)
        for up in self.upsample:                                                       # x2, x2
            h = run(up[0], h)
            h = run(up[1], h)
        h = run(self.decoder[0], h)
        for blk in self.decoder[1:1 + len(self.cfg.upsample_rates)]:                   # x8, x5, x4, x3
            h = blk.block[0](h)
            h = run(blk.block[1], h)
            for ru in blk.block[2:]:
                h = run(ru, h)
        h = run(self.decoder[-1], self.decoder[-2](h))                                 # [B, 1, t*1920]
        state.convs = convs
        state.pos = state.pos + t
        return h.clamp(min=-1, max=1)[:, 0]

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """One-shot decode: codes [B, 16, T] -> [B, T * 1920]."""
        return self.decode_step(codes, self.init_state(codes.shape[0]))

    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300, left_context_size: int = 25) -> torch.Tensor:
        """The official offline decode: chunks of 300 frames, each with 25 frames of left context re-decoded."""
        up = self.cfg.total_upsample
        wavs, start, T = [], 0, codes.shape[-1]
        while start < T:
            end = min(start + chunk_size, T)
            ctx = left_context_size if start - left_context_size > 0 else start
            wavs.append(self(codes[..., start - ctx:end])[..., ctx * up:])
            start = end
        return torch.cat(wavs, dim=-1)
