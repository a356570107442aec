"""How the speech-tokenizer decoder computes on a CPU (dtype and convolution path), chosen by measuring it here.

The decoder is compute bound (convolutions). Which dtype is faster depends on the CPU, not on the talker's choice:
on a 2-core Zen 4 (AVX-512 BF16) bf16 decoded a stream ~1.4x faster than fp32, while on a 2-core Xeon with
AVX-512 BF16 but no AMX the issue measured bf16 slower (63 vs 57 ms per frame). Which convolution path is faster
is measured too: aten's oneDNN call with the plain weight (reordered on every call) or `packed_conv` (weights
reordered once per input shape, channels-last activations; `CodecDecoder.set_conv_mode`).

So when the model runs in bf16 on a CPU, the decoder is timed once per candidate (bf16 and fp32, each with the
aten and the packed convolutions) on a stream's first chunks (1 + 2 + 8 frames, interleaved, best of 2 after a
warm-up: a few seconds, once per machine), and the fastest is kept; an fp32 candidate must take < 90 % of the
fastest bf16 one's time to replace bf16. On a CPU where oneDNN has no bf16 convolutions (AVX2 only: no AVX-512
BW/VL/DQ, no AVX-NE-CONVERT) only fp32 is a candidate: bf16 would take aten's generic kernels. The result is remembered per CPU model, thread count, torch version and
decoder size in ~/.cache/qwen3-tts-live/choices/codec_dtype.json.
An fp32 model keeps an fp32 decoder on aten's path (exact path, parity-tested); GPUs keep the model's dtype.

TTS_CODEC_DTYPE=auto (default) | fp32 | bf16 | model overrides the dtype; TTS_CODEC_CONV=auto (default) | aten |
packed the convolution path (for a bf16 model; an override of either still measures the other).
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
from . import packed_conv

log = logging.getLogger("tts_engine")
ENV = "TTS_CODEC_DTYPE"
CONV_ENV = "TTS_CODEC_CONV"
TIMED_CHUNKS = (1, 2, 8)   # frames per decode_step of the timed stream (the engine's first chunks, then a longer one)
FP32_MARGIN = 0.9   # fp32 replaces bf16 only when it takes < 90 % of bf16's time


def cache_file() -> Path:
    return cache_root() / "choices" / "codec_dtype.json"


def machine_key(dec=None) -> str:
    cpu = cpu_info().model_name or "unknown cpu"
    size = "" if dec is None else (f" | decoder {dec.cfg.decoder_dim}/{dec.cfg.latent_dim}/{dec.cfg.hidden_size}"
                                   f"x{dec.cfg.num_hidden_layers}")
    return f"{cpu} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | torch {torch.__version__}{size}"


def time_decoder(dec, rounds: int = 3) -> float:
    """Best-of-`rounds` seconds to decode a stream's first chunks (TIMED_CHUNKS frames) from an empty state."""
    codes = torch.randint(0, dec.cfg.codebook_size, (1, dec.cfg.num_quantizers, sum(TIMED_CHUNKS)),
                          generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds):
            st = dec.init_state(1)
            t0, o = time.perf_counter(), 0
            for n in TIMED_CHUNKS:
                dec.decode_step(codes[..., o:o + n], st)
                o += n
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


def _want(env: str, allowed: tuple) -> str:
    want = (os.environ.get(env) or "auto").strip().lower()
    if want not in allowed:
        raise ValueError(f"{env} must be {', '.join(allowed[:-1])} or {allowed[-1]}")
    return want


def choose(dec):
    """`dec` (just loaded, in the model's dtype) or an fp32 copy of it, with its convolution path set, per the
    rules above."""
    w = dec.pre_conv.conv.weight
    if w.device.type != "cpu" or w.dtype != torch.bfloat16:
        return dec
    want = _want(ENV, ("auto", "fp32", "bf16", "model"))
    want_conv = _want(CONV_ENV, ("auto", "aten", "packed"))
    dtypes = ["bf16", "fp32"] if want == "auto" else ["fp32" if want == "fp32" else "bf16"]
    if want == "auto" and not _bf16_convs():   # bf16 would take aten's generic convolutions (150-200x slower)
        dtypes = ["fp32"]
    convs = ["aten", "packed"] if want_conv == "auto" else [want_conv]
    if not packed_conv.available():
        convs = ["aten"]
    if len(dtypes) == len(convs) == 1:                      # both forced: nothing to measure
        out = _fp32(dec) if dtypes[0] == "fp32" else dec
        out.set_conv_mode(convs[0])
        return out
    key = machine_key(dec)
    entry, measured = _read().get(key), {}
    if entry is None or "conv" not in entry:   # (entries before the conv choice had only a dtype)
        entry, measured = _measure(dec)
        _write(key, entry)
        log.info("codec decoder measured on this CPU: %s", entry)
    dtype = entry["dtype"] if entry["dtype"] in dtypes else dtypes[0]
    conv = entry["conv"] if entry["conv"] in convs else convs[0]
    if len(convs) > 1 and len(dtypes) == 1 and entry["dtype"] != dtype:   # dtype forced: that dtype's faster conv
        conv = min(convs, key=lambda c: entry["ms_per_frame"].get(f"{dtype} {c}", float("inf")))
    out = measured.get(f"{dtype} {conv}")     # the timed copy (its weights already packed for those chunks)
    if out is None:
        out = _fp32(dec) if dtype == "fp32" else dec
        out.set_conv_mode(conv)
    if conv == "aten":
        out.release_packed()                   # packed while measuring, not used
    return out


def _measure(dec) -> tuple[dict, dict]:
    """Time every candidate (dtype x conv path) interleaved; -> the cache entry, {"dtype conv": decoder} for the
    chosen candidate (its weights already packed for the timed chunks). The two paths of one dtype share one
    decoder (switched by `set_conv_mode`), so only the fp32 copy is extra memory while measuring."""
    f32 = _fp32(dec)
    cands = {}
    for name, d in (("bf16", dec), ("fp32", f32)):
        if name == "bf16" and not _bf16_convs():
            continue
        for conv in (["aten", "packed"] if packed_conv.available() else ["aten"]):
            cands[f"{name} {conv}"] = (d, conv)

    def timed(d, conv):
        d.set_conv_mode(conv)
        return time_decoder(d, 1)

    for d, conv in cands.values():
        timed(d, conv)                                       # warm-up: oneDNN builds its primitives, packs weights
    best = {k: float("inf") for k in cands}
    for _ in range(2):                                       # interleaved
        for k, (d, conv) in cands.items():
            best[k] = min(best[k], timed(d, conv))
    b16 = min((k for k in best if k.startswith("bf16")), key=best.get, default=None)
    b32 = min((k for k in best if k.startswith("fp32")), key=best.get)
    pick = b32 if b16 is None or best[b32] < FP32_MARGIN * best[b16] else b16
    d, conv = cands[pick]
    d.set_conv_mode(conv)
    frames = sum(TIMED_CHUNKS)
    return {"dtype": pick.split()[0], "conv": pick.split()[1],
            "ms_per_frame": {k: round(1000 * v / frames, 2) for k, v in best.items()},
            "timed_chunks": list(TIMED_CHUNKS)}, {pick: d}


def _bf16_convs() -> bool:
    """oneDNN has bf16 convolutions on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on AVX2-only CPUs)."""
    from .decoder import _MKLDNN_BF16

    return _MKLDNN_BF16


def _fp32(dec):
    f32 = copy.deepcopy(dec).float()
    f32.refresh_codebooks()
    return f32
