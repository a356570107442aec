"""The engine driven by its caller (`TTSEngine.drive_in_caller`, what ZeroGPU's @spaces.GPU functions use): the
same frame step as the worker thread, in the calling thread, with no thread started."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine, TTSError
from tts_engine.tiny import make_tiny

TEXT = "Hello there, this is a test."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("driven") / "cv", kind="custom_voice", size="0b6", seed=0)


def _run(engine, seed, text=TEXT, **kw):
    s = engine.stream(text, voice="ryan", seed=seed, max_new_tokens=24, first_chunk_frames=1, **kw)
    chunks = list(s)
    return chunks, s.codes


def test_caller_driven_matches_the_worker_thread_and_starts_no_thread(folder):
    threaded = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="fp32")
    driven = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="fp32")
    try:
        driven.drive_in_caller()
        assert driven.driven_by_caller
        before = threading.active_count()
        chunks_d, codes_d = _run(driven, 7)
        assert driven.worker.thread is None and threading.active_count() == before
        chunks_t, codes_t = _run(threaded, 7)
        assert threaded.worker.thread is not None          # the usual path still uses its thread
        assert len(codes_d) > 0 and torch.equal(codes_d, codes_t)
        assert [len(c) for c in chunks_d] == [len(c) for c in chunks_t]
        np.testing.assert_allclose(np.concatenate(chunks_d), np.concatenate(chunks_t), atol=1e-5)
        assert driven.scheduler.idle()
    finally:
        threaded.close()
        driven.close()


def test_caller_driven_streams_batch_and_cancel_frees_the_row(folder):
    eng = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="fp32", max_batch=2)
    eng.drive_in_caller()
    try:
        alone, _ = _run(eng, 3)
        a = eng.stream(TEXT, voice="ryan", seed=3, max_new_tokens=24, first_chunk_frames=1)
        b = eng.stream("Another sentence, generated alongside.", voice="ryan", seed=4, max_new_tokens=24,
                       first_chunk_frames=1)
        first_a = next(a)
        assert len(eng.scheduler.running) == 2            # stepping a advanced b too (one batch)
        assert not b.seq.out.empty()                      # b's first chunk was made meanwhile
        rest_a = list(a)
        np.testing.assert_allclose(np.concatenate([first_a] + rest_a), np.concatenate(alone), atol=1e-4)
        next(b)
        b.cancel()                                        # steps until b has left: its row is free at once
        assert eng.scheduler.idle() and sorted(eng.scheduler.free_rows) == [0, 1]
        steps = eng.worker.steps
        list(b)                                           # what was made before the cancel, then the end
        assert eng.worker.steps == steps
    finally:
        eng.close()


def test_a_threaded_engine_cannot_switch_to_caller_driven(folder):
    eng = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="fp32")
    try:
        _run(eng, 1)
        with pytest.raises(TTSError):
            eng.drive_in_caller()
    finally:
        eng.close()
