"""The 12 Hz speech-tokenizer encoder (a Mimi encoder): 24 kHz waveform -> codes [T, 16], used to turn a
reference clip into the codes an in-context (ICL) clone continues from.

Pipeline (names = official state-dict names below `encoder.`):
  encoder              SEANet: conv k7, 4 x [residual block, ELU, strided conv (4, 5, 6, 8)], ELU, conv k3
                       (all causal: left padding k-stride, right padding up to a whole frame)   -> 25 Hz
  encoder_transformer  8 layers, LayerNorm, RoPE, causal attention, GELU MLP, LayerScale
  downsample           causal conv k4 s2, replicate padding                                     -> 12.5 Hz
  quantizer            split RVQ: 1 semantic + acoustic books, nearest codeword (Euclidean) per book
Only the first `valid_num_quantizers` (16) codebooks are computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class CodecEncoderConfig:
    sampling_rate: int = 24000
    frame_rate: float = 12.5
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    vector_quantization_hidden_dimension: int = 256
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    use_conv_shortcut: bool = False
    valid_num_quantizers: int = 16

    @classmethod
    def from_dict(cls, d: dict, valid_num_quantizers: int = 16) -> "CodecEncoderConfig":
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in (d or {}).items() if k in names}
        if "upsampling_ratios" in kw:
            kw["upsampling_ratios"] = tuple(kw["upsampling_ratios"])
        if "head_dim" not in kw:
            kw["head_dim"] = kw.get("hidden_size", 512) // kw.get("num_attention_heads", 8)
        cfg = cls(**kw, valid_num_quantizers=valid_num_quantizers)
        if not cfg.use_causal_conv or cfg.use_conv_shortcut:
            raise ValueError("only the causal Mimi encoder without conv shortcuts is supported")
        return cfg

    @property
    def hop(self) -> int:
        return int(np.prod(self.upsampling_ratios))


class MimiConv(nn.Module):
    """Causal Conv1d: pad left by k_eff - stride, and right by what makes the last frame whole."""

    def __init__(self, c_in, c_out, k, stride=1, dilation=1, bias=True, pad_mode="constant"):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, k, stride, dilation=dilation, bias=bias)
        self.k_eff = (k - 1) * dilation + 1
        self.stride = stride
        self.pad_total = self.k_eff - stride
        self.pad_mode = pad_mode

    def forward(self, x):
        L = x.shape[-1]
        n_frames = math.ceil((L - self.k_eff + self.pad_total) / self.stride + 1) - 1
        extra = n_frames * self.stride + self.k_eff - self.pad_total - L
        mode = "replicate" if self.pad_mode == "replicate" else "constant"
        return self.conv(F.pad(x, (self.pad_total, extra), mode=mode))


class ResnetBlock(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([nn.ELU(), MimiConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), MimiConv(hidden, dim, 1)])

    def forward(self, x):
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        layers = [MimiConv(cfg.audio_channels, cfg.num_filters, cfg.kernel_size)]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = scale * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j))
            layers += [nn.ELU(), MimiConv(dim, dim * 2, 2 * ratio, stride=ratio)]
            scale *= 2
        layers += [nn.ELU(), MimiConv(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, h * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(h * hd, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.mlp.fc2 = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.input_layernorm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.self_attn_layer_scale = nn.Module()
        self.self_attn_layer_scale.scale = nn.Parameter(torch.full((d,), cfg.layer_scale_initial_scale))
        self.mlp_layer_scale = nn.Module()
        self.mlp_layer_scale.scale = nn.Parameter(torch.full((d,), cfg.layer_scale_initial_scale))


class EncoderTransformer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x):
        """x [B, T, D] -> [B, T, D]; causal attention over positions 0..T-1."""
        cfg = self.cfg
        B, T, _ = x.shape
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=x.device)
                                        .float() / cfg.head_dim))
        freqs = torch.arange(T, device=x.device).float()[:, None] * inv
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        h_, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for layer in self.layers:
            a = layer.self_attn
            r = layer.input_layernorm(x)
            q = rope(a.q_proj(r).view(B, T, h_, hd).transpose(1, 2))
            k = rope(a.k_proj(r).view(B, T, hkv, hd).transpose(1, 2))
            v = a.v_proj(r).view(B, T, hkv, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h_ != hkv)
            x = x + layer.self_attn_layer_scale.scale * a.o_proj(o.transpose(1, 2).reshape(B, T, h_ * hd))
            r = layer.post_attention_layernorm(x)
            x = x + layer.mlp_layer_scale.scale * layer.mlp.fc2(F.gelu(layer.mlp.fc1(r)))
        return x


class Codebook(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.register_buffer("cluster_usage", torch.ones(cfg.codebook_size))
        self.register_buffer("embed_sum", torch.randn(cfg.codebook_size, cfg.codebook_dim))


class VQ(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.codebook = Codebook(cfg)


class RVQ(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig, n: int):
        super().__init__()
        self.layers = nn.ModuleList(VQ(cfg) for _ in range(n))
        self.input_proj = (nn.Conv1d(cfg.hidden_size, cfg.vector_quantization_hidden_dimension, 1, bias=False)
                           if cfg.vector_quantization_hidden_dimension != cfg.hidden_size else None)

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [B, D, T] -> codes [n, B, T]: nearest codeword, then subtract it (residual), book by book."""
        if self.input_proj is not None:
            x = self.input_proj(x)
        res = x.transpose(1, 2)                                               # [B, T, d]
        out = []
        for layer in self.layers[:n]:
            cb = layer.codebook
            embed = cb.embed_sum / cb.cluster_usage.clamp(min=1e-5)[:, None]  # [K, d]
            flat = res.reshape(-1, res.shape[-1])
            idx = torch.cdist(flat[None].float(), embed[None].float(), p=2)[0].argmin(dim=-1).view(res.shape[:-1])
            res = res - F.embedding(idx, embed)
            out.append(idx)
        return torch.stack(out)


class SplitRVQ(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.n_sem = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = RVQ(cfg, self.n_sem)
        self.acoustic_residual_vector_quantizer = RVQ(cfg, cfg.num_quantizers - self.n_sem)

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [B, D, T] -> codes [B, n, T]; both groups quantize the same input."""
        codes = self.semantic_residual_vector_quantizer.encode(x, self.n_sem)
        if n > self.n_sem:
            codes = torch.cat([codes, self.acoustic_residual_vector_quantizer.encode(x, n - self.n_sem)])
        return codes.transpose(0, 1)


class CodecEncoder(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        enc_rate = cfg.sampling_rate / cfg.hop
        k = 2 * int(enc_rate / cfg.frame_rate)
        self.downsample = MimiConv(cfg.hidden_size, cfg.hidden_size, k, stride=2, bias=False, pad_mode="replicate")
        self.quantizer = SplitRVQ(cfg)

    @property
    def samples_per_frame(self) -> int:
        return int(self.cfg.sampling_rate / self.cfg.frame_rate)

    def encode(self, wav: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """wav [B, S] at 24 kHz (zero-padded on the right), lengths [B] valid samples -> list of [T_i, 16]
        with T_i = ceil(length_i / 1920)."""
        p = self.downsample.conv.weight
        h = self.encoder(wav.to(p.device, p.dtype)[:, None])
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        h = self.downsample(h)
        codes = self.quantizer.encode(h, self.cfg.valid_num_quantizers)       # [B, 16, T]
        spf = self.samples_per_frame
        return [codes[i, :, : -(-int(n) // spf)].T for i, n in enumerate(lengths.tolist())]

    def encode_one(self, wav: np.ndarray, sr: int) -> torch.Tensor:
        """A mono float32 clip at any rate -> codes [T, 16] (resampled with librosa as the official)."""
        from ..audio import resample

        wav = resample(np.asarray(wav, dtype=np.float32), int(sr), self.cfg.sampling_rate)
        t = torch.from_numpy(np.ascontiguousarray(wav))[None]
        return self.encode(t, torch.tensor([t.shape[1]]))[0]
