"""The codec decoder's packed convolution path (tts_engine/cpu/packed_conv.py, `CodecDecoder.set_conv_mode`):
weights reordered once per input shape for oneDNN, channels-last activations. It must decode what the default
("aten") path decodes, up to float rounding, in any split of the frames, in batches of rows with different
histories, and fall back to aten's path for inputs longer than it handles. Tolerances: fp32 relative L2 < 1e-5
and max |diff| < 2e-5 (the accumulation order differs); bf16 relative L2 < 2e-2 (measured ~4e-3)."""
from __future__ import annotations

import copy

import pytest
import torch

from tts_engine.cpu import packed_conv
from tts_engine.codec.decoder import PACKED_MAX_FRAMES, CodecDecoder, CodecDecoderState
from tests.test_codec_decoder import SPF, _codes, _maxabs, _nontrivial, _rel, _stream, tiny_cfg

pytestmark = pytest.mark.skipif(not packed_conv.available(), reason="no oneDNN packed convolutions in this torch")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def decs():
    torch.manual_seed(0)
    plain = _nontrivial(CodecDecoder(tiny_cfg()), seed=1)
    packed = copy.deepcopy(plain)
    packed.set_conv_mode("packed")
    return plain, packed


def _count_packed_calls(dec, monkeypatch) -> list:
    calls = []
    orig = packed_conv.PackedConv.__call__

    def spy(self, x, add=None):
        y = orig(self, x, add)
        calls.append(y is not None)
        return y
    monkeypatch.setattr(packed_conv.PackedConv, "__call__", spy)
    return calls


@pytest.mark.parametrize("splits", [[1, 1, 2, 4, 8, 8, 6], [3, 13, 14], [1] * 30])
def test_packed_streaming_equals_aten_fp32(decs, splits, monkeypatch):
    plain, packed = decs
    codes = _codes(60, 1, sum(splits))
    calls = _count_packed_calls(packed, monkeypatch)
    with torch.inference_mode():
        want = plain(codes)
        got = _stream(packed, codes, splits)
    n_convs = len(packed.stateful_modules()) + 3 * len(packed.cfg.upsample_rates) + 1   # + RU conv2s, up[1] ctx 0
    assert len(calls) >= len(splits) * (n_convs - 1) and all(calls)   # every conv took the packed path
    assert float(want.std()) > 0.05
    assert _rel(got, want) < 1e-5 and _maxabs(got, want) < 2e-5


def test_packed_is_not_the_same_computation(decs):
    """The packed path really runs (a different accumulation order): not bit-identical to aten's, on some frame."""
    plain, packed = decs
    codes = _codes(61, 1, 8)
    with torch.inference_mode():
        assert not torch.equal(plain(codes), packed(codes))


def test_packed_batches_rows_with_different_histories(decs):
    plain, packed = decs
    a, b = _codes(62, 1, 40), _codes(63, 1, 40)
    with torch.inference_mode():
        sa, sb = packed.init_state(1), packed.init_state(1)
        packed.decode_step(a[..., :9], sa)
        packed.decode_step(b[..., :2], sb)
        joint = CodecDecoderState.concat([sa, sb, packed.init_state(1)])
        out = packed.decode_step(torch.cat([a[..., 9:17], b[..., 2:10], b[..., 0:8]]), joint)
        for row, (x, start) in enumerate([(a, 9), (b, 2), (b, 0)]):
            alone = plain(x[..., :start + 8])[0, start * SPF:]
            assert _maxabs(out[row], alone) < 2e-5
        kept = joint.select([1])                               # a row of a packed state continues alone
        nxt = packed.decode_step(b[..., 10:12], kept)
        assert _maxabs(nxt[0], plain(b[..., :12])[0, 10 * SPF:]) < 2e-5


def test_long_inputs_take_atens_path_and_shapes_share_copies(decs, monkeypatch):
    plain, packed = decs
    n = PACKED_MAX_FRAMES + 4
    codes = _codes(64, 1, n)
    calls = _count_packed_calls(packed, monkeypatch)
    with torch.inference_mode():
        got = packed(codes)
    assert calls and not any(calls)                            # too long for the packed path: aten's
    assert _maxabs(got, plain(codes)) < 2e-5
    conv = packed.decoder[0]
    pk = conv._pk[1]
    assert len(pk._by_shape) >= 3 and 1 <= pk.copies <= len(pk._by_shape)


def test_packed_bf16_close_to_aten_bf16(decs):
    plain, _ = decs
    p16 = copy.deepcopy(plain).to(torch.bfloat16)
    p16.refresh_codebooks()
    k16 = copy.deepcopy(p16)
    k16.set_conv_mode("packed")
    codes = _codes(65, 2, 20)
    with torch.inference_mode():
        want = p16(codes)
        got = _stream(k16, codes, [1, 1, 2, 8, 8])
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert _rel(got, want) < 2e-2


def test_weights_changed_after_packing_are_repacked(decs):
    """The packed weights follow the module's: a load / in-place edit after packing is seen."""
    plain, _ = decs
    a = copy.deepcopy(plain)
    a.set_conv_mode("packed")
    codes = _codes(66, 1, 4)
    with torch.inference_mode():
        before = a(codes)
        with torch.no_grad():
            a.decoder[0].conv.weight.mul_(0.5)
            a.decoder[1].block[1].conv.weight.mul_(0.5)
            a.decoder[1].block[1].conv.bias.add_(0.1)         # the tap conv's bias is derived from it
        b = copy.deepcopy(plain)
        with torch.no_grad():
            b.decoder[0].conv.weight.mul_(0.5)
            b.decoder[1].block[1].conv.weight.mul_(0.5)
            b.decoder[1].block[1].conv.bias.add_(0.1)
        after, want = a(codes), b(codes)
    assert not torch.equal(before, after) and _maxabs(after, want) < 2e-5


def test_set_conv_mode_validates_and_switches_back(decs):
    plain, _ = decs
    d = copy.deepcopy(plain)
    with pytest.raises(ValueError):
        d.set_conv_mode("fast")
    d.set_conv_mode("packed")
    assert d.conv_mode == "packed" and d.decoder[0].packed and d.decoder[1].block[2].conv2.packed
    d.set_conv_mode("aten")
    assert not any(getattr(m, "packed", False) for m in d.modules())
    codes = _codes(67, 1, 3)
    with torch.inference_mode():
        assert torch.equal(d(codes), plain(codes))           # back on the exact path


def test_packed_path_ignores_the_process_wide_onednn_switch(decs, monkeypatch):
    """The worker turns oneDNN off process-wide around small bf16 gemvs (model_runner's `aten_bf16_gemv`); a decode
    on the codec thread meanwhile must still take the packed oneDNN path (not aten's fallback kernels)."""
    plain, packed = decs
    codes = _codes(68, 1, 6)
    calls = _count_packed_calls(packed, monkeypatch)
    prev = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        with torch.inference_mode():
            got = _stream(packed, codes, [1, 5])
    finally:
        torch._C._set_mkldnn_enabled(prev)
    assert calls and all(calls)
    with torch.inference_mode():
        assert _maxabs(got, plain(codes)) < 2e-5
