"""Finding a checkpoint (hub id or local folder) and reading tensors from it selectively.

A checkpoint in the official layout:
  config.json, generation_config.json, model.safetensors, vocab.json, merges.txt, tokenizer_config.json,
  speech_tokenizer/{config.json, model.safetensors}
Tensors are read one by one with safetensors' `safe_open`, so a part of the file that no module asks for
(the speaker encoder of a CustomVoice request, the codec encoder when nobody clones) is never read into
memory. `SafetensorsFile.tensors_read` counts what was read, which the lazy-loading tests check.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tts_engine.errors import TTSError

REQUIRED_FILES = ("config.json", "model.safetensors", "speech_tokenizer/config.json",
                  "speech_tokenizer/model.safetensors")


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """A local folder, or a Hugging Face repo id downloaded (or found in the cache) with huggingface_hub."""
    p = Path(model).expanduser()
    if p.is_dir():
        folder = p
    elif isinstance(model, str) and model.count("/") == 1 and not p.exists():
        folder = _download(model)
    else:
        raise TTSError(f"model {str(model)!r} is neither a checkpoint folder nor a Hugging Face repo id")
    missing = [f for f in REQUIRED_FILES if not (folder / f).exists()]
    if missing:
        raise TTSError(f"{folder} is not a Qwen3-TTS 12 Hz checkpoint: missing {', '.join(missing)}")
    return folder


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:  # the cache first, so an offline machine with the weights cached never touches the network
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id))
    except Exception as e:  # network down, repo missing, auth...
        raise TTSError(f"could not download {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
                       "Pass a local checkpoint folder, or run once with network access to fill the cache.") from e


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise TTSError(f"{path} is not valid JSON: {e}") from e


class SafetensorsFile:
    """Selective, thread-safe reads from one .safetensors file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            self.keys = set(f.keys())
        self.tensors_read = 0
        self.bytes_read = 0
        self._fingerprint: str | None = None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.keys]
        if missing:
            raise TTSError(f"{self.path} lacks {len(missing)} tensors, e.g. {missing[:3]}: "
                           "is this the right checkpoint kind?")
        out = {}
        with self._lock, safe_open(str(self.path), framework="pt", device="cpu") as f:
            for n in names:
                t = f.get_tensor(n)
                out[n] = t
                self.tensors_read += 1
                self.bytes_read += t.numel() * t.element_size()
        return out

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.keys)

    def fingerprint(self) -> str:
        """Identifies the file's contents without reading it whole: its size, header and a few sampled blocks.
        Computed once (the file may be gone later: ZeroGPU deletes hub files it has packed)."""
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        size = self.path.stat().st_size
        h.update(str(size).encode())
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(n, 1 << 24)))
            for frac in (0.25, 0.5, 0.75, 0.999):
                f.seek(int(size * frac))
                h.update(f.read(4096))
        return h.hexdigest()[:32]


def load_module(module: nn.Module, file: SafetensorsFile, prefix: str, device, dtype) -> nn.Module:
    """Fill `module` (state-dict names = file names minus `prefix`) from `file`, cast floating tensors to
    `dtype`, on `device`. Extra tensors in the file under `prefix` are ignored; missing ones are an error."""
    names = list(module.state_dict().keys())
    tensors = file.read([prefix + n for n in names])
    sd = {}
    for n in names:
        t = tensors[prefix + n]
        if t.is_floating_point():
            t = t.to(dtype)
        sd[n] = t.to(device)
    module.load_state_dict(sd, strict=True, assign=True)
    return module.to(device).eval().requires_grad_(False)


def build_on_meta(factory):
    """Construct a module without allocating or initialising its weights (they are assigned on load)."""
    with torch.device("meta"):
        return factory()


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint is, read from its config.json (`inspect_checkpoint`): nothing of the weights is read."""

    folder: Path
    kind: str                     # "custom_voice" | "base" | "voice_design"
    size: str                     # "0b6" | "1b7"
    speakers: list[str]           # CustomVoice preset speakers ([] otherwise)
    languages: list[str]          # "auto" first
    supports_instruct: bool       # takes an `instruct` (VoiceDesign, 1.7B CustomVoice)
    supports_clone: bool          # Base: voices from reference clips
    hidden_size: int              # the talker's width: a voice embedding's length


def inspect_checkpoint(model: str | os.PathLike) -> CheckpointInfo:
    """Find a checkpoint (a local folder, or a Hugging Face repo id downloaded or found in the cache, as
    `TTSEngine.from_pretrained` does) and say what it is, without loading it. TTSError when it cannot be had or
    is not a Qwen3-TTS 12 Hz checkpoint."""
    from tts_engine.config import ModelConfig

    folder = resolve_checkpoint(model)
    mc = ModelConfig.from_dict(read_json(folder / "config.json"))
    return CheckpointInfo(folder=folder, kind=mc.tts_model_type, size=mc.tts_model_size, speakers=mc.speakers,
                          languages=mc.languages, supports_instruct=mc.supports_instruct,
                          supports_clone=mc.supports_clone, hidden_size=mc.talker.hidden_size)
