"""ECAPA-TDNN speaker encoder of the Base checkpoints: log-mel [B, T, 128] -> x-vector [B, enc_dim].

Parameter names = the official state-dict names below `speaker_encoder.`: blocks.0 (TDNN), blocks.1..N-2
(SE-Res2Net), mfa (multi-layer feature aggregation), asp (attentive statistics pooling), fc. All convolutions
are 'same' with reflect padding, as in the official `Qwen3TTSSpeakerEncoder`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from tts_engine.errors import TTSError
from tts_engine.voices.mel import HOP, MIN_SAMPLES, SR, log_mel_spectrogram


@dataclass
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of a checkpoint's config.json; defaults = official `Qwen3TTSSpeakerEncoderConfig`."""
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: list = field(default_factory=lambda: [512, 512, 512, 512, 1536])
    enc_kernel_sizes: list = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SR

    def __post_init__(self):
        self.enc_channels = [int(c) for c in self.enc_channels]
        self.enc_kernel_sizes = [int(k) for k in self.enc_kernel_sizes]
        self.enc_dilations = [int(d) for d in self.enc_dilations]
        if not (len(self.enc_channels) == len(self.enc_kernel_sizes) == len(self.enc_dilations)):
            raise TTSError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations should have "
                           "the same length")
        if len(self.enc_channels) < 3 or sum(self.enc_channels[1:-1]) != self.enc_channels[-1]:
            raise TTSError("speaker_encoder_config: enc_channels must be [first TDNN, SE-Res2Net blocks..., "
                           "aggregation], the last entry being the sum of the SE-Res2Net channels "
                           "(e.g. [512, 512, 512, 512, 1536])")

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeakerEncoderConfig":
        """Unknown keys (model_type, transformers_version, ...) are ignored; missing keys take the defaults."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})


def _conv(c_in: int, c_out: int, k: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(c_in, c_out, k, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """Conv1d + ReLU (official TimeDelayNetBlock)."""

    def __init__(self, c_in: int, c_out: int, k: int, dilation: int):
        super().__init__()
        self.conv = _conv(c_in, c_out, k, dilation)

    def forward(self, x):
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Split channels into `scale` groups; group 0 passes through, group i>0 = TDNN(group_i + out_{i-1})."""

    def __init__(self, channels: int, scale: int, k: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(channels // scale, channels // scale, k, dilation) for _ in range(scale - 1))

    def forward(self, x):
        outs, y = [], None
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            if i == 0:
                y = part
            elif i == 1:
                y = self.blocks[0](part)
            else:
                y = self.blocks[i - 1](part + y)
            outs.append(y)
        return torch.cat(outs, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, c: int, se: int):
        super().__init__()
        self.conv1 = _conv(c, se, 1)
        self.conv2 = _conv(se, c, 1)

    def forward(self, x):
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SERes2NetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, scale: int, se: int, k: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(c_in, c_out, 1, 1)
        self.res2net_block = Res2Net(c_out, scale, k, dilation)
        self.tdnn2 = TDNN(c_out, c_out, 1, 1)
        self.se_block = SqueezeExcitation(c_out, se)

    def forward(self, x):
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatsPool(nn.Module):
    """Mean and std over time, weighted by a learned attention over [x, global mean, global std]."""

    eps = 1e-12

    def __init__(self, c: int, att: int):
        super().__init__()
        self.tdnn = TDNN(c * 3, att, 1, 1)
        self.conv = _conv(att, c, 1)

    def _stats(self, x, w):
        mean = (w * x).sum(2)
        std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(self.eps))
        return mean, std

    def forward(self, x):  # [B, C, T] -> [B, 2C, 1]
        B, _, T = x.shape
        # the official weights are mask / mask.sum() computed in x's dtype: 1 / round(T), rounded (matters in bf16)
        w = (x.new_ones(B, 1, 1) / x.new_full((B, 1, 1), T)).expand(B, 1, T)
        mean, std = self._stats(x, w)
        a = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, T), std.unsqueeze(2).expand(-1, -1, T)], dim=1)
        a = F.softmax(self.conv(torch.tanh(self.tdnn(a))), dim=2)
        mean, std = self._stats(x, a)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig | None = None):
        super().__init__()
        cfg = cfg or SpeakerEncoderConfig()
        self.cfg = cfg
        ch, ks, ds = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks: list[nn.Module] = [TDNN(cfg.mel_dim, ch[0], ks[0], ds[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], ds[i]))
        self.blocks = nn.ModuleList(blocks)
        # the official layer is declared with ch[-1] inputs; it is fed the concatenation of the SE-Res2Net outputs
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], ds[-1])
        self.asp = AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim, 1)
        # 'same' reflect padding needs more frames than the widest one-sided pad
        self.min_frames = 1 + max(d * (k - 1) - (d * (k - 1)) // 2 for k, d in zip(ks, ds))

    @property
    def sample_rate(self) -> int:
        return int(self.cfg.sample_rate)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [B, T, mel_dim] -> [B, enc_dim]."""
        if mels.ndim != 3 or mels.shape[-1] != self.cfg.mel_dim:
            raise TTSError(f"expected mels of shape [batch, frames, {self.cfg.mel_dim}], got {tuple(mels.shape)}")
        if mels.shape[1] < self.min_frames:
            raise TTSError(f"the audio is too short for the speaker encoder ({mels.shape[1]} mel frames; "
                           f"at least {self.min_frames} are needed)")
        x = mels.transpose(1, 2)
        outs = []
        for blk in self.blocks:
            x = blk(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)

    def min_samples(self) -> int:
        """Shortest 24 kHz clip `embed` accepts."""
        return max(MIN_SAMPLES, HOP * self.min_frames)   # num_frames(S) = (S - 256) // 256 + 1

    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [S] or [B, S] at the encoder's rate (24 kHz) -> [enc_dim] / [B, enc_dim].

        Like the official `extract_speaker_embedding`: the mel is computed in fp32, then cast to the module's
        dtype for the network. The result has the module's dtype and device."""
        if wav.ndim not in (1, 2):
            raise TTSError(f"expected a waveform of shape [samples] or [batch, samples], got {tuple(wav.shape)}")
        w = self.fc.weight
        single = wav.ndim == 1
        wav = (wav[None] if single else wav).to(device=w.device, dtype=torch.float32)
        if not bool(torch.isfinite(wav).all()):
            raise TTSError("the audio contains invalid (NaN or infinite) samples")
        out = self(log_mel_spectrogram(wav).to(w.dtype))
        return out[0] if single else out
