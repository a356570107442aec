"""Scheduling by playback deadline and honest admission (engine/scheduler.py), on the scheduler alone with a fake
clock and a fake worker (no model): what each listener holds, who goes first, who may join, Retry-After."""
from __future__ import annotations

import numpy as np
import pytest

from tts_engine import EngineBusyError
from tts_engine.engine.scheduler import FRAME_S, SAMPLE_RATE, FrameTimes, Scheduler, Sequence, Status


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def audio(seconds: float) -> np.ndarray:
    return np.zeros(int(round(seconds * SAMPLE_RATE)), np.float32)


def make(rows=4, max_waiting=8, admission="realtime", **kw):
    clock = Clock()
    return Scheduler(rows, max_waiting, admission=admission, clock=clock, **kw), clock


def run_steps(sch: Scheduler, clock: Clock, n: int, step_s, emit_every: int = 0) -> list[Sequence]:
    """A fake worker: `n` steps, each `admit` and then `step_s(batch)` seconds of frames; every `emit_every`
    steps each running sequence hands out that many frames of audio. -> every sequence admitted."""
    admitted = []
    for k in range(n):
        admitted += sch.admit()
        clock.advance(step_s(len(sch.running)))
        if emit_every and (k + 1) % emit_every == 0:
            for s in list(sch.running):
                s.out.put(audio(emit_every * FRAME_S))
    return admitted


def test_the_listener_holds_what_was_handed_out_minus_what_has_played():
    sch, clock = make()
    s = Sequence(request=None)
    sch.add(s)
    assert s.held(clock()) == 0.0 and s.first_out is None       # due now: its first chunk is awaited
    clock.advance(0.5)
    assert s.held(clock()) == pytest.approx(-0.5)                # late by the wait for first audio
    s.out.put(audio(0.08))                                       # first chunk: playback starts now
    assert s.held(clock()) == pytest.approx(0.08)
    clock.advance(0.05)
    s.out.put(audio(0.32))
    assert s.held(clock()) == pytest.approx(0.08 + 0.32 - 0.05)
    clock.advance(1.0)                                           # it ran dry 0.65 s ago and waited since
    assert s.held(clock()) == pytest.approx(-0.65)
    s.out.put(audio(0.16))                                       # resumes where it stopped
    assert s.held(clock()) == pytest.approx(0.16) and s.stalled_s == pytest.approx(0.65)


def test_the_least_audio_held_goes_first():
    sch, clock = make()
    a, b, c = (Sequence(request=None) for _ in range(3))
    for s in (a, b, c):
        sch.add(s)
    assert sch.admit() == [a]                                    # (one at a time until a step is measured)
    clock.advance(0.01)
    a.out.put(audio(2.0))                                        # a's listener holds 2 s
    assert sch.by_deadline([a, b, c]) == [b, c, a]               # b, c: nothing yet, b is older
    clock.advance(0.01)
    c.out.put(audio(0.08))                                       # hypothetically handed out while waiting
    b.out.put(audio(0.5))
    assert sch.by_deadline([a, b, c]) == [c, b, a]


def test_the_queue_is_kept_in_deadline_order():
    sch, clock = make(rows=1)
    first = Sequence(request=None)
    sch.add(first)
    sch.admit()
    later = [Sequence(request=None, lead_s=lead) for lead in (3.0, 0.0, 1.0)]
    for s in later:
        sch.add(s)
        clock.advance(0.1)
    # a request whose listener still holds 3 s of the previous sentence waits behind new listeners
    assert [sch.position(s) for s in later] == [2, 0, 1]
    sch.release(first)
    assert sch.admit() == [later[1]]


def test_admission_keeps_the_running_streams_at_real_time():
    """A fake measured speed: each step costs 20 ms + 15 ms a row (real time with the 1.1x margin is at most 72.7 ms
    a step: three rows). Four requests arrive at once: three run (admitted one by one as each new batch size is
    measured), the fourth waits until a stream ends."""
    sch, clock = make(rows=4)
    cost = lambda b: 0.020 + 0.015 * b
    seqs = [Sequence(request=None) for _ in range(4)]
    for s in seqs:
        sch.add(s)
    run_steps(sch, clock, 60, cost, emit_every=4)
    assert [s.status for s in seqs] == [Status.RUNNING] * 3 + [Status.WAITING]
    assert sch.frame_times.estimate(4) * sch.min_pace > FRAME_S
    assert sch.counts()["realtime_streams"] == 3 and sch.counts()["step_ms"] == pytest.approx(65.0)
    for s in sch.running:                                        # every running listener stays ahead of playback
        assert s.held(clock()) > 0
    sch.release(seqs[0])
    run_steps(sch, clock, 1, cost)
    assert seqs[3].status is Status.RUNNING


def test_one_stream_at_a_time_where_two_may_not_keep_real_time():
    """One row takes 60 ms a step (1.33x real time); two are not measured and may take up to twice that (the
    pessimistic bound): the others wait for it rather than risk both streams."""
    sch, clock = make(rows=4)
    seqs = [Sequence(request=None) for _ in range(3)]
    for s in seqs:
        sch.add(s)
    run_steps(sch, clock, 30, lambda b: 0.060 * b, emit_every=4)
    assert [s.status for s in seqs] == [Status.RUNNING, Status.WAITING, Status.WAITING]
    assert sch.counts()["realtime_streams"] == 1


def test_admission_waits_while_a_listener_holds_less_than_the_prefill():
    """A fast engine (steps of 10 ms at any batch) but a 300 ms prefill: a newcomer joins only once every running
    listener holds more than the prefill and a step."""
    sch, clock = make(rows=4)
    a = Sequence(request=None)
    sch.add(a)
    sch.admit()
    clock.advance(0.3)                                           # a's prefill
    a.out.put(audio(0.08))
    for _ in range(4):
        sch.admit()
        clock.advance(0.01)
    sch.prefill_s = 0.3                                          # (as measured from an earlier admission)
    b = Sequence(request=None)
    sch.add(b)
    assert a.held(clock()) < 0.31 and sch.admit() == []          # a would run dry during b's prefill
    a.out.put(audio(0.96))
    assert sch.admit() == [b]


def test_rows_admission_joins_whenever_a_row_is_free():
    sch, clock = make(rows=3, admission="rows")
    seqs = [Sequence(request=None) for _ in range(4)]
    for s in seqs:
        sch.add(s)
    assert sch.admit() == seqs[:3]


def test_nothing_running_always_admits_the_head():
    sch, clock = make(rows=2)
    sch.frame_times.avg, sch.frame_times.n = {1: 0.5}, {1: 10}   # even a machine slower than real time
    s = Sequence(request=None)
    sch.add(s)
    assert sch.admit() == [s]


def test_a_cancelled_request_leaves_the_queue_at_the_next_step_without_a_row():
    sch, clock = make(rows=1)
    running, queued = Sequence(request=None), Sequence(request=None)
    sch.add(running)
    sch.admit()
    sch.add(queued)
    queued.cancelled.set()
    assert sch.admit() == [] and sch.waiting == [] and queued.status is Status.FINISHED


def test_a_full_queue_refuses_with_a_retry_after_from_the_drain_rate():
    sch, clock = make(rows=1, max_waiting=2, admission="rows")
    for _ in range(6):                                           # a request every 4 s leaves the queue
        s = Sequence(request=None)
        sch.add(s)
        sch.admit()
        clock.advance(4.0)
        sch.release(s)
    blocker = Sequence(request=None)
    sch.add(blocker)
    sch.admit()
    sch.add(Sequence(request=None))
    sch.add(Sequence(request=None))
    with pytest.raises(EngineBusyError) as info:
        sch.add(Sequence(request=None))
    assert info.value.retry_after_s == 8                         # two ahead, one every 4 s
    assert sch.counts()["retry_after_s"] == 12


def test_frame_times_estimates():
    ft = FrameTimes()
    assert ft.estimate(1) is None
    for _ in range(3):
        ft.record(2, 0.040)
    assert ft.estimate(2) == pytest.approx(0.040)
    assert ft.estimate(4) == pytest.approx(0.080)                # one size known: proportional to rows
    assert ft.estimate(1) == pytest.approx(0.040)
    for _ in range(3):
        ft.record(4, 0.050)
    assert ft.estimate(3) == pytest.approx(0.045)
    assert ft.estimate(8) == pytest.approx(0.070)                # the line through the measured sizes
    ft.record(4, 10.0)                                           # a reader's pause is not the batch's cost
    assert ft.estimate(4) < 0.09


def test_an_engine_with_realtime_admission_keeps_a_slow_batch_from_forming(tiny_cv_folder):
    """A real (tiny) engine whose frames are made slow: 30 ms + 30 ms a row. One stream keeps real time, two might
    not (two rows are not measured; at most twice one row's time is assumed): the second request waits in the queue
    until the first has ended, then runs."""
    import time

    from tts_engine import TTSEngine

    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=2,
                                    admission="realtime", overlap_codec=False)
    real = eng.runner.decode

    def slow(rows, *a, **kw):
        time.sleep(0.030 + 0.030 * len(rows))
        return real(rows, *a, **kw)

    eng.runner.decode = slow
    eng.worker.split_frames = False
    try:
        first = eng.stream("The first listener.", voice="ryan", seed=1, max_new_tokens=24)
        next(first)
        second = eng.stream("The second one.", voice="ryan", seed=2, max_new_tokens=4)
        batches, positions = [], []
        for _ in first:
            batches.append(len(eng.scheduler.running))
            positions.append(second.position)
        assert batches and max(batches) == 1 and set(positions[:-1]) == {0}   # (the last: it may have started)
        assert len(list(second)) >= 1
        state = eng.load_state()
        assert state["realtime_streams"] == 1 and state["admission"] == "realtime" and state["step_ms"] is None
    finally:
        eng.close()
