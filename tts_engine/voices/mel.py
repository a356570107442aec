"""Log-mel front-end of the speaker encoder: the official `mel_spectrogram` recipe at the arguments used by
`extract_speaker_embedding` (24 kHz): n_fft 1024, hop 256, Hann window 1024, 128 slaney mels
(`librosa.filters.mel` defaults), fmin 0, fmax 12000, reflect pad (n_fft - hop) / 2 = 384 on both sides and
center=False, magnitude sqrt(re^2 + im^2 + 1e-9), log(clamp(., 1e-5)). Always computed in fp32.

The filterbank and the window are built once per (device, dtype) and kept (`mel_basis_and_window`).
"""
from __future__ import annotations

import threading

import torch

from tts_engine.errors import TTSError

N_FFT, HOP, WIN, N_MELS, SR, FMIN, FMAX = 1024, 256, 1024, 128, 24000, 0, 12000
PAD = (N_FFT - HOP) // 2
# reflect padding needs more than PAD samples; the padded signal must hold one full window
MIN_SAMPLES = max(PAD + 1, N_FFT - 2 * PAD)

_BUFFERS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
_LOCK = threading.Lock()


def mel_basis_and_window(device: torch.device | str | None = None,
                         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The mel filterbank [128, 513] and Hann window [1024] for (device, dtype), built once and cached.

    Values are those of the official code (librosa's fp32 filterbank, `torch.hann_window` in fp32), then cast
    to `dtype`."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    hit = _BUFFERS.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        hit = _BUFFERS.get(key)
        if hit is None:
            from librosa.filters import mel

            basis = torch.from_numpy(mel(sr=SR, n_fft=N_FFT, n_mels=N_MELS, fmin=FMIN, fmax=FMAX)).float()
            window = torch.hann_window(WIN)
            hit = (basis.to(device=device, dtype=dtype), window.to(device=device, dtype=dtype))
            _BUFFERS[key] = hit
    return hit


def num_frames(num_samples: int) -> int:
    """Mel frames for a clip of `num_samples` samples."""
    return (num_samples + 2 * PAD - N_FFT) // HOP + 1


def log_mel_spectrogram(wav: torch.Tensor) -> torch.Tensor:
    """wav [B, S] (or [S]) float at 24 kHz -> log mel [B, frames, 128] (fp32), frames = (S - 256) // 256 + 1."""
    if wav.ndim == 1:
        wav = wav[None]
    if wav.ndim != 2:
        raise TTSError(f"expected a waveform of shape [batch, samples], got {tuple(wav.shape)}")
    if wav.shape[-1] < MIN_SAMPLES:
        raise TTSError(f"the audio is too short for the speaker encoder ({wav.shape[-1]} samples at 24 kHz; "
                       f"at least {MIN_SAMPLES} are needed)")
    wav = wav.float()
    basis, window = mel_basis_and_window(wav.device, torch.float32)
    y = torch.nn.functional.pad(wav.unsqueeze(1), (PAD, PAD), mode="reflect").squeeze(1)
    spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=WIN, window=window, center=False,
                      pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(torch.matmul(basis, mag), min=1e-5)).transpose(1, 2)
