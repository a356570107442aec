"""The request queue and continuous batching (CPU): batched == alone, join/leave mid-stream, cancellation,
the bounded queue, and error isolation."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tts_engine import EngineBusyError, TTSEngine, TTSError

REQS = [
    dict(text="Hello there, how are you doing today?", voice="ryan", seed=1, max_new_tokens=18),
    dict(text="你好，世界！今天天气不错。", voice="vivian", seed=2, max_new_tokens=11, language="chinese"),
    dict(text="A third, rather different sentence.", voice="dylan", seed=3, max_new_tokens=25),
]


@pytest.fixture(scope="module")
def ckpt(official):
    return official("custom_voice", "0b6")[0]


def _collect(stream):
    chunks = list(stream)
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32), stream.codes


def _close(a, b) -> bool:
    """Waveforms equal up to float rounding (relative L2 < 1e-4; the random tiny codec has a large gain)."""
    return a.shape == b.shape and np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-9)


def _alone(ckpt, greedy):
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=1)
    try:
        return [_collect(eng.stream(greedy=greedy, **r)) for r in REQS]
    finally:
        eng.close()


@pytest.mark.parametrize("greedy", [True, False])
def test_batched_equals_alone(ckpt, greedy):
    alone = _alone(ckpt, greedy)
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=4)
    try:
        streams = [eng.stream(greedy=greedy, **r) for r in REQS]   # all queued before the worker runs them
        together = [_collect(s) for s in streams]
    finally:
        eng.close()
    for (wa, ca), (wb, cb) in zip(alone, together):
        assert torch.equal(ca, cb)
        assert _close(wb, wa)


def test_join_and_leave_mid_stream(ckpt):
    alone = _alone(ckpt, True)
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=2)
    try:
        a = eng.stream(greedy=True, **REQS[2])
        first = next(a)                                    # A is running...
        b = eng.stream(greedy=True, **REQS[1])             # ...when B joins; B (shorter) leaves first
        wb, cb = _collect(b)
        c = eng.stream(greedy=True, **REQS[0])             # C takes B's freed row while A still runs
        wa, ca = _collect(a)
        wc, cc = _collect(c)
    finally:
        eng.close()
    assert torch.equal(ca, alone[2][1]) and torch.equal(cb, alone[1][1]) and torch.equal(cc, alone[0][1])
    assert _close(np.concatenate([first, wa]), alone[2][0])


def test_cancel_frees_the_row_within_a_frame(ckpt):
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=2)
    try:
        s = eng.stream("Cancel me please, this is long.", voice="aiden", seed=0, max_new_tokens=400,
                       sampling={"repetition_penalty": 1.0})
        next(s)
        steps_at_cancel = eng.worker.steps
        s.cancel()
        deadline = time.time() + 10
        while eng.scheduler.running and time.time() < deadline:
            time.sleep(0.005)
        assert not eng.scheduler.running and len(eng.scheduler.free_rows) == 2
        assert eng.worker.steps - steps_at_cancel <= 1
        list(s)  # the stream ends cleanly after cancel
        w, c = _collect(eng.stream(greedy=True, **REQS[1]))   # and the engine keeps serving
        assert c.shape[0] > 0
    finally:
        eng.close()


def test_bounded_queue_fails_fast_with_busy(ckpt):
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=1, max_waiting=2)
    try:
        running = eng.stream("Long running request.", voice="eric", seed=0, max_new_tokens=300)
        next(running)
        waiting = [eng.stream("Waiting.", voice="eric", seed=i, max_new_tokens=3) for i in range(2)]
        assert [w.position for w in waiting] == [0, 1]
        t0 = time.perf_counter()
        with pytest.raises(EngineBusyError, match="busy"):
            eng.stream("One too many.", voice="eric", seed=9, max_new_tokens=3)
        assert time.perf_counter() - t0 < 1.0
        running.cancel()
        for w in waiting:
            assert _collect(w)[1].shape[0] >= 1
    finally:
        eng.close()


@pytest.mark.parametrize("exc", [RuntimeError("injected fault"), torch.cuda.OutOfMemoryError("CUDA out of memory")])
def test_error_in_one_request_fails_only_that_request(ckpt, exc):
    alone = _alone(ckpt, True)
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=4)
    real_decode = eng.runner.decode
    poisoned = {}

    def decode(rows):
        if poisoned.get("row") in rows and eng.worker.steps >= 3:
            raise exc
        return real_decode(rows)

    eng.runner.decode = decode
    try:
        streams = [eng.stream(greedy=True, **r) for r in REQS]
        bad = eng.stream("This one breaks.", voice="sohee", seed=5, max_new_tokens=30, greedy=True)
        poisoned["row"] = None
        deadline = time.time() + 10
        while bad.seq.row is None and time.time() < deadline:
            time.sleep(0.001)
        poisoned["row"] = bad.seq.row
        results = [_collect(s) for s in streams]
        with pytest.raises(TTSError) as info:
            _collect(bad)
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            assert "out of memory" in str(info.value)
        for (wa, ca), (wb, cb) in zip(alone, results):
            assert torch.equal(ca, cb)
        eng.runner.decode = real_decode
        assert _collect(eng.stream(greedy=True, **REQS[1]))[1].shape[0] > 0   # still serving
    finally:
        eng.close()


def test_prefill_error_fails_only_that_request(ckpt):
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=4)
    real_prefill = eng.runner.prefill

    def prefill(row, prompt, params):
        if params.seed == 666:
            raise RuntimeError("boom")
        return real_prefill(row, prompt, params)

    eng.runner.prefill = prefill
    try:
        good = eng.stream(greedy=True, **REQS[0])
        bad = eng.stream("Bad.", voice="ryan", seed=666, max_new_tokens=5)
        with pytest.raises(TTSError, match="synthesis failed"):
            list(bad)
        assert _collect(good)[1].shape[0] > 0
        assert len(eng.scheduler.free_rows) == 4
    finally:
        eng.close()


def test_submit_is_thread_safe(ckpt):
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=3, max_waiting=32)
    out, errors = {}, []

    def client(i):
        try:
            out[i] = _collect(eng.stream("Thread safe?", voice="serena", seed=i % 3, max_new_tokens=6, greedy=True))[1]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        eng.close()
    assert not errors and len(out) == 8
    assert all(torch.equal(out[i], out[0]) for i in range(8))   # greedy: the same request, the same codes


def test_static_frame_equals_eager_frame(ckpt):
    """The captured (GPU) path runs `frame(b, L, general=True)`: the same computation for a batch bucket b >= B
    (padding rows), a length bucket L >= the longest row, and the general sampler (top-k candidates, top-p
    always on). On the CPU it runs eagerly; it must give the codes of the exact path, greedy and sampled."""
    results = {}
    for general in (False, True):
        eng = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=4, use_cuda_graphs=False)
        r = eng.runner
        for row, (req, greedy) in enumerate([(REQS[0], True), (REQS[1], False)]):
            q, _ = eng._make_request(req["text"], req["voice"], req.get("language", "auto"), None, req["seed"],
                                     None, greedy, 40, None, 2, 12)
            r.prefill(row, q.prompt, q.params)
        out = []
        with torch.inference_mode():
            for _ in range(8):
                read_len = max(r.host_len[:2]) + 1
                if general:
                    codes, done = r.frame(4, 128, general=True)   # bucket 4 (rows 2, 3 are padding), L=128
                    codes, done = codes[:2].clone(), done[:2].clone()
                else:
                    codes, done = r.frame(2, read_len, general=False)
                for i in range(2):
                    r.host_len[i] += 1
                out.append(codes)
        results[general] = torch.stack(out)
        eng.close()
    assert torch.equal(results[False], results[True])
