"""The length from which each int8 conv of the codec decoder is used (`codec/int8_threshold.py`): measured per conv
shape on the CPU at hand, remembered per machine, applied to each conv (`Int8Conv.min_positions`), off with
TTS_KERNEL_TUNE=0 (every conv keeps `int8_conv.MIN_POSITIONS`)."""
from __future__ import annotations

import json

import pytest
import torch

from tts_engine.codec import int8_conv, int8_threshold, packed_conv
from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
from tts_engine.tiny import tiny_speech_tokenizer_config

needs_int8 = pytest.mark.skipif(not (int8_conv.available() and packed_conv.available()),
                                reason="no oneDNN int8 convolutions in this torch")


def _dec():
    torch.manual_seed(0)
    d = CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).eval()
    d.set_conv_mode("int8")
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TTS_KERNEL_TUNE", raising=False)
    return tmp_path / "codec_int8"


def _rows(int8_from_frames: int | None, up: int = 10):
    """Timings where int8 is faster from `int8_from_frames` frames on (None: never)."""
    return [{"frames": n, "positions": n * up, "packed_ms": 1.0,
             "int8_ms": 0.5 if int8_from_frames is not None and n >= int8_from_frames else 1.2}
            for n in int8_threshold.LADDER]


def test_threshold_is_where_int8_pays_from_there_on():
    assert int8_threshold.threshold(_rows(1)) == 10
    assert int8_threshold.threshold(_rows(4)) == 40
    assert int8_threshold.threshold(_rows(None)) == int8_threshold.NEVER
    rows = _rows(1)
    rows[-1]["int8_ms"] = 0.97                      # not faster by the margin at the longest: never
    assert int8_threshold.threshold(rows) == int8_threshold.NEVER
    rows = _rows(1)
    rows[1]["int8_ms"] = 1.5                        # a loss at 2 frames: only from 4 on
    assert int8_threshold.threshold(rows) == 40


@needs_int8
def test_measured_per_shape_remembered_and_applied(cache, monkeypatch):
    dec = _dec()
    shapes = sorted({int8_threshold.shape_key(m) for m in dec.int8_convs()})
    assert len(shapes) >= 4                          # (first conv, and per block: transposed, k=7, k=1)
    timed = []
    pays = {s: (None if i % 3 == 0 else 1 + i % 2) for i, s in enumerate(shapes)}   # some never, some from 1 or 2

    def fake(m, dtype, ladder=int8_threshold.LADDER, rounds=None):
        timed.append(int8_threshold.shape_key(m))
        return _rows(pays[int8_threshold.shape_key(m)], m.up)

    monkeypatch.setattr(int8_threshold, "time_shape", fake)
    table = int8_threshold.apply(dec, torch.float32)
    assert sorted(timed) == shapes                   # each distinct shape once
    for m in dec.int8_convs():
        want = pays[int8_threshold.shape_key(m)]
        assert m.int8_min_positions == table[int8_threshold.shape_key(m)] == \
            (int8_threshold.NEVER if want is None else want * m.up)
    files = list(cache.glob("*.json"))
    assert len(files) == 1 and json.loads(json.loads(files[0].read_text())["choice"]) == table
    timed.clear()
    again = _dec()
    assert int8_threshold.apply(again, torch.float32) == table and not timed      # remembered: nothing timed
    assert [m.int8_min_positions for m in again.int8_convs()] == [m.int8_min_positions for m in dec.int8_convs()]
    int8_threshold.apply(_dec(), torch.bfloat16)    # another dtype is another key: measured again
    assert sorted(timed) == shapes


@needs_int8
def test_each_conv_takes_int8_from_its_own_threshold(cache, monkeypatch):
    dec = _dec()
    convs = dec.int8_convs()
    for i, m in enumerate(convs):                    # every other conv: int8 never; the rest: always
        m.int8_min_positions = int8_threshold.NEVER if i % 2 else 0
    calls = []
    real = int8_conv.Int8Conv.int8_row
    monkeypatch.setattr(int8_conv.Int8Conv, "int8_row", lambda self, x4: (calls.append(id(self)), real(self, x4))[1])
    with torch.inference_mode():
        dec(torch.randint(0, 2048, (2, 16, 3), generator=torch.Generator().manual_seed(0)))
    used = {id(m._pk8[1]) for m in convs if getattr(m, "_pk8", None) is not None and id(m._pk8[1]) in calls}
    assert used == {id(m._pk8[1]) for i, m in enumerate(convs) if i % 2 == 0}
    assert len(calls) == 2 * len(used)               # one int8 call per row (rows on their own)


@needs_int8
def test_tuning_off_measures_nothing(cache, monkeypatch):
    monkeypatch.setenv("TTS_KERNEL_TUNE", "0")
    monkeypatch.setattr(int8_threshold, "time_shape", lambda *a, **k: pytest.fail("measured with tuning off"))
    dec = _dec()
    assert int8_threshold.apply(dec, torch.float32) is None
    assert all(m.int8_min_positions is None for m in dec.int8_convs()) and not cache.exists()


@needs_int8
def test_a_real_measurement_gives_a_threshold_for_every_conv(cache):
    dec = _dec()
    before = torch.get_num_threads()
    got = int8_threshold.measure(dec, torch.float32)
    assert torch.get_num_threads() == before         # (timed on a helper thread at one thread)
    assert set(got) == {int8_threshold.shape_key(m) for m in dec.int8_convs()}
    for v in got.values():
        assert [r["frames"] for r in v["rows"]] == list(int8_threshold.LADDER)
        assert all(r["int8_ms"] > 0 and r["packed_ms"] > 0 for r in v["rows"])
        assert v["threshold"] == int8_threshold.threshold(v["rows"])
