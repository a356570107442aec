"""What the app is configured with: `AppConfig` (one per server) and the fixed defaults it starts from
(checkpoints per role and their environment variables, role labels, the speakers' native languages,
how long text is cut and paused, the default sampling)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from serving.limits import Limits

ROOT = Path(__file__).resolve().parent.parent      # the repository: presets/, assets/
SR = 24000                                        # every audio the page plays or offers: 24 kHz mono int16
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
FILE_CHOICE = "file"      # the voice choice "use the uploaded voice file" (Blend tab)
DEFAULT_SAMPLING = dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)


def ffmpeg_available() -> bool:
    """Gradio's streaming gr.Audio encodes every chunk to AAC/HLS with the `ffmpeg` program."""
    return shutil.which("ffmpeg") is not None


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
    preload: bool = False              # load every role's engine (and warm up) at start-up, not just the default tab's
    limits: Limits = field(default_factory=Limits.from_env)
    backend: str | None = None         # a remote OpenAI-compatible speech server instead of local engines
    # stream audio chunks through Gradio's own streaming gr.Audio (`live` output). That player needs ffmpeg;
    # None = only where ffmpeg is on PATH. Without it the `live` output stays empty (status updates still stream).
    live_audio: bool | None = None
    quantize: str | None = None        # None/"none", "int8", "int4", "auto" (the CPU default of `python app.py`)
    eager: bool = False                # no CUDA graphs on a GPU
    engine_options: dict = field(default_factory=dict)   # more TTSEngine arguments (ZeroGPU: max_batch, max_seq_len)
    # the page player's own request may start a click's generation (ui/early_start.py); never on ZeroGPU, where
    # generation must run inside the Gradio event (its @spaces.GPU call)
    early_start: bool = True

    def engine_kw(self) -> dict:
        """What every local engine is built with, besides device and dtype."""
        kw = {"max_waiting": self.limits.max_queue, "quantize": self.quantize, "admission": self.limits.admission,
              **self.engine_options}
        if self.eager:
            kw["use_cuda_graphs"] = False
        return kw

    @property
    def gradio_live_audio(self) -> bool:
        return ffmpeg_available() if self.live_audio is None else bool(self.live_audio)
