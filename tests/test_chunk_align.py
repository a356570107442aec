"""Chunks on a shared frame clock (`EngineWorker.next_chunks`, `align_chunks`), as the worker cuts them
(bench/chunk_align.py's `cut` steps the worker's own rule frame by frame, no model): streams that started a few frames
apart cut their later chunks on the same frames; a first chunk, a lone stream and the schedule's sizes as upper bounds
are kept."""
from __future__ import annotations

from bench.chunk_align import cut
from tts_engine.engine.request import chunk_schedule


def _sizes(plan, stream):
    return [n for _, chunks in plan for i, n, _ in chunks if i == stream]


def test_streams_a_frame_apart_go_out_together_from_their_third_chunk():
    shared, own = cut([1, 2, 2, 2], 60, True), cut([1, 2, 2, 2], 60, False)
    together = [t for t, chunks in shared if len(chunks) == 4 and len({n for _, n, _ in chunks}) == 1]
    assert together == [7, 15, 27, 39, 51]                                   # 4, 8, 12, 12, 12 frames x 4 streams
    assert not [t for t, chunks in own if len(chunks) == 4]                 # each on its own schedule: 1 + 3
    for i in range(4):
        s, o = _sizes(shared, i), _sizes(own, i)
        assert s[0] == o[0] == 1 and sum(s) == sum(o) == 60                 # the first chunk as soon as possible
        sched = chunk_schedule(1, 12)
        assert all(n <= next(sched) for n in s)                            # never longer than the schedule's


def test_a_lone_stream_and_streams_started_together_keep_their_schedule():
    want = [1, 2, 4, 8, 12, 12, 12, 9]
    assert _sizes(cut([5], 60, True), 0) == want
    shared = cut([3, 3, 3], 60, True)
    assert all(_sizes(shared, i) == want for i in range(3))
    assert all(len(chunks) == 3 for _, chunks in shared)


def test_streams_arriving_later_join_the_running_ones():
    plan, own = cut([1, 4, 9, 15], 60, True), cut([1, 4, 9, 15], 60, False)
    full = [t for t, chunks in plan if len(chunks) == 4 and {n for _, n, _ in chunks} == {12}]
    assert full == [39, 51]                                                  # all four in one batch of 12 frames
    assert max(len(chunks) for _, chunks in own) < 4 and len(own) > len(plan)
    for i in range(4):
        sched = chunk_schedule(1, 12)
        s = _sizes(plan, i)
        assert s[0] == 1 and sum(s) == 60 and all(n <= next(sched) for n in s)
