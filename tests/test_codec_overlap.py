"""The codec decode overlapped with generation (`TTSEngine(overlap_codec=True)`, `engine/codec_thread.py`): the
same audio as the serial path, chunks in order under concurrent requests, a codec failure fails its request only,
and Stop still frees the row at once. `overlap_codec="streams"` uses the codec thread only while several requests
run; the CPU default (`OVERLAP_CODEC_CPU_DEFAULT`) applies in 16-bit and quantised modes with 2+ threads only."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine, TTSError

TEXT = "Hello there, this is a test of the overlapped codec."


PAIR = (dict(overlap_codec=False), dict(overlap_codec=True))   # conftest's tiny_cv_pair


@pytest.fixture(scope="module")
def engines(tiny_cv_pair):
    return tiny_cv_pair


def _run(engine, seed, text=TEXT, frames=20, first=1, **kw):
    s = engine.stream(text, voice="ryan", seed=seed, max_new_tokens=frames, first_chunk_frames=first, **kw)
    chunks = list(s)
    return chunks, s.codes


def test_overlapped_decode_gives_the_serial_audio(engines):
    serial, overlap = engines
    assert serial.worker.codec is None and overlap.worker.codec is not None
    before = overlap.worker.codec.decoded_chunks
    for kw in (dict(seed=5), dict(seed=6, greedy=True)):
        chunks_s, codes_s = _run(serial, **kw)
        chunks_o, codes_o = _run(overlap, **kw)
        assert len(codes_o) > 8 and torch.equal(codes_s, codes_o)
        assert [len(c) for c in chunks_o] == [len(c) for c in chunks_s]     # 1, 2, 4, 8, ... frames
        np.testing.assert_allclose(np.concatenate(chunks_o), np.concatenate(chunks_s), atol=1e-5)
    assert overlap.worker.codec.decoded_chunks > before                     # the later chunks went there


def _cut_as_alone_or_on_shared_frames(chunks_g, chunks_a, first=1, aligned=True):
    """A concurrent stream's chunk sizes against its alone run's: the same with `worker.align_chunks` off; with it on
    (chunks cut on frames shared with other streams) the same first chunk, the same total, and no chunk longer than
    its place in the schedule (1, 2, 4, 8, 12, ...)."""
    from tts_engine.engine.request import chunk_schedule

    g, a = [len(c) for c in chunks_g], [len(c) for c in chunks_a]
    if not aligned:
        assert g == a
        return
    sizes = chunk_schedule(first, 12)
    assert g[0] == a[0] and sum(g) == sum(a) and all(n <= 1920 * next(sizes) for n in g), (g, a)


@pytest.mark.parametrize("aligned", [True, False])
def test_order_kept_for_concurrent_requests(engines, aligned):
    serial, overlap = engines
    texts = [TEXT, "A second sentence, generated alongside the first one.", "And a third, shorter one."]
    alone = [_run(serial, 10 + i, t, frames=24) for i, t in enumerate(texts)]
    got = [None] * 3

    def client(i):
        got[i] = _run(overlap, 10 + i, texts[i], frames=24)

    overlap.worker.align_chunks = aligned
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        overlap.worker.align_chunks = True
    for (chunks_a, codes_a), (chunks_g, codes_g) in zip(alone, got):
        assert torch.equal(codes_a, codes_g)
        _cut_as_alone_or_on_shared_frames(chunks_g, chunks_a, aligned=aligned)
        np.testing.assert_allclose(np.concatenate(chunks_g), np.concatenate(chunks_a), atol=1e-4)


def test_streams_started_frames_apart_decode_their_later_chunks_as_one_batch(tiny_cv_folder, monkeypatch):
    """Chunks on a shared frame clock (`EngineWorker.align_chunks`): B starts 3 frames after A; from B's third chunk on
    both cut their chunks on the same frames and each such pair decodes in one call of two rows, with each stream's
    codes and audio those of its run alone. With the alignment off they never share a call."""
    from tts_engine.engine import worker as worker_mod

    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=3)
    try:
        eng.drive_in_caller()       # (the test steps the frames: B joins exactly 3 frames after A)
        full = {"ignore_eos": True}   # (30 frames each whatever the random weights say)
        alone = [_run(eng, 70, frames=30, sampling=full),
                 _run(eng, 71, "A second sentence, a little longer than that.", frames=30, sampling=full)]
        real, calls = worker_mod.decode_group, []

        def spy(codec, items):
            calls.append((items[0][1].shape[0], len(items)))
            return real(codec, items)

        monkeypatch.setattr(worker_mod, "decode_group", spy)
        for aligned in (True, False):
            eng.worker.align_chunks, calls[:] = aligned, []
            a = eng.stream(TEXT, voice="ryan", seed=70, max_new_tokens=30, first_chunk_frames=1, sampling=full)
            for _ in range(3):
                eng.worker.step()
            b = eng.stream("A second sentence, a little longer than that.", voice="ryan", seed=71,
                           max_new_tokens=30, first_chunk_frames=1, sampling=full)
            got = [(list(a), a.codes), (list(b), b.codes)]
            pairs = [n for n, rows in calls if rows == 2]
            if aligned:
                assert len(pairs) >= 2 and max(pairs) >= 4, calls      # e.g. 4 and 8 frames, each as one batch
            else:
                assert not pairs, calls
            for (chunks_a, codes_a), (chunks_g, codes_g) in zip(alone, got):
                assert torch.equal(codes_a, codes_g)
                _cut_as_alone_or_on_shared_frames(chunks_g, chunks_a, aligned=aligned)
                np.testing.assert_allclose(np.concatenate(chunks_g), np.concatenate(chunks_a), atol=1e-5)
    finally:
        eng.close()


def test_a_codec_failure_fails_that_request_only(engines, monkeypatch):
    serial, overlap = engines
    want_b = _run(serial, 21, "The other request, which must not notice.", frames=24, first=3)
    dec = overlap.model.speech_tokenizer.decoder
    real = dec.decode_step

    def flaky(codes, state):   # request A's third chunk (4 frames) fails on the codec thread; B never has 4
        if codes.shape[-1] == 4 and threading.current_thread().name == "tts-codec":
            raise RuntimeError("codec exploded")
        return real(codes, state)

    monkeypatch.setattr(dec, "decode_step", flaky)
    a = overlap.stream(TEXT, voice="ryan", seed=20, max_new_tokens=40, first_chunk_frames=1)   # 1, 2, 4, ...
    b = overlap.stream("The other request, which must not notice.", voice="ryan", seed=21, max_new_tokens=24,
                       first_chunk_frames=3)                                                    # 3, 6, 12, ...
    got_a, err = [], None
    try:
        for c in a:
            got_a.append(len(c) // 1920)
    except TTSError as e:
        err = e
    chunks_b = list(b)
    assert err is not None and "synthesis failed" in str(err)
    assert got_a == [1, 2]                                   # the chunks before the failure, in order
    assert torch.equal(b.codes, want_b[1])
    np.testing.assert_allclose(np.concatenate(chunks_b), np.concatenate(want_b[0]), atol=1e-4)
    monkeypatch.setattr(dec, "decode_step", real)
    assert overlap.worker.codec.drain(30)
    assert overlap.scheduler.idle() and sorted(overlap.scheduler.free_rows) == [0, 1, 2]
    chunks, codes = _run(overlap, 5)                         # the engine keeps serving
    assert sum(len(c) for c in chunks) == len(codes) * 1920


def test_stop_frees_the_row_and_ends_the_stream(engines):
    _, overlap = engines
    s = overlap.stream(TEXT, voice="ryan", seed=3, max_new_tokens=400, first_chunk_frames=1)
    first = next(s)
    second = next(s)                                         # decoded on the codec thread
    assert len(first) == 1920 and len(second) == 2 * 1920
    s.cancel()
    rest = list(s)                                           # ends (END after any chunk already decoded)
    assert len(rest) <= 3
    assert overlap.worker.codec.drain(30)
    for _ in range(100):
        if overlap.scheduler.idle():
            break
        threading.Event().wait(0.05)
    assert overlap.scheduler.idle() and len(s.codes) < 400
    chunks, codes = _run(overlap, 4)
    assert len(codes) > 0 and sum(len(c) for c in chunks) == len(codes) * 1920


def test_caller_driven_engine_turns_the_overlap_off(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", overlap_codec=True)
    try:
        eng.drive_in_caller()
        assert eng.worker.codec is None
        chunks, codes = _run(eng, 2, frames=8)
        assert sum(len(c) for c in chunks) == len(codes) * 1920
    finally:
        eng.close()


def test_streams_mode_overlaps_only_concurrent_requests(engines):
    serial, overlap = engines
    overlap.worker.overlap_codec("streams")
    try:
        codec = overlap.worker.codec
        assert codec is not None and overlap.worker.codec_min_rows == 2
        chunks_s, codes_s = _run(serial, 31)
        chunks_o, codes_o = _run(overlap, 31)                        # one stream: every chunk decoded in the worker
        assert codec.decoded_chunks == 0 and torch.equal(codes_s, codes_o)
        np.testing.assert_array_equal(np.concatenate(chunks_o), np.concatenate(chunks_s))
        texts = [TEXT, "A second sentence, generated alongside the first one.", "And a third, shorter one."]
        alone = [_run(serial, 40 + i, t, frames=24) for i, t in enumerate(texts)]
        streams = [overlap.stream(t, voice="ryan", seed=40 + i, max_new_tokens=24, first_chunk_frames=1)
                   for i, t in enumerate(texts)]                       # all three queued before any is read
        got = [(list(s), s.codes) for s in streams]
        assert codec.decoded_chunks > 0                               # the later chunks of concurrent streams
        for (chunks_a, codes_a), (chunks_g, codes_g) in zip(alone, got):
            assert torch.equal(codes_a, codes_g)
            _cut_as_alone_or_on_shared_frames(chunks_g, chunks_a)
            np.testing.assert_allclose(np.concatenate(chunks_g), np.concatenate(chunks_a), atol=1e-4)
        with pytest.raises(ValueError):
            overlap.worker.overlap_codec("sometimes")
    finally:
        overlap.worker.overlap_codec(True)


def _synchronous_codec_thread(worker, monkeypatch, calls):
    """The codec thread's decode run at once in the worker (so it is never busy at the next emission: which way each
    chunk goes is then the choice's alone, not the scheduler's); `calls` gets each handed-over chunk's frames."""
    codec = worker.codec

    def decode(items, on_done=None):
        calls.append(items[0][1].shape[0])
        codec._decode(items, on_done)

    monkeypatch.setattr(codec, "decode", decode)


def test_auto_mode_measures_both_ways_and_gives_the_serial_audio(engines, monkeypatch):
    from tts_engine.cpu.codec_choice import HERE, THREAD

    serial, overlap = engines
    overlap.worker.overlap_codec("auto")
    try:
        choice, calls = overlap.worker.codec_choice, []
        assert choice is not None and overlap.worker.codec is not None
        _synchronous_codec_thread(overlap.worker, monkeypatch, calls)
        for seed in (51, 52):
            chunks_s, codes_s = _run(serial, seed, frames=40)
            chunks_o, codes_o = _run(overlap, seed, frames=40)                # chunks 1, 2, 4, 8, 12, 12, 1
            assert torch.equal(codes_s, codes_o)
            assert [len(c) for c in chunks_o] == [len(c) for c in chunks_s]
            np.testing.assert_allclose(np.concatenate(chunks_o), np.concatenate(chunks_s), atol=1e-5)
        snap = choice.snapshot()[1]
        assert snap["decodes"][THREAD] >= 1 and snap["decodes"][HERE] >= 1     # each way measured
        assert snap["f_idle_ms"] is not None and snap["best"] in (THREAD, HERE)
        assert calls                                                          # some chunks went to the thread
        texts = [TEXT, "A second sentence, generated alongside the first one.", "And a third, shorter one."]
        alone = [_run(serial, 60 + i, t, frames=24) for i, t in enumerate(texts)]
        streams = [overlap.stream(t, voice="ryan", seed=60 + i, max_new_tokens=24, first_chunk_frames=1)
                   for i, t in enumerate(texts)]
        got = [(list(s), s.codes) for s in streams]
        for (chunks_a, codes_a), (chunks_g, codes_g) in zip(alone, got):
            assert torch.equal(codes_a, codes_g)
            np.testing.assert_allclose(np.concatenate(chunks_g), np.concatenate(chunks_a), atol=1e-4)
        assert 4 in choice.snapshot()                                         # three rows: the 3-4 bucket
    finally:
        overlap.worker.overlap_codec(True)


def test_auto_mode_decodes_the_last_chunks_here_when_nothing_else_runs(engines, monkeypatch):
    from tts_engine.cpu.codec_choice import THREAD, CodecChoice

    serial, overlap = engines
    overlap.worker.overlap_codec("auto")
    try:
        calls = []
        _synchronous_codec_thread(overlap.worker, monkeypatch, calls)
        monkeypatch.setattr(CodecChoice, "choose", lambda self, rows, busy: THREAD)   # always the thread ...
        chunks_s, codes_s = _run(serial, 71, frames=20)
        chunks_o, codes_o = _run(overlap, 71, frames=20)
        sizes = [len(c) // 1920 for c in chunks_o]
        assert sizes[0] == 1 and len(sizes) >= 4
        assert calls == sizes[1:-1]                                           # ... but the first and the last
        np.testing.assert_allclose(np.concatenate(chunks_o), np.concatenate(chunks_s), atol=1e-5)
    finally:
        overlap.worker.overlap_codec(True)


def test_the_cpu_default_applies_in_16_bit_and_never_in_fp32(tiny_cv_folder, monkeypatch):
    from tts_engine.engine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "OVERLAP_CODEC_CPU_DEFAULT", "streams")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bf16 = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="bf16")
        fp32 = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32")
        try:
            assert bf16.worker.codec is not None and bf16.worker.codec_min_rows == 2
            assert fp32.worker.codec is None                                 # fp32: bit for bit as before
        finally:
            bf16.close()
            fp32.close()
        torch.set_num_threads(1)
        one = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="bf16")
        try:
            assert one.worker.codec is None                                  # one thread: nothing to overlap on
        finally:
            one.close()
    finally:
        torch.set_num_threads(threads)


def test_bench_ab_variants_switch_the_overlap_mode(engines):
    from bench import ab as bench_ab

    _, overlap = engines
    try:
        bench_ab._switch(overlap, {"overlap_codec": "streams"})
        assert overlap.worker.codec is not None and overlap.worker.codec_min_rows == 2
        bench_ab._switch(overlap, {"overlap_codec": 1})
        assert overlap.worker.codec is not None and overlap.worker.codec_min_rows == 1
        bench_ab._switch(overlap, {"overlap_codec": 0})
        assert overlap.worker.codec is None
        bench_ab._switch(overlap, {"overlap_codec": "auto"})
        assert overlap.worker.codec is not None and overlap.worker.codec_choice is not None
    finally:
        overlap.worker.overlap_codec(True)
        overlap.worker.split_frames = None


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
@pytest.mark.parametrize("nice", [0, 5])
def test_codec_thread_runs_at_the_priority_asked_for(nice):
    """`CodecThread(nice=n)`: its jobs run at the worker's priority lowered by n (0: unchanged); the process's other
    threads keep theirs."""
    import threading

    from tts_engine.engine.codec_thread import CodecThread

    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    class Seq:
        decoder_state = None
        codec_error = None

        def finish(self, item=None):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    ct = CodecThread(lambda: None, threads=1, nice=nice)
    ct.finish(Seq(), None)
    assert ct.drain(10)
    ct.close()
    assert seen == [min(19, me + nice)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == me
