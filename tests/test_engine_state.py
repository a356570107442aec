"""The engine's step with its state on the device (issue 28): requests arriving together are prefilled in one batch
with the same codes as one at a time; streams joining and leaving mid-run keep their codes whether the host reads each
frame at once or one frame behind the device (`EngineWorker.pipelined`); the codec's pooled decoder states decode a
batch as each row alone; `python -m bench host` runs and prints its table. fp32, tiny random checkpoints."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine

TEXTS = ["Hello there, this is the first one.", "A second text, somewhat longer than the first text is.",
         "Third."]


@pytest.fixture(scope="module")
def engine(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=3,
                                    overlap_codec=False)
    eng.drive_in_caller()
    yield eng
    eng.close()


def _open(eng, i, frames=14, first=(1, 1)):
    return eng.stream(TEXTS[i % 3], voice=eng.speakers[i % len(eng.speakers)], seed=10 + i,
                      max_new_tokens=frames, first_chunk_frames=first)


def _alone(eng, i, frames=14):
    s = _open(eng, i, frames)
    audio = np.concatenate(list(s))
    return s.codes, audio


def test_requests_arriving_together_are_prefilled_together_with_the_same_codes(engine, monkeypatch):
    alone = [_alone(engine, i) for i in range(3)]
    calls = []
    real = engine.runner.prefill_batch
    monkeypatch.setattr(engine.runner, "prefill_batch", lambda *a: calls.append(len(a[0])) or real(*a))
    streams = [_open(engine, i) for i in range(3)]   # queued together: admitted at one step
    audio = [np.concatenate(list(s)) for s in streams]
    assert calls == [3]
    for i, s in enumerate(streams):
        assert torch.equal(s.codes, alone[i][0]), i
        np.testing.assert_allclose(audio[i], alone[i][1], atol=1e-5)


def test_batched_prefill_with_the_prefix_cache_gives_the_same_codes(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=3,
                                    overlap_codec=False, prefix_cache_mb=8)
    try:
        eng.drive_in_caller()
        alone = [_alone(eng, i)[0] for i in range(3)]     # (fills the cache with the voices' prefixes)
        streams = [_open(eng, i) for i in range(3)]
        for s in streams:
            list(s)
        for i, s in enumerate(streams):
            assert torch.equal(s.codes, alone[i]), i
    finally:
        eng.close()


def test_prefill_budget_spreads_a_burst_over_steps_with_the_same_codes(engine, monkeypatch):
    """While a stream runs, newcomers are prefilled a few prompt positions per step (the running one is not held up
    by a large batch); their codes are those of one at a time."""
    alone = [_alone(engine, i, 20)[0] for i in range(3)]
    monkeypatch.setattr(engine.worker, "prefill_tokens_per_step", 1)   # one request per step
    first = _open(engine, 0, 20)
    it = iter(first)
    next(it)                                                 # it runs
    others = [_open(engine, i, 20) for i in (1, 2)]
    engine.worker.step()
    assert len(engine.worker._unprefilled) == 1             # one newcomer waits for the next step
    rest = list(it)
    for s in others:
        list(s)
    for i, s in enumerate([first] + others):
        assert torch.equal(s.codes, alone[i]), i


@pytest.mark.parametrize("pipelined, split", [(False, False), (True, False), (False, True)])
def test_streams_joining_and_leaving_mid_run_keep_their_codes(engine, pipelined, split):
    frames = [24, 6, 16]
    alone = [_alone(engine, i, frames[i])[0] for i in range(3)]
    w = engine.worker
    w.pipelined, w.split_frames = pipelined, split
    try:
        a = _open(engine, 0, frames[0])
        ia = iter(a)
        next(ia)
        b = _open(engine, 1, frames[1])      # joins while a runs, leaves first (a moves rows: compaction)
        list(b)
        c = _open(engine, 2, frames[2])      # joins after b left
        list(c)
        list(ia)
        for i, s in enumerate([a, b, c]):
            assert torch.equal(s.codes, alone[i]), i
        assert engine.scheduler.idle()
    finally:
        w.pipelined = w.split_frames = None


def test_one_read_back_per_frame_carries_codes_and_end_flags(engine):
    codes = torch.randint(0, 50, (3, 16))
    done = torch.tensor([False, True, False])
    rb = engine.runner.read_back(codes, done).wait()
    assert rb.shape == (3, 17) and rb.dtype == np.int64
    assert (rb[:, :16] == codes.numpy()).all() and rb[:, 16].tolist() == [0, 1, 0]
    assert engine.runner.read_back(codes).wait()[:, 16].tolist() == [0, 0, 0]


def test_pooled_codec_states_decode_a_batch_as_each_row_alone():
    from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
    from tts_engine.codec.state_pool import CodecStatePool
    from tts_engine.tiny import tiny_speech_tokenizer_config

    torch.manual_seed(0)
    dec = CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).eval()
    g = torch.Generator().manual_seed(3)
    book = dec.cfg.codebook_size
    with torch.inference_mode():
        pool = CodecStatePool(dec.init_state(1), rows=2)          # (grows past 2 rows below)
        solo, rows = [], []
        for i, before in enumerate((1, 3, 5)):
            st = dec.init_state(1)
            dec.decode_step(torch.randint(0, book, (1, 16, before), generator=g), st)
            solo.append(st)
            rows.append(pool.alloc(st.clone()))
        spare = pool.alloc()
        assert pool.rows >= 4 and pool.live == 4
        for step in range(2):
            codes = torch.randint(0, book, (3, 16, 2), generator=g)
            order = [2, 0, 1] if step else [0, 1, 2]              # a gather out of order, then in order
            batch = pool.decode(dec, [rows[i].slot for i in order], codes[order])
            for k, i in enumerate(order):
                alone = dec.decode_step(codes[i:i + 1], solo[i])
                torch.testing.assert_close(batch[k:k + 1], alone, atol=1e-5, rtol=0)
        for i in range(3):
            torch.testing.assert_close(rows[i].clone().pos, solo[i].pos)
        spare.free()
        rows[0].free()
        assert pool.live == 2


def test_bench_host_runs_and_prints_its_table(tmp_path, capsys):
    from bench import host

    out = tmp_path / "host.json"
    assert host.main(["--rows", "1,2", "--frames", "6", "--rounds", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cpu ms" in text and "mean ms" in text and "us/row" in text
    rows = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in rows] == [1, 2] and all(r["cpu_ms"] > 0 and r["mean_ms"] > 0 for r in rows)
