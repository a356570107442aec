"""The codec's work for concurrent streams with their chunks cut on a shared frame clock or each on its own schedule:
`python -m bench chunk_align [--starts 1,2,2,2] [--frames 60] [--conv int8] [--rounds 3]`.

Streams starting at the frames `--starts` each get `--frames` frames; their chunks are cut by the engine worker's
own rule (`EngineWorker.next_chunks`, with `align_chunks` on and off) and decoded as the worker groups them (the
chunks that go out at one frame with one size: one batched call) by the codec decoder of the random-weight checkpoint,
at one intra-op thread (the codec thread's), the two cuttings interleaved round by round. Prints the chunks per
frame, the calls and the codec seconds of each, with the load average. No model but the decoder is loaded.
`--int8-ways rows,batched,auto` times each cutting with each way of running a batch's int8 convs (row by row, one
call, measured per conv: `cpu/int8_conv.py`, TTS_CODEC_INT8_BATCH), e.g. `--cuts shared --int8-ways rows,auto`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from bench.common import command, device_name, random_checkpoint
from bench.common import load_average as _load


def cut(starts: list[int], frames: int, align: bool, first: int = 1, cap: int = 12) -> list[tuple[int, list]]:
    """[(frame, [(stream, frames of its chunk, first chunk?)])]: the chunks that go out at each frame, cut by the
    worker's rule."""
    from tts_engine.engine.request import chunk_schedule
    from tts_engine.engine.scheduler import Scheduler, Sequence, Status
    from tts_engine.engine.worker import EngineWorker

    w = EngineWorker.__new__(EngineWorker)          # (only the rule's state: the clock, the switch, the running)
    w.frame, w.align_chunks, w.scheduler = 0, align, Scheduler(len(starts), 0)
    seqs = [Sequence(request=None) for _ in starts]
    done = [0] * len(starts)
    out = []
    for t in range(1, max(starts) + frames + 1):
        w.frame = t
        for i, s in enumerate(seqs):
            if starts[i] == t:                       # admitted: its first chunk follows the schedule
                s.status, s.chunk_sizes = Status.RUNNING, chunk_schedule(first, cap)
                s.target, s.pending = next(s.chunk_sizes), []
                w.scheduler.running.append(s)
        ready, going = [], []
        for i, s in enumerate(seqs):
            if s.status is Status.RUNNING:
                s.pending.append(t)
                done[i] += 1
                if len(s.pending) >= s.target or done[i] == frames:
                    ready.append((i, len(s.pending), s.chunk_frames == 0))
                    s.pending = []
                    if done[i] == frames:
                        s.status = Status.FINISHED
                        w.scheduler.running.remove(s)
                    else:
                        going.append(s)
        w.next_chunks(going)
        if ready:
            out.append((t, ready))
    return out


def decode_all(dec, plan, codes: torch.Tensor) -> tuple[float, int, float]:
    """Seconds, calls and this thread's CPU seconds to decode `plan`'s chunks of `codes` [S, 16, frames] as the
    worker groups them (CPU time: at one intra-op thread, what a busy machine's preemptions leave out)."""
    from tts_engine.codec.decoder import CodecDecoderState

    st = [dec.init_state(1) for _ in range(codes.shape[0])]
    pos, calls = [0] * codes.shape[0], 0
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.inference_mode():
        for _, chunks in plan:
            groups = defaultdict(list)
            for i, n, first in chunks:
                groups[n, first].append(i)
            for (n, _), rows in groups.items():
                s = st[rows[0]] if len(rows) == 1 else CodecDecoderState.concat([st[i] for i in rows])
                dec.decode_step(torch.stack([codes[i, :, pos[i]:pos[i] + n] for i in rows]), s)
                calls += 1
                for k, i in enumerate(rows):
                    st[i] = s if len(rows) == 1 else s.select(torch.tensor([k]))
                    pos[i] += n
    return time.perf_counter() - t0, calls, time.thread_time() - c0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench chunk_align", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    p.add_argument("--starts", default="1,2,2,2", help="the frame each stream starts at")
    p.add_argument("--frames", type=int, default=60, help="frames per stream")
    p.add_argument("--conv", default="int8", choices=["aten", "packed", "int8"], help="the decoder's conv path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cuts", default="shared,own", help="comma list: chunks cut on shared frames, on own schedules")
    p.add_argument("--int8-ways", default="", help="comma list of TTS_CODEC_INT8_BATCH ways (rows, batched, auto)")
    a = p.parse_args(argv)
    starts = [int(x) for x in a.starts.split(",")]
    os.environ.setdefault("TTS_CODEC_DTYPE", "bf16")
    os.environ.setdefault("TTS_CODEC_CONV", "packed")
    from tts_engine.codec.speech_tokenizer import SpeechTokenizer

    torch.set_num_threads(1)
    dec = SpeechTokenizer(random_checkpoint(a.arch) / "speech_tokenizer", torch.device("cpu"),
                          torch.bfloat16).decoder
    dec.set_conv_mode(a.conv)
    codes = torch.randint(0, dec.cfg.codebook_size, (len(starts), 16, a.frames),
                          generator=torch.Generator().manual_seed(0))
    cuts = {"shared": ("shared frames", True), "own": ("own schedules", False)}
    plans = {cuts[c][0]: cut(starts, a.frames, cuts[c][1]) for c in a.cuts.split(",")}
    for k, plan in plans.items():
        print(f"{k}: " + ", ".join(f"{t}: {'+'.join(str(n) for _, n, _ in c)}" for t, c in plan), file=sys.stderr)
    ways = [w for w in a.int8_ways.split(",") if w]
    runs = {(f"{k}, int8 {w}" if w else k): (plan, w) for k, plan in plans.items() for w in (ways or [""])}

    def run(name):
        plan, way = runs[name]
        if way:
            os.environ["TTS_CODEC_INT8_BATCH"] = way
        return decode_all(dec, plan, codes)

    for k in runs:   # warm-up
        run(k)
    res: dict = defaultdict(list)
    start = _load()
    for r in range(a.rounds):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            s, calls, cpu = run(k)
            res[k].append((s, calls, cpu))
            print(f"round {r} {k}: {s:.2f} s, {cpu:.2f} CPU s, {calls} calls ({_load()})", file=sys.stderr)
    print(f"Device: **{device_name(torch.device('cpu'))}** (codec at 1 thread). {a.arch} decoder, conv {a.conv}, "
          f"streams starting at frames {starts}, {a.frames} frames each; {a.rounds} interleaved rounds. {start} at the "
          f"start, {_load()} at the end.\n\nCommand: `{command('chunk_align', argv)}`\n\n"
          "| chunks cut on | codec calls | codec s, median (best) | codec CPU s, median (best) |\n|---|---|---|---|")
    for k, v in res.items():
        w, c = [x[0] for x in v], [x[2] for x in v]
        print(f"| {k} | {v[0][1]} | {statistics.median(w):.2f} ({min(w):.2f}) | {statistics.median(c):.2f} "
              f"({min(c):.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
