"""tts_engine: a fast, self-contained PyTorch implementation of Qwen3-TTS (12 Hz)."""
from tts_engine.errors import EngineBusyError, TTSError

__all__ = ["TTSEngine", "TTSError", "EngineBusyError", "Voice", "SamplingParams"]


def __getattr__(name):  # keep `import tts_engine` light (no torch import until used)
    if name == "TTSEngine":
        from tts_engine.engine.engine import TTSEngine
        return TTSEngine
    if name == "Voice":
        from tts_engine.voices.voice import Voice
        return Voice
    if name == "SamplingParams":
        from tts_engine.model.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
