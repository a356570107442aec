"""Issue 16: the 43 request kinds of vLLM-Omni's own tests and docs for `POST /v1/audio/speech`, replayed against
our server (tiny checkpoints of all three kinds, on loopback), each status compared with vLLM-Omni's.

Where each expectation comes from (github.com/vllm-project/vllm-omni):
  [R]  tests/dfx/reliability/invalid_param_test/test_invalid_audio_speech.py: `test_speech_malformed_json`,
       `test_speech_missing_required_fields` and the 25 cases of `test_speech_invalid_field_values` (run against a
       Qwen3-TTS-12Hz-0.6B-Base server with the body `_BASE` below; every one expects 400).
  [P]  vllm_omni/entrypoints/openai/protocol/audio.py: `OpenAICreateSpeechRequest` (voice/speaker alias, the
       response_format Literal wav/pcm/flac/mp3/aac/opus, speed ge=0.25 le=4.0, `validate_stream_format` refusing
       'sse', `validate_streaming_constraints`: stream needs pcm/wav and speed 1.0).
  [S]  vllm_omni/entrypoints/openai/serving_speech.py: `_validate_tts_request` (language in _TTS_LANGUAGES,
       "Invalid speaker", instructions <= 500, 1 <= max_new_tokens <= 4096) and `_check_model` (404).
  [D]  docs/serving/speech_api.md: Quick Start, Examples (CustomVoice, VoiceDesign, Base), Error Responses (404).

Deliberate differences (docs/reliability.md lists them with the reason): R10, a CustomVoice request sent to a
server that also serves Base (one server serves all three kinds here); P39, speed with stream=true (we stretch
streams too, gaplessly); P34 aac where no ffmpeg is on PATH (aac is encoded by ffmpeg: a 400 that names ffmpeg
instead of vLLM-Omni's 200).
"""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import soundfile as sf

from server import audio_formats
from serving.limits import Limits
from tests.live_server import tiny_api

LIMITS = Limits(max_text_chars=300, max_new_tokens=8, max_per_client=16)
BASE_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-Base"
CV_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"


def _tone_data_url(seconds: float = 1.0, sr: int = 24000) -> str:
    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), sr, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


REF_AUDIO = _tone_data_url()
REF_TEXT = "Okay. Yeah. I resent you."
EMPTY_WAV = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEARKwAAIhYAQACABAAZGF0YQAAAAA="   # [R]'s own
# [R] test_speech_invalid_field_values: the body every case starts from
_BASE = {"model": BASE_MODEL, "input": "Hello.", "voice": "clone", "language": "English", "response_format": "wav",
         "ref_audio": REF_AUDIO, "ref_text": REF_TEXT}
_DROP = object()      # remove the key from the body (R's `_SPEECH_INVALID_EMBEDDING_ONLY_BODY`, None in CustomVoice)


def _r(overrides: dict | None = None, *, embedding_only: bool = False) -> dict:
    body = dict(_BASE)
    if embedding_only:
        body.pop("ref_audio"), body.pop("ref_text")
    for k, v in (overrides or {}).items():
        if v is _DROP:
            body.pop(k, None)
        else:
            body[k] = v
    return body


def _cv(**kw) -> dict:
    return {"model": CV_MODEL, "input": "Hello, how are you?", "voice": "vivian", **kw}


# (id, body or raw bytes, vLLM-Omni's status, source, param our 400 names (None: not checked))
CASES = [
    ("R01_malformed_json", b"{", 400, "R test_speech_malformed_json", None),
    ("R02_missing_input", {"model": BASE_MODEL}, 400, "R test_speech_missing_required_fields", "input"),
    ("R03_input_empty", _r({"input": ""}), 400, "R input_empty", "input"),
    ("R04_input_whitespace", _r({"input": "   "}), 400, "R input_whitespace_only", "input"),
    ("R05_voice_empty", _r({"voice": ""}), 400, "R voice_empty (skipped upstream: vllm-omni#3649)", "voice"),
    ("R06_instructions_not_str", _r({"instructions": 123}), 400, "R instructions_wrong_type", "instructions"),
    ("R07_response_format_mpeg", _r({"response_format": "mpeg"}), 400, "R response_format_invalid", "response_format"),
    ("R08_stream_format_int", _r({"stream_format": 1}), 400, "R stream_format_wrong_type", "stream_format"),
    ("R09_stream_not_bool", _r({"stream": "wrong_type"}), 400, "R stream_wrong_type", "stream"),
    ("R10_customvoice_on_base_server", _r({"voice": "vivian", "task_type": "CustomVoice", "ref_audio": _DROP,
                                           "ref_text": _DROP}), 400, "R customvoice_task_not_supported", None),
    ("R11_task_type_invalid", _r({"task_type": "InvalidEnum"}), 400, "R task_type_invalid", "task_type"),
    ("R12_language_empty", _r({"language": ""}), 400, "R language_empty", "language"),
    ("R13_ref_audio_ftp", _r({"ref_audio": "ftp://example.com/a.wav"}), 400, "R ref_audio_bad_scheme", "ref_audio"),
    ("R14_ref_audio_not_uri", _r({"ref_audio": "not_a_valid_uri"}), 400, "R ref_audio_invalid_uri", "ref_audio"),
    ("R15_ref_text_list", _r({"ref_text": ["x"]}), 400, "R ref_text_wrong_type", "ref_text"),
    ("R16_x_vector_only_not_bool", _r({"x_vector_only_mode": "wrong"}), 400,
     "R x_vector_only_mode_string_not_boolean", "x_vector_only_mode"),
    ("R17_embedding_with_ref_audio", _r({"speaker_embedding": [0.01] * 1024}), 400,
     "R speaker_embedding_with_ref_audio_mutually_exclusive", "speaker_embedding"),
    ("R18_max_new_tokens_0", _r({"max_new_tokens": 0}), 400, "R max_new_tokens_below_min", "max_new_tokens"),
    ("R19_max_new_tokens_4097", _r({"max_new_tokens": 4097}), 400, "R max_new_tokens_above_max", "max_new_tokens"),
    ("R20_seed_negative", _r({"seed": -1}), 400, "R seed_negative", "seed"),
    ("R21_seed_2_63", _r({"seed": 2**63}), 400, "R seed_above_max", "seed"),
    ("R22_initial_chunk_negative", _r({"initial_codec_chunk_frames": -1}), 400,
     "R initial_codec_chunk_frames_negative", "initial_codec_chunk_frames"),
    ("R23_instructions_501", _r({"instructions": "x" * 501}), 400, "R instructions_exceed_api_limit", "instructions"),
    ("R24_ref_text_whitespace", _r({"task_type": "Base", "ref_audio": EMPTY_WAV, "ref_text": "   "}), 400,
     "R ref_text_whitespace_only_base_clone", "ref_text"),
    ("R25_embedding_empty", _r({"task_type": "Base", "speaker_embedding": []}, embedding_only=True), 400,
     "R base_speaker_embedding_empty", None),
    ("R26_embedding_512", _r({"task_type": "Base", "x_vector_only_mode": True, "speaker_embedding": [0.01] * 512},
                             embedding_only=True), 400, "R base_speaker_embedding_wrong_dim_short", None),
    ("R27_embedding_2048", _r({"task_type": "Base", "x_vector_only_mode": True, "speaker_embedding": [0.01] * 2048},
                              embedding_only=True), 400, "R base_speaker_embedding_wrong_dim_long", None),
    ("D28_preset_voice", _cv(), 200, "D Quick Start (voice vivian)", None),
    ("P29_speaker_alias", {"model": CV_MODEL, "input": "Hello.", "speaker": "vivian"}, 200,
     "P voice validation_alias AliasChoices('voice', 'speaker')", None),
    ("D30_voice_design", {"input": "Hello world", "task_type": "VoiceDesign",
                          "instructions": "A warm, friendly female voice with a gentle tone"}, 200,
     "D Examples: VoiceDesign", None),
    ("D31_base_clone", {"input": "Hello, this is a cloned voice", "task_type": "Base", "ref_audio": REF_AUDIO,
                        "ref_text": REF_TEXT}, 200, "D Examples: Base (Voice Cloning)", None),
    ("D32_mp3", _cv(response_format="mp3"), 200, "D response_format wav, mp3, flac, pcm, opus", None),
    ("D33_opus", _cv(response_format="opus"), 200, "D response_format ... opus; P Literal", None),
    ("P34_aac", _cv(response_format="aac"), 200, "P response_format Literal[..., 'aac', 'opus']", "response_format"),
    ("P35_speed_2", _cv(speed=2.0), 200, "P speed ge=0.25 le=4.0; D speed 0.25-4.0", None),
    ("P36_speed_0_1", _cv(speed=0.1), 400, "P speed ge=0.25", "speed"),
    ("P37_speed_4_5", _cv(speed=4.5), 400, "P speed le=4.0", "speed"),
    ("P38_stream_mp3", _cv(stream=True, response_format="mp3"), 400,
     "P validate_streaming_constraints: pcm or wav", "response_format"),
    ("P39_stream_speed_2", _cv(stream=True, response_format="pcm", speed=2.0), 400,
     "P validate_streaming_constraints: speed 1.0 when streaming", None),
    ("P40_stream_format_sse", _cv(stream_format="sse"), 400, "P validate_stream_format: 'sse' not supported",
     "stream_format"),
    ("D41_unknown_model", _cv(model="no-such-model"), 404, "D Error Responses: 404 model not found; S _check_model",
     "model"),
    ("S42_language_unknown", _cv(language="Klingon"), 400, "S _validate_tts_request: Invalid language", "language"),
    ("S43_unknown_speaker", _cv(voice="nobody"), 400, "S _validate_tts_request: Invalid speaker", "voice"),
]
assert len(CASES) == 43 and len({c[0] for c in CASES}) == 43


def _deliberate() -> dict[str, tuple[int, str]]:
    """Cases where our status differs from vLLM-Omni's on purpose: id -> (our status, reason)."""
    d = {"R10_customvoice_on_base_server": (200, "one server serves CustomVoice, Base and VoiceDesign together"),
         "P39_stream_speed_2": (200, "streams are time-stretched too, gaplessly (Rubber Band's real-time mode)")}
    if audio_formats.ffmpeg() is None:
        d["P34_aac"] = (400, "aac is encoded by ffmpeg, and this machine has none on PATH")
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_api(tmp_path_factory.mktemp("parity"), ("custom_voice", "base", "voice_design"), LIMITS) as (url, reg, _):
        yield url, reg


@pytest.fixture(scope="module")
def api(server):
    return server[0]


def _send(url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + "/v1/audio/speech", content=body, headers={"content-type": "application/json"},
                          timeout=120)
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=120)


@pytest.mark.parametrize("case_id,body,vllm_status,source,param", CASES, ids=[c[0] for c in CASES])
def test_same_status_as_vllm_omni(api, case_id, body, vllm_status, source, param):
    expected, why = _deliberate().get(case_id, (vllm_status, ""))
    r = _send(api, body)
    assert r.status_code == expected, f"{case_id} ({source}; {why or 'same as vLLM-Omni'}): {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]                               # the OpenAI error shape, always
        assert set(err) >= {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param, err                 # every refusal names its field
    else:
        assert len(r.content) > 0


def test_at_least_40_of_43_match():
    deliberate = _deliberate()
    assert 43 - len(deliberate) >= 40, deliberate


@pytest.mark.parametrize("body,needle", [
    (_r({"max_new_tokens": 0}), "between 1 and 8"),
    (_r({"max_new_tokens": 4097}), "between 1 and 8"),
    (_r({"seed": 2**63}), "between 0 and 9223372036854775807"),
    (_r({"seed": -1}), "between 0 and"),
    (_r({"initial_codec_chunk_frames": -1}), "between 0"),
    (_r({"instructions": "x" * 501}), "the limit is 500"),
    (_cv(speed=0.1), "between 0.25 and 4.0"),
    (_cv(speed=4.5), "between 0.25 and 4.0"),
    (_cv(model="no-such-model"), "does not exist"),
    (_r({"speaker_embedding": [0.01] * 1024}), "mutually exclusive"),
    (_cv(stream_format="sse"), "'sse' is not supported"),
])
def test_refusals_say_what_is_allowed(api, body, needle):
    r = _send(api, body)
    assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], r.text


def test_in_range_values_are_served(api):
    """The edges of each range are served, not refused (and nothing is capped silently)."""
    for body in (_cv(max_new_tokens=1), _cv(max_new_tokens=LIMITS.max_new_tokens), _cv(seed=2**63 - 1),
                 _cv(seed=0), _cv(initial_codec_chunk_frames=0), _cv(initial_codec_chunk_frames=3),
                 _cv(instructions="x" * 500), _cv(speed=0.25), _cv(speed=4.0)):
        r = _send(api, body)
        assert r.status_code == 200, (body, r.text)


def test_no_voice_means_vivian_as_in_vllm_omni(server, monkeypatch):
    """docs/serving/speech_api.md: `voice` defaults to "vivian" (serving_speech.py `_build_tts_params`)."""
    url, registry = server
    engine = registry.get("custom_voice")
    asked, real = [], engine.stream
    monkeypatch.setattr(engine, "stream", lambda text, **kw: asked.append(kw["voice"]) or real(text, **kw))
    r = _send(url, {"input": "Hello, how are you?"})
    assert r.status_code == 200 and len(r.content) > 44 and asked == ["vivian"]
