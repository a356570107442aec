"""Where the fused decode step's time goes: `python -m bench fused_profile [--modes w8a8,w4a8,bf16]
[--paths split,team] [--out /tmp/x.md]`.

Builds the talker's and the code predictor's decoder stacks of the 0.6b architecture with random weights (W8A8,
W4A8 or bf16, as the engine quantises them) and times, in one process and interleaved (path A, path B, A, B, ...):
  - the fused step (`fused_step.StackPlan.run`) at one row: the talker at one position per call; the code predictor
    as in a frame (a call of two entries at positions 0 and 1, then 14 calls at positions 2..15), its stages timed
    by fused_step.cpp's profile (`fused_step.profile`): ms per call and, for the matmuls, GB/s of weight read;
  - the matmuls alone (`ttsf_matmuls`: the stack's matmuls in order, nothing between them) over weights of the same
    shapes rotating over > 300 MB (several copies of the predictor's stack), to separate a kernel below the memory
    floor ("busy": the slower thread's time in the kernel) from the hand-offs between kernels and the other stages;
  - the plain read (`common.PlainRead`, one pass after each path's frames, interleaved), the floor everything is
    compared with: GB/s figures against the median of the reads taken in the same table's rounds.
Paths (fused_step.team_setting): "split" (one at::parallel_for per matmul, small ops in the caller), "claim" and
"barrier" (the whole stack in one parallel region, fused_step.cpp run_team). Prints a table per mode and stack (best of --rounds for each figure's
call) and writes it to --out. Generation-step only: no sampling, no embeddings, no heads.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.common import PlainRead, device_name, load1, random_checkpoint, write_out

STACK_STAGES = ("other", "norm_in", "quant", "qkv", "rope_cache", "attn", "o_proj", "resid", "norm_post", "gate_up",
                "silu", "down")
MATMULS = {"qkv": "qkv", "o_proj": "o", "gate_up": "gu", "down": "down"}


def build_stack(cfg, mode: str, seed: int):
    """A random decoder stack of `cfg` in bf16, projections fused, quantised as quant.quantize_talker does (bf16:
    left as bf16 nn.Linear layers)."""
    from tts_engine.cpu import kernels
    from tts_engine.model.layers import DecoderStack
    from tts_engine.model.quant import quantize_module

    # W8A8 layers in our kernels' packed layout (the one the fused step reads), whatever the kernel table measured
    kernels.KernelTable.choice = lambda self, fmt, N, K, rows=1: "vnni" if fmt == "w8a8" else kernels.FORMATS[fmt].default
    torch.manual_seed(seed)
    with torch.device("meta"):
        stack = DecoderStack(cfg)
    stack = stack.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for n, p in stack.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0, 0.02)
    stack.fuse_projections()
    if mode != "bf16":
        quantize_module(stack.layers, mode)
    return stack.eval()


def weight_bytes(stack) -> dict[str, int]:
    """{matmul: bytes read per call, summed over layers} as the fused step reads them."""
    out = {"qkv": 0, "o": 0, "gu": 0, "down": 0}
    for layer in stack.layers:
        for key, m in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("gu", layer.mlp.gate_up_proj),
                       ("down", layer.mlp.down_proj)):
            if getattr(m, "packed", None) is not None:
                out[key] += m.packed.numel() + m.scale127.numel() * 4
            elif getattr(m, "packed4", None) is not None:
                out[key] += m.packed4.numel()
            else:
                out[key] += m.weight.numel() * m.weight.element_size()
    return out


def end_report(out: list[str], path: str | None, pr) -> int:
    """The report's last line (the load average and the plain reads `pr` took over the whole run, printed; `pr` is
    closed), then the report written to `path` (--out) where one is given -> 0, main's exit status."""
    out.append(f"load average after: {load1():.2f}; over the whole run: {pr.describe()}")
    pr.close()
    print(out[-1])
    write_out("\n".join(out), path)   # (the tables were printed as they came)
    return 0


def frame_calls(stack_name: str, talker_pos: int):
    """[(M, positions)] of one frame's calls at one row."""
    if stack_name == "talker":
        return [(1, [talker_pos])]
    return [(2, [0, 1])] + [(1, [p]) for p in range(2, 16)]


def run_frame(plan, cache, x, calls):
    for M, pos in calls:
        plan.run(x[:M], cache, torch.zeros(M, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), True)


def measure(lib, fused_step, plans, caches, x, calls, path: str, reps: int, matmul_only: bool):
    """Profile sums of `reps` frames (or matmul-only passes over every plan) on `path` -> (ns dict, wall s)."""
    fused_step.set_team(path)
    t0 = time.perf_counter()
    with fused_step.profile() as prof:
        for _ in range(reps):
            if matmul_only:
                for pl in plans:
                    lib.ttsf_matmuls(pl.dims.data_ptr(), pl.layers.data_ptr(), 1, 1, fused_step.TEAM_MODES[path])
            else:
                run_frame(plans[0], caches[0], x, calls)
    return prof.ns, time.perf_counter() - t0


def table(name: str, mode: str, res: dict, wb: dict, floor: float, calls_per_frame: int, copies: int) -> list[str]:
    """Markdown rows for one (mode, stack): res[path] = (stack profile ns, matmul-only ns), both per frame."""
    paths = list(res)
    total_b = sum(wb.values())
    lines = [f"#### {name}, {mode}, 1 row: {total_b / 1e6:.0f} MB of weights per call, {calls_per_frame} call(s) per "
             f"frame; plain read {floor:.1f} GB/s",
             "",
             "| stage | " + " | ".join(f"{p} ms/frame | {p} GB/s" for p in paths) + " |",
             "|---|" + "---|---|" * len(paths)]
    for st in STACK_STAGES:
        cells = []
        for p in paths:
            ns = res[p][0]
            ms = ns[st] / 1e6
            gb = ""
            if st in MATMULS and ns[st]:
                gb = f"{wb[MATMULS[st]] * calls_per_frame / ns[st]:.1f}"
            cells += [f"{ms:.3f}", gb]
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    for label, fn in (
            ("**call (all stages)**", lambda ns, mo: (ns["call"] / 1e6, total_b * calls_per_frame / ns["call"])),
            ("matmuls (wall: hand-offs and waits included)",
             lambda ns, mo: (sum(ns[s] for s in MATMULS) / 1e6, total_b * calls_per_frame / sum(ns[s] for s in MATMULS))),
            ("matmuls, slower thread's kernel time (busy max)",
             lambda ns, mo: (ns["busy_max"] / 1e6, total_b * calls_per_frame / max(1, ns["busy_max"]))),
            ("hand-offs (matmul walls - busy max)",
             lambda ns, mo: ((sum(ns[s] for s in MATMULS) - ns["busy_max"]) / 1e6, None)),
            ("imbalance (busy max - busy min)", lambda ns, mo: ((ns["busy_max"] - ns["busy_min"]) / 1e6, None)),
            (f"matmuls alone, ms per pass over one stack, rotating over {copies} cop{'y' if copies == 1 else 'ies'} (wall)",
             lambda ns, mo: (mo["call"] / copies / 1e6, total_b * copies / mo["call"])),
            ("matmuls alone, ms per pass, busy max", lambda ns, mo: (mo["busy_max"] / copies / 1e6, total_b * copies / max(1, mo["busy_max"])))):
        cells = []
        for p in paths:
            ms, gb = fn(*res[p])
            cells += [f"{ms:.3f}", "" if gb is None else f"{gb:.1f} ({100 * gb / floor:.0f} %)"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fused_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="w8a8,w4a8,bf16")
    ap.add_argument("--stacks", default="talker,predictor")
    ap.add_argument("--paths", default="split,claim", help="comma list of split / barrier / claim (fused_step.TEAM_MODES), "
                    "timed interleaved")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of (path A, path B, ...); the best round counts")
    ap.add_argument("--frames", type=int, default=4, help="frames per path per round")
    ap.add_argument("--talker-pos", type=int, default=60, help="the talker's cache position (prompt + frames)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--rotate-mb", type=int, default=320, help="the matmuls alone rotate over at least this much weight")
    ap.add_argument("--read-mb", type=int, help="the plain read's buffer in MiB (default: common.PlainRead's, 1 GiB or "
                    "32x the L3; smaller only for tests)")
    ap.add_argument("--config", help="the model's config.json (default: the bench's random 0.6b checkpoint's)")
    ap.add_argument("--out", help="write the tables here (markdown)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from tts_engine.config import TalkerConfig
    from tts_engine.cpu import fused_step
    from tts_engine.model.layers import KVCache

    if a.config is None:
        a.config = str(random_checkpoint("0.6b") / "config.json")
    with open(a.config, encoding="utf-8") as f:
        talker_cfg = TalkerConfig.from_dict(json.load(f)["talker_config"])
    device = device_name(torch.device("cpu"))
    lib = fused_step.library()
    paths = a.paths.split(",")
    pr = PlainRead(None if a.read_mb is None else a.read_mb << 20)
    head = [f"### Fused step profile ({device}, load {load1():.2f})", "",
            f"`python -m bench fused_profile --modes {a.modes} --stacks {a.stacks} --paths {a.paths} "
            f"--rounds {a.rounds} --frames {a.frames}`: best round of {a.rounds}, {a.frames} frames per path per "
            "round, interleaved; ms per frame (talker: 1 call; code predictor: 15 calls).", ""]
    out = list(head)
    print("\n".join(head), flush=True)
    for mode in a.modes.split(","):
        for name in a.stacks.split(","):
            scfg = talker_cfg if name == "talker" else talker_cfg.code_predictor
            stack = build_stack(scfg, mode, seed=1)
            wb = weight_bytes(stack)
            copies = max(1, -(-a.rotate_mb * 1_000_000 // sum(wb.values())))   # matmul-only rotation over > 300 MB
            plans = [fused_step.StackPlan(stack)]
            extra = [build_stack(scfg, mode, seed=2 + i) for i in range(copies - 1)]
            plans += [fused_step.StackPlan(s) for s in extra]
            caches = [KVCache(scfg.num_hidden_layers, 1, scfg.num_key_value_heads, 256, scfg.head_dim, "cpu",
                              torch.bfloat16)]
            x = (torch.randn(2, scfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.5).to(torch.bfloat16)
            calls = frame_calls(name, a.talker_pos)
            for p in paths:   # warm-up
                measure(lib, fused_step, plans, caches, x, calls, p, 1, False)
                measure(lib, fused_step, plans, caches, x, calls, p, 1, True)
            best: dict = {}
            mark = pr.mark()
            for r in range(a.rounds):
                for p in (paths if r % 2 == 0 else paths[::-1]):
                    ns, _ = measure(lib, fused_step, plans, caches, x, calls, p, a.frames, False)
                    mo, _ = measure(lib, fused_step, plans, caches, x, calls, p, a.frames, True)
                    ns = {k: v / a.frames for k, v in ns.items()}
                    mo = {k: v / a.frames for k, v in mo.items()}
                    pr.sample()
                    b = best.setdefault(p, [None, None])
                    if b[0] is None or ns["call"] < b[0]["call"]:
                        b[0] = ns
                    if b[1] is None or mo["call"] < b[1]["call"]:
                        b[1] = mo
            fused_step.set_team(fused_step.team_setting())
            lines = table(name, mode, {p: tuple(best[p]) for p in paths}, wb, pr.spread(mark)["median"], len(calls),
                          len(plans))
            lines.insert(1, f"({pr.describe(mark)})")
            print("\n".join(lines), flush=True)
            out += lines
            del stack, extra, plans
    return end_report(out, a.out, pr)


if __name__ == "__main__":
    sys.exit(main())
