"""Weight-only quantisation of the talker's and the code predictor's linear layers (CPU).

At one stream the talker (~440 M weights read once per frame) and the code predictor (~80 M weights read 15
times per frame) are bound by the bytes of weight they read. Storing those weights in int8 or int4 cuts the
bytes 4x or 8x against fp32. Embedding tables stay gathers (a frame reads 16 rows, not the table) and the
text projection stays dense (it runs only while building a prompt).

Modes:
  "int8"  per-output-channel symmetric: w[n, :] ~= q[n, :] * scale[n], q in [-127, 127].
          Matmul: `torch.ops.aten._weight_int8pack_mm(x, q, scale)`.
  "int4"  group-wise asymmetric (groups of INT4_GROUP input columns, 16 levels from the group's min to its
          max): w[n, g*G:(g+1)*G] ~= (q - 8) * scale[g, n] + zero[g, n], zero = min + 8 * scale.
          Matmul: `torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, scale_and_zero)`, weights packed
          once by `torch.ops.aten._convert_weight_to_int4pack_for_cpu`.

  "w8a8"  the int8 weights of "int8" (per output channel) and int8 activations: each input row rounded to int8 on
          its own absmax grid per call (a row's result never depends on the rest of the batch), int32 (or fp32)
          sums, both scales applied after. The kernel (`torch._int_mm` on the transposed view of [N, K], or the
          weight-only int8 kernel fed the int8 activation) is chosen per shape by measuring both on the CPU at
          hand (`kernels.KernelTable`, remembered per machine in the cache folder).

  "w4a8"  the int4 weights of "int4" (same groups, scales and zeros) x int8 activations (rounded per row as in
          "w8a8"): our own kernel only (`cpu_ext.w4a8`, AVX-512 VNNI or AVX2: int32 sums per group, then the group's scale
          and zero); on a CPU or machine where that kernel cannot run the mode is not offered (`available_modes`).

The weight-only kernels are vectorised for bf16 activations only (measured on a 2-core Zen 4 with one input row: fp32
activations read 1.5-2 GB/s of weight, bf16 activations 13-35 GB/s), so the quantised matmuls take bf16
inputs (MATMUL_DTYPE) whatever the engine's activation dtype, and give back that dtype: the rest of the
model (norms, attention, residual stream, KV caches) keeps the engine's dtype.

Where the quantised weights are born: `quantize_talker`, called once by `Qwen3TTSModel` after the checkpoint
is loaded (and after any load-time rewrite of the layers, such as fused projections: every `nn.Linear` found
under the quantised roots is swapped, whatever its shape). The dense weights they replace are dropped.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from tts_engine.errors import TTSError

# The kernels of the "w8a8" and "w4a8" layouts, our own CPU code: `cpu_ext` (packing, the W4A8 kernel) and `kernels`
# (the kernel table measured on this machine, the W8A8 kernels). Set when tts_engine.cpu is imported
# (`tts_engine.cpu.backend.set_hooks`); the int8 and int4 layouts use PyTorch's own kernels and need neither.
cpu_ext = None
kernels = None


def _own_kernels() -> None:
    """Raise a clear error where a layout that needs our own kernels is built before tts_engine.cpu was imported."""
    if cpu_ext is None or kernels is None:
        raise TTSError("the w8a8 and w4a8 layouts need the CPU package's kernels: import tts_engine.cpu first")

QUANT_MODES = ("int8", "int4", "w8a8", "w4a8")   # every lossy mode, in one place (app, CLI, bench, auto enumerate it)
INT4_GROUP = 64          # input columns per int4 scale/zero pair (see docs/benchmarks.md for the choice)
INT4_INNER_K_TILES = 8   # packing layout of the CPU int4 kernel
MATMUL_DTYPE = torch.bfloat16
INT8_DENSE_ROWS = 32     # from this many input rows (prompt prefill) int8 runs as a bf16 GEMM on q (see Int8Linear)
_dense_rows = [INT8_DENSE_ROWS]


@contextmanager
def decode_kernels_only():
    """Within this block every int8 matmul takes the decode kernel whatever its row count, so that a batched
    measurement (tts_engine.cpu.talker_quality) sees the numerics of frame-by-frame decoding. Not for a running engine."""
    saved = _dense_rows[0]
    _dense_rows[0] = 1 << 62
    try:
        yield
    finally:
        _dense_rows[0] = saved


def parse_quantize(quantize) -> str | None:
    """None / "none" / "" / "fp" -> None; "int8" / "int4" -> the mode; anything else -> TTSError."""
    if quantize is None:
        return None
    q = str(quantize).strip().lower()
    if q in ("", "none", "off", "no"):
        return None
    if q == "auto":
        raise TTSError("quantize='auto' is resolved by Qwen3TTSModel.from_pretrained / TTSEngine.from_pretrained")
    if q not in QUANT_MODES:
        raise TTSError(f"unknown quantize mode {quantize!r}; use one of: {', '.join(QUANT_MODES)} "
                       "(or leave it unset for the checkpoint's own weights)")
    return q


class Int8Linear(nn.Module):
    """Weight-only int8 linear: y = (x @ q.T) * scale (+ bias). q [N, K] int8, scale [N] (bf16)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                        # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)          # [N, K]
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scale", scale.to(MATMUL_DTYPE))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by [N, K] (fp32), for tests and error bounds."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, lead = x.dtype, x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(MATMUL_DTYPE).contiguous()         # [M, K]
        if x2.shape[0] < _dense_rows[0]:   # decode: weight-bound, the int8 kernel reads 1 byte per weight
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)     # [M, N]
        else:   # prefill: the int8 kernel is no GEMM (~2x slower than bf16 at 150 rows); q is exact in bf16
            y = torch.nn.functional.linear(x2, self.qweight.to(MATMUL_DTYPE)) * self.scale
        y = y.to(dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class W8A8Linear(nn.Module):
    """int8 weights x int8 activations: y = (xq @ q.T) * amax_row * scale[n] / 127 (+ bias).
    q [N, K] int8 and scale [N] as in Int8Linear; the activation is rounded per row per call
    (`kernels.quantize_rows`). The kernel of each row bucket is the one measured fastest here
    (`kernels.KernelTable.choice`; its default where the table has no entry). Where our own kernel ("vnni",
    `cpu_ext`) is chosen the layer holds q in that kernel's layout (`packed`), and holds q as [N, K] (`qweight`)
    only if another bucket's kernel needs it. Prompt prefills (more than kernels.MAX_DECODE_ROWS rows) take our
    kernel where the layer holds it, else `torch._int_mm`; both are exact int32 sums, so every kernel gives the
    same numbers up to the float rounding of the result."""

    def __init__(self, linear: nn.Linear, table: "kernels.KernelTable | None" = None):
        super().__init__()
        w = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                        # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.register_buffer("scale127", scale / 127.0)                              # fp32 [N]
        self.register_buffer("scale127_bf16", (scale / 127.0).to(torch.bfloat16))   # the int8pack kernel's scale
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        _own_kernels()
        table = table or kernels.kernel_table()
        self.kernel_names = {b: table.choice("w8a8", self.out_features, self.in_features, b)
                             for b in kernels.ROW_BUCKETS}
        self.register_buffer("qweight", None)
        self.register_buffer("packed", None)
        self.set_int8_weight(q)

    def set_int8_weight(self, q: torch.Tensor) -> None:
        """Hold the int8 weight q [N, K] in the layout(s) the chosen kernels read."""
        names, own = set(self.kernel_names.values()), set(kernels.OWN_PACKED)
        self.packed = cpu_ext.pack(q) if names & own else None
        self.qweight = q.contiguous() if names - own else None
        cands = kernels.FORMATS["w8a8"].candidates
        self._by_bucket = {b: (cands[n], self.packed if n in own else self.qweight)
                           for b, n in self.kernel_names.items()}
        self._prefill = (kernels.w8a8_vnni, self.packed) if self.packed is not None else \
            (kernels.w8a8_int_mm, self.qweight)

    def int8_weight(self) -> torch.Tensor:
        """q [N, K] int8, whatever layout the layer holds it in."""
        if self.qweight is not None:
            return self.qweight
        return cpu_ext.unpack(self.packed, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by [N, K] (fp32)."""
        return self.int8_weight().float() * (self.scale127 * 127.0)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, lead = x.dtype, x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if m > kernels.MAX_DECODE_ROWS and _dense_rows[0] < (1 << 62):
            fn, w = self._prefill
        else:
            fn, w = self._by_bucket[kernels.row_bucket(m)]
        y = fn(x2, w, self.scale127, self.scale127_bf16).to(dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 weights x int8 "
                f"activations, kernels {self.kernel_names}")


def int4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (fp32) -> (q [N, K] int32 in 0..15, scale_zero [K/G, N, 2] bf16): group-wise asymmetric, 16 levels
    from each group's min to its max, w ~= (q - 8) * scale + zero (the "int4" and "w4a8" modes)."""
    N, K = w.shape
    wg = w.reshape(N, K // group, group)
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)                                      # [N, K/G, 1]
    q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).reshape(N, K)
    zero = lo + 8.0 * scale
    sz = torch.stack([scale.reshape(N, K // group), zero.reshape(N, K // group)], dim=-1)  # [N, K/G, 2]
    return q, sz.transpose(0, 1).contiguous().to(MATMUL_DTYPE)


class Int4Linear(nn.Module):
    """Weight-only int4 linear, group-wise asymmetric. packed: the CPU kernel's layout of q [N, K] (0..15);
    scale_zero [K/G, N, 2] (bf16): per group and output channel, (scale, zero)."""

    def __init__(self, linear: nn.Linear, group: int | None = None):
        super().__init__()
        group = group or INT4_GROUP
        w = linear.weight.detach().float()
        N, K = w.shape
        self.in_features, self.out_features, self.group = K, N, group
        q, sz = int4_quantize(w, group)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES))
        self.register_buffer("scale_zero", sz)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @staticmethod
    def supports(linear: nn.Linear, group: int | None = None) -> bool:
        """The CPU kernel needs N % 16 == 0 and K % group == 0; other layers stay dense."""
        return linear.out_features % 16 == 0 and linear.in_features % (group or INT4_GROUP) == 0

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by [N, K] (fp32), read back through the kernel itself."""
        eye = torch.eye(self.in_features, dtype=MATMUL_DTYPE)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zero).float().T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, lead = x.dtype, x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(MATMUL_DTYPE).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scale_zero)
        y = y.to(dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 groups of {self.group}")


class W4A8Linear(nn.Module):
    """int4 weights (quantised as Int4Linear: groups of cpu_ext.INT4_GROUP input columns, bf16 scale and zero each)
    x int8 activation rows (rounded per row per call, as W8A8Linear), in one call of our own kernel
    (`cpu_ext.w4a8`; weights held in its layout only, `packed4`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        _own_kernels()
        w = linear.weight.detach().float()
        N, K = w.shape
        self.in_features, self.out_features, self.group = K, N, cpu_ext.INT4_GROUP
        q, sz = int4_quantize(w, self.group)
        self.register_buffer("packed4", cpu_ext.pack4(q, sz))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        _own_kernels()
        return linear.in_features % cpu_ext.INT4_GROUP == 0

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by [N, K] (fp32), read back through the kernel: row k of the identity
        rounds to 127 at k, so column k of the result is the weight (to fp32 rounding)."""
        eye = torch.eye(self.in_features)
        return cpu_ext.w4a8(eye, self.packed4, self.out_features).T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, lead = x.dtype, x.shape[:-1]
        y = cpu_ext.w4a8(x.reshape(-1, self.in_features), self.packed4, self.out_features)
        y = y.to(dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group} "
                "x int8 activations")


def available_modes() -> tuple[str, ...]:
    """The lossy modes that run here: every mode of QUANT_MODES, but "w4a8" only where our own kernels do."""
    return tuple(m for m in QUANT_MODES if m != "w4a8" or (cpu_ext is not None and cpu_ext.has_w4a8()))


def quantize_linear(linear: nn.Linear, mode: str, group: int | None = None) -> nn.Module:
    """One nn.Linear -> its quantised replacement (or the layer itself where the kernel cannot take its shape).
    group: int4 group size (default INT4_GROUP)."""
    if mode == "int8":
        return Int8Linear(linear)
    if mode == "int4":
        return Int4Linear(linear, group) if Int4Linear.supports(linear, group) else linear
    if mode == "w8a8":
        return W8A8Linear(linear)
    if mode == "w4a8":
        return W4A8Linear(linear) if W4A8Linear.supports(linear) else linear
    raise TTSError(f"unknown quantize mode {mode!r}")


def quantize_module(root: nn.Module, mode: str, group: int | None = None) -> int:
    """Swap every nn.Linear below `root` (or `root` itself is left alone) for its quantised form, in place.
    Returns the number of layers swapped."""
    return sum(_swap(parent, name, mode, group) for parent in list(root.modules())
               for name, _ in list(parent.named_children()))


def _swap(parent: nn.Module, name: str, mode: str, group: int | None) -> int:
    """Replace `parent.<name>` by its quantised form if it is an nn.Linear the kernel takes; -> 1 if swapped."""
    child = getattr(parent, name)
    if not isinstance(child, nn.Linear):
        return 0
    new = quantize_linear(child, mode, group)
    if new is child:
        return 0
    setattr(parent, name, new)
    return 1


def quantize_talker(talker: nn.Module, mode: str | None, group: int | None = None) -> int:
    """Quantise, in place, the per-frame linear layers of a loaded `Talker`: its decoder stack and codec_head,
    the code predictor's decoder stack, lm_heads and small_to_mtp_projection. Returns the number of layers
    swapped (0 for mode None). group: int4 group size (default INT4_GROUP)."""
    mode = parse_quantize(mode)
    if mode is None:
        return 0
    if talker.model.norm.weight.device.type != "cpu":
        raise TTSError("quantize is implemented for the CPU only (its int8/int4 kernels are CPU kernels); "
                       "on a GPU run bf16 without quantize")
    if mode in ("w8a8", "w4a8"):
        _own_kernels()
    if mode == "w4a8" and not cpu_ext.has_w4a8():
        raise TTSError(f"quantize='w4a8' needs our own CPU kernels (AVX2 + FMA or AVX-512 VNNI), which do not run here "
                       f"({cpu_ext.why_unavailable() or cpu_ext.isa()}); use int4")
    cp = talker.code_predictor
    # one matmul for q/k/v and one for gate/up: fewer kernel calls per layer; per-channel (int8) and per-row-group
    # (int4) quantisation of the stacked rows is the quantisation of each part
    talker.fuse_projections()
    if mode == "w8a8":   # time the kernels of every shape about to be built, once per machine (kernels.py)
        kernels.kernel_table().ensure("w8a8", [(m.out_features, m.in_features) for m in frame_linears(talker)])
    n = quantize_module(talker.model.layers, mode, group) + quantize_module(cp.model.layers, mode, group)
    n += quantize_module(cp.lm_head, mode, group)
    n += _swap(talker, "codec_head", mode, group) + _swap(cp, "small_to_mtp_projection", mode, group)
    return n


def frame_linears(talker: nn.Module) -> list[nn.Linear]:
    """The dense nn.Linear layers `quantize_talker` swaps (after fusing): what a frame reads at one stream."""
    cp = talker.code_predictor
    roots = [talker.model.layers, cp.model.layers, cp.lm_head]
    out = [m for r in roots for m in r.modules() if type(m) is nn.Linear]
    out += [m for m in (talker.codec_head, cp.small_to_mtp_projection) if type(m) is nn.Linear]
    return out


def precision_label(dtype: torch.dtype, quantize: str | None) -> str:
    """A short label for the app, the API and the CLI: "fp32", "bf16", "int8 weights (bf16 activations)",
    "int4 weights (bf16 matmuls, fp32 elsewhere)"."""
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    if quantize is None:
        return name
    mm = {torch.bfloat16: "bf16"}[MATMUL_DTYPE]
    if quantize in ("w8a8", "w4a8"):
        return f"int{quantize[1]} weights x int8 activations" + ("" if name == mm else f" ({name} elsewhere)")
    if name == mm:
        return f"{quantize} weights ({mm} activations)"
    return f"{quantize} weights ({mm} matmuls, {name} elsewhere)"
