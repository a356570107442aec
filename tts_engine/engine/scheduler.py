"""Who runs this step: a bounded waiting queue, a set of running sequences, and free cache rows.

A `Sequence` is one request's life inside the engine: WAITING in the queue, RUNNING in a cache row,
then FINISHED (done, cancelled or failed). The scheduler is pure bookkeeping (no tensors): the worker asks
it which sequences to admit (prefill) before each frame and which are running (decode), and tells it when
one ends, which frees its row.

Playback deadlines. Each sequence's output queue notes every audio chunk handed out (`AudioQueue`), so the
scheduler knows what its listener holds: the audio emitted minus what has played since the first chunk (a
listener's player that runs dry waits, as `bench/continuity.py`'s does). A sequence's *deadline* is the moment
its listener runs out of audio: for one that has emitted nothing yet, its arrival (plus `lead_s`, audio the
listener still holds from before, e.g. the previous sentence). The queue is kept in deadline order, and where a
step must choose (whose chunk decodes first) `by_deadline` puts the least audio held first.

Honest admission (`admission="realtime"`). The scheduler times the worker's steps itself (the time between two
`admit` calls is one whole step: the frame of every running row, the chunks it cut, their decode) per batch size
(`FrameTimes`). A waiting request joins the running batch only when the step estimated for one more row still
keeps every stream at `min_pace` x real time and every running listener holds enough audio to ride out the new
request's prefill (also measured); otherwise it waits, and it is admitted as soon as that holds (a stream ends,
buffers grow). With nothing running the head of the queue is always admitted. `admission="rows"`: a request
joins whenever a row is free (the engine's default: benchmarks measure N streams at once).
"""
from __future__ import annotations

import bisect
import itertools
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tts_engine.errors import EngineBusyError
from tts_engine.engine.request import Request

_ids = itertools.count()
SAMPLE_RATE = 24000          # of the audio chunks on a sequence's output queue
FRAME_S = 0.08               # audio seconds each step adds to every running sequence (12.5 Hz codec frames)
ADMISSIONS = ("rows", "realtime")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


END = object()  # end-of-stream marker on a sequence's output queue


class CancelFlag(threading.Event):
    """A sequence's cancel flag: a `threading.Event` whose `set` also calls `on_set()` (the scheduler's count of
    cancellations, set when the sequence is queued), so the worker looks for cancelled rows only at a step after
    one was cancelled, not at every row every step."""

    def __init__(self):
        super().__init__()
        self.on_set = None

    def set(self) -> None:
        super().set()
        hook = self.on_set
        if hook is not None:
            hook()


class AudioQueue(queue.SimpleQueue):
    """A sequence's output queue: `put` of an audio chunk (a float32 array) also calls `on_audio(samples)`, so the
    scheduler sees every chunk as it is handed out, whichever thread decoded it. Unbounded, one reader: a
    `queue.SimpleQueue` (`put`, `get`, `get_nowait`, `empty`, `qsize`), whose put costs a fraction of a
    `queue.Queue`'s (no condition variables): a step that emits for many streams puts one chunk on each."""

    def __init__(self):
        super().__init__()
        self.on_audio = None

    def put(self, item, block=True, timeout=None):
        if self.on_audio is not None and isinstance(item, np.ndarray):
            self.on_audio(int(item.shape[0]))
        super().put(item, block, timeout)


@dataclass(eq=False)  # identity semantics: a sequence is only equal to itself
class Sequence:
    request: Request
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    row: int | None = None
    out: AudioQueue = field(default_factory=AudioQueue)     # audio chunks (np.ndarray), an Exception, or END
    cancelled: threading.Event = field(default_factory=CancelFlag)
    # worker-side state while running
    pending: list = field(default_factory=list)             # frames of the current chunk where a tool steps the
                                                            # chunk rule itself (the worker keeps its own buffer)
    chunk_sizes: object = None
    target: int = 0                                         # frames of the current chunk (when it goes out)
    chunk_frames: int = 0                                   # the schedule's size of it (0: the first chunk)
    chunk_end: int = 0                                      # the worker's frame at which it ends (once chunk_frames)
    decoder_state: object = None
    finishing: bool = False                                 # end-of-speech seen in the current chunk
    codec_error: Exception | None = None                    # set by the codec thread when a decode failed
    # the listener's playback clock (scheduler clock seconds; see the module's doc)
    lead_s: float = 0.0                                     # audio the listener holds from before this request
    submitted: float | None = None
    admitted: float | None = None
    first_out: float | None = None                          # when the first chunk was handed out
    emitted_s: float = 0.0                                  # audio handed out so far
    stalled_s: float = 0.0                                  # time the listener's player waited, dry

    def finish(self, item=END) -> None:
        self.status = Status.FINISHED
        if item is not END:
            self.out.put(item)
        self.out.put(END)

    def deadline(self) -> float:
        """When this sequence's listener runs out of audio (scheduler clock): its first chunk is due at its
        arrival (+ `lead_s`); after that, when the audio handed out so far has played."""
        if self.first_out is None:
            return (self.submitted or 0.0) + self.lead_s
        return self.first_out + self.stalled_s + self.emitted_s

    def held(self, now: float) -> float:
        """Audio seconds the listener holds at `now` (negative: it has been waiting that long)."""
        return self.deadline() - now

    def note_audio(self, seconds: float, now: float) -> None:
        """A chunk of `seconds` handed out at `now`: the player runs from the first chunk on, and waits (stalls)
        whenever it has played everything it got."""
        if self.first_out is None:
            self.first_out = now
        else:
            playing = now - self.first_out - self.stalled_s
            if playing > self.emitted_s:
                self.stalled_s += playing - self.emitted_s
        self.emitted_s += seconds


class FrameTimes:
    """The worker's measured seconds per step, per batch size (an average of the recent steps), and an estimate
    for a batch size not measured yet: between two measured sizes, the line between them; above the largest, a
    least-squares line through the measured sizes (slope >= 0) or, from one size only, time proportional to rows
    (a pessimistic bound: a batch never costs more per row than one row alone); below the smallest, the
    smallest's."""

    MIN_SAMPLES = 3          # steps at a batch size before its time counts as measured
    ALPHA = 0.25             # weight of each new step in the running average
    CLIP = 3.0               # a step longer than this many times the average counts as this (a pause of the
                             # caller-driven engine's reader, a stall of the machine: not the batch's cost)

    def __init__(self):
        self.avg: dict[int, float] = {}
        self.n: dict[int, int] = {}
        self._slope: float | None = None     # of the line through the measured sizes (kept until the next record)

    def record(self, batch: int, seconds: float) -> None:
        if batch <= 0 or not seconds >= 0:
            return
        self._slope = None
        a = self.avg.get(batch)
        if a is None:
            self.avg[batch], self.n[batch] = seconds, 1
            return
        seconds = min(seconds, self.CLIP * a)
        self.avg[batch] = a + self.ALPHA * (seconds - a)
        self.n[batch] += 1

    def measured(self) -> dict[int, float]:
        return {b: t for b, t in self.avg.items() if self.n[b] >= self.MIN_SAMPLES}

    def estimate(self, batch: int) -> float | None:
        """Seconds per step at `batch` rows, or None while no batch size is measured."""
        known = self.measured()
        if not known or batch <= 0:
            return None
        if batch in known:
            return known[batch]
        below = [b for b in known if b < batch]
        above = [b for b in known if b > batch]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (batch - lo) / (hi - lo)
        if above:
            return known[min(above)]
        b0 = max(below)
        if len(known) == 1:
            return known[b0] * batch / b0
        if self._slope is None:
            xs, ys = np.array(list(known), float), np.array(list(known.values()), float)
            self._slope = max(0.0, float(np.polyfit(xs, ys, 1)[0]))
        return known[b0] + self._slope * (batch - b0)


class Scheduler:
    def __init__(self, rows: int, max_waiting: int, admission: str = "rows", min_pace: float = 1.1,
                 clock=time.monotonic):
        """admission: "rows" (a waiting request joins whenever a row is free) or "realtime" (only while the
        running streams keep `min_pace` x real time and hold audio enough for its prefill; the module's doc);
        clock: seconds, monotonic (tests pass a fake one)."""
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, not {admission!r}")
        self.free_rows = list(range(rows))[::-1]
        self.max_waiting = max_waiting
        self.admission, self.min_pace, self.clock = admission, float(min_pace), clock
        self.waiting: list[Sequence] = []      # in deadline order
        self.running: list[Sequence] = []
        self.lock = threading.Lock()
        self.frame_times = FrameTimes()
        self.prefill_s: float | None = None    # measured seconds of one request's prefill (running average)
        self._last: tuple[float, int, int] | None = None   # (time, batch, admitted) at the last `admit`
        self._admits: deque[float] = deque(maxlen=32)     # when recent requests left the queue for a row
        self._service_s: float | None = None   # average seconds from admission to release
        # changes whenever the running set or a running row changes (admit, release, compact): the worker keeps its
        # list of running rows between steps while it is the same
        self.version = 0
        # sequences cancelled since the start (queued ones' `CancelFlag`): the worker looks for cancelled running
        # rows only when it moved; `cancels_counted` turns False when a sequence came with a flag of another kind
        # (then the worker looks at every step)
        self.cancels = 0
        self.cancels_counted = True

    # --- the queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        with self.lock:
            if len(self.waiting) >= self.max_waiting:
                err = EngineBusyError("the server is busy: too many requests are waiting. Please try again "
                                      "in a moment.")
                err.retry_after_s = self._retry_after(len(self.waiting))
                raise err
            seq.submitted = self.clock()
            if isinstance(seq.cancelled, CancelFlag):
                seq.cancelled.on_set = self._note_cancel
            else:
                self.cancels_counted = False
            if isinstance(seq.out, AudioQueue):
                seq.out.on_audio = lambda n, s=seq: s.note_audio(n / SAMPLE_RATE, self.clock())
            bisect.insort(self.waiting, seq, key=_order)

    def _note_cancel(self) -> None:
        # (no lock: the flag is set before the count is read, so even an increment lost to another thread's leaves
        # the count moved past what the worker saw before either flag was set)
        self.cancels += 1

    def position(self, seq: Sequence) -> int | None:
        """Requests ahead of `seq` in the queue (None once it runs)."""
        with self.lock:
            for i, s in enumerate(self.waiting):
                if s is seq:
                    return i
        return None

    def by_deadline(self, seqs: list[Sequence]) -> list[Sequence]:
        """`seqs` with the listeners holding the least audio first (earliest deadline; ties: the older request)."""
        return sorted(seqs, key=_order)

    # --- rows --------------------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Waiting sequences that get a cache row now, in deadline order (cancelled ones leave the queue here,
        whether or not a row is free). Called by the worker once per step: the time between two calls is the
        step's, recorded for the batch that ran it."""
        out = []
        with self.lock:
            now = self.clock()
            self._measure(now)
            for seq in [s for s in self.waiting if s.cancelled.is_set()]:
                self.waiting.remove(seq)
                seq.finish()
            while self.waiting and self.free_rows and self._may_admit(now, len(out)):
                seq = self.waiting.pop(0)
                self.free_rows.sort(reverse=True)
                seq.row = self.free_rows.pop()          # the lowest free row: running rows stay dense
                seq.status = Status.RUNNING
                seq.admitted = now
                self.running.append(seq)
                self._admits.append(now)
                out.append(seq)
            if out:
                self.version += 1
            self._last = (now, len(self.running), len(out))
        return out

    def _measure(self, now: float) -> None:
        """The step since the last `admit`: its time goes to the batch that ran it; where that step also
        prefilled newcomers, what exceeds the batch's measured step is their prefill."""
        last, self._last = self._last, None
        if last is None or not self.running:   # (nothing ran since, or an idle wait came between)
            return
        t, batch, admitted = last
        dt = now - t
        if admitted == 0:
            self.frame_times.record(batch, dt)
            return
        step = self.frame_times.measured().get(batch)
        if step is not None:
            one = max(0.0, dt - step) / admitted
            self.prefill_s = one if self.prefill_s is None else self.prefill_s + FrameTimes.ALPHA * (one - self.prefill_s)

    def _may_admit(self, now: float, admitted_now: int) -> bool:
        if self.admission == "rows" or not self.running:
            return True
        step = self.frame_times.estimate(len(self.running) + 1)
        if step is None or step * self.min_pace > FRAME_S:
            return False                        # not measured yet, or the streams would fall below real time
        pause = (admitted_now + 1) * (self.prefill_s or 0.0) + step
        return all(s.first_out is None or s.held(now) >= pause for s in self.running)

    def release(self, seq: Sequence) -> None:
        with self.lock:
            if seq in self.running:
                self.running.remove(seq)
                if seq.admitted is not None:
                    d = self.clock() - seq.admitted
                    self._service_s = d if self._service_s is None else self._service_s + 0.25 * (d - self._service_s)
            if seq.row is not None:
                self.free_rows.append(seq.row)
                seq.row = None
            self.version += 1

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
            self.version += 1
            return top, src, low

    def idle(self) -> bool:
        with self.lock:
            return not self.waiting and not self.running

    # --- how full, how fast ----------------------------------------------------------------------------
    def _retry_after(self, ahead: int) -> int:
        """Seconds after which a request refused now would likely find a place: `ahead` requests leave the queue
        at the measured drain rate (recent admissions; before any, the average time a request holds its row over
        the rows), 1 to 120 s."""
        rows = len(self.running) + len(self.free_rows)
        recent = [t for t in self._admits if t >= self.clock() - 120.0]
        if len(recent) >= 2 and recent[-1] > recent[0]:
            per = (recent[-1] - recent[0]) / (len(recent) - 1)
        elif self._service_s is not None:
            per = self._service_s / max(1, rows)
        else:
            per = 5.0
        return int(min(120, max(1, math.ceil(per * max(1, ahead)))))

    def capacity(self) -> int | None:
        """The most streams estimated to keep `min_pace` x real time together (at least 1), None before any step
        was measured."""
        rows = len(self.running) + len(self.free_rows)
        if not self.frame_times.measured():
            return None
        n = 1
        while n < rows and (t := self.frame_times.estimate(n + 1)) is not None and t * self.min_pace <= FRAME_S:
            n += 1
        return n

    def counts(self) -> dict:
        """How full this scheduler is right now: {"running", "waiting", "max_waiting", "rows"}, and
        "admission" ("rows" or "realtime"), "step_ms" (the measured step at the running batch, None before),
        "realtime_streams" (`capacity`), "retry_after_s" (what a refused request is told)."""
        with self.lock:
            running = len(self.running)
            step = self.frame_times.estimate(running) if running else None
            return {"running": running, "waiting": len(self.waiting), "max_waiting": self.max_waiting,
                    "rows": running + len(self.free_rows), "admission": self.admission,
                    "step_ms": None if step is None else round(1000 * step, 1),
                    "realtime_streams": self.capacity(), "retry_after_s": self._retry_after(len(self.waiting) + 1)}

    def drain_waiting(self) -> list[Sequence]:
        with self.lock:
            out = list(self.waiting)
            self.waiting.clear()
            return out


def _order(seq: Sequence) -> tuple[float, int]:
    return seq.deadline(), seq.id
