"""The step's host work without Python per running row (issue 28): a request's frames kept as the chunks they went out
in (`FrameLog`), the worker's row buffer (chunks longer than its first width, rows that move), cancellations counted
so that the running rows are looked at only after one, and `python -m bench host` on each path. fp32, tiny random
checkpoints."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine
from tts_engine.engine.request import FrameLog
from tts_engine.engine.scheduler import CancelFlag, Scheduler, Sequence


def test_frame_log_keeps_chunks_and_reads_as_frames():
    log = FrameLog()
    assert len(log) == 0 and not log and log.stack().shape == (0, 16)
    a = np.arange(32, dtype=np.int64).reshape(2, 16)
    b = torch.arange(100, 148, dtype=torch.long).reshape(3, 16)
    log.add(a)
    log.add(b)
    assert len(log) == 5 and log and len(log.chunks) == 2
    want = torch.cat([torch.from_numpy(a), b])
    assert torch.equal(log.stack(), want) and log.stack().dtype == torch.long
    assert [f.tolist() for f in log] == want.tolist()
    assert torch.equal(log[3], want[3]) and torch.equal(log[-1], want[-1])


def test_cancels_are_counted_and_a_plain_flag_makes_the_worker_look_every_step():
    sch = Scheduler(rows=2, max_waiting=4)
    s = Sequence(request=None)
    assert isinstance(s.cancelled, CancelFlag)
    sch.add(s)
    before = sch.cancels
    s.cancelled.set()
    assert s.cancelled.is_set() and sch.cancels == before + 1 and sch.cancels_counted
    sch.add(Sequence(request=None, cancelled=threading.Event()))
    assert not sch.cancels_counted


def test_scheduler_version_moves_when_the_running_set_or_a_row_changes():
    sch = Scheduler(rows=3, max_waiting=4)
    seqs = [Sequence(request=None) for _ in range(3)]
    for s in seqs:
        sch.add(s)
    v = sch.version
    assert len(sch.admit()) == 3 and sch.version > v
    v = sch.version
    sch.admit()                                  # nothing new: the same
    assert sch.version == v
    sch.release(seqs[0])
    assert sch.version > v
    v = sch.version
    assert sch.compact() is not None and sch.version > v


@pytest.fixture(scope="module")
def engine(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=3,
                                    overlap_codec=False)
    eng.drive_in_caller()
    yield eng
    eng.close()


def _run(eng, seed, frames, first, max_chunk=12):
    s = eng.stream("Hello there, this is a test of long chunks.", voice=eng.speakers[0], seed=seed,
                   max_new_tokens=frames, first_chunk_frames=first, max_chunk_frames=max_chunk,
                   sampling={"ignore_eos": True})
    chunks = list(s)
    return [len(c) // 1920 for c in chunks], s.codes


@pytest.mark.parametrize("pipelined", [False, True])
def test_chunks_longer_than_the_row_buffer_keep_their_codes(engine, pipelined):
    sizes, codes = _run(engine, 5, 40, (1, 1))
    engine.worker.pipelined = pipelined
    try:
        long_sizes, long_codes = _run(engine, 5, 40, 20, max_chunk=40)   # (the buffer starts 16 frames wide)
    finally:
        engine.worker.pipelined = None
    assert sum(sizes) == sum(long_sizes) > 20 and long_sizes == [20, sum(sizes) - 20]
    assert torch.equal(codes, long_codes)


def test_a_cancelled_running_stream_frees_its_row_at_the_next_step(engine):
    a = engine.stream("One stream that keeps going.", voice=engine.speakers[0], seed=1, max_new_tokens=60,
                      first_chunk_frames=1, sampling={"ignore_eos": True})
    b = engine.stream("Another stream that keeps going.", voice=engine.speakers[0], seed=2, max_new_tokens=60,
                      first_chunk_frames=1, sampling={"ignore_eos": True})
    next(iter(a))
    next(iter(b))
    w = engine.worker
    for _ in range(3):
        w.step()
    assert len(engine.scheduler.running) == 2
    a.seq.cancelled.set()                        # (as a closed tab's abandoned stream does)
    w.step()
    assert len(engine.scheduler.running) == 1 and engine.scheduler.running[0] is b.seq and b.seq.row == 0
    b.cancel()
    assert engine.scheduler.idle()


@pytest.mark.parametrize("path", ["split", "graphs"])
def test_bench_host_runs_each_path(tmp_path, capsys, path):
    from bench import host

    out = tmp_path / "host.json"
    assert host.main(["--rows", "1,2", "--frames", "6", "--rounds", "1", "--path", path, "--json", str(out)]) == 0
    assert f"{path} frames" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["path"] == path and [r["rows"] for r in data["results"]] == [1, 2]
    assert all(r["cpu_ms"] > 0 for r in data["results"])
