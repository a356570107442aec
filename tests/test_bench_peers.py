"""The side-by-side CPU benchmark's logic, without any peer installed: precision classes, the summary and the
ratio to the best peer per class, the table's skipped/failed lines, the interleaved schedule, the docs section
per machine, and the parsers of the peers' outputs. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from bench.peers import run as bench_peers
from bench import common
from bench.peers import c_engine, vox
from bench.peers.ours import module_bytes
from bench.peers.table import OURS, Run, markdown, precision_class, ratios, summarize


@pytest.mark.parametrize("label, cls", [
    ("bf16", "16-bit"), ("fp16", "16-bit"), ("fp32", "32-bit"), ("int8", "8-bit"), ("q8", "8-bit"),
    ("Q8_0", "8-bit"), ("w8a8", "8-bit"), ("int8 weights (bf16 activations)", "8-bit"), ("int4", "4-bit"),
    ("q4", "4-bit"), ("Q4_0", "4-bit"), ("w4a8", "4-bit"), ("mystery", "other")])
def test_precision_class_goes_by_weight_bits(label, cls):
    assert precision_class(label) == cls


def _run(engine, prec, xrt, frames=48, rep=0, produced=None, **kw):
    produced = frames if produced is None else produced
    return Run(engine, prec, frames, frames=produced, wall_s=produced * 0.08 / xrt, first_audio_s=0.5, rep=rep, **kw)


def fake_runs():
    rows = []
    for rep, noise in enumerate((1.0, 0.8, 0.9)):   # the best repeat is the first, the median the third
        for eng, prec, xrt in [(OURS, "bf16", 0.30), (OURS, "int8", 0.50), (OURS, "int4", 0.90),
                               ("C engine", "bf16", 0.31), ("C engine", "int8", 0.60), ("C engine", "int4", 0.40),
                               ("vox", "q8", 0.45), ("vox", "q4", 0.39)]:
            rows.append(_run(eng, prec, xrt * noise, rep=rep))
            rows.append(_run(eng, prec, xrt * noise * 0.7, frames=24, rep=rep))
    return rows


def test_ratios_compare_our_best_with_the_best_peer_in_each_class():
    s = summarize(fake_runs())
    by = {(x.engine, x.precision): x for x in s}
    assert by[(OURS, "int8")].best[48] == pytest.approx(0.50)
    assert by[(OURS, "int8")].median[48] == pytest.approx(0.45)
    assert by[("vox", "q4")].n == {24: 3, 48: 3}
    r = {x.cls: x for x in ratios(s)}
    assert r["16-bit"].peer.engine == "C engine" and r["16-bit"].value == pytest.approx(0.30 / 0.31)
    assert r["8-bit"].peer.precision == "int8" and r["8-bit"].value == pytest.approx(0.50 / 0.60)
    assert r["4-bit"].peer.engine == "C engine" and r["4-bit"].value == pytest.approx(0.90 / 0.40)
    assert r["overall"].ours.precision == "int4" and r["overall"].peer.precision == "int8"
    assert r["overall"].value == pytest.approx(0.90 / 0.60)
    assert r["overall"].median_value == pytest.approx((0.90 * 0.9) / (0.60 * 0.9))
    assert all(x.frames == 48 for x in r.values())


def test_failed_and_short_runs_and_skipped_peers_are_shown_not_hidden():
    rows = [r for r in fake_runs() if r.engine != "vox"]
    rows.append(Run("C engine", "int4", 48, rep=3, error="no 'Generated N frames' line"))
    rows.append(_run("C engine", "int8", 0.9, produced=30, rep=3))       # stopped at end-of-speech
    s = summarize(rows)
    c8 = next(x for x in s if (x.engine, x.precision) == ("C engine", "int8"))
    assert c8.short == {48: 30}
    table = markdown(s, ["vox: pip install vox-tts==0.19.5 failed: no network"], [24, 48])
    assert "- skipped: vox: pip install vox-tts==0.19.5 failed: no network" in table
    assert "- C engine int4: 1 run(s) failed: no 'Generated N frames' line" in table
    assert "only 30 frames" in table
    assert "vox" not in table.split("- skipped")[0]


def test_a_class_without_a_peer_has_no_ratio():
    rows = [_run(OURS, "bf16", 0.3), _run(OURS, "int4", 0.8), _run("C engine", "bf16", 0.31)]
    r = {x.cls: x for x in ratios(summarize(rows))}
    assert r["4-bit"].peer is None and r["4-bit"].value is None
    assert r["8-bit"].ours is None and r["8-bit"].value is None
    assert "| 4-bit | tts_engine int4 (0.80x) | none measured | – |" in markdown(summarize(rows), [], [48])


def test_effective_bandwidth_from_bytes_and_split():
    rows = [_run(OURS, "int8", 0.5, talker_ms=None), _run("C engine", "int8", 0.6, talker_ms=40.0, cp_ms=80.0),
            _run("C engine", "int8", 0.6, talker_ms=50.0, cp_ms=70.0, rep=1)]
    s = summarize(rows, parts={(OURS, "int8"): (100.0, 200.0)},
                  weight_bytes={(OURS, "int8"): (5e8, 1.2e9), ("C engine", "int8"): (4.4e8, 1.2e9)})
    ours, c = s
    assert (ours.talker_ms, ours.cp_ms) == (100.0, 200.0)
    assert ours.talker_gbs == pytest.approx(5.0) and ours.cp_gbs == pytest.approx(6.0)
    assert (c.talker_ms, c.cp_ms) == (40.0, 70.0)               # the least per part over the runs
    assert c.talker_gbs == pytest.approx(11.0)


def test_schedule_interleaves_every_config_each_repeat_in_a_rotated_order():
    plan = bench_peers.schedule(3, [24, 48], 2)
    assert len(plan) == 12
    assert [i for rep, f, i in plan if rep == 0 and f == 24] == [0, 1, 2]
    assert [i for rep, f, i in plan if rep == 1 and f == 48] == [1, 2, 0]
    assert sorted((rep, f, i) for rep, f, i in plan) == sorted({(r, f, i) for r in (0, 1) for f in (24, 48)
                                                                for i in range(3)})


def test_docs_keep_one_table_per_machine():
    text = "# Benchmarks\n\n## Earlier\n\nold text\n"
    t1 = bench_peers.update_doc(text, "CPU A, 2 CPUs", "table A1")
    assert t1.startswith(text.rstrip("\n")) and bench_peers.SECTION in t1 and "table A1" in t1
    t2 = bench_peers.update_doc(t1 + "\n## Later section\n\nkeep me\n", "CPU B, 4 CPUs", "table B")
    t3 = bench_peers.update_doc(t2, "CPU A, 2 CPUs", "table A2")
    assert "table A1" not in t3 and "table A2" in t3 and "table B" in t3
    assert t3.index("### CPU A") < t3.index("### CPU B") < t3.index("## Later section")
    assert t3.count(bench_peers.SECTION) == 1 and t3.count("### CPU A, 2 CPUs") == 1
    assert "keep me" in t3 and "old text" in t3


C_ENGINE_LOG = """Model loaded in 3872 ms
seed: 42
Prefill: 24 positions (instruct=0, role=3, codec=6, text+eos=14, final=1)
  Prefill: 1114 ms

  Generated 24 frames (1.9s audio)
  Talker step: 2721 ms (113.4 ms/f), Code Predictor: 7658 ms (319.1 ms/f)
  Embed: 3 ms, Codec head+sampling: 47 ms
  Speech decoder: 7358 ms total (1578 ms drain after gen)
Audio: 1.9s generated in 13.1s (RTF 6.85)
  TTFA: 2602 ms (first audio chunk, 10-frame chunk)
Wrote /tmp/ctest.wav (46080 samples, 1.92s) [streamed]
"""


def test_c_engine_output_parser():
    r = c_engine.parse_output(C_ENGINE_LOG)
    assert r["frames"] == 24 and r["wall_s"] == pytest.approx(6.85 * 46080 / 24000)
    assert r["first_audio_s"] == pytest.approx(2.602) and r["load_s"] == pytest.approx(3.872)
    assert (r["talker_ms"], r["cp_ms"]) == (113.4, 319.1)
    with pytest.raises(ValueError, match="Generated"):
        c_engine.parse_output("Model loaded in 10 ms\nSegmentation fault")


def test_c_engine_simd_follows_cpu_flags():
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert c_engine.simd_for(avx512 | {"avx512_vnni", "avx512_bf16"}) == "avx512bf16"
    assert c_engine.simd_for(avx512 | {"avx512_vnni"}) == "avx512vnni"
    assert c_engine.simd_for(avx512) == "avx512"
    assert c_engine.simd_for({"avx2", "fma"}) == "auto"
    assert c_engine.simd_for({"sse4_2"}) == "scalar"


def test_c_engine_source_errors_say_why(tmp_path):
    with pytest.raises(c_engine.SetupError, match="does not exist"):
        c_engine.get_source(tmp_path / "peers", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(c_engine.SetupError, match="neither a git repository"):
        c_engine.get_source(tmp_path / "peers", str(tmp_path / "empty"))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "Makefile").write_text("blas:\n")
    (tree / "qwen_tts.c").write_text("int main(void){return 0;}\n")
    src, origin = c_engine.get_source(tmp_path / "peers", str(tree))
    assert (src / "qwen_tts.c").is_file() and "not checked" in origin


def test_an_unusable_peer_is_skipped_with_a_reason(tmp_path):
    a = argparse.Namespace(skip={"tts_engine", "vox"}, peers_dir=tmp_path, c_engine_src=str(tmp_path / "nowhere"),
                           threads=2, frames=[24])
    skipped, notes = [], []
    engines = bench_peers.setup_engines(a, tmp_path / "ckpt", {"flags": set()}, skipped, notes)
    assert engines == [] and notes == []
    assert len(skipped) == 1 and skipped[0].startswith("C engine:") and "does not exist" in skipped[0]


def test_vox_worker_result_parser():
    stats = {"backend": {"ms_per_frame": {"talker": 37.5, "predictor": 80.25, "codec": 68.0}},
             "plan": {"stages": [{"stage": "talker", "weight_bytes": 506343424},
                                 {"stage": "predictor", "weight_bytes": 186827776}]}}
    out = vox.parse_worker("vox log line\n" + json.dumps({"frames": 48.0, "wall_s": 9.1, "stats": stats}) + "\n")
    assert out["frames"] == 48.0
    assert vox.parts_and_bytes(out["stats"]) == (37.5, 80.25, 506343424)
    assert vox.parts_and_bytes({}) == (None, None, None)
    with pytest.raises(ValueError):
        vox.parse_worker("Traceback ...\nImportError: no vox")


def test_cpuinfo_and_machine_key():
    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
            "model name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_tile\n\n"
            "processor\t: 1\nmodel name\t: other\n")
    info = common.cpuinfo(text)
    assert info["model"] == "Intel(R) Xeon(R) Platinum" and (info["family"], info["model_no"]) == ("6", "207")
    assert common.machine_key(info).startswith("Intel(R) Xeon(R) Platinum (family 6 model 207), ")
    assert common.simd_flags(info) == "avx2 fma avx512f avx512_bf16 amx_tile"


def test_module_bytes_counts_parameters_and_buffers_once():
    lin = nn.Linear(3, 2)                                    # 6 + 2 fp32
    assert module_bytes(lin) == 32
    m = nn.Module()
    m.a = lin
    m.b = lin                                                # shared: counted once
    m.register_buffer("q", torch.zeros(4, 8, dtype=torch.int8))
    assert module_bytes(m) == 32 + 32


class FakeEngine:
    def __init__(self, name, precisions, xrt):
        self.name, self.precisions, self.xrt, self.calls, self.profiles = name, precisions, xrt, [], 0
        self.precision = precisions[0]

    def run(self, precision, frames, rep):
        self.calls.append((precision, frames, rep))
        if precision == "broken":
            return Run(self.name, precision, frames, rep=rep, error="crashed")
        return _run(self.name, precision, self.xrt, frames=frames, rep=rep)

    def profile(self, frames):
        self.profiles += 1
        return {"talker_ms": 10.0 + self.profiles, "code_predictor_ms": 20.0}


def test_interleave_mixes_engines_and_profiles_ours_after_every_repeat():
    ours = FakeEngine(OURS, ("bf16",), 0.3)
    peer = FakeEngine("C engine", ("bf16", "broken"), 0.31)
    runs, profiles = bench_peers.interleave([ours, peer], [24, 48], 2, profile_frames=8)
    assert len(runs) == 2 * 2 * 3 and sum(not r.ok for r in runs) == 4
    assert [(r.engine, r.precision) for r in runs[:3]] == [(OURS, "bf16"), ("C engine", "bf16"), ("C engine", "broken")]
    assert ours.calls == [("bf16", 24, 0), ("bf16", 48, 0), ("bf16", 24, 1), ("bf16", 48, 1)]
    assert [p["talker_ms"] for p in profiles["bf16"]] == [11.0, 12.0]
    assert peer.profiles == 0


def test_our_split_shows_the_rest_of_the_frame_beside_the_parts():
    rows = [_run(OURS, "int8", 0.5, talker_ms=None), _run("C engine", "int8", 0.6, talker_ms=40.0, cp_ms=80.0)]
    s = summarize(rows, parts={(OURS, "int8"): (100.0, 200.0, 3.5)})
    assert s[0].other_ms == 3.5 and s[1].other_ms is None
    md = markdown(s, [], [48])
    assert "rest of our frame" in md and "| 100 / 200 / 3.5 |" in md
    assert "| 40 / 80 |" in md
