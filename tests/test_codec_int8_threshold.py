"""From how many positions per row the codec decoder's int8 convs are used (`tts_engine/cpu/codec_int8_threshold.py`): chosen by
timing the decoder with each candidate on the CPU at hand, remembered per machine, applied to every int8 conv
(`Int8Conv.min_positions`), off with TTS_KERNEL_TUNE=0 (`int8_conv.MIN_POSITIONS` stays)."""
from __future__ import annotations

import json

import pytest
import torch

from tts_engine.cpu import int8_conv
from tts_engine.cpu import codec_int8_threshold as int8_threshold
from tts_engine.cpu import packed_conv
from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
from tts_engine.tiny import tiny_speech_tokenizer_config

needs_int8 = pytest.mark.skipif(not (int8_conv.available() and packed_conv.available()),
                                reason="no oneDNN int8 convolutions in this torch")


def _dec():
    torch.manual_seed(0)
    return CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TTS_KERNEL_TUNE", raising=False)
    return tmp_path / "codec_int8"


def test_pick_is_the_fastest_or_a_larger_one_as_fast():
    assert int8_threshold.pick({64: 10.0, 128: 9.0, 256: 9.5, 512: 12.0}) == 128
    assert int8_threshold.pick({64: 10.0, 128: 9.0, 256: 9.2, 512: 12.0}) == 256    # within 3 %: fewer lossy calls
    assert int8_threshold.pick({64: 8.0, 128: 9.0, 256: 9.5, 512: 12.0}) == 64


def _fake_decoder_times(monkeypatch, ms_by_threshold, timed):
    def fake(dec):
        t = dec.int8_convs()[0].int8_min_positions
        assert dec.conv_mode == "int8" and all(m.int8_min_positions == t for m in dec.int8_convs())
        assert torch.get_num_threads() == 1                   # (the codec thread's threads)
        timed.append(t)
        return ms_by_threshold[t] / 1000 * sum(int8_threshold.TIMED_CHUNKS)

    monkeypatch.setattr(int8_threshold, "time_decoder", fake)


@needs_int8
@pytest.mark.parametrize("fastest", [64, 256])
def test_measured_remembered_and_applied(cache, monkeypatch, fastest):
    timed = []
    _fake_decoder_times(monkeypatch, {t: (5.0 if t == fastest else 9.0) for t in int8_threshold.CANDIDATES}, timed)
    dec = _dec()
    before = torch.get_num_threads()
    assert int8_threshold.apply(dec, torch.float32) == fastest
    assert torch.get_num_threads() == before and dec.conv_mode == "aten"           # the caller's state kept
    # a warm-up (the smallest and largest threshold: every length of every candidate), one timed round each; the
    # others were more than BEHIND slower: the winner alone, no more rounds
    assert timed[:2] == [min(int8_threshold.CANDIDATES), max(int8_threshold.CANDIDATES)]
    assert set(timed) == set(int8_threshold.CANDIDATES) and len(timed) == 2 + len(int8_threshold.CANDIDATES)
    assert all(m.int8_min_positions == fastest for m in dec.int8_convs())
    files = list(cache.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["choice"] == str(fastest)
    timed.clear()
    again = _dec()
    assert int8_threshold.apply(again, torch.float32) == fastest and not timed    # remembered: nothing timed
    assert all(m.int8_min_positions == fastest for m in again.int8_convs())
    int8_threshold.apply(_dec(), torch.bfloat16)                                  # another dtype: timed again
    assert timed


def test_candidates_clearly_behind_are_timed_no_more():
    best = {64: 28.0, 128: 30.8, 256: 43.3, 512: 70.3}        # the 0.6B codec under load (module doc)
    assert int8_threshold.still_close(best, [64, 128, 256, 512]) == [64, 128]
    assert int8_threshold.still_close(best, [128, 256]) == [128]
    assert int8_threshold.still_close({64: 10.0, 128: 10.9}, [64, 128]) == [64, 128]


@needs_int8
def test_close_candidates_get_every_round_and_the_budget_bounds_them(cache, monkeypatch):
    timed = []
    ms = {64: 9.0, 128: 9.2, 256: 9.4, 512: 20.0}            # 64-256 within BEHIND: timed on; 512 dropped
    _fake_decoder_times(monkeypatch, ms, timed)
    monkeypatch.setattr(int8_threshold, "_rounds", lambda: 3)
    assert int8_threshold.apply(_dec(), torch.float32) == 128  # within TIE of the fastest: fewer lossy calls
    n = len(int8_threshold.CANDIDATES)
    assert len(timed) == 2 + n + 3 + 3 and timed.count(512) == 2
    timed.clear()
    monkeypatch.setattr(int8_threshold, "BUDGET_S", 0.0)      # spent after the first round: it stops there
    int8_threshold.apply(_dec(), torch.bfloat16)
    assert len(timed) == 2 + n


@needs_int8
def test_each_conv_takes_int8_from_its_threshold(monkeypatch):
    dec = _dec()
    dec.set_conv_mode("int8")
    convs = dec.int8_convs()
    for i, m in enumerate(convs):                    # every other conv: int8 never; the rest: always
        m.int8_min_positions = 1 << 30 if i % 2 else 0
    monkeypatch.setenv(int8_conv.BATCH_ENV, "rows")   # (the row-by-row calls, counted below)
    calls = []
    real = int8_conv.Int8Conv.int8_row
    monkeypatch.setattr(int8_conv.Int8Conv, "int8_row", lambda self, x4: (calls.append(id(self)), real(self, x4))[1])
    with torch.inference_mode():
        dec(torch.randint(0, 2048, (2, 16, 2), generator=torch.Generator().manual_seed(0)))
    assert set(calls) == {id(m._pk8[1]) for i, m in enumerate(convs) if i % 2 == 0}
    assert len(calls) == 2 * len(set(calls))         # one int8 call per row (rows on their own)


@needs_int8
def test_tuning_off_measures_nothing(cache, monkeypatch):
    monkeypatch.setenv("TTS_KERNEL_TUNE", "0")
    monkeypatch.setattr(int8_threshold, "time_decoder", lambda d: pytest.fail("measured with tuning off"))
    dec = _dec()
    assert int8_threshold.apply(dec, torch.float32) is None
    assert all(m.int8_min_positions is None for m in dec.int8_convs()) and not cache.exists()


@needs_int8
def test_a_real_measurement_times_every_candidate(cache):
    dec = _dec()
    ms = int8_threshold.measure(dec)
    assert set(ms) == set(int8_threshold.CANDIDATES) and all(v > 0 for v in ms.values())
    assert dec.conv_mode == "aten" and all(m.int8_min_positions is None for m in dec.int8_convs())
