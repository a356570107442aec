"""The codec decoder's CUDA-graph step (`tts_engine/gpu/codec_graph.py`), on a CPU: the same static-buffer step with
the graph replaced by an eager run on those buffers (`CodecGraphs(capture=False)`), so what is checked here is what
the graph wraps: codes and state copied in, audio and state copied out into the caller's own objects, a shape
captured once and reused, the measured choice between it and the eager step, the record `paths()` lists, the
variable that turns it off, and that an attached decoder off CUDA is left alone."""
from __future__ import annotations

import contextlib
import time
import types

import pytest
import torch

from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
from tts_engine.cpu.measured import made
from tts_engine.gpu import codec_graph, codec_stream
from tts_engine.tiny import tiny_speech_tokenizer_config

CHUNKS = (2, 4, 8, 4, 2, 4)   # a stream's chunk sizes: shapes repeat, so captured graphs are reused


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch, tmp_path):
    """Each test its own cache folder: verdicts remembered by one test are not another's."""
    from tts_engine import cache_paths

    monkeypatch.setenv(cache_paths.ENV, str(tmp_path))


def _dec():
    torch.manual_seed(0)
    return CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).eval()


def _stream(dec, codes, rows=1):
    st = dec.init_state(rows)
    out, o = [], 0
    with torch.inference_mode():
        for n in CHUNKS:
            out.append(dec.decode_step(codes[..., o:o + n], st))
            o += n
    return torch.cat(out, -1), st


@pytest.mark.parametrize("rows", [1, 3])
def test_static_buffer_steps_give_the_eager_audio_and_state(rows, monkeypatch):
    monkeypatch.delenv(codec_graph.ENV, raising=False)
    dec = _dec()
    codes = torch.randint(0, dec.cfg.codebook_size, (rows, 16, sum(CHUNKS)), generator=torch.Generator().manual_seed(2))
    want, want_state = _stream(dec, codes, rows)
    graphs = codec_graph.CodecGraphs(dec, capture=False)
    dec.fast_step = graphs
    got, got_state = _stream(dec, codes, rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(codec_graph._state_tensors(got_state), codec_graph._state_tensors(want_state)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert set(graphs.shapes) == {(rows, 2), (rows, 4), (rows, 8)}   # each shape captured once, then reused
    # the caller's state owns its tensors: nothing it holds is a graph's static buffer
    statics = {t.data_ptr() for g in graphs.shapes.values() if g is not None
               for t in codec_graph._state_tensors(g.state_out) + codec_graph._state_tensors(g.state_in)}
    assert not statics & {t.data_ptr() for t in codec_graph._state_tensors(got_state)}
    rec = graphs.record()
    assert rec["how"] == "measured now" and "x2" in rec["why"]
    assert made()["codec graphs"]["path"] == rec["path"]


def test_a_step_that_disagrees_is_served_eagerly_with_one_line(monkeypatch, caplog):
    monkeypatch.delenv(codec_graph.ENV, raising=False)
    dec = _dec()
    codes = torch.randint(0, dec.cfg.codebook_size, (1, 16, sum(CHUNKS)), generator=torch.Generator().manual_seed(3))
    want, _ = _stream(dec, codes)
    graphs = codec_graph.CodecGraphs(dec, capture=False)
    real_run = codec_graph._Graph.run

    def wrong(self, c, s):   # a graph whose audio is off: the check must catch it and keep eager for its shape
        return real_run(self, c, s) + 0.5

    monkeypatch.setattr(codec_graph._Graph, "run", wrong)
    dec.fast_step = graphs
    with caplog.at_level("WARNING", logger="tts_engine"):
        got, _ = _stream(dec, codes)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)    # every chunk served eagerly
    assert all(g is None for g in graphs.shapes.values())
    assert graphs.record()["path"] == "eager" and "audio differs" in graphs.record()["why"]
    assert sum("codec CUDA graph" in r.message for r in caplog.records) == len(graphs.shapes)


def test_the_variable_turns_it_off_and_a_cpu_decoder_is_left_alone(monkeypatch):
    dec = _dec()
    assert codec_graph.attach(dec) is None and dec.fast_step is None           # weights on the CPU: nothing to do
    monkeypatch.setenv(codec_graph.ENV, "0")
    assert codec_graph.attach(dec) is None
    assert {k: made()["codec graphs"][k] for k in ("path", "how")} == {"path": "eager",
                                                                      "how": f"forced by {codec_graph.ENV}"}
    graphs = codec_graph.CodecGraphs(dec, capture=False)
    dec.fast_step = graphs
    codes = torch.randint(0, dec.cfg.codebook_size, (1, 16, sum(CHUNKS)), generator=torch.Generator().manual_seed(4))
    _stream(dec, codes)
    assert graphs.shapes == {}                                                 # off: never captured


def test_a_later_process_takes_the_remembered_verdict_without_a_trial(monkeypatch):
    monkeypatch.delenv(codec_graph.ENV, raising=False)
    dec = _dec()
    codes = torch.randint(0, dec.cfg.codebook_size, (1, 16, sum(CHUNKS)), generator=torch.Generator().manual_seed(5))
    want, _ = _stream(dec, codes)
    first = codec_graph.CodecGraphs(dec, capture=False)
    dec.fast_step = first
    _stream(dec, codes)
    kept = {k for k, g in first.shapes.items() if g is not None}
    trials = []
    real_trial = codec_graph.MeasuredChoice.trial
    monkeypatch.setattr(codec_graph.MeasuredChoice, "trial", lambda *a, **k: trials.append(1) or real_trial(*a, **k))
    later = codec_graph.CodecGraphs(dec, capture=False)   # a restart, or a ZeroGPU worker: same machine and code
    dec.fast_step = later
    got, _ = _stream(dec, codes)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert trials == [] and {k for k, g in later.shapes.items() if g is not None} == kept
    assert later.record()["how"] == "remembered"


def test_pooled_decodes_copy_the_state_once_each_way(monkeypatch):
    """A `CodecStatePool`'s batched decode through a served shape gathers its rows straight into the graph's static
    inputs and writes the outputs straight back (`decode_pooled`): no gathered state, no clone of the outputs; the
    audio and the pool's states are the eager step's, rows in any order."""
    from tts_engine.codec.state_pool import CodecStatePool

    monkeypatch.setenv(codec_graph.ENV, "1")   # (every shape served by its graph: the timing is not under test)
    ref, dec = _dec(), _dec()
    streams = 3
    codes = torch.randint(0, dec.cfg.codebook_size, (streams, 16, 2 * sum(CHUNKS)),
                          generator=torch.Generator().manual_seed(6))
    graphs = codec_graph.CodecGraphs(dec, capture=False)
    dec.fast_step = graphs
    read = CodecStatePool.read
    ref_state = ref.init_state(streams)
    with torch.inference_mode():
        pool = CodecStatePool(dec.init_state(1), rows=4)
        rows = [pool.alloc() for _ in range(streams)]
        copies = {"read_into": 0, "write": 0}
        for name in copies:
            real = getattr(CodecStatePool, name)
            monkeypatch.setattr(CodecStatePool, name, lambda self, *a, _r=real, _n=name: copies.__setitem__(
                _n, copies[_n] + 1) or _r(self, *a))
        o = 0
        for rnd in range(2):
            if rnd == 1:   # every shape served now: nothing may copy the state between the pool and the graph
                monkeypatch.setattr(CodecStatePool, "read", lambda *a: pytest.fail("a gathered state"))
                monkeypatch.setattr(codec_graph._Graph, "run", lambda *a: pytest.fail("the outputs cloned"))
                copies.update(read_into=0, write=0)
            for k, n in enumerate(CHUNKS):
                order = [2, 0, 1] if (rnd + k) % 2 else [0, 1, 2]   # gathers out of order and in order
                chunk = codes[..., o:o + n]
                want = ref.decode_step_eager(chunk, ref_state)
                got = pool.decode(dec, [rows[i].slot for i in order], chunk[order])
                torch.testing.assert_close(got, want[order], atol=1e-5, rtol=1e-5)
                o += n
        assert copies == {"read_into": len(CHUNKS), "write": len(CHUNKS)}
        got_state = read(pool, [r.slot for r in rows])
    for a, b in zip(codec_graph._state_tensors(got_state), codec_graph._state_tensors(ref_state)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert set(graphs.shapes) == {(3, 2), (3, 4), (3, 8)} and all(g is not None for g in graphs.shapes.values())


class _Streams(codec_stream.CudaStreams):
    """A stand-in for CUDA's stream operations on a CPU: records them, and whether a decode runs on the side stream."""

    def __init__(self, fail_new=False):
        self.log, self.on_side, self.fail_new = [], False, fail_new

    def available(self, device):
        return True

    def new(self, device):
        if self.fail_new:
            raise RuntimeError("CUDA error: out of memory")
        self.log.append("new")
        streams = self

        class Side:
            def wait_stream(self, other):
                streams.log.append(f"wait {other}")
        return Side()

    def current(self, device):
        return "current"

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append("enter")
        self.on_side = True
        try:
            yield
        finally:
            self.on_side = False
            self.log.append("exit")

    def done_event(self, stream):
        return types.SimpleNamespace(synchronize=lambda: self.log.append("wait for the decode"))

    def synchronize(self, device):
        self.log.append("synchronize")


def test_decodes_on_their_own_stream_wait_for_their_inputs_and_are_waited_for(monkeypatch):
    """On its own stream (forced on): the stream waits for the caller's, the decode runs inside it, the caller waits for
    that stream alone after; the audio is the eager step's. Off: no stream operation at all."""
    monkeypatch.setenv(codec_graph.ENV, "1")
    dec, ref = _dec(), _dec()
    codes = torch.randint(0, dec.cfg.codebook_size, (1, 16, sum(CHUNKS)), generator=torch.Generator().manual_seed(8))
    want, _ = _stream(ref, codes)
    graphs = codec_graph.CodecGraphs(dec, capture=False)
    seen = []
    real = codec_graph._Graph.run
    monkeypatch.setattr(codec_graph._Graph, "run", lambda self, c, s: seen.append(st.on_side) or real(self, c, s))
    st = _Streams()
    graphs.stream = codec_stream.CodecStream(mode="on", streams=st)
    dec.fast_step = graphs
    got, _ = _stream(dec, codes)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    served = len(CHUNKS) - len(graphs.shapes)                    # (a shape's first call is its trial: not on it)
    assert seen.count(True) == served and served > 0
    assert st.log[:5] == ["new", "wait current", "enter", "exit", "wait for the decode"]
    assert st.log.count("new") == 1 and st.log.count("wait for the decode") == served
    assert graphs.stream.entry()["path"] == codec_stream.OWN
    off = _Streams()
    graphs.stream = codec_stream.CodecStream(mode="off", streams=off)
    _stream(dec, codes)
    assert off.log == [] and {k: graphs.stream.entry()[k] for k in ("path", "how")} == {
        "path": codec_stream.SAME, "how": f"forced by {codec_stream.ENV}"}


def test_a_stream_that_fails_leaves_the_decode_on_the_callers_stream_with_one_line(monkeypatch, caplog):
    cs = codec_stream.CodecStream(mode="on", streams=_Streams(fail_new=True))
    ran = []
    with caplog.at_level("WARNING", logger="tts_engine"):
        for _ in range(3):
            with cs.scope(torch.device("cpu")):
                ran.append(1)
    assert ran == [1, 1, 1] and not cs.own(torch.device("cpu"))
    assert cs.entry()["path"] == codec_stream.SAME and cs.entry()["how"] == "fell back"
    assert sum("own CUDA stream" in r.message for r in caplog.records) == 1


def test_the_measured_verdict_is_what_a_later_process_serves(monkeypatch):
    """`measure`: a decode on a second thread beside frames, same stream against its own; the faster is remembered and
    a later process's stream takes it without measuring (unmeasured: the same stream)."""
    monkeypatch.delenv(codec_stream.ENV, raising=False)
    dev = torch.device("cpu")
    fresh = codec_stream.CodecStream(streams=_Streams())
    assert not fresh.own(dev) and "not measured" in fresh.entry()["why"]
    st = _Streams()
    cs = codec_stream.CodecStream(streams=st)
    # the stand-in's "GPU": on the frames' stream a decode queues behind them (slow), beside them it does not
    ms = cs.measure(dev, frame=lambda: None, decode=lambda: time.sleep(0.001 if st.on_side else 0.02), rounds=3)
    assert set(ms) == {codec_stream.SAME, codec_stream.OWN} and ms[codec_stream.OWN] < ms[codec_stream.SAME]
    assert cs.entry()["path"] == codec_stream.OWN and cs.entry()["how"] == "measured now"
    later = codec_stream.CodecStream(streams=_Streams())
    assert later.own(dev) and later.entry()["how"] == "remembered"
    assert made()["codec stream"]["path"] == codec_stream.OWN
