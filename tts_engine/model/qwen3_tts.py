"""A loaded Qwen3-TTS checkpoint: config, text tokenizer, talker (+ code predictor), and lazily the speaker
encoder and the shared speech tokenizer (codec)."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from ..checkpoint import SafetensorsFile, build_on_meta, load_module, read_json, resolve_checkpoint
from ..codec.speech_tokenizer import SpeechTokenizer
from ..config import ModelConfig
from ..errors import TTSError
from ..text_tokenizer import TextTokenizer
from .prompt import PromptBuilder
from .quant import parse_quantize, precision_label, quantize_talker
from .sampling import SamplingParams
from .talker import Talker


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if str(dtype).lower() not in names:
        raise TTSError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return names[str(dtype).lower()]


class Qwen3TTSModel:
    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, text_embedding_on_cpu: bool = False,
                 quantize: str | None = None):
        self.folder = folder
        self.quantize = parse_quantize(quantize)
        self.device, self.dtype = device, dtype
        self.config = ModelConfig.from_dict(read_json(folder / "config.json"))
        self.generation_defaults = SamplingParams.from_dict(read_json(folder / "generation_config.json"))
        self.tokenizer = TextTokenizer.from_pretrained(folder)
        self.weights = SafetensorsFile(folder / "model.safetensors")
        self.talker: Talker = load_module(build_on_meta(lambda: Talker(self.config.talker)), self.weights,
                                          "talker.", device, dtype)
        self.talker.build_frame_table()
        if text_embedding_on_cpu and device.type != "cpu":
            # 151936 x 2048 (622 MB bf16) read only to build prompts: keep it in host memory
            self.talker.model.text_embedding.to("cpu")
        # last rewrite of the talker's layers: int8/int4 weights are born here, the dense ones dropped
        self.quantized_layers = quantize_talker(self.talker, self.quantize)
        self.prompts = PromptBuilder(self.config, self.talker)
        self._lock = threading.Lock()
        self._speaker_encoder = None
        self.speech_tokenizer = SpeechTokenizer.shared(folder / "speech_tokenizer", device, dtype)

    @classmethod
    def from_pretrained(cls, model, device=None, dtype=None, text_embedding_on_cpu: bool = False,
                        quantize: str | None = None) -> "Qwen3TTSModel":
        device = torch.device(device) if device is not None else default_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise TTSError("CUDA was requested but no GPU is available")
        dtype = parse_dtype(dtype) or default_dtype(device)
        quantize = parse_quantize(quantize)
        if quantize is not None and device.type != "cpu":
            raise TTSError("quantize is implemented for the CPU only (its int8/int4 kernels are CPU kernels); "
                           "on a GPU run bf16 without quantize")
        return cls(resolve_checkpoint(model), device, dtype, text_embedding_on_cpu, quantize)

    @property
    def precision(self) -> str:
        """What the talker computes with: "fp32", "bf16", "int8 weights (bf16 matmuls, fp32 elsewhere)", ..."""
        return precision_label(self.dtype, self.quantize)

    @property
    def lossy(self) -> bool:
        """True when the talker's weights are not the checkpoint's (quantised): its output is an approximation."""
        return self.quantize is not None

    @property
    def speaker_encoder(self):
        """The ECAPA speaker encoder (Base checkpoints), read from disk on first use."""
        if self.config.tts_model_type != "base":
            raise TTSError("only Base checkpoints can embed a reference clip (voice cloning)")
        with self._lock:
            if self._speaker_encoder is None:
                from ..voices.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig

                cfg = SpeakerEncoderConfig.from_dict(self.config.speaker_encoder)
                self._speaker_encoder = load_module(SpeakerEncoder(cfg), self.weights, "speaker_encoder.",
                                                    self.device, self.dtype)
            return self._speaker_encoder

    @property
    def speaker_encoder_loaded(self) -> bool:
        return self._speaker_encoder is not None
