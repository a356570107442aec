"""Speaker encoder (ECAPA-TDNN) and its mel front-end against the official code.

tests/oracle/speaker_encoder_ref.py builds a small official `Qwen3TTSSpeakerEncoder` with random weights and
records, for clips of several lengths (one at 16 kHz, one stereo file, one stereo array), the official 24 kHz
waveform, mel and x-vector (fp32 and bf16). Here the same clips go through tts_engine.audio.load_audio ->
resample -> SpeakerEncoder.embed.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from tts_engine.audio import load_audio, resample
from tts_engine.errors import TTSError
from tts_engine.voices.mel import MIN_SAMPLES, log_mel_spectrogram, mel_basis_and_window
from tts_engine.voices.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig

from oracle_records import read_record

MEL_ATOL = 1e-5
FP32_ATOL, FP32_RTOL = 1e-5, 1e-4          # same ops on the same CPU: in practice bit-exact
BF16_ATOL, BF16_RTOL = 1e-2, 1e-2          # bf16 has an 8-bit mantissa (~0.4 % per rounding)


@pytest.fixture(scope="module")
def ref(run_oracle, tmp_path_factory):
    from safetensors.torch import load_file

    d = tmp_path_factory.mktemp("speaker_encoder_ref")
    run_oracle("speaker_encoder_ref.py", d)
    cases, tensors = read_record(d / "ref.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    state = load_file(str(d / "speaker_encoder.safetensors"))
    enc = SpeakerEncoder(SpeakerEncoderConfig.from_dict(cfg)).eval()
    enc.load_state_dict(state, strict=True)
    return dict(dir=d, cases=cases, t=tensors, cfg=cfg, state=state, enc=enc)


def _source(ref, case):
    if case["kind"] == "array":
        return ref["t"][f"{case['name']}.input"].numpy(), case["sr"]
    return str(ref["dir"] / case["path"])


def _wav24(ref, case) -> np.ndarray:
    wav, sr = load_audio(_source(ref, case))
    return resample(wav, sr, ref["cfg"]["sample_rate"])


def test_state_dict_names_and_shapes_are_the_official_ones(ref):
    ours = ref["enc"].state_dict()
    assert set(ours) == set(ref["state"])
    assert all(tuple(ours[k].shape) == tuple(v.shape) for k, v in ref["state"].items())


def test_config_defaults_and_validation():
    c = SpeakerEncoderConfig.from_dict({"enc_dim": 2048, "model_type": "x", "transformers_version": "4.57.3"})
    assert (c.mel_dim, c.enc_dim, c.enc_channels, c.enc_kernel_sizes, c.enc_dilations) == (
        128, 2048, [512, 512, 512, 512, 1536], [5, 3, 3, 3, 1], [1, 2, 3, 4, 1])
    assert (c.enc_attention_channels, c.enc_res2net_scale, c.enc_se_channels, c.sample_rate) == (128, 8, 128, 24000)
    assert SpeakerEncoderConfig.from_dict(None) == SpeakerEncoderConfig()
    with pytest.raises(TTSError, match="same length"):
        SpeakerEncoderConfig.from_dict({"enc_kernel_sizes": [5, 3, 1]})


def test_mel_matches_official(ref):
    for case in ref["cases"]:
        mel = log_mel_spectrogram(torch.from_numpy(_wav24(ref, case))[None])
        want = ref["t"][f"{case['name']}.mel"]
        assert mel.dtype == torch.float32 and mel.shape == want.shape, case["name"]
        torch.testing.assert_close(mel, want, atol=MEL_ATOL, rtol=0, msg=case["name"])
    torch.testing.assert_close(log_mel_spectrogram(ref["t"]["batch.input"]), ref["t"]["batch.mel"],
                               atol=MEL_ATOL, rtol=0)


def test_loaded_and_resampled_audio_matches_official(ref):
    for case in ref["cases"]:
        name = case["name"]
        wav, sr = load_audio(_source(ref, case))
        assert wav.dtype == np.float32 and wav.ndim == 1
        np.testing.assert_allclose(wav, ref["t"][f"{name}.wav_native"].numpy(), atol=1e-7, rtol=0, err_msg=name)
        w24 = resample(wav, sr, 24000)
        assert w24.shape == tuple(ref["t"][f"{name}.wav24"].shape), name
        np.testing.assert_allclose(w24, ref["t"][f"{name}.wav24"].numpy(), atol=1e-6, rtol=0, err_msg=name)


@torch.inference_mode()
def test_embeddings_match_official_fp32(ref):
    enc = ref["enc"]
    for case in ref["cases"]:
        emb = enc.embed(torch.from_numpy(_wav24(ref, case)))
        want = ref["t"][f"{case['name']}.emb"]
        assert emb.shape == want.shape == (ref["cfg"]["enc_dim"],) and emb.dtype == torch.float32
        torch.testing.assert_close(emb, want, atol=FP32_ATOL, rtol=FP32_RTOL, msg=case["name"])
    batch = enc.embed(ref["t"]["batch.input"])                      # [B, S] -> [B, enc_dim]
    torch.testing.assert_close(batch, ref["t"]["batch.emb"], atol=FP32_ATOL, rtol=FP32_RTOL)
    torch.testing.assert_close(enc(ref["t"]["batch.mel"]), ref["t"]["batch.emb"], atol=FP32_ATOL, rtol=FP32_RTOL)


@torch.inference_mode()
def test_embeddings_match_official_bf16(ref):
    enc = copy.deepcopy(ref["enc"]).to(torch.bfloat16)
    for case in ref["cases"]:  # a24_long has 375 frames: the pooling weight 1/T must round like the official
        emb = enc.embed(torch.from_numpy(_wav24(ref, case)))
        assert emb.dtype == torch.bfloat16
        want = ref["t"][f"{case['name']}.emb_bf16"]
        torch.testing.assert_close(emb.float(), want.float(), atol=BF16_ATOL, rtol=BF16_RTOL, msg=case["name"])
        assert (emb.float() - ref["t"][f"{case['name']}.emb"]).abs().max() < 5e-2   # and close to fp32


def test_mel_buffers_are_cached_per_device_and_dtype():
    import librosa

    cpu = torch.device("cpu")
    basis, window = mel_basis_and_window(cpu)
    again = mel_basis_and_window(cpu, torch.float32)
    assert again[0] is basis and again[1] is window and mel_basis_and_window("cpu")[0] is basis
    log_mel_spectrogram(torch.zeros(1, 4000))
    assert mel_basis_and_window(cpu)[0] is basis                    # the mel uses the cached buffers
    b64, w64 = mel_basis_and_window(cpu, torch.float64)
    assert b64.dtype == w64.dtype == torch.float64 and b64 is not basis and mel_basis_and_window(cpu, torch.float64)[0] is b64
    assert basis.shape == (128, 513) and window.shape == (1024,) and basis.dtype == torch.float32
    np.testing.assert_array_equal(basis.numpy(), librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000))
    torch.testing.assert_close(window, torch.hann_window(1024), atol=0, rtol=0)


@torch.inference_mode()
def test_fresh_random_module_gives_finite_embeddings():
    torch.manual_seed(0)
    t = np.arange(24000) / 24000
    wav = torch.from_numpy((0.4 * np.sin(2 * np.pi * 170 * t)).astype(np.float32))
    tiny = SpeakerEncoder(SpeakerEncoderConfig.from_dict(dict(enc_dim=48, enc_channels=[32, 32, 32, 32, 96],
                                                              enc_attention_channels=16, enc_res2net_scale=4,
                                                              enc_se_channels=16))).eval()
    full = SpeakerEncoder(SpeakerEncoderConfig(enc_dim=64)).eval()  # released layout, small output only
    for enc, dim in ((tiny, 48), (full, 64)):
        emb = enc.embed(wav)
        assert emb.shape == (dim,) and torch.isfinite(emb).all() and emb.abs().max() > 0
        assert enc.embed(wav[None].repeat(2, 1)).shape == (2, dim)
        short = torch.zeros(enc.min_samples())                     # shortest accepted clip (silence) works too
        assert torch.isfinite(enc.embed(short)).all()


def test_bad_input_to_the_encoder_raises_tts_error(ref):
    enc = ref["enc"]
    with pytest.raises(TTSError, match="too short"):
        enc.embed(torch.zeros(MIN_SAMPLES - 1))
    with pytest.raises(TTSError, match="too short"):
        enc.embed(torch.zeros(enc.min_samples() - 256))            # long enough for a mel, not for the network
    with pytest.raises(TTSError, match="invalid"):
        enc.embed(torch.full((24000,), float("nan")))
    with pytest.raises(TTSError, match="shape"):
        enc.embed(torch.zeros(1, 1, 24000))
    with pytest.raises(TTSError, match="shape"):
        enc(torch.zeros(1, 50, 80))
