"""`python -m tts_engine.bench_matmuls int8,w8a8[,int4,bf16] [ROUNDS]`: one frame's matmuls of the real 0.6B
architecture (random weights) in each mode, interleaved A, B, A, B... in one process, one input row, in model
order as ModelRunner runs them (the talker's linear layers once, the code predictor's and one lm_head 15 times,
under the runner's oneDNN switch for bf16 rows). Prints the min and median ms per frame of each mode: the part of
the frame the kernel choice decides, without the rest of the engine. Loads one model per mode (~1 GB each)."""
from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

from . import bench
from .engine.model_runner import aten_bf16_gemv
from .model import quant
from .model.qwen3_tts import Qwen3TTSModel

LINEARS = (nn.Linear, quant.Int8Linear, quant.W8A8Linear, quant.Int4Linear)


def frame_calls(talker) -> list[nn.Module]:
    lin = lambda root: [m for m in root.modules() if isinstance(m, LINEARS)]   # noqa: E731
    cp = talker.code_predictor
    return lin(talker.model.layers) + [talker.codec_head] + [
        m for step in range(cp.lm_head.__len__()) for m in lin(cp.model.layers) + [cp.lm_head[step]]]


def sweep(calls: list[nn.Module], xs: dict) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode(), aten_bf16_gemv(True):
        for m in calls:
            m(xs.setdefault(m.in_features, torch.randn(1, m.in_features, dtype=torch.bfloat16)))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modes = (argv[0] if argv else "int8,w8a8").split(",")
    rounds = int(argv[1]) if len(argv) > 1 else 7
    torch.set_num_threads(int(os.environ.get("TTS_THREADS", "2")))
    ck = bench.checkpoint_for("0.6b", torch.bfloat16, "custom_voice")
    calls = {}
    for m in modes:
        model = Qwen3TTSModel.from_pretrained(str(ck), device="cpu", dtype="bf16", quantize=None if m == "bf16" else m)
        model.talker.model.text_embedding = None   # not read here
        calls[m] = frame_calls(model.talker)
    xs: dict = {}
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            times[m].append(1e3 * sweep(calls[m], xs))
    print(f"{bench.device_name(torch.device('cpu'))}, load average {os.getloadavg()[0]:.1f}, {rounds} rounds")
    for m in modes:
        v = sorted(times[m])
        print(f"{m}: {len(calls[m])} matmuls per frame, min {v[0]:.1f} ms, median {v[len(v) // 2]:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
