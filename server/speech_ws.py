"""`/v1/audio/speech/stream` (WebSocket): text in as it is written, speech out sentence by sentence, in vLLM-Omni's
protocol (its docs/serving/speech_api.md, "Streaming Text Input").

Client -> server (JSON text messages):
  {"type": "session.config", ...}   first; every /v1/audio/speech field (voice, model, task_type, language,
                                    instructions, ref_audio, ref_text, x_vector_only_mode, speaker_embedding,
                                    response_format, seed, max_new_tokens) plus `stream_audio` (false: one binary
                                    frame per sentence; true: PCM chunks as they are generated) and
                                    `split_granularity` ("sentence", the default here; "clause"; "none": one unit
                                    per input.done). May be sent again between utterances.
  {"type": "input.text", "text": "..."}   a piece of text
  {"type": "input.done"}            end of an utterance: the rest of the buffer is spoken; the socket stays open
  {"type": "session.close"}         finish what was sent, then close
Server -> client:
  {"type": "audio.start", "utterance_index", "sentence_index", "sentence_text", "format", "sample_rate", "channels"}
  binary frames: with stream_audio, int16 mono PCM at 24 kHz as generated (`wav`, the default format: a WAV
  header opens each sentence's audio); without, one frame per sentence holding a whole file of `response_format`
  {"type": "audio.done", "utterance_index", "sentence_index", "total_bytes", "error"}
  {"type": "session.done", "utterance_index", "total_sentences"}
  {"type": "busy", "utterance_index", "sentence_index", "position"}   the sentence about to be spoken waits for
                                    the engine (its queue is full, or the running streams leave no room at real
                                    time): position N in line, counting from 1; sent again when it changes
  {"type": "error", "message"}      non-fatal, except a bad first session.config (the socket then closes)

Each sentence is submitted to the engine as soon as it is complete while the one before it is spoken (at most
`LOOKAHEAD` sentences in the engine per socket), and its audio is sent right after the previous sentence's, in
order, with nothing inserted between them. A socket that closes cancels every sentence still in the engine. When the
engine's queue is full a sentence is not refused: it waits in the busy line (`serving/busy_line.py`, shared with the
page) and the client is told its position.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from tts_engine import EngineBusyError, TTSError

from server import audio_formats
from serving import text_prep
from serving.busy_line import LINE as BUSY_LINE
from serving.limits import Limits
from server.text_stream import GRANULARITIES, SentenceStream

log = logging.getLogger("tts_server")
LOOKAHEAD = 2                      # sentences in the engine per socket: the one spoken and the next
CONFIG_TIMEOUT_S = 10.0            # for the first session.config
IDLE_TIMEOUT_S = 300.0             # between messages afterwards, once everything sent has been spoken
MAX_PENDING = 64                   # sentences waiting to be spoken per socket
MAX_CONFIG_BYTES = 16 * 2**20      # session.config carries ref_audio (uvicorn's own message limit)
MAX_TEXT_MESSAGE_BYTES = 128 * 1024
SENTENCE_CHARS = 300
BUSY_POLL_S = 0.25                 # how often a waiting sentence checks its place
_DONE = object()


@dataclass
class Sentence:
    utterance: int
    index: int
    text: str
    engine: object = None
    voice: object = None
    kw: dict = field(default_factory=dict)
    fmt: str = "pcm"
    stream_audio: bool = False
    stream: object = None           # the engine's TTSStream once submitted
    error: str | None = None
    busy: bool = False              # the engine's queue was full: it waits in the busy line when its turn comes
    total_sentences: int | None = None   # set on the end-of-utterance marker instead of text
    # what the model reads (serving/text_prep.py): the runs between the sentence's pause tags, each in its spoken
    # form (dictionary, numbers read out) with the silence after it, and the silence before the first
    say: list = field(default_factory=list)
    lead_s: float = 0.0

    @property
    def first(self) -> str:
        return self.say[0][0] if self.say else self.text


def _message(e: BaseException) -> str:
    return getattr(e, "message", None) or str(e) or type(e).__name__


class SpeechSocket:
    """One WebSocket session: a receiver (this coroutine) and a speaker task sending audio in order."""

    def __init__(self, ws: WebSocket, prepare, request_model, limits: Limits):
        self.ws, self.prepare, self.request_model, self.limits = ws, prepare, request_model, limits
        self.config: dict | None = None
        self.setup = None                  # (engine, voice, engine kwargs, format, stream_audio)
        self.splitter = SentenceStream()
        self.utterance = 0
        self.sentence = 0
        self.open_utterance = False
        self.pending: deque[Sentence] = deque()
        self.changed = asyncio.Event()
        self.submit_lock = asyncio.Lock()
        self.closing = False
        self.cancelled = False

    # --- receiving ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        await self.ws.accept()
        speaker = asyncio.create_task(self._speak_all())
        try:
            while not self.closing:
                timeout = CONFIG_TIMEOUT_S if self.config is None else IDLE_TIMEOUT_S
                try:
                    msg = await asyncio.wait_for(self.ws.receive(), timeout=timeout)
                except asyncio.TimeoutError:
                    if self.config is not None and self.pending and not speaker.done():
                        continue                # still speaking what was sent: not idle
                    await self._error("timeout waiting for session.config" if self.config is None
                                      else "idle timeout: no message received")
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                if speaker.done():
                    break
                if not await self._handle(msg):
                    break
            if self.closing:                        # session.close: finish what was sent, then close
                self.pending.append(Sentence(self.utterance, -1, "", total_sentences=-1))
                self.changed.set()
                await asyncio.wait([speaker])
                if not speaker.exception():
                    await self.ws.close()
        except WebSocketDisconnect:
            pass
        except Exception as e:  # never take the server down for one socket
            log.exception("speech socket failed: %s", e)
        finally:
            self._cancel_all()
            speaker.cancel()
            try:
                await speaker
            except BaseException:   # cancelled, or the socket went away while it was sending
                pass

    async def _handle(self, msg: dict) -> bool:
        """One client message; False ends the session."""
        raw = msg.get("text")
        if raw is None:
            await self._error("send JSON text messages (binary frames are not accepted)")
            return self.config is not None
        if len(raw) > (MAX_CONFIG_BYTES if self.config is None or '"session.config"' in raw[:200]
                       else MAX_TEXT_MESSAGE_BYTES):
            await self._error("message too large")
            return self.config is not None
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            await self._error("invalid JSON message")
            return self.config is not None
        if not isinstance(data, dict):
            await self._error("messages must be JSON objects")
            return self.config is not None
        kind = data.get("type")
        if kind == "session.config":
            if self.open_utterance:
                await self._error("session.config cannot be applied while an utterance is in progress; "
                                  "send input.done first")
                return True
            ok = await self._configure(data)
            return ok or self.config is not None
        if self.config is None:
            await self._error(f"expected session.config first, got {kind!r}")
            return False
        if kind == "input.text":
            text = data.get("text", "")
            if not isinstance(text, str):
                await self._error("input.text needs a string `text`")
                return True
            if text:
                self.open_utterance = True
            for unit in self.splitter.feed(text):
                if not await self._queue(unit):
                    break
        elif kind == "input.done":
            for unit in self.splitter.flush():
                if not await self._queue(unit):
                    break
            self.pending.append(Sentence(self.utterance, -1, "", total_sentences=self.sentence))
            self.changed.set()
            self.utterance += 1
            self.sentence = 0
            self.open_utterance = False
        elif kind == "session.close":
            self.closing = True
        else:
            await self._error(f"unknown message type {kind!r}")
        return True

    async def _configure(self, data: dict) -> bool:
        cfg = {k: v for k, v in data.items() if k != "type"}
        stream_audio = bool(cfg.pop("stream_audio", False))
        granularity = cfg.pop("split_granularity", None) or "sentence"
        if granularity not in GRANULARITIES:
            await self._error(f"split_granularity must be one of {', '.join(GRANULARITIES)}")
            return False
        fmt = str(cfg.get("response_format") or "wav").lower()      # vLLM-Omni's default
        allowed = audio_formats.STREAMABLE if stream_audio else tuple(audio_formats.available_formats())
        if fmt not in allowed:
            await self._error(f"response_format must be one of {', '.join(allowed)}"
                              + (" with stream_audio" if stream_audio else ""))
            return False
        cfg.pop("input", None)
        cfg.pop("stream", None)
        try:
            req = self.request_model(input="-", **cfg)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", []))
            await self._error(f"invalid session config: {where}: {first.get('msg', 'bad value')}")
            return False
        try:
            engine, voice = await run_in_threadpool(self.prepare, req)
        except Exception as e:
            if not isinstance(e, TTSError) and not hasattr(e, "status"):
                log.exception("session.config failed")
            await self._error(f"invalid session config: {_message(e)}")
            return False
        max_new = min(req.max_new_tokens or self.limits.max_new_tokens, self.limits.max_new_tokens)
        kw = dict(language=req.language or "auto", instruct=req.instructions if engine.supports_instruct else None,
                  seed=req.seed, max_new_tokens=max_new)
        own = getattr(req, "lexicon", None)
        try:   # the session's pronunciation dictionary over the server's, and whether numbers are read out
            if own is not None and len(own) > text_prep.REQUEST_LEXICON_MAX:
                raise TTSError(f"lexicon has {len(own)} entries; a session's own is at most "
                               f"{text_prep.REQUEST_LEXICON_MAX}")
            lexicon = text_prep.Lexicon.merged(text_prep.server_lexicon(), text_prep.parse_lexicon(own, "lexicon"))
        except TTSError as e:
            await self._error(f"invalid session config: {_message(e)}")
            return False
        self.text_options = (lexicon, getattr(req, "read_numbers", None) is not False)
        self.config = cfg
        self.setup = (engine, voice, kw, fmt, stream_audio)
        chars = self.limits.max_text_chars if granularity == "none" else min(SENTENCE_CHARS,
                                                                               self.limits.max_text_chars)
        self.splitter = SentenceStream(granularity, chars)
        return True

    async def _queue(self, text: str) -> bool:
        if sum(1 for s in self.pending if s.total_sentences is None) >= MAX_PENDING:
            await self._error(f"too much text is waiting to be spoken ({MAX_PENDING} sentences); "
                              "send more after some audio has come back")
            return False
        engine, voice, kw, fmt, stream_audio = self.setup
        s = Sentence(self.utterance, self.sentence, text, engine, voice, kw, fmt, stream_audio)
        try:   # pause tags ([pause 0.5s], <break time="500ms"/>), the dictionary, numbers read out
            prep = text_prep.prepare(text, kw.get("language"), *self.text_options, ssml=True)
            s.say, s.lead_s = [(g.spoken, g.pause_s or 0.0) for g in prep.segments], prep.lead_s
        except TTSError as e:
            s.error = str(e)
        self.pending.append(s)
        self.sentence += 1
        await self._submit_ahead()
        self.changed.set()
        return True

    # --- the engine ----------------------------------------------------------------------------------------
    async def _submit_ahead(self) -> None:
        """Submit the first LOOKAHEAD sentences still waiting, in order."""
        async with self.submit_lock:
            ahead = [s for s in list(self.pending) if s.total_sentences is None][:LOOKAHEAD]
            for s in ahead:
                if s.busy and s.stream is None:
                    break                   # it waits in the busy line: nothing after it overtakes it
                if s.stream is None and s.error is None:
                    try:
                        s.stream = await run_in_threadpool(s.engine.stream, s.first, voice=s.voice, **s.kw)
                        if self.cancelled:
                            s.stream.cancel()
                    except EngineBusyError:
                        s.busy = True
                        break
                    except TTSError as e:
                        s.error = str(e)

    async def _wait_for_engine(self, s: Sentence) -> None:
        """Before `s` is spoken: while the engine's queue is full, wait in the busy line and submit it in turn;
        while it waits in the engine's queue, too. The client hears of its place ("busy") when it changes."""
        last = None

        async def tell(position: int) -> None:
            nonlocal last
            if position != last:
                last = position
                await self._send_json({"type": "busy", "utterance_index": s.utterance, "sentence_index": s.index,
                                       "position": position})

        if s.stream is None and s.busy and s.error is None:
            ticket = BUSY_LINE.join(s.engine)
            try:
                while not self.cancelled:
                    submit = lambda: s.engine.stream(s.first, voice=s.voice, **s.kw)
                    try:
                        s.stream = await run_in_threadpool(BUSY_LINE.try_submit, ticket, submit)
                    except TTSError as e:
                        s.error = str(e)
                        return
                    if s.stream is not None:
                        break
                    await tell(BUSY_LINE.ahead(ticket) + 1)
                    await asyncio.sleep(BUSY_POLL_S)
            finally:
                BUSY_LINE.leave(ticket)
            if s.stream is None:
                s.error = s.error or "the server is busy and the session ended while waiting"
                return
            if self.cancelled:
                s.stream.cancel()
        while s.stream is not None and (pos := getattr(s.stream, "position", None)) is not None \
                and not self.cancelled:
            await tell(pos + 1)
            await asyncio.sleep(BUSY_POLL_S)

    def _cancel_all(self) -> None:
        self.cancelled = True
        for s in list(self.pending):
            if s.stream is not None:
                s.stream.cancel()
        self.pending.clear()

    # --- speaking ------------------------------------------------------------------------------------------
    async def _speak_all(self) -> None:
        while True:
            while not self.pending:
                self.changed.clear()
                await self.changed.wait()
            s = self.pending[0]
            if s.total_sentences is not None:
                if s.total_sentences < 0:        # session.close marker
                    self.pending.popleft()
                    return
                await self._send_json({"type": "session.done", "utterance_index": s.utterance,
                                       "total_sentences": s.total_sentences})
                self.pending.popleft()
                continue
            await self._submit_ahead()
            await self._wait_for_engine(s)
            await self._speak(s)
            self.pending.popleft()
            await self._submit_ahead()

    async def _speak(self, s: Sentence) -> None:
        await self._send_json({"type": "audio.start", "utterance_index": s.utterance, "sentence_index": s.index,
                               "sentence_text": s.text, "format": s.fmt, "sample_rate": audio_formats.SAMPLE_RATE,
                               "channels": 1})
        total, failed, parts = 0, s.error is not None, []
        if s.error:
            await self._error(f"sentence {s.index}: {s.error}")
        else:
            first = True

            async def out(chunk):
                nonlocal first, total
                if not s.stream_audio:
                    parts.append(chunk)
                    return
                data = audio_formats.to_int16(chunk).tobytes()
                if first and s.fmt == "wav":
                    data = audio_formats.streaming_wav_header() + data
                first = False
                await self.ws.send_bytes(data)
                total += len(data)

            def silence(seconds: float):
                return np.zeros(int(round(seconds * audio_formats.SAMPLE_RATE)), np.float32)

            try:
                if s.lead_s:
                    await out(silence(s.lead_s))
                for k, (said, pause) in enumerate(s.say or [(s.text, 0.0)]):
                    stream = s.stream if k == 0 else await run_in_threadpool(s.engine.stream, said, voice=s.voice,
                                                                             **s.kw)
                    if k:
                        s.stream = stream   # (cancelled with the session)
                    while (chunk := await run_in_threadpool(next, stream, _DONE)) is not _DONE:
                        await out(chunk)
                    if pause:
                        await out(silence(pause))
            except TTSError as e:
                failed = True
                await self._error(f"sentence {s.index}: {e}")
            if not s.stream_audio and not failed:
                wav = np.concatenate(parts) if parts else np.zeros(0, np.float32)
                data = audio_formats.encode(wav, s.fmt)
                await self.ws.send_bytes(data)
                total += len(data)
        await self._send_json({"type": "audio.done", "utterance_index": s.utterance, "sentence_index": s.index,
                               "total_bytes": total, "error": failed})

    async def _send_json(self, obj: dict) -> None:
        await self.ws.send_text(json.dumps(obj, ensure_ascii=False))

    async def _error(self, message: str) -> None:
        try:
            await self._send_json({"type": "error", "message": message})
        except Exception:
            pass


def install(app: FastAPI, prepare, request_model, limits: Limits, slots=None) -> None:
    """Add `/v1/audio/speech/stream`. `prepare(request) -> (engine, voice)` resolves a /v1/audio/speech request
    the way the HTTP route does (role, checkpoint, voice); `request_model` is that route's request class; `slots`
    (openai_api.ClientSlots): an open socket takes one of its client's concurrent-request places."""

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket):
        client = ws.client.host if ws.client else "unknown"
        if slots is not None:
            try:
                slots.acquire(client)
            except Exception as e:   # too many at once from this client
                await ws.accept()
                await ws.send_text(json.dumps({"type": "error", "message": _message(e)}))
                await ws.close(code=1013)      # try again later
                return
        try:
            await SpeechSocket(ws, prepare, request_model, limits).run()
        finally:
            if slots is not None:
                slots.release(client)
