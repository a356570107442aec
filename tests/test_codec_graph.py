"""The codec decoder's CUDA-graph step (`tts_engine/gpu/codec_graph.py`), on a CPU: the same static-buffer step with
the graph replaced by an eager run on those buffers (`CodecGraphs(capture=False)`), so what is checked here is what
the graph wraps: codes and state copied in, audio and state copied out into the caller's own objects, a shape
captured once and reused, the measured choice between it and the eager step, the record `paths()` lists, the
variable that turns it off, and that an attached decoder off CUDA is left alone."""
from __future__ import annotations

import pytest
import torch

from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
from tts_engine.cpu.measured import made
from tts_engine.gpu import codec_graph
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
