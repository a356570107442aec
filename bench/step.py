"""Per-frame step A/B: `python -m bench.step --base /path/to/other/checkout [--mode int8] [--batch 1]`.

Builds the talker of the random-weight 0.6b architecture twice in one process, once from another checkout's
`tts_engine` (A, e.g. main; imported under the name `tts_base`) and once from this one (B), with the same
random weights, and runs their model runners' per-frame step interleaved frame by frame (A B C, B C A, ...), timing
each frame and, separately as `bench.profile_frame` does, its code predictor and talker parts. `--compile` adds
C: B with the compiled code-predictor pass (tts_engine/cpu/compiled_predictor.py), and prints its warm-up
time. `--profile` counts aten calls per frame. Prints one JSON line with medians (ms). Generation only: no codec,
no prompt building. On a busy machine use `--threads 1` (OpenMP threads that wait on each other under
oversubscription distort every figure); with one thread the *_cpu_ms figures (the main thread's CPU time)
do not count the time the scheduler gave to other processes.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

import torch
from torch import nn


def load_checkout(name: str, repo: str):
    spec = importlib.util.spec_from_file_location(name, f"{repo}/tts_engine/__init__.py",
                                                  submodule_search_locations=[f"{repo}/tts_engine"])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def build_talker(pkg: str, cfg, dtype, quant, state=None):
    """The talker of `pkg` with random weights (or `state`), without the 151936-row text embedding."""
    talker_mod = importlib.import_module(f"{pkg}.model.talker")
    quant_mod = importlib.import_module(f"{pkg}.model.quant")
    with torch.device("meta"):
        t = talker_mod.Talker(cfg.talker)
    t.model.text_embedding = nn.Embedding(4, cfg.talker.text_hidden_size, device="meta")
    t = t.to_empty(device="cpu").to(dtype)
    if state is None:
        with torch.no_grad():
            for n, p in t.named_parameters():
                p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0, 0.02)
        state = {k: v.clone() for k, v in t.state_dict().items()}
    else:
        t.load_state_dict(state)
    t.build_frame_table()
    if hasattr(t, "fuse_projections") and (quant or dtype != torch.float32):   # as Qwen3TTSModel does
        t.fuse_projections()
    if quant:
        quant_mod.quantize_talker(t, quant)
    return t.eval(), state


def make_runner(pkg: str, talker, cfg, dtype, batch: int, max_len: int):
    mr = importlib.import_module(f"{pkg}.engine.model_runner")
    pr = importlib.import_module(f"{pkg}.model.prompt")
    sp = importlib.import_module(f"{pkg}.model.sampling")
    D = cfg.talker.hidden_size
    r = mr.ModelRunner(talker, torch.zeros(D, dtype=dtype), rows=batch, max_len=max_len,
                       eos_id=cfg.talker.codec_eos_token_id)
    g = torch.Generator().manual_seed(1)
    p = pr.Prompt(prefill=(torch.randn(40, D, generator=g) * 0.05).to(dtype),
                  trailing=(torch.randn(8, D, generator=g) * 0.05).to(dtype))
    for row in range(batch):
        r.prefill(row, p, sp.SamplingParams(seed=row, ignore_eos=True))
    return r, mr, sp


def part_times(r, mr, sp, talker, batch: int, bf16: bool):
    """(code predictor s, talker s, the same in this thread's CPU time) of one more frame, timed apart (results
    discarded)."""
    rr = torch.arange(batch)
    rp = sp.RowParams(**{k: (v[:batch] if k != "host" else r._host_facts(batch, general=False))
                         for k, v in r.rp.__dict__.items()})
    scope = r.step_scope(batch) if hasattr(r, "step_scope") else mr.aten_bf16_gemv(bf16 and batch <= 2)
    with torch.inference_mode(), scope:
        a, ac = time.perf_counter(), time.thread_time()
        codes = r._predict_residuals(r.hidden[rr], r.c0[rr], r.step[rr] - 1, rp)
        b, bc = time.perf_counter(), time.thread_time()
        talker.forward_embeds(talker.frame_embed(codes)[:, None], r.cache, slice(0, batch), r.pos[rr] - 1,
                              max(r.host_len[:batch]))
        c, cc = time.perf_counter(), time.thread_time()
    return b - a, c - b, bc - ac, cc - bc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n")[0])
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
    from bench.speed import checkpoint_for
    from tts_engine.checkpoint import read_json
    from tts_engine.config import ModelConfig

    cfg = ModelConfig.from_dict(read_json(checkpoint_for(a.arch, torch.bfloat16) / "config.json"))
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
    out = {"device": _device(), "arch": a.arch, "mode": a.mode, "base_mode": base_mode, "batch": a.batch, "threads": torch.get_num_threads()}
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
    out["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))
    return 0


def _device() -> str:
    from bench.speed import device_name

    return device_name(torch.device("cpu"))


if __name__ == "__main__":
    sys.exit(main())
