"""Log-mel front-end of the speaker encoder (official `mel_spectrogram` recipe, 24 kHz):
n_fft 1024, hop 256, Hann window 1024, 128 slaney mels (librosa), fmin 0, fmax 12000, reflect pad 384 on
both sides and center=False, magnitude sqrt(re^2 + im^2 + 1e-9), log(clamp(., 1e-5)). Always fp32."""
from __future__ import annotations

import functools

import torch

N_FFT, HOP, WIN, N_MELS, SR, FMIN, FMAX = 1024, 256, 1024, 128, 24000, 0, 12000


@functools.lru_cache(maxsize=8)
def mel_basis_and_window(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The mel filterbank [128, 513] and Hann window [1024], built once per device (fp32)."""
    from librosa.filters import mel

    basis = torch.from_numpy(mel(sr=SR, n_fft=N_FFT, n_mels=N_MELS, fmin=FMIN, fmax=FMAX)).float().to(device)
    return basis, torch.hann_window(WIN).to(device)


def log_mel_spectrogram(wav: torch.Tensor) -> torch.Tensor:
    """wav [B, S] float at 24 kHz -> log mel [B, frames, 128] (fp32)."""
    wav = wav.float()
    basis, window = mel_basis_and_window(wav.device)
    pad = (N_FFT - HOP) // 2
    y = torch.nn.functional.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=WIN, window=window, center=False,
                      pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(basis @ mag, min=1e-5)).transpose(1, 2)
