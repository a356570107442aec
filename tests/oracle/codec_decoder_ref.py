"""Oracle: the official 12 Hz speech-tokenizer decoder on random codes, with tiny random weights.

usage: codec_decoder_ref.py OUT_DIR
Builds a tiny official `Qwen3TTSTokenizerV2Model` (float32, fixed seed), gives its decoder non-trivial random
weights, and writes to OUT_DIR:
  decoder.safetensors  the model's tensors whose names start with `decoder.` (official names)
  config.json          {"decoder_config": {...}} exactly as passed to the official config
  ref.safetensors      codes and the official outputs; metadata["cases"] is a JSON list of
                       {"name", "codes", "wav", "frames", "batch", "kind"}:
                         kind "decode"    official `Qwen3TTSTokenizerV2Model.decode` (fp32), i.e.
                                          `chunked_decode(300, 25)`: one chunk for T <= 300, two for T = 330
                         kind "bf16"      the official decoder cast to bfloat16, `decoder(codes)` (output as fp32)
Runs in the oracle venv only (official code via tests.oracle.official).
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import tests.oracle.official as off  # noqa: F401  (stand-ins first)
from tests.oracle.official import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

DECODER_CONFIG = {
    "codebook_size": 2048, "codebook_dim": 16, "hidden_size": 32, "latent_dim": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
    "sliding_window": 72, "rope_theta": 10000, "rms_norm_eps": 1e-5, "max_position_embeddings": 8000,
    "layer_scale_initial_scale": 0.01, "hidden_act": "silu", "attention_bias": False, "num_quantizers": 16,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32, "attention_dropout": 0.0,
}

ENCODER_CONFIG = {  # a small MimiConfig; the encoder is not used here
    "model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1, "hidden_size": 32,
    "num_filters": 4, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7,
    "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2, "use_causal_conv": True,
    "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0, "codebook_size": 2048, "codebook_dim": 16,
    "num_quantizers": 16, "num_semantic_quantizers": 1, "use_conv_shortcut": False,
    "vector_quantization_hidden_dimension": 16, "upsample_groups": 32, "num_hidden_layers": 2,
    "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 8000, "sliding_window": 250, "rope_theta": 10000.0, "norm_eps": 1e-5,
    "layer_scale_initial_scale": 0.01, "hidden_act": "gelu", "use_cache": False,
}

# (name, batch, frames): T <= 300 is one official chunk (one plain forward); 330 is two chunks with context
CASES = [("t120_b2", 2, 120), ("t1_b1", 1, 1), ("t7_b3", 3, 7), ("t330_b1", 1, 330)]
BF16_CASE = ("t7_b3_bf16", "t7_b3")


def randomize_decoder(decoder: torch.nn.Module, gen: torch.Generator) -> None:
    """Non-trivial random weights: positive random cluster usage, small random SnakeBeta, layer scales and
    ConvNeXt gammas around 0.1, norms around 1, weights ~ N(0, 1/fan_in)."""
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if name.endswith("cluster_usage"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 + 0.05)
            elif name.endswith("embedding_sum"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("alpha", "beta")):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith((".scale", ".gamma")):
                p.copy_(0.1 + 0.03 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = int(torch.tensor(p.shape[1:]).prod()) if p.ndim > 1 else p.shape[0]
                if ".block.1.conv." in name or (name.startswith("upsample.") and name.endswith("0.conv.weight")):
                    fan_in = p.shape[0] * 2   # ConvTranspose1d weight [in, out, k]: each output sees ~2 taps/in
                p.copy_(torch.randn(p.shape, generator=gen) / max(1, fan_in) ** 0.5)
                if name.endswith("conv2.conv.weight"):  # residual branches: keep the stack from blowing up
                    p.mul_(0.5)


def calibrate_output(decoder: torch.nn.Module, gen: torch.Generator, target_std: float = 0.3) -> None:
    """Scale the last conv so the pre-clamp waveform has std ~ target_std: parity is then tested on
    unclamped samples, not on a wall of +-1."""
    probe = torch.randint(0, 2048, (1, 16, 20), generator=gen)
    seen = {}
    hook = decoder.decoder[-1].register_forward_hook(lambda m, i, o: seen.update(std=float(o.std())))
    with torch.no_grad():
        decoder(probe)
        hook.remove()
        last = decoder.decoder[-1].conv
        last.weight.mul_(target_std / seen["std"])
        last.bias.mul_(target_std / seen["std"])


def main():
    torch.set_num_threads(1)  # tiny convs over long sequences: threads only add overhead (and contention)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    cfg = Qwen3TTSTokenizerV2Config(encoder_config=ENCODER_CONFIG, decoder_config=DECODER_CONFIG)
    model = Qwen3TTSTokenizerV2Model(cfg).float().eval()
    randomize_decoder(model.decoder, gen)
    calibrate_output(model.decoder, gen)

    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if k.startswith("decoder.")}
    save_file(weights, str(out / "decoder.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({"decoder_config": DECODER_CONFIG}, indent=2))

    tensors, cases = {}, []
    with torch.no_grad():
        for name, batch, frames in CASES:
            codes = torch.randint(0, DECODER_CONFIG["codebook_size"], (batch, 16, frames), generator=gen)
            # official API: audio_codes [B, T, 16]; returns a list of [T * 1920] waveforms
            wavs = model.decode(codes.transpose(1, 2), return_dict=True).audio_values
            wav = torch.stack(list(wavs))
            assert wav.shape == (batch, frames * 1920), wav.shape
            tensors[f"{name}.codes"], tensors[f"{name}.wav"] = codes, wav.float().contiguous()
            cases.append({"name": name, "codes": f"{name}.codes", "wav": f"{name}.wav", "frames": frames,
                          "batch": batch, "kind": "decode"})
        name, src = BF16_CASE
        dec16 = model.decoder.to(torch.bfloat16)
        wav = dec16(tensors[f"{src}.codes"]).float()[:, 0]
        tensors[f"{name}.wav"] = wav.contiguous()
        cases.append({"name": name, "codes": f"{src}.codes", "wav": f"{name}.wav", "frames": wav.shape[-1] // 1920,
                      "batch": wav.shape[0], "kind": "bf16"})

    stats = {c["name"]: {"std": float(tensors[c["wav"]].std()),
                         "clamped": float((tensors[c["wav"]].abs() >= 1).float().mean())} for c in cases}
    save_file(tensors, str(out / "ref.safetensors"), metadata={"cases": json.dumps(cases), "stats": json.dumps(stats)})
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
