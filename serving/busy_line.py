"""The line outside a full engine queue, for the page and the speech WebSocket: a listener there is told "busy,
position N" and waits instead of failing (the HTTP API answers 503 with `Retry-After` instead).

An engine's queue holds `max_waiting` requests (`TTS_MAX_QUEUE`); a submission beyond it raises `EngineBusyError`.
Callers turned away take a ticket in this line (one line per engine, in arrival order) and retry in turn: only the
first ticket of a line submits, so nobody who came later overtakes. A caller's position counts the requests in the
engine's queue and the tickets ahead of it.

    ticket = LINE.join(engine)
    try:
        while (stream := LINE.try_submit(ticket, submit)) is None:
            show(f"busy, position {LINE.ahead(ticket) + 1}"); sleep(poll)
    finally:
        LINE.leave(ticket)
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from tts_engine import EngineBusyError

_numbers = itertools.count()


@dataclass(eq=False)
class Ticket:
    engine: object
    number: int = field(default_factory=lambda: next(_numbers))


class BusyLine:
    def __init__(self):
        self._lock = threading.Lock()
        self._lines: dict[int, list[Ticket]] = {}

    def join(self, engine) -> Ticket:
        t = Ticket(engine)
        with self._lock:
            self._lines.setdefault(id(engine), []).append(t)
        return t

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            line = self._lines.get(id(ticket.engine), [])
            if ticket in line:
                line.remove(ticket)
            if not line:
                self._lines.pop(id(ticket.engine), None)

    def ahead(self, ticket: Ticket) -> int:
        """Requests ahead of `ticket`: those in its engine's queue, and the tickets before it in this line."""
        state = ticket.engine.load_state() if hasattr(ticket.engine, "load_state") else {}
        with self._lock:
            line = self._lines.get(id(ticket.engine), [])
            before = line.index(ticket) if ticket in line else 0
        return int(state.get("waiting", 0)) + before

    def try_submit(self, ticket: Ticket, submit):
        """`submit()` if `ticket` is first in its line -> its result; None while it is not first or the engine's
        queue is still full."""
        with self._lock:
            line = self._lines.get(id(ticket.engine), [])
            if not line or line[0] is not ticket:
                return None
        try:
            return submit()
        except EngineBusyError:
            return None

    def __len__(self) -> int:
        with self._lock:
            return sum(len(x) for x in self._lines.values())


LINE = BusyLine()   # the process's one line per engine (the page and the WebSocket share it)
