"""OpenAI-compatible speech API, as vLLM-Omni serves Qwen3-TTS:

  POST /v1/audio/speech   {model, input, voice, response_format, speed, stream, language, instructions,
                           task_type, ref_audio, ref_text, x_vector_only_mode, transcribe_ref_audio,
                           speaker_embedding, max_new_tokens, seed}
  GET  /v1/audio/voices
  POST /v1/audio/voices, DELETE /v1/audio/voices/{name}   uploaded voices (server/voices_api.py)
  WS   /v1/audio/speech/stream                           text in as it is written (server/speech_ws.py)

Answers of /v1/audio/speech carry X-Seed, X-TTS-Precision ("... (lossy)" for quantised weights), X-TTS-Paths
("part=path; ..." from `engine.paths()`: what served each part of a frame) and X-Notice (`SPEECH_HEADERS`, shown on
the API docs page /docs).
Errors use the OpenAI shape {"error": {"message", "type", "param", "code"}} with a matching status code.
`ref_audio` must be inline (a data: URI or base64 of an audio file): this server fetches no URLs.
Also `speaker` (= voice), `stream_format`, `initial_codec_chunk_frames`. The checks and their bounds (vLLM-Omni's)
are in `speech_request.py`, `speed` (0.25-4.0, pitch kept, streams too) in `speed.py`, formats in `audio_formats.py`.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import logging
import random
import re
import threading
import time
from collections import defaultdict

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from tts_engine import EngineBusyError, TTSError

from server import audio_formats, speech_ws, voices_api
from server.body_limit import BodySizeLimit
from serving.limits import Limits
from serving.reference import prepare_reference, transcribe_reference
from serving.registry import EngineRegistry
from server.speech_request import APIError, SpeechRequest, check_request, model_role, prepare_input
from serving.speed import StreamStretcher, change_speed
from serving.take_guard import SpokenTakes, TakeGuard
from serving import voice_store
from serving.subtitles import Cue, speak_with_cues, to_srt, to_vtt
from server.text_stream import SentenceStream

log = logging.getLogger("tts_server")
DEFAULT_SPEAKER = "vivian"     # when a CustomVoice request names no voice (vLLM-Omni's default)
TASKS = {"customvoice": "custom_voice", "custom_voice": "custom_voice", "voicedesign": "voice_design",
         "voice_design": "voice_design", "base": "base"}
ROLE_TASK = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}   # `task_type` names
STARTED = int(time.time())   # `created` of /v1/models' entries


def error_response(status: int, message: str, param=None, code=None, type_="invalid_request_error",
                   headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def busy_error(e: EngineBusyError, engine=None) -> "APIError":
    """A full queue as OpenAI clients expect it: 503, `Retry-After` in seconds (from the queue's measured drain
    rate: the `openai` client waits that long before its retry), an OpenAI-shaped body."""
    retry = getattr(e, "retry_after_s", None)
    if retry is None and engine is not None and hasattr(engine, "load_state"):
        retry = engine.load_state().get("retry_after_s")
    retry = max(1, int(retry or 2))
    return APIError(503, f"{e} (retry after {retry} s)", code="server_busy", type_="server_error",
                    headers={"Retry-After": str(retry)})


async def cancel_on_disconnect(receive, stream) -> None:
    """Cancel `stream` as soon as the client hangs up (its engine row is free by the next frame), not when the
    next chunk fails to send."""
    while (await receive())["type"] != "http.disconnect":
        pass
    await run_in_threadpool(stream.cancel)


QUEUE_POLL_S = 0.1    # how often a queued request checks that its client is still there


async def event_loop() -> asyncio.AbstractEventLoop:
    """The server's event loop, for a sync route (a dependency: FastAPI runs it in the loop)."""
    return asyncio.get_running_loop()


def wait_for_row(stream, request: Request, loop: asyncio.AbstractEventLoop) -> bool:
    """While `stream` waits in its engine's queue (honest admission may hold it there a while), watch the client
    (from the route's worker thread, asking the loop): one that hangs up leaves the queue at once. -> False when it
    did."""
    while getattr(stream, "position", None) is not None:
        if asyncio.run_coroutine_threadsafe(request.is_disconnected(), loop).result():
            stream.cancel()
            return False
        time.sleep(QUEUE_POLL_S)
    return True


class ClientSlots:
    """Concurrent requests per client address."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()

    def acquire(self, client: str) -> None:
        with self.lock:
            if self.active[client] >= self.limit:
                raise APIError(429, f"too many concurrent requests from this client (limit {self.limit})",
                               code="rate_limit_exceeded", type_="rate_limit_error")
            self.active[client] += 1

    def release(self, client: str) -> None:
        with self.lock:
            self.active[client] = max(0, self.active[client] - 1)
            if not self.active[client]:
                del self.active[client]


def _precision(engine) -> dict:
    """What the engine computes with, for clients: {"precision": "int8 weights (bf16 activations)", "lossy": True}."""
    p = getattr(engine, "precision", None)
    return {"precision": p, "lossy": bool(getattr(engine, "lossy", False))} if p else {}


def _ascii(s) -> str:
    return str(s).encode("ascii", "replace").decode()


def paths_header(engine) -> str:
    """`engine.paths()` in one header value: "part=path; part=path; ..." (what served each part of a frame; the
    reasons are in the page's footer and the engine's log). "" for an engine that does not say (a remote one)."""
    paths = engine.paths()
    clean = lambda s: re.sub(r"[;=\r\n]", " ", _ascii(s)).strip()
    return "; ".join(f"{clean(part)}={clean(e.get('path', ''))}" for part, e in paths.items())


# the headers of a /v1/audio/speech answer, as the API docs page (/docs) lists them
SPEECH_HEADERS = {
    "X-Seed": {"description": "the seed the generation used (send it as `seed` to get the same audio again)",
               "schema": {"type": "string"}},
    "X-TTS-Precision": {"description": "what the model computes with, e.g. `bf16` or `int8 weights (bf16 "
                                       "activations) (lossy)`; `(lossy)` when the weights are quantised",
                        "schema": {"type": "string"}},
    "X-TTS-Paths": {"description": "what served each part of a frame, `part=path; part=path; ...`, e.g. "
                                   "`frame=off; talker step=on; ...` (the engine's `paths()`)",
                    "schema": {"type": "string"}},
    "X-Notice": {"description": "what the server changed about the request (a trimmed reference clip, a "
                                "transcript written by Whisper), `; `-separated", "schema": {"type": "string"}},
    "X-Subtitles": {"description": "with `subtitles` (srt or vtt) in the request: the path of the answer's subtitles "
                                   "(`GET` it: one cue per sentence, timed from its samples), kept for the file "
                                   "lifetime", "schema": {"type": "string"}},
    "X-Take-Check": {"description": "the take guard's check of each part between pause tags, `; `-separated: "
                                    "`pass` or `fail=runaway|too-short|transcript`, seed, seconds, bound_frames, cer, "
                                    "takes (docs/text-and-takes.md); a stream says `streamed: ...` (not redone)",
                     "schema": {"type": "string"}},
}


class SubtitleStore:
    """The subtitles of recent answers, by an unguessable id, for `GET /v1/audio/subtitles/{id}.srt|.vtt`
    (at most `size` answers, each kept `ttl` seconds)."""

    def __init__(self, ttl: float, size: int = 512):
        self.ttl, self.size, self.items, self.lock = ttl, size, {}, threading.Lock()

    def put(self, cues: list[Cue]) -> str:
        import uuid

        sid = uuid.uuid4().hex
        with self.lock:
            now = time.monotonic()
            self.items = {k: v for k, v in self.items.items() if now - v[0] < self.ttl}
            while len(self.items) >= self.size:
                self.items.pop(next(iter(self.items)))
            self.items[sid] = (now, cues)
        return sid

    def get(self, sid: str) -> list[Cue] | None:
        with self.lock:
            item = self.items.get(sid)
        return item[1] if item and time.monotonic() - item[0] < self.ttl else None


def _headers(stream, notices: list[str], engine=None) -> dict:
    h = {"X-Seed": str(stream.seed)}
    if label := _precision(engine):
        h["X-TTS-Precision"] = label["precision"] + (" (lossy)" if label["lossy"] else "")
    if engine is not None and (paths := paths_header(engine)):
        h["X-TTS-Paths"] = paths
    if notices:
        h["X-Notice"] = _ascii("; ".join(notices))
    if hasattr(stream, "header"):
        h["X-Take-Check"] = _ascii(stream.header())
    return h


def decode_ref_audio(s: str, limits: Limits) -> bytes:
    s = s.strip()
    if s.startswith(("http://", "https://", "file:")) or re.match(r"^[a-z][a-z0-9+.-]*://", s, re.I):
        raise APIError(400, "ref_audio must be inline audio (a data: URI or base64); URLs are not fetched",
                       param="ref_audio")
    if s.startswith("data:"):
        s = s.split(",", 1)[-1]
    if len(s) * 3 // 4 > limits.max_upload_bytes:
        raise APIError(413, f"ref_audio is larger than {limits.max_upload_bytes // 2**20} MiB", param="ref_audio")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "ref_audio is not valid base64", param="ref_audio") from None


def install(app: FastAPI, registry: EngineRegistry, limits: Limits, take_guard: TakeGuard | None = None) -> None:
    """Add the speech API routes and the OpenAI-shaped error handlers to `app`. take_guard: how every take is
    checked (serving/take_guard.py; requests adjust it); default `TakeGuard.from_env()`."""
    slots = ClientSlots(limits.max_per_client)
    subtitles = SubtitleStore(limits.file_ttl_seconds)
    take_guard = take_guard or TakeGuard.from_env()
    if isinstance(registry, EngineRegistry):    # uploaded voices: POST / DELETE /v1/audio/voices
        voices_api.install(app, registry, limits)
    # base64 grows uploads by 4/3; leave room for the rest of the JSON body
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_upload_bytes * 4 // 3 + 64 * 1024)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.type, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        if not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": e.errors()}, status_code=422)
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", [])[1:]) or None
        return error_response(400, f"invalid request: {first.get('msg', 'bad body')}", param=param)

    def pick_role(req: SpeechRequest) -> str:
        named = model_role(req.model, registry.checkpoints)     # 404 for a model this server does not serve
        if req.task_type:
            role = TASKS.get(req.task_type.replace(" ", "").lower())
            if role is None:
                raise APIError(400, "task_type must be CustomVoice, VoiceDesign or Base", param="task_type")
            return role
        if req.ref_audio or req.speaker_embedding is not None:
            return "base"
        if named is not None:
            return named
        if req.voice:
            if registry.configured("custom_voice"):
                if req.voice.strip().lower() in registry.get("custom_voice").speakers:
                    return "custom_voice"
            if registry.voices.get(req.voice) is not None or voice_store.find(registry, req.voice) is not None:
                return "base"
            raise APIError(400, f"unknown voice {req.voice!r}", param="voice", code="voice_not_found")
        if req.instructions and registry.configured("voice_design"):
            return "voice_design"
        if registry.configured("custom_voice"):
            return "custom_voice"              # no voice named: vLLM-Omni's default, CustomVoice speaker vivian
        raise APIError(400, "say which voice to use: `voice`, `ref_audio` or `speaker_embedding`", param="voice")

    def make_voice(role, engine, req: SpeechRequest, request_notices: list):
        if role == "voice_design":
            if not (req.instructions or "").strip():
                raise APIError(400, "VoiceDesign needs `instructions` describing the voice", param="instructions")
            return None
        if role == "custom_voice":
            if not req.voice:                  # vLLM-Omni's default speaker
                return DEFAULT_SPEAKER if DEFAULT_SPEAKER in engine.speakers else engine.speakers[0]
            if req.voice.strip().lower() not in engine.speakers:
                raise APIError(400, f"unknown voice {req.voice!r}; choose one of: {', '.join(engine.speakers)}",
                               param="voice", code="voice_not_found")
            return req.voice
        if req.ref_audio:
            data = decode_ref_audio(req.ref_audio, limits)
            ref, notices = prepare_reference(data, limits)
            request_notices.extend(notices)
            ref_text = req.ref_text
            if req.transcribe_ref_audio and not req.x_vector_only_mode and not (ref_text or "").strip():
                ref_text, notices = transcribe_reference(ref, getattr(registry, "device", None), req.language)
                request_notices.extend(notices)
            xvec = bool(req.x_vector_only_mode) or not (ref_text or "").strip()
            return engine.clone_voice(ref, ref_text=ref_text, x_vector_only=xvec)
        if req.speaker_embedding is not None:
            return engine.voice_from_embedding(req.speaker_embedding)
        if req.voice:
            v = registry.voices.get(req.voice) or voice_store.voice_for(registry, req.voice, engine)
            if v is None:
                raise APIError(400, f"unknown voice {req.voice!r}", param="voice", code="voice_not_found")
            return v
        raise APIError(400, "a Base model needs `ref_audio`, `speaker_embedding` or a saved `voice`", param="voice")

    def prepare(req: SpeechRequest):
        """(engine, voice) of a request: what the WebSocket stream speaks each sentence with."""
        role = pick_role(req)
        engine = registry.get(role)
        return engine, make_voice(role, engine, req, [])

    speech_ws.install(app, prepare, SpeechRequest, limits, slots)    # /v1/audio/speech/stream

    @app.post("/v1/audio/speech", responses={200: {"description": "the audio (streamed as it is generated with "
                                                  "`stream=true`)", "headers": SPEECH_HEADERS}})
    def speech(req: SpeechRequest, request: Request, loop=Depends(event_loop)):
        fmt = check_request(req, limits)
        client = request.client.host if request.client else "unknown"
        slots.acquire(client)
        released, engine = False, None
        try:
            role = pick_role(req)
            engine = registry.get(role)
            if req.language is not None and req.language.strip().lower() not in engine.languages:
                raise APIError(400, f"unsupported language {req.language!r}; choose one of: "
                                    f"{', '.join(engine.languages)}", param="language")
            notices: list[str] = []
            voice = make_voice(role, engine, req, notices)
            extra = {"first_chunk_frames": req.initial_codec_chunk_frames} if req.initial_codec_chunk_frames else {}
            prepared = prepare_input(req)    # bad pause tags and dictionaries refused on every path
            if req.subtitles:            # sentence by sentence, each cue timed from its own request's samples
                return subtitled(engine, req, fmt, voice, notices, extra)

            def submit(text, seed, max_new):     # one take of one segment of the prepared input
                return engine.stream(text, voice=voice, language=req.language or "auto",
                                     instruct=req.instructions if engine.supports_instruct else None,
                                     seed=seed, max_new_tokens=max_new, **extra)
            stream = SpokenTakes(prepared, submit,
                                 take_guard.with_options(retries=req.take_retries, best_of=req.best_of),
                                 random.randrange(2**31) if req.seed is None else req.seed,
                                 req.max_new_tokens or limits.max_new_tokens, req.language, streaming=req.stream)
            if not getattr(engine, "driven_by_caller", False) and not wait_for_row(stream, request, loop):
                return Response(status_code=499)   # the client hung up while queued: nobody to answer
            try:
                first = next(stream)          # errors at the start still get a proper status code
            except StopIteration:
                first = np.zeros(0, np.float32)
            except BaseException:
                stream.cancel()
                raise
            if not req.stream:
                wav = np.concatenate([first] + list(stream))
                if req.speed is not None and req.speed != 1.0:
                    wav = change_speed(wav, audio_formats.SAMPLE_RATE, req.speed)
                try:
                    body = audio_formats.encode(wav, fmt)
                except audio_formats.FormatUnavailable as e:
                    raise APIError(400, str(e), param="response_format", code="unsupported_format") from None
                return Response(body, media_type=audio_formats.MEDIA_TYPES[fmt], headers=_headers(stream, notices, engine))

            stretch = (StreamStretcher(audio_formats.SAMPLE_RATE, req.speed)
                       if req.speed is not None and req.speed != 1.0 else None)

            ended = threading.Lock()

            def end() -> None:
                if ended.acquire(blocking=False):
                    stream.cancel()       # a client that goes away frees its engine slot
                    slots.release(client)

            def chunks():
                try:
                    if fmt == "wav":
                        yield audio_formats.streaming_wav_header()
                    for c in itertools.chain([first], stream):
                        c = stretch.push(c) if stretch else c
                        if len(c):
                            yield audio_formats.to_int16(c).tobytes()
                    if stretch:
                        yield audio_formats.to_int16(stretch.finish()).tobytes()
                except TTSError as e:  # mid-stream failure: the status is already sent; end the body
                    log.warning("stream ended early: %s", e)
                finally:
                    end()

            async def body():
                watch = asyncio.ensure_future(cancel_on_disconnect(request.receive, stream))
                try:
                    async for b in iterate_in_threadpool(chunks()):
                        yield b
                finally:
                    watch.cancel()
                    await run_in_threadpool(end)

            released = True
            return StreamingResponse(body(), media_type=audio_formats.MEDIA_TYPES[fmt],
                                     headers=_headers(stream, notices, engine))
        except EngineBusyError as e:
            raise busy_error(e, engine) from None
        except TTSError as e:
            raise APIError(400, str(e))
        finally:
            if not released:
                slots.release(client)

    def subtitled(engine, req: SpeechRequest, fmt: str, voice, notices: list, extra: dict) -> Response:
        cut = SentenceStream("sentence")
        sentences = cut.feed(req.input) + cut.flush()
        sr = audio_formats.SAMPLE_RATE
        wav, cues, seed = speak_with_cues(engine, sentences, sr, seed=req.seed, voice=voice,
                                          language=req.language or "auto",
                                          instruct=req.instructions if engine.supports_instruct else None,
                                          max_new_tokens=req.max_new_tokens or limits.max_new_tokens, **extra)
        if req.speed is not None and req.speed != 1.0:
            wav = change_speed(wav, sr, req.speed)
            cues = [Cue(q.start / req.speed, q.end / req.speed, q.text) for q in cues]
        try:
            body = audio_formats.encode(wav, fmt)
        except audio_formats.FormatUnavailable as e:
            raise APIError(400, str(e), param="response_format", code="unsupported_format") from None
        path = f"/v1/audio/subtitles/{subtitles.put(cues)}.{req.subtitles.lower()}"
        headers = {**_headers(type("Answer", (), {"seed": seed}), notices, engine), "X-Subtitles": path,
                   "Link": f'<{path}>; rel="alternate"'}
        return Response(body, media_type=audio_formats.MEDIA_TYPES[fmt], headers=headers)

    @app.get("/v1/audio/subtitles/{name}")
    def get_subtitles(name: str):
        """The subtitles of a recent answer (its `X-Subtitles` header): `<id>.srt` or `<id>.vtt`."""
        sid, _, ext = name.partition(".")
        cues = subtitles.get(sid) if ext in ("srt", "vtt") else None
        if cues is None:
            raise APIError(404, "no such subtitles (they are kept for the file lifetime): request the speech again",
                           param="name", code="not_found")
        if ext == "srt":
            return Response(to_srt(cues), media_type="application/x-subrip; charset=utf-8")
        return Response(to_vtt(cues), media_type="text/vtt; charset=utf-8")

    @app.get("/health")
    def health():
        """As vLLM-Omni's server: 200 while the server serves. The body says which engines are loaded and how full
        each one's queue is (load balancers read the status; people and dashboards the body)."""
        out = {"status": "ok", "engines": {}}
        if not isinstance(registry, EngineRegistry):      # a remote backend serves: this server only forwards
            out["backend"] = "remote"
            return out
        full = []
        for role, ckpt in registry.checkpoints.items():
            if not ckpt:
                continue
            entry = {"model": ckpt, "loaded": registry.loaded(role)}
            if entry["loaded"]:
                engine = registry.get(role)
                state = engine.load_state() if hasattr(engine, "load_state") else {}
                entry.update(state, precision=engine.precision)
                if state:
                    entry["queue_full"] = state["waiting"] >= state["max_waiting"]
                    full.append(entry["queue_full"])
            out["engines"][role] = entry
        # every configured engine loaded; any queue full (its requests are answered 503 with Retry-After)
        out["loaded"] = all(e["loaded"] for e in out["engines"].values())
        out["queue_full"] = any(full)
        return out

    @app.get("/v1/models")
    def models():
        """The models this server speaks with, as OpenAI's (and vLLM-Omni's) `GET /v1/models` lists them: one entry
        per configured checkpoint, its id being what the `model` field of a speech request names."""
        data = [{"id": ckpt, "object": "model", "created": STARTED, "owned_by": "qwen3-tts-live", "root": ckpt,
                 "task_type": ROLE_TASK.get(role, role)}
                for role, ckpt in getattr(registry, "checkpoints", {}).items() if ckpt]
        return {"object": "list", "data": data}

    @app.get("/v1/audio/voices")
    def voices():
        data = []
        if registry.configured("custom_voice"):
            try:
                eng = registry.get("custom_voice")
                data += [{"id": s, "name": s, "model": registry.checkpoints["custom_voice"], "task_type": "CustomVoice",
                          **_precision(eng)} for s in eng.speakers]
            except TTSError as e:
                log.warning("custom voice model unavailable: %s", e)
        base = registry.get("base") if registry.loaded("base") else None
        label = _precision(base) if base is not None else {}
        data += [{"id": n, "name": n, "model": registry.checkpoints.get("base"), "task_type": "Base", **label}
                 for n in registry.voices.names()]
        uploaded_data, uploaded = voices_api.listing(registry, label)
        data += uploaded_data
        return {"object": "list", "data": data, "voices": [d["id"] for d in data], "uploaded_voices": uploaded}
