"""int8 convolutions of the codec decoder (oneDNN's u8 x s8 kernels, VNNI where the CPU has it), a lossy option.

The decoder's convolutions are compute bound: in bf16 on a 2-core Zen 4 they ran at ~150-180 GFLOP/s per core, most
of bf16's peak, so no bf16 layout can make them much cheaper; int8 dot products (AVX-512 VNNI `vpdpbusd`) have twice
bf16's rate. An `Int8Conv` holds the weight quantised once (int8, symmetric, one scale per output channel) and
prepacked by oneDNN; each call quantises its input to uint8 (one scale and zero point for the whole tensor, from
its min/max: `cpu_ext.quant_u8`, or aten's ops where our kernels do not build) and runs `onednn.qconv_pointwise`,
which gives the output in the input's dtype (int32 accumulation, scaled, + the bias in fp32). Small calls (fewer than
`min_positions` output positions per row: measured per conv on the CPU at hand, `int8_threshold`, else MIN_POSITIONS)
take the packed conv of the model's dtype instead.

Row by row: each row of a batch is quantised and convolved on its own (one oneDNN call per row), so a stream's audio
does not depend on which other streams' chunks it was decoded with (one scale for the whole batch would make it
depend on their loudness, and a batch's total length would pick the path): decoding in a batch gives the samples
of decoding alone. The rows of a batch run either in one oneDNN call per row, or in ONE call for the batch
(`int8_batch`): each row quantised with its own scale and zero point, oneDNN's int32 sums of all rows given as fp32
with scales 1 and one zero point, and our epilogue (`cpu/csrc/codec_int8_rows.cpp`) finishing each row with its own
zero point, scale and bias in the very fp32 operations of oneDNN's epilogue: the same bits as the row's own call (a
row whose sums pass 2^24, beyond fp32's exact integers, is redone with its own call). Which way is faster depends on
the call's size (the row calls' fixed costs against the fp32 sums' memory traffic) and on the CPU, so each conv
measures both as it runs (`PathClock`; TTS_CODEC_INT8_BATCH=rows|batched forces one).

Lossy: its error against the fp32 decoder is measured (`codec.quality`) before it may be chosen automatically
(`dtype_choice`). Any failure of the oneDNN calls (a torch without these ops) turns the conv's int8 path off for good
and takes the packed conv of the model's dtype from then on.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import torch

from tts_engine.cpu import cpu_ext

log = logging.getLogger("tts_engine")


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "onednn")
            and hasattr(torch.ops.onednn, "qconv_pointwise") and hasattr(torch.ops.onednn, "qconv_prepack"))


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """x (fp32/bf16, dense) -> (uint8 with x's strides, scale, zero point): asymmetric, per tensor, range incl. 0."""
    got = cpu_ext.quant_u8(x)
    if got is not None:
        return got
    lo, hi = torch.aminmax(x)
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / 255.0
    if not scale > 0.0 or scale != scale or scale == float("inf"):
        scale = 1.0
    zp = int(round(-lo / scale))
    q = torch.clamp(torch.floor(x.float() * (1.0 / scale) + (zp + 0.5)), 0, 255).to(torch.uint8)
    return q, scale, zp


def weight_levels() -> int:
    """127 where the CPU has VNNI (AVX512-VNNI or AVX-VNNI: u8 x s8 products summed in int32), else 63: without
    VNNI oneDNN's u8 x s8 kernels sum pairs of products in saturating int16 (`vpmaddubsw`; 2 x 255 x 127 overflows),
    which cost ~12 dB of SNR on an emulated Haswell; 7-bit weights cannot overflow (2 x 255 x 63 < 32768)."""
    from tts_engine.cpu.cpu_info import cpu_info

    flags = cpu_info().flags
    return 127 if ("avx512_vnni" in flags or "avx_vnni" in flags) else 63


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[C_out, C_in/g, k] -> (int8 weight, fp32 scales [C_out]); symmetric per output channel (-L..L, L =
    `weight_levels()`)."""
    lv = float(weight_levels())
    w = weight.detach().float()
    scales = (w.abs().amax(dim=tuple(range(1, w.dim()))) / lv).clamp(min=1e-12)
    q = torch.round(w / scales.view(-1, *([1] * (w.dim() - 1)))).clamp(-lv, lv).to(torch.int8)
    return q, scales


# --- a batch in one call: each row with its own scale and zero point, the same bits as row by row ---------------


def _declare(lib) -> None:
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ttsc_quant_rows.argtypes, lib.ttsc_quant_rows.restype = [P, I, I64, I64, P, P, I], None
    lib.ttsc_int8_epilogue.argtypes = [P, I64, I64, I64, P, P, P, P, P, I, P, P, P, I]
    lib.ttsc_int8_epilogue.restype = None
    lib.ttsx_snake_isa.restype = I


rows_library = cpu_ext.Beside(_declare)
_rows_state: dict = {}


def batched_available() -> bool:
    """Whether one call can convolve a batch with per-row scales here (our epilogue kernel builds and oneDNN's int8
    convolution exists); False for good after a failure."""
    if "ok" not in _rows_state:
        if cpu_ext.building():
            return False   # our kernels are being built in the background: asked again once they are loaded
        try:
            lib = rows_library() if available() else None
            _rows_state["isa"] = None if lib is None else int(lib.ttsx_snake_isa())
            _rows_state["ok"] = lib is not None
        except Exception as e:   # noqa: BLE001 - no compiler, a CPU without AVX2: the row-by-row calls stay
            log.info("codec: int8 convolutions stay row by row (%s)", e)
            _rows_state["ok"] = False
    return _rows_state["ok"]


# Output positions (samples of one row) of one call below which the int8 convolution is not used (the call takes the
# packed bf16/fp32 conv instead): on a 2-core Zen 4 (1 thread, torch 2.13) oneDNN's u8 x s8 conv took 2x the packed
# bf16 conv's time at 32 positions (a one-stream first chunk in the first decoder block) and 0.75x at 160, 0.5x at
# 1700 and more (the weight-read-bound small calls gain nothing from int8 here; the compute-bound large ones do).
# The default where nothing was measured (`int8_threshold`: TTS_KERNEL_TUNE=0, or before it ran).
MIN_POSITIONS = 128

# Which way a call of several rows runs: "rows" (default) one oneDNN call per row, "auto" measures both per conv as the
# decoder runs (`PathClock`), "batched" always one call for the batch (where it can run here). The default is "rows":
# in a quiet A/B (Zen 4, four streams of 24 and 48 frames) "auto" came out 10-13 % behind "rows" in the engine, though
# the codec alone spent 3-15 % less CPU batched (docs/bench-history.md).
BATCH_ENV = "TTS_CODEC_INT8_BATCH"


def batch_setting() -> str:
    v = os.environ.get(BATCH_ENV, "rows").strip().lower()
    return v if v in ("auto", "batched") else "rows"


def _thread_clock():
    """The clock a call is timed with: this thread's CPU time where its ops run on one intra-op thread (the codec
    thread's: a busy machine's preemptions then do not count), else the wall clock."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


class PathClock:
    """Per conv: whether a call of B rows x L output positions runs faster row by row or as one batched call,
    measured as the decoder runs (both give the same bits, so a switch changes nothing but time). Calls are keyed by
    (B, L's power of two, clock) and timed per output position (`_thread_clock`). A key starts with the way `prior`
    says, and times the other one every `interval` calls (EXPLORE, doubled up to MAX_INTERVAL while it stays slower, x4 while it takes more
    than FAR times the other: a short stream must not pay much for timing a way that loses); the faster running average
    (weight ALPHA) is taken. On a 2-core Zen 4 (one thread, bf16, four rows, under load) one call took 0.5-0.8x the
    row calls' time up to ~1M outputs per row (the row calls' fixed costs), and 1.2-3.7x above ~1.5M (its fp32 sums
    of all rows no longer stay in the cache): the prior is the batched call while those sums take at most
    PRIOR_BYTES. The whole 0.6b decoder at four rows then took 7-15 % less CPU time per frame than row by row on
    chunks of 1-4 frames, the same on 8, and 6 % less on 12 (where always-batched took 17 % more)."""

    EXPLORE, MAX_INTERVAL, ALPHA, FAR = 4, 64, 0.3, 1.5
    PRIOR_BYTES = 16 << 20

    def __init__(self):
        self._keys: dict = {}

    @staticmethod
    def key(rows: int, positions: int) -> tuple:
        return rows, int(positions).bit_length()

    def batched(self, key: tuple, prior: bool) -> bool:
        """Run this call as one batched call? (`prior`: the guess for a key not timed yet.)"""
        s = self._keys.get(key)
        if s is None:
            s = self._keys[key] = {"ema": [None, None], "n": [0, 0], "calls": 0, "interval": self.EXPLORE,
                                   "next": self.EXPLORE, "prior": int(prior)}
        s["calls"] += 1
        best = self._best(s)
        if s["calls"] >= s["next"]:
            s["next"] = s["calls"] + s["interval"]
            return not best
        return bool(best)

    def record(self, key: tuple, batched: bool, seconds_per_position: float) -> None:
        s = self._keys.get(key)
        if s is None:
            return
        way, before = int(batched), self._best(s)
        e = s["ema"][way]
        s["ema"][way] = seconds_per_position if e is None else e + self.ALPHA * (seconds_per_position - e)
        s["n"][way] += 1
        if way != before:   # an exploration: soon again if it won, else less often (far less if it lost by far)
            other = s["ema"][before]
            grow = 4 if other is not None and s["ema"][way] > self.FAR * other else 2
            s["interval"] = self.EXPLORE if self._best(s) == way else min(grow * s["interval"], self.MAX_INTERVAL)

    @staticmethod
    def _best(s: dict) -> int:
        rows, one = s["ema"]
        if rows is None or one is None:   # the way timed so far (the prior before either is)
            return s["prior"] if rows is None and one is None else int(rows is None)
        return 1 if one <= rows else 0

    def snapshot(self) -> dict:
        """{(rows, L bit length): {"rows_ns": .., "batched_ns": .. per output position, "calls": ..}} (benchmarks)."""
        ns = lambda v: None if v is None else round(1e9 * v, 3)   # noqa: E731
        return {k: {"rows_ns": ns(s["ema"][0]), "batched_ns": ns(s["ema"][1]), "calls": s["calls"]}
                for k, s in self._keys.items()}


class Int8Conv:
    """One conv1d (weight [C_out, C_in/groups, k], stride 1, no padding) in int8. `__call__(x [B, C_in, L])` ->
    [B, C_out, L - (k-1)*dilation] in x's dtype (channels-last strides), or None. `bias` may be replaced (fp32 kept).
    Calls of fewer than `min_positions` output positions per row (None: MIN_POSITIONS), and every call after an int8
    failure, go to `fallback` (a `packed_conv.PackedConv` of the same weight in its own dtype). Rows are quantised
    and convolved one by one (the module's doc)."""

    min_positions: int | None = None   # set from the measured threshold of this conv (`int8_threshold`)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int, groups: int, max_len: int):
        from tts_engine.cpu.packed_conv import PackedConv

        self.fallback = PackedConv(weight, bias, dilation, groups, max_len)
        qw, self.w_scales = quantize_weight(weight)
        self.qw4 = qw.unsqueeze(2)                          # [C_out, C_in/g, 1, k]
        self.c_out = int(weight.shape[0])
        self.w_zps = torch.zeros(self.c_out, dtype=torch.int64)
        self.bias = bias
        self.dilation, self.groups, self.max_len = int(dilation), int(groups), int(max_len)
        self._packed = None
        self._ones = self._sumw = None          # (int8_batch: unit scales, and each output channel's weight sum)
        self.clock = PathClock()                # a batch's calls: row by row or in one call, measured
        self._lock = threading.Lock()
        self.broken = False

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    @bias.setter
    def bias(self, b: torch.Tensor | None) -> None:
        if b is not None and b is getattr(self, "_bias_src", None):
            return                                   # (the transposed convs set the same tensor on every call)
        self._bias_src = b
        self._bias = None if b is None else b.detach().float().contiguous()
        if getattr(self, "fallback", None) is not None:
            self.fallback.bias = None if b is None else b.detach()

    def _weight(self) -> torch.Tensor:
        if self._packed is None:
            with self._lock:
                if self._packed is None:
                    self._packed = torch.ops.onednn.qconv_prepack(
                        self.qw4, self.w_scales, 1.0, 0, [1, 1], [0, 0], [1, self.dilation], self.groups, None)
        return self._packed

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor | None:
        """conv(x) (+ `add`, [B, C_out, L_out] in x's dtype)."""
        if x.shape[-1] > self.max_len or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        k = self.qw4.shape[-1]
        least = MIN_POSITIONS if self.min_positions is None else self.min_positions
        if self.broken or x.shape[-1] - (k - 1) * self.dilation < least:
            return self.fallback(x, add)
        x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)       # [B, C, 1, L], time-major
        rows, positions = x.shape[0], x.shape[-1] - (k - 1) * self.dilation
        way = batch_setting() if rows > 1 and batched_available() else "rows"
        if way != "rows":
            clock = _thread_clock()                                              # (CPU time at one thread)
            key = self.clock.key(rows, positions) + (clock is time.thread_time,)
            prior = rows * positions * self.c_out * 4 <= PathClock.PRIOR_BYTES
            if way == "batched" or self.clock.batched(key, prior):
                try:
                    t0 = clock()
                    y = self.int8_batch(x4, add)
                    self.clock.record(key, True, (clock() - t0) / (rows * positions))
                    return y
                except Exception as e:   # noqa: BLE001 - never fatal: the row-by-row calls from now on
                    log.warning("codec: int8 convolution of a batch in one call failed (%s); row by row", e)
                    _rows_state["ok"] = False
        t0 = clock() if way == "auto" else 0.0
        try:
            out = [self.int8_row(x4[i:i + 1]) for i in range(rows)]               # each row on its own
        except Exception as e:   # noqa: BLE001 - this torch/CPU cannot: the bf16/fp32 path from now on
            log.warning("codec: int8 oneDNN convolution unavailable (%s); using the %s path", e, x.dtype)
            self.broken = True
            return self.fallback(x, add)
        y = (out[0] if rows == 1 else torch.cat(out)).squeeze(2)                 # (channels-last kept)
        y = y if add is None else y + add
        if way == "auto":
            self.clock.record(key, False, (clock() - t0) / (rows * positions))
        return y

    def int8_batch(self, x4: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [B, C_in, 1, L] (channels-last) -> conv [B, C_out, L_out] (+ add) in x4's dtype, in ONE oneDNN call
        with each row's own scale and zero point: the same bits as `int8_row` row by row (codec_int8_rows.cpp)."""
        lib, isa = rows_library(), _rows_state["isa"]
        B, C, _, L = x4.shape
        bf16 = int(x4.dtype == torch.bfloat16)
        q = torch.empty_like(x4, dtype=torch.uint8)                              # (x4's channels-last strides)
        sz = torch.empty(B, 2, dtype=torch.float32)                              # per row: scale, zero point
        lib.ttsc_quant_rows(x4.data_ptr(), bf16, B, C * L, q.data_ptr(), sz.data_ptr(), isa)
        zps = sz[:, 1].to(torch.int32)
        z = int(zps.median())                                                    # the call's one zero point
        if self._ones is None:
            self._ones = torch.ones(self.c_out, dtype=torch.float32)
            self._sumw = self.qw4.to(torch.int32).sum(dim=(1, 2, 3), dtype=torch.int32).contiguous()
        f = torch.ops.onednn.qconv_pointwise(   # int32 sums of (q - z) * w as fp32 (scales 1, no bias)
            q, 1.0, z, self._weight(), self._ones, self.w_zps, None, [1, 1], [0, 0], [1, self.dilation],
            self.groups, 1.0, 0, torch.float32, "none", [], "")
        f = f.contiguous(memory_format=torch.channels_last)                      # [B, C_out, 1, L_out]
        lo = f.shape[-1]
        y = torch.empty(B, lo, self.c_out, dtype=x4.dtype)                      # time-major
        fused = add is not None and add.dtype == x4.dtype and add.shape == (B, self.c_out, lo) and \
            add.transpose(1, 2).is_contiguous()
        dz = (z - zps).contiguous()
        scales = sz[:, 0].contiguous()
        bad = torch.zeros(B, dtype=torch.int32)
        b = self._bias
        lib.ttsc_int8_epilogue(f.data_ptr(), B, lo, self.c_out, dz.data_ptr(), scales.data_ptr(),
                               self._sumw.data_ptr(), self.w_scales.data_ptr(), None if b is None else b.data_ptr(),
                               bf16, add.data_ptr() if fused else None, y.data_ptr(), bad.data_ptr(), isa)
        y = y.transpose(1, 2)                                                    # [B, C_out, L_out]
        for r in bad.nonzero().flatten().tolist():   # a sum beyond fp32's exact integers: this row alone
            yr = self.int8_row(x4[r:r + 1]).squeeze(2)
            y[r:r + 1].copy_(yr if not fused else yr + add[r:r + 1])
        return y if add is None or fused else y + add

    def int8_row(self, x4: torch.Tensor) -> torch.Tensor:
        """One row [1, C_in, 1, L] (channels-last) -> [1, C_out, 1, L_out] in its dtype, through oneDNN in int8."""
        q, scale, zp = quantize_input(x4)
        return torch.ops.onednn.qconv_pointwise(
            q, scale, zp, self._weight(), self.w_scales, self.w_zps, self._bias, [1, 1], [0, 0],
            [1, self.dilation], self.groups, 1.0, 0, x4.dtype, "none", [], "")

    def __deepcopy__(self, memo):
        return None   # (like PackedConv: a copied decoder packs its own weights)
