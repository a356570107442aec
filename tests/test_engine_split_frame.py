"""A CPU frame in two halves (`ModelRunner.complete` / `advance`, `EngineWorker._frame_in_halves`): a chunk's audio
is decoded before the talker step that follows its last frame (first audio one talker step sooner), with the same
codes and audio as whole frames, ends cut at the same frame, and a codec failure failing only its request."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine, TTSError

TEXT = "Hello there, this is a test of the split frame."


PAIR = (dict(split_frames=False), dict())   # conftest's tiny_cv_pair: whole frames against the CPU default


@pytest.fixture(scope="module")
def engines(tiny_cv_pair):
    whole, split = tiny_cv_pair
    assert not whole.worker.split_frames and split.worker.split_frames           # the CPU default
    return whole, split


def _run(engine, **kw):
    s = engine.stream(TEXT, voice="ryan", first_chunk_frames=1, **kw)
    chunks = list(s)
    return chunks, s.codes


FIXED = {"ignore_eos": True}   # no end-of-speech: max_new_tokens - 1 frames


@pytest.mark.parametrize("kw", [dict(seed=1, max_new_tokens=40), dict(seed=2, greedy=True, max_new_tokens=7, sampling=FIXED),
                                dict(seed=3, max_new_tokens=8, sampling=FIXED)])
def test_same_codes_and_audio_as_whole_frames(engines, kw):
    whole, split = engines
    cw, codes_w = _run(whole, **kw)
    cs, codes_s = _run(split, **kw)
    assert torch.equal(codes_w, codes_s) and len(codes_s) > 0
    if "sampling" in kw:   # 6 frames: chunks 1, 2, 3 (cut); 7 frames: 1, 2, 4 (an end on a chunk's last frame)
        assert len(codes_s) == kw["max_new_tokens"] - 1
    assert [len(c) for c in cs] == [len(c) for c in cw]    # 1, 2, 4, ... frames; the last cut at the end
    np.testing.assert_array_equal(np.concatenate(cs), np.concatenate(cw))


def test_first_chunk_comes_before_the_talker_step(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=1)
    eng.drive_in_caller()
    seen = []
    orig = eng.runner._advance

    def advance(*a):
        seen.append(stream.seq.out.qsize())
        return orig(*a)

    eng.runner._advance = advance
    stream = eng.stream(TEXT, voice="ryan", seed=0, max_new_tokens=6, first_chunk_frames=1, sampling=FIXED)
    first = next(stream)
    assert len(first) == 1920 and seen[0] == 1    # the first chunk was queued before the first talker step
    rest = list(stream)
    assert sum(len(c) for c in rest) == 4 * 1920 and len(seen) == 5
    eng.close()


def test_codec_failure_between_the_halves_fails_that_request_only(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=2)
    dec = eng.model.speech_tokenizer.decoder
    orig = dec.decode_step
    calls = {"n": 0}

    def flaky(codes, state):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return orig(codes, state)

    try:
        dec.decode_step = flaky
        with pytest.raises(TTSError):
            list(eng.stream(TEXT, voice="ryan", seed=0, max_new_tokens=8, first_chunk_frames=1, sampling=FIXED))
        assert not eng.scheduler.running           # its row is free again
    finally:
        dec.decode_step = orig
    chunks = list(eng.stream(TEXT, voice="ryan", seed=1, max_new_tokens=9, first_chunk_frames=1, sampling=FIXED))
    assert sum(len(c) for c in chunks) == 8 * 1920
    eng.close()
