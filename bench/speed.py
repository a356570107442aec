"""Benchmark: `python -m bench speed` (`--peers`: `python -m bench peers`; `--check`: `python -m bench check`).

Builds a checkpoint of the chosen architecture with random weights (no download) or loads one, forces a
fixed output length (end-of-speech disabled), and measures through the public streaming API:
time to first audio chunk (p50/p99, from submit), per-stream real-time factor (x real time, p50 and the
worst p99), total audio seconds per wall second, at each concurrency, and peak memory. Where the official
implementation is installed (the oracle venv), it is timed on the same weights and the speed ratio printed.
A per-frame profile (talker, code predictor, sampling, codec, host overhead) is taken at concurrency 1: each part
timed alone in the caller's thread; with --profile (CPU) also the split of a real stream's wall time per frame as the
engine's threads serve it (`stream_split`: parts, glue, codec thread) and the same stream with its chunks
decoded in the worker.
Results go to stdout and to docs/benchmarks.md, with the device named.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import (ROOT, bench_request, command, device_name, random_checkpoint, run_concurrency,
                          write_markdown)
from bench.stream_split import split_lines
from tts_engine.cpu.measured import describe
from tts_engine.engine.engine import TTSEngine
from tts_engine.model.quant import QUANT_MODES


def profile_frame(engine: TTSEngine, frames: int, between=None) -> dict:
    """Per-frame time split at batch 1, measured around each part with device synchronisation. The codec
    decodes the frames in the engine's chunks (2, 4, 8, 12, 12, ...), as a stream does. Each frame's parts are then
    run again alone as the engine serves them: the code predictor (`ModelRunner.complete` of the next frame: it
    changes no row state) and the talker step the frame ran (`ModelRunner.replay_talker_step`). `between`: called
    after each frame's parts, outside the timings (the peers bench: the plain read, interleaved with the parts)."""
    runner, model = engine.runner, engine.model
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    req = bench_request(engine, frames + 1)
    row = 0  # the engine is idle: row 0 is free
    codec = model.speech_tokenizer.decoder
    acc = {"talker_ms": 0.0, "code_predictor_ms": 0.0, "codec_ms": 0.0, "frame_total_ms": 0.0}
    with torch.inference_mode():
        runner.prefill(row, req.prompt, req.params)
        state = codec.init_state(1)
        rows = [row]
        chunks, pending = req.chunk_sizes(), []
        target = next(chunks)
        for f in range(frames):
            sync()
            t0 = time.perf_counter()
            codes, _ = runner.decode(rows)
            sync()
            t1 = time.perf_counter()
            acc["frame_total_ms"] += 1000 * (t1 - t0)
            pending.append(codes)
            if len(pending) == target or f == frames - 1:
                codec.decode_step(torch.cat(pending).T[None], state)
                sync()
                acc["codec_ms"] += 1000 * (time.perf_counter() - t1)
                pending, target = [], next(chunks)
            # the same frame's parts, timed separately (results discarded)
            sync()
            a = time.perf_counter()
            runner.complete(rows)
            sync()
            b = time.perf_counter()
            runner.replay_talker_step(rows, codes)
            sync()
            c = time.perf_counter()
            acc["code_predictor_ms"] += 1000 * (b - a)
            acc["talker_ms"] += 1000 * (c - b)
            if between is not None:
                between()
        runner.release(row)
    out = {k: v / frames for k, v in acc.items()}
    if runner.graphs is None:   # the parts are what the frame ran: the rest is sampling and host work
        out["sampling_and_host_ms"] = out["frame_total_ms"] - out["talker_ms"] - out["code_predictor_ms"]
    return out


def frame_split_line(prof: dict, graphs: bool) -> str:
    """The bench's 'Per frame' line. With CUDA graphs the frame is one replay and the parts were timed eagerly
    beside it (launch-bound, far slower): they are named so, and no remainder is derived from them."""
    ms = {k[:-3].replace("_", " "): v for k, v in prof.items()}
    if not graphs:
        return "Per frame at concurrency 1 (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()) + "."
    return (f"Per frame at concurrency 1 (ms): frame (CUDA graph replay) {ms['frame total']:.2f}, codec "
            f"{ms['codec']:.2f}; the same parts run eagerly, without graphs: talker {ms['talker']:.2f}, code "
            f"predictor {ms['code predictor']:.2f}.")


def torch_profile(engine: TTSEngine, frames: int, top: int = 25) -> tuple[str, dict]:
    """torch.profiler over `frames` frames at one stream (talker + code predictor + sampling) and the codec
    decode of those frames in the engine's chunks. Returns (a markdown table of the top ops by self CPU
    time, per frame; a summary {ops per frame, self CPU ms per frame})."""
    from torch.profiler import ProfilerActivity, profile

    runner, model = engine.runner, engine.model
    req = bench_request(engine, frames + 1)
    codec = model.speech_tokenizer.decoder
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with torch.inference_mode():
        runner.prefill(0, req.prompt, req.params)
        state = codec.init_state(1)
        for _ in range(2):                                   # warm-up outside the profile
            codec.decode_step(runner.decode([0])[0].T[None], state)
        chunks, pending = req.chunk_sizes(), []
        target = next(chunks)
        with profile(activities=acts) as prof:
            for f in range(frames):
                pending.append(runner.decode([0])[0])
                if len(pending) == target or f == frames - 1:
                    codec.decode_step(torch.cat(pending).T[None], state)
                    pending, target = [], next(chunks)
        runner.release(0)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    lines = ["| op | self CPU ms per frame | share | calls per frame |", "|---|---|---|---|"]
    for e in events[:top]:
        lines.append(f"| `{e.key}` | {e.self_cpu_time_total / 1000 / frames:.2f} | "
                     f"{100 * e.self_cpu_time_total / total:.1f} % | {e.count / frames:.0f} |")
    return "\n".join(lines), {"aten_calls_per_frame": calls / frames, "self_cpu_ms_per_frame": total / 1000 / frames}


def official_xrt(ckpt: Path, frames: int, device: str, dtype: str) -> float | None:
    exe = os.environ.get("QWEN_TTS_ORACLE_PYTHON") or str(ROOT / ".venv-oracle" / "bin" / "python")
    if not Path(exe).exists():
        return None
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    p = subprocess.run([exe, str(ROOT / "tests" / "oracle" / "bench_official.py"), str(ckpt), str(frames), device,
                        dtype], capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        print("official benchmark failed:\n" + p.stderr[-2000:], file=sys.stderr)
        return None
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return r["frames"] * 0.08 / r["wall_s"]


def quality_vs_fp32(engine: TTSEngine, ckpt: Path, device: torch.device, frames: int) -> str:
    """Teacher-forced deviation of the engine's talker from an fp32 copy of the same weights (tts_engine.cpu.talker_quality)."""
    from tts_engine.cpu import talker_quality as quality
    from tts_engine.loader import Qwen3TTSModel

    rows = 4
    ref_model = Qwen3TTSModel.from_pretrained(str(ckpt), device=device, dtype="fp32")
    ref = quality.reference_run(ref_model, rows=rows, frames=max(1, frames // rows))
    report = quality.measure(ref, engine.model.talker, ref_model.prompts.tts_pad, engine.precision)
    del ref_model
    return ("Quality vs fp32 (teacher forcing on the fp32 model's greedy codes, "
            f"{rows} prompts x {frames // rows} frames; cosine similarity and top-1 agreement per frame):\n\n"
            + quality.QualityReport.table([report]))


def resident_memory(device: torch.device) -> str:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return f"{torch.cuda.memory_allocated(device) / 2**30:.2f} GiB GPU"
    with open(f"/proc/{os.getpid()}/statm") as f:
        return f"{int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**30:.2f} GiB host RSS"


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU (max allocated)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB host RSS (peak)"


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--peers" in args:  # the side-by-side CPU benchmark has its own options (python -m bench peers -h)
        from bench.peers.run import main as peers_main

        return peers_main([x for x in args if x != "--peers"])
    p = argparse.ArgumentParser(prog="python -m bench speed", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=["tiny", "small", "0.6b", "1.7b"], help="random-weight architecture "
                   "(default: 0.6b on a GPU, small on a CPU)")
    p.add_argument("--model", help="a checkpoint folder or hub id instead of random weights")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--frames", type=int, help="frames per request (80 ms each); default 250 GPU / 40 CPU")
    p.add_argument("--concurrency", default=None, help="comma list; default 1,4,16,64 GPU / 1,4 CPU")
    p.add_argument("--first-chunk", type=int, default=2)
    p.add_argument("--no-official", action="store_true")
    p.add_argument("--kind", choices=["custom_voice", "base"], default="custom_voice",
                   help="random-weight checkpoint kind; base also reports memory after a first clone")
    p.add_argument("--text-embedding-on-cpu", action="store_true")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (the eager per-frame step)")
    p.add_argument("--check", action="store_true", help="does the fast path work here? graphs vs eager greedy "
                   "codes at batch 1 and 4 (identical), then the one-stream speed; exit status 1 on a mismatch")
    p.add_argument("--quantize", choices=[*QUANT_MODES, "auto"], help="quantised talker and code predictor "
                   "(int8 / int4 weights, w8a8 / w4a8 int8 or int4 weights x int8 activations; auto: the fastest acceptable here)")
    p.add_argument("--quality-frames", type=int, default=100, help="teacher-forced frames of the quality check "
                   "against fp32, run when the mode is not fp32 (4 prompts share them); 0 skips it")
    p.add_argument("--profile", action="store_true", help="also run torch.profiler over frames at one stream, "
                   "split a stream's wall time per frame in the engine (CPU: stream_split.py), print the top ops by self CPU time and write them to docs/benchmarks.md "
                   "(section 'CPU profile of one frame')")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--peers", action="store_true", help="instead: ours and the independent CPU engines side by side "
                   "in one interleaved run (bench/peers/run.py; see python -m bench peers -h)")
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if a.check:
        from bench.check import run_check

        arch = a.arch or ("0.6b" if gpu else "tiny")
        ckpt = a.model or str(random_checkpoint(arch, a.kind))
        return run_check(ckpt, device, a.dtype, a.frames or (64 if gpu else 12))
    arch = a.arch or ("0.6b" if gpu else "small")
    frames = a.frames or (250 if gpu else 40)
    conc = [int(x) for x in (a.concurrency or ("1,4,16,64" if gpu else "1,4")).split(",")]
    ckpt = Path(a.model) if a.model else random_checkpoint(arch, a.kind)
    t0 = time.perf_counter()
    engine = TTSEngine.from_pretrained(str(ckpt), device=device, dtype=a.dtype, max_batch=max(conc),
                                       max_waiting=max(64, max(conc)),
                                       max_seq_len=frames + 128, text_embedding_on_cpu=a.text_embedding_on_cpu,
                                       quantize=a.quantize, use_cuda_graphs=False if a.eager else None)
    load_s = time.perf_counter() - t0
    if engine.kind == "base":  # the voice every request uses
        t = np.arange(24000 * 3) / 24000
        bench_voice = engine.clone_voice((0.3 * np.sin(2 * np.pi * 160 * t).astype(np.float32), 24000),
                                         x_vector_only=True)
        engine.speakers_for_bench = [bench_voice]
    else:
        engine.speakers_for_bench = engine.speakers
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[engine.model.dtype]
    run_concurrency(engine, 1, 4, a.first_chunk)                  # warm-up
    mem_synth = resident_memory(device)                            # weights + caches, synthesis only
    mem_clone = None
    if engine.kind == "base":                                      # an ICL clone reads the codec encoder too
        t = np.arange(24000 * 3) / 24000
        engine.clone_voice((0.3 * np.sin(2 * np.pi * 160 * t).astype(np.float32), 24000), ref_text="A tone.")
        mem_clone = resident_memory(device)
    rows = [run_concurrency(engine, c, frames, a.first_chunk) for c in conc]
    graphs = describe(engine.paths()["frame"])
    prof = profile_frame(engine, min(frames, 20))
    top = torch_profile(engine, min(frames, 12)) if a.profile else None
    stream_lines = split_lines(engine, frames) if a.profile and not gpu else None
    mem = peak_memory(device)
    off = None if a.no_official else official_xrt(ckpt, min(frames, 40 if not gpu else frames), str(device), dtype_name)
    engine.close()
    quality_md = None
    if engine.precision != "fp32" and a.quality_frames > 0:
        quality_md = quality_vs_fp32(engine, ckpt, device, a.quality_frames)

    dev = device_name(device)
    what = a.model or f"random-weight {arch} architecture"
    precision = engine.precision + (" (lossy)" if engine.lossy else "")
    if getattr(engine.model, "quantize_why", ""):
        precision += f" (`--quantize auto`: {engine.model.quantize_why})"
    lines = [f"Device: **{dev}**. Model: {what}, {precision}. {frames} frames ({frames * 0.08:.1f} s of audio) per "
             f"request, end-of-speech disabled, first chunk after {a.first_chunk} frames. Load {load_s:.1f} s. "
             f"Resident memory after load and a first synthesis: {mem_synth}"
             + (f"; after a first ICL clone: {mem_clone}" if mem_clone else "")
             + f". Peak: {mem}." + (" Text embedding kept on the CPU." if a.text_embedding_on_cpu else "")
             + (f" CUDA graphs: {graphs}." if gpu else ""),
             "",
             f"Command: `{command('speed', argv)}`",
             "",
             "| concurrency | first audio p50 (ms) | first audio p99 (ms) | x real time per stream p50 | worst stream p99 | audio s per wall s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['ttfa_p50_ms']:.0f} | {r['ttfa_p99_ms']:.0f} | {r['xrt_p50']:.2f} | "
                     f"{r['xrt_p99_worst']:.2f} | {r['audio_s_per_s']:.2f} |")
    lines += ["", frame_split_line(prof, engine.runner.graphs is not None)]
    if stream_lines:   # the parts above were timed alone; in a stream the worker's threads serve them
        lines += ["", f"In a stream of {frames} frames (`stream_split`, ms per frame):", ""]
        lines += [f"- {ln}" for ln in stream_lines]
    if off is not None:
        ours = rows[0]["xrt_p50"]
        lines.append(f"\nOfficial qwen-tts 0.1.1 on the same weights and device: {off:.3f}x real time "
                     f"(non-streaming, whole request); tts_engine at concurrency 1: {ours:.2f}x, "
                     f"**{ours / off:.1f}x the official speed**.")
    else:
        lines.append("\nOfficial implementation: not measured in this run (oracle venv not installed or --no-official).")
    if quality_md:
        lines += ["", quality_md]
    body = "\n".join(lines)
    print(body)
    write_markdown(Path(a.out), f"## {dev} — {what}, {engine.precision}", body)
    if top is not None:
        table, summ = top
        pbody = (f"Device: **{dev}**. Model: {what}, {engine.precision}. torch.profiler over {min(frames, 12)} frames at one "
                 f"stream (talker, code predictor, sampling, and the codec decode of those frames in the engine's "
                 f"chunks 2, 4, 8, ...), top ops by self CPU time, per frame. {summ['aten_calls_per_frame']:.0f} aten "
                 f"calls and {summ['self_cpu_ms_per_frame']:.0f} ms self CPU per frame (profiler overhead "
                 f"included).\n\nCommand: `{command('speed', argv)}`\n\n{table}")
        print("\n" + pbody)
        write_markdown(Path(a.out), f"## CPU profile of one frame — {engine.precision}" if not gpu else
                       f"## Profile of one frame — {dev}, {engine.precision}", pbody)
    return 0


if __name__ == "__main__":
    sys.exit(main())
