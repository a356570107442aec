"""Where a stream's wall time goes: `python -m bench breakdown --quantize auto --concurrency 1,4`.

Runs the streaming benchmark (`common.run_concurrency`, random-weight checkpoint, fixed length) on one engine with
its worker's parts timed from the inside: each request's prefill, the code predictor half and the talker half of
every frame (`TTSEngine.wrap`: "code predictor" / "talker step"), and every codec decode (by group size and chunk frames), each in
wall time and in the worker thread's CPU time (on a machine shared with other programs the CPU time is the steadier
figure). Also the first audio of one stream split into its parts (request building, prefill, the first frame's code
predictor, the first chunk's codec decode). `--threads 1` runs the engine at one thread without the thread
governor (the figures then do not include OpenMP waits). Prints markdown; nothing is written.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import Laps, bench_request, command, device_name, load1, random_checkpoint, run_concurrency


class _Acc:
    def __init__(self):
        self.parts: dict = {}

    def add(self, label: str, wall: float, cpu: float) -> None:
        x = self.parts.setdefault(label, [0.0, 0.0, 0])
        x[0] += wall
        x[1] += cpu
        x[2] += 1

    def timer(self, label):
        """A wrapper factory for `TTSEngine.wrap`: every call of the part timed under `label` (or `label(*args)`)."""
        def wrapper(f):
            def timed(*a, **k):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return f(*a, **k)
                finally:
                    self.add(label(*a) if callable(label) else label, time.perf_counter() - t0,
                             time.thread_time() - c0)
            return timed
        return wrapper


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench breakdown", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    p.add_argument("--quantize", default="auto")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--first-chunk", type=int, default=1)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--threads", type=int, help="intra-op threads (1: also no thread governor)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from tts_engine.engine import worker as worker_mod
    from tts_engine.engine.engine import TTSEngine

    conc = [int(x) for x in a.concurrency.split(",")]
    q = None if a.quantize == "none" else a.quantize
    engine = TTSEngine.from_pretrained(str(random_checkpoint(a.arch)), device="cpu", quantize=q,
                                       max_batch=max(conc), max_seq_len=a.frames + 160,
                                       govern_threads=None if (a.threads or 2) > 1 else False)
    engine.speakers_for_bench = engine.speakers
    acc = _Acc()
    r = engine.runner
    engine.wrap("prefill", acc.timer("prefill (one request)"))
    engine.wrap("code predictor", acc.timer(lambda h, *a: f"code predictor half, {h.shape[0]} row(s)"))
    engine.wrap("talker step", acc.timer(lambda rr, *a: f"talker half, {rr.shape[0]} row(s)"))
    engine.wrap("worker step", acc.timer("worker step (all of it)"))
    worker_mod.decode_group = acc.timer(
        lambda codec, items: f"codec decode, {len(items)} stream(s) x {items[0][1].shape[0]} frame(s)")(
        worker_mod.decode_group)
    run_concurrency(engine, 1, 4, a.first_chunk)   # warm-up
    out = [f"Device: **{device_name(torch.device('cpu'))}**. {a.arch} random weights, {engine.precision}, "
           f"{a.frames} frames per stream, first chunk {a.first_chunk} frame(s), thread governor "
           f"{'on' if engine.worker.governor is not None else 'off'}.", "",
           f"Command: `{command('breakdown', argv)}`"]
    for c in conc:
        acc.parts.clear()
        load0 = load1()
        row = run_concurrency(engine, c, a.frames, a.first_chunk)
        out += ["", f"**{c} stream(s)**: wall {row['wall_s']:.2f} s for {row['audio_s']:.2f} s of audio = "
                f"{row['audio_s_per_s']:.2f} audio s per wall s; first audio p50 {row['ttfa_p50_ms']:.0f} ms "
                f"(load average {load0:.2f} before, {load1():.2f} after).", "",
                "| part | calls | wall ms (per call) | worker CPU ms (per call) | share of the worker's CPU |",
                "|---|---|---|---|---|"]
        total_cpu = acc.parts.get("worker step (all of it)", [0, 1e-9, 0])[1]
        for k, (ws, cs, n) in sorted(acc.parts.items(), key=lambda kv: -kv[1][1]):
            out.append(f"| {k} | {n} | {1000 * ws:.0f} ({1000 * ws / n:.1f}) | {1000 * cs:.0f} ({1000 * cs / n:.1f}) | "
                       f"{100 * cs / total_cpu:.0f} % |")
    # first audio of one stream, part by part (the worker's own order: prefill, code predictor, codec, then talker)
    codec = engine.model.speech_tokenizer.decoder
    rows = []
    with torch.inference_mode():
        for _ in range(3):
            laps = Laps()
            req = bench_request(engine, 30, first_chunk_frames=1)
            laps.mark("request (text -> prompt)")
            state = codec.init_state(1, r.device)
            r.prefill(0, req.prompt, req.params)
            laps.mark(f"prefill ({req.prompt.prefill.shape[0]} positions)")
            codes = r.complete([0])
            laps.mark("first frame: code predictor (15 passes)")
            codec.decode_step(codes[None].transpose(1, 2), state)[0].float().cpu().numpy()
            laps.mark("first chunk: codec decode of 1 frame")
            r.advance([0], codes)
            laps.mark("(after the first audio: talker step)")
            r.release(0)
            rows.append(laps.ms)
    out += ["", "**First audio of one stream, part by part** (median of 3, the engine's own calls in the worker's order; "
            f"{torch.get_num_threads()} threads):", "", "| part | wall ms | CPU ms |", "|---|---|---|"]
    total = [0.0, 0.0]
    for k in rows[0]:
        ws = sorted(x[k][0] for x in rows)[1]
        cs = sorted(x[k][1] for x in rows)[1]
        out.append(f"| {k} | {ws:.0f} | {cs:.0f} |")
        if not k.startswith("(after"):
            total[0] += ws
            total[1] += cs
    out.append(f"| **submit -> first audio** | **{total[0]:.0f}** | **{total[1]:.0f}** |")
    print("\n".join(out))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
