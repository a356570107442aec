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

int8 convolutions (`int8_conv`, conv path "int8": the decoder's first conv and its blocks' convs in int8, ~90 % of
its multiply-adds) are a lossy candidate: timed with the others (in the first dtype only), and chosen only when they
take < 90 % of the lossless pick's time AND their output against the fp32 decoder (`codec.quality`: waveform SNR
and log-spectral distance on QUALITY_FRAMES frames of fixed codes, measured once per checkpoint and remembered in
the entry) meets `quality.MIN_SNR_DB` / `quality.MAX_LSD_DB`. Where oneDNN's int8 convolutions are missing, or any
call fails, the path is no candidate or falls back to the dtype's own convolutions.

Before any int8 timing, each int8 conv gets the length from which its int8 call beats the packed one on this CPU
(`int8_threshold`: measured once per machine and remembered; TTS_KERNEL_TUNE=0 keeps `int8_conv.MIN_POSITIONS`).

TTS_CODEC_DTYPE=auto (default) | fp32 | bf16 | model overrides the dtype; TTS_CODEC_CONV=auto (default) | aten |
packed | int8 the convolution path (for a bf16 model; an override of either still measures the other; int8 forced
skips the quality check); TTS_CODEC_INT8=0 takes int8 out of the automatic choice.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from tts_engine.cache_paths import cache_root
from tts_engine.cpu.cpu_info import cpu_info
from tts_engine.cpu import int8_conv
from tts_engine.cpu import measured
from tts_engine.cpu import codec_int8_threshold as int8_threshold
from tts_engine.cpu import packed_conv
from tts_engine.cpu import codec_quality as quality
from tts_engine.cpu import deferred_trials

log = logging.getLogger("tts_engine")
ENV = "TTS_CODEC_DTYPE"
CONV_ENV = "TTS_CODEC_CONV"
TIMED_CHUNKS = (1, 2, 8)   # frames per decode_step of the timed stream (the engine's first chunks, then a longer one)
FP32_MARGIN = 0.9   # fp32 replaces bf16 only when it takes < 90 % of bf16's time
INT8_MARGIN = 0.9   # int8 convolutions replace the lossless pick only when they take < 90 % of its time
INT8_ENV = "TTS_CODEC_INT8"   # 0: int8 convolutions are no candidate (TTS_CODEC_CONV=int8 forces them)
QUALITY_FRAMES = 36   # frames of the int8 quality check at load (codec.quality; its command line uses 120)
ENTRY_VERSION = 2   # entries before it were measured without the int8 path
NAME = "codec"   # its entry in measured.made() and TTSEngine.paths(): the decoder's dtype and convolution path


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
                deferred_trials.check()   # (measured while idle: a request stops it)
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
    want_conv = _want(CONV_ENV, ("auto", "aten", "packed", "int8"))
    dtypes = ["bf16", "fp32"] if want == "auto" else ["fp32" if want == "fp32" else "bf16"]
    if want == "auto" and not _bf16_convs():   # bf16 would take aten's generic convolutions (150-200x slower)
        dtypes = ["fp32"]
    convs = ["aten", "packed"] + (["int8"] if _int8_ok() else []) if want_conv == "auto" else [want_conv]
    if not packed_conv.available():
        convs = ["aten"]
    key = machine_key(dec)
    entry, timed = _read().get(key), {}
    fresh = entry is None or "conv" not in entry or entry.get("v", 1) < ENTRY_VERSION   # (older entries: fewer paths)
    if fresh and not (len(dtypes) == len(convs) == 1) and deferred_trials.bounded():
        return _defer(dec, key, dtypes, convs)   # a fresh start: the model's dtype on aten's convs until measured
    if "int8" in convs:   # from how many positions each int8 conv pays (measured once per machine, remembered)
        int8_threshold.apply(dec, torch.bfloat16 if "bf16" in dtypes else torch.float32)
    forced = [f"{e}={w}" for e, w in ((ENV, want), (CONV_ENV, want_conv)) if w != "auto"]
    forced_how = measured.forced_by(" and ".join(f.split("=")[0] for f in forced)) if forced else None
    if len(dtypes) == len(convs) == 1:                      # both forced: nothing to measure
        out = _fp32(dec) if dtypes[0] == "fp32" else dec
        out.set_conv_mode(convs[0])
        _note(dtypes[0], convs[0], forced_how or measured.DEFAULT, ", ".join(forced) or "one candidate here")
        return out
    how = measured.REMEMBERED
    if fresh:
        entry, timed = _measure(dec)
        _write(key, entry)
        how = measured.MEASURED
        log.info("codec decoder measured on this CPU: %s", entry)
    ms = entry["ms_per_frame"]
    dtype, conv = _pick(ms, dtypes, [c for c in convs if c != "int8"] or ["packed"])
    i8 = min((d for d in dtypes if f"{d} int8" in ms), key=lambda d: ms[f"{d} int8"], default=None)
    if want_conv == "int8":                                     # forced: in the measured dtype, else the pick's
        dtype, conv = i8 or dtype, "int8"
    elif "int8" in convs:   # int8 replaces the lossless pick when it is faster by the margin and good enough
        if i8 is not None and ms[f"{i8} int8"] < INT8_MARGIN * ms.get(f"{dtype} {conv}", float("inf")):
            q = int8_quality(dec, i8, entry, key)
            if quality.acceptable(q):
                dtype, conv = i8, "int8"
            else:
                log.info("codec: int8 convolutions faster but not accurate enough here (%s); %s %s kept", q, dtype,
                         conv)
    why = "ms per frame " + ", ".join(f"{k} {v}" for k, v in ms.items())
    _note(dtype, conv, forced_how or how, ", ".join(forced + [why]))
    out = timed.get(f"{dtype} {conv}")     # the timed copy (its weights already packed for those chunks)
    if out is None:
        out = _fp32(dec) if dtype == "fp32" else dec
    out.set_conv_mode(conv)
    out.release_unused()                       # packed while measuring, not used
    return out


def _note(dtype: str, conv: str, how: str, why: str) -> None:
    """The process's record of the decoder's path (`measured.note`), and of how its int8 convolutions take a batch."""
    measured.note(NAME, f"{dtype} {conv}", how, why)
    if conv == "int8":
        way = int8_conv.batch_setting()
        env = int8_conv.BATCH_ENV
        measured.note("codec int8 batch", way, measured.forced_by(env) if os.environ.get(env) else measured.DEFAULT,
                      "row by row or one call, per conv as the decoder runs (int8_conv.PathClock)" if way == "auto"
                      else f"{env}={os.environ.get(env, '')}" if way == "batched"
                      else "one call per row")


def _defer(dec, key: str, dtypes: list, convs: list):
    """`dec` in the model's dtype on the lossless convolution path that usually wins (oneDNN's with the weights packed
    once, where it runs here; else aten's), nothing measured now; the measurement of `choose` (int8 threshold, every
    candidate's timing, int8 quality) on a copy later, while no engine serves (`deferred_trials`), remembered for the
    next start."""
    conv = "packed" if "packed" in convs else "aten"
    dec.set_conv_mode(conv)
    _note("bf16", conv, measured.DEFAULT, "not measured here yet (measured when idle, used from the next start)")
    log.info("codec decoder: bf16 on %s convolutions until measured on this CPU (when idle, in the background; "
             "%s=all measures at start)", conv, deferred_trials.ENV)

    def measure():
        d = copy.deepcopy(dec)
        if "int8" in convs:
            int8_threshold.apply(d, torch.bfloat16 if "bf16" in dtypes else torch.float32)
        return d, _measure(d)[0]

    def commit(got):
        d, entry = got
        _write(key, entry)
        ms = entry["ms_per_frame"]
        i8 = min((x for x in dtypes if f"{x} int8" in ms), key=lambda x: ms[f"{x} int8"], default=None)
        dtype, conv = _pick(ms, dtypes, [c for c in convs if c != "int8"] or ["packed"])
        if "int8" in convs and i8 is not None and ms[f"{i8} int8"] < INT8_MARGIN * ms.get(f"{dtype} {conv}", 1e30):
            int8_quality(d, i8, entry, key)   # (numbers, not timings: written with the entry)
        log.info("codec decoder measured on this CPU while idle: %s (used from the next start)", entry)

    deferred_trials.defer("codec conv choice", measure, commit)
    return dec


def _pick(ms: dict, dtypes: list, convs: list) -> tuple[str, str]:
    """The lossless (dtype, conv) to use: the fastest measured of each dtype; fp32 replaces bf16 only when it takes
    < FP32_MARGIN of bf16's time. Unmeasured combinations (a forced path) count as slowest."""
    def best(d):
        return min(convs, key=lambda c: ms.get(f"{d} {c}", float("inf")))

    picks = {d: (d, best(d)) for d in dtypes}
    if len(picks) == 1:
        return next(iter(picks.values()))
    t16, t32 = ms.get(" ".join(picks["bf16"]), float("inf")), ms.get(" ".join(picks["fp32"]), float("inf"))
    return picks["fp32"] if t32 < FP32_MARGIN * t16 else picks["bf16"]


def _int8_ok() -> bool:
    return int8_conv.available() and os.environ.get(INT8_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def weights_key(dec) -> str:
    """A short fingerprint of the decoder's weights (the int8 quality depends on them, not on the machine)."""
    h = hashlib.sha1()
    for m in (dec.decoder[0], dec.decoder[1].block[1], dec.decoder[-1]):
        t = m.conv.weight.detach().float().reshape(-1)
        h.update(t[:4096].numpy().tobytes())
        h.update(str(tuple(m.conv.weight.shape)).encode())
    return h.hexdigest()[:16]


def int8_quality(dec, dtype: str, entry: dict, key: str) -> dict:
    """{"snr_db", "lsd_db"} of `dec` in `dtype` with int8 convolutions against its fp32 copy (QUALITY_FRAMES frames,
    `codec.quality`), remembered in the machine's entry per weights fingerprint (measured once per checkpoint)."""
    wk = weights_key(dec)
    got = (entry.get("int8_quality") or {}).get(wk)
    if got is not None:
        return got
    t0 = time.perf_counter()
    try:
        got = quality.measure(dec, [("int8", torch.bfloat16 if dtype == "bf16" else torch.float32, "int8")],
                              QUALITY_FRAMES, ref_conv="packed" if packed_conv.available() else "aten")["int8"]
    except Exception as e:   # noqa: BLE001 - not measurable: not eligible
        log.warning("codec: int8 quality not measured (%s)", e)
        return {"snr_db": float("-inf"), "lsd_db": float("inf"), "error": str(e)[:200]}
    got["frames"] = QUALITY_FRAMES
    log.info("codec: int8 convolutions against fp32 on %d frames: %s (%.1f s)", QUALITY_FRAMES, got,
             time.perf_counter() - t0)
    entry.setdefault("int8_quality", {})[wk] = got
    _write(key, entry)
    return got


def _measure(dec) -> tuple[dict, dict]:
    """Time every candidate (dtype x conv path) interleaved; -> the cache entry, {"dtype conv": decoder} of the
    candidates (their weights already packed for the timed chunks). The paths of one dtype share one decoder
    (switched by `set_conv_mode`), so only the fp32 copy is extra memory while measuring. The int8 path is timed in
    the first dtype only (bf16 where oneDNN has bf16 convolutions, else fp32)."""
    f32 = _fp32(dec)
    cands = {}
    for name, d in (("bf16", dec), ("fp32", f32)):
        if name == "bf16" and not _bf16_convs():
            continue
        paths = ["aten", "packed"] if packed_conv.available() else ["aten"]
        if not cands and packed_conv.available() and _int8_ok():
            paths.append("int8")
        for conv in paths:
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
    frames = sum(TIMED_CHUNKS)
    ms = {k: round(1000 * v / frames, 2) for k, v in best.items()}
    dtype, conv = _pick(ms, sorted({k.split()[0] for k in ms}), ["aten", "packed"])
    return {"v": ENTRY_VERSION, "dtype": dtype, "conv": conv, "ms_per_frame": ms,
            "timed_chunks": list(TIMED_CHUNKS)}, {k: d for k, (d, _) in cands.items()}


def _bf16_convs() -> bool:
    """oneDNN has bf16 convolutions on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on AVX2-only CPUs)."""
    from tts_engine.codec.decoder import _MKLDNN_BF16

    return _MKLDNN_BF16


def _fp32(dec):
    f32 = copy.deepcopy(dec).float()
    f32.refresh_codebooks()
    return f32
