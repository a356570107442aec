"""bench/common.py's lap timer (`Laps`), and the two scripts that use it (`python -m bench prefill`, `python -m bench
breakdown`) run end to end on a tiny random checkpoint (their tables come out, every part timed)."""
from __future__ import annotations

import pytest

from bench import common as bench_timing


def test_laps_time_each_part_since_the_previous_mark(monkeypatch):
    wall, cpu = iter([10.0, 10.5, 12.0]), iter([1.0, 1.25, 1.5])
    monkeypatch.setattr(bench_timing.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(bench_timing.time, "thread_time", lambda: next(cpu))
    laps = bench_timing.Laps()
    laps.mark("a")
    laps.mark("b")
    assert laps.ms == {"a": (500.0, 250.0), "b": (1500.0, 250.0)}
    assert list(laps.ms) == ["a", "b"]


@pytest.fixture
def tiny_bench_cache(monkeypatch, tmp_path):
    from tts_engine.cpu import kernels

    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))   # the random tiny checkpoint is written here
    return tmp_path


def test_bench_prefill_prints_every_part(tiny_bench_cache, capsys):
    from bench import prefill as bench_prefill

    assert bench_prefill.main(["--arch", "tiny", "--quantize", "none", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith(("| hit", "| miss", "| no cache"))]
    assert len(rows) == 3 and all(ln.count("(") == 4 for ln in rows), out


def test_bench_breakdown_prints_every_part(tiny_bench_cache, capsys, monkeypatch):
    from bench import breakdown as bench_breakdown
    from tts_engine.engine import worker

    monkeypatch.setattr(worker, "decode_group", worker.decode_group)   # the script times it (put back after)

    assert bench_breakdown.main(["--arch", "tiny", "--quantize", "none", "--frames", "4", "--concurrency", "1"]) == 0
    out = capsys.readouterr().out
    for part in ("prefill (one request)", "codec decode, 1 stream(s)", "talker half", "request (text -> prompt)",
                 "first frame: code predictor (15 passes)", "**submit -> first audio**"):
        assert part in out, (part, out)
