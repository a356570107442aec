"""The codec encoder (waveform -> reference codes) against the official one (transformers MimiModel inside
Qwen3TTSTokenizerV2Model, through the official `Qwen3TTSTokenizer.encode` wrapper).

tests/oracle/codec_encoder_ref.py builds a tiny official tokenizer with random weights, saves it in the official
layout and records the official codes; here tts_engine loads the `encoder.` tensors of that file and must give:
- fp32: identical codes for every waveform (whole frames, a partial last frame, < 1 frame, 11 s which is past the
  250-step `sliding_window` the official config names but never applies), for a batch of different lengths, and for
  a 16 kHz clip resampled by librosa as the wrapper does;
- bf16: at least 95 % identical codes (nearest-codeword ties can flip under rounding; measured: 100 %).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tts_engine.audio import resample
from tts_engine.checkpoint import SafetensorsFile, load_module
from tts_engine.codec.encoder import CodecEncoder, CodecEncoderConfig
from tts_engine.tiny import tiny_speech_tokenizer_config

from oracle_records import read_record

BATCH = ["b0", "b1", "b2"]
BF16_MIN_IDENTICAL = 0.95


@pytest.fixture(scope="module")
def ref(run_oracle, tmp_path_factory):
    """(tokenizer folder, speech-tokenizer config dict, recorded cases, tensors)."""
    out = tmp_path_factory.mktemp("codec_encoder_ref")
    run_oracle("codec_encoder_ref.py", out)
    cases, tensors = read_record(out / "ref.safetensors")
    folder = out / "tokenizer"
    return folder, json.loads((folder / "config.json").read_text()), cases, tensors


def _load(ref, dtype) -> CodecEncoder:
    folder, st, _, _ = ref
    cfg = CodecEncoderConfig.from_dict(st["encoder_config"], valid_num_quantizers=st["encoder_valid_num_quantizers"])
    return load_module(CodecEncoder(cfg), SafetensorsFile(folder / "model.safetensors"), "encoder.", "cpu", dtype)


@pytest.fixture(scope="module")
def enc32(ref):
    return _load(ref, torch.float32)


def _padded(wavs: list[torch.Tensor], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_len + extra] with noise (not zeros) after each item: encode must cut and zero it."""
    lengths = torch.tensor([len(w) for w in wavs])
    out = torch.randn(len(wavs), int(lengths.max()) + extra, generator=torch.Generator().manual_seed(0))
    for i, w in enumerate(wavs):
        out[i, : len(w)] = w
    return out, lengths


def test_uses_exactly_the_official_tensors_it_needs(ref, enc32):
    folder, st, _, _ = ref
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        official = {k[len("encoder."):] for k in f.keys() if k.startswith("encoder.")}
    ours = set(enc32.state_dict())
    assert ours <= official
    n_sem = st["encoder_config"]["num_semantic_quantizers"]
    unused = {k for k in official - ours}
    for k in unused:  # the official encode path never reads these
        book = k.split(".layers.")[1].split(".")[0] if "_residual_vector_quantizer.layers." in k else None
        assert (k.endswith(("codebook.initialized", "output_proj.weight"))
                or (k.startswith("quantizer.acoustic") and int(book) >= 16 - n_sem)), k
    assert any(".layers.15." in k for k in unused)  # the oracle has 20 books, 16 used


def test_fp32_single_clips_match_official_exactly(ref, enc32):
    _, _, cases, t = ref
    singles = [c for c in cases if c["kind"] == "single" and c["dtype"] == "fp32" and "sr" not in c]
    assert len(singles) == 4 + len(BATCH)
    for c in singles:
        wav, want = t[f"wav.{c['name']}"], t[f"fp32.single.{c['name']}"]
        assert want.shape == (math.ceil(len(wav) / 1920), 16)
        got = enc32.encode_one(wav.numpy(), 24000)
        assert got.dtype == torch.long and torch.equal(got, want), c["name"]
        assert torch.equal(enc32.encode(wav[None], torch.tensor([len(wav)]))[0], want)


def test_fp32_batch_matches_official_and_one_by_one(ref, enc32):
    _, _, _, t = ref
    wavs = [t[f"wav.{n}"] for n in BATCH]
    batch, lengths = _padded(wavs, extra=3000)
    got = enc32.encode(batch, lengths)
    longest = int(lengths.max())
    for name, wav, codes in zip(BATCH, wavs, got):
        assert torch.equal(codes, t[f"fp32.batch.{name}"]), name
        alone = enc32.encode_one(wav.numpy(), 24000)
        assert torch.equal(alone, t[f"fp32.single.{name}"])
        # batch == one by one, except (official quirk) the last frame of a shorter item whose length is not a
        # whole number of frames: in a batch it is completed by the network's response to the zero padding,
        # alone by zero padding inside each conv
        if len(wav) % 1920 == 0 or len(wav) == longest:
            assert torch.equal(codes, alone), name
        else:
            assert torch.equal(codes[:-1], alone[:-1]), name


def test_16khz_clip_is_resampled_like_the_official_wrapper(ref, enc32):
    _, _, _, t = ref
    w16 = t["wav.w16k"].numpy()
    np.testing.assert_array_equal(resample(w16, 16000, 24000), t["wav.w16k.resampled"].numpy())
    got = enc32.encode_one(w16, 16000)
    assert got.shape == (math.ceil(len(w16) * 1.5 / 1920), 16)
    assert torch.equal(got, t["fp32.single.w16k"])


def test_bf16_matches_official_bf16_within_tolerance(ref):
    _, _, cases, t = ref
    enc = _load(ref, torch.bfloat16)
    same = total = 0
    for c in (c for c in cases if c["kind"] == "single" and c["dtype"] == "bf16"):
        got, want = enc.encode_one(t[f"wav.{c['name']}"].numpy(), 24000), t[f"bf16.single.{c['name']}"]
        assert got.shape == want.shape
        same, total = same + int((got == want).sum()), total + want.numel()
    batch, lengths = _padded([t[f"wav.{n}"] for n in BATCH])
    for name, got in zip(BATCH, enc.encode(batch, lengths)):
        want = t[f"bf16.batch.{name}"]
        assert got.shape == want.shape
        same, total = same + int((got == want).sum()), total + want.numel()
    assert same / total >= BF16_MIN_IDENTICAL, f"bf16: {same}/{total} codes identical"


def test_config_from_saved_dict():
    st = tiny_speech_tokenizer_config("0.6b")
    d = dict(st["encoder_config"], unknown_key=1)
    d.pop("frame_rate", None)
    d["_frame_rate"] = 12.5                       # as save_pretrained writes it
    cfg = CodecEncoderConfig.from_dict(d, valid_num_quantizers=16)
    assert (cfg.hidden_size, cfg.codebook_dim, cfg.num_quantizers, cfg.frame_rate) == (512, 256, 32, 12.5)
    assert cfg.hop == 960 and cfg.encode_downsample_rate == 1920
    bare = CodecEncoderConfig.from_dict({}, valid_num_quantizers=16)   # MimiConfig defaults
    assert (bare.head_dim, bare.frame_rate, bare.encode_downsample_rate) == (64, 12.5, 1920)
    with pytest.raises(ValueError):
        CodecEncoderConfig.from_dict(d, valid_num_quantizers=33)


def test_random_init_is_usable():
    st = tiny_speech_tokenizer_config()
    torch.manual_seed(1234)
    enc = CodecEncoder(CodecEncoderConfig.from_dict(st["encoder_config"], valid_num_quantizers=16)).eval()
    sd = enc.state_dict()
    assert all(torch.isfinite(v).all() for v in sd.values())
    assert all((v > 0).all() for k, v in sd.items() if k.endswith("cluster_usage"))
    assert sum(k.endswith("embed_sum") for k in sd) == 16
    t = np.arange(int(24000 * 1.7)) / 24000
    wav = (0.3 * np.sin(2 * np.pi * 170 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 2.3 * t))
           + 0.03 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)
    codes = enc.encode_one(wav, 24000)
    assert codes.shape == (math.ceil(len(wav) / 1920), 16)
    assert codes.min() >= 0 and codes.max() < 2048
    assert len(codes.unique()) > 16                # not one code everywhere
