"""What one browser session owns, and the files the page offers for download.

A session's voices (clones, loaded voice files, exported blends) live in a `gr.State` dict {name: Voice}:
per browser tab, gone when the page closes; one session never sees another's. `Voices` turns a voice choice
(`ryan`, `preset:emma`, `uploaded:<name>`, `my:<name>`, `file`) into what `engine.stream` takes; `uploaded:` are
the voices uploaded through `POST /v1/audio/voices` (serving/voice_store.py), shared by every session. `Files`
writes voice files (and WAVs: dialogue lines, takes) into a private temporary folder and deletes each after
`limits.file_ttl_seconds`."""
from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path

from tts_engine import TTSError
from tts_engine.voices.presets import PresetLibrary
from tts_engine.voices.voice import Voice

from serving import voice_store

from ui.config import FILE_CHOICE, ROLE_LABEL, SR
from ui.roles import Models, speaker_label


UPLOADED = "uploaded:"     # the choice prefix of a voice uploaded through the API


def remember(session: dict | None, name: str, voice: Voice) -> dict:
    """A new session dict with `voice` kept under `name` (gr.State values are replaced, not mutated)."""
    out = dict(session or {})
    out[name] = voice
    return out


class Voices:
    """The voices a session can choose from, and the resolution of a choice to an engine voice."""

    def __init__(self, models: Models, presets: PresetLibrary):
        self.models, self.presets = models, presets

    def choices(self, session: dict | None, blend: bool = False) -> list[tuple[str, str]]:
        """(label, value) pairs for a voice dropdown: CustomVoice speakers, Base preset clips, this session's
        voices, and (Blend tab) "use the uploaded voice file"."""
        ch = [(speaker_label(s), s) for s in self.models.speakers()]
        if self.models.has("base"):
            ch += [(f"{p.name} · {p.language.title()} · preset clip (Base)", f"preset:{p.id}") for p in self.presets]
            ch += [(f"☁️ {n} · uploaded voice (Base)", f"{UPLOADED}{n}") for n in self._uploaded_names()]
        for name, v in (session or {}).items():
            kind = "blend" if v.kind == "embedding" else "clone"
            ch.append((f"🎤 {name} · your {kind} ({ROLE_LABEL.get(self.models.role_of(v, check=False), '?')})",
                       f"my:{name}"))
        if blend:
            ch.append(("📄 Voice file (upload below)", FILE_CHOICE))
        return ch

    def load_file(self, path) -> Voice:
        """A voice file (.safetensors or .json; never a pickle) that fits one of this server's models."""
        if not path:
            raise TTSError("upload a voice file (.safetensors or .json) first")
        voice = Voice.load(path)
        self.models.role_of(voice)
        return voice

    def _uploaded_names(self) -> list[str]:
        store = voice_store.store_of(self.models.registry)
        return store.names() if store is not None else []

    def _is_preset_clip(self, key: str) -> bool:
        if key.startswith("preset:"):
            return True
        return (self.models.has("base") and key.lower() in self.presets
                and key.lower() not in self.models.speakers())

    def resolve(self, key: str, session: dict | None, file=None):
        """A voice choice -> (role, voice for engine.stream): CustomVoice speaker name, `preset:<id>`,
        `my:<session name>` or `file` (the uploaded voice file)."""
        key = (key or "").strip()
        session = session or {}
        if not key:
            raise TTSError("choose a voice")
        if key == FILE_CHOICE:
            v = self.load_file(file)
            return self.models.role_of(v), v
        if key.startswith(UPLOADED):
            engine = self.models.engine("base")
            v = voice_store.voice_for(self.models.registry, key[len(UPLOADED):], engine)
            if v is None:
                raise TTSError(f"there is no uploaded voice named {key[len(UPLOADED):]!r} (any more): reload the page")
            return "base", v
        if self._is_preset_clip(key):
            pid = key.split(":", 1)[-1]
            self.presets.get(pid)   # unknown id -> readable error before loading anything
            return "base", self.presets.voice(self.models.engine("base"), pid)
        if key.startswith("my:") or key in session:
            name = key[3:] if key.startswith("my:") else key
            if name not in session:
                raise TTSError(f"there is no voice named {name!r} in this session (voices you clone or load "
                               "live as long as the page stays open)")
            v = session[name]
            return self.models.role_of(v), v
        if key.lower() in self.models.speakers():
            return "custom_voice", key.lower()
        known = [v for _, v in self.choices(session)]
        raise TTSError(f"unknown voice {key!r}; choose one of: {', '.join(known) or '(none)'}")

    def embedding_of(self, key: str, session: dict | None, file=None):
        """(role, embedding vector [H], label) of a voice choice, for blending."""
        role, v = self.resolve(key, session, file)
        if isinstance(v, str):
            return role, self.models.engine("custom_voice").preset_embedding(v).numpy(), speaker_label(v)
        if v.kind == "preset":
            return (role, self.models.engine("custom_voice").preset_embedding(v.speaker).numpy(),
                    speaker_label(v.speaker))
        return role, v.embedding.float().numpy(), v.name or key

    def role_of_key(self, key, session: dict | None = None) -> str | None:
        """Which model a voice choice needs, without loading anything (None when unknown)."""
        key = str(key or "").strip()
        if key.startswith(UPLOADED):
            return "base" if self.models.has("base") else None
        if key.startswith("preset:") or (key.lower() in self.presets and self.models.has("base")):
            return "base"
        if key.startswith("my:") or key in (session or {}):
            v = (session or {}).get(key[3:] if key.startswith("my:") else key)
            return self.models.role_of(v, check=False) if v is not None else None
        if key.lower() in self.models.speakers():
            return "custom_voice"
        return None

    def supports_instruct(self, key, session: dict | None = None) -> bool:
        role = self.role_of_key(key, session)
        return role in self.models.roles and self.models.roles[role].supports_instruct


class Files:
    """Voice files offered for download: one private folder per server, each file in its own random
    subfolder, deleted `ttl_seconds` after it was written (checked whenever a new one is written)."""

    def __init__(self, ttl_seconds: float):
        self.ttl_seconds = ttl_seconds
        self.dir = Path(tempfile.mkdtemp(prefix="qwen3-tts-live-"))

    def save_voice(self, voice: Voice, name: str, fmt: str) -> str:
        fmt = "json" if str(fmt).lower().lstrip(".") == "json" else "safetensors"
        return str(voice.save(self._new_path(name, fmt, "voice")))

    def save_wav(self, pcm, name: str) -> str:
        """int16 mono samples at 24 kHz as a 16-bit WAV file (expires like the voice files)."""
        import soundfile as sf

        path = self._new_path(name, "wav", "audio")
        sf.write(str(path), pcm, SR, subtype="PCM_16")
        return str(path)

    def save_text(self, text: str, name: str, ext: str) -> str:
        """A UTF-8 text file `<name>.<ext>` (subtitles; expires like the voice files)."""
        path = self._new_path(name, ext, "text")
        path.write_text(text, encoding="utf-8")
        return str(path)

    def _new_path(self, name: str, ext: str, fallback: str) -> Path:
        """A fresh file `<name>.<ext>` in its own random subfolder (old ones pruned first)."""
        self.prune()
        d = self.dir / uuid.uuid4().hex
        d.mkdir(parents=True)
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name).strip("_") or fallback
        return d / f"{safe}.{ext}"

    def prune(self) -> None:
        cutoff = time.time() - self.ttl_seconds
        for d in self.dir.iterdir():
            try:
                if d.stat().st_mtime < cutoff:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
