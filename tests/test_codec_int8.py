"""The codec decoder's int8 convolutions (`tts_engine/cpu/int8_conv.py`, conv mode "int8"), their quality check
against fp32 (`tts_engine/cpu/codec_quality.py`) and their place in the measured choice (`dtype_choice`): eligible only
when faster AND accurate enough, forced by TTS_CODEC_CONV=int8, off with TTS_CODEC_INT8=0, and a failing oneDNN call
falls back to the decoder's own convolutions."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tts_engine.codec import decoder
from tts_engine.cpu import codec_dtype as dtype_choice
from tts_engine.cpu import int8_conv
from tts_engine.cpu import packed_conv
from tts_engine.cpu import codec_quality as quality
from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
from tts_engine.cpu import cpu_ext
from tts_engine.tiny import tiny_speech_tokenizer_config

needs_int8 = pytest.mark.skipif(not (int8_conv.available() and packed_conv.available()),
                                reason="no oneDNN int8 convolutions in this torch")


def _dec(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).to(dtype).eval()


def _snr(ref, y):
    return quality.snr_db(ref, y)


def test_weights_use_7_bits_without_vnni(monkeypatch):
    from tts_engine.cpu import cpu_info

    w = torch.randn(8, 4, 3)
    for flags, top in ((frozenset({"avx2", "avx512_vnni"}), 127), (frozenset({"avx2", "avx_vnni"}), 127),
                       (frozenset({"avx2", "fma"}), 63)):
        monkeypatch.setattr(cpu_info, "cpu_info", lambda f=flags: cpu_info.CpuInfo(flags=f))
        q, s = int8_conv.quantize_weight(w)
        assert int(q.abs().max()) == top and torch.allclose(q.float() * s[:, None, None], w, atol=float(s.max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_input_kernel_matches_the_aten_fallback(monkeypatch, dtype):
    x = (torch.randn(2, 24, 37) * 3 + 0.5).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)   # channels-last
    q, s, zp = int8_conv.quantize_input(x)
    assert q.dtype == torch.uint8 and q.stride() == x.stride()
    err = ((q.float() - zp) * s - x.float()).abs().max()
    assert float(err) <= s * 0.5 + 1e-6 and 0 <= zp <= 255
    if cpu_ext.available():                                               # the scalar loops (the reference)
        isa = cpu_ext._state["quant_u8"]
        monkeypatch.setitem(cpu_ext._state, "quant_u8", 0)
        q1, s1, zp1 = int8_conv.quantize_input(x)
        monkeypatch.setitem(cpu_ext._state, "quant_u8", isa)
        assert s1 == s and zp1 == zp and torch.equal(q, q1)              # the same bits (test_cpu_isa_levels)
    monkeypatch.setattr(cpu_ext, "quant_u8", lambda t: None)            # aten's ops
    q2, s2, zp2 = int8_conv.quantize_input(x)
    assert s2 == pytest.approx(s, rel=1e-6) and zp2 == zp
    assert int((q.int() - q2.int()).abs().max()) <= 1                   # (rounding at exact halves)


@needs_int8
@pytest.mark.parametrize("c_in, c_out, k, dil", [(32, 48, 7, 3), (16, 16, 1, 1), (24, 96, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_conv_is_within_tolerance_of_fp32(c_in, c_out, k, dil, dtype):
    if dtype == torch.bfloat16 and not decoder._MKLDNN_BF16:
        pytest.skip("no oneDNN bf16 here")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(c_out, c_in, k, generator=g) / (c_in * k) ** 0.5
    b = torch.randn(c_out, generator=g) * 0.1
    x = torch.randn(3, c_in, 150 + (k - 1) * dil, generator=g)   # (>= MIN_POSITIONS per row: the int8 path)
    ref = F.conv1d(x, w, b, dilation=dil)
    conv = int8_conv.Int8Conv(w.to(dtype), b.to(dtype), dil, 1, 10_000)
    add = torch.randn(ref.shape, generator=g)
    y = conv(x.to(dtype), add=add.to(dtype))
    assert y is not None and y.dtype == dtype and y.shape == ref.shape and not conv.broken
    assert _snr(ref + add, y.float()) > 30      # 8 bits of each side (7 for weights without VNNI): ~30-40 dB
    assert _snr(ref + add, y.float()) < 80                                   # (and it really is int8, not exact)
    assert conv(torch.zeros(1, c_in, 20_000, dtype=dtype)) is None          # longer than max_len: the caller's path
    small = x[..., :(k - 1) * dil + 8].to(dtype)                             # a small call: the packed conv's result
    assert torch.equal(conv(small), conv.fallback(small))


@needs_int8
def test_int8_decoder_streams_close_to_fp32_and_the_check_sees_a_wrong_one(monkeypatch):
    monkeypatch.setattr(int8_conv, "MIN_POSITIONS", 0)        # (the tiny decoder's calls are small)
    dec = _dec()
    got = quality.measure(dec, [("int8", torch.float32, "int8"), ("packed", torch.float32, "packed")], frames=16)
    assert quality.acceptable(got["int8"]), got
    assert got["packed"]["snr_db"] > got["int8"]["snr_db"] + 10              # int8 is the lossy one
    # a broken int8 path (weight scales 2x too large) is measured as not acceptable
    real = int8_conv.quantize_weight
    monkeypatch.setattr(int8_conv, "quantize_weight", lambda w: (lambda q, s: (q, 2 * s))(*real(w)))
    bad = quality.measure(_dec(), [("int8", torch.float32, "int8")], frames=16)["int8"]
    assert not quality.acceptable(bad) and bad["snr_db"] < quality.MIN_SNR_DB


@needs_int8
def test_a_failing_int8_call_falls_back_to_the_dtypes_convolutions(monkeypatch, caplog):
    dec, ref = _dec(), _dec()
    dec.set_conv_mode("int8")
    ref.set_conv_mode("packed")
    assert all(m.int8 for m in dec.int8_convs()) and not any(m.int8 for m in ref.int8_convs())

    def boom(*a, **k):
        raise RuntimeError("no int8 here")

    monkeypatch.setattr(int8_conv, "quantize_input", boom)
    monkeypatch.setattr(int8_conv.Int8Conv, "int8_batch", boom)   # (a batch's rows in one call: fails too)
    monkeypatch.setenv(int8_conv.BATCH_ENV, "auto")                  # (both ways tried: neither may break the decoder)
    monkeypatch.setitem(int8_conv._rows_state, "ok", int8_conv.batched_available())   # (put back afterwards)
    monkeypatch.setattr(int8_conv, "MIN_POSITIONS", 0)        # (every call of this tiny decoder tries int8)
    codes = torch.randint(0, 2048, (2, 16, 3), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a, b = dec(codes), ref(codes)
    assert torch.allclose(a, b, atol=1e-4)
    assert all(m._pk8[1].broken for m in dec.int8_convs()) and "int8 oneDNN convolution unavailable" in caplog.text
    assert not int8_conv._rows_state["ok"] or not int8_conv.available()   # the batched way is off for good too


# --- the measured choice -----------------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TTS_CACHE_DIR", "")
    for env in (dtype_choice.ENV, dtype_choice.CONV_ENV, dtype_choice.INT8_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(dtype_choice, "_bf16_convs", lambda: True)
    return tmp_path / "qwen3-tts-live" / "choices" / "codec_dtype.json"


def _fake_times(monkeypatch, times):
    def fake(dec, rounds=3):
        name = f"{'bf16' if dec.pre_conv.conv.weight.dtype == torch.bfloat16 else 'fp32'} {dec.conv_mode}"
        return times.get(name, 1.0)

    monkeypatch.setattr(dtype_choice, "time_decoder", fake)


@needs_int8
@pytest.mark.skipif(not decoder._MKLDNN_BF16, reason="oneDNN has no bf16 convolutions on this CPU")
@pytest.mark.parametrize("snr, t_int8, want", [(40.0, 0.5, "int8"), (20.0, 0.5, "packed"), (40.0, 0.7, "packed")])
def test_int8_is_chosen_only_when_faster_and_accurate_enough(cache, monkeypatch, snr, t_int8, want):
    _fake_times(monkeypatch, {"bf16 packed": 0.75, "bf16 int8": t_int8})
    checked = []

    def fake_measure(dec, modes, frames, seed=0, ref_conv="aten"):
        checked.append(frames)
        return {"int8": {"snr_db": snr, "lsd_db": 0.5}}

    monkeypatch.setattr(quality, "measure", fake_measure)
    got = dtype_choice.choose(_dec(torch.bfloat16))
    assert got.conv_mode == want and got.pre_conv.conv.weight.dtype == torch.bfloat16
    entry = json.loads(cache.read_text())[dtype_choice.machine_key(got)]
    assert entry["v"] == dtype_choice.ENTRY_VERSION and "bf16 int8" in entry["ms_per_frame"]
    assert checked == ([dtype_choice.QUALITY_FRAMES] if t_int8 < 0.9 * 0.75 else [])   # checked only when faster
    if checked:
        assert list(entry["int8_quality"].values())[0]["snr_db"] == snr
    # remembered: neither timed nor checked again
    monkeypatch.setattr(dtype_choice, "time_decoder", lambda *a, **k: pytest.fail("timed again"))
    monkeypatch.setattr(quality, "measure", lambda *a, **k: pytest.fail("checked again"))
    assert dtype_choice.choose(_dec(torch.bfloat16)).conv_mode == want


@needs_int8
@pytest.mark.skipif(not decoder._MKLDNN_BF16, reason="oneDNN has no bf16 convolutions on this CPU")
def test_int8_switches_and_a_torch_without_it(cache, monkeypatch):
    _fake_times(monkeypatch, {"bf16 packed": 0.75, "bf16 int8": 0.5})
    monkeypatch.setattr(quality, "measure", lambda *a, **k: {"int8": {"snr_db": 40.0, "lsd_db": 0.5}})
    monkeypatch.setenv(dtype_choice.INT8_ENV, "0")                    # no candidate
    assert dtype_choice.choose(_dec(torch.bfloat16)).conv_mode == "packed"
    monkeypatch.delenv(dtype_choice.INT8_ENV)
    monkeypatch.setattr(quality, "measure", lambda *a, **k: {"int8": {"snr_db": 10.0, "lsd_db": 5.0}})
    monkeypatch.setenv(dtype_choice.CONV_ENV, "int8")                 # forced: no quality check, int8 anyway
    got = dtype_choice.choose(_dec(torch.bfloat16))
    assert got.conv_mode == "int8" and all(m.int8 for m in got.int8_convs())
    monkeypatch.delenv(dtype_choice.CONV_ENV)
    cache.unlink()
    monkeypatch.setattr(int8_conv, "available", lambda: False)        # a torch without oneDNN int8 convolutions
    got = dtype_choice.choose(_dec(torch.bfloat16))
    assert got.conv_mode == "packed" and "bf16 int8" not in json.loads(cache.read_text())[
        dtype_choice.machine_key(got)]["ms_per_frame"]
