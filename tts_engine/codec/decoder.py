"""The 12 Hz speech-tokenizer decoder: codes [B, 16, T] -> waveform [B, T * 1920] at 24 kHz.

A plain-PyTorch re-implementation of the official `Qwen3TTSTokenizerV2Decoder` (qwen-tts 0.1.1). Parameter
names are the official state-dict names with the leading `decoder.` removed, so official tensors load with
`load_state_dict(strict=True)`.

Pipeline (C = channels, n = frames of this call; 1 frame = 1920 samples):
  quantizer        split RVQ: book 0 and books 1..15, each group summed and projected   [B, codebook_dim, n]
  pre_conv         causal conv k=3                                                      [B, latent_dim, n]
  pre_transformer  input_proj, L x (RMSNorm, RoPE MHA with a sliding window of 72 keys, LayerScale;
                   RMSNorm, SiLU-GLU, LayerScale), norm, output_proj                    [B, latent_dim, n]
  upsample         2 x (ConvTranspose k=s=2, ConvNeXt block with causal depthwise k=7)  [B, latent_dim, 4n]
  decoder          conv k7 -> decoder_dim; 4 x [SnakeBeta, ConvTranspose(k=2r, s=r, right-trim r),
                   3 residual units (dilation 1, 3, 9)] for r = 8, 5, 4, 3; SnakeBeta, conv k7 -> 1 channel
                   clamp to [-1, 1]                                                     [B, 1, 1920n]

Everything is causal without look-ahead, so the decoder is written once, as a *stateful step*
(`decode_step`): each causal conv keeps its last (k-1)*dilation input samples, each overlapping transposed
conv its last input sample, the transformer the last `sliding_window - 1` keys/values of every layer (after
RoPE) and each row's absolute frame position. `forward` is that step from an empty state, so decoding in any
split of the frames equals the one-shot decode up to float rounding (not a windowed approximation).
`chunked_decode` reproduces the official offline decode (chunks of 300 frames, 25 frames of left context,
each chunk restarting at position 0), which is *not* equal to the one-shot decode beyond 300 frames.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from tts_engine.errors import TTSError
from tts_engine.model.layers import RMSNorm, rotate_half  # the same Qwen-style norm and RoPE rotation as the talker

__all__ = ["CodecDecoderConfig", "CodecDecoder", "CodecDecoderState"]

# The CPU kernels of conv modes "packed" and "int8" (`CodecDecoder.set_conv_mode`): an object with `PackedConv`,
# `Int8Conv` (classes built per conv: weight, bias, dilation, groups, max length) and `snake(x, exp_alpha, inv_beta)`
# (the fused activation, None where it cannot run). Set when tts_engine.cpu is imported
# (`tts_engine.cpu.backend.set_hooks`; the mode is chosen by measuring, cpu/codec_dtype.py): the codec's only
# way to the CPU package.
cpu_kernels = None


@dataclass
class CodecDecoderConfig:
    """`decoder_config` of `speech_tokenizer/config.json`. Defaults are those of the official
    `Qwen3TTSTokenizerV2DecoderConfig` (the released checkpoints set hidden_size 512, intermediate_size 1024,
    codebook_dim 512, head_dim 64). `codebook_dim` has no official default; 512 is the released value."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 1024
    latent_dim: int = 1024
    max_position_embeddings: int = 8000      # unused (plain RoPE has no table)
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None              # None: hidden_size // num_attention_heads (official fallback)
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple = (8, 5, 4, 3)
    upsampling_ratios: tuple = (2, 2)
    decoder_dim: int = 1536
    attention_dropout: float = 0.0           # unused (inference)

    def __post_init__(self):
        self.upsample_rates = tuple(int(r) for r in self.upsample_rates)
        self.upsampling_ratios = tuple(int(r) for r in self.upsampling_ratios)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "CodecDecoderConfig":
        """Build from a config dict; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})

    @property
    def total_upsample(self) -> int:
        """Waveform samples per code frame (1920 for the released codec)."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


_ACT = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


# --- convolutions that ignore the process-wide oneDNN switch ----------------------------------------------------
_MKLDNN = torch.backends.mkldnn.is_available()
# oneDNN's bf16 convolutions need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU torch's
# mkldnn_convolution raises for bf16 ("bf16 path needs the cpu support ..."; seen under QEMU -cpu Haswell), so
# bf16 inputs take aten's generic path there
_MKLDNN_BF16 = _MKLDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _direct(x: torch.Tensor) -> bool:
    """On a CPU with oneDNN, the decoder's convolutions call oneDNN directly: `torch._C._set_mkldnn_enabled`
    is process-wide, and the engine turns it off around small bf16 matrix-vector steps (model_runner's
    `aten_bf16_gemv`). A decode running on another thread meanwhile (`overlap_codec`) would then take aten's
    fallback kernels, measured 5x (depthwise) to 150-200x (bf16 conv and matmul) slower on a Zen 4. bf16 only
    where oneDNN has bf16 kernels (`_MKLDNN_BF16`)."""
    if not _MKLDNN or x.device.type != "cpu":
        return False
    return x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _MKLDNN_BF16)


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1,
           groups: int = 1) -> torch.Tensor:
    """F.conv1d without padding or stride (x [B, C_in, L] -> [B, C_out, L - (k-1)*dilation])."""
    if _direct(x):
        return torch.ops.aten.mkldnn_convolution(x.contiguous(), weight, bias, [0], [1], [dilation], groups)
    return F.conv1d(x, weight, bias, dilation=dilation, groups=groups)


# --- packed (reordered once) oneDNN convolutions, channels-last; chosen by measuring (dtype_choice) --------------
PACKED_MAX_FRAMES = 16   # chunks up to this many frames take the packed path; longer inputs (offline decodes) aten's


class _Packable:
    """Mixin of the stateful convs: `packed` (set by `CodecDecoder.set_conv_mode`) says whether this conv runs
    through `packed_conv.PackedConv` (weights reordered once per input shape, activations channels-last) instead
    of `conv1d`. `up` is this conv's input samples per code frame (set by the decoder), for the length limit."""

    packed = False
    int8 = False   # (with `packed`) this conv runs through `int8_conv.Int8Conv` (set_conv_mode("int8"))
    int8_min_positions = None   # its int8 calls from this many output positions per row (None: MIN_POSITIONS)
    up = 1

    def _packer(self, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int, groups: int, ctx: int):
        key = (weight.data_ptr(), _version(weight), weight.dtype, None if bias is None else _version(bias))
        slot = "_pk8" if self.int8 else "_pk"   # (both kept: switching modes while timing them must not repack)
        pk = getattr(self, slot, None)
        if pk is None or pk[0] != key:
            conv = cpu_kernels.Int8Conv if self.int8 else cpu_kernels.PackedConv
            pk = (key, conv(weight, bias, dilation, groups, PACKED_MAX_FRAMES * self.up + ctx))
            setattr(self, slot, pk)
        if self.int8:
            pk[1].min_positions = self.int8_min_positions   # (measured per conv: `int8_threshold`)
        return pk[1]


def _cat_time(hist: torch.Tensor, x: torch.Tensor, time_major: bool) -> torch.Tensor:
    """[B, C, a] + [B, C, b] -> [B, C, a + b]; time-major in memory (channels-last) when `time_major`."""
    if time_major:
        return torch.cat([hist.transpose(1, 2), x.transpose(1, 2)], dim=1).transpose(1, 2)
    return torch.cat([hist, x], dim=-1)


# --- streaming building blocks ----------------------------------------------------------------------------
# A stateful module has `ctx` (history length, static) and `step(x, hist) -> (y, new_hist)`:
#   x [B, C_in, n] new input, hist [B, C_in, ctx] the inputs before it (zeros in an empty state, which is
#   exactly the official left zero-padding), y the output for these n inputs, new_hist [B, C_in, ctx].

class CausalConv(_Packable, nn.Module):
    """Official `Qwen3TTSTokenizerV2CausalConvNet` with stride 1: left zero padding of (k-1)*dilation and no
    right padding (the official "extra padding" is 0 for stride 1). Params: conv.{weight,bias}."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, groups=groups)
        self.c_in = c_in
        self.ctx = (kernel_size - 1) * dilation

    def run(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """conv(x) (+ add); stride 1, no padding (callers carry the history)."""
        c = self.conv
        if self.packed and _direct(x):
            y = self._packer(c.weight, c.bias, c.dilation[0], c.groups, self.ctx)(x, add)
            if y is not None:
                return y
        y = conv1d(x, c.weight, c.bias, c.dilation[0], c.groups)
        return y if add is None else add + y

    def step(self, x: torch.Tensor, hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ctx == 0:
            return self.run(x), hist
        xx = _cat_time(hist, x, self.packed)                    # [B, C_in, ctx + n]
        return self.run(xx), xx[..., xx.shape[-1] - self.ctx:]      # [B, C_out, n], [B, C_in, ctx]


class CausalTransConv(_Packable, nn.Module):
    """Official `Qwen3TTSTokenizerV2CausalTransConvNet`: ConvTranspose1d(k, stride s), then the last k - s
    outputs are trimmed (right only), so n inputs give n*s outputs. Output block j (samples [j*s, (j+1)*s))
    depends on inputs j and, when k > s, j-1 (k <= 2s), so the history is the previous input sample.
    Params: conv.{weight,bias} (weight [C_in, C_out, k]).

    The step is one matrix product of the inputs with the weight viewed as [C_in, C_out*k] (every input's
    contribution to its k output taps), then the overlap-add of neighbouring blocks: block j = taps 0..s-1 of
    input j + taps s..k-1 of input j-1 + bias. aten's ConvTranspose1d takes a slow im2col path on CPU that
    costs ~5-25x this product on the few frames of a streaming chunk (and less than it on long inputs, so inputs
    longer than MATMUL_MAX_LEN per row still use it); the two equal each other up to float rounding. On a CPU
    with oneDNN (`_direct`) the product is a 1x1 convolution with C_out*k output channels (the weight
    rearranged once, cached like the codebooks), at every length: oneDNN directly, whatever the process-wide
    switch says."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int):
        super().__init__()
        if not stride <= kernel_size <= 2 * stride:
            raise ValueError("CausalTransConv supports stride <= kernel_size <= 2 * stride")
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel_size, stride=stride)
        self.c_in, self.c_out, self.k, self.s = c_in, c_out, kernel_size, stride
        self.ctx = 1 if kernel_size > stride else 0
        self._taps: tuple | None = None   # (key, [C_out*k, C_in, 1] weight); not a buffer, not in state_dict

    def tap_weight(self) -> torch.Tensor:
        w = self.conv.weight
        key = (w.data_ptr(), _version(w), w.dtype, w.device)
        taps = self._taps
        if taps is None or taps[0] != key:
            with torch.no_grad():
                taps = (key, w.detach().permute(1, 2, 0).reshape(self.c_out * self.k, self.c_in, 1).contiguous())
            self._taps = taps
        return taps[1]

    def tap_bias(self) -> torch.Tensor:
        """[C_out*k] bias for the packed tap conv: the conv's bias on taps 0..s-1 of each channel, 0 on the rest."""
        b = self.conv.bias
        key = (b.data_ptr(), _version(b), b.dtype, b.device)
        tb = getattr(self, "_tap_bias", None)
        if tb is None or tb[0] != key:
            with torch.no_grad():
                t = torch.zeros(self.c_out, self.k, dtype=b.dtype, device=b.device)
                t[:, :self.s] = b.detach()[:, None]
            tb = self._tap_bias = (key, t.reshape(-1))
        return tb[1]

    def _load_from_state_dict(self, *args, **kwargs):
        self._taps = None
        self._tap_bias = None
        super()._load_from_state_dict(*args, **kwargs)

    MATMUL_MAX_LEN = 32   # inputs per row up to which the matmul form is used (measured faster below, slower above)

    def step(self, x: torch.Tensor, hist: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, _, n = x.shape
        k, s, w = self.k, self.s, self.conv.weight
        xx = x if self.ctx == 0 else _cat_time(hist, x, self.packed)             # [B, C_in, m]
        new_hist = x[..., n - 1:] if self.ctx else hist
        if self.packed and _direct(xx):   # the taps' 1x1 conv time-major: [B, m, C_out*k] in memory
            pk = self._packer(self.tap_weight(), None, 1, 1, self.ctx)
            pk.bias = self.tap_bias()                # the bias on taps 0..s-1 (each output sample gets it once)
            taps = pk(xx)
            if taps is not None:
                m = xx.shape[-1]
                taps = taps.transpose(1, 2).view(B, m, self.c_out, k)                # [B, m, C_out, k]
                out = torch.empty(B, n, s, self.c_out, dtype=taps.dtype, device=taps.device)
                head = taps[:, self.ctx:, :, :s].transpose(2, 3)                   # [B, n, s, C_out]
                if self.ctx and k == 2 * s:                                        # + the previous input's tail
                    torch.add(head, taps[:, :n, :, s:].transpose(2, 3), out=out)
                elif self.ctx:
                    out.copy_(head + F.pad(taps[:, :n, :, s:], (0, 2 * s - k)).transpose(2, 3))
                else:
                    out.copy_(head)
                return out.view(B, n * s, self.c_out).transpose(1, 2), new_hist
        if _direct(xx):
            taps = conv1d(xx, self.tap_weight(), None).view(B, self.c_out, k, xx.shape[-1])  # [B, C_out, k, m]
            y = taps[:, :, :s, self.ctx:]                                          # [B, C_out, s, n]
            if self.ctx:                                                           # + the previous input's tail
                y = y + F.pad(taps[:, :, s:, :n], (0, 0, 0, 2 * s - k))
            y = y + self.conv.bias[:, None, None]
            return y.transpose(2, 3).reshape(B, self.c_out, n * s), new_hist
        if n > self.MATMUL_MAX_LEN:                                                # long inputs: aten's op
            return self.conv(xx)[..., self.ctx * s: self.ctx * s + n * s], (x[..., n - 1:] if self.ctx else hist)
        taps = torch.matmul(xx.transpose(1, 2), w.view(self.c_in, self.c_out * k))  # [B, m, C_out*k]
        taps = taps.view(B, xx.shape[-1], self.c_out, k)
        y = taps[:, self.ctx:, :, :s]                                              # [B, n, C_out, s]
        if self.ctx:                                                               # + the previous input's tail
            y = y + F.pad(taps[:, :n, :, s:], (0, 2 * s - k))
        y = y + self.conv.bias[:, None]
        return y.permute(0, 2, 1, 3).reshape(B, self.c_out, n * s), (x[..., n - 1:] if self.ctx else hist)


class SnakeBeta(nn.Module):
    """x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel; x [B, C, n]. Params: alpha, beta [C]."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    fused = False   # set by CodecDecoder.set_conv_mode("packed"): one pass through cpu_kernels.snake where it runs

    def _params32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """exp(alpha), 1 / (exp(beta) + 1e-9) in fp32 [C], cached on the parameters' versions."""
        key = (self.alpha.data_ptr(), _version(self.alpha), self.beta.data_ptr(), _version(self.beta))
        c = getattr(self, "_p32", None)
        if c is None or c[0] != key:
            with torch.no_grad():
                a = torch.exp(self.alpha.detach().float()).contiguous()
                ib = (1.0 / (torch.exp(self.beta.detach().float()) + 1e-9)).contiguous()
            c = self._p32 = (key, a, ib)
        return c[1], c[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.device.type == "cpu":
            y = cpu_kernels.snake(x, *self._params32())
            if y is not None:
                return y
        alpha = torch.exp(self.alpha[None, :, None])
        beta = torch.exp(self.beta[None, :, None])
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k=7, LayerNorm, Linear 4x, GELU (erf), Linear, gamma, residual. x [B, C, n]."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def step(self, x: torch.Tensor, hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, hist = self.dwconv.step(x, hist)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h.permute(0, 2, 1)))))   # [B, n, C]
        return x + (self.gamma * h).permute(0, 2, 1), hist


class ResidualUnit(nn.Module):
    """x + conv2_k1(snake(conv1_k7_dilated(snake(x)))); the history is conv1's."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def step(self, x: torch.Tensor, hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, hist = self.conv1.step(self.act1(x), hist)
        if self.conv2.packed:   # the residual sum inside the conv's call
            return self.conv2.run(self.act2(h), add=x), hist
        return x + self.conv2.run(self.act2(h)), hist


class DecoderBlock(nn.Module):
    """block.0 SnakeBeta(c_in), block.1 CausalTransConv(c_in -> c_out, k=2r, s=r), block.2-4 residual units."""

    def __init__(self, c_in: int, c_out: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(c_in), CausalTransConv(c_in, c_out, 2 * rate, rate),
                                    ResidualUnit(c_out, 1), ResidualUnit(c_out, 3), ResidualUnit(c_out, 9)])


# --- quantizer ------------------------------------------------------------------------------------------
class EuclideanCodebook(nn.Module):
    """Codebook vectors are embedding_sum / clamp(cluster_usage, 1e-5). A fresh module has usage 1 and
    N(0, 1) sums, so a randomly initialised decoder makes audible noise."""

    def __init__(self, dim: int, size: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.randn(size, dim))


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, size)


class ResidualVectorQuantization(nn.Module):
    def __init__(self, n: int, dim: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(dim, size) for _ in range(n))


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:          # inference tensors have no version counter
        return -1


class ResidualVectorQuantizer(nn.Module):
    """One RVQ group: input_proj (encoder side, unused here), n codebooks, output_proj (1x1 conv, no bias)."""

    def __init__(self, n: int, dim: int, io_dim: int, size: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = ResidualVectorQuantization(n, dim, size)
        self._books: tuple | None = None            # (key, [n, size, dim]); not a buffer, not in state_dict

    def _key(self) -> tuple:
        params = [p for layer in self.vq.layers for p in (layer._codebook.embedding_sum, layer._codebook.cluster_usage)]
        return tuple((p.data_ptr(), _version(p), p.device, p.dtype) for p in params)

    def codebooks(self) -> torch.Tensor:
        """[n, size, dim] codebook vectors, computed once in the parameters' dtype (as the official) and cached.
        The cache is keyed on the parameters' storage, version counter, device and dtype, so loading, `.to()`
        and in-place edits all invalidate it; `refresh()` forces a rebuild."""
        key = self._key()
        if self._books is None or self._books[0] != key:
            with torch.no_grad():
                books = torch.stack([layer._codebook.embedding_sum /
                                     layer._codebook.cluster_usage.clamp(min=1e-5)[:, None]
                                     for layer in self.vq.layers])
            self._books = (key, books)
        return self._books[1]

    def refresh(self) -> None:
        self._books = None
        self.codebooks()

    def _load_from_state_dict(self, *args, **kwargs):
        self._books = None
        super()._load_from_state_dict(*args, **kwargs)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, T] -> [B, io_dim, T]; books summed in order (as the official), then output_proj."""
        books = self.codebooks()
        q = F.embedding(codes[:, 0], books[0])                   # [B, T, dim]
        for i in range(1, codes.shape[1]):
            q = q + F.embedding(codes[:, i], books[i])
        return conv1d(q.transpose(1, 2), self.output_proj.weight, None)


class SplitResidualVectorQuantizer(nn.Module):
    """rvq_first: book 0 (semantic); rvq_rest: books 1..num_quantizers-1. Both use `codebook_size` entries of
    dim codebook_dim // 2 and project to codebook_dim; the two projections are added."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualVectorQuantizer(1, dim, cfg.codebook_dim, cfg.codebook_size)
        self.rvq_rest = ResidualVectorQuantizer(cfg.num_quantizers - 1, dim, cfg.codebook_dim, cfg.codebook_size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, 16, T] -> [B, codebook_dim, T]."""
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# --- transformer ----------------------------------------------------------------------------------------
class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Attention(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=b)


class Mlp(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)


class PreTransformer(nn.Module):
    """Sliding-window transformer. The official mask (transformers `sliding_window_overlay`) lets the query
    at position p see keys at positions p-71 .. p: `sliding_window` = 72 keys *including itself*, so the
    state keeps W1 = sliding_window - 1 past keys per layer."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def _rope(self, qpos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """qpos [B, n] absolute positions -> cos, sin [B, 1, n, head_dim]; computed in fp32 (like the
        official: inv_freq in fp32, positions as fp32), then cast to the activations' dtype."""
        hd = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (
            torch.arange(0, hd, 2, dtype=torch.int64, device=qpos.device).float() / hd))   # [hd/2]
        freqs = qpos.float()[..., None] * inv_freq                                        # [B, n, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def step(self, x: torch.Tensor, pos: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor):
        """x [B, n, latent]; pos [B] (long) absolute position of x[:, 0] per row;
        k_hist, v_hist [L, B, Hkv, W1, hd]: slot i of row b holds the key/value (after RoPE) of position
        pos[b] - W1 + i (garbage, and masked, where that position is < 0).
        Returns y [B, n, latent], new k_hist, new v_hist (same shapes as the inputs)."""
        cfg = self.cfg
        B, n, _ = x.shape
        W1 = k_hist.shape[3]
        dev = x.device
        h = self.input_proj(x)                                                           # [B, n, hidden]
        qpos = pos[:, None] + torch.arange(n, device=dev)                                # [B, n]
        kpos = torch.cat([pos[:, None] - W1 + torch.arange(W1, device=dev), qpos], 1)   # [B, W1 + n]
        d = qpos[:, :, None] - kpos[:, None, :]                                          # [B, n, W1 + n]
        mask = ((d >= 0) & (d < cfg.sliding_window) & (kpos[:, None, :] >= 0))[:, None]  # [B, 1, n, W1 + n]
        cos, sin = self._rope(qpos, h.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            r = layer.input_layernorm(h)
            q = a.q_proj(r).view(B, n, a.h, a.hd).transpose(1, 2)                       # [B, H, n, hd]
            k = a.k_proj(r).view(B, n, a.hkv, a.hd).transpose(1, 2)                     # [B, Hkv, n, hd]
            v = a.v_proj(r).view(B, n, a.hkv, a.hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            kk = torch.cat([k_hist[i], k], dim=2)                                       # [B, Hkv, W1 + n, hd]
            vv = torch.cat([v_hist[i], v], dim=2)
            new_k.append(kk[:, :, n:])                                                   # last W1 positions
            new_v.append(vv[:, :, n:])
            if a.h != a.hkv:
                kk = kk.repeat_interleave(a.h // a.hkv, dim=1)
                vv = vv.repeat_interleave(a.h // a.hkv, dim=1)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=a.hd ** -0.5)
            o = a.o_proj(o.transpose(1, 2).reshape(B, n, a.h * a.hd))
            h = h + layer.self_attn_layer_scale(o)
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
        return self.output_proj(self.norm(h)), torch.stack(new_k), torch.stack(new_v)


# --- streaming state --------------------------------------------------------------------------------------
@dataclass
class CodecDecoderState:
    """Streaming state of B independent rows (each row its own stream and position).

    convs  list of [B, C_in, ctx] input histories, one per stateful conv in `CodecDecoder.stateful_modules()`
           order (causal convs: ctx = (k-1)*dilation; overlapping transposed convs: ctx = 1)
    k, v   [L, B, Hkv, sliding_window - 1, head_dim] last keys/values per layer, after RoPE, oldest first
    pos    [B] int64 frames decoded so far per row (the RoPE position of the row's next frame)

    All shapes are fixed for a given batch size; `decode_step` replaces every field by a tensor of the same
    shape. Rows can be dropped / reordered (`select`) and states of different streams joined (`concat`)."""

    convs: list
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    def select(self, rows) -> "CodecDecoderState":
        """A new state with the given rows (LongTensor or list of indices, any order); copies."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.pos.device)
        return CodecDecoderState([c.index_select(0, rows) for c in self.convs], self.k.index_select(1, rows),
                                 self.v.index_select(1, rows), self.pos.index_select(0, rows))

    @staticmethod
    def concat(states: list["CodecDecoderState"]) -> "CodecDecoderState":
        """Rows of all states, in order (a new state; the inputs are not modified)."""
        return CodecDecoderState([torch.cat(cs, 0) for cs in zip(*[s.convs for s in states])],
                                 torch.cat([s.k for s in states], 1), torch.cat([s.v for s in states], 1),
                                 torch.cat([s.pos for s in states], 0))

    def clone(self) -> "CodecDecoderState":
        return CodecDecoderState([c.clone() for c in self.convs], self.k.clone(), self.v.clone(), self.pos.clone())


# --- the decoder ------------------------------------------------------------------------------------------
class CodecDecoder(nn.Module):
    """Official `Qwen3TTSTokenizerV2Decoder` (state-dict names without `decoder.`), with exact streaming."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.total_upsample = cfg.total_upsample
        self.quantizer = SplitResidualVectorQuantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(cfg.latent_dim, cfg.latent_dim, f, f), ConvNeXtBlock(cfg.latent_dim)])
            for f in cfg.upsampling_ratios)
        dec: list[nn.Module] = [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
        for i, r in enumerate(cfg.upsample_rates):
            dec.append(DecoderBlock(cfg.decoder_dim // 2 ** i, cfg.decoder_dim // 2 ** (i + 1), r))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        dec += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(dec)
        self._stateful = self.stateful_modules()
        self._init_random()

    def _init_random(self) -> None:
        """A fresh decoder (saved by make-tiny) must make finite, audible audio: codebooks N(0,1) with usage 1
        (set in EuclideanCodebook), SnakeBeta alpha/beta small random instead of 0, LayerScale at its
        configured init, torch's default Linear/Conv init elsewhere."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, SnakeBeta) and not m.alpha.is_meta:
                    m.alpha.uniform_(-0.1, 0.1)
                    m.beta.uniform_(-0.1, 0.1)

    def stateful_modules(self) -> list[nn.Module]:
        """Modules with an input history, in the order of `CodecDecoderState.convs`."""
        mods: list[nn.Module] = [self.pre_conv]
        for up in self.upsample:
            mods += [m for m in (up[0], up[1].dwconv) if m.ctx > 0]
        mods.append(self.decoder[0])
        for blk in self.decoder[1:1 + len(self.cfg.upsample_rates)]:
            mods += [m for m in (blk.block[1], blk.block[2].conv1, blk.block[3].conv1, blk.block[4].conv1) if m.ctx > 0]
        mods.append(self.decoder[-1])
        return mods

    conv_mode = "aten"
    CONV_MODES = ("aten", "packed", "int8")

    def set_conv_mode(self, mode: str) -> None:
        """"aten" (default; the parity-tested path): each conv calls oneDNN (or aten) with its plain weight.
        "packed": the stateful convs run through `packed_conv.PackedConv` (weights reordered once per input
        shape, activations channels-last) on chunks of up to PACKED_MAX_FRAMES frames, and the SnakeBeta
        activations in one fused pass (`cpu_kernels.snake`, where our CPU kernels build); equal to "aten" up to
        float rounding (the accumulation order differs; the snake is computed in fp32, rounded once).
        "int8": "packed", and the convs of `int8_convs` in int8 (`int8_conv.Int8Conv`: int8 weights, inputs
        quantised to uint8 per call): lossy, measured against fp32 (`codec.quality`) before it may be chosen.
        Chosen by measuring them (`dtype_choice`)."""
        if mode not in self.CONV_MODES:
            raise ValueError(f"conv mode must be one of {', '.join(self.CONV_MODES)}")
        on = mode in ("packed", "int8")
        if on and cpu_kernels is None:
            raise TTSError(f"conv mode {mode!r} needs the CPU package's kernels: import tts_engine.cpu first")
        up = 1                                                  # input samples per frame at each conv
        self.pre_conv.packed, self.pre_conv.up = on, up
        for tc, blk in self.upsample:
            tc.packed, tc.up = on, up
            up *= tc.s
            blk.dwconv.packed, blk.dwconv.up = on, up
        self.decoder[0].packed, self.decoder[0].up = on, up
        for blk in self.decoder[1:1 + len(self.cfg.upsample_rates)]:
            tc = blk.block[1]
            tc.packed, tc.up = on, up
            up *= tc.s
            for ru in blk.block[2:]:
                for c in (ru.conv1, ru.conv2):
                    c.packed, c.up = on, up
        self.decoder[-1].packed, self.decoder[-1].up = on, up
        for m in self.modules():
            if isinstance(m, SnakeBeta):
                m.fused = on
            if isinstance(m, _Packable):
                m.int8 = False
        if mode == "int8":
            for m in self.int8_convs():
                m.int8 = True
        self.conv_mode = mode

    def int8_convs(self) -> list[nn.Module]:
        """The convs that conv mode "int8" runs in int8: the decoder's first conv and, in every decoder block, the
        transposed conv and the residual units' convs (~90 % of the decoder's multiply-adds). The pre-transformer,
        the upsampling stages and the last conv (1 output channel) keep the model's dtype."""
        mods: list[nn.Module] = [self.decoder[0]]
        for blk in self.decoder[1:1 + len(self.cfg.upsample_rates)]:
            mods.append(blk.block[1])
            for ru in blk.block[2:]:
                mods += [ru.conv1, ru.conv2]
        return mods

    def release_packed(self) -> None:
        """Drop the convs' reordered weights (they are made again on the next packed decode)."""
        for m in self.modules():
            for slot in ("_pk", "_pk8"):
                if getattr(m, slot, None) is not None:
                    setattr(m, slot, None)

    def release_unused(self) -> None:
        """Drop the reordered weights the current conv mode does not use (all of them on the aten path; the int8
        copies in "packed" mode; the bf16/fp32 copies of the int8 convs in "int8" mode)."""
        if self.conv_mode == "aten":
            self.release_packed()
            return
        for m in self.modules():
            if isinstance(m, _Packable):
                slot = "_pk" if m.int8 else "_pk8"
                if getattr(m, slot, None) is not None:
                    setattr(m, slot, None)

    def refresh_codebooks(self) -> None:
        """Recompute the cached codebook vectors (automatic after load / .to() / in-place edits)."""
        self.quantizer.rvq_first.refresh()
        self.quantizer.rvq_rest.refresh()

    def init_state(self, batch_size: int, device=None, dtype=None) -> CodecDecoderState:
        """Empty state (no frames decoded) for `batch_size` rows; device/dtype default to the weights'."""
        p = self.pre_conv.conv.weight
        device = p.device if device is None else torch.device(device)
        dtype = p.dtype if dtype is None else dtype
        c = self.cfg
        convs = [torch.zeros(batch_size, m.c_in, m.ctx, device=device, dtype=dtype) for m in self._stateful]
        kv_shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, c.sliding_window - 1, c.head_dim)
        return CodecDecoderState(convs, torch.zeros(kv_shape, device=device, dtype=dtype),
                                 torch.zeros(kv_shape, device=device, dtype=dtype),
                                 torch.zeros(batch_size, dtype=torch.long, device=device))

    fast_step = None   # a device's fast path for `decode_step` (on CUDA: `tts_engine.gpu.codec_graph`), where attached

    def decode_step(self, codes: torch.Tensor, state: CodecDecoderState) -> torch.Tensor:
        """codes [B, 16, n] (int64, 0 <= code < codebook_size, n >= 1) -> waveform [B, n * 1920], clamped to
        [-1, 1]. Continues each row of `state` and advances it (its fields are replaced by new tensors of the
        same shapes, only after the whole step succeeded). Served by `fast_step` where a device attached one (it
        falls back to `decode_step_eager`, the readable reference, by itself)."""
        if self.fast_step is not None:
            return self.fast_step(codes, state)
        return self.decode_step_eager(codes, state)

    @torch.no_grad()
    def decode_step_eager(self, codes: torch.Tensor, state: CodecDecoderState) -> torch.Tensor:
        """`decode_step` in plain PyTorch, op by op."""
        if codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"Expected {self.cfg.num_quantizers} layer of codes, got {codes.shape[1]}")
        B, _, n = codes.shape
        hists = state.convs
        new_hists: list[torch.Tensor] = []

        def run(mod, x):  # a module with history number len(new_hists)
            y, h = mod.step(x, hists[len(new_hists)])
            new_hists.append(h)
            return y

        x = run(self.pre_conv, self.quantizer.decode(codes))                            # [B, latent, n]
        y, k, v = self.pre_transformer.step(x.transpose(1, 2), state.pos, state.k, state.v)
        x = y.transpose(1, 2)                                                            # [B, latent, n]
        for up in self.upsample:                                                         # x2 each
            x = run(up[0], x) if up[0].ctx else up[0].step(x, None)[0]
            x = run(up[1], x)
        x = run(self.decoder[0], x)                                                      # [B, decoder_dim, 4n]
        for blk in self.decoder[1:1 + len(self.cfg.upsample_rates)]:                     # x8, x5, x4, x3
            x = blk.block[0](x)
            x = run(blk.block[1], x) if blk.block[1].ctx else blk.block[1].step(x, None)[0]
            for ru in blk.block[2:]:
                x = run(ru, x)
        wav = run(self.decoder[-1], self.decoder[-2](x))                                 # [B, 1, n * 1920]
        assert len(new_hists) == len(hists)
        state.convs, state.k, state.v, state.pos = new_hists, k, v, state.pos + n
        return wav.clamp(min=-1, max=1)[:, 0]

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """One-shot causal decode, no chunking: codes [B, 16, T] -> [B, T * 1920] (the official
        `Qwen3TTSTokenizerV2Decoder.forward`, squeezed)."""
        return self.decode_step(codes, self.init_state(codes.shape[0], codes.device))

    @torch.no_grad()
    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300, left_context_size: int = 25) -> torch.Tensor:
        """The official offline decode: codes [B, 16, T] -> [B, T * 1920]. Chunks of `chunk_size` frames, each
        decoded from scratch (positions from 0) with up to `left_context_size` preceding frames whose audio is
        dropped. Equal to `forward` for T <= chunk_size."""
        wavs, start, T = [], 0, codes.shape[-1]
        while start < T:
            end = min(start + chunk_size, T)
            ctx = left_context_size if start - left_context_size > 0 else start
            wavs.append(self(codes[..., start - ctx:end])[..., ctx * self.total_upsample:])
            start = end
        return torch.cat(wavs, dim=-1)
