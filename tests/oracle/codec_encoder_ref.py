"""Oracle: what the official 12 Hz speech-tokenizer encoder (a transformers MimiModel) makes of some waveforms.

usage: codec_encoder_ref.py OUT_DIR
Builds a tiny official `Qwen3TTSTokenizerV2Model` with random weights (fixed seed), saves it with
`save_pretrained` (official layout) and loads it back through the official wrapper
`Qwen3TTSTokenizer.from_pretrained`, then encodes test waveforms one by one, as a batch, at 16 kHz (resampled by
the wrapper) and in bf16. Writes to OUT_DIR:
  tokenizer/                 the saved official tokenizer folder (config.json with `encoder_config`, model.safetensors
                             whose `encoder.` tensors tts_engine loads)
  ref.safetensors            waveforms and official codes; metadata "cases" (JSON) describes them
Runs in the oracle venv only.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import tests.oracle.official as off  # noqa: F401  (stand-ins first)
from qwen_tts import Qwen3TTSTokenizer
from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

SEED = 20240611
FEATURE_EXTRACTOR = {"feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
                     "sampling_rate": 24000, "padding_side": "right", "padding_value": 0.0,
                     "return_attention_mask": True, "chunk_length_s": None, "overlap": None}

# Tiny widths, real rate schedule: ratios [8,6,5,4] (hop 960, 25 Hz), downsample x2 -> 12.5 Hz, 1920 samples/frame.
# num_quantizers 20 > encoder_valid_num_quantizers 16, like the released codec (32 books, 16 used).
ENCODER_CONFIG = {
    "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1, "hidden_size": 32, "num_filters": 4,
    "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
    "residual_kernel_size": 3, "dilation_growth_rate": 2, "use_causal_conv": True, "pad_mode": "constant",
    "compress": 2, "trim_right_ratio": 1.0, "codebook_size": 2048, "codebook_dim": 16, "num_quantizers": 20,
    "num_semantic_quantizers": 1, "use_conv_shortcut": False, "vector_quantization_hidden_dimension": 16,
    "upsample_groups": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8000, "sliding_window": 250,
    "rope_theta": 10000.0, "norm_eps": 1e-5, "layer_scale_initial_scale": 0.01, "hidden_act": "gelu",
    "use_cache": False,
}
DECODER_CONFIG = {
    "codebook_size": 2048, "codebook_dim": 16, "hidden_size": 32, "latent_dim": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
    "sliding_window": 72, "rope_theta": 10000, "rms_norm_eps": 1e-5, "max_position_embeddings": 8000,
    "layer_scale_initial_scale": 0.01, "hidden_act": "silu", "attention_bias": False, "num_quantizers": 16,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32, "attention_dropout": 0.0,
}


def test_waveforms(rng: np.random.Generator) -> dict:
    """Speech-like test signals: a few harmonics with vibrato, an envelope, and a little noise."""

    def signal(n: int, sr: int, f0: float) -> np.ndarray:
        t = np.arange(n) / sr
        f = f0 * (1 + 0.05 * np.sin(2 * np.pi * 3 * t))
        ph = 2 * np.pi * np.cumsum(f) / sr
        x = sum(a * np.sin(k * ph) for k, a in ((1, 0.4), (2, 0.2), (3, 0.1), (5, 0.05)))
        env = 0.5 + 0.5 * np.abs(np.sin(2 * np.pi * 1.7 * t + rng.uniform(0, 3)))
        return (x * env + 0.02 * rng.standard_normal(n)).astype(np.float32)

    return {
        "w_exact": signal(1920 * 6, 24000, 140.0),         # a whole number of frames
        "w_odd": signal(1920 * 4 + 777, 24000, 210.0),     # not a multiple of 1920 (last frame partial)
        "w_short": signal(1000, 24000, 180.0),             # shorter than one frame
        "w_long": signal(24000 * 11 + 123, 24000, 120.0),  # 11 s: > 250 frames at 25 Hz (sliding_window)
        "b0": signal(9000, 24000, 160.0),                  # batch items, different lengths
        "b1": signal(20000, 24000, 230.0),
        "b2": signal(3840, 24000, 100.0),
        "w16k": signal(int(16000 * 1.3), 16000, 190.0),    # resampled by the wrapper
    }


def build_model(folder: Path, gen: torch.Generator) -> None:
    cfg = Qwen3TTSTokenizerV2Config(encoder_config=ENCODER_CONFIG, decoder_config=DECODER_CONFIG,
                                    encoder_valid_num_quantizers=16, input_sample_rate=24000,
                                    output_sample_rate=24000, decode_upsample_rate=1920,
                                    encode_downsample_rate=1920)
    model = Qwen3TTSTokenizerV2Model(cfg).eval()
    enc = model.encoder
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".scale"):                                     # LayerScale
                p.copy_(0.3 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:                                                             # conv / linear weights, ~unit gain
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in) ** 0.5)
        # codebooks: scaled to the residual each book sees, so that many codewords are used
        rng = np.random.default_rng(SEED)
        calib = torch.from_numpy(np.concatenate(list(test_waveforms(rng).values())))[None, None]
        h = enc.encoder(calib)
        h = enc.encoder_transformer(h.transpose(1, 2)).last_hidden_state.transpose(1, 2)
        h = enc.downsample(h)
        q = enc.quantizer
        for rvq in (q.semantic_residual_vector_quantizer, q.acoustic_residual_vector_quantizer):
            res = rvq.input_proj(h).transpose(1, 2).reshape(-1, rvq.input_proj.out_channels)
            for layer in rvq.layers:
                cb = layer.codebook
                usage = torch.rand(cb.cluster_usage.shape, generator=gen) * 4 + 0.5
                centroids = res.mean(0) + res.std(0) * torch.randn(cb.embed_sum.shape, generator=gen)
                cb.cluster_usage.copy_(usage)
                cb.embed_sum.copy_(centroids * usage[:, None])
                cb._embed = None
                idx = layer.encode(res.T[None])[0]
                res = res - layer.decode(idx[None])[0].T
    model.save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps(FEATURE_EXTRACTOR))


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "tokenizer"
    torch.manual_seed(SEED)
    build_model(folder, torch.Generator().manual_seed(SEED))
    wavs = test_waveforms(np.random.default_rng(SEED))

    tensors, cases = {}, []
    for name, w in wavs.items():
        tensors[f"wav.{name}"] = torch.from_numpy(w)

    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tok = Qwen3TTSTokenizer.from_pretrained(str(folder), dtype=dtype, device_map="cpu")
        assert tok.model.encoder.config._attn_implementation == "sdpa"
        names = ["w_exact", "w_odd", "w_short", "w_long"] if dtype_name == "fp32" else ["w_exact", "w_odd"]
        for name in names:   # one by one, at 24 kHz
            codes = tok.encode(wavs[name], sr=24000).audio_codes[0]
            tensors[f"{dtype_name}.single.{name}"] = codes.long()
            cases.append(dict(kind="single", dtype=dtype_name, name=name))
        batch = ["b0", "b1", "b2"]
        for name in batch:   # the batch items alone too
            tensors[f"{dtype_name}.single.{name}"] = tok.encode(wavs[name], sr=24000).audio_codes[0].long()
            cases.append(dict(kind="single", dtype=dtype_name, name=name))
        for name, codes in zip(batch, tok.encode([wavs[n] for n in batch], sr=24000).audio_codes):
            tensors[f"{dtype_name}.batch.{name}"] = codes.long()
            cases.append(dict(kind="batch", dtype=dtype_name, name=name, batch=batch))
        if dtype_name == "fp32":
            tensors[f"{dtype_name}.single.w16k"] = tok.encode(wavs["w16k"], sr=16000).audio_codes[0].long()
            cases.append(dict(kind="single", dtype=dtype_name, name="w16k", sr=16000))
            wavs_norm = tok._normalize_audio_inputs(wavs["w16k"], sr=16000)
            tensors["wav.w16k.resampled"] = torch.from_numpy(wavs_norm[0])

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "ref.safetensors"),
              metadata={"cases": json.dumps(cases)})


if __name__ == "__main__":
    main()
