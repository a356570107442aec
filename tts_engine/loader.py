"""A loaded Qwen3-TTS checkpoint: config, text tokenizer, talker (+ code predictor), and lazily the speaker
encoder and the shared speech tokenizer (codec)."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from tts_engine.checkpoint import SafetensorsFile, build_on_meta, load_module, read_json, resolve_checkpoint
from tts_engine.codec.speech_tokenizer import SpeechTokenizer
from tts_engine.config import ModelConfig
from tts_engine.cpu.cpu_info import cpu_info
from tts_engine.errors import TTSError
from tts_engine.text_tokenizer import TextTokenizer
from tts_engine.model.prompt import PromptBuilder
from tts_engine.model.quant import parse_quantize, precision_label, quantize_talker
from tts_engine.model.sampling import SamplingParams
from tts_engine.model.talker import Talker


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


log = logging.getLogger("tts_engine")

CPU_DTYPE_ENV = "TTS_CPU_DTYPE"   # auto (default) | fp32 | bf16: the CPU default when no dtype is given


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    return set(cpu_info().flags)


def cpu_has_fast_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX-512 BF16 or AMX-BF16) and oneDNN can use it. Without
    those instructions bf16 matmuls are emulated and slower than fp32."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU; on a CPU bf16 where it is native (`cpu_has_fast_bf16`), else fp32. The environment
    variable TTS_CPU_DTYPE=fp32|bf16 overrides the CPU choice (auto by default)."""
    if device.type == "cuda":
        return torch.bfloat16
    choice = os.environ.get(CPU_DTYPE_ENV, "auto").strip().lower()
    if choice not in ("", "auto"):
        dt = parse_dtype(choice)
        if dt not in (torch.float32, torch.bfloat16):
            raise TTSError(f"{CPU_DTYPE_ENV} must be auto, fp32 or bf16")
        return dt
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if str(dtype).lower() not in names:
        raise TTSError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return names[str(dtype).lower()]


def dtype_forced() -> bool:
    """True when TTS_CPU_DTYPE names a dtype (the user chose it, as with an explicit dtype argument)."""
    return os.environ.get(CPU_DTYPE_ENV, "auto").strip().lower() not in ("", "auto")


def quantize_choice(quantize, device: torch.device, dtype: torch.dtype, dtype_given: bool, talker_cfg=None,
                    folder: Path | None = None) -> tuple[str | None, str]:
    """(the weight quantisation an engine runs with, why). "auto" (the app's CPU default): on a CPU whose dtype
    the engine chose, the fastest mode measured here whose quality against fp32 is acceptable
    (`auto_precision.pick`); with an explicit dtype (argument or TTS_CPU_DTYPE), or on a GPU, none."""
    if isinstance(quantize, str) and quantize.strip().lower() == "auto":
        if device.type != "cpu":
            return None, "a GPU: the checkpoint's weights"
        if dtype_given or dtype_forced():
            return None, "the dtype was given: the checkpoint's weights"
        from tts_engine.cpu import auto_precision

        return auto_precision.pick(dtype, talker_cfg, folder)
    quantize = parse_quantize(quantize)
    if quantize is not None and device.type != "cpu":
        raise TTSError("quantize is implemented for the CPU only (its int8/int4 kernels are CPU kernels); "
                       "on a GPU run bf16 without quantize")
    return quantize, ""


def resolve_quantize(quantize, device: torch.device, dtype: torch.dtype, dtype_given: bool, talker_cfg=None,
                     folder: Path | None = None) -> str | None:
    """The weight quantisation an engine runs with (`quantize_choice` without the reason)."""
    return quantize_choice(quantize, device, dtype, dtype_given, talker_cfg, folder)[0]


def expected_precision(device=None, dtype=None, quantize=None, folder=None) -> str:
    """The `precision` label an engine loaded with these arguments will report (nothing is loaded; with
    quantize="auto" the kernel table is read or measured, and `folder`'s shapes and quality records are used)."""
    return expected_choice(device, dtype, quantize, folder)[0]


def expected_choice(device=None, dtype=None, quantize=None, folder=None) -> tuple[str, str]:
    """(precision label, why) of an engine loaded with these arguments; why is "" unless quantize="auto"."""
    device = torch.device(device) if device is not None else default_device()
    chosen = parse_dtype(dtype) or default_dtype(device)
    cfg = None
    if folder is not None and (Path(folder) / "config.json").is_file():
        cfg = ModelConfig.from_dict(read_json(Path(folder) / "config.json")).talker
    mode, why = quantize_choice(quantize, device, chosen, dtype is not None, cfg, folder)
    return precision_label(chosen, mode), why


class Qwen3TTSModel:
    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, text_embedding_on_cpu: bool = False,
                 quantize: str | None = None):
        self.folder = folder
        self.quantize = parse_quantize(quantize)
        self.device, self.dtype = device, dtype
        self.dtype_auto = False
        self.quantize_why = ""   # why quantize="auto" chose this mode (from_pretrained), shown by the app
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
        if device.type == "cpu" and (self.quantize is not None or dtype != torch.float32):
            self.talker.fuse_projections()   # fewer calls per frame; fp32 keeps the official layout (parity)
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
        chosen = parse_dtype(dtype)
        if chosen is None:
            chosen = default_dtype(device)
            if device.type == "cpu":
                log.info("tts_engine: %s weights and activations on this CPU (%s); dtype='fp32' forces fp32",
                         "bf16" if chosen == torch.bfloat16 else "fp32",
                         "native bf16: AVX-512 BF16 / AMX" if cpu_has_fast_bf16() else "no native bf16")
        folder = resolve_checkpoint(model)
        talker_cfg = ModelConfig.from_dict(read_json(folder / "config.json")).talker
        if device.type == "cpu":   # our C++ library loaded (or its build started) before any choice is timed
            from tts_engine.cpu import cpu_build

            cpu_build.prepare()
        quantize, why = quantize_choice(quantize, device, chosen, dtype is not None, talker_cfg, folder)
        inst = cls(folder, device, chosen, text_embedding_on_cpu, quantize)
        inst.quantize_why = why
        inst.dtype_auto = dtype is None   # True when the engine chose the dtype (reported with model.dtype)
        return inst

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
                from tts_engine.voices.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig

                cfg = SpeakerEncoderConfig.from_dict(self.config.speaker_encoder)
                self._speaker_encoder = load_module(SpeakerEncoder(cfg), self.weights, "speaker_encoder.",
                                                    self.device, self.dtype)
            return self._speaker_encoder

    @property
    def speaker_encoder_loaded(self) -> bool:
        return self._speaker_encoder is not None
