"""The body of `POST /v1/audio/speech` and the checks that need no engine, with vLLM-Omni's rules.

Each refusal is an `APIError(400, ...)` naming the field (`param`) and what is allowed; out-of-range values are
refused, never capped. The bounds follow vLLM-Omni's speech protocol and serving code (see docs/reliability.md,
"Same answers as vLLM-Omni"); where this server's own limits are tighter (`Limits`), the message gives ours.
"""
from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from server import audio_formats
from serving import text_prep
from serving.limits import Limits
from serving.take_guard import MAX_BEST_OF, MAX_RETRIES
from serving.speed import SPEED_MAX, SPEED_MIN

SEED_MAX = 2**63 - 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = (
            status, message, param, code, type_, headers)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str
    # "speaker" is another name for "voice", as in vLLM-Omni
    voice: str | None = Field(default=None, validation_alias=AliasChoices("voice", "speaker"))
    response_format: str = "wav"
    speed: float | None = None
    stream: bool = False
    stream_format: Literal["sse", "audio"] | None = None
    language: str | None = None
    instructions: str | None = None
    task_type: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    transcribe_ref_audio: bool | None = None    # no ref_text: transcribe ref_audio for in-context cloning
    speaker_embedding: list[float] | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    initial_codec_chunk_frames: int | None = None
    subtitles: str | None = None                # "srt" or "vtt": cues per sentence, linked from the answer's headers
    # what the model reads and how takes are checked (serving/text_prep.py, serving/take_guard.py)
    lexicon: dict[str, str] | None = None        # word or phrase -> respelling, over the server's dictionary
    read_numbers: bool | None = None             # numbers, dates, times, currencies, abbreviations as words (True)
    take_retries: int | None = None              # a failed take is redone this many times (server default: 2)
    best_of: int | None = None                   # render N takes, keep the one with the lowest error


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def check_request(req: SpeechRequest, limits: Limits) -> str:
    """Everything that can be checked before an engine is chosen. Returns the response format (lower case)."""
    fmt = (req.response_format or "wav").lower()
    if fmt not in audio_formats.ALL_FORMATS:
        raise _bad(f"response_format must be one of {', '.join(audio_formats.ALL_FORMATS)}, got {fmt!r}",
                   "response_format")
    if reason := audio_formats.unavailable_reason(fmt):
        raise _bad(reason, "response_format", code="unsupported_format")
    if req.stream_format == "sse":
        raise _bad("stream_format 'sse' is not supported; use 'audio' (raw wav/pcm bytes with stream=true)",
                   "stream_format", code="unsupported_parameter")
    if req.speed is not None:
        if not SPEED_MIN <= req.speed <= SPEED_MAX:
            raise _bad(f"speed must be between {SPEED_MIN} and {SPEED_MAX}, got {req.speed:g}", "speed")
    if req.stream and fmt not in audio_formats.STREAMABLE:
        raise _bad(f"stream=true supports response_format {' or '.join(audio_formats.STREAMABLE)}, got {fmt!r}",
                   "response_format")
    if not req.input or not req.input.strip():
        raise _bad("input is empty", "input")
    if len(req.input) > limits.max_text_chars:
        raise _bad(f"input is too long: {len(req.input)} characters, the limit is {limits.max_text_chars}",
                   "input", code="input_too_long")
    if req.voice is not None and not req.voice.strip():
        raise _bad("voice must not be empty: name a preset speaker or a saved voice (GET /v1/audio/voices "
                   "lists them), or leave voice out", "voice")
    if req.language is not None and not req.language.strip():
        raise _bad("language must not be empty: use auto or a language name such as english", "language")
    if req.instructions is not None and len(req.instructions) > limits.max_instructions_chars:
        raise _bad(f"instructions are too long: {len(req.instructions)} characters, the limit is "
                   f"{limits.max_instructions_chars}", "instructions")
    if req.max_new_tokens is not None and not 1 <= req.max_new_tokens <= limits.max_new_tokens:
        raise _bad(f"max_new_tokens must be between 1 and {limits.max_new_tokens} (frames of 80 ms), got "
                   f"{req.max_new_tokens}", "max_new_tokens")
    if req.seed is not None and not 0 <= req.seed <= SEED_MAX:
        raise _bad(f"seed must be between 0 and {SEED_MAX} (2^63 - 1), got {req.seed}", "seed")
    if req.initial_codec_chunk_frames is not None and not 0 <= req.initial_codec_chunk_frames <= limits.max_new_tokens:
        raise _bad(f"initial_codec_chunk_frames must be between 0 (the server's default) and "
                   f"{limits.max_new_tokens}, got {req.initial_codec_chunk_frames}", "initial_codec_chunk_frames")
    if req.subtitles is not None:
        if req.subtitles.lower() not in ("srt", "vtt"):
            raise _bad(f"subtitles must be srt or vtt, got {req.subtitles!r}", "subtitles")
        if req.stream:
            raise _bad("subtitles come with whole answers: leave out stream=true (or leave out subtitles)",
                       "subtitles", code="unsupported_parameter")
    if req.speaker_embedding is not None and req.ref_audio is not None:
        raise _bad("speaker_embedding and ref_audio are mutually exclusive: send one of them", "speaker_embedding")
    if req.ref_text is not None and not req.ref_text.strip() and req.ref_audio is not None \
            and not req.x_vector_only_mode:
        raise _bad("ref_text must be the non-empty transcript of ref_audio; leave it out (or set "
                   "x_vector_only_mode) to clone from the voice's timbre only", "ref_text")
    if req.take_retries is not None and not 0 <= req.take_retries <= MAX_RETRIES:
        raise _bad(f"take_retries must be between 0 and {MAX_RETRIES}, got {req.take_retries}", "take_retries")
    if req.best_of is not None and not 1 <= req.best_of <= MAX_BEST_OF:
        raise _bad(f"best_of must be between 1 and {MAX_BEST_OF}, got {req.best_of}", "best_of")
    return fmt


def prepare_input(req: SpeechRequest) -> text_prep.Prepared:
    """`input` as the model reads it: pause tags ([pause 0.5s], SSML <break time="500ms"/>), the server's and the
    request's pronunciation dictionaries, numbers read out (unless `read_numbers` is false)."""
    if req.lexicon is not None and len(req.lexicon) > text_prep.REQUEST_LEXICON_MAX:
        raise _bad(f"lexicon has {len(req.lexicon)} entries; a request's own is at most "
                   f"{text_prep.REQUEST_LEXICON_MAX} (put a larger one in the server's file, TTS_LEXICON_FILE)",
                   "lexicon")
    try:
        lexicon = text_prep.Lexicon.merged(text_prep.server_lexicon(),
                                           text_prep.parse_lexicon(req.lexicon, "lexicon"))
        return text_prep.prepare(req.input, req.language, lexicon, req.read_numbers is not False, ssml=True)
    except text_prep.TextPrepError as e:
        raise _bad(str(e), e.param) from None


GENERIC_MODELS = {"tts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts", "qwen3-tts"}
ROLE_NAMES = {"custom_voice": ("custom_voice", "customvoice"), "base": ("base",),
              "voice_design": ("voice_design", "voicedesign")}
QWEN_KINDS = {"customvoice": "custom_voice", "voicedesign": "voice_design", "base": "base"}


def model_role(model: str | None, checkpoints: dict[str, str | None]) -> str | None:
    """Which configured role `model` names: None when it names no particular one (left out, or a generic name
    such as tts-1). Raises APIError 404 when it names nothing this server serves.

    Served names: a configured checkpoint (hub id or folder, or its last path part), a role name (base,
    custom_voice, voice_design), a Qwen3-TTS hub id of a configured kind (the size is not checked: a local folder
    or the offline tiny fallback serves that kind), and the generic names of OpenAI clients."""
    m = (model or "").strip().lower()
    if not m or m in GENERIC_MODELS:
        return None
    configured = {r: str(ck) for r, ck in checkpoints.items() if ck}
    for role, ck in configured.items():
        ck_l = ck.lower().rstrip("/")
        if m in (ck_l, ck_l.rsplit("/", 1)[-1]) or m in ROLE_NAMES.get(role, ()):
            return role
    if "qwen3-tts" in m:
        kind = m.replace("_", "").rsplit("-", 1)[-1]
        role = QWEN_KINDS.get(kind)
        if role in configured:
            return role
    served = sorted({*configured.values(), *configured.keys(), "tts-1"})
    raise APIError(404, f"The model `{model}` does not exist on this server; it serves: {', '.join(served)}",
                   param="model", code="model_not_found")
