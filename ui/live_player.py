"""The live player's server side: per-token slots that carry raw PCM from a Gradio handler to the page.

The page (assets/live_player.js) makes a random token inside the Generate click, starts
`fetch("live/<token>?session=<gradio session hash>")` at once and hands the same token to the Gradio event
(as its last input). The Gradio handler opens the slot for (token, session) and writes int16 chunks into it
(`LiveSink.write`); the route streams them as raw 24 kHz mono PCM, int16 little-endian, as soon as the first
chunk exists. Whichever of the two arrives first creates the slot.

Who may read a stream. The token is the secret: 128 random bits made in the page (`crypto.getRandomValues`,
which, unlike `crypto.randomUUID`, exists on plain HTTP too), sent only to this server, single use (a token that
was opened once is never opened again) and short lived (a slot nobody reads expires). It is also bound to the
Gradio session on the handler side: the handler opens it with `request.session_hash`, and the route must present
the same session hash (`?session=`, which the page reads from `window.__gradio_session_hash__`). The session
hash alone is no secret worth the name (the page makes it and sends it with every request), so it does not
replace the token; it makes a token that leaked afterwards (it appears in access logs as part of the URL)
useless to another page, and a token handed to the wrong session's handler is refused instead of streamed.
Every refusal answers 404 (no slot for you) except a second reader of one's own stream (409), so the route does
not tell a stranger whether a token exists.

Lifetime. A slot lives from whichever side arrives first until the reader has read everything the handler wrote
(or either side gave up). The route waits at most `handler_wait_s` for the handler (the Gradio queue may hold
the event for a while), the handler's data waits at most `reader_wait_s` for a reader. A slot holds at most
`max_buffer_s` of unread audio; a writer that gets ahead of its reader by more waits (backpressure) for at most
`write_block_s`, then the slot is cancelled. A reader that goes away (fetch aborted, tab closed or reloaded)
cancels the slot; the handler sees `sink.cancelled` and stops its engine request. Nothing is left in the
registry afterwards (`len(streams) == 0`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

log = logging.getLogger("qwen3_tts_live.live")

SR = 24000
BYTES_PER_SAMPLE = 2
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{22,64}$")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
JS_FILES = {"player.js": "live_player.js", "worklet.js": "live_player_worklet.js"}


class LiveRefused(Exception):
    """The route may not stream this token: `status` is the HTTP status to answer."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class _Slot:
    """One token's stream. All fields are guarded by `LiveStreams._lock` (shared with `cond`)."""

    def __init__(self, token: str, session: str, cond: threading.Condition, now: float):
        self.token = token
        self.session = session
        self.cond = cond                     # writers wait on it for room (backpressure)
        self.created = now
        self.chunks: deque[bytes] = deque()
        self.buffered = 0                    # unread bytes
        self.written = 0                     # bytes written in all
        self.has_writer = False              # the handler has opened it
        self.has_reader = False              # a route is reading (or waiting to read) it
        self.writer_done = False             # the handler closed it: no more data
        self.cancelled = False               # the reader went away or the slot expired: stop generating
        self.refused = False                 # the handler's session did not match the route's
        self.failed: str | None = None       # the click's run ended without opening it (its error, or "")
        self.first_write: float | None = None
        self.last_write: float | None = None
        self.expected_s: float | None = None
        self.chunks_s: list[float] | None = None   # audio seconds of the stream's first chunks, as the engine makes them
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    # called with the lock held
    def wake_reader(self) -> None:
        if self._wake is not None:
            loop, ev = self._wake
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:             # the loop is closed: the reader is gone
                pass


class LiveSink:
    """The handler's end of a slot: `write(pcm_int16)`, `close()`, `cancelled`. A context manager."""

    def __init__(self, streams: "LiveStreams", slot: _Slot):
        self._streams = streams
        self._slot = slot

    @property
    def token(self) -> str:
        return self._slot.token

    @property
    def cancelled(self) -> bool:
        with self._streams._lock:
            self._streams._expire_locked(time.monotonic())
            return self._slot.cancelled

    def write(self, pcm) -> None:
        """Append int16 samples (a numpy array, or bytes already int16 LE). Blocks while the reader is more than
        `max_buffer_s` behind; a no-op once the slot is cancelled."""
        data = pcm if isinstance(pcm, (bytes, bytearray)) else np.asarray(pcm).astype("<i2", copy=False).tobytes()
        if not data:
            return
        s, st = self._slot, self._streams
        with st._lock:
            deadline = time.monotonic() + st.write_block_s
            while not s.cancelled and s.buffered + len(data) > st.max_buffer_bytes and s.buffered > 0:
                now = time.monotonic()
                st._expire_locked(now)
                if now >= deadline:
                    log.info("live stream %s…: the reader fell %.0f s behind; cancelled", s.token[:6],
                             s.buffered / BYTES_PER_SAMPLE / SR)
                    st._cancel_locked(s)
                    break
                s.cond.wait(min(0.5, deadline - now))
            if s.cancelled or s.writer_done:
                return
            now = time.monotonic()
            s.first_write = s.first_write or now
            s.last_write = now
            s.chunks.append(bytes(data))
            s.buffered += len(data)
            s.written += len(data)
            s.wake_reader()

    def close(self) -> None:
        """No more data. The slot stays until its reader has read the rest (or `reader_wait_s` passed)."""
        st, s = self._streams, self._slot
        with st._lock:
            if s.writer_done:
                return
            s.writer_done = True
            st._learn_rate_locked(s)
            s.wake_reader()
            s.cond.notify_all()
            # a slot nobody reads yet stays for its reader until `reader_wait_s` (then `_expire_locked`)

    def __enter__(self) -> "LiveSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LiveStreams:
    """Registry of live slots, shared by the Gradio handlers (threads) and the route (the server's event loop)."""

    def __init__(self, handler_wait_s: float = 300.0, reader_wait_s: float = 30.0, max_buffer_s: float = 60.0,
                 write_block_s: float = 30.0, spent_ttl_s: float = 3600.0, poll_s: float = 0.25):
        self.handler_wait_s = handler_wait_s
        self.reader_wait_s = reader_wait_s
        self.max_buffer_bytes = int(max_buffer_s * SR) * BYTES_PER_SAMPLE
        self.write_block_s = write_block_s
        self.spent_ttl_s = spent_ttl_s
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._spent: dict[str, float] = {}    # token -> when it was opened by a handler (single use)
        self._failed: dict[str, tuple[float, str]] = {}   # token -> (when, why): its run ended without a stream
        self.rate: float | None = None        # audio seconds generated per wall second, recent streams (EMA)

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked(time.monotonic())
            return len(self._slots)

    # --- handler side ------------------------------------------------------------------------------------
    def open(self, token: str | None, session: str | None, expected_seconds: float | None = None,
             chunks_s: list[float] | None = None) -> LiveSink | None:
        """The Gradio handler's end of `token`, bound to its `session` (gr.Request.session_hash). None when
        there is no token (gradio_client callers) or it may not be used (malformed, spent, another session's):
        the handler then generates without a live stream. `expected_seconds`: the audio's rough length;
        `chunks_s`: the audio seconds of the stream's first chunks as they will be written (the player's start
        rule uses them to know when the next chunk is due)."""
        token = (token or "").strip()
        if not token:
            return None
        if not TOKEN_RE.match(token):
            log.warning("live stream: malformed token ignored")
            return None
        session = session or ""
        now = time.monotonic()
        with self._lock:
            self._expire_locked(now)
            if token in self._spent:
                log.warning("live stream: token reused; ignored")
                return None
            self._spent[token] = now
            s = self._slots.get(token)
            if s is None:
                s = self._slots[token] = _Slot(token, session, threading.Condition(self._lock), now)
            elif s.session != session:       # the route that came first claimed another session
                s.refused = True
                s.wake_reader()
                self._drop_locked(s)
                log.warning("live stream: token used by another session; refused")
                return None
            s.has_writer = True
            s.expected_s = expected_seconds
            s.chunks_s = list(chunks_s) if chunks_s else None
            s.wake_reader()
            return LiveSink(self, s)

    def abandon(self, token: str | None, reason: str = "") -> None:
        """The click's run ended without opening its stream (it failed its input checks, say): a route waiting
        for it, now or later, answers at once (422 with `reason`, or 404) instead of waiting `handler_wait_s`."""
        token = (token or "").strip()
        if not token or not TOKEN_RE.match(token):
            return
        with self._lock:
            s = self._slots.get(token)
            if s is not None and s.has_writer:
                return
            self._failed[token] = (time.monotonic(), reason)
            if s is not None:
                s.failed = reason
                s.wake_reader()

    # --- route side --------------------------------------------------------------------------------------
    async def attach(self, token: str, session: str, disconnected=None) -> _Slot:
        """Become the reader of `token`; returns once the handler has written its first chunk (or closed).
        `disconnected`: an async callable, polled while waiting. Raises LiveRefused."""
        if not TOKEN_RE.match(token or ""):
            raise LiveRefused(404, "no such stream")
        session = session or ""
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        now = time.monotonic()
        with self._lock:
            self._expire_locked(now)
            s = self._slots.get(token)
            if s is None:
                if token in self._failed:
                    raise self._failure(self._failed[token][1])
                if token in self._spent:
                    raise LiveRefused(404, "no such stream")
                s = self._slots[token] = _Slot(token, session, threading.Condition(self._lock), now)
            elif s.session != session:
                raise LiveRefused(404, "no such stream")
            elif s.has_reader:
                raise LiveRefused(409, "this stream already has a reader")
            s.has_reader = True
            s.created = now if not s.has_writer else s.created
            s._wake = (loop, ev)
        deadline = now + self.handler_wait_s
        try:
            while True:
                with self._lock:
                    if s.refused:
                        raise LiveRefused(404, "no such stream")
                    if s.failed is not None and not s.has_writer:
                        self._drop_locked(s)
                        raise self._failure(s.failed)
                    if s.cancelled:
                        raise LiveRefused(404, "the stream was cancelled")
                    if s.has_writer and (s.chunks or s.writer_done):
                        return s
                    ev.clear()
                    if not s.has_writer and time.monotonic() >= deadline:
                        self._drop_locked(s)
                        raise LiveRefused(404, "no such stream (no generation started for it)")
                await self._wait(ev)
                if disconnected is not None and await disconnected():
                    raise LiveRefused(499, "the client went away")
        except BaseException:
            with self._lock:
                self._cancel_locked(s)
            raise

    @staticmethod
    def _failure(reason: str) -> LiveRefused:
        return LiveRefused(422, reason) if reason else LiveRefused(404, "no stream for this click")

    async def _wait(self, ev: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(ev.wait(), self.poll_s)
        except asyncio.TimeoutError:
            pass

    async def read(self, s: _Slot):
        """Yields the slot's bytes as they come; ends when the handler closed it and all was read. Leaving
        early (the client went away: the server cancels this generator, or the next send fails) cancels the
        slot."""
        _, ev = s._wake
        finished = False
        try:
            while True:
                with self._lock:
                    data = b"".join(s.chunks)
                    s.chunks.clear()
                    s.buffered = 0
                    s.cond.notify_all()
                    done = s.writer_done and not data
                    if s.cancelled and not data:
                        return
                    ev.clear()
                if data:
                    yield data
                    continue
                if done:
                    finished = True
                    return
                await self._wait(ev)
        finally:
            with self._lock:
                if finished:
                    self._drop_locked(s)
                else:
                    self._cancel_locked(s)

    def headers(self, s: _Slot) -> dict:
        h = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
             "X-Live-Sample-Rate": str(SR), "X-Live-Format": "s16le"}
        with self._lock:
            if self.rate:
                h["X-Live-Rate"] = f"{self.rate:.3f}"
            if s.expected_s:
                h["X-Live-Expected-Seconds"] = f"{s.expected_s:.2f}"
            if s.chunks_s:
                h["X-Live-Chunks"] = ",".join(f"{x:.3f}" for x in s.chunks_s)
        return h

    # --- bookkeeping (lock held) ---------------------------------------------------------------------
    def _cancel_locked(self, s: _Slot) -> None:
        if not s.cancelled:
            s.cancelled = True
            s.chunks.clear()
            s.buffered = 0
        s.cond.notify_all()
        s.wake_reader()
        self._drop_locked(s)

    def _drop_locked(self, s: _Slot) -> None:
        if self._slots.get(s.token) is s:
            del self._slots[s.token]
        if s.has_writer or s.has_reader:
            self._spent.setdefault(s.token, time.monotonic())

    def _expire_locked(self, now: float) -> None:
        for s in list(self._slots.values()):
            if s.has_writer and not s.has_reader and now - s.created > self.reader_wait_s:
                log.info("live stream %s…: nobody came to read it; cancelled", s.token[:6])
                self._cancel_locked(s)
        for t, when in list(self._spent.items()):
            if now - when > self.spent_ttl_s:
                del self._spent[t]
        for t, (when, _) in list(self._failed.items()):
            if now - when > self.spent_ttl_s:
                del self._failed[t]

    def _learn_rate_locked(self, s: _Slot) -> None:
        if s.first_write is None or s.last_write is None:
            return
        wall = s.last_write - s.first_write
        audio = s.written / BYTES_PER_SAMPLE / SR
        if wall > 0.2 and audio > 0.5:
            r = audio / wall        # quick to believe a slower stream, slow to believe a faster one
            self.rate = r if self.rate is None or r < self.rate else 0.7 * self.rate + 0.3 * r


MAX_FORM_BYTES = 1 << 20   # the form values a POST may carry


def install(app, streams: LiveStreams, prefix: str = "/live", starter=None) -> LiveStreams:
    """Add `GET {prefix}/{token}?session=…` (the PCM stream) and the player's JS files
    (`{prefix}/player.js`, `{prefix}/worklet.js`) to a FastAPI app. Call before mounting Gradio at `/`.
    With `starter` (ui.early_start.EarlyStarts) also `POST {prefix}/{token}?session=…&api=<endpoint>` with the
    click's form values as JSON `{"data": [...]}`: it starts the generation at once and streams the same PCM (or,
    when the Gradio event came first and started it, streams that run's). When the starter declines and the
    Gradio event has not come yet, it answers `202 {"started": false, "why": …}` at once: the page then sends the
    Gradio event (which it holds until its first audio, see assets/live_player.js) and reads with a GET."""
    for route_name, file in JS_FILES.items():
        path = ASSETS / file

        def serve_js(path=path):
            return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

        app.add_api_route(f"{prefix}/{route_name}", serve_js, methods=["GET"], include_in_schema=False)

    async def live(token: str, request: Request, session: str = ""):
        async def disconnected() -> bool:
            return await request.is_disconnected()

        try:
            slot = await streams.attach(token, session, disconnected)
        except LiveRefused as e:
            return JSONResponse({"error": str(e)}, status_code=e.status if e.status != 499 else 400,
                                headers={"Cache-Control": "no-store"})
        # once streaming, Starlette notices a client that went away and cancels `read` (its finally cancels the
        # slot); polling `request.is_disconnected()` there as well would compete with it for `receive`
        return StreamingResponse(streams.read(slot), media_type="application/octet-stream",
                                 headers=streams.headers(slot))

    async def live_start(token: str, request: Request, session: str = "", api: str = ""):
        if starter is not None and TOKEN_RE.match(token or ""):
            body = await request.body()
            data = None
            if len(body) <= MAX_FORM_BYTES:
                try:
                    data = json.loads(body or b"{}").get("data")
                except (ValueError, AttributeError):
                    data = None
            started, why = starter.start(api, token, session, data)
            if not started:
                log.info("live stream %s…: not started early (%s); waiting for the Gradio event", token[:6], why)
                if not starter.known(token):     # the event must start it: tell the page now (it holds the event)
                    return JSONResponse({"started": False, "why": why}, status_code=202,
                                        headers={"Cache-Control": "no-store"})
        return await live(token, request, session)

    app.add_api_route(prefix + "/{token}", live, methods=["GET"], include_in_schema=False)
    app.add_api_route(prefix + "/{token}", live_start, methods=["POST"], include_in_schema=False)
    return streams


# --- the page's side, for gr.mount_gradio_app(..., head=HEAD) and the generating events ---------------------
# Loads the player (a classic script: it finds the route next to its own URL).
HEAD = '<script src="live/player.js"></script>'
# `js=` of a generating event: the token made by this click replaces the event's last input (a hidden Textbox).
# Without the player (a script blocker, gradio_client) the input stays "" and the handler streams nowhere.
TOKEN_JS = ("(...args) => { if (args.length) args[args.length - 1] = window.liveTTS ? window.liveTTS.takeToken() : '';"
            " return args; }")


def token_js(api: str) -> str:
    """`js=` of a generating event whose generation the player's own request may start (ui/early_start.py): the
    player gets the event's form values (`args`, the last one the token's place) with the endpoint's name and
    sends them with its stream request. The token comes back as a promise: Gradio sends the event once the player
    has the first audio (it keeps the page's main thread and the server free for the first chunk)."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", api):
        raise ValueError(f"bad endpoint name {api!r}")
    return ("async (...args) => { if (args.length) args[args.length - 1] = window.liveTTS ? "
            f"await window.liveTTS.takeToken(args.slice(0, -1), '{api}') : ''; return args; }}")
# `js=` of a JS-only `.then()` after a generating event: tells the player that the server side is over (a run
# that never got its stream, e.g. the handler refused the input, stops waiting).
DONE_JS = "() => { if (window.liveTTS) window.liveTTS.serverDone(); }"


def after_event(event) -> None:
    """Tell the page's player when a generating event is over, whether it succeeded or failed (Gradio 6.31 runs a
    `.then()` only after a success; `.failure()` after an error)."""
    event.then(None, js=DONE_JS)
    event.failure(None, js=DONE_JS)


# Classes that the player's click listener looks for.
GENERATE_CLASS = "live-generate"
STOP_CLASS = "live-stop"
# Where the player writes "buffering… / playing · click → sound N ms" (a gr.HTML with this element).
STATUS_HTML = '<div id="live-player-status" aria-live="polite"></div>'


def expected_seconds(text: str) -> float:
    """A rough duration of `text` spoken (for the player's buffering decision when generation is slower than
    playback): ~14 characters a second for alphabetic scripts, ~4.5 for CJK."""
    cjk = sum(1 for ch in text if "\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af")
    return (len(text) - cjk) / 14.0 + cjk / 4.5
