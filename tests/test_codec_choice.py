"""Where a CPU engine decodes a batch's chunks (`tts_engine/cpu/codec_choice.py`): the cost model, the choice per
batch-size bucket, the warm-up and the exploration, all from fed timings (no clock)."""
from __future__ import annotations

import pytest

from tts_engine.cpu.codec_choice import HERE, THREAD, CodecChoice, bucket


def feed(c: CodecChoice, rows: int, f_idle=None, f_busy=None, c_thread=None, c_here=None, times=1):
    """Per-row seconds fed as whole-batch figures (a frame of `rows` rows; a decode of 4 frames of `rows` rows)."""
    for _ in range(times):
        if f_idle is not None:
            c.record_frame(rows, False, f_idle * rows)
        if f_busy is not None:
            c.record_frame(rows, True, f_busy * rows)
        if c_thread is not None:
            c.record_decode(rows, THREAD, c_thread * 4 * rows, 4 * rows)
        if c_here is not None:
            c.record_decode(rows, HERE, c_here * 4 * rows, 4 * rows)


def test_buckets():
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 16]


def test_each_way_is_measured_first_then_the_cheaper_one_wins():
    c = CodecChoice(alpha=1.0)
    assert c.choose(1, codec_busy=False) == THREAD          # nothing measured yet: the thread first
    feed(c, 1, c_thread=0.02, f_busy=0.11, f_idle=0.10)
    assert c.costs(1) is None
    assert c.choose(1, codec_busy=False) == HERE            # then here
    feed(c, 1, c_here=0.03)
    # thread: 0.02 + (1 - 0.02 / 0.11) * 0.10 = 0.1018; here: 0.10 + 0.03 = 0.13
    assert c.costs(1) == pytest.approx({THREAD: 0.02 + (1 - 0.02 / 0.11) * 0.10, HERE: 0.13})
    assert c.choose(1, codec_busy=False) == THREAD


def test_a_codec_thread_that_slows_the_frames_down_loses():
    c = CodecChoice(alpha=1.0)
    # four rows: beside a decode the frame takes twice as long (the codec took a core the frame needed)
    feed(c, 4, f_idle=0.05, f_busy=0.10, c_thread=0.06, c_here=0.03)
    costs = c.costs(4)
    assert costs[THREAD] == pytest.approx(0.06 + (1 - 0.06 / 0.10) * 0.05)   # 0.08
    assert costs[HERE] == pytest.approx(0.05 + 0.03)                          # a tie at 0.08
    feed(c, 4, c_here=0.02)                                                    # here: 0.07 < 0.08
    for _ in range(3):
        assert c.choose(4, codec_busy=False) == HERE


def test_a_codec_that_cannot_keep_up_bounds_the_thread_way():
    c = CodecChoice(alpha=1.0)
    feed(c, 2, f_idle=0.05, f_busy=0.06, c_thread=0.09, c_here=0.05)
    assert c.costs(2)[THREAD] == pytest.approx(0.09)                        # the codec is the bottleneck
    assert c.costs(2)[HERE] == pytest.approx(0.10)
    assert c.choose(2, codec_busy=False) == THREAD


def test_buckets_are_chosen_apart():
    c = CodecChoice(alpha=1.0)
    feed(c, 1, f_idle=0.10, f_busy=0.11, c_thread=0.03, c_here=0.03)        # one row: the overlap pays
    feed(c, 4, f_idle=0.04, f_busy=0.09, c_thread=0.05, c_here=0.02)        # four: it costs
    assert c.choose(1, codec_busy=False) == THREAD
    assert c.choose(3, codec_busy=False) == HERE                            # 3 rows: the 3-4 bucket
    assert set(c.snapshot()) == {1, 4}
    assert c.snapshot()[4]["best"] == HERE and c.snapshot()[1]["best"] == THREAD


def test_while_the_codec_thread_is_busy_chunks_go_there_and_nothing_is_counted():
    c = CodecChoice(alpha=1.0, explore_every=3)
    feed(c, 4, f_idle=0.04, f_busy=0.09, c_thread=0.05, c_here=0.02)
    for _ in range(10):
        assert c.choose(4, codec_busy=True) == THREAD
    assert c.choose(4, codec_busy=False) == HERE and c.choose(4, codec_busy=False) == HERE   # 2 of 3 counted
    assert c.choose(4, codec_busy=False) == THREAD                                            # the third explores


def test_the_other_way_is_explored_now_and_then_less_often_while_it_keeps_losing():
    c = CodecChoice(alpha=0.5, explore_every=2, max_interval=8)
    feed(c, 1, f_idle=0.10, f_busy=0.105, c_thread=0.03, c_here=0.05)      # thread ~0.10, here 0.15
    seen = []
    for _ in range(40):
        w = c.choose(1, codec_busy=False)
        seen.append(w)
        if w == HERE:
            feed(c, 1, c_here=0.05)                                         # it loses again: back off
    gaps = [i for i, w in enumerate(seen) if w == HERE]
    assert len(gaps) >= 3                                                   # explored more than once
    steps = [b - a for a, b in zip(gaps, gaps[1:])]
    assert steps == sorted(steps) and steps[-1] <= 8 and steps[-1] > steps[0]   # backing off to the cap


def test_the_choice_follows_a_change_of_the_machine():
    c = CodecChoice(alpha=0.5, explore_every=2)
    feed(c, 4, f_idle=0.05, f_busy=0.055, c_thread=0.04, c_here=0.04)     # quiet: the overlap pays
    assert c.choose(4, codec_busy=False) == THREAD
    chosen = []
    for _ in range(30):                                                     # now the thread's frames crawl
        w = c.choose(4, codec_busy=False)
        chosen.append(w)
        if w == THREAD:
            feed(c, 4, f_busy=0.25, c_thread=0.12)   # thread: 0.12 + (1 - 0.12 / 0.25) 0.05 = 0.146
        else:
            feed(c, 4, f_idle=0.05, c_here=0.04)     # here: 0.09
    assert chosen[-10:].count(HERE) >= 8


def test_bad_input_is_ignored():
    c = CodecChoice()
    c.record_frame(0, False, 1.0)
    c.record_decode(0, THREAD, 1.0, 4)
    c.record_decode(2, THREAD, 1.0, 0)
    assert c.snapshot() == {}
