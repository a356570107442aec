"""Benchmark: `python -m bench.speed`.

Builds a checkpoint of the chosen architecture with random weights (no download) or loads one, forces a
fixed output length (end-of-speech disabled), and measures through the public streaming API:
time to first audio chunk (p50/p99, from submit), per-stream real-time factor (x real time, p50 and the
worst p99), total audio seconds per wall second, at each concurrency, and peak memory. Where the official
implementation is installed (the oracle venv), it is timed on the same weights and the speed ratio printed.
A per-frame profile (talker, code predictor, sampling, codec, host overhead) is taken at concurrency 1: each part
timed alone in the caller's thread; with --profile (CPU) also the split of a real stream's wall time per frame as the
engine's threads serve it (`bench_stream_split`: parts, glue, codec thread) and the same stream with its chunks
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
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tts_engine.cache_paths import cache_root
from tts_engine.cpu.cpu_info import cpu_info
from tts_engine.cpu.measured import describe
from tts_engine.engine.engine import TTSEngine
from bench.stream_split import split_lines
from tts_engine.engine.model_runner import aten_bf16_gemv
from tts_engine.model.quant import QUANT_MODES
from tts_engine.tiny import make_tiny

ROOT = Path(__file__).resolve().parent.parent


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = cpu_info().name
    forced = ""
    if os.environ.get("TTS_CPU_ISA", "native").strip().lower() not in ("", "native", "auto") \
            or os.environ.get("TTS_CPU_EXT_ISA"):   # a forced CPU level of our kernels: say so beside every figure
        from tts_engine.cpu import cpu_ext

        if cpu_ext.available() and cpu_ext.level() < cpu_ext.cpu_level():
            forced = f", our kernels forced to {cpu_ext.level_name()} (TTS_CPU_ISA; this CPU: " \
                     f"{cpu_ext.LEVEL_NAMES[cpu_ext.cpu_level()]})"
    return f"CPU: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads{forced}"


def checkpoint_for(arch: str, dtype: torch.dtype, kind: str = "custom_voice") -> Path:
    folder = cache_root() / "bench" / f"{arch}-{kind}"
    if not (folder / "speech_tokenizer" / "model.safetensors").exists():
        print(f"writing a random {arch} {kind} checkpoint to {folder} ...", file=sys.stderr)
        make_tiny(folder, kind=kind, size="0b6" if arch != "1.7b" else "1b7", seed=0, arch=arch,
                  dtype=torch.bfloat16 if arch in ("0.6b", "1.7b") else torch.float32)
    return folder


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


def run_concurrency(engine: TTSEngine, c: int, frames: int, first_chunk: int) -> dict:
    results = [None] * c
    start = threading.Barrier(c)

    def client(i):
        start.wait()
        t0 = time.perf_counter()
        voices = engine.speakers_for_bench
        s = engine.stream("Ladies and gentlemen, please remain calm.", voice=voices[i % len(voices)],
                          seed=i, max_new_tokens=frames + 1, sampling={"ignore_eos": True},
                          first_chunk_frames=first_chunk)
        first, n = None, 0
        for chunk in s:
            if first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
        results[i] = (first, time.perf_counter() - t0, n / engine.sample_rate)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfa = [r[0] for r in results]
    xrt = [r[2] / r[1] for r in results]
    return {"concurrency": c, "ttfa_p50_ms": 1000 * pct(ttfa, 50), "ttfa_p99_ms": 1000 * pct(ttfa, 99),
            "xrt_p50": pct(xrt, 50), "xrt_p99_worst": pct(xrt, 1), "audio_s_per_s": sum(r[2] for r in results) / wall,
            "audio_s": sum(r[2] for r in results), "wall_s": wall}


def profile_frame(engine: TTSEngine, frames: int, between=None) -> dict:
    """Per-frame time split at batch 1, measured around each part with device synchronisation. The codec
    decodes the frames in the engine's chunks (2, 4, 8, 12, 12, ...), as a stream does. `between`: called after
    each frame's parts, outside the timings (bench_peers: the plain read, interleaved with the parts)."""
    runner, model = engine.runner, engine.model
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    req, _ = engine._make_request("Ladies and gentlemen, please remain calm.", engine.speakers_for_bench[0], "auto", None, 0,
                                  {"ignore_eos": True}, False, frames + 1, None, 2, 12)
    row = 0  # the engine is idle: row 0 is free
    codec = model.speech_tokenizer.decoder
    acc = {"talker_ms": 0.0, "code_predictor_ms": 0.0, "codec_ms": 0.0, "frame_total_ms": 0.0}
    with torch.inference_mode():
        runner.prefill(row, req.prompt, req.params)
        state = codec.init_state(1)
        rows = [row]
        r = torch.tensor(rows, device=model.device)
        from tts_engine.model.sampling import RowParams

        rp = RowParams(**{k: (v[:1] if k != "host" else runner._host_facts(1, general=False))
                          for k, v in runner.rp.__dict__.items()})
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
            fi = runner.step[r] - 1
            with aten_bf16_gemv(model.device.type == "cpu" and model.dtype == torch.bfloat16):  # as decode does
                sync()
                a = time.perf_counter()
                runner._predict_residuals(runner.hidden[r], runner.c0[r], fi, rp)
                sync()
                b = time.perf_counter()
                _replay_talker_step(runner, row, rows, codes)
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


def _replay_talker_step(runner, row: int, rows: list[int], codes: torch.Tensor) -> None:
    """The talker step this frame ran, run again as the engine serves it (`ModelRunner._advance`: the C++ talker
    step where it serves, else the Python path) from the state it started in; the row's state is put back after
    (the cache position it rewrites gets the same values)."""
    names = ("pos", "step", "seen", "hidden", "c0")
    saved = {n: getattr(runner, n)[row].clone() for n in names}
    runner.pos[row] -= 1
    runner.step[row] -= 1
    r, cache_rows, rp = runner._rows_view(rows)
    try:
        runner._advance(r, cache_rows, rp, runner.host_len[row], codes)
    finally:
        for n, v in saved.items():
            getattr(runner, n)[row] = v


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
    req, _ = engine._make_request("Ladies and gentlemen, please remain calm.", engine.speakers_for_bench[0], "auto", None, 0,
                                  {"ignore_eos": True}, False, frames + 1, None, 2, 12)
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


def write_markdown(path: Path, header: str, body: str) -> None:
    """Replace (or add) the section that starts with `header` in docs/benchmarks.md."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\nWritten by `python -m bench.speed`.\n"
    sections = text.split("\n## ")
    kept = [sections[0]] + ["## " + s for s in sections[1:] if not ("## " + s).startswith(header)]
    path.write_text("\n".join(k.rstrip("\n") + "\n" for k in kept) + "\n" + header + "\n\n" + body + "\n",
                    encoding="utf-8")


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--peers" in args:  # the side-by-side CPU benchmark has its own options (python -m bench.speed --peers -h)
        from bench.peers.run import main as peers_main

        return peers_main([x for x in args if x != "--peers"])
    p = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__.split("\n")[0])
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
                   "split a stream's wall time per frame in the engine (CPU: bench_stream_split), print the top ops by self CPU time and write them to docs/benchmarks.md "
                   "(section 'CPU profile of one frame')")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--peers", action="store_true", help="instead: ours and the independent CPU engines side by side "
                   "in one interleaved run (bench/peers/run.py; see python -m bench.speed --peers -h)")
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if a.check:
        from bench.check import run_check

        arch = a.arch or ("0.6b" if gpu else "tiny")
        ckpt = a.model or str(checkpoint_for(arch, torch.bfloat16, a.kind))
        return run_check(ckpt, device, a.dtype, a.frames or (64 if gpu else 12))
    arch = a.arch or ("0.6b" if gpu else "small")
    frames = a.frames or (250 if gpu else 40)
    conc = [int(x) for x in (a.concurrency or ("1,4,16,64" if gpu else "1,4")).split(",")]
    ckpt = Path(a.model) if a.model else checkpoint_for(arch, torch.bfloat16, a.kind)
    t0 = time.perf_counter()
    engine = TTSEngine.from_pretrained(str(ckpt), device=device, dtype=a.dtype, max_batch=max(conc),
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
             f"Command: `python -m bench.speed {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip(),
             "",
             "| concurrency | first audio p50 (ms) | first audio p99 (ms) | x real time per stream p50 | worst stream p99 | audio s per wall s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['ttfa_p50_ms']:.0f} | {r['ttfa_p99_ms']:.0f} | {r['xrt_p50']:.2f} | "
                     f"{r['xrt_p99_worst']:.2f} | {r['audio_s_per_s']:.2f} |")
    lines += ["", frame_split_line(prof, engine.runner.graphs is not None)]
    if stream_lines:   # the parts above were timed alone; in a stream the worker's threads serve them
        lines += ["", f"In a stream of {frames} frames (`bench_stream_split`, ms per frame):", ""]
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
                 f"included).\n\nCommand: `python -m bench.speed "
                 f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{table}")
        print("\n" + pbody)
        write_markdown(Path(a.out), f"## CPU profile of one frame — {engine.precision}" if not gpu else
                       f"## Profile of one frame — {dev}, {engine.precision}", pbody)
    return 0


if __name__ == "__main__":
    sys.exit(main())
