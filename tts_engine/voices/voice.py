"""Voices: what fills the speaker slot of a prompt (and, for ICL clones, the reference to continue).

Kinds:
  preset     a CustomVoice speaker name (its row of the talker codec embedding fills the slot)
  xvector    a Base-model speaker embedding of a reference clip (x-vector-only cloning)
  icl        xvector + the clip's codes and transcript (in-context cloning)
  embedding  a raw speaker-embedding vector (blends, imported vectors)
  reference  the reference clip itself (+ transcript): cloned when used (what a remote server is sent)
A voice file is safetensors (tensors + JSON metadata in the header) or JSON; never pickle.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tts_engine.errors import TTSError

FORMAT = "qwen3-tts-live.voice/1"
KINDS = ("preset", "xvector", "icl", "embedding", "reference")
MAX_VOICE_FILE_BYTES = 64 * 1024 * 1024


@dataclass
class Voice:
    kind: str
    name: str = ""
    speaker: str | None = None                 # preset name
    embedding: torch.Tensor | None = None      # [H] float32
    ref_codes: torch.Tensor | None = None      # [T, 16] int64 (icl)
    ref_text: str | None = None                # icl, reference
    ref_audio: torch.Tensor | None = None      # [S] int16 (reference)
    ref_sr: int | None = None                  # reference
    model_type: str | None = None              # checkpoint kind it was made for
    hidden_size: int | None = None             # talker width it fits
    meta: dict = field(default_factory=dict)   # free-form (source, licence, blend recipe...)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TTSError(f"unknown voice kind {self.kind!r}")
        if self.kind == "preset" and not self.speaker:
            raise TTSError("a preset voice needs a speaker name")
        if self.kind in ("xvector", "icl", "embedding"):
            self.embedding = check_embedding(self.embedding, self.hidden_size)
            self.hidden_size = int(self.embedding.shape[0])
        if self.kind == "reference":
            if self.ref_audio is None or self.ref_audio.ndim != 1 or self.ref_audio.numel() == 0:
                raise TTSError("a reference voice needs its clip")
            if not isinstance(self.ref_sr, int) or not (4000 <= self.ref_sr <= 384000):
                raise TTSError("a reference voice needs the clip's sample rate")
            self.ref_audio = self.ref_audio.to(torch.int16).cpu()
        if self.kind == "icl":
            if self.ref_codes is None or self.ref_codes.ndim != 2 or self.ref_codes.shape[1] != 16:
                raise TTSError("an in-context (ICL) voice needs reference codes of shape (frames, 16)")
            if self.ref_codes.shape[0] < 1:
                raise TTSError("the reference clip is too short to clone from")
            if not (self.ref_text or "").strip():
                raise TTSError("an in-context (ICL) voice needs the transcript of its reference clip")
            self.ref_codes = self.ref_codes.long().cpu()
            if int(self.ref_codes.min()) < 0 or int(self.ref_codes.max()) >= 2048:
                raise TTSError("reference codes must lie in [0, 2048)")

    @classmethod
    def from_clip(cls, wav, sr: int, ref_text: str | None, x_vector_only: bool, name: str = "",
                  model_type: str | None = "base") -> "Voice":
        """A reference voice from float samples in [-1, 1]."""
        import numpy as np

        pcm = torch.from_numpy((np.clip(np.asarray(wav, dtype=np.float32), -1, 1) * 32767).astype(np.int16))
        return cls(kind="reference", name=name, ref_audio=pcm, ref_sr=int(sr),
                   ref_text=None if x_vector_only else (ref_text or "").strip() or None,
                   model_type=model_type, meta={"x_vector_only": bool(x_vector_only or not (ref_text or "").strip())})

    def clip(self):
        """(float32 samples, sample rate) of a reference voice."""
        return self.ref_audio.float().numpy() / 32767.0, self.ref_sr

    @property
    def uses_x_vector_only(self) -> bool:
        return self.kind in ("xvector", "embedding")

    # --- files -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"format": FORMAT, "kind": self.kind, "name": self.name, "speaker": self.speaker,
             "ref_text": self.ref_text, "model_type": self.model_type, "hidden_size": self.hidden_size,
             "ref_sr": self.ref_sr, "meta": self.meta}
        if self.embedding is not None:
            d["embedding"] = [float(x) for x in self.embedding.float().tolist()]
        if self.ref_codes is not None:
            d["ref_codes"] = self.ref_codes.tolist()
        if self.ref_audio is not None:
            d["ref_audio"] = self.ref_audio.tolist()
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict()), encoding="utf-8")
            return path
        if path.suffix != ".safetensors":
            raise TTSError("a voice file must end in .safetensors or .json")
        tensors = {}
        if self.embedding is not None:
            tensors["embedding"] = self.embedding.float().contiguous()
        if self.ref_codes is not None:
            tensors["ref_codes"] = self.ref_codes.long().contiguous()
        if self.ref_audio is not None:
            tensors["ref_audio"] = self.ref_audio.to(torch.int16).contiguous()
        if not tensors:
            tensors["none"] = torch.zeros(1)
        meta = {k: v for k, v in self.to_dict().items() if k not in ("embedding", "ref_codes", "ref_audio")}
        save_file(tensors, str(path), metadata={"voice": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Voice":
        path = Path(path)
        try:
            size = path.stat().st_size
        except OSError:
            raise TTSError(f"voice file {path.name} cannot be read") from None
        if size > MAX_VOICE_FILE_BYTES:
            raise TTSError("voice file is too large")
        with open(path, "rb") as f:
            head = f.read(16)
        if head.lstrip()[:1] == b"{":
            try:
                d = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise TTSError(f"{path.name} is not a valid JSON voice file") from None
            return cls.from_dict(d)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = json.loads((f.metadata() or {}).get("voice", "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except TTSError:
            raise
        except Exception:
            raise TTSError(f"{path.name} is not a voice file (expected .safetensors or .json; "
                           "pickled .pt files are not accepted)") from None
        meta["embedding"] = tensors.get("embedding")
        meta["ref_codes"] = tensors.get("ref_codes")
        meta["ref_audio"] = tensors.get("ref_audio")
        return cls.from_dict(meta)

    @classmethod
    def from_dict(cls, d: dict) -> "Voice":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise TTSError("not a Qwen3-TTS Live voice file (missing or wrong 'format')")
        emb = d.get("embedding")
        codes = d.get("ref_codes")
        audio = d.get("ref_audio")
        try:
            emb = None if emb is None else torch.as_tensor(emb, dtype=torch.float32)
            codes = None if codes is None else torch.as_tensor(codes, dtype=torch.long)
            audio = None if audio is None else torch.as_tensor(audio, dtype=torch.int16)
        except (TypeError, ValueError, RuntimeError):
            raise TTSError("voice file holds malformed numbers") from None
        hs = d.get("hidden_size")
        sr = d.get("ref_sr")
        return cls(kind=str(d.get("kind")), name=str(d.get("name") or ""), speaker=d.get("speaker"),
                   embedding=emb, ref_codes=codes, ref_text=d.get("ref_text"), model_type=d.get("model_type"),
                   ref_audio=audio, ref_sr=int(sr) if isinstance(sr, (int, float)) else None,
                   hidden_size=int(hs) if isinstance(hs, (int, float)) else None,
                   meta=d.get("meta") if isinstance(d.get("meta"), dict) else {})


def check_embedding(v, hidden_size: int | None = None) -> torch.Tensor:
    """Validate a speaker-embedding vector: 1-D, finite, of the expected width, not absurdly scaled."""
    if v is None:
        raise TTSError("this voice needs a speaker-embedding vector")
    try:
        v = torch.as_tensor(v, dtype=torch.float32).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise TTSError("the speaker embedding must be a list of numbers") from None
    if v.ndim != 1:
        raise TTSError(f"the speaker embedding must be a 1-D vector, got shape {tuple(v.shape)}")
    if hidden_size is not None and v.shape[0] != hidden_size:
        raise TTSError(f"the speaker embedding has {v.shape[0]} values but this model needs {hidden_size}")
    if not torch.isfinite(v).all():
        raise TTSError("the speaker embedding contains NaN or infinite values")
    n = float(v.norm())
    if n == 0 or not math.isfinite(n) or n > 1e4:
        raise TTSError("the speaker embedding has an unusable norm")
    return v
