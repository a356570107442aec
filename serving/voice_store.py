"""Uploaded voices (`POST /v1/audio/voices`): cloned Base-model voices kept on disk across restarts.

One safetensors file per voice in the data folder (never pickle): the cloned voice (speaker embedding, and for
in-context voices the reference codes and transcript) plus the reference clip itself (int16), so the voice can
be cloned again for a Base checkpoint of another width. The JSON header holds what the list endpoint shows
(name, consent, created_at, file_size, mime_type, ref_text, ref_text_source = "asr" when Whisper wrote it,
speaker_description) and the SHA-256 of the owner's token. File names are a hash of the voice name, so no name
reaches the file system.

Ownership: an upload returns an `owner_token` (or keeps the one the client sent in the `X-Voice-Owner-Token`
header). Deleting a voice, or uploading another under its name, needs that token, or the server's admin key
(`TTS_ADMIN_KEY`) in `X-Admin-Key` or `Authorization: Bearer`. Without an admin key configured nobody can touch
another client's voices.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tts_engine import TTSError
from tts_engine.cache_paths import cache_root
from tts_engine.voices.voice import Voice

from serving.registry import check_name

log = logging.getLogger("tts_server")
SUFFIX = ".safetensors"


class VoiceStoreError(TTSError):
    """A refusal with an HTTP status (400 bad input, 403 not the owner, 404 unknown, 409 name taken, 413 too big)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass
class StoreLimits:
    max_voices: int = 1000                 # uploaded voices kept (vLLM-Omni's SPEAKER_MAX_UPLOADED default)
    max_clip_bytes: int = 10 * 2**20       # the uploaded audio file (vLLM-Omni: 10 MB)
    max_ref_text_chars: int = 1000
    max_description_chars: int = 500
    max_consent_chars: int = 200

    @classmethod
    def from_env(cls) -> "StoreLimits":
        kw = {}
        for name, env in (("max_voices", "TTS_MAX_UPLOADED_VOICES"), ("max_clip_bytes", "TTS_MAX_VOICE_CLIP_BYTES")):
            if (v := os.environ.get(env)) is not None:
                kw[name] = int(v)
        return cls(**kw)


def default_folder() -> Path:
    """TTS_VOICES_DIR, else voices/ in the cache folder (TTS_CACHE_DIR, else ~/.cache/qwen3-tts-live)."""
    if d := os.environ.get("TTS_VOICES_DIR"):
        return Path(d).expanduser()
    return cache_root() / "voices"


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def public_info(meta: dict) -> dict:
    """The entry `GET /v1/audio/voices` lists under `uploaded_voices` (vLLM-Omni's fields, and ours)."""
    out = {k: meta[k] for k in ("name", "consent", "created_at", "file_size", "mime_type") if k in meta}
    for k in ("ref_text", "ref_text_source", "speaker_description"):
        if meta.get(k):
            out[k] = meta[k]
    out["mode"] = meta.get("mode")
    return out


class VoiceStore:
    """The uploaded voices of a server: {lowercase name: (Voice, metadata)}, mirrored in `folder`."""

    def __init__(self, folder: Path | str | None = None, admin_key: str | None = None,
                 limits: StoreLimits | None = None):
        self.folder = Path(folder) if folder else default_folder()
        self.admin_key = admin_key if admin_key is not None else (os.environ.get("TTS_ADMIN_KEY") or None)
        self.limits = limits or StoreLimits.from_env()
        self._voices: dict[str, tuple[Voice, dict]] = {}
        self._lock = threading.Lock()
        self._load()

    # --- lookup ----------------------------------------------------------------------------------------
    def get(self, name: str) -> Voice | None:
        try:
            key = check_name(name).lower()
        except TTSError:
            return None
        with self._lock:
            item = self._voices.get(key)
        return item[0] if item else None

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(m["name"] for _, m in self._voices.values())

    def list(self) -> list[dict]:
        with self._lock:
            items = sorted(self._voices.values(), key=lambda vm: vm[1]["created_at"])
        return [public_info(m) for _, m in items]

    # --- changes ---------------------------------------------------------------------------------------
    def is_admin(self, key: str | None) -> bool:
        return bool(self.admin_key and key and hmac.compare_digest(key.encode(), self.admin_key.encode()))

    def check_may_write(self, name: str, owner_token: str | None, admin: bool) -> str:
        """-> the checked name. Raises 403 when `name` exists and belongs to someone else."""
        name = self.check_new_name(name)
        with self._lock:
            item = self._voices.get(name.lower())
        if item is not None and not admin and not self._owns(item[1], owner_token):
            raise VoiceStoreError(403, f"voice {name!r} belongs to another client: send its owner token "
                                  "(X-Voice-Owner-Token) or use another name", param="name", code="voice_not_owned")
        return name

    def check_new_name(self, name: str) -> str:
        try:
            return check_name(name)
        except TTSError as e:
            raise VoiceStoreError(400, f"invalid voice name: {e}", param="name", code="invalid_voice_name") from None

    def add(self, name: str, voice: Voice, meta: dict, owner_token: str | None,
            admin: bool = False) -> tuple[dict, str]:
        """Keep `voice` under `name` (replacing the caller's own voice of that name). -> (public info, owner token)."""
        name = self.check_may_write(name, owner_token, admin)
        token = owner_token or secrets.token_urlsafe(24)
        with self._lock:
            key = name.lower()
            taken = self._voices.get(key)      # again under the lock: another upload may have won meanwhile
            if taken is not None and not admin and not self._owns(taken[1], owner_token):
                raise VoiceStoreError(403, f"voice {name!r} belongs to another client", param="name",
                                      code="voice_not_owned")
            if key not in self._voices and len(self._voices) >= self.limits.max_voices:
                raise VoiceStoreError(400, f"this server keeps at most {self.limits.max_voices} uploaded voices; "
                                      "delete one first", code="voice_limit_reached")
            previous = self._voices.get(key)
            meta = dict(meta, name=name, created_at=int(time.time()), owner_sha256=_token_hash(token))
            voice.name = name
            voice.meta = {"uploaded": meta}
            self.folder.mkdir(parents=True, exist_ok=True)
            final = self._path(name)
            part = final.with_name(final.stem + ".part" + SUFFIX)
            voice.save(part)
            os.replace(part, final)                 # atomic: a crash never leaves half a voice file
            self._voices[key] = (voice, meta)
        if previous is not None:
            log.warning("uploaded voice %r replaced", name)
        return public_info(meta), token

    def delete(self, name: str, owner_token: str | None, admin: bool = False) -> str:
        try:
            key = check_name(name).lower()
        except TTSError:
            key = None
        with self._lock:
            item = self._voices.get(key) if key else None
            if item is None:
                raise VoiceStoreError(404, f"Voice '{name}' not found", param="name", code="voice_not_found")
            if not admin and not self._owns(item[1], owner_token):
                raise VoiceStoreError(403, f"voice {item[1]['name']!r} belongs to another client: deleting it needs "
                                      "its owner token (X-Voice-Owner-Token) or the server's admin key",
                                      param="name", code="voice_not_owned")
            self._path(item[1]["name"]).unlink(missing_ok=True)
            del self._voices[key]
            return item[1]["name"]

    # --- files -----------------------------------------------------------------------------------------
    @staticmethod
    def _owns(meta: dict, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(meta.get("owner_sha256", ""), _token_hash(token))

    def _path(self, name: str) -> Path:
        return self.folder / (hashlib.sha256(name.lower().encode("utf-8")).hexdigest()[:32] + SUFFIX)

    def _load(self) -> None:
        if not self.folder.is_dir():
            return
        for p in sorted(self.folder.glob("*" + SUFFIX)):
            if ".part" in p.name:
                continue
            try:
                voice = Voice.load(p)
                meta = voice.meta.get("uploaded")
                if not isinstance(meta, dict) or not meta.get("name"):
                    raise TTSError("no upload metadata")
                name = check_name(meta["name"])
                if p != self._path(name):
                    raise TTSError("file name does not match the voice name")
                self._voices[name.lower()] = (voice, meta)
            except (TTSError, json.JSONDecodeError) as e:
                log.warning("skipping uploaded voice file %s: %s", p.name, e)


# --- the uploaded voices of an engine registry (its `uploaded` store), for the page and the API alike -----------

def store_of(registry) -> VoiceStore | None:
    """The registry's store of uploaded voices; None where it keeps none (a remote backend, no Base model)."""
    return getattr(registry, "uploaded", None)


def find(registry, name: str | None) -> Voice | None:
    """The uploaded voice called `name` (case-insensitive), or None."""
    store = store_of(registry)
    return store.get(name) if store is not None and name else None


def voice_for(registry, name: str, engine) -> Voice | None:
    """The uploaded voice `name`, fitted to `engine` (cloned again from its kept clip, through the engine's
    reference cache, when it was made for a Base checkpoint of another width). None when unknown."""
    v = find(registry, name)
    if v is None or v.hidden_size == engine.hidden_size or v.ref_audio is None:
        return v
    wav = v.ref_audio.float().numpy() / 32767.0
    return engine.clone_voice((wav, v.ref_sr), ref_text=v.ref_text, x_vector_only=v.kind != "icl", name=v.name)


def keep_clip(voice: Voice, wav, sr: int) -> Voice:
    """`voice` with its reference clip (float samples in [-1, 1]) kept as int16, so the store can clone it again
    for a Base checkpoint of another width."""
    import torch

    voice.ref_audio = torch.from_numpy((wav.clip(-1, 1) * 32767).astype("int16"))
    voice.ref_sr = int(sr)
    return voice
