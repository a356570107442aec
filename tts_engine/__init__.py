"""tts_engine: a fast, self-contained PyTorch implementation of Qwen3-TTS (12 Hz).

The public API is what this module exports (`__all__`) plus the modules of `PUBLIC_MODULES`; the page (`ui/`), the
HTTP API (`server/`) and `serving/` use nothing else (tests/test_app_layers.py checks it). Names other than
TTSError and EngineBusyError are loaded on first use, so `import tts_engine` stays light (no torch):

  TTSEngine            load a checkpoint, clone voices, stream speech (`TTSEngine.from_pretrained`)
  Voice                a voice: preset speaker, clone, or embedding; saved as .safetensors or .json
  SamplingParams       temperature, top-k, top-p, repetition penalty
  PresetLibrary        the preset reference clips of a folder, cloned on first use
  inspect_checkpoint   what a checkpoint is (kind, speakers, languages, sizes), without loading it -> CheckpointInfo
  expected_precision   the precision label an engine loaded with these arguments will report, before loading
  expected_choice      (that label, why quantize="auto" chose it)
  chunk_schedule       frames per streamed chunk for `first_chunk_frames` / `max_chunk_frames`
  make_tiny            write a tiny random checkpoint (tests, and the app's offline fallback)
  QUANT_MODES          the lossy weight modes `quantize=` takes (besides "auto" and "none")
"""
from tts_engine.errors import EngineBusyError, TTSError

__all__ = ["TTSEngine", "TTSError", "EngineBusyError", "Voice", "SamplingParams", "PresetLibrary",
           "inspect_checkpoint", "CheckpointInfo", "expected_precision", "expected_choice", "chunk_schedule",
           "make_tiny", "QUANT_MODES"]

# modules that are public as a whole (functions without one home class); everything else inside is internal
PUBLIC_MODULES = (
    "tts_engine.audio",           # reading clips (load_audio, trim_reference, resample)
    "tts_engine.asr",             # transcribing reference clips (Whisper)
    "tts_engine.cache_paths",     # where caches live (cache_root)
    "tts_engine.voices.voice",    # Voice and check_embedding
    "tts_engine.voices.blend",    # blending voice embeddings
    "tts_engine.voices.presets",  # PresetLibrary and its clips
)

_LAZY = {   # name -> module that defines it
    "TTSEngine": "tts_engine.engine.engine",
    "Voice": "tts_engine.voices.voice",
    "SamplingParams": "tts_engine.model.sampling",
    "PresetLibrary": "tts_engine.voices.presets",
    "inspect_checkpoint": "tts_engine.checkpoint",
    "CheckpointInfo": "tts_engine.checkpoint",
    "expected_precision": "tts_engine.loader",
    "expected_choice": "tts_engine.loader",
    "chunk_schedule": "tts_engine.engine.request",
    "make_tiny": "tts_engine.tiny",
    "QUANT_MODES": "tts_engine.model.quant",
}


def __getattr__(name):  # keep `import tts_engine` light (no torch import until used)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
