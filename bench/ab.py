"""Engine A/B in one process: `python -m bench ab --base /path/to/other/checkout [--quantize int8]`.

Loads the random-weight checkpoint twice, once with another checkout's `tts_engine` (A, e.g. /work/main, imported
as `tts_base`) and once with this one (B), and runs the streaming benchmark (`common.run_concurrency`: first audio
from submit, x real time per stream, audio seconds per wall second) on each, interleaved round by round (A B, B A,
...), so a shared machine's load falls on both alike. Prints a markdown table of medians (and best) with the
device and the load average; nothing is written (`--out FILE` appends the table to FILE). `--variant NAME=KEY=VAL[,KEY=VAL]`
adds a variant of B: the same engine switched before its runs (`overlap_codec`, `govern_threads`, `split_frames`,
`prefix_cache`, `codec_conv`, `codec_nice`, `codec_threads`, `talker_step`; e.g. `--variant overlap=overlap_codec=1`,
`--variant nocache=prefix_cache=0`,
`--variant int8=codec_conv=int8`: the codec decoder's convolution path, `CodecDecoder.set_conv_mode`;
`--variant pytalker=talker_step=0` with TTS_TALKER_STEP=1: the talker's step on the Python path;
`--variant noalign=align_chunks=0`: concurrent streams' chunks cut on their own schedules, not on shared frames;
`--variant t128=int8_threshold=128`: every int8 codec conv used from 128 positions per row, not the measured pick).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import weakref

import torch

from bench.common import command, device_name, load_checkout, random_checkpoint, report, run_concurrency
from bench.common import load_average as _load


def _value(v: str):
    low = v.lower()
    if low in ("1", "true", "on", "yes"):
        return True
    if low in ("0", "false", "off", "no"):
        return False
    if low == "none":
        return None
    try:
        return int(v)
    except ValueError:
        return v


SWITCHES = ("overlap_codec", "govern_threads", "split_frames", "prefix_cache", "codec_conv", "codec_nice",
            "codec_threads", "talker_step", "align_chunks", "int8_threshold")


_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # engine -> what its load chose (put back)


def _switch(engine, setting: dict) -> None:
    """Put B's engine in a variant's state (between runs, nothing in flight): overlap_codec (with codec_threads, its
    intra-op threads, and codec_nice, its priority lowered), govern_threads, split_frames, prefix_cache (0: none; its
    entries stay for the runs that use it); what `setting` leaves out is this checkout's default, or what the engine
    chose at load (kept here the first time)."""
    from tts_engine.engine.engine import OVERLAP_CODEC_CPU_DEFAULT

    unknown = set(setting) - set(SWITCHES)
    if unknown:
        raise SystemExit(f"--variant: unknown setting(s) {sorted(unknown)}; use {', '.join(SWITCHES)}")
    dec = engine.model.speech_tokenizer.decoder
    if engine not in _KEPT:
        _KEPT[engine] = {"governor": None, "prefix_cache": getattr(engine.runner, "prefix_cache", None),
                         "codec_conv": dec.conv_mode,   # (the path chosen at load)
                         # per conv, as measured at load (cpu/codec_int8_threshold.py)
                         "int8_threshold": [m.int8_min_positions for m in dec.int8_convs()],
                         # the talker's step in one call (cpu/talker_step.py), where attached
                         "talker_step": getattr(engine.runner, "talker_step", None)}
    kept = _KEPT[engine]
    ov = setting.get("overlap_codec", OVERLAP_CODEC_CPU_DEFAULT)
    engine.worker.overlap_codec(ov if ov in ("streams", "auto") else bool(ov), setting.get("codec_threads", 1),
                                nice=setting.get("codec_nice", 0))
    governor = engine.worker.governor or kept["governor"]   # what it learnt so far stays
    engine.govern_threads(bool(setting.get("govern_threads", True)) and engine.model.dtype != torch.float32)
    if engine.worker.governor is not None and governor is not None:
        engine.worker.governor = governor
    kept["governor"] = governor
    engine.worker.split_frames = setting.get("split_frames")
    if hasattr(engine.worker, "align_chunks"):   # later chunks cut on frames shared with other streams (worker.py)
        engine.worker.align_chunks = bool(setting.get("align_chunks", True))
    engine.runner.prefix_cache = kept["prefix_cache"] if setting.get("prefix_cache", True) else None
    dec.set_conv_mode(setting.get("codec_conv", kept["codec_conv"]))
    for m, threshold in zip(dec.int8_convs(), kept["int8_threshold"]):
        m.int8_min_positions = setting.get("int8_threshold", threshold)
    engine.runner.talker_step = kept["talker_step"] if setting.get("talker_step", True) else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench ab", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the other checkout (A), e.g. /work/main")
    p.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    p.add_argument("--quantize", default="int8", help="int8, int4, w8a8, auto or none")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--first-chunk", type=int, default=1)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", action="append", default=[], help="NAME=ARG=VALUE[,ARG=VALUE]: another B engine")
    p.add_argument("--no-base-variants", action="store_true", help="only B engines (no A)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    conc = [int(x) for x in a.concurrency.split(",")]
    ckpt = str(random_checkpoint(a.arch))
    q = None if a.quantize == "none" else a.quantize
    kw = dict(device="cpu", quantize=q, max_batch=max(conc), max_seq_len=a.frames + 160)
    engines = {}
    if not a.no_base_variants:
        load_checkout("tts_base", a.base)
        from importlib import import_module

        engines["A (base)"] = import_module("tts_base.engine.engine").TTSEngine.from_pretrained(ckpt, **kw)
    from tts_engine.engine.engine import TTSEngine

    b = engines["B (this)"] = TTSEngine.from_pretrained(ckpt, **kw)
    settings = {"B (this)": {}}
    for v in a.variant:   # the same B engine, switched before each of its runs (one copy of the weights)
        name, _, args = v.partition("=")
        settings[f"B {name}"] = {k: _value(x) for k, _, x in (s.partition("=") for s in args.split(","))}
        engines[f"B {name}"] = b
    for e in engines.values():
        e.speakers_for_bench = e.speakers
        run_concurrency(e, 1, 4, a.first_chunk)   # warm-up
    names = list(engines)
    res: dict = {}
    start_load = _load()
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for c in conc:
            for n in order:
                if n in settings:
                    _switch(engines[n], settings[n])
                row = run_concurrency(engines[n], c, a.frames, a.first_chunk)
                res.setdefault((n, c), []).append(row)
                print(f"round {r} {n} c={c}: first audio {row['ttfa_p50_ms']:.0f} ms, x real time "
                      f"{row['xrt_p50']:.3f}, {row['audio_s_per_s']:.2f} audio s per s ({_load()})", file=sys.stderr)
    lines = [f"Device: **{device_name(torch.device('cpu'))}**. {a.arch} random weights, --quantize {a.quantize} "
             f"({engines[names[-1]].precision}), {a.frames} frames per stream, first chunk {a.first_chunk} frame(s); "
             f"{a.rounds} interleaved rounds, median (best, worst). {start_load} at the start, {_load()} at the end.",
             "", f"Command: `{command('ab', argv)}`",
             "", "| engine | streams | first audio p50 ms | first audio p99 ms | x real time per stream | "
             "audio s per wall s |", "|---|---|---|---|---|---|"]
    for (n, c), rows in res.items():
        f = [x["ttfa_p50_ms"] for x in rows]
        f99 = [x["ttfa_p99_ms"] for x in rows]
        x = [x["xrt_p50"] for x in rows]
        s = [x["audio_s_per_s"] for x in rows]
        lines.append(f"| {n} | {c} | {statistics.median(f):.0f} ({min(f):.0f}, {max(f):.0f}) | "
                     f"{statistics.median(f99):.0f} | {statistics.median(x):.3f} ({max(x):.3f}, {min(x):.3f}) | "
                     f"{statistics.median(s):.2f} ({max(s):.2f}, {min(s):.2f}) |")
    cc = b.worker.measured_codec_choice
    if cc is not None:
        lines.append(f"\nB: where chunks decode (overlap_codec auto; per batch-size bucket, ms per frame of one row) "
                     f"{cc.snapshot()}")
    tc = getattr(b, "thread_choice", None)
    if tc:
        lines.append(f"\nB: thread governor's averages at the end ((rows 1-2 / more, codec busy): option: (ms per "
                     f"frame, frames)) {tc}")
    text = "\n".join(lines)
    report(text, a.out, append=True)
    for e in {id(e): e for e in engines.values()}.values():
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
