"""Which checkpoint serves which role (CustomVoice / Base / VoiceDesign): `prepare_role` finds a checkpoint
(falling back to a tiny random one when the hub is unreachable), `Models` holds the roles of this server and
their engines (local `EngineRegistry`, or a remote server with `--backend URL`), and says which model a voice
belongs to. Also the random-weights banner text."""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.registry import EngineRegistry
from tts_engine import CheckpointInfo, TTSError, Voice, cache_paths, expected_choice, inspect_checkpoint, make_tiny

from ui.config import NATIVE, ROLE_LABEL, ROLES, AppConfig

log = logging.getLogger("qwen3_tts_live")
# the footer's precision while `--quantize auto` is measured in the background (no "weights" in it: not lossy yet)
MEASURING = "chosen by `--quantize auto` while the models load (measured on this CPU; reload the page to see it)"


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
    hidden_size: int | None
    size: str


def speaker_label(name: str) -> str:
    pretty = name.replace("_", " ").title()
    native = NATIVE.get(name.lower())
    return f"{pretty} · {native}" if native else pretty


def cache_root(cfg: AppConfig) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else cache_paths.cache_root()


def _tiny_checkpoint(role: str, cache: Path) -> CheckpointInfo:
    folder = cache / "tiny" / role
    try:
        return inspect_checkpoint(str(folder))
    except TTSError:
        shutil.rmtree(folder, ignore_errors=True)
        make_tiny(folder, kind=role, size="1b7" if role == "voice_design" else "0b6", seed=0)
        return inspect_checkpoint(str(folder))


def prepare_role(role: str, checkpoint: str, cfg: AppConfig) -> RoleInfo:
    """Find (download, or find in the cache) a role's checkpoint and read its config; weights load later.
    When the hub cannot be reached and nothing is cached, fall back to a tiny random checkpoint."""
    random_weights = cfg.tiny
    if cfg.tiny:
        info = _tiny_checkpoint(role, cache_root(cfg))
    else:
        try:
            info = inspect_checkpoint(checkpoint)
        except TTSError as e:
            if not cfg.offline_fallback or Path(checkpoint).expanduser().exists() or checkpoint.count("/") != 1:
                raise
            log.warning("%s checkpoint %s unavailable (%s): falling back to a tiny random checkpoint",
                        ROLE_LABEL[role], checkpoint, e)
            info, random_weights = _tiny_checkpoint(role, cache_root(cfg)), True
    if info.kind != role:
        raise TTSError(f"{checkpoint} is a {ROLE_LABEL.get(info.kind, info.kind)} checkpoint, "
                       f"but it was given as the {ROLE_LABEL[role]} model")
    return RoleInfo(role=role, checkpoint=checkpoint, folder=info.folder, random=random_weights, kind=info.kind,
                    speakers=info.speakers, languages=info.languages, supports_instruct=info.supports_instruct,
                    hidden_size=info.hidden_size, size=info.size)


def _others(engine, mine: int) -> bool:
    """Requests in `engine` besides `mine` of this thread's own (running or waiting); False where the engine does not
    say (a stand-in)."""
    load_state = getattr(engine, "load_state", None)
    state = load_state() if load_state is not None else {}
    return state.get("running", 0) + state.get("waiting", 0) > mine


class Models:
    """The roles this server runs and their engines: loaded in the background (`load_in_background`, the
    `loader` says where each stands) or else on first use."""

    def __init__(self, cfg: AppConfig):
        from ui.model_loader import ModelLoader

        self.cfg = cfg
        self.roles: dict[str, RoleInfo] = {}
        self.loader = ModelLoader(load=self._load, warm_up=self.warm_up)
        if cfg.backend:
            self._init_remote(cfg.backend)
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
                                       engine_kw=cfg.engine_kw())
        self.registry.random_weights |= {r for r, i in self.roles.items() if i.random}
        if "base" in self.roles:   # voices uploaded through POST /v1/audio/voices, also offered on the page
            from serving.voice_store import VoiceStore
            self.registry.uploaded = VoiceStore(os.environ.get("TTS_VOICES_DIR") or cache_root(cfg) / "voices")

    def _init_remote(self, url: str) -> None:
        """--backend URL: every role is served by a remote OpenAI-compatible speech server."""
        from serving.remote_backend import RemoteRegistry

        self.registry = RemoteRegistry(url)
        for role in ROLES:
            if self.registry.configured(role):
                eng = self.registry.get(role)
                self.roles[role] = RoleInfo(role=role, checkpoint=self.registry.checkpoints[role], folder=Path("."),
                                            random=False, kind=role, speakers=eng.speakers, languages=eng.languages,
                                            supports_instruct=eng.supports_instruct, hidden_size=None, size="")

    def default_concurrency(self) -> int:
        """Generation events running at once: 16 on a GPU, 4 on a CPU, 8 against a remote server."""
        if self.cfg.concurrency:
            return int(self.cfg.concurrency)
        if self.cfg.backend:
            return 8
        import torch
        gpu = torch.cuda.is_available() and str(self.cfg.device or "cuda").startswith("cuda")
        return 16 if gpu else 4

    @property
    def random_roles(self) -> list[str]:
        return [r for r in ROLES if r in self.registry.random_weights]

    def is_random(self, role: str | None) -> bool:
        return role in self.registry.random_weights

    def lossy_label(self, role: str | None) -> str:
        """"int8 weights (bf16 activations)" when the role's loaded engine runs quantised (lossy) weights, else ""."""
        if role is None or not self.registry.loaded(role):
            return ""
        eng = self.registry.get(role)
        return eng.precision if getattr(eng, "lossy", False) else ""

    def expected_precision(self) -> str | None:
        """What local engines compute with (before any is loaded); None against a remote server."""
        if self.cfg.backend:
            return None
        return self.expected_choice()[0]

    def expected_choice(self) -> tuple[str | None, str]:
        """(precision label, why): why says what `--quantize auto` measured and chose ("" otherwise). A loaded
        engine says what it runs; while the models load in the background with `--quantize auto`, the page's
        thread measures nothing (the loader does: the page is served at once, and the two would time each other's
        load) and says so until a page load after the loader finished."""
        if self.cfg.backend:
            return None, ""
        for role in self.roles:
            if self.registry.loaded(role):
                eng = self.registry.get(role)
                return eng.precision, getattr(eng, "precision_why", "")
        if getattr(self, "_expected", None) is None:
            auto = str(self.cfg.quantize or "").strip().lower() == "auto"
            if auto and any(self.loader.busy(r) for r in self.roles):
                return MEASURING, ""
            folder = next((i.folder for i in self.roles.values()), None)
            self._expected = expected_choice(self.cfg.device, self.cfg.dtype, self.cfg.quantize, folder)
        return self._expected

    def paths(self) -> dict[str, dict[str, dict[str, str]]]:
        """{role: engine.paths()} of the local engines loaded so far: what serves each part of a frame and why
        ({} before any has loaded, and against a remote server, whose own responses say it: X-TTS-Paths)."""
        if self.cfg.backend:
            return {}
        return {r: self.registry.get(r).paths() for r in self.roles if self.registry.loaded(r)}

    def has(self, role: str) -> bool:
        return role in self.roles

    def engine(self, role: str):
        """The role's engine: loaded (and warmed up) by the background loader, which this waits for."""
        if role not in self.roles:
            raise TTSError(f"this server runs no {ROLE_LABEL[role]} model"
                           + (" (start it with --voice-design-model)" if role == "voice_design" else ""))
        if not self.cfg.backend and not self.registry.loaded(role):
            self.loader.start([role])   # loads in the loader: its progress shows on the page and in the status line
        self.loader.wait(role)
        return self.registry.get(role)

    def _load(self, role: str):
        return self.registry.get(role)

    def default_roles(self) -> list[str]:
        """The models the page's default tab (Preset voices) uses: CustomVoice speakers, then the Base model of
        the preset clips."""
        return [r for r in ("custom_voice", "base") if r in self.roles]

    def load_in_background(self, roles: list[str] | None = None) -> None:
        """Start loading `roles` (default: `default_roles()`) in a background thread; the page is served
        meanwhile, and a request for a role still loading waits for it."""
        if self.cfg.backend:
            return   # nothing to load here: a remote server serves every role
        self.loader.start(self.default_roles() if roles is None else [r for r in roles if r in self.roles])

    def loaded(self, role: str) -> bool:
        return self.registry.loaded(role)

    def speakers(self) -> list[str]:
        return list(self.roles["custom_voice"].speakers) if self.has("custom_voice") else []

    def languages(self) -> list[str]:
        langs = ["auto"]
        for info in self.roles.values():
            langs += [lang for lang in info.languages if lang not in langs]
        return langs

    def role_of(self, voice: Voice, check: bool = True) -> str:
        """The role (model) a voice is for; with `check`, also that this server runs it and that it fits."""
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

    def preload(self) -> None:
        """Load every engine and run one short synthesis on each, now (first requests then start warm)."""
        if self.cfg.backend:
            return   # nothing to load here: a remote server serves every role
        self.loader.load_now(list(self.roles))

    def warm_up(self, role: str) -> None:
        """One short synthesis on a loaded engine, streamed as the page streams (first chunks of one frame): a later
        first request then starts warm. Only for latency, so it yields to real requests: none starts while one is
        already in the engine (the API's requests wait for the engine itself, not for the loader), and one that
        comes meanwhile cuts it short at the next chunk."""
        t = time.perf_counter()
        eng = self.registry.get(role)
        if _others(eng, 0):
            log.info("%s warm-up skipped: a request is already in the engine", ROLE_LABEL[role])
            return
        voice = None
        if role == "custom_voice":   # the page's default voice (ui/layout.py): its prompt prefix is then cached
            voice = "ryan" if "ryan" in eng.speakers else eng.speakers[0]
        elif role == "base":
            voice = eng.voice_from_embedding(np.ones(eng.hidden_size, np.float32))
        stream = eng.stream("Hello.", voice=voice, instruct="A calm voice." if role == "voice_design" else None,
                            seed=0, max_new_tokens=8, first_chunk_frames=(1, 1))
        for _ in stream:
            if _others(eng, 1):
                stream.cancel()
                log.info("%s warm-up cut short after %.1f s: a request came", ROLE_LABEL[role],
                         time.perf_counter() - t)
                return
        log.info("%s warmed up in %.1f s", ROLE_LABEL[role], time.perf_counter() - t)

    def close(self) -> None:
        self.registry.close()

    def banner_text(self) -> str:
        """The warning shown on top of the page when some role runs on random weights ("" when none does)."""
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
