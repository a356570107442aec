"""Which engine serves a request, loaded on first use, and the named voices of this server.

Roles: `custom_voice` (preset speakers), `base` (cloning, blending, saved voices), `voice_design`. Each role
has a checkpoint (hub id or folder); its engine is loaded the first time the role is used. When a hub
checkpoint cannot be had (no network, nothing cached) and `offline_fallback` is on, the role falls back to
a tiny random checkpoint of the same kind, and `random_weights` says so (the UI shows a banner).
"""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

from tts_engine import TTSEngine, TTSError
from tts_engine.cache_paths import cache_root
from tts_engine.voices.voice import Voice

log = logging.getLogger("tts_server")
ROLES = ("custom_voice", "base", "voice_design")
NAME_RE = re.compile(r"^[\w][\w .\-()]{0,63}$", re.UNICODE)


def check_name(name: str) -> str:
    """A voice or preset name: letters, digits, space, . - _ ( ); no path separators, no '..'."""
    name = (name or "").strip()
    if not name or ".." in name or "/" in name or "\\" in name or not NAME_RE.match(name):
        raise TTSError("voice names may use letters, digits, spaces and . - _ ( ) only (no paths)")
    return name


class VoiceLibrary:
    """Named Base-model voices: presets from a folder plus voices registered while the server runs."""

    def __init__(self):
        self._voices: dict[str, Voice] = {}
        self._lock = threading.Lock()

    def add(self, name: str, voice: Voice) -> str:
        name = check_name(name)
        with self._lock:
            self._voices[name.lower()] = voice
        return name

    def get(self, name: str) -> Voice | None:
        with self._lock:
            return self._voices.get(check_name(name).lower())

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    def load_dir(self, folder: Path) -> None:
        for p in sorted(Path(folder).glob("*")):
            if p.suffix in (".safetensors", ".json") and p.is_file():
                try:
                    self.add(p.stem, Voice.load(p))
                except TTSError as e:
                    log.warning("skipping voice file %s: %s", p.name, e)


class EngineRegistry:
    def __init__(self, checkpoints: dict[str, str | None], device=None, dtype=None, offline_fallback: bool = True,
                 cache_dir: Path | None = None, engine_kw: dict | None = None):
        self.checkpoints = {r: checkpoints.get(r) for r in ROLES}
        self.device, self.dtype = device, dtype
        self.offline_fallback = offline_fallback
        self.cache_dir = Path(cache_dir or cache_root() / "tiny")
        self.engine_kw = engine_kw or {}
        self._engines: dict[str, TTSEngine] = {}
        self._locks = {r: threading.Lock() for r in ROLES}
        self.random_weights: set[str] = set()
        self.voices = VoiceLibrary()
        self.uploaded = None     # server/voice_store.VoiceStore: voices uploaded through /v1/audio/voices

    def configured(self, role: str) -> bool:
        return bool(self.checkpoints.get(role))

    def loaded(self, role: str) -> bool:
        return role in self._engines

    def get(self, role: str) -> TTSEngine:
        if role not in ROLES:
            raise TTSError(f"unknown model role {role!r}")
        if not self.configured(role):
            raise TTSError(f"no {role.replace('_', ' ')} checkpoint is configured on this server")
        with self._locks[role]:
            if role not in self._engines:
                self._engines[role] = self._load(role)
            return self._engines[role]

    def put(self, role: str, engine) -> None:
        """Serve `engine` for `role` from now on (ZeroGPU: the main process's stand-in for an engine loaded at
        start-up, see ui/zerogpu.py)."""
        with self._locks[role]:
            self._engines[role] = engine

    def _load(self, role: str) -> TTSEngine:
        ckpt = self.checkpoints[role]
        try:
            return TTSEngine.from_pretrained(ckpt, device=self.device, dtype=self.dtype, **self.engine_kw)
        except TTSError as e:
            if not self.offline_fallback or Path(str(ckpt)).exists():
                raise
            log.warning("%s: %s -- falling back to a tiny random checkpoint", role, e)
        from tts_engine import make_tiny

        folder = self.cache_dir / role
        if not (folder / "speech_tokenizer" / "model.safetensors").exists():
            make_tiny(folder, kind=role, size="1b7" if role == "voice_design" else "0b6", seed=0)
        self.random_weights.add(role)
        return TTSEngine.from_pretrained(str(folder), device=self.device, dtype=self.dtype, **self.engine_kw)

    def close(self) -> None:
        for e in self._engines.values():
            e.close()
