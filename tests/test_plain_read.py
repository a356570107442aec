"""The plain large read (bench/common.py's PlainRead; `python -m bench plain_read` watches it): one definition of the memory floor for every bench, sized beyond
the L3, non-repeating bytes, sampled between a bench's timings and reported as a spread; the peers table's
"% of plain read" column compares each profile's parts with the reads taken between its frames."""
from __future__ import annotations

import pytest
import torch

from bench import common, plain_read
from bench.common import PlainRead, buffer_bytes, last_level_cache_bytes, percent
from bench.peers.table import OURS, Run, markdown, summarize


def test_buffer_is_a_gib_or_32_last_level_caches():
    assert buffer_bytes(0) == 1 << 30
    assert buffer_bytes(32 << 20) == 1 << 30
    assert buffer_bytes(64 << 20) == 2 << 30          # a 64 MiB L3 -> 2 GiB
    assert buffer_bytes() >= 32 * last_level_cache_bytes()


def test_last_level_cache_from_sysfs(tmp_path):
    for idx, size in (("index0", "32K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / idx).mkdir()
        (tmp_path / idx / "size").write_text(size + "\n")
    (tmp_path / "index9").mkdir()                      # unreadable entries are skipped
    assert last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert last_level_cache_bytes(str(tmp_path / "none")) == 0


def test_fill_repeats_no_word_and_no_page():
    buf = torch.empty(4 << 20, dtype=torch.uint8)
    common._fill(buf)
    words = buf.view(torch.int64)
    assert torch.unique(words).numel() == words.numel()
    pages = buf.view(-1, 4096)
    assert torch.unique(pages, dim=0).shape[0] == pages.shape[0]
    assert (pages != 0).any(dim=1).all()              # no zero page either


@pytest.mark.parametrize("reader", ["torch_sum", "cpu_ext", "cpu_ext_claim"])
def test_samples_and_spread(reader):
    from tts_engine.cpu import cpu_ext

    if reader.startswith("cpu_ext") and not cpu_ext.available():
        pytest.skip(f"cpu_ext: {cpu_ext.why_unavailable()}")
    pr = PlainRead(8 << 20, reader=reader)
    assert pr.samples == []                            # the first pass after the fill is not a sample
    g = [pr.sample() for _ in range(3)]
    assert all(x > 0 for x in g) and pr.samples == g
    m = pr.mark()
    pr.sample()
    s, since = pr.spread(), pr.spread(m)
    assert s["n"] == 4 and since["n"] == 1 and since["median"] == pr.samples[-1]
    assert s["min"] <= s["median"] <= s["max"]
    assert len(pr.cpu_shares) == 4 and all(0 <= c <= 1.5 for c in pr.cpu_shares)
    assert s["full_cpu"] == sum(c >= common.FULL_CPU for c in pr.cpu_shares)
    assert f"{reader}" in pr.describe() and "median" in pr.describe()
    with pytest.raises(ValueError):
        PlainRead(1 << 20, reader="memcpy")


def test_percent_of_the_median():
    assert percent(10.0, {"min": 5.0, "median": 20.0, "max": 40.0, "n": 3}) == pytest.approx(50.0)
    assert percent(30.0, 40.0) == pytest.approx(75.0)
    assert percent(None, 40.0) is None and percent(10.0, None) is None


def test_every_bench_takes_the_one_definition():
    """No bench keeps its own plain read (each used to: torch sum of 1 GiB of ones, 512 MB of ones, ...)."""
    import importlib
    import inspect

    for name in ("peers.run", "talker_step", "predictor_frame", "fused_profile", "matmuls", "engine_step"):
        src = inspect.getsource(importlib.import_module(f"bench.{name}"))
        assert "PlainRead(" in src, name
        assert "torch.ones(512" not in src and "plain_read_gbps" not in src and "read_bandwidth" not in src, name
        assert "class PlainRead" not in src and "def buffer_bytes" not in src, name
    assert not hasattr(common, "read_bandwidth") and not hasattr(common, "best_read_bandwidth")


def _run(engine, prec, xrt, frames=48, rep=0, **kw):
    return Run(engine, prec, frames, frames=frames, wall_s=frames * 0.08 / xrt, first_audio_s=0.2, rep=rep, **kw)


def test_peers_table_percent_uses_the_reads_beside_each_profile():
    rows = [_run(OURS, "w8a8", 1.1), _run("C engine", "int8", 0.5, talker_ms=40.0, cp_ms=80.0)]
    # two profiles of ours: talker 20 / 25 ms and predictor 40 / 50 ms of 5e8 / 1.2e9 bytes, reads 50 / 25 GB/s beside
    floors = {(OURS, "w8a8"): [(20.0, 40.0, 50.0), (25.0, 50.0, 25.0)]}
    s = summarize(rows, parts={(OURS, "w8a8"): (20.0, 40.0)},
                  weight_bytes={(OURS, "w8a8"): (5e8, 1.2e9), ("C engine", "int8"): (4.4e8, 1.2e9)},
                  part_floors=floors, read_floor=40.0)
    ours, c = s
    # profile 1: 25 GB/s of 50 = 50 %, 30 of 50 = 60 %; profile 2: 20 of 25 = 80 %, 24 of 25 = 96 %: medians
    assert ours.talker_pct == pytest.approx(65.0) and ours.cp_pct == pytest.approx(78.0)
    # the peer: its estimated GB/s against the run's median read
    assert c.talker_pct == pytest.approx(100 * 11.0 / 40.0) and c.cp_pct == pytest.approx(100 * 15.0 / 40.0)
    md = markdown(s, [], [48])
    assert "% of plain read talker / code predictor" in md
    assert "| 65 / 78 |" in md and "| 28 / 38 |" in md


def test_peers_table_without_reads_shows_no_percent():
    s = summarize([_run(OURS, "bf16", 0.6)], parts={(OURS, "bf16"): (30.0, 60.0)},
                  weight_bytes={(OURS, "bf16"): (9e8, 2.4e9)})
    assert s[0].talker_pct is None and s[0].cp_pct is None
    assert markdown(s, [], [48]).splitlines()[2].endswith("| – |")


class _Floor:
    def __init__(self):
        self.samples = []

    def sample(self):
        self.samples.append(30.0 + len(self.samples))
        return self.samples[-1]


class _Engine:
    name = OURS
    precisions = ("w8a8",)
    precision = "w8a8"

    def __init__(self):
        self.floors = []

    def run(self, precision, frames, rep):
        return _run(OURS, precision, 1.0, frames=frames, rep=rep)

    def profile(self, frames, floor=None):
        self.floors.append(floor)
        return {"talker_ms": 10.0, "code_predictor_ms": 20.0}


def test_interleave_samples_the_read_after_every_run_and_gives_it_to_the_profiles():
    from bench.peers import run as bench_peers

    e, fl = _Engine(), _Floor()
    runs, profiles = bench_peers.interleave([e], [24, 48], 2, profile_frames=4, floor=fl)
    assert len(fl.samples) == len(runs) == 4
    assert [r.extra["plain_read_gbs"] for r in runs] == fl.samples
    assert e.floors == [fl, fl] and len(profiles["w8a8"]) == 2


def test_our_engine_profile_reads_between_its_frames(tiny_cv_folder):
    """The peers bench's profile of our engine (speed.profile_frame) samples the plain read once after each
    frame's parts and returns their spread beside the parts."""
    from bench.peers.ours import OurEngine

    e = OurEngine(tiny_cv_folder, None, 16)
    try:
        pr = PlainRead(4 << 20, reader="torch_sum")
        pr.sample()
        prof = e.profile(3, pr)
        assert prof["talker_ms"] > 0 and prof["code_predictor_ms"] > 0
        assert prof["plain_read"]["n"] == 3 and len(pr.samples) == 4       # the earlier sample is not in its spread
        assert prof["plain_read"]["median"] == pytest.approx(sorted(pr.samples[1:])[1])
        assert "plain_read" not in e.profile(2)
    finally:
        e.close()


def test_survey_interleaves_readers_and_thread_counts():
    lines = []
    prs = plain_read.survey(0.0, [1, 2], ["torch_sum"], 2 << 20, say=lines.append)
    assert list(prs) == [("torch_sum", 1), ("torch_sum", 2)]
    assert len(lines) == 1 and "torch_sum/1t" in lines[0] and "torch_sum/2t" in lines[0]   # one round at least
    assert all(len(pr.samples) == 1 for pr in prs.values())
    assert "2 threads" in prs[("torch_sum", 2)].describe()


def test_claimed_read_reads_every_chunk():
    """ttsx_read_claim: the threads claim 1 MiB chunks; every chunk is read once whatever the thread count: the
    result (an XOR over the chunks' values) is the same at 1 and 2 threads and changes with any chunk's bytes."""
    from tts_engine.cpu import cpu_ext

    if not cpu_ext.available():
        pytest.skip(f"cpu_ext: {cpu_ext.why_unavailable()}")
    buf = torch.empty(8 << 20, dtype=torch.uint8)
    common._fill(buf)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ext.read_bytes(buf, claim=True)
        torch.set_num_threads(2)
        assert cpu_ext.read_bytes(buf, claim=True) == one
        for chunk in range(8):
            buf[(chunk << 20) + 4096] ^= 0x10
            assert cpu_ext.read_bytes(buf, claim=True) != one, chunk
            buf[(chunk << 20) + 4096] ^= 0x10
    finally:
        torch.set_num_threads(saved)
    assert PlainRead(1 << 20).reader == "cpu_ext_claim"
