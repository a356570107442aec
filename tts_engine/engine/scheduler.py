"""Who runs this step: a bounded waiting queue, a set of running sequences, and free cache rows.

A `Sequence` is one request's life inside the engine: WAITING in the queue, RUNNING in a cache row,
then FINISHED (done, cancelled or failed). The scheduler is pure bookkeeping (no tensors): the worker asks
it which sequences to admit (prefill) before each frame and which are running (decode), and tells it when
one ends, which frees its row.
"""
from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from tts_engine.errors import EngineBusyError
from tts_engine.engine.request import Request

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


END = object()  # end-of-stream marker on a sequence's output queue


@dataclass(eq=False)  # identity semantics: a sequence is only equal to itself
class Sequence:
    request: Request
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    row: int | None = None
    out: queue.Queue = field(default_factory=queue.Queue)   # audio chunks (np.ndarray), an Exception, or END
    cancelled: threading.Event = field(default_factory=threading.Event)
    # worker-side state while running
    pending: list = field(default_factory=list)             # [(codes [16] device tensor, done [] device bool)]
    chunk_sizes: object = None
    target: int = 0                                         # frames of the current chunk (when it goes out)
    chunk_frames: int = 0                                   # the schedule's size of it (0: the first chunk)
    decoder_state: object = None
    finishing: bool = False                                 # end-of-speech seen in the current chunk
    codec_error: Exception | None = None                    # set by the codec thread when a decode failed

    def finish(self, item=END) -> None:
        self.status = Status.FINISHED
        if item is not END:
            self.out.put(item)
        self.out.put(END)


class Scheduler:
    def __init__(self, rows: int, max_waiting: int):
        self.free_rows = list(range(rows))[::-1]
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lock = threading.Lock()

    def add(self, seq: Sequence) -> None:
        with self.lock:
            if len(self.waiting) >= self.max_waiting:
                raise EngineBusyError("the server is busy: too many requests are waiting. Please try again "
                                      "in a moment.")
            self.waiting.append(seq)

    def position(self, seq: Sequence) -> int | None:
        """Requests ahead of `seq` in the queue (None once it runs)."""
        with self.lock:
            for i, s in enumerate(self.waiting):
                if s is seq:
                    return i
        return None

    def admit(self) -> list[Sequence]:
        """Waiting sequences that get a cache row now (FIFO), cancelled ones dropped."""
        out = []
        with self.lock:
            while self.waiting and self.free_rows:
                seq = self.waiting.popleft()
                if seq.cancelled.is_set():
                    seq.finish()
                    continue
                self.free_rows.sort(reverse=True)
                seq.row = self.free_rows.pop()          # the lowest free row: running rows stay dense
                seq.status = Status.RUNNING
                self.running.append(seq)
                out.append(seq)
        return out

    def release(self, seq: Sequence) -> None:
        with self.lock:
            if seq in self.running:
                self.running.remove(seq)
            if seq.row is not None:
                self.free_rows.append(seq.row)
                seq.row = None

    def compact(self) -> tuple[Sequence, int, int] | None:
        """If a running sequence sits above a free row, move it down (returns (seq, src, dst)); the runner
        then moves its state. Keeps running rows 0..B-1 so a batch bucket is a prefix of the cache."""
        with self.lock:
            if not self.running or not self.free_rows:
                return None
            top = max(self.running, key=lambda s: s.row)
            low = min(self.free_rows)
            if low > top.row:
                return None
            self.free_rows.remove(low)
            self.free_rows.append(top.row)
            src, top.row = top.row, low
            return top, src, low

    def idle(self) -> bool:
        with self.lock:
            return not self.waiting and not self.running

    def counts(self) -> dict[str, int]:
        """{"running", "waiting", "max_waiting", "rows"}: how full this scheduler is right now."""
        with self.lock:
            return {"running": len(self.running), "waiting": len(self.waiting), "max_waiting": self.max_waiting,
                    "rows": len(self.running) + len(self.free_rows)}

    def drain_waiting(self) -> list[Sequence]:
        with self.lock:
            out = list(self.waiting)
            self.waiting.clear()
            return out
