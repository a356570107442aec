"""A click starts its generation as soon as the server hears of it: from the page player's own stream request
(`POST /live/{token}`, which carries the click's form values) or from the Gradio event, whichever arrives first.
The other one attaches: the stream request reads the audio, the Gradio event reports (status line, final WAV).

One code path. Every generating handler (`/preset`, `/design`, `/blend`, `/clone`) runs as a `Run`: a thread
that drives the handler's generator (the same function Gradio calls, with the same input checks) and keeps its
updates; the Gradio event relays them (`attachable`), adding "Loading the … model" progress while the handler
waits for a model that still loads in the background. When the stream request came first, it turned the form
values into the handler's arguments exactly as Gradio would (`Component.preprocess` of the session's copy of
each input, `gr.State` values from the session) and started the Run; the Gradio event that follows finds the
Run by its token (and session) and only relays it. Validation errors reach the page through the Gradio event as
usual (the stream request answers 422 with the same message).

When the stream request may not start a generation it tells the page so at once (202), and the page reads the run
the Gradio event starts with a plain GET (as without early start): a form value
that needs Gradio's file handling (an uploaded clip or voice file), more runs in flight than the app runs at
once, a second run of the same session, or early start switched off (ZeroGPU, where generation must run inside
the Gradio event)."""
from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import threading
import time

import gradio as gr

log = logging.getLogger("qwen3_tts_live.early")

# input components whose values the stream request may carry (plain JSON values)
PLAIN = (gr.Textbox, gr.Dropdown, gr.Number, gr.Slider, gr.Checkbox, gr.Radio, gr.State)
# and those allowed only while empty (their values need Gradio's upload cache)
EMPTY_ONLY = (gr.File, gr.Audio)


class Run:
    """One click's generation: a thread that drives the handler's generator and keeps its updates for the relay."""

    def __init__(self, token: str, session: str, api: str, by: str):
        self.token, self.session, self.api, self.by = token, session, api, by
        self.created = time.monotonic()
        self.cond = threading.Condition()
        self.items: list[dict] = []          # updates not yet relayed (runs of plain updates merged)
        self.done = False
        self.error: BaseException | None = None
        self.cancelled = False
        self.attached = by == "event"        # the Gradio event relays it
        self.finished_at: float | None = None
        self.thread: threading.Thread | None = None

    def push(self, update: dict, streaming: set) -> None:
        """Keep `update`; plain updates merge into the last one (only the newest status/WAV matter), updates with
        a streaming output (Gradio's own live audio: every chunk counts) stay separate."""
        with self.cond:
            streams = any(k in streaming for k in update)
            if self.items and not streams and not self.items[-1].get("__streams__"):
                self.items[-1].update(update)
            else:
                self.items.append({**update, "__streams__": True} if streams else dict(update))
            self.cond.notify_all()

    def take(self, timeout: float) -> list[dict]:
        with self.cond:
            if not self.items and not self.done:
                self.cond.wait(timeout)
            items, self.items = self.items, []
        return [{k: v for k, v in it.items() if k != "__streams__"} for it in items]

    def finish(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.error = error
            self.done = True
            self.finished_at = time.monotonic()
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True


class EarlyStarts:
    """The runs of generating clicks, by token. `attachable(api, fn, inputs)` wraps a handler for Gradio;
    `start(api, token, session, data)` is the stream request's side."""

    def __init__(self, c, status, loader, live, max_runs: int = 4, enabled: bool = True, keep_s: float = 300.0,
                 relay_every_s: float = 0.1):
        self.c, self.status, self.loader, self.live = c, status, loader, live
        self.max_runs, self.enabled, self.keep_s, self.relay_every_s = max_runs, enabled, keep_s, relay_every_s
        self.demo = None
        self._apis: dict[str, tuple] = {}     # api name -> (handler, input components)
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._seen: dict[str, float] = {}     # every token a run was made for (single use), with its time

    def bind(self, demo) -> None:
        """The built page (its session states: `demo.state_holder`, set when Gradio is mounted)."""
        self.demo = demo

    def __len__(self) -> int:
        with self._lock:
            self._prune_locked(time.monotonic())
            return len(self._runs)

    # --- the Gradio side ----------------------------------------------------------------------------------
    def attachable(self, api: str, fn, inputs: list):
        """`fn` (a generating handler whose last inputs are `live_token` then `request`) as Gradio calls it: it
        relays the run the stream request started for this click, or starts one and relays it."""
        sig = inspect.signature(fn)
        self._apis[api] = (fn, list(inputs))

        @functools.wraps(fn)
        def handler(*args, **kwargs):
            if not self.enabled:
                yield from fn(*args, **kwargs)
                return
            b = sig.bind(*args, **kwargs)
            token = str(b.arguments.get("live_token") or "").strip()
            session = getattr(b.arguments.get("request"), "session_hash", None) or ""
            run = self._claim(token, session, api) if token else None
            if run is None:                      # nothing started for this click: start it here
                if token and self._taken(token):
                    # a run of another session (or endpoint) has this token: ours gets no live stream
                    log.warning("a click's token belongs to another run; generating without a live stream")
                    token = b.arguments["live_token"] = ""
                run = Run(token, session, api, by="event")
                self._drive(run, lambda: fn(*b.args, **b.kwargs), contextvars.copy_context())
            yield from self.relay(run)

        return handler

    def relay(self, run: Run):
        """Yield the run's updates as they come (at most one every `relay_every_s`), with "Loading the … model"
        progress while its handler waits for a model; raise its error at the end."""
        try:
            last_loading = ""
            while True:
                items = run.take(0.25)
                for it in items:
                    yield it
                if not items and not run.done:
                    job = self.loader.waiting_for(run.thread.ident if run.thread else None)
                    if job is not None and job.busy:
                        text = job.describe()
                        if text != last_loading:
                            last_loading = text
                            yield {self.c.status: self.status(text + "; your request starts when it is ready",
                                                              role=job.role)}
                    continue
                if run.done and not run.items:
                    break
                if items and self.relay_every_s:
                    time.sleep(self.relay_every_s)
            if run.error is not None:
                raise run.error
        finally:
            run.cancel()
            with self._lock:
                if self._runs.get(run.token) is run and run.done:
                    del self._runs[run.token]

    # --- the stream request's side ------------------------------------------------------------------------
    def start(self, api: str, token: str, session: str, data) -> tuple[bool, str]:
        """Start the click's run from the form values `data` (the Gradio event's inputs, without the token).
        -> (started, why not). Not started: the stream request waits for the Gradio event instead."""
        if not self.enabled:
            return False, "early start is off"
        if api not in self._apis:
            return False, f"unknown endpoint {api!r}"
        fn, inputs = self._apis[api]
        if not isinstance(data, list) or len(data) != len(inputs) - 1:
            return False, "the form values do not match the endpoint"
        for comp, v in zip(inputs, data):
            if not isinstance(comp, PLAIN) and not (isinstance(comp, EMPTY_ONLY) and v in (None, "", [])):
                return False, f"{type(comp).__name__} values need Gradio's upload handling"
        now = time.monotonic()
        with self._lock:
            self._prune_locked(now)
            if token in self._seen or self._taken(token):
                return False, "this click's run exists already"
            mine = [r for r in self._runs.values() if r.by == "route" and not r.done]
            if len(mine) >= self.max_runs:
                return False, "as many runs in flight as the app runs at once"
            if any(r.session == session for r in mine):
                return False, "this session has a run in flight"
            run = Run(token, session, api, by="route")
            self._runs[token] = run
            self._seen[token] = now
        request = gr.Request(session_hash=session)
        try:
            args = self._arguments(inputs[:-1], data, session)
        except Exception as e:                 # Gradio's own checks of a value (a number out of bounds...)
            run.finish(e if isinstance(e, gr.Error) else gr.Error(str(e)))
            self.live.abandon(token, str(e))
            return True, ""
        self._drive(run, lambda: fn(*args, token, request=request), None)
        return True, ""

    def _arguments(self, inputs: list, data: list, session: str) -> list:
        """The handler's arguments from raw form values, as Gradio makes them: each input's `preprocess` (the
        session's copy of the component), `gr.State` values from the session."""
        holder = getattr(self.demo, "state_holder", None)
        state = holder[session] if holder is not None and session else None
        out = []
        for comp, raw in zip(inputs, data):
            block = state[comp._id] if state is not None else comp
            if comp.stateful:
                out.append(block if state is not None else None)
            else:
                out.append(block.preprocess(raw))
        return out

    # --- both sides ---------------------------------------------------------------------------------------
    def _claim(self, token: str, session: str, api: str) -> Run | None:
        """The Gradio event's side: the run the stream request started for this click (same session and
        endpoint), else None after marking the token as the event's (a stream request that comes later then
        only reads)."""
        with self._lock:
            run = self._runs.get(token)
            if run is not None and run.by == "route" and run.session == session and run.api == api \
                    and not run.attached:
                run.attached = True
                return run
            if run is None and token not in self._seen:
                self._seen[token] = time.monotonic()
            return None

    def known(self, token: str) -> bool:
        """A run exists, or existed, for `token` (the Gradio event came first, or a stream request started it)."""
        with self._lock:
            return token in self._runs or token in self._seen

    def _taken(self, token: str) -> bool:
        """A run other than a fresh one of the event exists (or existed) for `token`."""
        return token in self._runs

    def _drive(self, run: Run, make_gen, ctx) -> None:
        streaming = {self.c.live} if hasattr(self.c, "live") else set()

        def drive():
            gen = None
            err = None
            try:
                gen = make_gen()
                for update in gen:
                    if isinstance(update, dict):
                        run.push(update, streaming)
                    if run.cancelled:       # the Gradio event went away (cancelled): stop generating
                        break
            except Exception as e:
                err = e
            finally:
                if gen is not None:
                    gen.close()
                run.finish(err)
                # a stream request still waiting for this click's audio stops waiting (nothing will come)
                self.live.abandon(run.token, str(err) if err else "")

        t = threading.Thread(target=(lambda: ctx.run(drive)) if ctx is not None else drive,
                             name=f"run-{run.api}", daemon=True)
        run.thread = t
        if run.by == "event" and run.token:
            with self._lock:
                self._runs.setdefault(run.token, run)
        t.start()

    def _prune_locked(self, now: float) -> None:
        for tok, r in list(self._runs.items()):
            if r.done and (r.attached or now - (r.finished_at or now) > self.keep_s):
                del self._runs[tok]
            elif not r.done and not r.attached and r.by == "route" and now - r.created > 3600:
                del self._runs[tok]
        for tok, when in list(self._seen.items()):
            if now - when > 3600:
                del self._seen[tok]
