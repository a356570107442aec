"""From how many output positions each int8 convolution of the codec decoder is worth it, measured on the CPU at hand.

An `int8_conv.Int8Conv` call quantises its input and runs oneDNN's u8 x s8 kernel; below some length the fixed cost
of that beats the gain of int8's faster dot products, and the packed conv of the model's dtype is faster. Where that
length lies depends on the conv's shape (a 1x1 conv gains less than a k=7 one, a wide transposed conv's weight read
costs more) and on the CPU: on a 2-core Zen 4 at one thread the k=7 convs of the 0.6B decoder broke even at ~130
output positions, the 1x1 convs at ~400-600 and the first block's transposed conv at ~300, where one constant
(`int8_conv.MIN_POSITIONS`, 128) had been picked for all.

So each distinct int8 conv shape of a decoder (weight shape, groups and input samples per code frame; the residual
units' dilations share one) is timed both ways on one row of a stream's chunks of LADDER frames: the int8 call and
the packed call, interleaved, fastest of ROUNDS calls each (twice as many on a busy machine), at one intra-op thread (the codec thread's; the timing runs
on a helper thread so the caller's threads stay as they are). A conv's threshold is the smallest of those lengths
from which int8 takes less than MARGIN of the packed call's time at every longer one measured; where int8 never does
at the longest, int8 is never used for that conv (it is the lossy path: it has to pay). About 1-2 s once per machine:
the thresholds are remembered per CPU model, torch version and decoder shapes in the cache folder
(`<cache>/codec_int8/`, `remembered_choice`). TTS_KERNEL_TUNE=0 measures nothing: every conv keeps MIN_POSITIONS.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import torch

from .. import cpu_info, remembered_choice
from . import int8_conv

log = logging.getLogger("tts_engine")

LADDER = (1, 2, 4, 12)      # frames per call (one row): a stream's first chunks and its steady chunks
ROUNDS = 3                  # interleaved rounds; the fastest call of each path counts
BUSY_LOAD = 1.5             # load average per core above which a timing takes twice the rounds
MARGIN = 0.95               # int8 must take less than this share of the packed call's time
NEVER = 1 << 30             # threshold of a conv for which int8 never paid
VERSION = 1
TUNE_ENV = "TTS_KERNEL_TUNE"


def tuning_enabled() -> bool:
    return remembered_choice.setting(TUNE_ENV) != "off"


def _conv_args(m) -> tuple[torch.Tensor, torch.Tensor | None, int, int, int]:
    """(weight, bias, dilation, groups, input history) of the conv an int8 module runs (`decoder._Packable`)."""
    from .decoder import CausalTransConv

    if isinstance(m, CausalTransConv):           # its 1x1 tap conv (bias added on the taps)
        return m.tap_weight(), m.tap_bias(), 1, 1, m.ctx
    c = m.conv
    return c.weight, c.bias, int(c.dilation[0]), int(c.groups), m.ctx


def shape_key(m) -> str:
    w, _, _, groups, _ = _conv_args(m)
    return f"{'x'.join(map(str, w.shape))} g{groups} up{m.up}"


def _rounds() -> int:
    """ROUNDS, twice as many on a busy machine (load average per core above BUSY_LOAD)."""
    try:
        busy = os.getloadavg()[0] / max(1, os.cpu_count() or 1) > BUSY_LOAD
    except OSError:
        busy = False
    return 2 * ROUNDS if busy else ROUNDS


def _time_calls(fns: dict, rounds: int) -> dict:
    best = {k: float("inf") for k in fns}
    for f in fns.values():   # warm-up: oneDNN builds its primitives, packs the weight for this length
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def time_shape(m, dtype: torch.dtype, ladder=LADDER, rounds: int | None = None) -> list[dict]:
    """[{"frames", "positions", "int8_ms", "packed_ms"}] of conv module `m` (weights in `dtype`) on one row of
    `ladder` frames each, int8 and packed interleaved."""
    from .decoder import PACKED_MAX_FRAMES

    w, b, dil, groups, ctx = _conv_args(m)
    w = w.detach().to(dtype)
    b = None if b is None else b.detach().to(dtype)
    conv = int8_conv.Int8Conv(w, b, dil, groups, PACKED_MAX_FRAMES * m.up + ctx)
    k = w.shape[-1]
    g = torch.Generator().manual_seed(0)
    out = []
    for n in ladder:
        L = n * m.up + ctx
        x = torch.randn(1, L, w.shape[1] * groups, generator=g).to(dtype).transpose(1, 2)   # [1, C_in, L], time-major
        x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        t = _time_calls({"int8": lambda: conv.int8_row(x4), "packed": lambda: conv.fallback(x)}, rounds or _rounds())
        out.append({"frames": n, "positions": L - (k - 1) * dil, "int8_ms": round(1000 * t["int8"], 4),
                    "packed_ms": round(1000 * t["packed"], 4)})
    return out


def threshold(rows: list[dict], margin: float = MARGIN) -> int:
    """The smallest measured length from which int8 is faster (by `margin`) at every longer one; NEVER if not at the
    longest."""
    best = NEVER
    for r in sorted(rows, key=lambda r: -r["positions"]):
        if r["int8_ms"] < margin * r["packed_ms"]:
            best = r["positions"]
        else:
            break
    return best


def _key(dec, dtype: torch.dtype) -> dict:
    shapes = sorted({shape_key(m) for m in dec.int8_convs()})
    return {"cpu": cpu_info.cache_key(), "torch": torch.__version__, "threads": 1, "dtype": str(dtype),
            "ladder": list(LADDER), "shapes": shapes, "v": VERSION}


def measure(dec, dtype: torch.dtype) -> dict:
    """{shape_key: {"threshold": positions, "rows": time_shape(...)}} for the int8 convs of `dec`, timed at one thread
    on a helper thread (the caller's thread count and the process default are left as they were)."""
    got: dict = {}
    err: list = []

    def run():
        try:
            default = torch.get_num_threads()
            torch.set_num_threads(1)          # (this thread's team; also the process default: put back below)
            try:
                with torch.inference_mode():
                    for m in dec.int8_convs():
                        sk = shape_key(m)
                        if sk not in got:
                            rows = time_shape(m, dtype)
                            got[sk] = {"threshold": threshold(rows), "rows": rows}
            finally:
                t = threading.Thread(target=torch.set_num_threads, args=(default,), daemon=True)
                t.start()
                t.join()
        except Exception as e:   # noqa: BLE001 - reported to the caller
            err.append(e)

    t = threading.Thread(target=run, name="tts-int8-threshold", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return got


def apply(dec, dtype: torch.dtype) -> dict | None:
    """Give every int8 conv of `dec` its threshold (`int8_min_positions`): remembered for this machine, else measured
    now and remembered. -> {shape_key: positions}, or None (tuning off, int8 unavailable, or the measurement failed:
    the convs keep MIN_POSITIONS)."""
    if not tuning_enabled() or not int8_conv.available():
        return None
    key = _key(dec, dtype)
    path = remembered_choice.path_for("codec_int8", key)
    got = remembered_choice.recall(path, key, None)
    table = None
    if got is not None:
        try:
            table = {k: int(v) for k, v in json.loads(got["choice"]).items()}
        except (ValueError, TypeError, AttributeError):
            table = None
    if table is None or set(table) != set(key["shapes"]):
        t0 = time.perf_counter()
        try:
            measured = measure(dec, dtype)
        except Exception as e:   # noqa: BLE001 - never fatal: the default threshold stays
            log.warning("codec: int8 thresholds not measured (%s); MIN_POSITIONS (%d) kept", e,
                        int8_conv.MIN_POSITIONS)
            return None
        table = {k: v["threshold"] for k, v in measured.items()}
        why = (f"measured in {time.perf_counter() - t0:.1f} s: " +
               "; ".join(f"{k}: " + ", ".join(f"{r['positions']}: {r['int8_ms']:.3g}/{r['packed_ms']:.3g} ms"
                                              for r in v["rows"]) for k, v in measured.items()))
        remembered_choice.remember(path, key, json.dumps(table, sort_keys=True), why)
        log.info("codec: int8 conv thresholds (output positions per row) measured on this CPU: %s", table)
    for m in dec.int8_convs():
        m.int8_min_positions = table[shape_key(m)]
    return table
