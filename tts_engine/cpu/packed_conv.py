"""oneDNN convolutions of the codec decoder with their weights reordered once, in channels-last activations.

`aten.mkldnn_convolution` with a plain weight reorders the weight into oneDNN's blocked layout on every call. For
the decoder's streaming chunks that reorder is most of the work: the first decoder block's transposed conv (a 1x1
conv with 12288 output channels, 38 MB in bf16) took ~40 ms per call on a 2-core Zen 4 for a 1-frame chunk, ~1 ms
with the weight reordered once and the activations channels-last (time-major, [B, L, C] in memory).

The blocked layout oneDNN wants depends on the input's shape (and on the ISA and thread count). A weight reordered
for one input length and used with another of a different layout class is *not* rejected: it takes a slow path
(measured 100-200x slower). So a `PackedConv` reorders the weight for every distinct (batch, length, threads) it
sees, up to `MAX_SHAPES`, and shares one copy among shapes whose reordered bytes are equal (most lengths share one
of two or three layouts). Inputs longer than `max_len` (offline decodes) are not handled (the caller uses aten).

Whether this path is used at all is measured on the machine at hand (`dtype_choice`), not assumed; a decoder
never uses it unless `CodecDecoder.set_conv_mode("packed")` was called. Any failure of the oneDNN calls (an old
torch without these ops, a CPU without oneDNN) turns the module's packing off for good and returns None.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import threading

import torch

log = logging.getLogger("tts_engine")

MAX_SHAPES = 64   # distinct (batch, length, threads) per conv; beyond it, aten's path


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
            and hasattr(torch._C._nn, "mkldnn_reorder_conv2d_weight"))


def _digest(packed: torch.Tensor) -> bytes | None:
    """Hash of a reordered weight's raw bytes (None where torch cannot give them: then copies are not shared)."""
    try:
        ptr, n = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
        return hashlib.blake2b(ctypes.string_at(ptr, n), digest_size=16).digest()
    except Exception:   # noqa: BLE001 - optional sharing
        return None


class PackedConv:
    """One conv1d (weight [C_out, C_in/groups, k], stride 1, no padding) run through oneDNN with a reordered
    weight. `__call__(x [B, C_in, L])` -> [B, C_out, L - (k-1)*dilation] in channels-last strides, or None."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int, groups: int, max_len: int):
        self.w4 = weight.detach().unsqueeze(2)            # [C_out, C_in/g, 1, k]
        self.bias = None if bias is None else bias.detach()
        self.dilation, self.groups, self.max_len = int(dilation), int(groups), int(max_len)
        self._by_shape: dict = {}
        self._by_digest: dict = {}
        self._lock = threading.Lock()
        self.broken = False

    def _packed(self, B: int, C: int, L: int) -> torch.Tensor:
        key = (B, L, torch.get_num_threads())
        p = self._by_shape.get(key)
        if p is None:
            with self._lock:
                p = self._by_shape.get(key)
                if p is None:
                    p = torch._C._nn.mkldnn_reorder_conv2d_weight(
                        self.w4.to_mkldnn(), [0, 0], [1, 1], [1, self.dilation], self.groups, [B, C, 1, L])
                    d = _digest(p)
                    if d is not None:
                        p = self._by_digest.setdefault(d, p)
                    self._by_shape[key] = p
        return p

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor | None:
        """conv(x) (+ `add`, [B, C_out, L_out] in x's dtype, summed inside oneDNN's call: one pass less)."""
        B, C, L = x.shape
        if self.broken or L > self.max_len or x.dtype != self.w4.dtype or (
                len(self._by_shape) >= MAX_SHAPES and (B, L, torch.get_num_threads()) not in self._by_shape):
            return None
        x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)   # [B, C, 1, L], time-major in memory
        try:
            w = self._packed(B, C, L)
            if add is not None:
                a4 = add.unsqueeze(2).contiguous(memory_format=torch.channels_last)
                y = torch.ops.mkldnn._convolution_pointwise.binary(
                    x4, a4, w, self.bias, [0, 0], [1, 1], [1, self.dilation], self.groups, "add", 1.0, None, [], None)
            else:
                y = torch.ops.mkldnn._convolution_pointwise(x4, w, self.bias, [0, 0], [1, 1],
                                                            [1, self.dilation], self.groups, "none", [], "")
        except Exception as e:   # noqa: BLE001 - this torch/CPU cannot: aten's path from now on
            log.warning("codec: packed oneDNN convolution unavailable (%s); using aten's", e)
            self.broken = True
            return None
        return y.squeeze(2)

    def __deepcopy__(self, memo):
        """A copied decoder has its own weights (new storage), so its convs pack them anew (`_Packable._packer`
        keys on the weight's storage); oneDNN's blocked tensors cannot be deep-copied anyway."""
        return None

    @property
    def copies(self) -> int:
        """Distinct reordered weights held (shapes sharing a layout share one)."""
        return len({id(p) for p in self._by_shape.values()})
