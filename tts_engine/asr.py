"""Speech recognition for reference clips: the transcript that in-context cloning needs, so nobody has to type it.

`Transcriber(model)` loads a Whisper checkpoint with transformers' own classes (`WhisperProcessor`,
`WhisperForConditionalGeneration`) the first time `transcribe` is called, never before (a user who types the
transcript never loads it), on the device the TTS engines use, and keeps it. One clip at a time (a lock): it is a
short job next to speech generation. Without the model (offline and not cached) it raises a `TTSError` that says
so; cloning does not depend on it.

Why Whisper small by default (docs/api.md, "Transcribing"): all ten Qwen3-TTS languages (zh, en, ja,
ko, de, fr, ru, pt, es, it) are among Whisper's 99, and every transformers 5.x that requirements.txt allows loads
it; small (244 M parameters, ~1 GB in fp32) is the smallest size whose published error rates on Chinese, Japanese
and Korean are usable for a transcript that must match the clip, and it is a few times lighter than Qwen3-ASR.
`TTS_ASR_MODEL` picks another Whisper (e.g. `openai/whisper-base`: faster, weaker outside English;
`openai/whisper-large-v3-turbo`: better, ~3x the size)."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from tts_engine.errors import TTSError

log = logging.getLogger("tts_engine.asr")

DEFAULT_ASR_MODEL = "openai/whisper-small"
SR = 16000                 # Whisper's input rate
MAX_SECONDS = 30.0         # one Whisper window
RETRY_AFTER_S = 60.0       # a failed load is not retried (slow hub time-outs) before this


def whisper_language(language: str | None) -> str | None:
    """A language as Whisper names it ("english", "zh"), or None (detect it) for "auto" and the unknown."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    lang = (language or "").strip().lower()
    return lang if lang in TO_LANGUAGE_CODE or lang in LANGUAGES else None


_shared: dict[tuple[str, str | None], "Transcriber"] = {}
_shared_lock = threading.Lock()


def shared(device: str | None = None, model: str | None = None) -> "Transcriber":
    """The process's transcriber for `model` (default: `TTS_ASR_MODEL`, else DEFAULT_ASR_MODEL) on `device` (the
    TTS engines' device; None: CUDA when present), shared by the page and the speech API. Creating it loads
    nothing."""
    model = model or os.environ.get("TTS_ASR_MODEL") or DEFAULT_ASR_MODEL
    with _shared_lock:
        t = _shared.get((model, device))
        if t is None:
            t = _shared[(model, device)] = Transcriber(model, device=device)
        return t


@dataclass
class Transcript:
    text: str
    seconds: float          # compute time
    model: str


def _clip(wav: np.ndarray, sr: int) -> np.ndarray:
    """A clip as Whisper reads it: float32 mono at 16 kHz, its first MAX_SECONDS; an empty one is refused."""
    from tts_engine.audio import resample

    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim != 1 or wav.size == 0:
        raise TTSError("the clip to transcribe is empty")
    return resample(wav, sr, SR)[: int(MAX_SECONDS * SR)]


class Transcriber:
    def __init__(self, model: str = DEFAULT_ASR_MODEL, device: str | None = None, dtype=None,
                 max_new_tokens: int = 220):
        self.model_id = model
        self.device = device
        self.dtype = dtype
        self.max_new_tokens = max_new_tokens
        self._lock = threading.Lock()
        self._model = None
        self._processor = None
        self._failed: tuple[float, str] | None = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def _load(self) -> None:
        """Load processor and model (lock held)."""
        if self._model is not None:
            return
        if self._failed and time.monotonic() - self._failed[0] < RETRY_AFTER_S:
            raise TTSError(self._failed[1])
        import torch
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = self.dtype or (torch.float16 if str(device).startswith("cuda") else torch.float32)
        t = time.perf_counter()
        try:
            processor = WhisperProcessor.from_pretrained(self.model_id)
            model = WhisperForConditionalGeneration.from_pretrained(self.model_id, dtype=dtype)
        except (OSError, ValueError) as e:
            msg = (f"the speech-recognition model {self.model_id!r} is not available here (offline and not cached?"
                   f" {type(e).__name__}). Type the transcript yourself, or clone without one (x-vector only).")
            self._failed = (time.monotonic(), msg)
            log.warning("ASR model %s: %s", self.model_id, e)
            raise TTSError(msg) from None
        self._model = model.to(device).eval()
        self._processor = processor
        log.info("ASR model %s loaded on %s in %.1f s", self.model_id, device, time.perf_counter() - t)

    def _generate_kw(self, model, lang: str | None) -> dict:
        """`generate`'s arguments: transcribe, in `lang` where the model knows languages; the prompt (start,
        language, task, no-timestamps) and the words share the decoder's positions."""
        room = int(getattr(model.config, "max_target_positions", 448)) - 5
        kw = {"task": "transcribe", "max_new_tokens": max(1, min(self.max_new_tokens, room))}
        if lang is not None and getattr(model.generation_config, "lang_to_id", None):
            kw["language"] = lang
        return kw

    def transcribe(self, wav: np.ndarray, sr: int, language: str | None = None) -> Transcript:
        """The words of a clip (float mono at any rate; the first 30 s). `language`: a Whisper language name or
        code ("english", "zh"), or None/"auto" to let the model detect it."""
        wav, lang = _clip(wav, sr), whisper_language(language)
        with self._lock:
            self._load()
            import torch

            t = time.perf_counter()
            model, proc = self._model, self._processor
            feats = proc(wav, sampling_rate=SR, return_tensors="pt").input_features
            feats = feats.to(model.device, model.dtype)
            kw = self._generate_kw(model, lang)
            try:
                with torch.inference_mode():
                    ids = model.generate(feats, **kw)
            except ValueError as e:      # e.g. a language Whisper does not know
                raise TTSError(f"speech recognition failed: {e}") from None
            text = proc.batch_decode(ids, skip_special_tokens=True)[0].strip()
            return Transcript(text=text, seconds=time.perf_counter() - t, model=self.model_id)

    def words(self, wav: np.ndarray, sr: int, language: str | None = None) -> list[tuple[str, float, float]]:
        """The words of a clip (the first 30 s) with their (start, end) in seconds, estimated from the decoder's
        cross-attention by dynamic time warping (transformers' `return_token_timestamps`; the checkpoint's
        alignment heads, else every head of the decoder's second half, as openai-whisper does without them).
        Estimates, not measurements: label them so."""
        wav, lang = _clip(wav, sr), whisper_language(language)
        with self._lock:
            self._load()
            import torch

            model, proc = self._model, self._processor
            inputs = proc(wav, sampling_rate=SR, return_tensors="pt", return_attention_mask=True)
            feats = inputs.input_features.to(model.device, model.dtype)
            gc = model.generation_config
            if not getattr(gc, "alignment_heads", None):
                n, h = model.config.decoder_layers, model.config.decoder_attention_heads
                gc.alignment_heads = [[layer, head] for layer in range(n // 2, n) for head in range(h)]
            kw = self._generate_kw(model, lang)
            try:
                with torch.inference_mode():
                    out = model.generate(feats, attention_mask=inputs.attention_mask.to(model.device),
                                         return_token_timestamps=True, return_dict_in_generate=True, **kw)
            except (ValueError, RuntimeError) as e:
                raise TTSError(f"word timing failed: {e}") from None
            ids, times = out["sequences"][0].tolist(), out["token_timestamps"][0].tolist()
            special = set(proc.tokenizer.all_special_ids)
            clip = len(wav) / SR
            words: list[list] = []
            for k, tok in enumerate(ids):          # token k spans from its time to the next token's
                piece = proc.tokenizer.decode([tok]) if tok not in special else ""
                if not piece.strip():
                    continue
                start, end = times[k], times[k + 1] if k + 1 < len(times) else clip
                if not words or piece.startswith(" "):
                    words.append([piece.strip(), start, end])
                else:
                    words[-1][0] += piece
                    words[-1][2] = end
            return [(w, min(a, clip), min(max(b, a), clip)) for w, a, b in words]
