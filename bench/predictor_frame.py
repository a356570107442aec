"""Where the code predictor's frame in one call spends its time: `python -m bench predictor_frame
[--modes w8a8,w4a8,bf16] [--rows 1,4] [--base /work/main] [--shares split,claim] [--out /tmp/x.md]`.

Builds the talker of the random-weight 0.6b architecture (its own stack cut to one layer: only the code predictor
is timed) in W8A8, W4A8 or bf16, a model runner over it with the fused step and the predictor frame forced on
(TTS_FUSED_STEP=1, TTS_PREDICTOR_FRAME=1), and times per frame, interleaved round by round:
  - "call": the C++ frame call alone (predictor_frame.cpp's profile, F_CALL), split into its stages (setup, the
    projection, the 15 stack calls, final norms, lm_heads, rounding, sampling, next embeddings) and the stack's own
    stages inside (fused_step.cpp's profile);
  - "plan.run": `FramePlan.run` (the call plus its Python: argument tensors, checks, the output);
  - "runner": `ModelRunner.predict_residuals` (what the engine calls per frame: the frame's `takes`, its thread
    switch, `run`), wall time and the main thread's CPU time;
  - with --base: the same three of another checkout (A, e.g. main; its own library built from its sources, the same
    random weights), interleaved with this one (B).
Sampling as the engine's default (sub-talker top-k 50, temperature 0.9). Also the plain read (`common.PlainRead`, one pass
after every frame series, interleaved; % of the median of those taken in the same table's rounds) and the GB/s of the predictor's weights per frame (15 stack passes and 15 heads). Prints a table per
mode and row count (best of --rounds of the median frame), writes it to --out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.common import PlainRead, build_talker, device_name, load1, load_checkout, make_runner, random_checkpoint


def _env() -> None:
    os.environ["TTS_FUSED_STEP"] = "1"
    os.environ["TTS_PREDICTOR_FRAME"] = "1"


def build(pkg: str, mode: str, rows: int, state=None):
    """(talker, runner, state) of package `pkg` (tts_engine or another checkout's, imported as tts_base)."""
    import importlib

    from tts_engine.checkpoint import read_json

    cfg_mod = importlib.import_module(f"{pkg}.config")
    d = read_json(random_checkpoint("0.6b") / "config.json")
    d["talker_config"] = dict(d["talker_config"], num_hidden_layers=1)
    cfg = cfg_mod.ModelConfig.from_dict(d)
    t, state = build_talker(pkg, cfg, torch.bfloat16, None if mode == "bf16" else mode, state)
    r, _, sp = make_runner(pkg, t, cfg, torch.bfloat16, rows, 64)
    return t, r, sp, state


def weight_bytes(t) -> int:
    """Bytes of predictor weights one frame reads: 15 passes over the stack, each head once, the projection."""
    cp = t.code_predictor

    def lin(m) -> int:
        if m is None or isinstance(m, torch.nn.Identity):
            return 0
        for a in ("packed", "packed4"):
            w = getattr(m, a, None)
            if w is not None:
                return w.numel() * w.element_size() + (m.scale127.numel() * 4 if a == "packed" else 0)
        return m.weight.numel() * m.weight.element_size()

    stack = 0
    for layer in cp.model.layers:
        a, m = layer.self_attn, layer.mlp
        stack += sum(lin(x) for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))
    books = len(cp.lm_head)
    return books * stack + sum(lin(h) for h in cp.lm_head) + books * lin(cp.small_to_mtp_projection)


def inputs(r, B: int):
    """(hidden, c0, frame indices, RowParams) of rows 0..B-1, as their next frame starts from."""
    rr, _, rp = r.rows_view(list(range(B)))
    return r.hidden[rr].clone(), r.c0[rr].clone(), (r.step[rr] - 1).clone(), rp


class _NoProfile:
    frame: dict = {}
    stack: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def one(variant, B: int, frames: int) -> dict:
    """Medians over `frames` frames of one variant: call (profile), plan.run, runner, runner CPU; and the profile
    sums per frame."""
    pkg, t, r, sp, pf, team, share = variant
    if team is not None:   # "claim-pass": a team mode, one region per pass
        pf.set_team(team.split("-")[0], not team.endswith("-pass"))
    if share is not None:   # how each matmul shares its blocks between threads (cpu_ext.set_share)
        from tts_engine.cpu import cpu_ext

        cpu_ext.set_share(share)
    h, c0, fi, rp = inputs(r, B)
    h = (torch.randn(h.shape, generator=torch.Generator().manual_seed(B)) * 0.5).to(h.dtype)
    frame = t.code_predictor.frame
    wall_run, wall_runner, cpu_runner, call = [], [], [], []
    stages, stack = {}, {}
    with torch.inference_mode():
        for _ in range(frames):
            with (pf.profile() if hasattr(pf, "profile") else _NoProfile()) as prof:   # (older checkouts: none)
                a = time.perf_counter()
                frame.plan.run(h, c0, fi, rp, r.cp_cache)
                wall_run.append(time.perf_counter() - a)
            call.append(prof.frame["call"] / 1e9 if prof.frame else wall_run[-1])
            for k, v in prof.frame.items():
                stages[k] = stages.get(k, 0) + v / frames
            for k, v in prof.stack.items():
                stack[k] = stack.get(k, 0) + v / frames
            a, ac = time.perf_counter(), time.thread_time()
            r.predict_residuals(h, c0, fi, rp)
            wall_runner.append(time.perf_counter() - a)
            cpu_runner.append(time.thread_time() - ac)
    med = statistics.median
    return {"call": med(call), "plan_run": med(wall_run), "runner": med(wall_runner), "runner_cpu": med(cpu_runner),
            "stages": stages, "stack": stack}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench predictor_frame", description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="w8a8,w4a8,bf16")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--frames", type=int, default=5, help="frames per variant per round")
    ap.add_argument("--base", help="another checkout (A) timed interleaved with this one (B)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--teams", default="", help="comma list of split / barrier / claim (the whole frame in one "
                    "parallel region) / barrier-pass / claim-pass (one per pass): this checkout's frame once per team "
                    "mode (predictor_frame.set_team), interleaved; default: as TTS_FUSED_TEAM says")
    ap.add_argument("--shares", default="", help="comma list of split / claim: this checkout's frame once per way "
                    "its matmuls share their blocks between threads (cpu_ext.set_share), interleaved; default: as "
                    "TTS_MATMUL_SHARE / the remembered trial say")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    _env()
    if a.threads:
        torch.set_num_threads(a.threads)
    from bench.fused_profile import end_report
    from tts_engine.cpu import predictor_frame

    pkgs = [("B", "tts_engine", predictor_frame)]
    if a.base:
        import importlib

        load_checkout("tts_base", a.base)
        pkgs.insert(0, ("A", "tts_base", importlib.import_module("tts_base.cpu.predictor_frame")))
    rows = [int(x) for x in a.rows.split(",")]
    pr = PlainRead()
    out = [f"### Code predictor frame ({device_name(torch.device('cpu'))}, load {load1():.2f}, {pr.describe()} before)", "",
           f"`python -m bench predictor_frame --modes {a.modes} --rows {a.rows} --rounds {a.rounds} "
           f"--frames {a.frames}{' --base ' + a.base if a.base else ''}{' --teams ' + a.teams if a.teams else ''}"
           f"{' --threads ' + str(a.threads) if a.threads else ''}`: ms per frame, best round's median"
           f"{' (A: ' + a.base + ', B: this checkout, interleaved)' if a.base else ''}.", ""]
    print("\n".join(out), flush=True)
    for mode in a.modes.split(","):
        state = None
        built = {}
        for name, pkg, pf in pkgs:
            t, r, sp, state = build(pkg, mode, max(rows), state)
            st = t.code_predictor.frame.status if t.code_predictor.frame is not None else "none"
            if t.code_predictor.frame is None or t.code_predictor.frame.state != "on":
                print(f"{name} {mode}: the predictor frame does not serve ({st}); skipped", flush=True)
                continue
            teams = a.teams.split(",") if name == "B" and a.teams else [None]
            shares = a.shares.split(",") if name == "B" and a.shares else [None]
            for team in teams:
                for share in shares:
                    label = "-".join([name] + [v for v in (team, share) if v])
                    built[label] = (pkg, t, r, sp, pf, team, share)
        if not built:
            continue
        wb = weight_bytes(next(iter(built.values()))[1])
        for B in rows:
            for v in built.values():
                one(v, B, 2)   # warm-up
            best: dict = {}
            mark = pr.mark()
            for rd in range(a.rounds):
                order = list(built) if rd % 2 == 0 else list(built)[::-1]
                for name in order:
                    res = one(built[name], B, a.frames)
                    pr.sample()   # the plain read, interleaved with the frames
                    if name not in best or res["call"] < best[name]["call"]:
                        best[name] = res
            floor = pr.spread(mark)["median"]
            names = list(best)
            lines = [f"#### {mode}, {B} row(s): {wb / 1e6:.0f} MB of predictor weights per frame, load "
                     f"{load1():.2f}, {pr.describe(mark)}: % of its median", "",
                     "| | " + " | ".join(f"{n} ms | {n} GB/s (% of plain read)" for n in names) + " |",
                     "|---|" + "---|---|" * len(names)]

            def row(label, f, gb=False):
                cells = []
                for n in names:
                    s = f(best[n])
                    cells += [f"{1e3 * s:.2f}", f"{wb / s / 1e9:.1f} ({100 * wb / s / 1e9 / floor:.0f} %)" if gb else ""]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")

            row("runner.predict_residuals (engine's call)", lambda x: x["runner"], True)
            row("runner, main thread CPU time", lambda x: x["runner_cpu"])
            row("FramePlan.run", lambda x: x["plan_run"], True)
            row("C++ frame call", lambda x: x["call"], True)
            for st in predictor_frame.FRAME_STAGES[:8]:
                row(f"&nbsp; {st}", lambda x, st=st: x["stages"].get(st, 0) / 1e9)
            row("&nbsp; stack: matmul walls (qkv, o, gate_up, down)",
                lambda x: sum(x["stack"].get(k, 0) for k in ("qkv", "o_proj", "gate_up", "down")) / 1e9)
            row("&nbsp; stack: slower thread's kernel time (busy max, heads' included)", lambda x: x["stack"].get("busy_max", 0) / 1e9)
            row("&nbsp; stack: attention + rope/cache", lambda x: (x["stack"].get("attn", 0) + x["stack"].get("rope_cache", 0)) / 1e9)
            row("&nbsp; stack: quant / norms / resid / silu",
                lambda x: sum(x["stack"].get(k, 0) for k in ("quant", "norm_in", "norm_post", "resid", "silu")) / 1e9)
            lines.append("")
            print("\n".join(lines), flush=True)
            out += lines
        del built
    return end_report(out, a.out, pr)


if __name__ == "__main__":
    sys.exit(main())
