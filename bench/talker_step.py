"""Where the talker's per-frame step goes at one stream: `python -m bench talker_step [--modes w8a8,w4a8,bf16]
[--frames 24] [--out /tmp/x.md]`.

Builds the 0.6b architecture's (--arch) talker with random weights (as bench/step.py does) in each mode and a one-row model runner,
then, frame after frame (the code predictor's codes of each frame from `ModelRunner.complete`), times in turn
(interleaved, the order rotating):
  - "step": `ModelRunner.advance` end to end with the talker step in one C++ call (`talker_step`, forced on: --step);
  - "python": `ModelRunner.advance` end to end on the Python path;
  - "split": the Python path split into its parts: embeddings (frame_embed + trailing vector), the stack call
    (`DecoderStack.run`, the fused step), codec head (+ .float()), sampling (`C0Processor`), state updates (pos, seen,
    step, hidden, c0) and the rest (the caller's bookkeeping, the step scope);
  - the plain read (`common.PlainRead`, once per frame) for the memory floor, and the talker weights' bytes per
    frame; read_GBps is its median (min-max), *_pct the median over frames of a path's GB/s / the same frame's read.
Both paths advance the same runner, so they see the same lengths. Medians over --frames per path. The device and the
load average go with the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.common import PlainRead, build_talker, device_name, load1, make_runner, percent, random_config, \
    report
from tts_engine.cpu.measured import describe


def talker_weight_bytes(talker) -> int:
    """Bytes of weights one talker step reads: the decoder stack's linear layers and the codec head."""
    from tts_engine.model.quant import W4A8Linear, W8A8Linear

    def nbytes(m) -> int:
        if isinstance(m, W8A8Linear):
            return m.out_features * m.in_features
        if isinstance(m, W4A8Linear):
            return m.packed4.numel() * m.packed4.element_size()
        return m.weight.numel() * m.weight.element_size()

    n = nbytes(talker.codec_head)
    for layer in talker.model.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
            n += nbytes(lin)
    return n


def split_python(r, rows, codes):
    """`ModelRunner.advance` over the Python path, timed part by part -> ({part: s}, done)."""
    clock = time.perf_counter
    t = [clock()]
    B = len(rows)
    read_len = max(r.host_len[i] for i in rows) + 1
    rr, cache_rows, rp = r.rows_view(rows)
    with torch.inference_mode(), r.step_scope(B):
        t.append(clock())
        frame_idx = r.step[rr] - 1
        x = r.talker.frame_embed(codes) + r.text_vectors(rr, frame_idx)
        t.append(clock())
        h = r.talker.model.run(x[:, None], r.cache, cache_rows, r.pos[rr], read_len)[:, -1]
        t.append(clock())
        logits = r.talker.codec_head(h).float()
        t.append(clock())
        c0 = r.c0_proc(logits, r.seen[rr], r.step[rr], rp)
        t.append(clock())
        r.pos[rr] = (r.pos[rr] + 1).clamp(max=r.max_len - 1)
        done = r.finish_step(rr, h, c0)
        t.append(clock())
    for i in rows:
        r.host_len[i] += 1
    t.append(clock())
    names = ("rows_view", "embed", "stack", "head", "sampling", "state", "rest")
    parts = {n: t[i + 1] - t[i] for i, n in enumerate(names)}
    parts["rest"] += parts.pop("rows_view")
    parts["total"] = t[-1] - t[0]
    return parts, done


def run_mode(mode: str, frames: int, arch: str = "0.6b") -> dict:
    cfg = random_config(arch)
    dtype = torch.bfloat16
    quant = mode if mode in ("int8", "int4", "w8a8", "w4a8") else None
    torch.manual_seed(0)
    t, _ = build_talker("tts_engine", cfg, dtype, quant)
    r, mr, sp = make_runner("tts_engine", t, cfg, dtype, 1, 4 * frames + 120)
    rows = [0]
    out = {"mode": mode, "fused": describe(r.path_entries.get("talker stack", {})),
           "talker_step": describe(r.path_entries.get("talker step", {}))}
    step = r.talker_step
    floor = PlainRead()
    variants = ["python", "split"] + (["step"] if step is not None else [])
    res: dict[str, list] = {v: [] for v in variants + ["read"]}
    for k in range(frames):
        for which in variants[k % len(variants):] + variants[:k % len(variants)]:
            codes = r.complete(rows)
            if which == "split":
                parts, _ = split_python(r, rows, codes)
                res["split"].append(parts)
                continue
            r.talker_step = step if which == "step" else None
            t0 = time.perf_counter()
            r.advance(rows, codes)
            res[which].append(time.perf_counter() - t0)
            r.talker_step = step
        res["read"].append(floor.sample())
    floor.close()
    med = statistics.median
    wb = talker_weight_bytes(t)
    out["weights_MB"] = round(wb / 1e6, 1)
    sp = floor.spread()
    out["read_GBps"] = f"{sp['median']:.1f} ({sp['min']:.1f}-{sp['max']:.1f})"
    for v in ("python", "step"):
        if res.get(v):
            out[f"{v}_ms"] = round(1e3 * med(res[v]), 2)
            out[f"{v}_GBps"] = round(wb / med(res[v]) / 1e9, 1)
            # % of the plain read taken in the same frame, median over the frames
            out[f"{v}_pct"] = round(med(percent(wb / s / 1e9, g) for s, g in zip(res[v], res["read"])))
    for p in ("total", "embed", "stack", "head", "sampling", "state", "rest"):
        out[f"split_{p}_ms"] = round(1e3 * med(x[p] for x in res["split"]), 2)
    out["stack_GBps"] = round(wb / med(x["stack"] for x in res["split"]) / 1e9, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench talker_step", description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="w8a8,w4a8,bf16")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--arch", default="0.6b", choices=["tiny", "0.6b"],
                   help="tiny: a stack so small that the work around it shows")
    p.add_argument("--threads", type=int)
    p.add_argument("--out")
    p.add_argument("--step", default="1", help="TTS_TALKER_STEP for the runner (default 1: forced on, timed beside the "
                   "Python path)")
    a = p.parse_args(argv)
    os.environ["TTS_TALKER_STEP"] = a.step
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for mode in a.modes.split(","):
        rows.append(run_mode(mode, a.frames, a.arch))
        print(json.dumps(rows[-1]), flush=True)
    head = ["mode", "python_ms", "step_ms", "split_total_ms", "split_embed_ms", "split_stack_ms", "split_head_ms",
            "split_sampling_ms", "split_state_ms", "split_rest_ms", "weights_MB", "python_GBps", "step_GBps",
            "stack_GBps", "read_GBps", "python_pct", "step_pct", "talker_step"]
    lines = [f"Talker step at one row, {a.arch}, {device_name(torch.device('cpu'))}, load average "
             f"{load1():.2f} (medians of {a.frames} frames per path; read_GBps: the plain read, "
             "common.PlainRead, once per frame: median (min-max); *_pct: median over frames of GB/s / that frame's read)",
             "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r.get(h, "")) for h in head) + " |" for r in rows]
    text = "\n".join(lines)
    report(text, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
