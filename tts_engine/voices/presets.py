"""Our own preset voices for Base checkpoints: reference clips listed in `presets/presets.json`.

Each preset has a clip, its transcript, a name, a language, a source and a licence. The first time a preset
is used with a given Base model it is cloned (in-context mode) and the resulting voice is cached on disk as a
safetensors voice file, one folder per model, so later uses (and later runs) skip the encoders.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tts_engine.cache_paths import cache_root
from tts_engine.errors import TTSError
from tts_engine.voices.voice import Voice

log = logging.getLogger(__name__)
FORMAT = "qwen3-tts-live.presets/1"
REQUIRED = ("id", "name", "language", "clip", "transcript", "source", "licence")


def default_cache_dir() -> Path:
    return cache_root() / "presets"


@dataclass(frozen=True)
class Preset:
    id: str
    name: str
    language: str
    clip: Path
    transcript: str
    source: str
    licence: str
    description: str = ""

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.clip.read_bytes())
        h.update(self.transcript.encode("utf-8"))
        return h.hexdigest()[:16]


def load_presets(folder: str | os.PathLike) -> list[Preset]:
    """The presets listed in `folder/presets.json` whose clip exists; bad entries are skipped with a warning."""
    folder = Path(folder)
    index = folder / "presets.json"
    if not index.exists():
        return []
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("ignoring %s: %s", index, e)
        return []
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("voices"), list):
        log.warning("ignoring %s: not a %s file", index, FORMAT)
        return []
    out, seen = [], set()
    for entry in data["voices"]:
        if not isinstance(entry, dict) or any(not isinstance(entry.get(k), str) or not entry[k].strip()
                                              for k in REQUIRED):
            log.warning("skipping preset entry without %s: %r", ", ".join(REQUIRED), entry)
            continue
        pid = entry["id"].strip().lower()
        clip = (folder / entry["clip"]).resolve()
        if pid in seen or not pid.replace("_", "").replace("-", "").isalnum():
            log.warning("skipping preset with a duplicate or unusable id %r", pid)
            continue
        if folder.resolve() not in clip.parents or not clip.is_file():
            log.warning("skipping preset %r: clip %s not found in %s", pid, entry["clip"], folder)
            continue
        seen.add(pid)
        out.append(Preset(id=pid, name=entry["name"].strip(), language=entry["language"].strip().lower(),
                          clip=clip, transcript=entry["transcript"].strip(), source=entry["source"].strip(),
                          licence=entry["licence"].strip(), description=str(entry.get("description", "")).strip()))
    return out


def model_key(engine) -> str:
    """Identifies the Base checkpoint an engine runs (its weights' fingerprint when available)."""
    model = getattr(engine, "model", None)
    parts = [str(getattr(engine, "kind", "")), str(getattr(engine, "hidden_size", ""))]
    weights = getattr(model, "weights", None)
    try:
        parts.append(weights.fingerprint())
    except Exception:
        parts.append(str(getattr(model, "folder", "")))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class PresetLibrary:
    """Preset voices, cloned on first use per model and cached on disk."""

    def __init__(self, folder: str | os.PathLike, cache_dir: str | os.PathLike | None = None):
        self.folder = Path(folder)
        self.presets = {p.id: p for p in load_presets(self.folder)}
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._memo: dict[tuple[str, str], Voice] = {}
        self._lock = threading.Lock()

    def __contains__(self, pid: str) -> bool:
        return str(pid).strip().lower() in self.presets

    def __iter__(self):
        return iter(self.presets.values())

    def __len__(self) -> int:
        return len(self.presets)

    def get(self, pid: str) -> Preset:
        p = self.presets.get(str(pid).strip().lower())
        if p is None:
            raise TTSError(f"unknown preset voice {pid!r}; choose one of: {', '.join(self.presets) or '(none)'}")
        return p

    def cache_path(self, engine, preset: Preset) -> Path:
        return self.cache_dir / model_key(engine) / f"{preset.id}-{preset.fingerprint()}.safetensors"

    def voice(self, engine, pid: str) -> Voice:
        """The preset cloned with `engine` (a Base TTSEngine): from memory, the disk cache, or cloned now."""
        preset = self.get(pid)
        key = (model_key(engine), preset.id)
        with self._lock:
            if key in self._memo:
                return self._memo[key]
            path = self.cache_path(engine, preset)
            voice = None
            if path.exists():
                try:
                    voice = Voice.load(path)
                    if voice.hidden_size != engine.hidden_size:
                        voice = None
                except TTSError as e:
                    log.warning("preset cache %s unusable (%s); cloning again", path, e)
            if voice is None:
                voice = engine.clone_voice(str(preset.clip), ref_text=preset.transcript, name=preset.name)
                voice.meta.update({"preset": preset.id, "language": preset.language, "source": preset.source,
                                   "licence": preset.licence})
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".tmp{os.getpid()}.safetensors")
                    voice.save(tmp)
                    os.replace(tmp, path)
                except OSError as e:   # a read-only cache is not fatal
                    log.warning("cannot cache preset voice at %s: %s", path, e)
            self._memo[key] = voice
            return voice
