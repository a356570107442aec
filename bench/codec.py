"""Codec benchmark: the speech-tokenizer decoder's ms per frame, and the codec overlapped with generation A/B.

    python -m bench codec --arch 0.6b --quantize int8 --frames 24 --rounds 3

One process, one engine; every variant runs once per round, the variants interleaved (A, B, A, B, ...), and the
table gives the median over rounds (and the best). Part 1 decodes a stream's chunks (first chunk, then doubling up
to 12 frames) with the engine's decoder in each dtype and convolution path (aten, packed) at the process's threads and at 1 thread. Part 2 runs a
stream (x real time from submit to last audio, and first audio) with `overlap_codec` off and on. Nothing is
asserted; `--out FILE` appends the tables to FILE (nothing is written otherwise).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import device_name, random_checkpoint, report, run_concurrency
from bench.common import load_average as _load
from tts_engine.engine.engine import TTSEngine


def _chunks(first: int, total: int, cap: int = 12):
    out, n = [], max(1, first)
    while sum(out) < total:
        out.append(min(n, total - sum(out)))
        n = min(n * 2, cap)
    return out


def codec_ms_per_frame(dec, frames: int, first: int, threads: int, cap: int = 12) -> float:
    """Decode `frames` random frames of one stream in the engine's chunks; ms per frame."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        codes = torch.randint(0, 2048, (1, 16, frames), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            st = dec.init_state(1)
            t0, o = time.perf_counter(), 0
            for n in _chunks(first, frames, cap):
                dec.decode_step(codes[..., o:o + n], st)
                o += n
            return 1000 * (time.perf_counter() - t0) / frames
    finally:
        torch.set_num_threads(prev)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench codec", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    p.add_argument("--model", help="a checkpoint folder instead of random weights")
    p.add_argument("--dtype")
    p.add_argument("--quantize", choices=["int8", "int4", "w8a8", "w4a8", "auto"])
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--first-chunk", type=int, default=1)
    p.add_argument("--concurrency", default="1", help="comma list of streams for the overlap A/B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--codec-threads", default="1", help="comma list: intra-op threads of the codec thread")
    p.add_argument("--conv-modes", default="aten,packed", help="comma list of the decoder's convolution paths")
    p.add_argument("--max-chunk", type=int, default=12, help="the chunks double from --first-chunk up to this")
    p.add_argument("--codec-only", action="store_true",
                   help="load only the speech tokenizer's decoder (no talker; implies --skip-overlap)")
    p.add_argument("--skip-codec", action="store_true", help="only the overlap A/B")
    p.add_argument("--skip-overlap", action="store_true", help="only the codec ms per frame")
    p.add_argument("--out", help="append the tables to this markdown file")
    a = p.parse_args(argv)
    ckpt = Path(a.model) if a.model else random_checkpoint(a.arch)
    conc = [int(x) for x in a.concurrency.split(",")]
    if a.codec_only:   # the speech tokenizer's decoder alone (bf16, its path chosen as the engine would), no talker
        from tts_engine.codec.speech_tokenizer import SpeechTokenizer

        engine = None
        a.skip_overlap = True
        dec = SpeechTokenizer(ckpt / "speech_tokenizer", torch.device("cpu"), torch.bfloat16).decoder
        precision = "codec decoder only"
    else:
        engine = TTSEngine.from_pretrained(str(ckpt), device="cpu", dtype=a.dtype, quantize=a.quantize,
                                           max_batch=max(conc), max_seq_len=a.frames + 128, overlap_codec=False)
        engine.speakers_for_bench = engine.speakers
        dec = engine.model.speech_tokenizer.decoder
        precision = engine.precision
    nthreads = torch.get_num_threads()
    lines = [f"Device: **{device_name(torch.device('cpu'))}**. Model: {a.arch} random weights, {precision}. "
             f"{a.rounds} interleaved rounds, median (best). {_load()} at the start."]
    if not a.skip_codec:
        decs = {}
        for dt in (torch.float32, torch.bfloat16):        # every dtype x convolution path (tts_engine/cpu/codec_dtype.py)
            for conv in a.conv_modes.split(","):
                d = copy.deepcopy(dec).to(dt)
                d.refresh_codebooks()
                d.set_conv_mode(conv)
                decs[f"{str(dt).removeprefix('torch.')} {conv}"] = d
        res: dict = {}
        for r in range(a.rounds + 1):
            for name, d in decs.items():
                for t in sorted({nthreads, 1}, reverse=True):
                    ms = codec_ms_per_frame(d, a.frames, a.first_chunk, t, a.max_chunk)
                    if r:   # round 0 warms up
                        res.setdefault((name, t), []).append(ms)
        lines += ["", f"Codec decoder, one stream's chunks ({a.frames} frames, first chunk {a.first_chunk}, then "
                  f"doubling to {a.max_chunk}): ms per 80 ms frame, and the chosen path "
                  f"({dec.pre_conv.conv.weight.dtype}, {dec.conv_mode})", "",
                  "| decoder dtype, convolutions | threads | ms per frame |", "|---|---|---|"]
        for (name, t), v in res.items():
            lines.append(f"| {name} | {t} | {statistics.median(v):.1f} ({min(v):.1f}) |")
    if not a.skip_overlap:
        variants = [("off", None)] + [(f"on, codec thread {t} intra-op", int(t)) for t in a.codec_threads.split(",")]
        res = {}
        run_concurrency(engine, 1, 4, a.first_chunk)   # warm-up
        for r in range(a.rounds):
            for name, t in variants:
                engine.worker.overlap_codec(t is not None, t)
                for c in conc:
                    row = run_concurrency(engine, c, a.frames, a.first_chunk)
                    res.setdefault((name, c), []).append(row)
                    print(f"round {r} {name} c={c}: x real time {row['xrt_p50']:.3f}, first audio "
                          f"{row['ttfa_p50_ms']:.0f} ms, {row['audio_s_per_s']:.2f} audio s per s", file=sys.stderr)
        engine.worker.overlap_codec(False)
        lines += ["", f"Codec overlapped with generation ({a.frames} frames per stream, first chunk after "
                  f"{a.first_chunk}; x real time from submit to the last audio)", "",
                  "| overlap | streams | x real time per stream p50 | first audio p50 (ms) | audio s per wall s |",
                  "|---|---|---|---|---|"]
        for (name, c), rows in res.items():
            x = [r["xrt_p50"] for r in rows]
            f = [r["ttfa_p50_ms"] for r in rows]
            s = [r["audio_s_per_s"] for r in rows]
            lines.append(f"| {name} | {c} | {statistics.median(x):.3f} ({max(x):.3f}) | {statistics.median(f):.0f} "
                         f"({min(f):.0f}) | {statistics.median(s):.2f} ({max(s):.2f}) |")
    lines.append(f"\n{_load()} at the end.")
    text = "\n".join(lines)
    report(text, a.out, append=True)
    if engine is not None:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
