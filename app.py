#!/usr/bin/env python3
"""Qwen3-TTS Live: the Gradio app (preset voices, cloning, blending, voice design), streaming as it speaks.

    python app.py                       # http://0.0.0.0:7860, CustomVoice + Base 0.6B, loaded on first use
    python app.py --tiny                # tiny random checkpoints: no download, the audio is noise
    python app.py --help                # every flag; each has an environment variable too

The UI is thin: every handler calls the engine's public API (`TTSEngine.stream`, `clone_voice`,
`voice_from_embedding`, `preset_embedding`, `Voice.load/save`) and the pure blending functions in
`tts_engine.voices.blend`. Model roles (CustomVoice / Base / VoiceDesign) are served by
`server.registry.EngineRegistry`, which loads each checkpoint on first use.

API (gradio_client, `Client(url).predict(..., api_name="/preset")`): `/preset`, `/clone`, `/blend`,
`/blend_sweep`, `/blend_export`, `/design`, `/load_voice`, `/stop`; each documents its arguments on the
page's "Use via API" view. Generation endpoints stream: iterate `client.submit(...)` for the live chunks;
the final output holds the lossless WAV.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import gradio as gr

from server.limits import Limits
from server.registry import EngineRegistry, check_name
from tts_engine import EngineBusyError, TTSError
from tts_engine.voices import blend as blendlib
from tts_engine.voices.presets import PresetLibrary
from tts_engine.voices.voice import Voice

log = logging.getLogger("qwen3_tts_live")

ROOT = Path(__file__).resolve().parent
SR = 24000
ROLES = ("custom_voice", "base", "voice_design")
ROLE_LABEL = {"custom_voice": "CustomVoice", "base": "Base", "voice_design": "VoiceDesign"}
DEFAULT_CHECKPOINTS = {"custom_voice": "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
                       "base": "Qwen/Qwen3-TTS-12Hz-0.6B-Base", "voice_design": ""}
ENV = {"custom_voice": "TTS_CUSTOM_VOICE_MODEL", "base": "TTS_BASE_MODEL", "voice_design": "TTS_VOICE_DESIGN_MODEL"}
# native language of the released CustomVoice speakers (Qwen3-TTS README)
NATIVE = {"vivian": "Chinese", "serena": "Chinese", "uncle_fu": "Chinese", "dylan": "Chinese (Beijing dialect)",
          "eric": "Chinese (Sichuan dialect)", "ryan": "English", "aiden": "English", "ono_anna": "Japanese",
          "sohee": "Korean"}
SENTENCE_CHARS = 200      # long text is streamed in pieces of at most this many characters (whole sentences)
SENTENCE_PAUSE_S = 0.12   # silence between pieces
FILE_CHOICE = "file"
DEFAULT_SAMPLING = dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)

CSS = """
#random-weights-banner {border: 2px solid #f59e0b; background: #fffbeb; color: #78350f; border-radius: 8px;
  padding: 10px 14px;}
#random-weights-banner * {color: #78350f !important;}
#status {min-height: 2.2em; font-variant-numeric: tabular-nums;}
.share {text-align: center; font-weight: 600; padding-top: 1.6em;}
.sweep-row .block {min-width: 150px;}
"""


# --- text ----------------------------------------------------------------------------------------------

_ENDERS = set(".!?…;。！？；")
_CJK_ENDERS = set("。！？；…")
_CLOSERS = set("\"'”’」』)]）")


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`: cut after . ! ? … ; (followed by a space) or 。！？； and at line breaks;
    closing quotes and brackets stay with their sentence, '3.14' is not cut."""
    out, cur, i, n = [], [], 0, len(text)

    def flush():
        s = "".join(cur).strip()
        if s:
            out.append(s)
        cur.clear()

    while i < n:
        ch = text[i]
        if ch == "\n":
            flush()
            i += 1
            continue
        cur.append(ch)
        i += 1
        if ch in _ENDERS:
            while i < n and (text[i] in _ENDERS or text[i] in _CLOSERS):
                cur.append(text[i])
                i += 1
            if i >= n or text[i].isspace() or ch in _CJK_ENDERS:
                flush()
    flush()
    return out


def _hard_split(s: str, max_chars: int) -> list[str]:
    """A sentence longer than max_chars, cut at the last comma or space before the limit."""
    parts = []
    while len(s) > max_chars:
        window = s[:max_chars]
        cut = max(window.rfind(", "), window.rfind("，"), window.rfind("、"))
        if cut < max_chars // 3:
            cut = window.rfind(" ")
        if cut < max_chars // 3:
            cut = max_chars - 1
        parts.append(s[:cut + 1].strip())
        s = s[cut + 1:].strip()
    if s:
        parts.append(s)
    return parts


def chunk_text(text: str, max_chars: int = SENTENCE_CHARS) -> list[str]:
    """Whole sentences grouped in order into pieces of at most `max_chars` characters (a longer sentence is
    cut at a comma or space). Every piece is spoken with the same voice and seed."""
    pieces, cur = [], ""
    for sent in split_sentences(text):
        for part in _hard_split(sent, max_chars):
            if cur and len(cur) + 1 + len(part) > max_chars:
                pieces.append(cur)
                cur = part
            elif cur:
                cur = cur + ("" if cur[-1] in _CJK_ENDERS else " ") + part
            else:
                cur = part
    if cur:
        pieces.append(cur)
    return pieces


def to_int16(wav: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16, one fixed scale for every chunk (Gradio would peak-normalise each float
    chunk on its own, which makes the loudness jump at chunk joins)."""
    return (np.clip(np.asarray(wav, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


def speaker_label(name: str) -> str:
    pretty = name.replace("_", " ").title()
    native = NATIVE.get(name.lower())
    return f"{pretty} · {native}" if native else pretty


# --- configuration -------------------------------------------------------------------------------------

@dataclass
class AppConfig:
    checkpoints: dict = field(default_factory=lambda: dict(DEFAULT_CHECKPOINTS))
    device: str | None = None
    dtype: str | None = None
    tiny: bool = False                 # tiny random checkpoints for every role (no download)
    offline_fallback: bool = True      # hub unreachable and nothing cached -> tiny random checkpoints
    cache_dir: Path | None = None      # tiny checkpoints and preset voices
    presets_dir: Path = ROOT / "presets"
    examples_file: Path = ROOT / "assets" / "examples.json"
    concurrency: int | None = None     # generation events running at once (engine batch)
    preload: bool = False              # load the engines (and warm up) before serving
    limits: Limits = field(default_factory=Limits.from_env)
    backend: str | None = None         # a remote OpenAI-compatible speech server instead of local engines


@dataclass
class RoleInfo:
    role: str
    checkpoint: str
    folder: Path
    random: bool
    kind: str
    speakers: list
    languages: list
    supports_instruct: bool
    hidden_size: int
    size: str


def _cache_root(cfg: AppConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen3-tts-live"


def _tiny_checkpoint(role: str, cache: Path) -> Path:
    from tts_engine.checkpoint import resolve_checkpoint
    from tts_engine.tiny import make_tiny

    folder = cache / "tiny" / role
    try:
        return resolve_checkpoint(str(folder))
    except TTSError:
        shutil.rmtree(folder, ignore_errors=True)
        make_tiny(folder, kind=role, size="1b7" if role == "voice_design" else "0b6", seed=0)
        return resolve_checkpoint(str(folder))


def prepare_role(role: str, checkpoint: str, cfg: AppConfig) -> RoleInfo:
    """Find (download, or find in the cache) a role's checkpoint and read its config; weights load later.
    When the hub cannot be reached and nothing is cached, fall back to a tiny random checkpoint."""
    from tts_engine.checkpoint import read_json, resolve_checkpoint
    from tts_engine.config import ModelConfig

    random_weights = cfg.tiny
    if cfg.tiny:
        folder = _tiny_checkpoint(role, _cache_root(cfg))
    else:
        try:
            folder = resolve_checkpoint(checkpoint)
        except TTSError as e:
            if not cfg.offline_fallback or Path(checkpoint).expanduser().exists() or checkpoint.count("/") != 1:
                raise
            log.warning("%s checkpoint %s unavailable (%s): falling back to a tiny random checkpoint",
                        ROLE_LABEL[role], checkpoint, e)
            folder, random_weights = _tiny_checkpoint(role, _cache_root(cfg)), True
    mc = ModelConfig.from_dict(read_json(folder / "config.json"))
    if mc.tts_model_type != role:
        raise TTSError(f"{checkpoint} is a {ROLE_LABEL.get(mc.tts_model_type, mc.tts_model_type)} checkpoint, "
                       f"but it was given as the {ROLE_LABEL[role]} model")
    return RoleInfo(role=role, checkpoint=checkpoint, folder=folder, random=random_weights, kind=mc.tts_model_type,
                    speakers=mc.speakers, languages=mc.languages, supports_instruct=mc.supports_instruct,
                    hidden_size=mc.talker.hidden_size, size=mc.tts_model_size)


def _guard(fn):
    """Turn every failure of a handler into a message in the page (gr.Error), never a traceback."""
    def convert(e: BaseException):
        if isinstance(e, gr.Error):
            return e
        if isinstance(e, EngineBusyError):
            return gr.Error(f"The server is busy: {e}")
        if isinstance(e, TTSError):
            return gr.Error(str(e)[:1].upper() + str(e)[1:])
        log.exception("handler %s failed", fn.__name__)
        return gr.Error(f"Something went wrong on the server ({type(e).__name__}). The app keeps running; "
                        "please try again.")

    import inspect
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except Exception as e:
                raise convert(e) from None
        return gen

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise convert(e) from None
    return call


def _api_doc(fn) -> str:
    """The handler's docstring (description, parameters, returns) for the "Use via API" page."""
    import inspect
    return inspect.getdoc(fn) or ""


# --- the app -------------------------------------------------------------------------------------------

class TTSApp:
    def __init__(self, cfg: AppConfig | None = None):
        self.cfg = cfg = cfg or AppConfig()
        self.limits = cfg.limits
        self.roles: dict[str, RoleInfo] = {}
        if cfg.backend:
            self._init_remote(cfg)
            return
        for role in ROLES:
            ck = "tiny" if cfg.tiny else (cfg.checkpoints.get(role) or "").strip()
            if ck:
                self.roles[role] = prepare_role(role, ck, cfg)
        if not self.roles:
            raise TTSError("no checkpoint is configured: give at least one of --custom-voice-model, "
                           "--base-model, --voice-design-model")
        self.registry = EngineRegistry({r: str(i.folder) for r, i in self.roles.items()}, device=cfg.device,
                                       dtype=cfg.dtype, offline_fallback=False,
                                       engine_kw={"max_waiting": self.limits.max_queue})
        self.registry.random_weights |= {r for r, i in self.roles.items() if i.random}
        self.presets = PresetLibrary(cfg.presets_dir, _cache_root(cfg) / "presets")
        self.files_dir = Path(tempfile.mkdtemp(prefix="qwen3-tts-live-"))
        self._active: dict[str, set] = {}
        self._active_lock = threading.Lock()
        if cfg.concurrency:
            self.concurrency = int(cfg.concurrency)
        else:
            import torch
            gpu = torch.cuda.is_available() and str(cfg.device or "cuda").startswith("cuda")
            self.concurrency = 16 if gpu else 4
        self.c = SimpleNamespace()   # UI components, filled by build()
        self.examples = self._load_examples()

    def _init_remote(self, cfg: AppConfig) -> None:
        """--backend URL: every role is served by a remote OpenAI-compatible speech server."""
        from server.remote_backend import RemoteRegistry

        self.registry = RemoteRegistry(cfg.backend)
        for role in ROLES:
            if self.registry.configured(role):
                eng = self.registry.get(role)
                self.roles[role] = RoleInfo(role=role, checkpoint=self.registry.checkpoints[role], folder=Path("."),
                                            random=False, kind=role, speakers=eng.speakers, languages=eng.languages,
                                            supports_instruct=eng.supports_instruct, hidden_size=None, size="")
        self.presets = PresetLibrary(cfg.presets_dir, _cache_root(cfg) / "presets")
        self.files_dir = Path(tempfile.mkdtemp(prefix="qwen3-tts-live-"))
        self._active: dict[str, set] = {}
        self._active_lock = threading.Lock()
        self.concurrency = int(cfg.concurrency or 8)
        self.c = SimpleNamespace()
        self.examples = self._load_examples()

    # --- roles and engines ------------------------------------------------------------------------
    @property
    def random_roles(self) -> list[str]:
        return [r for r in ROLES if r in self.registry.random_weights]

    def has(self, role: str) -> bool:
        return role in self.roles

    def engine(self, role: str):
        if role not in self.roles:
            raise TTSError(f"this server runs no {ROLE_LABEL[role]} model"
                           + (" (start it with --voice-design-model)" if role == "voice_design" else ""))
        return self.registry.get(role)

    def languages(self) -> list[str]:
        langs = ["auto"]
        for info in self.roles.values():
            langs += [lang for lang in info.languages if lang not in langs]
        return langs

    def close(self) -> None:
        self.registry.close()
        shutil.rmtree(self.files_dir, ignore_errors=True)

    def preload(self) -> None:
        """Load every engine and run one short synthesis on each (first requests then start warm)."""
        if self.cfg.backend:
            return   # nothing to load here: a remote server serves every role
        for role in self.roles:
            t = time.perf_counter()
            eng = self.engine(role)
            voice = None
            if role == "custom_voice":
                voice = eng.speakers[0]
            elif role == "base":
                voice = eng.voice_from_embedding(np.ones(eng.hidden_size, np.float32))
            eng.synthesize("Hello.", voice=voice, instruct="A calm voice." if role == "voice_design" else None,
                           seed=0, max_new_tokens=8)
            log.info("%s ready in %.1f s", ROLE_LABEL[role], time.perf_counter() - t)

    # --- voices ---------------------------------------------------------------------------------------
    def voice_choices(self, session: dict | None, blend: bool = False) -> list[tuple[str, str]]:
        ch = []
        if self.has("custom_voice"):
            ch += [(speaker_label(s), s) for s in self.roles["custom_voice"].speakers]
        if self.has("base"):
            ch += [(f"{p.name} · {p.language.title()} · preset clip (Base)", f"preset:{p.id}") for p in self.presets]
        for name, v in (session or {}).items():
            kind = "blend" if v.kind == "embedding" else "clone"
            ch.append((f"🎤 {name} · your {kind} ({ROLE_LABEL.get(self._role_of(v, check=False), '?')})",
                       f"my:{name}"))
        if blend:
            ch.append(("📄 Voice file (upload below)", FILE_CHOICE))
        return ch

    def _role_of(self, voice: Voice, check: bool = True) -> str:
        if voice.kind == "preset" or voice.model_type == "custom_voice":
            role = "custom_voice"
        elif voice.model_type == "voice_design":
            raise TTSError("this voice file was made for a VoiceDesign model, which takes a description, not a voice")
        else:
            role = "base"
        if not check:
            return role
        if role not in self.roles:
            raise TTSError(f"this voice belongs to a {ROLE_LABEL[role]} model, which this server does not run")
        info = self.roles[role]
        if (voice.kind != "preset" and voice.hidden_size is not None and info.hidden_size is not None
                and voice.hidden_size != info.hidden_size):
            raise TTSError(f"this voice was made for a different model: its embedding has {voice.hidden_size} "
                           f"values, this server's {ROLE_LABEL[role]} model ({info.checkpoint}) needs "
                           f"{info.hidden_size}")
        if voice.kind == "preset" and voice.speaker.strip().lower() not in info.speakers:
            raise TTSError(f"unknown speaker {voice.speaker!r} in this voice file")
        return role

    def load_voice_file(self, path) -> Voice:
        if not path:
            raise TTSError("upload a voice file (.safetensors or .json) first")
        voice = Voice.load(path)
        self._role_of(voice)
        return voice

    def resolve(self, key: str, session: dict | None, file=None):
        """A voice choice -> (role, voice for engine.stream): CustomVoice speaker name, `preset:<id>`,
        `my:<session name>` or `file` (the uploaded voice file)."""
        key = (key or "").strip()
        session = session or {}
        if not key:
            raise TTSError("choose a voice")
        if key == FILE_CHOICE:
            v = self.load_voice_file(file)
            return self._role_of(v), v
        if key.startswith("preset:") or (self.has("base") and key.lower() in self.presets
                                         and not (self.has("custom_voice")
                                                  and key.lower() in self.roles["custom_voice"].speakers)):
            pid = key.split(":", 1)[-1]
            self.presets.get(pid)   # unknown id -> readable error before loading anything
            return "base", self.presets.voice(self.engine("base"), pid)
        if key.startswith("my:") or key in session:
            name = key[3:] if key.startswith("my:") else key
            if name not in session:
                raise TTSError(f"there is no voice named {name!r} in this session (voices you clone or load "
                               "live as long as the page stays open)")
            v = session[name]
            return self._role_of(v), v
        if self.has("custom_voice") and key.lower() in self.roles["custom_voice"].speakers:
            return "custom_voice", key.lower()
        known = [v for _, v in self.voice_choices(session)]
        raise TTSError(f"unknown voice {key!r}; choose one of: {', '.join(known) or '(none)'}")

    def embedding_of(self, key: str, session: dict | None, file=None):
        """(role, embedding vector [H], label) of a voice choice, for blending."""
        role, v = self.resolve(key, session, file)
        label = key
        if isinstance(v, str):
            return role, self.engine("custom_voice").preset_embedding(v).numpy(), speaker_label(v)
        if v.kind == "preset":
            return role, self.engine("custom_voice").preset_embedding(v.speaker).numpy(), speaker_label(v.speaker)
        if v.name:
            label = v.name
        return role, v.embedding.float().numpy(), label

    def _save_voice(self, voice: Voice, name: str, fmt: str) -> str:
        self._prune_files()
        fmt = "json" if str(fmt).lower().lstrip(".") == "json" else "safetensors"
        d = self.files_dir / uuid.uuid4().hex
        d.mkdir(parents=True)
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name).strip("_") or "voice"
        return str(voice.save(d / f"{safe}.{fmt}"))

    def _prune_files(self) -> None:
        cutoff = time.time() - self.limits.file_ttl_seconds
        for d in self.files_dir.iterdir():
            try:
                if d.stat().st_mtime < cutoff:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass

    def _dropdown_updates(self, session: dict) -> dict:
        c = self.c
        out = {}
        if hasattr(c, "p_voice"):
            out[c.p_voice] = gr.update(choices=self.voice_choices(session))
        for dd in getattr(c, "slot_voice", []):
            out[dd] = gr.update(choices=self.voice_choices(session, blend=True))
        return out

    # --- generation ------------------------------------------------------------------------------------
    def _track(self, request, stream, add: bool) -> None:
        key = getattr(request, "session_hash", None) or "_"
        with self._active_lock:
            if add:
                self._active.setdefault(key, set()).add(stream)
            else:
                s = self._active.get(key)
                if s is not None:
                    s.discard(stream)
                    if not s:
                        del self._active[key]

    def _seed(self, seed, randomize) -> int:
        if randomize or seed is None or (isinstance(seed, str) and not seed.strip()):
            return random.randrange(2**31)
        try:
            s = int(float(seed))
        except (TypeError, ValueError):
            raise TTSError("the seed must be a whole number") from None
        if s < 0 or s >= 2**63:
            raise TTSError("the seed must be a non-negative whole number")
        return s

    def _sampling(self, temperature, top_k, top_p, repetition_penalty, max_new_tokens) -> tuple[dict, int]:
        def num(v, default, cast=float):
            return default if v is None or v == "" else cast(v)
        sampling = {"temperature": num(temperature, DEFAULT_SAMPLING["temperature"]),
                    "top_k": num(top_k, DEFAULT_SAMPLING["top_k"], lambda x: int(float(x))),
                    "top_p": num(top_p, DEFAULT_SAMPLING["top_p"]),
                    "repetition_penalty": num(repetition_penalty, DEFAULT_SAMPLING["repetition_penalty"])}
        max_new = num(max_new_tokens, self.limits.max_new_tokens, lambda x: int(float(x)))
        if max_new < 1:
            raise TTSError("the maximum length must be at least 1 frame")
        return sampling, min(max_new, self.limits.max_new_tokens)

    def check_text(self, text) -> str:
        text = (text or "").strip() if isinstance(text, str) else ""
        if not text:
            raise TTSError("enter some text to speak")
        if len(text) > self.limits.max_text_chars:
            raise TTSError(f"the text is too long: {len(text)} characters; the limit is "
                           f"{self.limits.max_text_chars}. Split it or shorten it.")
        return text

    def _status(self, stage: str, *, ttfa=None, compute=0.0, audio_s=0.0, seed=None, piece=None, pieces=None,
                queue=None, note="", role=None) -> str:
        parts = [f"**{stage}**"]
        if queue is not None:
            parts.append(f"position in queue: {queue + 1} ({queue} ahead)")
        if ttfa is not None:
            parts.append(f"first audio {ttfa:.2f} s")
        if audio_s > 0 and compute > 0:
            parts.append(f"RTF {compute / audio_s:.2f}")
        if audio_s > 0:
            parts.append(f"{audio_s:.1f} s of audio")
        if pieces and pieces > 1:
            parts.append(f"part {piece}/{pieces}")
        if seed is not None:
            parts.append(f"seed {seed}")
        if note:
            parts.append(note)
        if role in self.registry.random_weights:
            parts.append("⚠️ random weights: noise")
        return " · ".join(parts)

    def _ensure_loaded_status(self, role: str):
        if not self.registry.loaded(role):
            return self._status(f"Loading the {ROLE_LABEL[role]} model (first use)…", role=role)
        return None

    def _speak(self, role, engine, text, voice, language, instruct, seed, sampling, max_new, request,
               note: str = "", extra_final: dict | None = None):
        """Stream `text` (in sentence groups, one voice, one seed) into the live player; end with the
        lossless WAV and the status line. Yields dicts {component: value}."""
        c = self.c
        pieces = chunk_text(text)
        t0 = time.perf_counter()
        ttfa, compute, n = None, 0.0, 0
        parts: list[np.ndarray] = []
        pause = np.zeros(int(SR * SENTENCE_PAUSE_S), np.int16)
        for k, piece in enumerate(pieces, 1):
            stream = engine.stream(piece, voice=voice, language=language or "auto", instruct=instruct, seed=seed,
                                   sampling=sampling, max_new_tokens=max_new)
            self._track(request, stream, True)
            try:
                waited = False
                while True:
                    pos = getattr(stream, "position", None)
                    if not pos:          # None: running (or done); 0: next in line
                        break
                    waited = True
                    yield {c.status: self._status("Waiting for the engine", queue=pos, seed=seed, role=role)}
                    time.sleep(0.25)
                if waited:
                    yield {c.status: self._status("Starting", seed=seed, role=role)}
                t_run = time.perf_counter()
                if k > 1:
                    parts.append(pause)
                    n += len(pause)
                    yield {c.live: (SR, pause)}
                for chunk in stream:
                    if len(chunk) == 0:
                        continue
                    pcm = to_int16(chunk)
                    if ttfa is None:
                        ttfa = time.perf_counter() - t0
                    parts.append(pcm)
                    n += len(pcm)
                    yield {c.live: (SR, pcm),
                           c.status: self._status("Streaming", ttfa=ttfa, compute=compute + time.perf_counter() - t_run,
                                                  audio_s=n / SR, seed=seed, piece=k, pieces=len(pieces), note=note,
                                                  role=role)}
                compute += time.perf_counter() - t_run
            finally:
                stream.cancel()
                self._track(request, stream, False)
        if n == 0:
            final = {c.final: None, c.status: self._status("Done: the model produced no audio (try another seed)",
                                                           seed=seed, role=role)}
        else:
            final = {c.final: (SR, np.concatenate(parts)),
                     c.status: self._status("Done", ttfa=ttfa, compute=compute, audio_s=n / SR, seed=seed,
                                            pieces=len(pieces), piece=len(pieces), note=note, role=role)}
        final[c.seed] = seed
        final.update(extra_final or {})
        yield final

    def _start(self, role: str, seed: int):
        """First yield of a generation: clear the lossless player, show the seed (and 'loading' if cold)."""
        c = self.c
        msg = self._ensure_loaded_status(role) or self._status("Starting", seed=seed, role=role)
        return {c.final: None, c.status: msg, c.seed: seed}

    # --- handlers (each is one API endpoint) ------------------------------------------------------------
    def preset(self, text: str, voice: str, language: str = "auto", instruct: str = "", session: dict | None = None,
               seed: float | None = None, randomize: bool = True, temperature: float = 0.9, top_k: int = 50,
               top_p: float = 1.0, repetition_penalty: float = 1.05, max_new_tokens: int | None = None,
               request: gr.Request = None):
        """Speak text with a preset voice: a CustomVoice speaker, one of our preset clips (Base model) or a voice
        you cloned or loaded in this session. Streams the audio while it is generated.

        Parameters:
            text: what to say (long text is spoken sentence group by sentence group, same voice and seed)
            voice: a CustomVoice speaker name (e.g. "ryan", "vivian"), "preset:<id>" for our Base preset clips (e.g. "preset:emma"), or "my:<name>" for a voice of this session
            language: "auto" or a language name the model knows (e.g. "english", "chinese")
            instruct: speaking-style instruction (only for checkpoints that follow instructions, e.g. 1.7B CustomVoice; otherwise ignored)
            seed: random seed (used when randomize is false)
            randomize: draw a new seed for this request (the seed used is returned)
            temperature: sampling temperature of the talker
            top_k: top-k of the talker (0 = off)
            top_p: top-p of the talker
            repetition_penalty: repetition penalty on the first codebook
            max_new_tokens: maximum frames (80 ms each) per sentence group
        Returns:
            live streamed audio, the full lossless WAV, the status line (time to first audio, real-time factor, audio length), the seed used
        """
        seed = self._seed(seed, randomize)
        text = self.check_text(text)
        sampling, max_new = self._sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens)
        role, v = self.resolve(voice, session)
        yield self._start(role, seed)
        engine = self.engine(role)
        note = ""
        inst = (instruct or "").strip() or None
        if inst and not self.roles[role].supports_instruct:
            inst, note = None, "instruction ignored: this checkpoint does not follow instructions"
        yield from self._speak(role, engine, text, v, language, inst, seed, sampling, max_new, request, note=note)

    def clone(self, ref_audio, ref_text: str = "", x_vector_only: bool = False, voice_name: str = "My voice",
              file_format: str = "safetensors", text: str = "", language: str = "auto",
              session: dict | None = None, seed: float | None = None, randomize: bool = True,
              temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0, repetition_penalty: float = 1.05,
              max_new_tokens: int | None = None, request: gr.Request = None):
        """Clone a voice from a short reference clip (Base model), keep it in this session under a name, offer
        it as a voice file, and speak the text with it (streamed).

        Parameters:
            ref_audio: the reference clip (3-10 s of clean speech; wav, flac, mp3, ogg...)
            ref_text: exact transcript of the clip (in-context cloning, best similarity); leave empty for x-vector-only cloning
            x_vector_only: use only the speaker embedding (no transcript needed; needed for blending)
            voice_name: name to keep the voice under in this session (letters, digits, spaces, . - _ ( ))
            file_format: "safetensors" or "json" for the voice file
            text: what to say with the cloned voice
            language: "auto" or a language name
            seed: random seed (used when randomize is false)
            randomize: draw a new seed for this request
            temperature: sampling temperature
            top_k: top-k (0 = off)
            top_p: top-p
            repetition_penalty: repetition penalty
            max_new_tokens: maximum frames (80 ms each) per sentence group
        Returns:
            live streamed audio, full lossless WAV, status line, seed used, the voice file
        """
        from tts_engine.audio import load_audio, trim_reference

        seed = self._seed(seed, randomize)
        text = self.check_text(text)
        sampling, max_new = self._sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens)
        name = check_name(voice_name or "My voice")
        if not ref_audio:
            raise TTSError("upload or record a reference clip first")
        session = dict(session or {})
        yield self._start("base", seed)
        engine = self.engine("base")
        wav, sr = load_audio(ref_audio)
        dur = len(wav) / sr
        if dur < self.limits.min_reference_seconds:
            raise TTSError(f"the reference clip is too short ({dur:.2f} s); record at least "
                           f"{self.limits.min_reference_seconds:g} s (3-10 s works best)")
        if not np.any(np.abs(wav) > 1e-4):
            raise TTSError("the reference clip is silent")
        wav, trimmed = trim_reference(wav, sr, self.limits.max_reference_seconds)
        notes = []
        if trimmed:
            notes.append(f"reference trimmed to {self.limits.max_reference_seconds:g} s")
        xvec = bool(x_vector_only) or not (ref_text or "").strip()
        if xvec and not x_vector_only:
            notes.append("no transcript: x-vector-only clone")
        yield {self.c.status: self._status("Cloning the voice…", seed=seed, role="base")}
        voice = engine.clone_voice((wav, sr), ref_text=None if xvec else ref_text, x_vector_only=xvec, name=name)
        voice.meta.update({"checkpoint": self.roles["base"].checkpoint})
        session[name] = voice
        path = self._save_voice(voice, name, file_format)
        extra = {self.c.voice_file: path, self.c.session: session, **self._dropdown_updates(session)}
        notes.append(f"saved as “{name}”")
        # the voice is kept (and its file offered) even if the speech that follows is stopped
        yield {**extra, self.c.status: self._status(f"Cloned “{name}”", seed=seed, role="base")}
        yield from self._speak("base", engine, text, voice, language, None, seed, sampling, max_new, request,
                               note=" · ".join(notes), extra_final=extra)

    def load_voice(self, voice_file, voice_name: str = "", session: dict | None = None):
        """Load a voice file (.safetensors or .json, made by this app or the engine) into this session, so the
        other tabs can use it.

        Parameters:
            voice_file: the voice file
            voice_name: name to keep it under (default: the name stored in the file, or the file name)
        Returns:
            status line
        """
        voice = self.load_voice_file(voice_file)
        name = check_name(voice_name or voice.name or Path(str(voice_file)).stem)
        session = dict(session or {})
        session[name] = voice
        role = self._role_of(voice)
        msg = (f"**Loaded “{name}”** · {ROLE_LABEL[role]} voice ({voice.kind}) · "
               f"choose it as “my:{name}” in any tab")
        return {self.c.session: session, self.c.status: msg, **self._dropdown_updates(session)}

    def _blend_inputs(self, n_voices, slots, a_to_b, session):
        """-> role, vectors, weights, labels for the used slots."""
        try:
            n = int(float(n_voices))
        except (TypeError, ValueError):
            raise TTSError("the number of voices must be 2, 3 or 4") from None
        if n not in (2, 3, 4):
            raise TTSError("the number of voices must be 2, 3 or 4")
        used = slots[:n]
        roles, vecs, labels = [], [], []
        for i, (key, file, _w) in enumerate(used):
            letter = "ABCD"[i]
            try:
                role, vec, label = self.embedding_of(key, session, file)
            except TTSError as e:
                raise TTSError(f"voice {letter}: {e}") from None
            roles.append(role)
            vecs.append(vec)
            labels.append(label)
        if len(set(roles)) > 1:
            desc = ", ".join(f"{'ABCD'[i]} = {labels[i]} ({ROLE_LABEL[r]})" for i, r in enumerate(roles))
            raise TTSError("voices from different checkpoints cannot be mixed: " + desc + ". CustomVoice speakers "
                           "blend with CustomVoice speakers, cloned (Base) voices with cloned voices.")
        if n == 2:
            t = float(a_to_b if a_to_b is not None else 50) / 100.0
            if not 0 <= t <= 1:
                raise TTSError("the A-to-B position must lie between 0 and 100 %")
            weights = [1 - t, t]
        else:
            weights = [float(w if w is not None else 0) for _k, _f, w in used]
        return roles[0], vecs, weights, labels

    def _blend_voice(self, n_voices, slots, a_to_b, session, name="Blend"):
        role, vecs, weights, labels = self._blend_inputs(n_voices, slots, a_to_b, session)
        vec = blendlib.blend(vecs, weights)
        shares = blendlib.shares_percent(weights)
        recipe = [{"voice": lab, "share": s} for lab, s in zip(labels, shares)]
        method = "slerp" if len(vecs) == 2 else "nlerp"
        engine = self.engine(role)
        voice = engine.voice_from_embedding(vec, name=name, meta={"blend": recipe, "method": method,
                                                                  "checkpoint": self.roles[role].checkpoint})
        desc = " + ".join(f"{s} % {lab}" for lab, s in zip(labels, shares) if s > 0)
        return role, engine, voice, desc

    @staticmethod
    def _slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3, voice_4, file_4,
               weight_4):
        return [(voice_1, file_1, weight_1), (voice_2, file_2, weight_2), (voice_3, file_3, weight_3),
                (voice_4, file_4, weight_4)]

    def blend(self, text: str, n_voices: int = 2, voice_1: str = "", file_1=None, weight_1: float = 50,
              voice_2: str = "", file_2=None, weight_2: float = 50, voice_3: str = "", file_3=None,
              weight_3: float = 50, voice_4: str = "", file_4=None, weight_4: float = 50, a_to_b: float = 50,
              language: str = "auto", session: dict | None = None, seed: float | None = None,
              randomize: bool = True, temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0,
              repetition_penalty: float = 1.05, max_new_tokens: int | None = None, request: gr.Request = None):
        """Blend 2-4 voices of one checkpoint and speak with the blend (streamed). Two voices: spherical
        interpolation at the A-to-B position; 3-4 voices: normalised-direction interpolation with norm restore,
        weighted by the sliders (shares are normalised to 100 %). Blends use speaker embeddings (x-vector mode).

        Parameters:
            text: what to say
            n_voices: how many voice slots are used (2, 3 or 4)
            voice_1: voice A: a CustomVoice speaker name, "preset:<id>", "my:<name>", or "file" to use file_1
            file_1: voice file for slot A when voice_1 is "file"
            weight_1: weight of voice A (3-4 voices)
            voice_2: voice B (same forms as voice_1)
            file_2: voice file for slot B
            weight_2: weight of voice B (3-4 voices)
            voice_3: voice C (3-4 voices)
            file_3: voice file for slot C
            weight_3: weight of voice C
            voice_4: voice D (4 voices)
            file_4: voice file for slot D
            weight_4: weight of voice D
            a_to_b: with two voices, the position from A (0) to B (100), in percent
            language: "auto" or a language name
            seed: random seed (used when randomize is false)
            randomize: draw a new seed for this request
            temperature: sampling temperature
            top_k: top-k (0 = off)
            top_p: top-p
            repetition_penalty: repetition penalty
            max_new_tokens: maximum frames (80 ms each) per sentence group
        Returns:
            live streamed audio, full lossless WAV, status line, seed used
        """
        seed = self._seed(seed, randomize)
        text = self.check_text(text)
        sampling, max_new = self._sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens)
        slots = self._slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3,
                            voice_4, file_4, weight_4)
        role, engine, voice, desc = self._blend_voice(n_voices, slots, a_to_b, session)
        yield self._start(role, seed)
        yield from self._speak(role, engine, text, voice, language, None, seed, sampling, max_new, request,
                               note=f"blend: {desc}")

    def blend_sweep(self, text: str, n_voices: int = 2, voice_1: str = "", file_1=None, weight_1: float = 50,
                    voice_2: str = "", file_2=None, weight_2: float = 50, voice_3: str = "", file_3=None,
                    weight_3: float = 50, voice_4: str = "", file_4=None, weight_4: float = 50,
                    a_to_b: float = 50, language: str = "auto", session: dict | None = None,
                    seed: float | None = None, randomize: bool = True, temperature: float = 0.9, top_k: int = 50,
                    top_p: float = 1.0, repetition_penalty: float = 1.05, max_new_tokens: int | None = None,
                    request: gr.Request = None):
        """Render the same sentence with the same seed at 0, 25, 50, 75 and 100 % from voice A to voice B
        (spherical interpolation), for A/B listening. Uses the first sentence group of the text and voices A and B.

        Parameters:
            text: the sentence (only its first sentence group is used)
            n_voices: must be 2
            voice_1: voice A (see /blend)
            file_1: voice file for slot A
            weight_1: unused
            voice_2: voice B
            file_2: voice file for slot B
            weight_2: unused
            voice_3: unused
            file_3: unused
            weight_3: unused
            voice_4: unused
            file_4: unused
            weight_4: unused
            a_to_b: unused
            language: "auto" or a language name
            seed: random seed (used when randomize is false); the same seed renders all five points
            randomize: draw one new seed for the sweep
            temperature: sampling temperature
            top_k: top-k (0 = off)
            top_p: top-p
            repetition_penalty: repetition penalty
            max_new_tokens: maximum frames (80 ms each)
        Returns:
            five WAVs (0, 25, 50, 75, 100 %), the status line, the seed used
        """
        c = self.c
        seed = self._seed(seed, randomize)
        text = chunk_text(self.check_text(text))[0]
        sampling, max_new = self._sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens)
        try:
            n = int(float(n_voices))
        except (TypeError, ValueError):
            n = 0
        if n != 2:
            raise TTSError("the sweep goes from voice A to voice B: set the number of voices to 2")
        slots = self._slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3,
                            voice_4, file_4, weight_4)
        role, vecs, _w, labels = self._blend_inputs(2, slots, 50, session)
        out = {p: None for p in c.sweep}
        out.update(self._start(role, seed))
        yield out
        engine = self.engine(role)
        points = blendlib.sweep(vecs[0], vecs[1])
        streams = []
        t0 = time.perf_counter()
        try:
            for t, vec in zip(blendlib.SWEEP, points):
                v = engine.voice_from_embedding(vec, name=f"{int(t * 100)} %")
                s = engine.stream(text, voice=v, language=language or "auto", seed=seed, sampling=sampling,
                                  max_new_tokens=max_new)
                streams.append(s)
                self._track(request, s, True)
            done = {}
            for i, s in enumerate(streams):
                audio = [to_int16(x) for x in s]
                audio = np.concatenate(audio) if audio else np.zeros(0, np.int16)
                done[c.sweep[i]] = (SR, audio) if len(audio) else None
                yield {c.sweep[i]: done[c.sweep[i]],
                       c.status: self._status(f"Sweep {i + 1}/5 rendered", seed=seed, role=role,
                                              note=f"{labels[0]} → {labels[1]}")}
        finally:
            for s in streams:
                s.cancel()
                self._track(request, s, False)
        yield {**done, c.seed: seed,
               c.status: self._status(f"Sweep done in {time.perf_counter() - t0:.1f} s", seed=seed, role=role,
                                      note=f"0 % = {labels[0]}, 100 % = {labels[1]}, same seed and sentence")}

    def blend_export(self, n_voices: int = 2, voice_1: str = "", file_1=None, weight_1: float = 50,
                     voice_2: str = "", file_2=None, weight_2: float = 50, voice_3: str = "", file_3=None,
                     weight_3: float = 50, voice_4: str = "", file_4=None, weight_4: float = 50,
                     a_to_b: float = 50, blend_name: str = "My blend", file_format: str = "safetensors",
                     session: dict | None = None):
        """Export the current blend as a voice file (and keep it in this session under its name).

        Parameters:
            n_voices: how many voice slots are used (2, 3 or 4)
            voice_1: voice A (see /blend)
            file_1: voice file for slot A
            weight_1: weight of voice A
            voice_2: voice B
            file_2: voice file for slot B
            weight_2: weight of voice B
            voice_3: voice C
            file_3: voice file for slot C
            weight_3: weight of voice C
            voice_4: voice D
            file_4: voice file for slot D
            weight_4: weight of voice D
            a_to_b: with two voices, the position from A (0) to B (100), in percent
            blend_name: name of the blended voice
            file_format: "safetensors" or "json"
        Returns:
            the voice file, status line
        """
        name = check_name(blend_name or "My blend")
        slots = self._slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3,
                            voice_4, file_4, weight_4)
        role, _engine, voice, desc = self._blend_voice(n_voices, slots, a_to_b, session, name=name)
        session = dict(session or {})
        session[name] = voice
        path = self._save_voice(voice, name, file_format)
        return {self.c.export_file: path, self.c.session: session,
                self.c.status: (f"**Exported “{name}”** · {desc} · {ROLE_LABEL[role]} model · "
                                f"usable as “my:{name}”"),
                **self._dropdown_updates(session)}

    def design(self, text: str, description: str, language: str = "auto", seed: float | None = None,
               randomize: bool = True, temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0,
               repetition_penalty: float = 1.05, max_new_tokens: int | None = None, request: gr.Request = None):
        """Design a voice from a description (VoiceDesign model) and speak the text with it (streamed).

        Parameters:
            text: what to say
            description: the voice, in words (e.g. "A warm, low male voice, speaking slowly")
            language: "auto" or a language name
            seed: random seed (used when randomize is false)
            randomize: draw a new seed for this request
            temperature: sampling temperature
            top_k: top-k (0 = off)
            top_p: top-p
            repetition_penalty: repetition penalty
            max_new_tokens: maximum frames (80 ms each) per sentence group
        Returns:
            live streamed audio, full lossless WAV, status line, seed used
        """
        seed = self._seed(seed, randomize)
        text = self.check_text(text)
        desc = (description or "").strip()
        if not desc:
            raise TTSError("describe the voice you want (e.g. “a warm, low male voice, speaking slowly”)")
        sampling, max_new = self._sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens)
        yield self._start("voice_design", seed)
        engine = self.engine("voice_design")
        yield from self._speak("voice_design", engine, text, None, language, desc, seed, sampling, max_new, request)

    def stop(self, request: gr.Request = None):
        """Stop this session's generation and free its place in the engine.

        Returns:
            status line
        """
        key = getattr(request, "session_hash", None) or "_"
        with self._active_lock:
            streams = list(self._active.pop(key, ()))
        for s in streams:
            s.cancel()
        return "**Stopped**" + (f" · {len(streams)} request(s) cancelled" if streams else "")

    # --- small UI helpers -----------------------------------------------------------------------------
    def slot_visibility(self, n_voices):
        n = int(n_voices)
        c = self.c
        out = {c.ab_row: gr.update(visible=n == 2), c.sweep_btn: gr.update(visible=n == 2),
               c.sweep_row: gr.update(visible=n == 2)}
        for i in range(4):
            out[c.slot_group[i]] = gr.update(visible=i < n)
            out[c.slot_weight[i]] = gr.update(visible=n > 2)
            out[c.slot_share[i]] = gr.update(visible=n > 2)
        return out

    @staticmethod
    def shares(n_voices, w1, w2, w3, w4, a_to_b):
        n = int(n_voices)
        ws = [w1, w2, w3, w4][:n]
        pct = blendlib.shares_percent([float(w or 0) for w in ws])
        shares = [f"{p} %" for p in pct] + ["" for _ in range(4 - n)]
        t = float(a_to_b or 0)
        ab = f"A {100 - t:.0f} % · B {t:.0f} %"
        return (*shares, ab)

    def role_of_key(self, key, session: dict | None = None) -> str | None:
        """Which model a voice choice needs, without loading anything (None when unknown)."""
        key = str(key or "").strip()
        if key.startswith("preset:") or (key.lower() in self.presets and self.has("base")):
            return "base"
        if key.startswith("my:") or key in (session or {}):
            v = (session or {}).get(key[3:] if key.startswith("my:") else key)
            return self._role_of(v, check=False) if v is not None else None
        if self.has("custom_voice") and key.lower() in self.roles["custom_voice"].speakers:
            return "custom_voice"
        return None

    def supports_instruct(self, key, session: dict | None = None) -> bool:
        role = self.role_of_key(key, session)
        return role in self.roles and self.roles[role].supports_instruct

    def instruct_visibility(self, voice, session=None):
        return gr.update(visible=self.supports_instruct(voice, session))

    # --- examples -----------------------------------------------------------------------------------
    def _load_examples(self) -> dict:
        try:
            return json.loads(Path(self.cfg.examples_file).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            log.warning("no examples (%s)", e)
            return {}

    def _preset_examples(self) -> list[list]:
        valid = {v for _, v in self.voice_choices(None)}
        out = []
        for ex in self.examples.get("preset", []):
            voice = ex.get("voice")
            if voice in valid:
                out.append([ex["text"], voice, ex.get("language", "auto"), ex.get("instruct", "")])
        return out

    # --- UI ----------------------------------------------------------------------------------------------
    def banner_text(self) -> str:
        roles = self.random_roles
        if not roles:
            return ""
        if self.cfg.tiny:
            why = "This app was started with `--tiny`, so it runs on tiny checkpoints with **random weights**."
        else:
            names = ", ".join(f"{ROLE_LABEL[r]} (`{self.roles[r].checkpoint}`)" for r in roles)
            why = (f"The weights of {names} could not be downloaded (the Hugging Face Hub is unreachable and nothing "
                   "is cached), so this app runs on tiny checkpoints with **random weights**.")
        return ("### ⚠️ Random weights: the audio is noise\n"
                f"{why} Everything works, but what you hear is noise, not speech.  \n"
                "To get real weights: run once with network access (they are cached for later offline runs), e.g. "
                "`hf download Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice` and "
                "`hf download Qwen/Qwen3-TTS-12Hz-0.6B-Base`, or pass local checkpoint folders with "
                "`--custom-voice-model DIR --base-model DIR`.")

    def build(self) -> gr.Blocks:
        c = self.c
        langs = [("Auto", "auto")] + [(lang.title(), lang) for lang in self.languages()[1:]]
        max_frames = self.limits.max_new_tokens
        default_frames = min(max_frames, 100) if self.random_roles else max_frames
        choices = self.voice_choices(None)
        blend_choices = self.voice_choices(None, blend=True)
        default_voice = ("ryan" if self.has("custom_voice") and "ryan" in self.roles["custom_voice"].speakers
                         else (choices[0][1] if choices else None))
        with gr.Blocks(title="Qwen3-TTS Live", delete_cache=(600, self.limits.file_ttl_seconds)) as demo:
            c.session = gr.State({})
            c.banner = gr.Markdown(self.banner_text(), visible=bool(self.random_roles), elem_id="random-weights-banner")
            gr.Markdown("# 🗣️ Qwen3-TTS Live\nStreaming text-to-speech with the Qwen3-TTS 12 Hz models: speech "
                        "starts "
                        "playing while the rest is being generated. Pick a preset voice, clone your own from a few "
                        "seconds of audio, or blend voices. Every generation ends with a lossless WAV.")
            with gr.Row(equal_height=False):
                with gr.Column(scale=3):
                    with gr.Tabs():
                        self._build_preset_tab(c, choices, default_voice, langs)
                        self._build_clone_tab(c, langs)
                        self._build_blend_tab(c, blend_choices, langs)
                        if self.has("voice_design"):
                            self._build_design_tab(c, langs)
                with gr.Column(scale=2, min_width=320):
                    c.live = gr.Audio(label="Live (streaming)", streaming=True, autoplay=True, interactive=False,
                                      elem_id="live-audio", buttons=[])
                    c.status = gr.Markdown("Ready.", elem_id="status")
                    c.stop_btn = gr.Button("■ Stop", variant="stop", elem_id="stop-btn")
                    c.final = gr.Audio(label="Full result (lossless WAV)", format="wav", interactive=False,
                                       elem_id="final-audio", buttons=["download"])
                    with gr.Row():
                        c.seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed", scale=2)
                        c.randomize = gr.Checkbox(value=True, label="Randomise seed", scale=1)
                    with gr.Accordion("Advanced: sampling", open=False):
                        c.temperature = gr.Slider(0.1, 1.5, value=DEFAULT_SAMPLING["temperature"], step=0.05,
                                                  label="Temperature")
                        c.top_k = gr.Slider(0, 200, value=DEFAULT_SAMPLING["top_k"], step=1, label="Top-k (0 = off)")
                        c.top_p = gr.Slider(0.05, 1.0, value=DEFAULT_SAMPLING["top_p"], step=0.05, label="Top-p")
                        c.rep = gr.Slider(1.0, 1.5, value=DEFAULT_SAMPLING["repetition_penalty"], step=0.01,
                                          label="Repetition penalty")
                        c.max_new = gr.Slider(1, max_frames, value=default_frames, step=1,
                                              label="Max length per sentence group (frames of 80 ms)")
                        gr.Markdown("Long text is split at sentence boundaries and streamed in order, with the same "
                                    "voice and seed for every part.")
            gr.Markdown(self._footer())
            self._wire(c)
        return demo

    def _footer(self) -> str:
        rows = []
        for r, i in self.roles.items():
            rows.append(f"{ROLE_LABEL[r]}: `{i.checkpoint}`" + (" (random tiny weights)" if i.random else ""))
        return ("<small>Models: " + " · ".join(rows) + ". Preset clips: see `presets/README.md` (source and licence "
                "per voice). Use the microphone over HTTPS (or on localhost). API: “Use via API” below.</small>")

    def _build_preset_tab(self, c, choices, default_voice, langs):
        with gr.Tab("Preset voices", id="tab-preset"):
            with gr.Row():
                c.p_voice = gr.Dropdown(choices, value=default_voice, label="Voice", allow_custom_value=True, scale=3,
                                        info="CustomVoice speakers (native language shown; each speaks every "
                                             "language), our preset clips (Base model), your voices of this session")
                c.p_lang = gr.Dropdown(langs, value="auto", label="Language", scale=1)
            sup = self.supports_instruct(default_voice)
            c.p_instruct = gr.Textbox("", label="Instruction (speaking style)", visible=sup,
                                      placeholder="e.g. Speak with excitement, a little faster")
            c.p_text = gr.Textbox(label="Text", lines=4, elem_id="preset-text",
                                  value="Hello! This is Qwen3-TTS Live, speaking while it thinks.")
            c.p_btn = gr.Button("▶ Generate", variant="primary", elem_id="preset-generate")
            ex = self._preset_examples()
            if ex:
                instruct = any(i.supports_instruct for r, i in self.roles.items() if r == "custom_voice")
                gr.Examples(ex if instruct else [e[:3] for e in ex],
                            [c.p_text, c.p_voice, c.p_lang] + ([c.p_instruct] if instruct else []), label="Examples")

    def _build_clone_tab(self, c, langs):
        with gr.Tab("Clone", id="tab-clone", visible=self.has("base")):
            gr.Markdown("Upload or record 3-10 s of clean speech. With its transcript the clone is closest "
                        "(in-context); without one, only the speaker embedding is used (x-vector only), which is "
                        "also what blending uses.")
            with gr.Row():
                c.ref_audio = gr.Audio(sources=["upload", "microphone"], type="filepath", label="Reference clip",
                                       elem_id="ref-audio")
                with gr.Column():
                    c.ref_text = gr.Textbox("", label="Transcript of the clip", lines=3,
                                            placeholder="Exactly what is said in the clip")
                    c.xvec = gr.Checkbox(False, label="x-vector only (no transcript; lower similarity)")
                    c.voice_name = gr.Textbox("My voice", label="Name this voice", max_lines=1)
            with gr.Row():
                c.c_lang = gr.Dropdown(langs, value="auto", label="Language")
                c.file_format = gr.Radio(["safetensors", "json"], value="safetensors", label="Voice file format")
            c.c_text = gr.Textbox(label="Text", lines=3, value="This is my cloned voice, streaming as it speaks.")
            c.clone_btn = gr.Button("▶ Clone and speak", variant="primary", elem_id="clone-generate")
            c.voice_file = gr.File(label="Your voice file (reusable: load it here later, or in the Blend tab)",
                                   interactive=False, height=120)
            with gr.Accordion("Load a voice file", open=False):
                c.load_file = gr.File(label="Voice file (.safetensors or .json)", file_types=[".safetensors", ".json"])
                c.load_name = gr.Textbox("", label="Name (optional)", max_lines=1)
                c.load_btn = gr.Button("Load into this session")
            clips = [[str(p.clip), p.transcript, p.name] for p in self.presets]
            if clips:
                gr.Examples(clips, [c.ref_audio, c.ref_text, c.voice_name], label="Example reference clips")

    def _build_blend_tab(self, c, blend_choices, langs):
        with gr.Tab("Blend", id="tab-blend"):
            gr.Markdown("Mix 2-4 voices of **one** checkpoint (CustomVoice speakers with each other, cloned voices "
                        "with each other). Two voices: spherical interpolation; more: normalised direction with the "
                        "norm restored. Blends use speaker embeddings only (x-vector mode).")
            c.n_voices = gr.Radio([2, 3, 4], value=2, label="Number of voices")
            plain = [v for _, v in blend_choices if v != FILE_CHOICE]
            preferred = [v for v in ("ryan", "vivian", "serena", "aiden") if v in plain]
            plain = preferred + [v for v in plain if v not in preferred]
            defaults = [plain[i % len(plain)] for i in range(4)] if plain else [None] * 4
            c.slot_group, c.slot_voice, c.slot_file, c.slot_weight, c.slot_share = [], [], [], [], []
            for i in range(4):
                with gr.Group(visible=i < 2) as g:
                    with gr.Row(equal_height=True):
                        dd = gr.Dropdown(blend_choices, value=defaults[i], label=f"Voice {'ABCD'[i]}", scale=4,
                                         allow_custom_value=True)
                        w = gr.Slider(0, 100, value=50, step=1, label="Weight", scale=3, visible=False)
                        sh = gr.Markdown("25 %", elem_classes="share", visible=False)
                    f = gr.File(label=f"Voice file for {'ABCD'[i]}", file_types=[".safetensors", ".json"],
                                visible=False)
                c.slot_group.append(g)
                c.slot_voice.append(dd)
                c.slot_file.append(f)
                c.slot_weight.append(w)
                c.slot_share.append(sh)
            with gr.Row(visible=True) as c.ab_row:
                c.ab = gr.Slider(0, 100, value=50, step=5, label="A ◀── mix ──▶ B (% of B)", scale=4)
                c.ab_share = gr.Markdown("A 50 % · B 50 %", elem_classes="share")
            with gr.Row():
                c.b_lang = gr.Dropdown(langs, value="auto", label="Language")
            c.b_text = gr.Textbox(label="Text", lines=2, value="The quick brown fox jumps over the lazy dog.")
            with gr.Row():
                c.blend_btn = gr.Button("▶ Speak with the blend", variant="primary", elem_id="blend-generate")
                c.sweep_btn = gr.Button("Sweep A → B (0/25/50/75/100 %)", elem_id="blend-sweep")
            with gr.Row(elem_classes="sweep-row") as c.sweep_row:
                c.sweep = [gr.Audio(label=lab, interactive=False, format="wav", buttons=["download"],
                                    elem_id=f"sweep-{int(t * 100)}", min_width=90)
                           for t, lab in zip(blendlib.SWEEP, ["0 % (A)", "25 %", "50 %", "75 %", "100 % (B)"])]
            with gr.Accordion("Export the blend as a voice file", open=False):
                with gr.Row():
                    c.blend_name = gr.Textbox("My blend", label="Name", max_lines=1)
                    c.blend_format = gr.Radio(["safetensors", "json"], value="safetensors", label="Format")
                c.export_btn = gr.Button("Export")
                c.export_file = gr.File(label="Blended voice file", interactive=False)
            gr.Examples([["Good evening. Here is the news, read by a voice that does not exist."],
                         ["Two voices, one sentence: listen to how the timbre moves from A to B."]],
                        [c.b_text], label="Examples")

    def _build_design_tab(self, c, langs):
        with gr.Tab("Voice design", id="tab-design"):
            c.d_desc = gr.Textbox(label="Describe the voice", lines=2,
                                  value="A warm, low male voice, speaking slowly and calmly.")
            c.d_lang = gr.Dropdown(langs, value="auto", label="Language")
            c.d_text = gr.Textbox(label="Text", lines=3, value="Welcome. Let me tell you a story.")
            c.design_btn = gr.Button("▶ Design and speak", variant="primary", elem_id="design-generate")
            ex = [[e["text"], e["description"]] for e in self.examples.get("design", [])]
            if ex:
                gr.Examples(ex, [c.d_text, c.d_desc], label="Examples")

    def _wire(self, c):
        common = [c.seed, c.randomize, c.temperature, c.top_k, c.top_p, c.rep, c.max_new]
        gen_out = [c.live, c.final, c.status, c.seed]
        dd_out = [c.p_voice, *c.slot_voice]
        slot_in = [x for i in range(4) for x in (c.slot_voice[i], c.slot_file[i], c.slot_weight[i])]
        kw = dict(concurrency_id="tts", concurrency_limit=self.concurrency, show_progress="minimal")
        doc = _api_doc
        events = []
        events.append(c.p_btn.click(_guard(self.preset), [c.p_text, c.p_voice, c.p_lang, c.p_instruct, c.session]
                                    + common, gen_out, api_name="preset", api_description=doc(self.preset), **kw))
        if self.has("base"):
            events.append(c.clone_btn.click(
                _guard(self.clone), [c.ref_audio, c.ref_text, c.xvec, c.voice_name, c.file_format, c.c_text, c.c_lang,
                                     c.session] + common,
                gen_out + [c.voice_file, c.session] + dd_out, api_name="clone", api_description=doc(self.clone), **kw))
            c.load_btn.click(_guard(self.load_voice), [c.load_file, c.load_name, c.session],
                             [c.session, c.status] + dd_out, api_name="load_voice",
                             api_description=doc(self.load_voice))
        blend_in = [c.b_text, c.n_voices] + slot_in + [c.ab, c.b_lang, c.session] + common
        events.append(c.blend_btn.click(_guard(self.blend), blend_in, gen_out, api_name="blend",
                                        api_description=doc(self.blend), **kw))
        events.append(c.sweep_btn.click(_guard(self.blend_sweep), blend_in, c.sweep + [c.final, c.status, c.seed],
                                        api_name="blend_sweep", api_description=doc(self.blend_sweep), **kw))
        c.export_btn.click(_guard(self.blend_export), [c.n_voices] + slot_in + [c.ab, c.blend_name, c.blend_format,
                                                                                c.session],
                           [c.export_file, c.session, c.status] + dd_out, api_name="blend_export",
                           api_description=doc(self.blend_export))
        if self.has("voice_design"):
            events.append(c.design_btn.click(_guard(self.design), [c.d_text, c.d_desc, c.d_lang] + common, gen_out,
                                             api_name="design", api_description=doc(self.design), **kw))
        c.events = events
        c.stop_btn.click(self.stop, None, [c.status], cancels=events, api_name="stop", queue=False)

        # UI-only helpers (stable names, not part of the documented API)
        ui = dict(queue=False, show_progress="hidden", api_visibility="undocumented")
        c.n_voices.change(self.slot_visibility, [c.n_voices],
                          [c.ab_row, c.sweep_btn, c.sweep_row] + c.slot_group + c.slot_weight + c.slot_share,
                          api_name="ui_slots", **ui)
        share_in = [c.n_voices, *c.slot_weight, c.ab]
        share_out = c.slot_share + [c.ab_share]
        for j, comp in enumerate([c.n_voices, *c.slot_weight, c.ab]):
            comp.change(self.shares, share_in, share_out, api_name=f"ui_shares_{j}", **ui)
        for i in range(4):
            c.slot_voice[i].change(lambda v: gr.update(visible=v == FILE_CHOICE), [c.slot_voice[i]], [c.slot_file[i]],
                                   api_name=f"ui_slot_file_{i + 1}", **ui)
        c.p_voice.change(self.instruct_visibility, [c.p_voice, c.session], [c.p_instruct], api_name="ui_instruct", **ui)

    def launch_kwargs(self) -> dict:
        return dict(theme=gr.themes.Soft(primary_hue="indigo", secondary_hue="pink"), css=CSS,
                    max_file_size=self.limits.max_upload_bytes,
                    allowed_paths=[str(self.cfg.presets_dir)])


# --- command line ---------------------------------------------------------------------------------------

def _env_bool(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description="Qwen3-TTS Live: streaming text-to-speech web app",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default=env("GRADIO_SERVER_NAME", "0.0.0.0"), help="address to listen on "
                   "[GRADIO_SERVER_NAME]")
    p.add_argument("--port", type=int, default=int(env("TTS_PORT") or env("GRADIO_SERVER_PORT") or 7860),
                   help="port [TTS_PORT or GRADIO_SERVER_PORT]")
    p.add_argument("--device", default=env("TTS_DEVICE"), help="cuda, cuda:1, cpu (default: cuda if present) "
                   "[TTS_DEVICE]")
    p.add_argument("--dtype", default=env("TTS_DTYPE"), choices=["fp32", "bf16", "fp16"],
                   help="weights dtype (default: bf16 on GPU; on a CPU bf16 where native (AVX-512 BF16 / AMX), else fp32) [TTS_DTYPE]")
    for role, flag in (("custom_voice", "--custom-voice-model"), ("base", "--base-model"),
                       ("voice_design", "--voice-design-model")):
        p.add_argument(flag, dest=role, default=env(ENV[role], DEFAULT_CHECKPOINTS[role]),
                       help=f"{ROLE_LABEL[role]} checkpoint: hub id or local folder; empty to disable [{ENV[role]}]")
    p.add_argument("--backend", default=env("TTS_BACKEND"),
                   help="URL of a remote OpenAI-compatible speech server (vLLM-Omni, or another instance of this "
                        "app) to use instead of local models [TTS_BACKEND]")
    p.add_argument("--tiny", action="store_true", default=_env_bool("TTS_TINY"),
                   help="tiny random checkpoints for every role (no download; the audio is noise) [TTS_TINY]")
    p.add_argument("--no-offline-fallback", dest="offline_fallback", action="store_false",
                   default=not _env_bool("TTS_NO_OFFLINE_FALLBACK"),
                   help="fail instead of falling back to random tiny checkpoints when the hub cannot be reached "
                        "[TTS_NO_OFFLINE_FALLBACK]")
    p.add_argument("--cache-dir", default=env("TTS_CACHE_DIR"), help="where tiny checkpoints and preset voices "
                   "are cached (default ~/.cache/qwen3-tts-live) [TTS_CACHE_DIR]")
    p.add_argument("--concurrency", type=int, default=int(env("TTS_CONCURRENCY") or 0) or None,
                   help="generations running at once (default 16 on GPU, 4 on CPU) [TTS_CONCURRENCY]")
    p.add_argument("--preload", action="store_true", default=_env_bool("TTS_PRELOAD"),
                   help="load and warm up every model before serving [TTS_PRELOAD]")
    p.add_argument("--share", action="store_true", default=_env_bool("TTS_SHARE"),
                   help="also open a public gradio.live link (off by default) [TTS_SHARE]")
    p.add_argument("--ssl-certfile", default=env("TTS_SSL_CERTFILE"),
                   help="HTTPS certificate (browsers allow the microphone only over HTTPS or on localhost) "
                        "[TTS_SSL_CERTFILE]")
    p.add_argument("--ssl-keyfile", default=env("TTS_SSL_KEYFILE"), help="HTTPS key [TTS_SSL_KEYFILE]")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> AppConfig:
    return AppConfig(checkpoints={r: getattr(a, r) or "" for r in ROLES}, device=a.device, dtype=a.dtype,
                     tiny=a.tiny, offline_fallback=a.offline_fallback,
                     cache_dir=Path(a.cache_dir) if a.cache_dir else None, concurrency=a.concurrency,
                     preload=a.preload, backend=a.backend)


def create_server(app: TTSApp, demo: gr.Blocks):
    """One FastAPI server: the OpenAI-compatible speech API (`/v1/audio/speech`, `/v1/audio/voices`) on the same
    engines as the UI, and the Gradio app mounted at `/`. `demo.queue()` must have been called."""
    from fastapi import FastAPI

    from server.openai_api import install

    api = FastAPI(title="Qwen3-TTS Live")
    install(api, app.registry, app.limits)
    kw = app.launch_kwargs()
    return gr.mount_gradio_app(api, demo, path="/", theme=kw["theme"], css=kw["css"],
                               max_file_size=kw["max_file_size"], allowed_paths=kw["allowed_paths"])


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    if bool(a.ssl_certfile) != bool(a.ssl_keyfile):
        raise SystemExit("--ssl-certfile and --ssl-keyfile go together")
    try:
        app = TTSApp(config_from_args(a))
    except TTSError as e:
        raise SystemExit(f"error: {e}")
    if app.random_roles:
        log.warning("RANDOM WEIGHTS for %s: the audio is noise (see the banner on the page)",
                    ", ".join(app.random_roles))
    if app.cfg.preload:
        app.preload()
    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=app.limits.max_queue)
    if a.share:  # a public link needs Gradio's own launcher; the HTTP API is then not served
        log.warning("--share: serving the UI through gradio.live; the /v1 speech API is not mounted")
        demo.launch(server_name=a.host, server_port=a.port, share=True, ssl_certfile=a.ssl_certfile,
                    ssl_keyfile=a.ssl_keyfile, ssl_verify=not a.ssl_certfile, **app.launch_kwargs())
        return
    import uvicorn

    scheme = "https" if a.ssl_certfile else "http"
    log.info("serving the app and the /v1/audio/speech API on %s://%s:%d", scheme, a.host, a.port)
    uvicorn.run(create_server(app, demo), host=a.host, port=a.port, ssl_certfile=a.ssl_certfile,
                ssl_keyfile=a.ssl_keyfile, log_level="warning")


if __name__ == "__main__":
    main()
