"""bench/peers_gpu.py without a GPU: the markdown table of a given result dict, the argument checks, the choice of
wheels a Python can install, and (where bench/gpu_wheels.sh filled .whl/, skipped otherwise, as in CI) its CPU dry
run of one engine end to end: install into its own target folders, imports with the stubs, the tiny random
checkpoint, emulated CUDA graphs, the JSON and the table. No timing is asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peers_gpu
from bench.peers_gpu import check_args, markdown, parse, usable_wheels

ROOT = Path(__file__).resolve().parent.parent
WHL = ROOT / ".whl"


def result_dict():
    rows = [
        {"engine": "triton", "model": "0.6B", "mode": "build", "build_s": 3.1},
        {"engine": "triton", "model": "0.6B", "mode": "codes", "batch": 1, "n_frames": 128, "median_s": 2.048,
         "ms_per_frame": 16.0, "rtf": 5.0, "agg_audio_s_per_s": 5.0, "peak_gb": 2.71, "frames_ok": True},
        {"engine": "triton", "model": "0.6B", "mode": "stream", "batch": 1, "chunk": 8, "n_frames": 128,
         "median_s": 2.5, "ms_per_frame": 19.53, "rtf": 4.1, "agg_audio_s_per_s": 4.1, "ttfa_ms": 187.4,
         "peak_gb": 2.8, "frames_ok": True},
        {"engine": "triton", "model": "0.6B", "mode": "ttfa", "batch": 1, "chunk": 4, "ttfa_ms": 120.2},
        {"engine": "batch", "model": "0.6B", "mode": "batch", "batch": 16, "n_frames": 128, "median_s": 4.0,
         "ms_per_frame": 31.25, "rtf": 2.56, "agg_audio_s_per_s": 40.96, "first_audio_ms": 4000.0,
         "codes_rtf": 3.2, "codes_agg_audio_s_per_s": 51.2, "peak_gb": 6.5, "frames_ok": False,
         "note": "time budget: 2/3 timed runs"},
        {"engine": "triton_batch", "model": "0.6B", "mode": "batch", "batch": 64, "error": "OutOfMemoryError: x"},
        {"engine": "batch", "model": "1.7B", "mode": "worker", "skipped": "time budget before the worker started"},
    ]
    meta = {"frames": 128, "runs": 3, "warmup": 1, "tiny": False, "dtype": "bfloat16", "device": "cuda",
            "device_name": "NVIDIA H100 80GB HBM3", "started": "2026-11-28T09:00:00+0000"}
    return {"meta": meta, "rows": rows, "workers": [{"engine": "triton", "model": "0.6B", "rc": 0, "wall_s": 51.2}]}


def test_the_table_shows_every_series_and_every_failure():
    md = markdown(result_dict())
    lines = md.splitlines()
    assert lines[0].startswith("Peers on the same GPU: NVIDIA H100 80GB HBM3, 2026-11-28T09:00:00+0000; real sizes")
    assert "N = 128 frames (10.24 s of audio)" in lines[0]
    body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| engine")]
    assert body == [
        "| triton | 0.6B | codes | 1 | 5.00 | 5.00 | – | 16.00 | 2.71 | ok |",
        "| triton | 0.6B | stream (chunk 8) | 1 | 4.10 | 4.10 | 187 | 19.53 | 2.80 | ok |",
        "| triton | 0.6B | ttfa (chunk 4) | 1 | – | – | 120 | – | – |  |",
        "| batch | 0.6B | batch; codes only 3.20x / 51.2 audio s/s | 16 | 2.56 | 40.96 | 4000 (whole clip) | 31.25 | "
        "6.50 | LENGTH MISMATCH (time budget: 2/3 timed runs) |",
    ]
    assert "- triton_batch 0.6B batch B=64: ERROR OutOfMemoryError: x" in lines
    assert "- batch 1.7B worker: skipped: time budget before the worker started" in lines
    assert lines[-1] == "Workers: triton 0.6B rc=0 51.2 s"


def test_a_dry_run_table_says_its_timings_mean_nothing():
    r = result_dict()
    r["meta"]["tiny"] = True
    assert "TINY configuration (dry run: timings meaningless)" in markdown(r).splitlines()[0]


def test_bad_arguments_get_a_clear_message(tmp_path):
    anchor = tmp_path / "anchor_bench.py"
    anchor.write_text("")
    ok = parse(["--anchor", str(anchor)])
    assert check_args(ok) == []
    bad = parse(["--anchor", str(tmp_path / "none.py"), "--engines", "triton,vllm", "--models", "7B",
                 "--batches", "1,x", "--frames", "300", "--batch-max-seq-len", "256"])
    errs = "\n".join(check_args(bad))
    for part in ("unknown engine(s) ['vllm']", "--models '7B'", "--batches '1,x'", "--batch-max-seq-len 256",
                 "anchor_bench.py not found"):
        assert part in errs
    assert parse(["--patch-range", "all"]).patch_range is None and parse([]).patch_range == (0, 24)


def test_only_wheels_this_python_can_import_are_installed(tmp_path):
    pure = tmp_path / "pkg-1.0-py3-none-any.whl"
    foreign = tmp_path / "ext-1.0-cp27-cp27mu-manylinux1_x86_64.whl"
    assert usable_wheels([pure, foreign]) == ([pure], [foreign])


def _carried():
    need = [WHL / s for s in ("batch", "faster4", "official", "common")]
    return all(d.is_dir() and any(d.glob("*.whl")) for d in need) and (WHL / "anchor_bench.py").is_file()


@pytest.mark.skipif(not _carried(), reason="no .whl/ (run bash bench/gpu_wheels.sh where there is network)")
def test_the_dry_run_measures_an_engine_end_to_end(tmp_path):
    out = tmp_path / "dry.json"
    r = subprocess.run([sys.executable, "-m", "bench", "peers_gpu", "--dry-run", "--engines", "batch",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "dry run: ok" in r.stdout
    d = json.loads(out.read_text())
    rows = [x for x in d["rows"] if x.get("mode") == "batch"]
    assert [x["batch"] for x in rows] == [1, 2] and all(x["frames_ok"] for x in rows)
    assert d["meta"]["tiny"] and d["env"]["batch 0.6B"]["versions"]["faster-qwen3-tts-batch"] == "0.2.0"
    assert out.with_suffix(".md").read_text() == peers_gpu.markdown(d)


def test_the_batch_workers_loop_builds_times_and_reports_each_batch():
    """`sweep_batches`, the loop both batch workers share, on stand-ins: a build per model size, a timed call per
    batch size, the rows in order; a build that raises gives its error row and no batch rows, a call that raises its
    error row; memory released after every batch and every size."""
    import types

    rows, released = [], []
    ctx = types.SimpleNamespace(args=types.SimpleNamespace(frames=8, models="0.6B,1.7B", batches="1,4"),
                                time_left=lambda: 100.0, add=rows.append, mem_reset=lambda: 0,
                                mem_peak=lambda base: (1.0, 0.5))
    anchor = types.SimpleNamespace(
        warm_frames=lambda ctx, n: 2, release=lambda ctx: released.append(1),
        skipped_row=lambda *a: {"skipped": a}, err_row=lambda size, mode, b, e: {"model": size, "mode": mode,
                                                                                 "batch": b, "error": str(e)},
        timed_runs=lambda ctx, run, warm, ratio: (warm(), [0.5, 0.4], [run(), run()], "")[1:],
        summarize=lambda walls, n, b: {"median_s": sorted(walls)[len(walls) // 2]})

    def build(size):
        if size == "1.7B":
            raise RuntimeError("no room")
        return {"size": size}, {"build_s": 1.0}

    def make_call(state, b):
        if b == 4:
            return lambda frames: (_ for _ in ()).throw(RuntimeError("out of memory"))
        return lambda frames: [frames] * b

    peers_gpu.sweep_batches(ctx, anchor, build, make_call,
                            lambda out, runs: (out[-1], [f * peers_gpu.SAMPLES_PER_FRAME for f in out[-1]], [0.3]))
    assert [(r.get("model"), r.get("mode"), r.get("batch")) for r in rows] == [
        ("0.6B", "build", None), ("0.6B", "batch", 1), ("0.6B", "batch", 4), ("1.7B", "build", None)]
    assert rows[1]["frames_ok"] and rows[1]["codes_s"] == 0.3 and "out of memory" in rows[2]["error"]
    assert "no room" in rows[3]["error"] and len(released) == 3
