"""The batched prefill's CUDA graphs per (batch, token, read) bucket (`tts_engine/gpu/prefill_graph.py`), on a CPU:
the graph replaced by the same padded static-buffer call run eagerly (`PrefillGraphs(capture=False)`), so what is
checked here is what a graph replays: prompts padded to the token bucket, the batch padded into free cache rows, the
read length bucketed, with the same codes as the exact eager prefill (fp32) for the new streams and for a stream
already running beside them; the measured choice, its fallbacks (one log line each), the variable, the remembered
verdict and the `paths()` entry."""
from __future__ import annotations

import logging

import pytest
import torch

from tts_engine import TTSEngine
from tts_engine.gpu import prefill_graph
from tts_engine.gpu.prefill_graph import GRAPH, PrefillGraphs

TEXTS = ["Hello there, this is the first one.", "A second text, somewhat longer than the first text is.",
         "Third.", "The fourth request has a sentence of its own.", "Fifth and last, a little longer again."]


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch, tmp_path):
    """Each test its own cache folder (remembered verdicts) and the variable unset."""
    from tts_engine import cache_paths

    monkeypatch.setenv(cache_paths.ENV, str(tmp_path))
    monkeypatch.delenv(prefill_graph.ENV, raising=False)


@pytest.fixture(scope="module")
def engine(tiny_cv_folder):
    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=8,
                                    overlap_codec=False)
    eng.drive_in_caller()
    eng.worker.prefill_tokens_per_step = 1 << 20   # every newcomer of a step in one batch
    yield eng
    eng.close()


def _open(eng, i, frames=10):
    return eng.stream(TEXTS[i % len(TEXTS)], voice=eng.speakers[i % len(eng.speakers)], seed=20 + i,
                      max_new_tokens=frames, first_chunk_frames=(1, 1))


@pytest.fixture(scope="module")
def alone(engine):
    """Each request's codes run alone, with the plain eager prefill."""
    assert engine.runner.prefill_graphs is None   # (a CPU runner gets none)
    out = []
    for i in range(len(TEXTS)):
        s = _open(engine, i)
        list(s)
        out.append(s.codes)
    return out


def _with(engine, pg):
    engine.runner.prefill_graphs = pg
    engine.runner.path_entries[prefill_graph.PART] = pg


@pytest.fixture
def graphs(engine, alone):
    pg = PrefillGraphs(engine.runner, capture=False, mode="on", follow_frame_graphs=False)
    _with(engine, pg)
    yield pg
    engine.runner.prefill_graphs = None
    engine.runner.path_entries.pop(prefill_graph.PART, None)


def test_buckets():
    assert prefill_graph._ladder(64, 1) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert prefill_graph._ladder(20, 1)[-1] == 20 and prefill_graph._ladder(1000, 16)[:4] == [16, 24, 32, 48]
    assert prefill_graph.bucket(5, [1, 2, 4, 6]) == 6 and prefill_graph.bucket(7, [1, 2, 4, 6]) is None


def test_requests_arriving_together_get_the_eager_codes_through_padded_buckets(engine, alone, graphs, monkeypatch):
    graphs.token_ladder = [64] + [n for n in graphs.token_ladder if n > 64]   # (coarse: these prompts get padded)
    calls = []
    real = PrefillGraphs._shape_of
    monkeypatch.setattr(PrefillGraphs, "_shape_of", lambda self, x, *a: calls.append(tuple(x.shape[:2]))
                        or real(self, x, *a))
    streams = [_open(engine, i) for i in range(5)]   # queued together: one prefill of 5 rows, bucket 6
    for s in streams:
        list(s)
    for i, s in enumerate(streams):
        assert torch.equal(s.codes, alone[i]), i
    assert graphs.calls[GRAPH] >= 1
    (b, T, R), = [k for k, s in graphs.shapes.items() if s is not None]
    assert calls == [(5, calls[0][1])] and calls[0][1] < T    # padded: a row into a free cache row, and positions
    assert b == 6 and T == 64 and R >= calls[0][1]   # (the read length: the longest prompt's bucket)
    e = engine.paths()[prefill_graph.PART]
    assert e["path"] == "cuda graphs" and "6x" in e["why"] and e["how"] == f"forced by {prefill_graph.ENV}"


def test_a_running_stream_beside_a_padded_prefill_keeps_its_codes(engine, alone, graphs):
    first = _open(engine, 0, 10)
    it = iter(first)
    next(it)                                         # it runs in row 0
    others = [_open(engine, i) for i in range(1, 5)]  # 4 arrive: bucket 4; then 3 free rows of 8
    rest = list(it)
    assert rest is not None
    for s in others:
        list(s)
    for i, s in enumerate([first] + others):
        assert torch.equal(s.codes, alone[i]), i
    assert graphs.calls[GRAPH] >= 1


def test_too_few_free_rows_gives_the_exact_batch(engine):
    pg = PrefillGraphs(engine.runner, capture=False, mode="on", follow_frame_graphs=False)
    r = engine.runner
    x = torch.zeros(5, 20, 8)
    key, pad = pg._shape_of(x, read_len=30, write_start=0)
    assert key == (6, 24, 32) and len(pad) == 1 and r.params[pad[0]] is None
    taken = [i for i in range(r.rows) if r.params[i] is None]
    try:
        for i in taken:
            r.params[i] = object()
        key, pad = pg._shape_of(x, read_len=30, write_start=0)
        assert key == (5, 24, 32) and pad == []
    finally:
        for i in taken:
            r.params[i] = None
    assert pg._shape_of(x, read_len=r.max_len, write_start=None) == (None, None)   # padding past the cache


def test_a_bucket_that_disagrees_is_served_eagerly_with_one_line(engine, alone, monkeypatch, caplog):
    pg = PrefillGraphs(engine.runner, capture=False, mode="auto", follow_frame_graphs=False)
    _with(engine, pg)
    real = prefill_graph._Shape.run
    monkeypatch.setattr(prefill_graph._Shape, "run", lambda self: real(self) + 0.5)
    try:
        with caplog.at_level("WARNING", logger="tts_engine"):
            streams = [_open(engine, i) for i in range(3)]
            for s in streams:
                list(s)
    finally:
        engine.runner.prefill_graphs = None
    for i, s in enumerate(streams):
        assert torch.equal(s.codes, alone[i]), i
    assert pg.shapes and all(s is None for s in pg.shapes.values())
    e = pg.entry()
    assert e["path"] == "eager" and "hidden differs" in e["why"]
    assert sum("prefill CUDA graph" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("where", ["capture", "replay"])
def test_a_bucket_that_raises_falls_back_with_one_line(engine, alone, monkeypatch, caplog, where):
    pg = PrefillGraphs(engine.runner, capture=False, mode="on", follow_frame_graphs=False)
    _with(engine, pg)
    if where == "capture":
        def boom(*a, **k):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        monkeypatch.setattr(prefill_graph._Shape, "__init__", boom)
    try:
        with caplog.at_level("WARNING", logger="tts_engine"):
            first = [_open(engine, i) for i in range(3)]
            for s in first:
                list(s)
            if where == "replay":
                monkeypatch.setattr(prefill_graph._Shape, "run", lambda self: (_ for _ in ()).throw(
                    RuntimeError("CUDA error: an illegal memory access was encountered")))
                again = [_open(engine, i) for i in range(3)]
                for s in again:
                    list(s)
                first += again
    finally:
        engine.runner.prefill_graphs = None
    for i, s in enumerate(first):
        assert torch.equal(s.codes, alone[i % 3]), i
    assert all(s is None for s in pg.shapes.values())
    assert ("raised" in pg.entry()["why"]) and sum("prefill CUDA graph" in r.message for r in caplog.records) == 1


def test_a_later_process_takes_the_remembered_verdict_without_a_trial(engine, alone, monkeypatch):
    first = PrefillGraphs(engine.runner, capture=False, mode="auto", follow_frame_graphs=False)
    _with(engine, first)
    try:
        for s in [_open(engine, i) for i in range(3)]:
            list(s)
        kept = {k: s is not None for k, s in first.shapes.items()}
        assert first.entry()["how"] == "measured now"
        trials = []
        real_trial = prefill_graph.MeasuredChoice.trial
        monkeypatch.setattr(prefill_graph.MeasuredChoice, "trial",
                            lambda *a, **k: trials.append(1) or real_trial(*a, **k))
        later = PrefillGraphs(engine.runner, capture=False, mode="auto", follow_frame_graphs=False)
        _with(engine, later)
        streams = [_open(engine, i) for i in range(3)]
        for s in streams:
            list(s)
    finally:
        engine.runner.prefill_graphs = None
    assert trials == [] and {k: s is not None for k, s in later.shapes.items()} == kept
    assert later.entry()["how"] == "remembered"
    for i, s in enumerate(streams):
        assert torch.equal(s.codes, alone[i]), i


def test_off_without_frame_graphs_and_on_a_cpu_runner(engine, monkeypatch):
    r = engine.runner
    assert prefill_graph.attach(r) is None and r.prefill_graphs is None          # not CUDA: nothing to do
    pg = PrefillGraphs(r, capture=False)                                          # follows the frame graphs: none
    assert not pg.active() and pg.entry() == {"path": "eager", "how": "default",
                                              "why": "the engine's CUDA graphs are off"}
    monkeypatch.setenv(prefill_graph.ENV, "0")
    off = PrefillGraphs(r, capture=False, follow_frame_graphs=False)
    assert not off.active() and off.entry()["how"] == f"forced by {prefill_graph.ENV}"
    x = torch.zeros(2, 4, r.talker.cfg.hidden_size)
    calls = []
    monkeypatch.setattr(r.talker.model, "run", lambda *a, **k: calls.append(1) or "eager")
    assert off.run(x, r.cache, slice(0, 2), torch.zeros(2, dtype=torch.long), 4) == "eager" and calls == [1]
    assert off.shapes == {}
