"""`make-tiny`: a complete Qwen3-TTS 12 Hz checkpoint in the official layout, with tiny random weights.

Same file names, tensor names, config fields and special ids as the released checkpoints, but every
network is a few thousand parameters wide, so tests (and the app's offline mode) run in seconds on a
CPU. The audio it makes is noise: the weights are random.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# the released checkpoints' ids (reference notes section 1 / 2.3)
SPEAKERS = {"vivian": 3065, "serena": 3066, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
            "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878}
SPEAKER_DIALECT = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
LANGUAGES = {"english": 2050, "german": 2053, "spanish": 2054, "chinese": 2055, "japanese": 2058,
             "french": 2061, "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071}
DIALECTS = {"sichuan_dialect": 2062, "beijing_dialect": 2074}
GENERATION_CONFIG = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9,
                     "repetition_penalty": 1.05, "subtalker_dosample": True, "subtalker_top_k": 50,
                     "subtalker_top_p": 1.0, "subtalker_temperature": 0.9, "max_new_tokens": 8192}
KINDS = ("base", "custom_voice", "voice_design")

TALKER_HIDDEN = 64

# Network widths. "tiny" is what tests use; "small" is the CPU benchmark size; "0.6b"/"1.7b" are the real
# architectures (reference notes section 2), used with random weights by the benchmark.
ARCHS = {
    "tiny": dict(hidden=64, inter=128, layers=2, heads=4, kv=2, hd=16, text_hidden=32,
                 cp_hidden={"0b6": 64, "1b7": 32}, cp_inter=64, cp_layers=2, cp_heads=4, cp_kv=2, cp_hd=8,
                 spk=dict(enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_res2net_scale=4,
                          enc_se_channels=16)),
    "small": dict(hidden=256, inter=768, layers=6, heads=8, kv=4, hd=32, text_hidden=256,
                  cp_hidden={"0b6": 256, "1b7": 128}, cp_inter=512, cp_layers=3, cp_heads=8, cp_kv=4, cp_hd=32,
                  spk=dict(enc_channels=[64, 64, 64, 64, 192], enc_attention_channels=32, enc_res2net_scale=4,
                           enc_se_channels=32)),
    "0.6b": dict(hidden=1024, inter=3072, layers=28, heads=16, kv=8, hd=128, text_hidden=2048,
                 cp_hidden={"0b6": 1024, "1b7": 1024}, cp_inter=3072, cp_layers=5, cp_heads=16, cp_kv=8, cp_hd=128,
                 spk=dict(enc_channels=[512, 512, 512, 512, 1536], enc_attention_channels=128,
                          enc_res2net_scale=8, enc_se_channels=128)),
    "1.7b": dict(hidden=2048, inter=6144, layers=28, heads=16, kv=8, hd=128, text_hidden=2048,
                 cp_hidden={"0b6": 1024, "1b7": 1024}, cp_inter=3072, cp_layers=5, cp_heads=16, cp_kv=8, cp_hd=128,
                 spk=dict(enc_channels=[512, 512, 512, 512, 1536], enc_attention_channels=128,
                          enc_res2net_scale=8, enc_se_channels=128)),
}
REAL_TEXT_VOCAB = 151936


def tiny_config(kind: str, size: str, text_ids: dict, arch: str = "tiny") -> dict:
    a = ARCHS[arch]
    cp_hidden = a["cp_hidden"][size]
    half = a["hd"] // 2
    talker = {
        "hidden_size": a["hidden"], "intermediate_size": a["inter"], "num_hidden_layers": a["layers"],
        "num_attention_heads": a["heads"], "num_key_value_heads": a["kv"], "head_dim": a["hd"], "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "rope_scaling": {"mrope_section": [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16],
                         "interleaved": True, "rope_type": "default"},
        "vocab_size": 3072,
        "text_vocab_size": text_ids["text_vocab_size"] if arch in ("tiny", "small") else REAL_TEXT_VOCAB,
        "text_hidden_size": a["text_hidden"],
        "num_code_groups": 16, "attention_bias": False, "use_sliding_window": False,
        "codec_eos_token_id": 2150, "codec_think_id": 2154, "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
        "position_id_per_seconds": 13,
        "spk_id": SPEAKERS if kind == "custom_voice" else {},
        "spk_is_dialect": ({s: SPEAKER_DIALECT.get(s, False) for s in SPEAKERS} if kind == "custom_voice" else {}),
        "codec_language_id": {**LANGUAGES, **(DIALECTS if kind == "custom_voice" else {})},
        "code_predictor_config": {
            "hidden_size": cp_hidden, "intermediate_size": a["cp_inter"], "num_hidden_layers": a["cp_layers"],
            "num_attention_heads": a["cp_heads"], "num_key_value_heads": a["cp_kv"], "head_dim": a["cp_hd"],
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 65536,
            "vocab_size": 2048, "num_code_groups": 16, "use_sliding_window": False,
        },
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": size, "tts_model_type": kind,
        "im_start_token_id": text_ids["im_start_token_id"], "im_end_token_id": text_ids["im_end_token_id"],
        "tts_pad_token_id": text_ids["tts_pad_token_id"], "tts_bos_token_id": text_ids["tts_bos_token_id"],
        "tts_eos_token_id": text_ids["tts_eos_token_id"],
        "talker_config": talker,
        "speaker_encoder_config": {
            "mel_dim": 128, "enc_dim": a["hidden"], "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1], "sample_rate": 24000, **a["spk"],
        },
    }


REAL_CODEC = {
    "encoder_config": {"hidden_size": 512, "num_filters": 64, "codebook_dim": 256, "num_hidden_layers": 8,
                       "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
                       "num_quantizers": 32, "upsample_groups": 512, "vector_quantization_hidden_dimension": 256},
    "decoder_config": {"codebook_dim": 512, "hidden_size": 512, "latent_dim": 1024, "intermediate_size": 1024,
                       "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64,
                       "decoder_dim": 1536},
}


def tiny_speech_tokenizer_config(arch: str = "tiny") -> dict:
    cfg = _tiny_speech_tokenizer_config()
    if arch in ("0.6b", "1.7b"):
        for part in ("encoder_config", "decoder_config"):
            cfg[part].update(REAL_CODEC[part])
    return cfg


def _tiny_speech_tokenizer_config() -> dict:
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"], "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16, "input_sample_rate": 24000, "output_sample_rate": 24000,
        "decode_upsample_rate": 1920, "encode_downsample_rate": 1920,
        "encoder_config": {
            "model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1,
            "hidden_size": 32, "num_filters": 4, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4],
            "kernel_size": 7, "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2,
            "use_causal_conv": True, "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0,
            "codebook_size": 2048, "codebook_dim": 16, "num_quantizers": 16, "num_semantic_quantizers": 1,
            "use_conv_shortcut": False, "vector_quantization_hidden_dimension": 16, "upsample_groups": 32,
            "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 8000, "sliding_window": 250, "rope_theta": 10000.0,
            "norm_eps": 1e-5, "layer_scale_initial_scale": 0.01, "hidden_act": "gelu", "use_cache": False,
        },
        "decoder_config": {
            "codebook_size": 2048, "codebook_dim": 16, "hidden_size": 32, "latent_dim": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 16, "sliding_window": 72, "rope_theta": 10000, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8000, "layer_scale_initial_scale": 0.01, "hidden_act": "silu",
            "attention_bias": False, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2], "decoder_dim": 32, "attention_dropout": 0.0,
        },
    }


FEATURE_EXTRACTOR = {"feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
                     "sampling_rate": 24000, "padding_side": "right", "padding_value": 0.0,
                     "return_attention_mask": True, "chunk_length_s": None, "overlap": None}


def _prefixed(prefix: str, module: torch.nn.Module, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {prefix + k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().clone()
            for k, v in module.state_dict().items()}


def make_tiny(folder: str | Path, kind: str = "custom_voice", size: str = "0b6", seed: int = 0,
              arch: str = "tiny", dtype: torch.dtype = torch.float32) -> Path:
    """Write a random checkpoint of `kind` (base | custom_voice | voice_design) to `folder`; `arch` picks the
    widths (tiny for tests, or the real 0.6b / 1.7b architecture for benchmarks), `dtype` the stored dtype."""
    from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
    from tts_engine.codec.encoder import CodecEncoder, CodecEncoderConfig
    from tts_engine.config import ModelConfig
    from tts_engine.model.talker import Talker
    from tts_engine.tiny_tokenizer import write_tiny_tokenizer

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    if size not in ("0b6", "1b7"):
        raise ValueError("size must be 0b6 or 1b7")
    folder = Path(folder)
    (folder / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    text_ids = write_tiny_tokenizer(folder, seed=seed)
    cfg_dict = tiny_config(kind, size, text_ids, arch)
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))

    torch.manual_seed(seed)
    cfg = ModelConfig.from_dict(cfg_dict)
    tensors = _prefixed("talker.", Talker(cfg.talker), dtype)
    if kind == "base":
        from tts_engine.voices.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig

        se = SpeakerEncoder(SpeakerEncoderConfig.from_dict(cfg_dict["speaker_encoder_config"]))
        tensors.update(_prefixed("speaker_encoder.", se, dtype))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    st = tiny_speech_tokenizer_config(arch)
    (folder / "speech_tokenizer" / "config.json").write_text(json.dumps(st, indent=2))
    (folder / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(FEATURE_EXTRACTOR, indent=2))
    # the codec does not depend on the checkpoint kind or seed: every tiny checkpoint shares it, like the
    # released ones do
    torch.manual_seed(1234)
    codec = _prefixed("encoder.", CodecEncoder(CodecEncoderConfig.from_dict(
        st["encoder_config"], valid_num_quantizers=16)), dtype)
    codec.update(_prefixed("decoder.", CodecDecoder(CodecDecoderConfig.from_dict(st["decoder_config"])), dtype))
    save_file(codec, str(folder / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"})
    return folder


def random_checkpoint(arch: str, kind: str = "custom_voice") -> Path:
    """A random-weight checkpoint of the real `arch` ("0.6b", "1.7b") or a small one ("tiny", "small"), of `kind`,
    written once into the cache folder (`cache_paths.cache_root() / "bench"`) and reused: what the benchmarks and the
    codec quality check run on without a download. -> its folder."""
    import sys

    from tts_engine.cache_paths import cache_root

    folder = cache_root() / "bench" / f"{arch}-{kind}"
    if not (folder / "speech_tokenizer" / "model.safetensors").exists():
        print(f"writing a random {arch} {kind} checkpoint to {folder} ...", file=sys.stderr)
        make_tiny(folder, kind=kind, size="0b6" if arch != "1.7b" else "1b7", seed=0, arch=arch,
                  dtype=torch.bfloat16 if arch in ("0.6b", "1.7b") else torch.float32)
    return folder
