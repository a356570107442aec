"""How far a lossy codec decoder (bf16, int8 convolutions) is from the fp32 one, on the same codes.

Both decoders decode the same codes as a stream does (chunks of 1, 2, 4, 8, then 12 frames), from an empty state;
the waveforms are compared by
  snr_db   waveform signal-to-noise ratio, 10 log10(sum ref^2 / sum (y - ref)^2)
  lsd_db   log-spectral distance: per STFT frame (1024-point Hann window, hop 256), the RMS over frequency bins of
           20 log10(|Y| / |REF|) (magnitudes floored at 60 dB below the reference's peak magnitude, where differences
           are inaudible), averaged over frames.
A lossy mode may be chosen automatically only where snr_db >= MIN_SNR_DB and lsd_db <= MAX_LSD_DB (`acceptable`).
The thresholds sit below what bf16 measures (~45-47 dB, ~0.1-0.2 dB on the random and tiny checkpoints) with room for
int8 (~40 dB) and far above an audibly wrong decode (a wrong sign or scale of one layer gives < 10 dB).

    python -m bench codec_quality --arch 0.6b --frames 120      (prints the table; nothing is written)
"""
from __future__ import annotations

import copy
import math

import torch

MIN_SNR_DB = 30.0
MAX_LSD_DB = 1.0
FRAMES = 120


def stream_chunks(frames: int, cap: int = 12) -> list[int]:
    out, n = [], 1
    while sum(out) < frames:
        out.append(min(n, frames - sum(out)))
        n = min(2 * n, cap)
    return out


def test_codes(dec, frames: int = FRAMES, seed: int = 0) -> torch.Tensor:
    """[1, 16, frames] fixed pseudo-random codes for `dec`'s codebooks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, dec.cfg.codebook_size, (1, dec.cfg.num_quantizers, frames), generator=g)


@torch.inference_mode()
def decode_stream(dec, codes: torch.Tensor) -> torch.Tensor:
    """codes [B, 16, T] -> fp32 waveform [B, T * 1920], decoded in a stream's chunks."""
    st, o, out = dec.init_state(codes.shape[0]), 0, []
    for n in stream_chunks(codes.shape[-1]):
        out.append(dec.decode_step(codes[..., o:o + n], st).float())
        o += n
    return torch.cat(out, -1)


def snr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    err = (y.double() - ref.double()).pow(2).sum()
    sig = ref.double().pow(2).sum()
    if err == 0:
        return math.inf
    return float(10 * torch.log10(sig / err))


def lsd_db(ref: torch.Tensor, y: torch.Tensor, n_fft: int = 1024, hop: int = 256) -> float:
    win = torch.hann_window(n_fft, dtype=torch.float64)
    R = torch.stft(ref.double().reshape(-1), n_fft, hop, window=win, return_complex=True).abs()
    Y = torch.stft(y.double().reshape(-1), n_fft, hop, window=win, return_complex=True).abs()
    floor = 1e-3 * float(R.max()) if float(R.max()) > 0 else 1e-12
    d = 20 * torch.log10(Y.clamp(min=floor) / R.clamp(min=floor))      # [freq, frames]
    return float(d.pow(2).mean(0).sqrt().mean())


def compare(ref_wav: torch.Tensor, wav: torch.Tensor) -> dict:
    return {"snr_db": round(snr_db(ref_wav, wav), 2), "lsd_db": round(lsd_db(ref_wav, wav), 3)}


def acceptable(q: dict | None) -> bool:
    return bool(q) and q.get("snr_db", -math.inf) >= MIN_SNR_DB and q.get("lsd_db", math.inf) <= MAX_LSD_DB


def fp32_reference(dec, conv: str = "aten"):
    """An fp32 copy of `dec` on the exact (aten) path, or `conv` ("packed": equal up to fp32 rounding, faster)."""
    f32 = copy.deepcopy(dec).float()
    f32.refresh_codebooks()
    f32.set_conv_mode(conv)
    return f32


def measure(dec, modes: list[tuple[str, object, str]], frames: int = FRAMES, seed: int = 0,
            ref_conv: str = "aten") -> dict:
    """{label: {"snr_db", "lsd_db"}} of each (label, dtype, conv mode) variant of `dec` against its fp32 copy on
    `frames` frames of the same codes (a copy per variant; `dec` is not changed)."""
    codes = test_codes(dec, frames, seed)
    ref = decode_stream(fp32_reference(dec, ref_conv), codes)
    out = {}
    for label, dtype, conv in modes:
        d = copy.deepcopy(dec).to(dtype)
        d.refresh_codebooks()
        d.set_conv_mode(conv)
        out[label] = compare(ref, decode_stream(d, codes))
    return out

