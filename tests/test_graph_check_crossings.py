"""`graph_check.host_crossings`: the report `--check` prints when a CUDA-graph capture fails (which op copies a host
value in or reads a result back, and where). CUDA itself cannot run here; the classifier and the frame run are
checked on the CPU, where a frame crosses nothing and must leave the runner's state as it found it."""
import torch

from tts_engine.engine.engine import TTSEngine
from tts_engine.graph_check import crossing, host_crossings


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
