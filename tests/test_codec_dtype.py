"""The codec decoder's dtype on a CPU (`tts_engine/cpu/codec_dtype.py`): a bf16 model's decoder is timed in bf16
and fp32 once per machine and the faster kept (remembered in the cache folder); fp32 models keep fp32; the
TTS_CODEC_DTYPE override; an engine whose decoder dtype differs from the talker's still streams."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine
from tts_engine.codec import decoder, speech_tokenizer
from tts_engine.cpu import codec_dtype as dtype_choice
from tts_engine.cpu import int8_conv
from tts_engine.cpu import packed_conv
from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
from tts_engine.tiny import make_tiny, tiny_speech_tokenizer_config


def _dec(dtype):
    torch.manual_seed(0)
    return CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).to(dtype).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TTS_CACHE_DIR", "")
    monkeypatch.delenv(dtype_choice.ENV, raising=False)
    monkeypatch.delenv(dtype_choice.CONV_ENV, raising=False)
    return tmp_path / "qwen3-tts-live" / "choices" / "codec_dtype.json"


@pytest.mark.parametrize("t16, t32, want", [(1.0, 0.5, torch.float32), (1.0, 0.95, torch.bfloat16),
                                            (0.5, 1.0, torch.bfloat16)])
def test_auto_keeps_the_faster_dtype_and_remembers_it(cache, monkeypatch, t16, t32, want):
    calls = []

    def fake(dec, rounds=3):
        calls.append(dec.pre_conv.conv.weight.dtype)
        return t16 if dec.pre_conv.conv.weight.dtype == torch.bfloat16 else t32

    monkeypatch.setattr(dtype_choice, "time_decoder", fake)
    monkeypatch.setattr(dtype_choice, "_bf16_convs", lambda: True)   # bf16 a candidate on any CPU (timing faked)
    dec = _dec(torch.bfloat16)
    got = dtype_choice.choose(dec)
    assert got.pre_conv.conv.weight.dtype == want and (got is dec) == (want == torch.bfloat16)
    n_conv = 2 if packed_conv.available() else 1                                 # aten and packed convs
    n_int8 = int(packed_conv.available() and int8_conv.available())              # + int8, in the first dtype only
    assert calls.count(torch.bfloat16) == 3 * (n_conv + n_int8)                   # warm-up + 2 interleaved
    assert calls.count(torch.float32) == 3 * n_conv
    saved = json.loads(cache.read_text())[dtype_choice.machine_key(dec)]
    assert saved["dtype"] == {torch.float32: "fp32", torch.bfloat16: "bf16"}[want]
    # the next load reads the choice instead of measuring
    monkeypatch.setattr(dtype_choice, "time_decoder", lambda *a, **k: pytest.fail("measured again"))
    again = dtype_choice.choose(_dec(torch.bfloat16))
    assert again.pre_conv.conv.weight.dtype == want
    if want == torch.float32:   # the copy decodes like the original up to bf16 rounding
        codes = torch.randint(0, 2048, (1, 16, 3), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            a, b = dec(codes).float(), got(codes)
        assert b.dtype == torch.float32 and float((a - b).norm() / b.norm()) < 0.1


def test_without_onednn_bf16_convolutions_bf16_is_no_candidate_and_still_decodes(cache, monkeypatch):
    """An AVX2-only CPU (oneDNN has no bf16 convolutions; torch's mkldnn_convolution raises for bf16 there, seen
    under QEMU -cpu Haswell): a bf16 model's decoder is timed and kept in fp32 only, and a bf16 decoder (forced)
    takes aten's generic convolutions instead of calling oneDNN."""
    monkeypatch.setattr(decoder, "_MKLDNN_BF16", False)
    calls = []
    monkeypatch.setattr(dtype_choice, "time_decoder", lambda d, rounds=3: calls.append(d.pre_conv.conv.weight.dtype) or 1.0)
    got = dtype_choice.choose(_dec(torch.bfloat16))
    assert got.pre_conv.conv.weight.dtype == torch.float32 and calls and set(calls) == {torch.float32}
    assert json.loads(cache.read_text())[dtype_choice.machine_key(got)]["dtype"] == "fp32"
    d16 = _dec(torch.bfloat16)
    assert not decoder._direct(torch.zeros(1, 2, 3, dtype=torch.bfloat16))
    assert decoder._direct(torch.zeros(1, 2, 3)) == decoder._MKLDNN
    codes = torch.randint(0, 2048, (1, 16, 3), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a, b = d16(codes).float(), _dec(torch.float32)(codes)
    assert float((a - b).norm() / b.norm()) < 0.1


def test_fp32_models_and_the_override(cache, monkeypatch):
    monkeypatch.setattr(dtype_choice, "time_decoder", lambda *a, **k: pytest.fail("fp32 decoders are not timed"))
    d32 = _dec(torch.float32)
    assert dtype_choice.choose(d32) is d32 and d32.conv_mode == "aten"      # exact path untouched
    monkeypatch.setenv(dtype_choice.CONV_ENV, "aten")                       # both forced: nothing timed
    monkeypatch.setenv(dtype_choice.ENV, "bf16")
    d16 = _dec(torch.bfloat16)
    assert dtype_choice.choose(d16) is d16
    monkeypatch.setenv(dtype_choice.ENV, "fp32")
    assert dtype_choice.choose(d16).pre_conv.conv.weight.dtype == torch.float32
    monkeypatch.setenv(dtype_choice.ENV, "fp64")
    with pytest.raises(ValueError, match=dtype_choice.ENV):
        dtype_choice.choose(d16)
    assert not cache.exists()


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_streams_with_a_decoder_dtype_unlike_the_talkers(cache, monkeypatch, tmp_path, overlap):
    monkeypatch.setenv(dtype_choice.ENV, "fp32")
    monkeypatch.setattr(dtype_choice, "time_decoder", _one_decode)   # the conv path's timing is not what is tested here
    # a registry of our own: the process-wide one shares a speech tokenizer (and its decoder, fp32 here) with every
    # later engine on a checkpoint with the same codec weights
    monkeypatch.setattr(speech_tokenizer, "_registry", {})
    folder = make_tiny(tmp_path / "cv", kind="custom_voice", size="0b6", seed=0)
    eng = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", overlap_codec=overlap)
    try:
        assert eng.model.dtype == torch.bfloat16
        assert eng.model.speech_tokenizer.decoder.pre_conv.conv.weight.dtype == torch.float32
        s = eng.stream("Hello there.", voice="ryan", seed=1, max_new_tokens=10, first_chunk_frames=1)
        chunks = list(s)
        assert len(s.codes) > 0 and sum(len(c) for c in chunks) == len(s.codes) * 1920
        assert all(c.dtype == np.float32 and np.isfinite(c).all() for c in chunks)
    finally:
        eng.close()


def _one_decode(dec, rounds=3):
    """dtype_choice.time_decoder without the timing rounds: one real decode (the packed candidates pack their weights),
    every candidate equally fast."""
    with torch.inference_mode():
        dec.decode_step(torch.zeros(1, dec.cfg.num_quantizers, 1, dtype=torch.long), dec.init_state(1))
    return 1.0


@pytest.mark.skipif(not packed_conv.available(), reason="no oneDNN packed convolutions in this torch")
@pytest.mark.skipif(not decoder._MKLDNN_BF16, reason="oneDNN has no bf16 convolutions on this CPU (AVX2 only): bf16 is "
                    "no candidate here (test_without_onednn_bf16_convolutions_... covers it)")
@pytest.mark.parametrize("fast, want_dtype, want_conv", [("bf16 packed", torch.bfloat16, "packed"),
                                                         ("bf16 aten", torch.bfloat16, "aten"),
                                                         ("fp32 packed", torch.float32, "packed")])
def test_auto_keeps_the_faster_conv_path_and_remembers_it(cache, monkeypatch, fast, want_dtype, want_conv):
    """Each (dtype, conv path) is timed; the fastest wins (fp32 by the 10 % margin) and is remembered."""
    def fake(dec, rounds=3):
        name = f"{'bf16' if dec.pre_conv.conv.weight.dtype == torch.bfloat16 else 'fp32'} {dec.conv_mode}"
        with torch.inference_mode():   # a real decode: the packed candidates pack their weights
            dec.decode_step(torch.zeros(1, 16, 1, dtype=torch.long), dec.init_state(1))
        return 0.5 if name == fast else 1.0

    monkeypatch.setattr(dtype_choice, "time_decoder", fake)
    got = dtype_choice.choose(_dec(torch.bfloat16))
    assert got.pre_conv.conv.weight.dtype == want_dtype and got.conv_mode == want_conv
    assert got.decoder[0].packed == (want_conv == "packed")
    held = [m for m in got.modules() if getattr(m, "_pk", None) is not None]
    assert bool(held) == (want_conv == "packed")               # the losing path's packed weights are released
    saved = json.loads(cache.read_text())[dtype_choice.machine_key(got)]
    assert saved["conv"] == want_conv and set(saved["ms_per_frame"]) == {"bf16 aten", "bf16 packed", "fp32 aten",
                                                                          "fp32 packed"} | (
        {"bf16 int8"} if int8_conv.available() else set())   # (int8 as slow as the rest here: not chosen)
    monkeypatch.setattr(dtype_choice, "time_decoder", lambda *a, **k: pytest.fail("measured again"))
    again = dtype_choice.choose(_dec(torch.bfloat16))
    assert again.conv_mode == want_conv and again.pre_conv.conv.weight.dtype == want_dtype
    # overrides: the conv path forced; the dtype forced (then that dtype's faster conv path, as measured)
    monkeypatch.setenv(dtype_choice.CONV_ENV, "aten")
    assert dtype_choice.choose(_dec(torch.bfloat16)).conv_mode == "aten"
    monkeypatch.setenv(dtype_choice.CONV_ENV, "auto")
    monkeypatch.setenv(dtype_choice.ENV, "bf16" if want_dtype == torch.float32 else "fp32")
    forced = dtype_choice.choose(_dec(torch.bfloat16))
    assert forced.pre_conv.conv.weight.dtype != want_dtype and forced.conv_mode == "aten"   # the other is 1.0 / 1.0
    monkeypatch.setenv(dtype_choice.CONV_ENV, "fast")
    with pytest.raises(ValueError, match=dtype_choice.CONV_ENV):
        dtype_choice.choose(_dec(torch.bfloat16))


def test_an_entry_without_a_conv_choice_is_measured_again(cache, monkeypatch):
    """Caches written before the conv path was chosen hold only a dtype: measured again, then remembered."""
    dec = _dec(torch.bfloat16)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({dtype_choice.machine_key(dec): {"dtype": "bf16"}}))
    calls = []
    monkeypatch.setattr(dtype_choice, "time_decoder", lambda d, rounds=3: calls.append(1) or 1.0)
    dtype_choice.choose(dec)
    assert calls and "conv" in json.loads(cache.read_text())[dtype_choice.machine_key(dec)]
