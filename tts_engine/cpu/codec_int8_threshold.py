"""From how many output positions per row the codec decoder's int8 convolutions are used, measured on the CPU at hand.

An `int8_conv.Int8Conv` call quantises its input and runs oneDNN's u8 x s8 kernel; below some length the fixed cost
of that beats the gain of int8's faster dot products, and the packed conv of the model's dtype is faster. Where that
length lies depends on the CPU (and on the convs' shapes), so it is chosen by timing the decoder itself in int8 mode
with each of CANDIDATES as every int8 conv's threshold, on a stream's first chunks (TIMED_CHUNKS frames, one row,
one intra-op thread: the codec thread's; the timing runs on a helper thread so the caller's threads stay as they
are), interleaved, fastest of ROUNDS runs each (twice as many on a busy machine); the fastest wins, a larger
threshold (fewer lossy calls) where it is within TIE of it. The trial is bounded: after each round a candidate more
than BEHIND slower than the fastest is timed no more, and no round starts after BUDGET_S seconds of rounds (on the
0.6B codec under load 6-9 on a 2-core Zen 4 the unbounded trial took 35 s: 64 28 ms per frame, 128 31, 256 43, 512
70, so after one round only 64 and 128 were worth timing). Timed in the decoder, not conv by conv: timed alone, each
conv's packed weight stays in the cache between calls and the packed path looked faster than it is in a decode (on a
2-core Zen 4 per-conv thresholds from such timings decoded a stream 20 % slower than the old constant). There 64-512
decoded alike (38-40 ms per frame under load, 32: 44, int8 never: 54), so 128 (`int8_conv.MIN_POSITIONS`) was no
worse a pick (the timing picked 256 at 26.3 ms per frame against 28.1 for 128); another CPU may differ. Once per
machine (two warm-up decodes, WARM_UP, and at least one timed decode of 15 frames per candidate): the choice is remembered per CPU
model, torch version, decoder shape and dtype in the cache folder (`<cache>/codec_int8/`, `measured`).
TTS_KERNEL_TUNE=0 measures nothing: MIN_POSITIONS stays.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
import time

import torch

from tts_engine.cpu import cpu_info
from tts_engine.cpu import measured
from tts_engine.cpu import int8_conv

log = logging.getLogger("tts_engine")

CANDIDATES = (64, 128, 256, 512)   # output positions per row from which int8 is used (MIN_POSITIONS among them)
TIMED_CHUNKS = (1, 2, 4, 8)        # frames per call of the timed stream: the chunks where the threshold decides
ROUNDS = 2                         # interleaved rounds after a warm-up; the fastest run of each counts
BUSY_LOAD = 1.5                    # load average per core above which a timing takes twice the rounds
TIE = 0.03                         # a larger threshold within 3 % of the fastest wins (fewer lossy calls)
BEHIND = 0.10                      # after a round, a candidate this much slower than the fastest is timed no more
BUDGET_S = 3.0                     # no round starts after this many seconds of timed rounds (one always runs)
# the warm-up decodes with the smallest threshold (every int8 length of any candidate) and the largest (every packed
# length): each candidate's calls are among theirs
WARM_UP = (min(CANDIDATES), max(CANDIDATES))
VERSION = 2
TUNE_ENV = "TTS_KERNEL_TUNE"
NAME = "codec int8 threshold"     # its entry in measured.made() and TTSEngine.paths()


def tuning_enabled() -> bool:
    return measured.setting(TUNE_ENV) != "off"


def _rounds() -> int:
    """ROUNDS, twice as many on a busy machine (load average per core above BUSY_LOAD)."""
    try:
        busy = os.getloadavg()[0] / max(1, os.cpu_count() or 1) > BUSY_LOAD
    except OSError:
        busy = False
    return 2 * ROUNDS if busy else ROUNDS


def set_threshold(dec, positions: int | None) -> None:
    """Every int8 conv of `dec` uses int8 from `positions` output positions per row (None: MIN_POSITIONS)."""
    for m in dec.int8_convs():
        m.int8_min_positions = positions


def time_decoder(dec) -> float:
    """Seconds for `dec` to decode a stream's TIMED_CHUNKS from an empty state (one row)."""
    codes = torch.randint(0, dec.cfg.codebook_size, (1, dec.cfg.num_quantizers, sum(TIMED_CHUNKS)),
                          generator=torch.Generator().manual_seed(0))
    st, o = dec.init_state(1), 0
    t0 = time.perf_counter()
    for n in TIMED_CHUNKS:
        dec.decode_step(codes[..., o:o + n], st)
        o += n
    return time.perf_counter() - t0


def still_close(best: dict, alive: list) -> list:
    """The candidates of `alive` whose fastest run so far is within BEHIND of the fastest one's (in order)."""
    top = min(best[t] for t in alive)
    return [t for t in alive if best[t] <= (1 + BEHIND) * top]


def pick(ms: dict) -> int:
    """The threshold to use from {threshold: ms}: the fastest, or a larger one within TIE of it."""
    best = min(ms.values())
    return max(t for t, v in ms.items() if v <= (1 + TIE) * best)


def _key(dec, dtype: torch.dtype) -> dict:
    c = dec.cfg
    return {"cpu": cpu_info.cache_key(), "torch": torch.__version__, "threads": 1, "dtype": str(dtype),
            "decoder": [c.decoder_dim, c.latent_dim, list(c.upsample_rates), list(c.upsampling_ratios)],
            "candidates": list(CANDIDATES), "chunks": list(TIMED_CHUNKS), "v": VERSION}


def measure(dec) -> dict:
    """{threshold: ms per frame} of `dec` in int8 mode (its conv mode and thresholds are put back), timed at one
    thread on a helper thread (the caller's thread count and the process default are left as they were)."""
    got: dict = {}
    err: list = []
    mode, before = dec.conv_mode, [m.int8_min_positions for m in dec.int8_convs()]

    def run():
        try:
            default = torch.get_num_threads()
            torch.set_num_threads(1)          # (this thread's team; also the process default: put back below)
            try:
                with torch.inference_mode():
                    dec.set_conv_mode("int8")
                    for t in WARM_UP:         # warm-up: oneDNN builds its primitives, packs weights per length
                        set_threshold(dec, t)
                        time_decoder(dec)
                    best = {t: float("inf") for t in CANDIDATES}
                    alive, t0 = list(CANDIDATES), time.perf_counter()
                    for r in range(_rounds()):
                        for t in (alive if r % 2 == 0 else alive[::-1]):
                            set_threshold(dec, t)
                            best[t] = min(best[t], time_decoder(dec))
                        alive = still_close(best, alive)
                        if len(alive) == 1 or time.perf_counter() - t0 > BUDGET_S:
                            break
                    got.update({t: round(1000 * v / sum(TIMED_CHUNKS), 3) for t, v in best.items()})
            finally:
                t = threading.Thread(target=torch.set_num_threads, args=(default,), daemon=True)
                t.start()
                t.join()
        except Exception as e:   # noqa: BLE001 - reported to the caller
            err.append(e)

    t = threading.Thread(target=run, name="tts-int8-threshold", daemon=True)
    t.start()
    t.join()
    dec.set_conv_mode(mode)
    for m, b in zip(dec.int8_convs(), before):
        m.int8_min_positions = b
    if err:
        raise err[0]
    return got


def apply(dec, dtype: torch.dtype) -> int | None:
    """Give every int8 conv of `dec` the threshold chosen for this machine (remembered, else measured now on `dec`,
    or on a copy in `dtype` when `dec` has another, and remembered). -> the threshold, or None (tuning off, int8
    unavailable, or the measurement failed: MIN_POSITIONS stays)."""
    if not tuning_enabled() or not int8_conv.available():
        if int8_conv.available():
            measured.note(NAME, str(int8_conv.MIN_POSITIONS), measured.forced_by(TUNE_ENV), f"{TUNE_ENV}=0")
        return None
    key = _key(dec, dtype)
    path = measured.path_for("codec_int8", key)
    got = measured.recall(path, key, tuple(str(t) for t in CANDIDATES))
    if got is not None:
        chosen = int(got["choice"])
        measured.note(NAME, str(chosen), measured.REMEMBERED, got["why"])
        log.info("codec: int8 convolutions from %d positions per row (remembered: %s)", chosen, got["why"])
    else:
        t0 = time.perf_counter()
        try:
            timed = dec
            if dec.pre_conv.conv.weight.dtype != dtype:
                timed = copy.deepcopy(dec).to(dtype)
                timed.refresh_codebooks()
            ms = measure(timed)
        except Exception as e:   # noqa: BLE001 - never fatal: the default threshold stays
            log.warning("codec: int8 threshold not measured (%s); MIN_POSITIONS (%d) kept", e,
                        int8_conv.MIN_POSITIONS)
            measured.note(NAME, str(int8_conv.MIN_POSITIONS), measured.FELL_BACK, f"the trial failed: {e}")
            return None
        chosen = pick(ms)
        why = f"ms per frame of a stream's first chunks {ms} (measured in {time.perf_counter() - t0:.1f} s)"
        measured.remember(path, key, str(chosen), why)
        measured.note(NAME, str(chosen), measured.MEASURED, why)
        log.info("codec: int8 convolutions from %d positions per row (%s)", chosen, why)
    set_threshold(dec, chosen)
    return chosen
