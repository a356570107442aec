"""tts_engine: a fast, self-contained PyTorch implementation of Qwen3-TTS (12 Hz)."""
from .errors import EngineBusyError, TTSError

__all__ = ["TTSError", "EngineBusyError"]
