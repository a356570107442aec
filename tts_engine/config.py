"""Model configuration, parsed from a checkpoint's config.json and generation_config.json.

Field names follow the official `Qwen3TTSConfig` / `Qwen3TTSTalkerConfig` /
`Qwen3TTSTalkerCodePredictorConfig` classes so the JSON files load as they are. Only what the engine reads
is kept; unknown keys are ignored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tts_engine.errors import TTSError


def _pick(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass
class DecoderStackConfig:
    """A Qwen3 decoder stack (the talker and the code predictor share this shape of config)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    use_sliding_window: bool = False

    def check(self, what: str) -> None:
        if self.hidden_act != "silu":
            raise TTSError(f"{what}: unsupported activation {self.hidden_act!r}")
        if self.attention_bias:
            raise TTSError(f"{what}: attention_bias=true is not supported")
        if self.use_sliding_window:
            raise TTSError(f"{what}: sliding-window attention is not supported")
        if self.num_attention_heads % self.num_key_value_heads:
            raise TTSError(f"{what}: heads must be a multiple of KV heads")


@dataclass
class CodePredictorConfig(DecoderStackConfig):
    vocab_size: int = 2048
    num_code_groups: int = 16

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CodePredictorConfig":
        d = dict(d)
        d.setdefault("head_dim", d.get("hidden_size", 1024) // d.get("num_attention_heads", 16))
        cfg = cls(**_pick(cls, d))
        cfg.check("code_predictor_config")
        return cfg


@dataclass
class TalkerConfig(DecoderStackConfig):
    vocab_size: int = 3072
    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    num_code_groups: int = 16
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, Any] = field(default_factory=dict)
    codec_language_id: dict[str, int] = field(default_factory=dict)
    code_predictor: CodePredictorConfig | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TalkerConfig":
        d = dict(d)
        d.setdefault("head_dim", d.get("hidden_size", 1024) // d.get("num_attention_heads", 16))
        cp = CodePredictorConfig.from_dict(d.get("code_predictor_config") or {})
        kw = _pick(cls, d)
        kw.pop("code_predictor", None)
        for k in ("spk_id", "spk_is_dialect", "codec_language_id"):
            kw[k] = {str(n).lower(): v for n, v in (d.get(k) or {}).items()}
        cfg = cls(**kw, code_predictor=cp)
        cfg.check("talker_config")
        if cp.num_code_groups != cfg.num_code_groups:
            raise TTSError("talker and code predictor disagree on num_code_groups")
        return cfg


@dataclass
class ModelConfig:
    """Top-level config.json of a Qwen3-TTS 12 Hz checkpoint."""

    talker: TalkerConfig
    speaker_encoder: dict[str, Any]
    tts_model_type: str  # "base" | "custom_voice" | "voice_design"
    tts_model_size: str  # "0b6" | "1b7"
    tokenizer_type: str = "qwen3_tts_tokenizer_12hz"
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if d.get("model_type") not in (None, "qwen3_tts"):
            raise TTSError(f"not a Qwen3-TTS checkpoint (model_type={d.get('model_type')!r})")
        kind = d.get("tts_model_type")
        if kind not in ("base", "custom_voice", "voice_design"):
            raise TTSError(f"unknown tts_model_type {kind!r}")
        tok = d.get("tokenizer_type", "qwen3_tts_tokenizer_12hz")
        if tok != "qwen3_tts_tokenizer_12hz":
            raise TTSError(f"only the 12 Hz speech tokenizer is supported, not {tok!r}")
        kw = _pick(cls, d)
        kw.pop("talker", None)
        kw.pop("speaker_encoder", None)
        return cls(
            talker=TalkerConfig.from_dict(d.get("talker_config") or {}),
            speaker_encoder=dict(d.get("speaker_encoder_config") or {}),
            **kw,
        )

    # --- what the model kind supports --------------------------------------------------------------
    @property
    def speakers(self) -> list[str]:
        return sorted(self.talker.spk_id)

    @property
    def languages(self) -> list[str]:
        """'auto' plus every language id that is not a dialect (as the official get_supported_languages)."""
        return ["auto"] + sorted(k for k in self.talker.codec_language_id if "dialect" not in k)

    @property
    def supports_instruct(self) -> bool:
        # The official wrapper drops `instruct` for 0.6B CustomVoice (`tts_model_size in "0b6"`).
        if self.tts_model_type == "voice_design":
            return True
        return self.tts_model_type == "custom_voice" and self.tts_model_size not in "0b6"

    @property
    def supports_clone(self) -> bool:
        return self.tts_model_type == "base"
