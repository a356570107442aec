"""`graph_check.host_crossings`: the report `--check` prints when a CUDA-graph capture fails (which op copies a host
value in or reads a result back, and where). CUDA itself cannot run here; the classifier and the frame run are
checked on the CPU, where a frame crosses nothing and must leave the runner's state as it found it."""
import torch

from tts_engine.engine.engine import TTSEngine
from bench.check import crossing, host_crossings


def test_crossing_kinds():
    assert crossing({"cpu", "cuda"}, {"cuda"}, None) == "mixed"        # a host scalar tensor beside device ones
    assert crossing({"cpu"}, {"cuda"}, "cuda") == "to-cuda"            # .to("cuda") of a host tensor
    assert crossing({"cuda"}, {"cpu"}, None) == "to-cpu"               # .cpu() / .item(): a sync
    assert crossing({"cuda"}, {"cuda"}, None) is None
    assert crossing({"cpu"}, {"cpu"}, None) is None
    assert crossing(set(), {"cuda"}, "cuda") is None                   # a factory on the device


def test_a_cpu_frame_crosses_nothing_and_keeps_the_state(tiny_cv_folder):
    e = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype=torch.float32)
    try:
        r = e.runner
        r.hidden.normal_()
        before = [t.clone() for t in (r.pos, r.step, r.seen, r.hidden, r.c0)]
        assert host_crossings(r, 2, 64) == []
        for a, b in zip(before, (r.pos, r.step, r.seen, r.hidden, r.c0)):
            assert torch.equal(a, b)
    finally:
        e.close()


def test_the_bench_frame_line_with_graphs_derives_no_remainder():
    from bench.speed import frame_split_line

    prof = {"talker_ms": 101.0, "code_predictor_ms": 134.0, "codec_ms": 30.0, "frame_total_ms": 16.5}
    line = frame_split_line(prof, graphs=True)
    assert "CUDA graph replay) 16.50" in line and "eagerly" in line and "sampling" not in line
    cpu = dict(prof, frame_total_ms=240.0, sampling_and_host_ms=5.0)
    line = frame_split_line(cpu, graphs=False)
    assert line == ("Per frame at concurrency 1 (ms): talker 101.00, code predictor 134.00, codec 30.00, "
                    "frame total 240.00, sampling and host 5.00.")
