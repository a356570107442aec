"""The engine's host work per frame, with the model's device work replaced by a stand-in that returns at once:
`python -m bench host [--rows 1,16,64] [--frames 120] [--rounds 3] [--path whole|split|graphs] [--json FILE]`.

What is timed is `EngineWorker.step` (one frame boundary, as the worker thread or a caller-driven engine runs it) for
`rows` streams that run together: the scheduler, the per-row bookkeeping, cutting chunks, handing them to the codec,
emitting audio. What is not: the code predictor's half of a frame and the talker step (`TTSEngine.wrap` puts
stand-ins in their place that return ready-made codes and done flags), and the codec's decode (a stand-in
`decode_step` returns silence of the right length). The streams are admitted and prefilled (on the tiny random
checkpoint) before the timing starts. `--path`: `whole` (default) runs whole eager frames, each read right after it;
`split` the CPU's split frames (the chunks handed over between the halves; `--split` says the same); `graphs` the
GPU's path: the frame is one replay of a stand-in for the captured CUDA graph (`TTSEngine.start_graphs` with an
object whose `run(B, read_len)` returns the codes and flags at once, so none of the eager frame's tensor indexing is
timed either) and the host runs one frame behind it (`EngineWorker.pipelined`). A frame's host time should stay flat
as rows are added: the issue's target is <= 1 ms per frame at 64 rows, and 64 rows within 2x of one row.

Prints one row per batch size: the worker thread's CPU ms per frame (mean; the figure the target is about, since
a shared machine's preemptions inflate the wall clock), wall mean, p50 and p99 ms per frame, CPU us per row and
frame, the ratio to the first row count's CPU mean, and that CPU mean split: the steps where no chunk went out
("frame ms") and those where chunks went out ("emit ms", how many: "emits"; with 12-frame chunks one step in 12),
beside the device and the load average; `--json FILE` writes the same figures.
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time

import torch

from bench.common import command, device_name, load_average, pct


def _engine(rows: int):
    from tts_engine import TTSEngine
    from tts_engine.tiny import random_checkpoint

    return TTSEngine.from_pretrained(str(random_checkpoint("tiny")), device="cpu", dtype="fp32", max_batch=rows,
                                     max_seq_len=4096, overlap_codec=False, govern_threads=False, prefix_cache_mb=0,
                                     fast_paths=False)


class StandIn:
    """The device's work of a frame, returning at once: ready-made codes [B, 16] and done flags [B] (all False:
    the streams run until the bench cancels them), and a codec decode that returns silence."""

    def __init__(self, rows: int, device, samples_per_frame: int):
        self.codes = torch.randint(0, 100, (rows, 16), dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.silence = torch.zeros(rows, 12 * samples_per_frame, device=device)
        self.spf = samples_per_frame

    def predictor(self, inner):
        return lambda h, c0, frame_idx, rp: self.codes[:h.shape[0]]

    def talker(self, inner):
        return lambda r, cache_rows, rp, read_len, codes: self.done[:codes.shape[0]]

    def decode_step(self, codes, state):
        return self.silence[:codes.shape[0], :codes.shape[2] * self.spf]


class StandInGraphs:
    """The captured frame's stand-in (`ModelRunner.graphs`): a replay that returns the frame's codes and end flags
    at once, as `cuda_graphs.GraphedFrames.run` returns its static outputs."""

    def __init__(self, stand: StandIn):
        self.stand, self.graphs = stand, {}

    def run(self, B: int, read_len: int):
        return self.stand.codes[:B], self.stand.done[:B]

    def capture_all(self) -> None:
        pass


def _drain(streams) -> None:
    for s in streams:
        q = s.seq.out if hasattr(s, "seq") else None
        if q is None:
            return
        try:
            while True:
                q.get_nowait()
        except queue.Empty:
            pass


def measure(rows: int, frames: int, rounds: int, path: str, warm: int = 30) -> dict:
    """Per-frame host work of `rows` streams -> {rows, cpu_ms (the worker thread's CPU time per frame, mean: what a
    busy machine's preemptions leave out), mean_ms, p50_ms, p99_ms (wall), us_per_row (CPU)}."""
    eng = _engine(rows)
    try:
        eng.drive_in_caller()
        eng.worker.split_frames = path == "split"
        dec = eng.model.speech_tokenizer.decoder
        stand = StandIn(rows, eng.runner.device, dec.total_upsample)
        put_back = [eng.wrap("code predictor", stand.predictor), eng.wrap("talker step", stand.talker)]
        if path == "graphs":
            eng.start_graphs(StandInGraphs(stand), capture_now=False)
            eng.worker.pipelined = True
        emitted = [False]

        def flag(inner):   # (which steps sent chunks out: one flag write per such step)
            def emit(*args, **kw):
                emitted[0] = True
                return inner(*args, **kw)
            return emit
        put_back.append(eng.wrap("emit", flag))
        dec.decode_step = stand.decode_step
        voices = eng.speakers
        times: list[float] = []
        cpu: list[float] = []
        cpu_emit: list[float] = []
        cpu_frame: list[float] = []
        try:
            for _ in range(rounds):
                streams = [eng.stream("Host work per frame.", voice=voices[i % len(voices)], seed=i,
                                      max_new_tokens=warm + frames + 4, first_chunk_frames=(1, 1))
                           for i in range(rows)]
                w = eng.worker
                for _ in range(warm):          # admission, prefill and the first chunks: not timed
                    w.step()
                _drain(streams)
                for k in range(frames):
                    emitted[0] = False
                    t0, c0 = time.perf_counter(), time.thread_time()
                    w.step()
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.thread_time() - c0)
                    (cpu_emit if emitted[0] else cpu_frame).append(cpu[-1])
                    if k % 24 == 23:
                        _drain(streams)
                for s in streams:
                    s.cancel()
        finally:
            for p in put_back:
                p()
            del dec.decode_step
    finally:
        eng.close()
    mean, cpu_mean = statistics.fmean(times), statistics.fmean(cpu)
    return {"rows": rows, "cpu_ms": 1000 * cpu_mean, "mean_ms": 1000 * mean, "p50_ms": 1000 * pct(times, 50),
            "p99_ms": 1000 * pct(times, 99), "us_per_row": 1e6 * cpu_mean / rows,
            "frame_cpu_ms": 1000 * statistics.fmean(cpu_frame) if cpu_frame else float("nan"),
            "emit_cpu_ms": 1000 * statistics.fmean(cpu_emit) if cpu_emit else float("nan"),
            "emit_steps": len(cpu_emit)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64", help="batch sizes (streams running together), comma separated")
    ap.add_argument("--frames", type=int, default=120, help="timed frames per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--path", choices=("whole", "split", "graphs"), default="whole",
                    help="whole eager frames; the CPU's split frames; the GPU's (a stand-in graph replay, pipelined)")
    ap.add_argument("--split", action="store_true", help="the same as --path split")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    a = ap.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",") if x.strip()]
    path = "split" if a.split else a.path
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # host work: one thread, as the worker's bookkeeping runs
    try:
        results = [measure(r, a.frames, a.rounds, path) for r in rows]
    finally:
        torch.set_num_threads(threads)   # (the caller's, where it runs in-process: tests)
    base = results[0]["cpu_ms"]
    print(f"# {command('host', argv)}")
    print(f"# device: {device_name(torch.device('cpu'))}; {load_average()}; "
          f"{path} frames, stand-in model and codec")
    print(f"{'rows':>5} {'cpu ms':>8} {'mean ms':>9} {'p50 ms':>8} {'p99 ms':>8} {'us/row':>8} "
          f"{'x rows=' + str(rows[0]):>10} {'frame ms':>9} {'emit ms':>8} {'emits':>6}")
    for r in results:
        r["ratio"] = r["cpu_ms"] / base if base else float("nan")
        print(f"{r['rows']:>5} {r['cpu_ms']:>8.3f} {r['mean_ms']:>9.3f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
              f"{r['us_per_row']:>8.1f} {r['ratio']:>10.2f} {r['frame_cpu_ms']:>9.3f} {r['emit_cpu_ms']:>8.3f} "
              f"{r['emit_steps']:>6}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"command": command("host", argv), "path": path, "split": path == "split", "results": results},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
