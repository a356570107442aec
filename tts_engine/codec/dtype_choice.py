"""The dtype the speech-tokenizer decoder computes in on a CPU, chosen by measuring it on this machine.

The decoder is compute bound (convolutions). Which dtype is faster depends on the CPU, not on the talker's choice:
on a 2-core Zen 4 (AVX-512 BF16) bf16 decoded a stream ~1.4x faster than fp32, while on a 2-core Xeon with
AVX-512 BF16 but no AMX the issue measured bf16 slower (63 vs 57 ms per frame). So when the model runs in bf16 on
a CPU, the decoder is timed once in bf16 and in fp32 (a stream's first chunks, 2 + 4 frames, interleaved, best of
3 after a warm-up: about a second) and the faster is kept; fp32 must win by 10 % to replace bf16. The result is
remembered per CPU model, thread count, torch version and decoder size in ~/.cache/qwen3-tts-live/choices/codec_dtype.json.
An fp32 model keeps an fp32 decoder (exact path, parity-tested); GPUs keep the model's dtype.

TTS_CODEC_DTYPE=auto (default) | fp32 | bf16 | model overrides the choice.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import time
from pathlib import Path

import torch

from ..cache_paths import cache_root
from ..cpu_info import cpu_info

log = logging.getLogger("tts_engine")
ENV = "TTS_CODEC_DTYPE"
FP32_MARGIN = 0.9   # fp32 replaces bf16 only when it takes < 90 % of bf16's time


def cache_file() -> Path:
    return cache_root() / "choices" / "codec_dtype.json"


def machine_key(dec=None) -> str:
    cpu = cpu_info().model_name or "unknown cpu"
    size = "" if dec is None else (f" | decoder {dec.cfg.decoder_dim}/{dec.cfg.latent_dim}/{dec.cfg.hidden_size}"
                                   f"x{dec.cfg.num_hidden_layers}")
    return f"{cpu} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | torch {torch.__version__}{size}"


def time_decoder(dec, rounds: int = 3) -> float:
    """Best-of-`rounds` seconds to decode 2 + 4 frames of one stream from an empty state."""
    codes = torch.randint(0, dec.cfg.codebook_size, (1, dec.cfg.num_quantizers, 6),
                          generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds):
            st = dec.init_state(1)
            t0 = time.perf_counter()
            dec.decode_step(codes[..., :2], st)
            dec.decode_step(codes[..., 2:], st)
            best = min(best, time.perf_counter() - t0)
    return best


def _read() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write(key: str, entry: dict) -> None:
    try:
        data = _read()
        data[key] = entry
        f = cache_file()
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(f)
    except OSError as e:   # a read-only home: measure again next time
        log.warning("codec dtype choice not saved: %s", e)


def choose(dec):
    """`dec` (just loaded, in the model's dtype) or an fp32 copy of it, per the rules above."""
    w = dec.pre_conv.conv.weight
    if w.device.type != "cpu" or w.dtype != torch.bfloat16:
        return dec
    want = (os.environ.get(ENV) or "auto").strip().lower()
    if want in ("bf16", "model"):
        return dec
    if want == "fp32":
        return _fp32(dec)
    if want != "auto":
        raise ValueError(f"{ENV} must be auto, fp32, bf16 or model")
    key = machine_key(dec)
    entry = _read().get(key)
    if entry is None:
        f32 = _fp32(dec)
        time_decoder(dec, 1), time_decoder(f32, 1)          # warm-up: oneDNN builds its primitives
        t16 = t32 = float("inf")
        for _ in range(3):                                   # interleaved
            t16 = min(t16, time_decoder(dec, 1))
            t32 = min(t32, time_decoder(f32, 1))
        entry = {"dtype": "fp32" if t32 < FP32_MARGIN * t16 else "bf16",
                 "bf16_ms_per_frame": round(1000 * t16 / 6, 2), "fp32_ms_per_frame": round(1000 * t32 / 6, 2)}
        _write(key, entry)
        log.info("codec decoder dtype measured on this CPU: %s", entry)
        return f32 if entry["dtype"] == "fp32" else dec
    return _fp32(dec) if entry.get("dtype") == "fp32" else dec


def _fp32(dec):
    f32 = copy.deepcopy(dec).float()
    f32.refresh_codebooks()
    return f32
