"""The matmul kernels of the per-frame linear layers, and the table of their speeds measured on the CPU at hand.

At one stream every per-frame linear layer of the talker and the code predictor multiplies 1-4 input rows by a
weight that comes from memory: its speed is how fast a kernel streams that weight, which differs between CPUs
(AVX2 only, AVX-512 with or without BF16/VNNI/AMX) and PyTorch builds. So nothing here is assumed: for each
weight format, shape (N out x K in) and row bucket the engine needs, `KernelTable.measure` times every candidate
kernel of that format and keeps the fastest; the table is remembered per machine (CPU model and SIMD flags,
torch version, thread count) in the cache folder (`$TTS_CACHE_DIR/kernels/`, default
`~/.cache/qwen3-tts-live/kernels/`) and read back by the next start; another CPU's table is never used.

How a shape is timed (DRAM-realistic, robust to a busy machine): weights of that shape are views into one scratch
buffer larger than the last-level cache (ROTATE_MIN_BYTES, or 3x the L3 where it is larger), visited in order, so
every call reads its weight from memory as in a running model (and, for 1-2 rows of bf16, with oneDNN off as
`ModelRunner` runs them); each call is timed alone, each weight's fastest
call over up to ROUNDS rounds counts (a call that waited for a descheduled thread does not; candidates interleaved
call by call, each on a weight it has not read for a whole round; after MIN_ROUNDS rounds a candidate DROP times slower
than the fastest is timed no more, and the rounds stop once one candidate is ahead of every other by CLEAR, or is
the only one, and no time moved by more than STABLE in the last round), and the lower quartile over the weights
is the candidate's time (includes everything the layer does per call: for W8A8 quantising the
activation and scaling the result). A candidate that raises is left out (logged); if all do, the format's default
stands. `TTS_KERNEL_TUNE=0` measures nothing and uses the defaults. At a bounded start (`deferred_trials`: a fresh
machine answers its first request soon) only the 1-row bucket is timed at load; the 4-row bucket takes its shape's
1-row winner and is timed while idle, for the next start.

Formats (what a layer stores) and their candidates (how it multiplies); candidates of one format compute the same
numbers up to float summation order:
  "bf16"  dense bf16 [N, K]:  "aten" (PyTorch's own gemv, oneDNN off: what `ModelRunner` runs for 1-2 rows),
          "onednn" (F.linear through oneDNN)
  "fp32"  dense fp32 [N, K]:  "linear" (F.linear)
  "int8"  int8 [N, K] + bf16 scale [N], bf16 activations: "int8pack" (aten._weight_int8pack_mm)
  "w8a8"  int8 [N, K] + fp32 scale [N], activations rounded to int8 per row (absmax):
          "int_mm" (torch._int_mm on the transposed view of [N, K]: int32 sums, VNNI where the CPU has it),
          "int8pack_a8" (the int8 activation, exact in bf16, through the weight-only int8 kernel),
          "vnni" (our own fused kernel, `cpu_ext`: quantise, VNNI int8 dot products, scale, one call; its weights
          are the same int8 values in a blocked layout, `cpu_ext.pack`; a candidate only where it builds; on a
          CPU without AVX-512 VNNI the same candidate runs its AVX-512BW or AVX2 path, `cpu_ext.isa()`),
          "own_avx2" (the AVX2 path on a CPU with AVX-512 (VNNI or not), timed beside it; same layout)
  "int4"  aten's packed int4 + bf16 (scale, zero) per group: "int4pack" (aten._weight_int4pack_mm_for_cpu)
  "w4a8"  int4 + bf16 (scale, zero) per group of 64 in our kernel's layout, activations rounded to int8 per row:
          "vnni" (`cpu_ext.w4a8`: AVX-512 VNNI, or the AVX2 path on a CPU without VNNI, the same bits; the
          format has no candidate where our kernels do not run)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tts_engine import cache_paths
from tts_engine.cpu import cpu_info
from tts_engine.cpu import cpu_ext
from tts_engine.cpu import measured
from tts_engine.cpu import deferred_trials

log = logging.getLogger("tts_engine")

TUNE_ENV = "TTS_KERNEL_TUNE"        # 0 / off / no: measure nothing, use each format's default
TABLE_NAME = "kernel table"        # its entry in measured.made() and TTSEngine.paths()
CACHE_ENV = cache_paths.ENV
TABLE_VERSION = 1
ROW_BUCKETS = (1, 4)                # a call with M rows uses bucket 1 for M <= 2, else 4
MAX_DECODE_ROWS = 16                # more rows than this is a prompt prefill: not a per-frame call
ROTATE_MIN_BYTES = 96 << 20         # weights visited per timing: more than most L3s (3x the L3 where larger)
ROTATE_MAX_BYTES = 384 << 20
MAX_COPIES = 256
ROUNDS = 3                          # rounds over the weights at most (twice as many when the machine is busy)
MIN_ROUNDS = 2                      # rounds that always run
CLEAR = 0.25                        # after MIN_ROUNDS, a candidate this much faster than every other wins ...
STABLE = 0.05                       # ... once no time moved by more than this in the last round: no more rounds
DROP = 1.5                          # after MIN_ROUNDS, a candidate this many times slower than the fastest is dropped
MIN_COPIES = 8                      # weights per timing at least (the scratch buffer grows for big shapes)
BUSY_LOAD = 1.5                     # load average per core above which a timing takes twice the rounds
INT4_GROUP = 64                     # quant.INT4_GROUP (kept here to avoid an import cycle; test checks they agree)


# --- the machine ----------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """Where the kernel table (and the quality records, our built C++ libraries) are kept: $TTS_CACHE_DIR (the
    app's --cache-dir), else a Hugging Face Space's persistent storage, else ~/.cache/qwen3-tts-live
    (`cache_paths.choices_root`)."""
    return cache_paths.choices_root()


def cpu_identity() -> dict:
    """CPU model name, vendor / family / model and the SIMD flags that decide kernel speed (/proc/cpuinfo)."""
    return cpu_info.cache_key()


def machine_key() -> dict:
    """What a kernel measurement depends on: the CPU, its flags, torch's version and SIMD level, the threads, and
    whether our own kernels (`cpu_ext`, built here on first use) are candidates."""
    return {"cpu": cpu_identity(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "version": TABLE_VERSION, "cpu_ext": register_cpu_ext()}


def table_path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() else "-" for c in key["cpu"]["model_name"] or "cpu")[:40].strip("-")
    return cache_root() / "kernels" / f"{name}-{digest}.json"


def l3_bytes() -> int:
    try:
        s = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
        return int(s.rstrip("KMG")) * mult
    except (OSError, ValueError):
        return 32 << 20


def rotate_bytes() -> int:
    return max(ROTATE_MIN_BYTES, min(ROTATE_MAX_BYTES, 3 * l3_bytes()))


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


# --- the candidates -------------------------------------------------------------------------------------------
class _OneDNNSwitch:
    """oneDNN's process-wide switch (`torch._C._set_mkldnn_enabled`) shared by the threads that want it off
    (`onednn_off`: an engine worker's small bf16 frames) or on (`onednn_on`: `_int_mm` inside such a frame, the codec
    handed over from one) for a while: on while any thread wants it on, else off while any wants it off, else as it
    was before the first of them came. Counted under a lock: a save-and-restore per region is not safe across
    threads (two engines' workers: A saves on and turns it off, B saves off, A restores on, B restores off, and the
    process is left without oneDNN)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._want = {False: 0, True: 0}
        self._before = True

    @contextlib.contextmanager
    def want(self, on: bool):
        self._move(on, 1)
        try:
            yield
        finally:
            self._move(on, -1)

    def _move(self, on: bool, step: int) -> None:
        with self._lock:
            if not (self._want[False] or self._want[True]):
                self._before = torch._C._get_mkldnn_enabled()
            self._want[on] += step
            state = True if self._want[True] else False if self._want[False] else self._before
            torch._C._set_mkldnn_enabled(state)

    def outside(self) -> bool:
        """The switch as it is outside every thread's region: what it was before the first of them came while any
        is open (another engine's worker may hold it off at this moment), else as it is."""
        with self._lock:
            if self._want[False] or self._want[True]:
                return self._before
            return torch._C._get_mkldnn_enabled()


_ONEDNN = _OneDNNSwitch()


def onednn_off():
    """PyTorch's own CPU matmul instead of oneDNN's for the calls inside (process-wide switch, kept short; safe to
    overlap with other threads' `onednn_off` / `onednn_on`)."""
    return _ONEDNN.want(False)


def onednn_on():
    """oneDNN allowed for the calls inside, also within another `onednn_off` (process-wide, as `onednn_off`)."""
    return _ONEDNN.want(True)


def onednn_outside() -> bool:
    """Whether oneDNN is on outside every `onednn_off` / `onednn_on` region of every thread (the process's own
    setting, whichever engine holds it off meanwhile)."""
    return _ONEDNN.outside()


def _call_with_onednn(fn, *args):
    """fn(*args) with oneDNN allowed: `ModelRunner` turns it off process-wide for 1-2 row bf16 frames (PyTorch's
    gemv), and torch._int_mm without oneDNN is a ~5x slower loop."""
    if torch._C._get_mkldnn_enabled():
        return fn(*args)
    with onednn_on():
        return fn(*args)


def bf16_aten(x, w):
    with onednn_off():
        return F.linear(x, w)


def bf16_onednn(x, w):
    return _call_with_onednn(F.linear, x, w)


def int8_pack(x, q, scale):
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] int8, amax [M, 1] fp32): each row rounded to int8 on its own absmax grid,
    x ~= xq * amax / 127 (a row's result never depends on the other rows of a batch). 5 small ops."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-30)
    return torch.round(x * (127.0 / amax)).to(torch.int8), amax


def w8a8_int_mm(x, q, scale127, scale127_bf16=None):
    """int8 x int8 -> int32 sums (torch._int_mm on q's transposed view), times amax_row * scale[n] / 127.
    q [N, K] int8, scale127 [N] fp32 (the weight's per-channel scale / 127). Returns fp32 [M, N]."""
    xq, amax = quantize_rows(x)
    return _call_with_onednn(torch._int_mm, xq, q.t()) * (amax * scale127)


def w8a8_int8pack(x, q, scale127, scale127_bf16):
    """The numbers of `w8a8_int_mm` through the weight-only kernel: the int8 activation is exact in bf16, the
    kernel multiplies by the weight's int8 values and the per-channel scale (fp32 sums, bf16 result)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-30)
    xq = torch.round(x * (127.0 / amax)).to(torch.bfloat16)
    return torch.ops.aten._weight_int8pack_mm(xq, q, scale127_bf16) * amax


def w8a8_vnni(x, packed, scale127, scale127_bf16=None):
    """The numbers of `w8a8_int_mm` (exact int32 sums, the same rounding; result in x's dtype) in one call of our
    own kernel: packed = cpu_ext.pack(q), N = scale127's length."""
    return cpu_ext.w8a8(x, packed, scale127, scale127.numel())


def w8a8_own_avx2(x, packed, scale127, scale127_bf16=None):
    """`w8a8_vnni`'s AVX2 code path (16-bit products) on a CPU with AVX-512 (VNNI or not): timed beside it."""
    return cpu_ext.w8a8(x, packed, scale127, scale127.numel(), path=1)


OWN_PACKED = ("vnni", "own_avx2")   # the W8A8 candidates that read cpu_ext.pack's layout


def w4a8_vnni(x, packed4, N):
    return cpu_ext.w4a8(x, packed4, N)


def int4_pack(x, packed, group, scale_zero):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zero)


@dataclass(frozen=True)
class Format:
    """A weight format: bytes per weight element, the candidates that multiply by it, its default, and how to view a
    scratch buffer as one weight of shape (N, K) for timing (`weights(buf, N, K) -> extra args`)."""
    name: str
    bytes_per_weight: float
    candidates: dict
    default: str
    weights: Callable
    act_dtype: torch.dtype = torch.bfloat16
    layouts: dict = field(default_factory=dict)   # candidate -> (weights(buf, N, K), bytes(N, K)) of its own layout


def _dense_view(dtype):
    def make(buf, N, K):
        return (buf.view(dtype)[: N * K].view(N, K),)
    return make


def _int8_view(buf, N, K):
    return buf.view(torch.int8)[: N * K].view(N, K), torch.full((N,), 0.01, dtype=torch.bfloat16)


def _w8a8_view(buf, N, K):
    s = torch.full((N,), 1e-4)
    return buf.view(torch.int8)[: N * K].view(N, K), s, s.to(torch.bfloat16)


def _w8a8_packed_view(buf, N, K):
    s = torch.full((N,), 1e-4)
    return buf[: cpu_ext.packed_bytes(N, K)], s, s.to(torch.bfloat16)


def _w4a8_view(buf, N, K):
    return buf[: cpu_ext.packed4_bytes(N, K)], N


def _int4_view(buf, N, K):
    # aten's CPU int4 packing is [N, K / 2] uint8 (two 4-bit values a byte); the timing only needs its size
    packed = buf[: N * K // 2].view(N, K // 2)
    return packed, INT4_GROUP, torch.full((K // INT4_GROUP, N, 2), 0.01, dtype=torch.bfloat16)


FORMATS: dict[str, Format] = {
    "bf16": Format("bf16", 2, {"aten": bf16_aten, "onednn": bf16_onednn}, "aten", _dense_view(torch.bfloat16)),
    "fp32": Format("fp32", 4, {"linear": F.linear}, "linear", _dense_view(torch.float32), torch.float32),
    "int8": Format("int8", 1, {"int8pack": int8_pack}, "int8pack", _int8_view),
    "w8a8": Format("w8a8", 1, {"int_mm": w8a8_int_mm, "int8pack_a8": w8a8_int8pack}, "int_mm",
                   _w8a8_view),
    "int4": Format("int4", 0.5, {"int4pack": int4_pack}, "int4pack", _int4_view),
    "w4a8": Format("w4a8", 0.5625, {}, "vnni", _w4a8_view),
}


def register_cpu_ext() -> str | None:
    """Make our own kernels candidates where they build and run here (`cpu_ext.available()`, built on first use);
    -> their tag for the machine key (None where unavailable, then aten's kernels stand alone)."""
    cands, layouts = FORMATS["w8a8"].candidates, FORMATS["w8a8"].layouts
    if not cpu_ext.available():
        for n in OWN_PACKED:
            cands.pop(n, None)
            layouts.pop(n, None)
        FORMATS["w4a8"].candidates.pop("vnni", None)
        return None
    cands.setdefault("vnni", w8a8_vnni)
    layouts.setdefault("vnni", (_w8a8_packed_view, cpu_ext.packed_bytes))
    if cpu_ext.isa() in ("avx512-vnni", "avx512bw") and {"avx2", "fma"} <= set(cpu_identity()["flags"]):
        cands.setdefault("own_avx2", w8a8_own_avx2)
        layouts.setdefault("own_avx2", (_w8a8_packed_view, cpu_ext.packed_bytes))
    else:
        cands.pop("own_avx2", None)
        layouts.pop("own_avx2", None)
    if cpu_ext.has_w4a8():
        FORMATS["w4a8"].candidates.setdefault("vnni", w4a8_vnni)
    else:
        FORMATS["w4a8"].candidates.pop("vnni", None)
    return cpu_ext.tag()


def row_bucket(rows: int) -> int:
    return 1 if rows <= 2 else 4


def tuning_enabled() -> bool:
    return os.environ.get(TUNE_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


# --- timing ---------------------------------------------------------------------------------------------------
def time_candidates(fmt: str, N: int, K: int, rows: int, buf: torch.Tensor | None = None,
                    candidates: dict | None = None) -> dict[str, float]:
    """{candidate: seconds per call} for one shape at `rows` input rows, weights read from memory (module doc).
    A candidate that raises is left out. `buf`: a scratch buffer to reuse (uint8, >= one weight)."""
    f = FORMATS[fmt]
    candidates = f.candidates if candidates is None else candidates
    wbytes = max([int(N * K * f.bytes_per_weight)] + [nb(N, K) for n, (_, nb) in f.layouts.items() if n in candidates])
    if buf is None:
        buf = scratch_buffer()
    copies = max(MIN_COPIES, min(MAX_COPIES, buf.numel() // max(1, wbytes)))
    if buf.numel() < wbytes * copies:
        buf = torch.full((wbytes * copies,), 0x3C, dtype=torch.uint8)
    # every candidate's weights (in its own layout where it has one) at the same places of the buffer
    weights = {name: [f.layouts.get(name, (f.weights,))[0](buf[i * wbytes:(i + 1) * wbytes], N, K)
                      for i in range(copies)] for name in candidates}
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(0)).to(f.act_dtype)
    ok: dict[str, Callable] = {}
    for name, fn in candidates.items():
        try:
            with torch.inference_mode():
                y = fn(x, *weights[name][0])
            if tuple(y.shape) != (rows, N) or not bool(torch.isfinite(y.float()).all()):
                raise RuntimeError(f"gave shape {tuple(y.shape)} / non-finite values")
            ok[name] = fn
        except Exception as e:  # a kernel this CPU or build cannot run
            log.info("kernel %s/%s left out at %dx%d: %s", fmt, name, N, K, f"{type(e).__name__}: {e}"[:200])
    names = list(ok)
    best = {name: [float("inf")] * copies for name in names}
    busy = load_average() / (os.cpu_count() or 1) > BUSY_LOAD
    clock = time.perf_counter
    with torch.inference_mode(), (onednn_off() if rows <= 2 and f.act_dtype == torch.bfloat16
                                  else contextlib.nullcontext()):
        last = dict.fromkeys(names, float("inf"))   # (no round before the first: never stable)
        for r in range(ROUNDS * (2 if busy else 1)):
            deferred_trials.check()   # (measured while idle: a request stops it)
            for i in range(copies):
                for j, name in enumerate(names):   # candidates interleaved, each on a weight not read lately
                    k = (i + j * copies // len(names)) % copies
                    t0 = clock()
                    ok[name](x, *weights[name][k])
                    dt = clock() - t0
                    if dt < best[name][k]:
                        best[name][k] = dt
            now = {name: sorted(best[name])[copies // 4] for name in names}
            if r + 1 >= MIN_ROUNDS:
                if clearly_ahead(now) and all(abs(now[n] - last[n]) <= STABLE * now[n] for n in names):
                    break   # the winner is settled (a lone candidate: its time no longer moves)
                names = [n for n in names if now[n] <= DROP * min(now.values())]
            last = now
    return {name: sorted(b)[len(b) // 4] for name, b in best.items()}


def clearly_ahead(times: dict[str, float]) -> bool:
    """True when the fastest of `times` beats every other by more than CLEAR (or has no rival): more rounds would
    not change the winner."""
    order = sorted(times.values())
    return len(order) < 2 or order[0] * (1 + CLEAR) < order[1]


def scratch_buffer() -> torch.Tensor:
    """Bytes the timed weights are views of, filled once (untouched pages would time page faults) with 0x3C: as
    bf16 / fp32 that is ~0.0115 (no denormals, which are slow on some CPUs), as int8 60."""
    return torch.full((rotate_bytes(),), 0x3C, dtype=torch.uint8)


# --- the table ------------------------------------------------------------------------------------------------
class KernelTable:
    """{(format, N, K, row bucket): the fastest candidate and every candidate's time}, measured here and
    remembered in a JSON file per machine (`table_path`); a file written for another machine key is ignored."""

    def __init__(self, key: dict | None = None, path: Path | None = None):
        self.key = key or machine_key()
        self.path = path or table_path(self.key)
        self.entries: dict[str, dict] = {}
        self.guessed: dict[str, tuple] = {}   # entry key -> (fmt, N, K) whose 1-row winner stands in (`ensure`)
        self.measured_now = 0
        self._lock = threading.Lock()
        self._read()

    @staticmethod
    def entry_key(fmt: str, N: int, K: int, bucket: int) -> str:
        return f"{fmt} {N}x{K} r{bucket}"

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if data.get("machine") != self.key:
            log.info("kernel table %s was measured on another machine; measuring here", self.path)
            return
        self.entries = {k: v for k, v in data.get("entries", {}).items() if isinstance(v, dict)}

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"machine": self.key, "entries": self.entries}, indent=1, sort_keys=True),
                           encoding="utf-8")
            tmp.replace(self.path)
        except OSError as e:
            log.info("kernel table not saved to %s: %s", self.path, e)

    def lookup(self, fmt: str, N: int, K: int, rows: int = 1) -> dict | None:
        return self.entries.get(self.entry_key(fmt, N, K, row_bucket(rows)))

    def ensure(self, fmt: str, shapes, buckets=ROW_BUCKETS) -> int:
        """Measure every (N, K) of `shapes` x `buckets` of `fmt` not in the table yet (one scratch buffer for all),
        then save once. Returns how many were measured. Nothing is measured when tuning is off. At a bounded start
        (`deferred_trials.bounded`) the buckets above 1 row (batches of 3+ streams) are not timed now: each takes
        its shape's 1-row winner (`guessed`, one log line) and is measured while idle, for the next start."""
        if not tuning_enabled():
            measured.note(TABLE_NAME, "each format's default", measured.forced_by(TUNE_ENV), f"{TUNE_ENV}=0")
            return 0
        with self._lock:
            todo = [(N, K, b) for N, K in dict.fromkeys(shapes) for b in buckets
                    if self.entry_key(fmt, N, K, b) not in self.entries]
            if deferred_trials.bounded() and any(b > 1 for *_, b in todo):
                later = [t for t in todo if t[2] > 1]
                todo = [t for t in todo if t[2] == 1]
                self._defer(fmt, later, guess_after=todo)
            if not todo:
                if self.entries and not self.measured_now:
                    measured.note(TABLE_NAME, "the fastest per shape", measured.REMEMBERED,
                                  f"{len(self.entries)} shapes in {self.path}")
                return 0
            t0 = time.perf_counter()
            buf = scratch_buffer()
            for N, K, b in todo:
                deferred_trials.mark_busy(frame=False)   # (no deferred trial runs beside these timings)
                times = time_candidates(fmt, N, K, b, buf)
                if not times:
                    log.warning("no %s kernel ran at %dx%d (%d rows); using %s", fmt, N, K, b, FORMATS[fmt].default)
                self.entries[self.entry_key(fmt, N, K, b)] = {
                    "winner": min(times, key=times.get) if times else None,
                    "us": {n: round(t * 1e6, 2) for n, t in times.items()}, "load": round(load_average(), 2)}
            del buf
            self.measured_now += len(todo)
            self.save()
            measured.note(TABLE_NAME, "the fastest per shape", measured.MEASURED,
                          f"{self.measured_now} shapes measured here ({self.path})")
            log.info("tts_engine: measured %d %s kernel shapes in %.2f s (%s)", len(todo), fmt,
                     time.perf_counter() - t0, self.path)
            return len(todo)

    def _defer(self, fmt: str, later: list, guess_after: list) -> None:
        """(Under the lock) the (N, K, bucket)s of `later` take their shape's 1-row winner until measured while idle
        (`deferred_trials`); the 1-row entries of `guess_after` are measured first, by the caller."""
        for N, K, b in later:
            self.guessed[self.entry_key(fmt, N, K, b)] = (fmt, N, K)
        log.info("tts_engine: %d %s kernel shapes of batches of 3+ streams take their 1-stream winner until measured "
                 "while idle (%s=all measures them at start)", len(later), fmt, deferred_trials.ENV)

        def measure():
            buf = scratch_buffer()
            return {(N, K, b): time_candidates(fmt, N, K, b, buf) for N, K, b in later}

        def commit(got):
            with self._lock:
                for (N, K, b), times in got.items():
                    self.entries[self.entry_key(fmt, N, K, b)] = {
                        "winner": min(times, key=times.get) if times else None,
                        "us": {n: round(t * 1e6, 2) for n, t in times.items()}, "load": round(load_average(), 2)}
                self.save()

        deferred_trials.defer(f"kernel table ({fmt}, {len(later)} shapes of 3+ rows)", measure, commit)

    def choice(self, fmt: str, N: int, K: int, rows: int = 1) -> str:
        """The fastest candidate measured for this shape and rows (a bucket deferred at a bounded start: the 1-row
        winner of its shape); the format's default when unmeasured."""
        key = self.entry_key(fmt, N, K, row_bucket(rows))
        e = self.entries.get(key)
        if e is None and key in self.guessed:
            e = self.lookup(*self.guessed[key], 1)
        w = e.get("winner") if e else None
        return w if w in FORMATS[fmt].candidates else FORMATS[fmt].default

    def seconds(self, fmt: str, N: int, K: int, rows: int = 1) -> float | None:
        """The measured time of the fastest candidate (None when unmeasured or nothing ran)."""
        e = self.lookup(fmt, N, K, rows)
        if not e or not e.get("us"):
            return None
        return min(e["us"].values()) / 1e6


_TABLE: list[KernelTable | None] = [None]


def kernel_table() -> KernelTable:
    """The process's table (made on first use; a changed cache folder or thread count gives a new one)."""
    t, key = _TABLE[0], machine_key()
    if t is None or t.key != key or t.path != table_path(key):
        t = _TABLE[0] = KernelTable(key)
    return t


def reset_kernel_table() -> None:
    _TABLE[0] = None


cpu_ext.use_machine(key=machine_key, rotate_bytes=rotate_bytes, tuning=tuning_enabled, tune_env=TUNE_ENV)
