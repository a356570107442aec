"""ECAPA-TDNN speaker encoder of the Base checkpoints: log-mel [B, T, 128] -> x-vector [B, enc_dim].

Names = official state-dict names below `speaker_encoder.`: blocks.0 (TDNN), blocks.1..3 (SE-Res2Net),
mfa, asp (attentive statistics pooling), fc. All convolutions are 'same' with reflect padding.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from .mel import SR, log_mel_spectrogram


@dataclass
class SpeakerEncoderConfig:
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: list = field(default_factory=lambda: [512, 512, 512, 512, 1536])
    enc_kernel_sizes: list = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SR

    @classmethod
    def from_dict(cls, d: dict) -> "SpeakerEncoderConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})


def _conv(c_in, c_out, k, dilation=1):
    return nn.Conv1d(c_in, c_out, k, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    def __init__(self, c_in, c_out, k, dilation):
        super().__init__()
        self.conv = _conv(c_in, c_out, k, dilation)

    def forward(self, x):
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    def __init__(self, channels, scale, k, dilation):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(channels // scale, channels // scale, k, dilation) for _ in range(scale - 1))

    def forward(self, x):
        outs, y = [], None
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            y = part if i == 0 else self.blocks[i - 1](part if i == 1 else part + y)
            outs.append(y)
        return torch.cat(outs, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, c, se):
        super().__init__()
        self.conv1 = _conv(c, se, 1)
        self.conv2 = _conv(se, c, 1)

    def forward(self, x):
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SERes2NetBlock(nn.Module):
    def __init__(self, c_in, c_out, scale, se, k, dilation):
        super().__init__()
        self.tdnn1 = TDNN(c_in, c_out, 1, 1)
        self.res2net_block = Res2Net(c_out, scale, k, dilation)
        self.tdnn2 = TDNN(c_out, c_out, 1, 1)
        self.se_block = SqueezeExcitation(c_out, se)

    def forward(self, x):
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatsPool(nn.Module):
    """Mean and std over time, weighted by a learned attention over [x, global mean, global std]."""

    def __init__(self, c, att):
        super().__init__()
        self.tdnn = TDNN(c * 3, att, 1, 1)
        self.conv = _conv(att, c, 1)

    @staticmethod
    def _stats(x, w):
        mean = (w * x).sum(2)
        std = torch.sqrt((w * (x - mean[..., None]).pow(2)).sum(2).clamp(1e-12))
        return mean, std

    def forward(self, x):  # [B, C, T] -> [B, 2C, 1]
        T = x.shape[-1]
        w = torch.full((x.shape[0], 1, T), 1.0 / T, dtype=x.dtype, device=x.device)
        mean, std = self._stats(x, w)
        a = torch.cat([x, mean[..., None].expand(-1, -1, T), std[..., None].expand(-1, -1, T)], dim=1)
        a = F.softmax(self.conv(torch.tanh(self.tdnn(a))), dim=2)
        mean, std = self._stats(x, a)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch, ks, ds = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks = [TDNN(cfg.mel_dim, ch[0], ks[0], ds[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], ds[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], ds[-1])
        self.asp = AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [B, T, 128] -> [B, enc_dim]."""
        x = mels.transpose(1, 2)
        outs = []
        for blk in self.blocks:
            x = blk(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x))[..., 0]

    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [S] or [B, S] at 24 kHz -> [enc_dim] / [B, enc_dim]; mel in fp32, network in its own dtype."""
        w = self.fc.weight
        single = wav.ndim == 1
        mels = log_mel_spectrogram((wav[None] if single else wav).to(w.device))
        out = self(mels.to(w.dtype))
        return out[0] if single else out
