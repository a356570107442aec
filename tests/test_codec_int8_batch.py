"""The codec's int8 convolutions of a batch in ONE oneDNN call with each row's own scale and zero point
(`Int8Conv.int8_batch`, tts_engine/cpu/csrc/codec_int8_rows.cpp) give every row the bits of the row-by-row calls
(`int8_row`), in bf16 and fp32, with and without the residual sum, on the AVX-512 and the scalar epilogue; a row whose
int32 sums pass fp32's exact integers is redone row by row; `PathClock` takes the faster way."""
from __future__ import annotations

import pytest
import torch

from tts_engine.cpu import int8_conv
from tts_engine.cpu.int8_conv import BATCH_ENV, Int8Conv, PathClock

pytestmark = pytest.mark.skipif(not int8_conv.batched_available(), reason="no oneDNN int8 conv or our kernels here")


def _rows_input(cin: int, length: int, dtype) -> torch.Tensor:
    """Four rows of different loudness and offset (so that each gets its own scale and zero point)."""
    g = torch.Generator().manual_seed(cin * 1000 + length)
    rows = [torch.randn(1, length, cin, generator=g) * sc + off for sc, off in ((2, .3), (0.01, 0), (5, -3), (1, 7))]
    return torch.cat(rows).to(dtype).transpose(1, 2)          # [4, C_in, L], time-major like the decoder's


def _conv(cin, cout, k, d, dtype, scale=0.05, bias=True):
    g = torch.Generator().manual_seed(cout * 7 + k)
    w = (torch.randn(cout, cin, k, generator=g) * scale).to(dtype)
    b = (torch.randn(cout, generator=g) * 0.1).to(dtype) if bias else None
    return Int8Conv(w, b, d, 1, 1 << 20)


def _both_ways(conv, x, add, monkeypatch):
    monkeypatch.setenv(BATCH_ENV, "rows")
    ref = conv(x, add)
    monkeypatch.setenv(BATCH_ENV, "batched")
    return ref, conv(x, add)


@pytest.mark.parametrize("isa", [2, 0])     # the AVX-512 epilogue, the scalar one
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cin, cout, k, d, length", [(64, 48, 7, 3, 300), (96, 96, 1, 1, 257), (100, 37, 3, 1, 40),
                                                     (192, 576, 1, 1, 33)])
def test_a_batch_in_one_call_gives_each_row_the_bits_of_its_own_call(isa, dtype, cin, cout, k, d, length,
                                                                     monkeypatch):
    if isa == 2 and int8_conv._rows_state["isa"] < 2:
        pytest.skip("no AVX-512 here")
    monkeypatch.setitem(int8_conv._rows_state, "isa", isa)
    monkeypatch.setattr(int8_conv, "MIN_POSITIONS", 0)
    conv = _conv(cin, cout, k, d, dtype, bias=cout != 37)
    x = _rows_input(cin, length, dtype)
    lo = length - (k - 1) * d
    add = torch.randn(4, lo, cout, generator=torch.Generator().manual_seed(5)).to(dtype).transpose(1, 2)
    calls = []
    real = conv.int8_batch
    monkeypatch.setattr(conv, "int8_batch", lambda *a: calls.append(1) or real(*a))
    for a in (None, add, add.contiguous()):        # no sum, the sum in the epilogue, the sum after it
        ref, got = _both_ways(conv, x, a, monkeypatch)
        assert got.dtype == dtype and got.shape == (4, cout, lo) and got.stride() == ref.stride()
        assert torch.equal(ref, got), f"{(ref != got).sum().item()} of {ref.numel()} values differ"
    assert len(calls) == 3                         # (the batched way did run)
    for i in range(4):                             # and each row as alone
        assert torch.equal(conv(x[i:i + 1], None if add is None else add[i:i + 1]), got[i:i + 1])


def test_a_row_beyond_fp32_integers_is_redone_row_by_row(monkeypatch):
    """Positive inputs (zero point 0) and positive weights: the sums of row 1 reach 255 x 127 x 896 > 2^24, beyond
    fp32's exact integers, so that row alone goes row by row; the result keeps every row's bits."""
    monkeypatch.setattr(int8_conv, "MIN_POSITIONS", 0)
    cin, k = 128, 7
    conv = Int8Conv(torch.ones(32, cin, k), torch.zeros(32), 1, 1, 1 << 20)
    x = torch.rand(3, cin, 50, generator=torch.Generator().manual_seed(0)) * 0.1
    x[:, 0, 0] = 1.0                               # rows 0 and 2: most q <= 26, sums far below 2^24
    x[1] = 1.0                                     # row 1: every input at the top of its range, q = 255
    x = x.transpose(1, 2).contiguous().transpose(1, 2)
    alone = []
    real = conv.int8_row
    monkeypatch.setattr(conv, "int8_row", lambda x4: alone.append(x4.clone()) or real(x4))
    monkeypatch.setenv(BATCH_ENV, "batched")
    got = conv(x)
    assert len(alone) == 1 and torch.equal(alone[0].squeeze(2), x[1:2])   # only row 1 went alone
    monkeypatch.setenv(BATCH_ENV, "rows")
    assert torch.equal(conv(x), got)


@pytest.mark.parametrize("prior", [True, False])
def test_auto_takes_the_faster_way_and_keeps_timing_the_other(prior):
    clock = PathClock()
    key = clock.key(4, 1000)
    assert key == clock.key(4, 1023) != clock.key(4, 1024) != clock.key(2, 1000)
    seen = []
    for _ in range(200):
        b = clock.batched(key, prior)
        seen.append(b)
        clock.record(key, b, 1.0 if b else 2.0)    # batched twice as fast
    assert seen[:PathClock.EXPLORE - 1] == [prior] * (PathClock.EXPLORE - 1)   # the prior first
    late = seen[2 * PathClock.EXPLORE:]
    assert 0 < late.count(False) <= len(late) // 8   # row by row now and then only
    snap = clock.snapshot()[key]
    assert snap["batched_ns"] < snap["rows_ns"] and snap["calls"] == 200
    for _ in range(100):                           # the machine changes: row by row becomes faster
        b = clock.batched(key, prior)
        clock.record(key, b, 3.0 if b else 2.0)
    assert not clock.batched(key, prior)


def test_auto_mode_runs_both_ways_with_the_same_bits(monkeypatch):
    monkeypatch.setattr(int8_conv, "MIN_POSITIONS", 0)
    monkeypatch.setenv(BATCH_ENV, "auto")
    conv = _conv(64, 48, 7, 1, torch.bfloat16)
    x = _rows_input(64, 120, torch.bfloat16)
    outs = [conv(x) for _ in range(2 * PathClock.EXPLORE)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    snap = conv.clock.snapshot()[PathClock.key(4, 114) + (torch.get_num_threads() == 1,)]
    assert snap["rows_ns"] is not None and snap["batched_ns"] is not None


def test_without_our_kernels_a_batch_goes_row_by_row(monkeypatch):
    monkeypatch.setattr(int8_conv, "MIN_POSITIONS", 0)
    monkeypatch.setitem(int8_conv._rows_state, "ok", False)
    monkeypatch.setenv(BATCH_ENV, "batched")
    conv = _conv(64, 48, 7, 1, torch.bfloat16)
    monkeypatch.setattr(conv, "int8_batch", lambda *a: pytest.fail("batched without the kernels"))
    x = _rows_input(64, 50, torch.bfloat16)
    assert torch.equal(conv(x), torch.cat([conv(x[i:i + 1]) for i in range(4)]))
