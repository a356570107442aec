"""The 12 Hz speech tokenizer (codec) of a checkpoint, loaded half by half on demand and shared.

- The decoder (codes -> waveform) is read from disk on the first synthesis.
- The encoder (waveform -> codes) only when an ICL clone needs reference codes.
- Checkpoints whose speech_tokenizer/ files have the same contents (all released 12 Hz checkpoints ship the
  same codec) share one instance per (device, dtype): `SpeechTokenizer.shared`.
"""
from __future__ import annotations

import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from tts_engine.checkpoint import SafetensorsFile, load_module, read_json
from tts_engine.errors import TTSError

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920

_registry: "weakref.WeakValueDictionary[tuple, SpeechTokenizer]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


class SpeechTokenizer:
    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, file: SafetensorsFile | None = None):
        self.folder = Path(folder)
        self.device, self.dtype = device, dtype
        self.config = read_json(self.folder / "config.json")
        if self.config.get("model_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise TTSError(f"{self.folder} is not a 12 Hz speech tokenizer")
        self.sample_rate = int(self.config.get("output_sample_rate", SAMPLE_RATE))
        self.samples_per_frame = int(self.config.get("decode_upsample_rate", SAMPLES_PER_FRAME))
        self.file = file or SafetensorsFile(self.folder / "model.safetensors")
        self._lock = threading.Lock()
        self._decoder = None
        self._encoder = None

    @classmethod
    def shared(cls, folder: Path, device: torch.device, dtype: torch.dtype) -> "SpeechTokenizer":
        file = SafetensorsFile(Path(folder) / "model.safetensors")
        cfg_text = (Path(folder) / "config.json").read_text(encoding="utf-8")
        key = (file.fingerprint(), hash(cfg_text), str(device), dtype)
        with _registry_lock:
            inst = _registry.get(key)
            if inst is None:
                inst = cls(folder, device, dtype, file)
                _registry[key] = inst
            return inst

    @property
    def decoder(self):
        with self._lock:
            if self._decoder is None:
                from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig

                cfg = CodecDecoderConfig.from_dict(self.config.get("decoder_config") or {})
                from tts_engine.cpu.codec_dtype import choose

                # bf16 on a CPU: bf16 or fp32, whichever decodes faster on this machine (measured once, cached)
                self._decoder = choose(load_module(CodecDecoder(cfg), self.file, "decoder.", self.device, self.dtype))
                if self.device.type == "cuda":   # its steps as CUDA graphs per shape, where they agree and pay
                    from tts_engine.gpu.codec_graph import attach

                    attach(self._decoder)
            return self._decoder

    @property
    def encoder(self):
        with self._lock:
            if self._encoder is None:
                from tts_engine.codec.encoder import CodecEncoder, CodecEncoderConfig

                cfg = CodecEncoderConfig.from_dict(self.config.get("encoder_config") or {},
                                                   valid_num_quantizers=int(self.config.get(
                                                       "encoder_valid_num_quantizers", 16)))
                self._encoder = load_module(CodecEncoder(cfg), self.file, "encoder.", self.device, self.dtype)
            return self._encoder

    @property
    def decoder_loaded(self) -> bool:
        return self._decoder is not None

    @property
    def encoder_loaded(self) -> bool:
        return self._encoder is not None

    @torch.inference_mode()
    def encode(self, wav: np.ndarray, sr: int) -> torch.Tensor:
        """Mono float32 waveform at any rate -> reference codes [T, 16] (int64, CPU)."""
        return self.encoder.encode_one(wav, sr).cpu()

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> np.ndarray:
        """Codes [T, 16] -> float32 waveform [T * 1920] (one-shot, as the official offline decode)."""
        codes = codes.to(self.device).long().clamp(min=0)
        wav = self.decoder.chunked_decode(codes.T[None])[0]
        return wav.float().cpu().numpy()
