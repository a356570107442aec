"""The talker step inside the engine against the same step alone, interleaved with the plain read:
`python -m bench engine_step [--quantize w8a8] [--frames 24] [--rounds 3] [--base /other/checkout]
[--variants served,codec_in_worker,no_governor,alone,alone_no_predictor] [--out /tmp/x.md]`.

One process, one random-weight engine per checkout (this one: B; --base: A, imported as `tts_base`, as bench/ab.py does).
Every variant times the SAME span, the engine's talker step (embeddings, the stack, the codec head, codebook-0
sampling and the row state; where the step in one C++ call serves, that call), by wrapping it on the engine's
instance (`TTSEngine.wrap("talker step")`; --base: a checkout with that hook), and records per call: its wall time, the calling thread's CPU time in it (wall minus CPU: waiting
for a core or for OpenMP threads), the OpenMP threads it ran with (the governor's option: 1, N, or "matmul"), whether
the engine's codec thread was decoding at its start, and the C++ call's own time inside it (`StepPlan.run`). Variants,
run round by round in a rotating order, with a plain read (`common.PlainRead`) before every block:
  served              one stream through the public API (`common.run_concurrency`), the engine as configured
                      (thread governor, codec thread, split frames);
  codec_in_worker     the same with every chunk decoded in the worker (the codec thread set aside: nothing beside);
  no_governor         the same with the thread governor off (every frame with the process's threads);
  bare                governor off and the codec in the worker;
  alone               in the caller's thread on the idle engine: the predictor's frame (`ModelRunner.complete`), then
                      the talker step (`advance`), frame after frame, with the process's threads (as bench/talker_step.py);
  alone_no_predictor  the talker step alone, step after step, no predictor frame between (warm caches and TLB).
Reported per engine and variant: the step's median ms, GB/s of the talker's weights (`talker_step.
talker_weight_bytes`), % of the plain reads taken beside that block, the median of the C++ call inside it, the
wait (wall - CPU: the calling thread's own CPU only, so at N threads it also counts the time the caller waits for its
team) and the options the steps ran with (count and median ms each; "busy": the codec thread was decoding at the step's
start), and beside them the predictor frames' median ms per option (`TTSEngine.wrap("code predictor")`: not slowed?).
Nothing is written to
docs/benchmarks.md (--out FILE writes the table there). The device and the load average go with the table.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

from bench.common import (PlainRead, bench_request, command, device_name, load_average, load_checkout,
                          random_checkpoint, report, run_concurrency)

VARIANTS = ("served", "codec_in_worker", "no_governor", "bare", "alone", "alone_no_predictor")


class StepTimer:
    """Wraps one engine's talker step (`TTSEngine.wrap("talker step")`, and the step's `StepPlan.run` inside it) and
    its predictor half ("code predictor") -> a record per call."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list[dict] = []
        self.on = False
        self._inner = threading.local()
        mm = engine.worker.matmul_threads

        def timed_step(orig):
            def advance(*args, **kw):
                if not self.on:
                    return orig(*args, **kw)
                codec = engine.worker.codec
                n = torch.get_num_threads()
                option = "matmul" if mm is not None and mm.serial else str(n)
                busy = bool(codec is not None and codec.busy)
                self._inner.s = 0.0
                c0, t0 = time.thread_time(), time.perf_counter()
                try:
                    return orig(*args, **kw)
                finally:
                    wall = time.perf_counter() - t0
                    self.records.append({"wall": wall, "cpu": time.thread_time() - c0, "option": option,
                                         "codec_busy": busy, "call": self._inner.s})
            return advance

        engine.wrap("talker step", timed_step)
        self.predictor: list[dict] = []   # the predictor's frames beside them (not slowed?)

        def timed_predictor(pred):
            def predict(*args, **kw):
                if not self.on:
                    return pred(*args, **kw)
                option = "matmul" if mm is not None and mm.serial else str(torch.get_num_threads())
                t0 = time.perf_counter()
                try:
                    return pred(*args, **kw)
                finally:
                    self.predictor.append({"wall": time.perf_counter() - t0, "option": option})
            return predict

        engine.wrap("code predictor", timed_predictor)
        step = getattr(engine.runner, "talker_step", None)
        if step is not None:
            plan_run = step.plan.run

            def run(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return plan_run(*args, **kw)
                finally:
                    self._inner.s = getattr(self._inner, "s", 0.0) + time.perf_counter() - t0

            step.plan.run = run

    @contextlib.contextmanager
    def recording(self):
        self.records, self.predictor = [], []   # (the caller copies its block's records before the next one)
        self.on = True
        try:
            yield self.records
        finally:
            self.on = False


@contextlib.contextmanager
def variant_state(engine, name: str):
    """The engine switched for one variant's block (put back after)."""
    w = engine.worker
    codec, gov = w.codec, w.governor
    if name in ("codec_in_worker", "bare") and codec is not None:
        codec.drain(30)
        w.codec = None
    if name in ("no_governor", "bare"):
        w.governor = None
    try:
        yield
    finally:
        w.codec, w.governor = codec, gov


def alone(engine, frames: int, predictor: bool) -> None:
    """`frames` talker steps of row 0 in the caller's thread on the idle engine; predictor: the predictor's frame
    (`complete`) before each, else the first frame's codes again (the step consumes any valid codes)."""
    runner = engine.runner
    req = bench_request(engine, frames + 2)
    with torch.inference_mode():
        runner.prefill(0, req.prompt, req.params)
        rows = [0]
        codes = runner.complete(rows)
        try:
            for _ in range(frames):
                if predictor:
                    codes = runner.complete(rows)
                runner.advance(rows, codes)
        finally:
            runner.release(0)


def run_block(engine, timer: StepTimer, name: str, frames: int, first_chunk: int) -> tuple[list, list]:
    """One variant's block -> (the talker steps' records, the predictor frames' records)."""
    with timer.recording() as recs, variant_state(engine, name):
        if name.startswith("alone"):
            alone(engine, frames, predictor=name == "alone")
        else:
            run_concurrency(engine, 1, frames, first_chunk)
            if engine.worker.codec is not None:
                engine.worker.codec.drain(30)
        return list(recs), list(timer.predictor)


def summarize(recs: list[dict], wbytes: int, reads: list[float]) -> dict:
    med = statistics.median
    walls = [r["wall"] for r in recs]
    out = {"n": len(recs), "ms": 1e3 * med(walls), "GBps": wbytes / med(walls) / 1e9,
           "call_ms": 1e3 * med(r["call"] for r in recs), "wait_ms": 1e3 * med(r["wall"] - r["cpu"] for r in recs),
           "read": med(reads) if reads else None}
    out["pct"] = 100.0 * out["GBps"] / out["read"] if out["read"] else None
    by = defaultdict(list)
    for r in recs:
        by[(r["option"], r["codec_busy"])].append(r["wall"])
    out["options"] = ", ".join(f"{o}{' busy' if b else ''}: {len(v)} x {1e3 * med(v):.1f}"
                               for (o, b), v in sorted(by.items()))
    return out


def _pred(recs: list[dict]) -> str:
    """The predictor frames' median ms, and per option (steps x median ms)."""
    if not recs:
        return ""
    med = statistics.median
    by = defaultdict(list)
    for r in recs:
        by[r["option"]].append(r["wall"])
    return f"{1e3 * med(r['wall'] for r in recs):.1f} (" + ", ".join(
        f"{o}: {len(v)} x {1e3 * med(v):.1f}" for o, v in sorted(by.items())) + ")"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench engine_step", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b"])
    p.add_argument("--quantize", default="w8a8", help="w8a8, w4a8, int8, int4 or none (bf16)")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--first-chunk", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="served,codec_in_worker,no_governor,alone,alone_no_predictor")
    p.add_argument("--base", help="another checkout (A), e.g. a detached worktree of main")
    p.add_argument("--out")
    a = p.parse_args(argv)
    from bench.talker_step import talker_weight_bytes

    variants = [v for v in a.variants.split(",") if v]
    bad = set(variants) - set(VARIANTS)
    if bad:
        raise SystemExit(f"unknown variant(s) {sorted(bad)}; use {', '.join(VARIANTS)}")
    ckpt = str(random_checkpoint(a.arch))
    q = None if a.quantize == "none" else a.quantize
    kw = dict(device="cpu", quantize=q, max_batch=1, max_seq_len=4 * a.frames + 200)
    engines = {}
    if a.base:
        load_checkout("tts_base", a.base)
        from importlib import import_module

        engines["A"] = import_module("tts_base.engine.engine").TTSEngine.from_pretrained(ckpt, **kw)
    from tts_engine.engine.engine import TTSEngine

    engines["B"] = TTSEngine.from_pretrained(ckpt, **kw)
    timers = {}
    for n, e in engines.items():
        e.speakers_for_bench = e.speakers
        run_concurrency(e, 1, 4, a.first_chunk)   # warm-up
        timers[n] = StepTimer(e)
    wbytes = talker_weight_bytes(engines["B"].model.talker)
    floor = PlainRead()
    blocks = [(n, v) for n in engines for v in variants]
    recs: dict = defaultdict(list)
    reads: dict = defaultdict(list)
    preds: dict = defaultdict(list)
    start_load = load_average()
    for r in range(a.rounds):
        order = blocks[r % len(blocks):] + blocks[:r % len(blocks)]
        for n, v in order:
            before = floor.sample()
            got, pred = run_block(engines[n], timers[n], v, a.frames, a.first_chunk)
            after = floor.sample()
            recs[n, v] += got
            preds[n, v] += pred
            reads[n, v] += [before, after]
            s = summarize(got, wbytes, [before, after])
            print(f"round {r} {n} {v}: predictor {_pred(pred)}; step {s['ms']:.2f} ms ({s['pct']:.0f} % of the read {s['read']:.1f} GB/s), "
                  f"call {s['call_ms']:.2f}, wait {s['wait_ms']:.2f}; {s['options']} ({load_average()})",
                  file=sys.stderr, flush=True)
    floor_all = floor.spread()
    for e in engines.values():
        e.close()
    e = engines["B"]
    lines = [f"Talker step in the engine vs alone. Device: **{device_name(torch.device('cpu'))}**. {a.arch} random "
             f"weights, {e.precision}, talker weights {wbytes / 1e6:.0f} MB per step, {a.frames} frames per block, "
             f"{a.rounds} interleaved rounds (medians of every step of a variant). Plain read beside the blocks: "
             f"{floor_all['median']:.1f} GB/s median ({floor_all['min']:.1f}-{floor_all['max']:.1f}, {floor_all['n']} "
             f"reads). {start_load} at the start, {load_average()} at the end.", "",
             f"Command: `{command('engine_step', argv)}`",
             "", "| engine | variant | steps | step ms | GB/s | % of the read beside | C++ call ms | wait ms (wall - CPU) "
             "| options: steps x median ms | predictor frame ms (options) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (n, v), rr in recs.items():
        if not rr:
            continue
        s = summarize(rr, wbytes, reads[n, v])
        lines.append(f"| {n} | {v} | {s['n']} | {s['ms']:.2f} | {s['GBps']:.1f} | {s['pct']:.0f} | {s['call_ms']:.2f} "
                     f"| {s['wait_ms']:.2f} | {s['options']} | {_pred(preds[n, v])} |")
    text = "\n".join(lines)
    report(text, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
