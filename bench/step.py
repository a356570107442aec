"""Per-frame step A/B: `python -m bench step --base /path/to/other/checkout [--mode int8] [--batch 1]`.

Builds the talker of the random-weight 0.6b architecture twice in one process, once from another checkout's
`tts_engine` (A, e.g. main; imported under the name `tts_base`) and once from this one (B), with the same
random weights, and runs their model runners' per-frame step interleaved frame by frame (A B C, B C A, ...), timing
each frame and, separately as `speed.profile_frame` does, its code predictor and talker parts. `--compile` adds
C: B with the compiled code-predictor pass (tts_engine/cpu/compiled_predictor.py), and prints its warm-up
time. `--profile` counts aten calls per frame. Prints one JSON line with medians (ms). Generation only: no codec,
no prompt building. On a busy machine use `--threads 1` (OpenMP threads that wait on each other under
oversubscription distort every figure); with one thread the *_cpu_ms figures (the main thread's CPU time)
do not count the time the scheduler gave to other processes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.common import build_talker, device_name, load1, load_checkout, make_runner, random_config


def part_times(r, mr, sp, talker, batch: int, bf16: bool):
    """(code predictor s, talker s, the same in this thread's CPU time) of one more frame, timed apart (results
    discarded): the predictor's half as the engine serves it (`ModelRunner.complete`: no row state changes), the
    talker's forward over its codes."""
    rr = torch.arange(batch)
    with torch.inference_mode():
        a, ac = time.perf_counter(), time.thread_time()
        codes = r.complete(list(range(batch)))
        b, bc = time.perf_counter(), time.thread_time()
    scope = r.step_scope(batch) if hasattr(r, "step_scope") else mr.aten_bf16_gemv(bf16 and batch <= 2)
    with torch.inference_mode(), scope:
        talker.forward_embeds(talker.frame_embed(codes)[:, None], r.cache, slice(0, batch), r.pos[rr] - 1,
                              max(r.host_len[:batch]))
        c, cc = time.perf_counter(), time.thread_time()
    return b - a, c - b, bc - ac, cc - bc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench step", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the other checkout (A), e.g. /work/main")
    p.add_argument("--arch", choices=["tiny", "small", "0.6b", "1.7b"], default="0.6b")
    p.add_argument("--mode", choices=["fp32", "bf16", "int8", "int4", "w8a8", "w4a8"], default="int8")
    p.add_argument("--base-mode", choices=["fp32", "bf16", "int8", "int4", "w8a8", "w4a8"],
                   help="A's mode when it differs from B's (--mode), e.g. --base-mode int8 --mode w8a8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--frames", type=int, default=4, help="frames per variant per round (rounds x frames in all)")
    p.add_argument("--threads", type=int)
    p.add_argument("--compile", action="store_true", help="also C: B with the compiled code-predictor pass")
    p.add_argument("--profile", action="store_true", help="aten calls per frame of A and B")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    load_checkout("tts_base", a.base)
    cfg = random_config(a.arch)
    base_mode = a.base_mode or a.mode
    if (base_mode == "fp32") != (a.mode == "fp32"):
        p.error("--base-mode and --mode must both be fp32 or both not")
    dtype = torch.float32 if a.mode == "fp32" else torch.bfloat16
    quant = a.mode if a.mode in ("int8", "int4", "w8a8", "w4a8") else None
    torch.manual_seed(0)
    tA, state = build_talker("tts_base", cfg, dtype, base_mode if base_mode in ("int8", "int4", "w8a8", "w4a8") else None)
    tB, _ = build_talker("tts_engine", cfg, dtype, quant, state)
    del state
    max_len = 2 * a.rounds * a.frames * 3 + 200
    rA, mA, sA = make_runner("tts_base", tA, cfg, dtype, a.batch, max_len)
    rB, mB, sB = make_runner("tts_engine", tB, cfg, dtype, a.batch, max_len)
    rows = list(range(a.batch))
    out = {"device": device_name(torch.device("cpu")), "arch": a.arch, "mode": a.mode, "base_mode": base_mode, "batch": a.batch, "threads": torch.get_num_threads()}
    variants = [("A", rA, mA, sA, tA), ("B", rB, mB, sB, tB)]
    compiled = None
    if a.compile:
        from tts_engine.cpu import compiled_predictor

        compiled_predictor.COMPILE_BUDGET_S = float("inf")   # measure it, whatever it takes
        t0 = time.perf_counter()
        out["compile_status"] = rB.backend.compile_predictor(rB)
        out["compile_s"] = round(time.perf_counter() - t0, 1)
        compiled, tB.code_predictor.compiled = tB.code_predictor.compiled, None
        if compiled is not None:
            variants.append(("C", rB, mB, sB, tB))
    for r in (rA, rB):
        r.decode(rows)   # warm-up
    res = {v[0]: [] for v in variants}
    for k in range(a.rounds * a.frames):   # one frame of each variant in turn, the order rotating
        for name, r, mr, sp, t in variants[k % len(variants):] + variants[:k % len(variants)]:
            tB.code_predictor.compiled = compiled if name == "C" else None
            t0, c0 = time.perf_counter(), time.thread_time()
            r.decode(rows)
            t1, c1 = time.perf_counter(), time.thread_time()
            res[name].append((t1 - t0, *part_times(r, mr, sp, t, a.batch, dtype == torch.bfloat16), c1 - c0))
    tB.code_predictor.compiled = None

    def med(xs):
        return round(1000 * sorted(xs)[len(xs) // 2], 1)

    for n, xs in res.items():
        out[n] = {"frame_ms": med([x[0] for x in xs]), "code_predictor_ms": med([x[1] for x in xs]),
                  "talker_ms": med([x[2] for x in xs]), "frame_cpu_ms": med([x[5] for x in xs]),
                  "code_predictor_cpu_ms": med([x[3] for x in xs]), "talker_cpu_ms": med([x[4] for x in xs])}
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for n, r in (("A", rA), ("B", rB)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    r.decode(rows)
            out[n]["aten_calls_per_frame"] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / 3
    out["load_average"] = round(load1(), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
