"""The 12 Hz speech-tokenizer encoder (a Mimi encoder): 24 kHz waveform -> codes [T, 16], used to turn a
reference clip into the codes an in-context (ICL) clone continues from.

Pipeline (module names = official state-dict names below `encoder.`), for the released codec:
  encoder              SEANet: conv k7, 4 x [residual block, ELU, strided conv k=2r (r = 4, 5, 6, 8)], ELU,
                       conv k3; all causal                              [B, 1, S] -> [B, 512, ceil(S/960)]  25 Hz
  encoder_transformer  8 pre-LayerNorm layers: causal MHA with RoPE, GELU MLP, LayerScale   [B, T25, 512]
  downsample           causal conv k4 s2, replicate padding, no bias     -> [B, 512, ceil(S/1920)]        12.5 Hz
  quantizer            split RVQ: 1 semantic book + acoustic books; each group projects 512 -> 256 (1x1 conv)
                       and picks the nearest codeword (Euclidean), book by book on the residual
Only the first `valid_num_quantizers` (16) books are built and computed; each item is trimmed to
ceil(valid_samples / 1920) frames.

Exactness notes (what the official transformers 4.57 `MimiModel.encode` does, mirrored here):
- causal convs pad `k_eff - stride` on the left and, on the right, what completes the last stride ("extra
  padding", computed from the length of *their own input*). In a batch the shorter items therefore see the
  encoder's response to the zero padding, not fresh zero padding: only the last frame of an item whose length is
  not a multiple of 1920 can differ from encoding it alone. `encode` reproduces the batch behaviour.
- the transformer gets no padding mask and uses plain causal attention (`sliding_window` is not applied: the
  encoder runs without a cache, and `create_causal_mask` has no window).
- distances are computed in fp32 (`torch.cdist`), whatever the model dtype; codeword = embed_sum / usage.
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
    """MimiConfig fields (defaults = transformers' MimiConfig defaults) + the top-level codec fields we need."""

    sampling_rate: int = 24000
    frame_rate: float | None = None          # None: sampling_rate / (prod(upsampling_ratios) * 2)
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
    codebook_dim: int | None = 256           # None: hidden_size
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None              # None: hidden_size // num_attention_heads
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    # top level of speech_tokenizer/config.json
    valid_num_quantizers: int = 16           # `encoder_valid_num_quantizers`
    encode_downsample_rate: int | None = None  # samples per output frame; None: sampling_rate / frame_rate

    def __post_init__(self):
        self.upsampling_ratios = tuple(int(r) for r in self.upsampling_ratios)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.codebook_dim is None:
            self.codebook_dim = self.hidden_size
        if self.frame_rate is None:
            self.frame_rate = self.sampling_rate / (self.hop * 2)
        if self.encode_downsample_rate is None:
            self.encode_downsample_rate = int(self.sampling_rate / self.frame_rate)
        if not self.use_causal_conv or self.use_conv_shortcut or self.audio_channels != 1:
            raise ValueError("only the causal mono Mimi encoder without conv shortcuts is supported")
        if not self.num_semantic_quantizers <= self.valid_num_quantizers <= self.num_quantizers:
            raise ValueError(f"valid_num_quantizers {self.valid_num_quantizers} must be within "
                             f"[{self.num_semantic_quantizers}, {self.num_quantizers}]")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")

    @classmethod
    def from_dict(cls, d: dict | None, valid_num_quantizers: int = 16,
                  encode_downsample_rate: int | None = None) -> "CodecEncoderConfig":
        """From the `encoder_config` dict of speech_tokenizer/config.json (MimiConfig names; unknown keys are
        ignored, missing ones get MimiConfig's defaults; the saved `_frame_rate` is read as `frame_rate`)."""
        d = dict(d or {})
        if d.get("frame_rate") is None and d.get("_frame_rate") is not None:
            d["frame_rate"] = d["_frame_rate"]
        names = {f.name for f in fields(cls)} - {"valid_num_quantizers", "encode_downsample_rate"}
        kw = {k: v for k, v in d.items() if k in names}
        return cls(**kw, valid_num_quantizers=int(valid_num_quantizers),
                   encode_downsample_rate=encode_downsample_rate)

    @property
    def hop(self) -> int:
        """Samples per SEANet output step (960: 25 Hz)."""
        return int(np.prod(self.upsampling_ratios))

    @property
    def encodec_frame_rate(self) -> int:
        return math.ceil(self.sampling_rate / self.hop)


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


# ----------------------------------------------------------------------------------------------------- SEANet
class CausalConv1d(nn.Module):
    """Mimi's causal Conv1d: pad `k_eff - stride` on the left, and on the right what makes the last stride whole
    (so [B, C_in, L] -> [B, C_out, ceil(L / stride)]). State dict: `conv.weight` [C_out, C_in, k], `conv.bias`."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.k_eff = (kernel_size - 1) * dilation + 1
        self.pad_total = self.k_eff - stride
        self.pad_mode = pad_mode

    def extra_padding(self, length: int) -> int:
        # the official arithmetic (int64 tensors, a float32 true division, ceil), to round exactly alike
        n = (torch.tensor(length) - self.k_eff + self.pad_total) / self.stride + 1
        n_frames = int(torch.ceil(n).to(torch.int64)) - 1
        return n_frames * self.stride + self.k_eff - self.pad_total - length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C_in, L] -> [B, C_out, ceil(L / stride)]."""
        return self.conv(_pad1d(x, self.pad_total, self.extra_padding(x.shape[-1]), self.pad_mode))


def _pad1d(x: torch.Tensor, left: int, right: int, mode: str) -> torch.Tensor:
    if mode != "reflect":
        return F.pad(x, (left, right), mode)
    extra = max(0, max(left, right) - x.shape[-1] + 1)   # reflect needs length > pad: zero-extend first
    y = F.pad(F.pad(x, (0, extra)), (left, right), "reflect")
    return y[..., : y.shape[-1] - extra]


class ResnetBlock(nn.Module):
    """x + conv1x1(ELU(conv_k3_dilated(ELU(x)))); channels dim -> dim // compress -> dim.
    State dict: block.1.conv.*, block.3.conv.* (block.0 and block.2 are the parameterless ELUs)."""

    def __init__(self, cfg: CodecEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
            nn.ELU(), CausalConv1d(hidden, dim, 1, pad_mode=cfg.pad_mode),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANetEncoder(nn.Module):
    """[B, 1, S] -> [B, hidden, ceil(S / hop)]. `layers` keeps the official indices (ELUs included)."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(cfg.audio_channels, cfg.num_filters, cfg.kernel_size,
                                                pad_mode=cfg.pad_mode)]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):          # strides 4, 5, 6, 8
            dim = scale * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j))
            layers += [nn.ELU(), CausalConv1d(dim, dim * 2, 2 * ratio, stride=ratio, pad_mode=cfg.pad_mode)]
            scale *= 2
        layers += [nn.ELU(), CausalConv1d(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size,
                                          pad_mode=cfg.pad_mode)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------------------------------------ transformer
class Attention(nn.Module):
    """Causal multi-head attention with RoPE (rotate-half), no window. State dict: {q,k,v,o}_proj.weight."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        d, self.n_heads, self.n_kv, self.head_dim = (cfg.hidden_size, cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], cos/sin [T, head_dim] -> [B, T, D]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)   # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)      # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.n_kv != self.n_heads:                                                # GQA: repeat kv heads
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)                # [B, H, T, hd]
        return self.o_proj(o.transpose(1, 2).contiguous().view(B, T, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MLP(nn.Module):
    """fc2(act(fc1(x))), no biases."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerScale(nn.Module):
    """scale [D] * x. State dict: `scale`."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.scale = nn.Parameter(torch.full((cfg.hidden_size,), float(cfg.layer_scale_initial_scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg)
        self.mlp_layer_scale = LayerScale(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    """[B, T, D] -> [B, T, D]; positions 0..T-1."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def rope(self, T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim], computed in fp32 then cast to the activation dtype (as the official)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
                                    / self.head_dim))                              # [hd/2]
        freqs = torch.arange(T, device=device).float()[:, None] * inv[None, :]    # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(x.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


# -------------------------------------------------------------------------------------------------- quantizer
class Codebook(nn.Module):
    """Euclidean codebook: codeword k = embed_sum[k] / max(cluster_usage[k], 1e-5).
    State dict: cluster_usage [K], embed_sum [K, d]."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.register_buffer("cluster_usage", torch.ones(cfg.codebook_size))
        # random init (make-tiny): codewords on the scale of a default-initialised network's projected
        # features (~0.01-0.05), so that a random checkpoint uses many codewords
        self.register_buffer("embed_sum", 0.02 * torch.randn(cfg.codebook_size, cfg.codebook_dim))

    def embed(self) -> torch.Tensor:
        """[K, d] in the buffers' dtype."""
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.codebook = Codebook(cfg)


class ResidualVQ(nn.Module):
    """input_proj (1x1 conv, no bias, when vq dim != hidden) then `n` books on the running residual."""

    def __init__(self, cfg: CodecEncoderConfig, n: int):
        super().__init__()
        self.input_proj = (nn.Conv1d(cfg.hidden_size, cfg.vector_quantization_hidden_dimension, 1, bias=False)
                           if cfg.vector_quantization_hidden_dimension != cfg.hidden_size else None)
        self.layers = nn.ModuleList(VectorQuantizer(cfg) for _ in range(n))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, D, T] -> codes [n, B, T] (int64)."""
        if self.input_proj is not None:
            x = self.input_proj(x)                                     # [B, d, T]
        res = x.transpose(1, 2)                                        # [B, T, d]
        out = []
        for layer in self.layers:
            embed = layer.codebook.embed()                             # [K, d]
            flat = res.reshape(-1, res.shape[-1])                      # [B*T, d]
            dist = torch.cdist(flat[None].float(), embed[None].float(), p=2)[0]   # [B*T, K]
            idx = dist.argmin(dim=-1).view(res.shape[:-1])             # [B, T]
            res = res - F.embedding(idx, embed)
            out.append(idx)
        return torch.stack(out)


class SplitResidualVQ(nn.Module):
    """Semantic RVQ (first `num_semantic_quantizers` books) and acoustic RVQ (the rest, up to
    `valid_num_quantizers`); both quantize the same input, their codes are concatenated."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        n_sem = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVQ(cfg, n_sem)
        self.acoustic_residual_vector_quantizer = ResidualVQ(cfg, cfg.valid_num_quantizers - n_sem)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, D, T] -> codes [B, valid_num_quantizers, T]."""
        codes = self.semantic_residual_vector_quantizer.encode(x)
        if len(self.acoustic_residual_vector_quantizer.layers):
            codes = torch.cat([codes, self.acoustic_residual_vector_quantizer.encode(x)])
        return codes.transpose(0, 1)


# ------------------------------------------------------------------------------------------------------ model
class CodecEncoder(nn.Module):
    """Waveform at 24 kHz -> codes at 12.5 Hz. State-dict names = the official ones below `encoder.` (the
    official file also holds tensors this module does not use: `*.codebook.initialized`, `*.output_proj.weight`
    and the books past `valid_num_quantizers`)."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        self.downsample = None
        if cfg.frame_rate != cfg.encodec_frame_rate:
            k = 2 * int(cfg.encodec_frame_rate / cfg.frame_rate)
            self.downsample = CausalConv1d(cfg.hidden_size, cfg.hidden_size, k, stride=2, bias=False,
                                           pad_mode="replicate")
        self.quantizer = SplitResidualVQ(cfg)

    @property
    def samples_per_frame(self) -> int:
        return int(self.cfg.encode_downsample_rate)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, S] -> codes [B, valid_num_quantizers, ceil(S / 1920)] (the whole padded batch)."""
        h = self.encoder(wav[:, None])                                       # [B, D, T25]
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)      # [B, D, T25]
        if self.downsample is not None:
            h = self.downsample(h)                                           # [B, D, T12]
        return self.quantizer.encode(h)

    @torch.no_grad()
    def encode(self, wav: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """wav [B, S] float at 24 kHz, right-padded; lengths [B] valid samples -> list of codes [T_i, 16] (int64)
        with T_i = ceil(length_i / 1920), as the official batch encode: the batch is cut to the longest item and
        padded with zeros (what EncodecFeatureExtractor does), cast to the model dtype, encoded as a whole."""
        p = next(self.parameters())
        lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1).cpu()
        if wav.dim() != 2 or wav.shape[0] != lengths.numel():
            raise ValueError(f"wav must be [B, S] with B = len(lengths); got {tuple(wav.shape)} and {lengths.numel()}")
        if lengths.numel() == 0:
            return []
        if int(lengths.min()) < 1 or int(lengths.max()) > wav.shape[1]:
            raise ValueError("lengths must be within [1, wav.shape[1]]")
        S = int(lengths.max())
        wav = wav[:, :S].to(p.device, torch.float32)
        keep = torch.arange(S, device=p.device)[None, :] < lengths.to(p.device)[:, None]
        wav = torch.where(keep, wav, torch.zeros((), device=p.device)).to(p.dtype)
        codes = self(wav)                                                    # [B, 16, T]
        spf = self.samples_per_frame
        return [codes[i, :, : -(-n // spf)].T.contiguous() for i, n in enumerate(lengths.tolist())]

    def encode_one(self, wav: np.ndarray, sr: int) -> torch.Tensor:
        """A mono clip ([S], or [S, C] which is averaged over channels as the official) at any rate -> codes
        [T, 16], resampled to 24 kHz with librosa (soxr_hq) when sr differs, as the official wrapper."""
        from tts_engine.audio import resample

        wav = np.asarray(wav)
        if wav.ndim > 1:
            wav = np.mean(wav, axis=-1)
        wav = resample(wav.astype(np.float32), int(sr), self.cfg.sampling_rate).astype(np.float32)
        t = torch.from_numpy(np.ascontiguousarray(wav))[None]
        return self.encode(t, torch.tensor([t.shape[1]]))[0]
