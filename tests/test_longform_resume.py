"""The engine's `reproducible` requests (what long-form segments are): a request's samples are the same bits alone
and beside other streams, whichever frame they joined at (its chunks keep their own schedule and decode alone),
so a job continued after a stop or a restart gives the files of a straight run (tests/test_longform.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine, make_tiny

TEXT = "The first chapter begins here. It has two sentences."
OTHER = "A second paragraph follows it here, a little longer than the first one."
KW = dict(voice="ryan", max_new_tokens=30, first_chunk_frames=(1, 1))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ck = make_tiny(tmp_path_factory.mktemp("repro") / "cv", kind="custom_voice", size="0b6", seed=0)
    eng = TTSEngine.from_pretrained(str(ck), device="cpu")
    yield eng
    eng.close()


def _alone(engine, text, seed, **kw):
    s = engine.stream(text, seed=seed, **KW, **kw)
    audio = np.concatenate(list(s))
    return s.codes.clone(), audio


def _joining(engine, seed, at_chunk: int, **kw):
    """TEXT submitted at the `at_chunk`-th chunk of another stream (as the page's loop submits the next part)."""
    other = engine.stream(OTHER, seed=5, **KW)
    s = None
    for k, _ in enumerate(other, 1):
        if k == at_chunk:
            s = engine.stream(TEXT, seed=seed, **KW, **kw)
    s = s or engine.stream(TEXT, seed=seed, **KW, **kw)
    audio = np.concatenate(list(s))
    return s.codes.clone(), audio


def test_a_reproducible_request_is_the_same_bits_beside_other_streams(engine):
    codes, ref = _alone(engine, TEXT, 11, reproducible=True)
    for at in (1, 2, 3, 5):
        c, a = _joining(engine, 11, at, reproducible=True)
        assert torch.equal(c, codes), at
        assert a.tobytes() == ref.tobytes(), at
    # several streams at once, admitted together
    streams = [engine.stream(TEXT, seed=11, **KW, reproducible=True)] + \
        [engine.stream(OTHER, seed=s, **KW) for s in (6, 7, 8)]
    outs = [np.concatenate(list(s)) for s in streams]
    assert outs[0].tobytes() == ref.tobytes()


def test_reproducible_changes_nothing_for_a_lone_stream(engine):
    """Alone, the option cuts the same chunks as without it: the same samples."""
    c0, a0 = _alone(engine, TEXT, 12)
    c1, a1 = _alone(engine, TEXT, 12, reproducible=True)
    assert torch.equal(c0, c1) and a0.tobytes() == a1.tobytes()
