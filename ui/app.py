"""`TTSApp`: one per server. Ties the rooms of the UI together: the models and their engines (roles.py), the
session voices and download files (session.py), the generation loop (speak.py), the handlers behind each
`api_name` (handlers.py, which it inherits: `app.preset(...)` is the /preset endpoint) and the page
(layout.py, `app.build()`)."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from tts_engine.voices.presets import PresetLibrary

from ui import layout, server, zerogpu
from ui.config import AppConfig
from ui.dialogue import DialogueHandler
from ui.early_start import EarlyStarts
from ui.handlers import Handlers
from ui.longform_tab import LongformHandler
from ui.roles import Models, cache_root
from ui.session import Files, Voices
from ui.transcribe import TranscribeHandler
from ui.speak import ActiveStreams, Speaker


class TTSApp(Handlers, DialogueHandler, TranscribeHandler, LongformHandler):
    def __init__(self, cfg: AppConfig | None = None):
        self.cfg = cfg = cfg or AppConfig()
        self.zerogpu = zerogpu.enabled()     # Hugging Face ZeroGPU (the `spaces` package's own detection)
        if self.zerogpu:
            zerogpu.configure(cfg)
        models = Models(cfg)
        c = SimpleNamespace()   # the page's components, filled by build()
        active = ActiveStreams()
        speaker_cls = zerogpu.ZeroGPUSpeaker if self.zerogpu else Speaker
        super().__init__(models=models, voices=Voices(models, PresetLibrary(cfg.presets_dir,
                                                                            cache_root(cfg) / "presets")),
                         files=Files(cfg.limits.file_ttl_seconds), active=active,
                         speaker=speaker_cls(c, self.status, models.loaded, active, live_audio=cfg.gradio_live_audio),
                         limits=cfg.limits, c=c)
        self.concurrency = models.default_concurrency()
        # a click's generation starts from the player's request or the Gradio event, whichever comes first
        # (not on ZeroGPU: there the generation must run inside the Gradio event, in its @spaces.GPU call)
        self.early = EarlyStarts(c, self.status, models.loader, self.live, max_runs=self.concurrency,
                                 enabled=cfg.early_start and not self.zerogpu)

    # the parts tests and scripts reach for most
    @property
    def roles(self):
        return self.models.roles

    @property
    def registry(self):
        return self.models.registry

    @property
    def random_roles(self) -> list[str]:
        return self.models.random_roles

    def engine(self, role: str):
        return self.models.engine(role)

    def build(self) -> gr.Blocks:
        demo = layout.build(self)
        self.early.bind(demo)
        return demo

    def launch_kwargs(self) -> dict:
        return server.launch_kwargs(self)

    def preload(self) -> None:
        """Load and warm up every model now (blocking)."""
        self.models.preload()

    def load_in_background(self, roles: list[str] | None = None) -> None:
        """Load the models of `roles` (default: those of the default tab) in a background thread."""
        self.models.load_in_background(roles)

    def close(self) -> None:
        if getattr(self, "listen", None) is not None:   # listening tests and their extra engines (ui/listen_tab.py)
            self.listen.close()
        self.models.close()
        self.files.close()
