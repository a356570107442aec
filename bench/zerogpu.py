"""`python -m bench zerogpu`: one click in ZeroGPU mode, as a GPU worker serves it.

On ZeroGPU the engine is loaded in the main process with no fast paths and no CUDA graphs (`ui/zerogpu.configure`:
`fast_paths=False`, two cache rows, caller-driven), and each `@spaces.GPU` worker takes the GPU's paths on its first
call (`TTSEngine.warm_gpu`: the fused Triton frame, CUDA graphs captured on first use of each bucket). This benchmark
loads the engine the same way in one process (standing in for the worker: the `spaces` package and its fork are not
needed to time the GPU work) and times, from the moment the call would be granted the GPU:

- an eager click (the engine as loaded, before `warm_gpu`: what every click cost before the worker took its paths);
- the worker's first click with nothing remembered (`warm_gpu` checks the fused frame's kernels and runs its trial:
  TTS_GPU_FRAME=check for this click; then bucket captures + the request);
- a second click in the same worker (paths kept);
- a new worker: a fresh process that loads the engine as ZeroGPU does and clicks once, as the next ZeroGPU worker
  (or a restarted Space) would: the fused frame's verdict remembered by the first click (`paths()` "remembered") and
  Triton's disk cache warm, so its `warm_gpu` only installs the frame and its first frame captures one bucket.

Each: first audio after the grant, wall time, x real time (audio seconds / wall seconds), and how the gpu frame was
chosen ("measured now" / "remembered"). The random-weight checkpoint ignores end-of-speech, so every click is exactly
--frames frames. On a CPU it runs (a dry run; `warm_gpu` changes nothing there).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import TEXT, command, device_name, random_checkpoint, write_out
from tts_engine.cpu.measured import describe
from tts_engine.engine.engine import TTSEngine

GPU_FRAME_ENV = "TTS_GPU_FRAME"   # (tts_engine/gpu/backend.py: "check" runs the checks even where remembered)


def click(engine: TTSEngine, frames: int, warm: bool) -> dict:
    """One click: from the grant, (`warm_gpu` when `warm`, then) one streamed request of `frames` frames."""
    t0 = time.perf_counter()
    if warm:
        engine.warm_gpu()
    t_warm = time.perf_counter() - t0
    s = engine.stream(TEXT, voice=engine.speakers[0], seed=0, max_new_tokens=frames + 1,
                      sampling={"ignore_eos": True}, first_chunk_frames=2)
    first, samples = None, 0
    for chunk in s:
        if first is None:
            first = time.perf_counter() - t0
        samples += len(chunk)
    wall = time.perf_counter() - t0
    audio = samples / engine.sample_rate
    paths = engine.paths()
    gpu = paths.get("gpu frame")
    return {"first_audio_ms": 1000 * first, "wall_s": wall, "audio_s": audio, "xrt": audio / wall,
            "warm_gpu_ms": 1000 * t_warm if warm else None, "frame": describe(paths["frame"]),
            "gpu frame": describe(gpu) if gpu is not None else "-",
            "gpu frame chosen": gpu["how"] if gpu is not None else "-"}


@contextlib.contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def load(arch: str, device: torch.device, frames: int) -> tuple[TTSEngine, float]:
    """The engine as ZeroGPU's main process loads it (no fast paths, no graphs, 2 rows, caller-driven) -> (engine,
    seconds)."""
    t0 = time.perf_counter()
    engine = TTSEngine.from_pretrained(str(random_checkpoint(arch)), device=device, fast_paths=False, max_batch=2,
                                       max_seq_len=frames + 1024, use_cuda_graphs=False)
    engine.drive_in_caller()
    return engine, time.perf_counter() - t0


def new_worker(arch: str, device: torch.device, frames: int) -> dict:
    """A fresh process (`--as-worker`): loads the engine as ZeroGPU does, clicks once with `warm_gpu` -> its click's
    figures (plus its "load_s"), or {"error": ...}."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "click.json")
        child_env = {k: v for k, v in os.environ.items() if k != GPU_FRAME_ENV or v.strip().lower() != "check"}
        cmd = [sys.executable, "-m", "bench", "zerogpu", "--as-worker", out, "--arch", arch, "--device", str(device),
               "--frames", str(frames)]
        p = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not os.path.exists(out):
            tail = (p.stderr or p.stdout or "").strip().splitlines()[-3:]
            return {"error": f"the new worker exited with {p.returncode}: {' | '.join(tail)}"}
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench zerogpu", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=None, choices=["tiny", "small", "0.6b", "1.7b"],
                    help="random-weight architecture (default 0.6b on a GPU, tiny on a CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--frames", type=int, default=100, help="frames per click (80 ms each)")
    ap.add_argument("--eager-frames", type=int, default=16, help="frames of the eager click (0: skip it)")
    ap.add_argument("--no-new-worker", action="store_true", help="skip the new worker's click")
    ap.add_argument("--as-worker", default=None, metavar="FILE",
                    help="(internal) be the new worker: load, click once, write the click's figures to FILE")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="append the table to this file")
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arch = a.arch or ("0.6b" if device.type == "cuda" else "tiny")
    if a.as_worker:
        engine, load_s = load(arch, device, a.frames)
        got = click(engine, a.frames, warm=True)
        engine.close()
        with open(a.as_worker, "w") as f:
            json.dump({**got, "load_s": load_s, "pid": os.getpid()}, f)
        return 0
    engine, load_s = load(arch, device, a.frames)
    rows = []
    if a.eager_frames:
        rows.append(("eager (as loaded)", click(engine, a.eager_frames, warm=False)))
    off = os.environ.get(GPU_FRAME_ENV, "auto").strip().lower() in ("0", "off", "false", "no")
    with env(GPU_FRAME_ENV, os.environ[GPU_FRAME_ENV] if off else "check"):   # the first worker: nothing remembered
        rows.append(("worker's first click, nothing remembered", click(engine, a.frames, warm=True)))
    rows.append(("second click", click(engine, a.frames, warm=True)))
    engine.close()
    if not a.no_new_worker:
        got = new_worker(arch, device, a.frames)
        if "error" in got:
            print(f"new worker: {got['error']}", file=sys.stderr)
        rows.append(("a new worker (remembered verdict, Triton cache warm)", got))
    dev = device_name(device)
    lines = [f"ZeroGPU mode, one click, {dev}: random-weight {arch}, {engine.precision}, loaded as on ZeroGPU "
             f"(no fast paths, no graphs, 2 rows, caller-driven) in {load_s:.1f} s; times from the grant.",
             "", f"Command: `{command('zerogpu', argv)}`", "",
             "| click | frames | warm_gpu (ms) | first audio (ms) | wall (s) | x real time | gpu frame chosen | frame "
             "| gpu frame |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | - | - | {r['error']} | - |")
            continue
        w = "-" if r["warm_gpu_ms"] is None else f"{r['warm_gpu_ms']:.0f}"
        lines.append(f"| {name} | {round(r['audio_s'] * 12.5)} | {w} | {r['first_audio_ms']:.0f} | {r['wall_s']:.2f} "
                     f"| {r['xrt']:.2f} | {r['gpu frame chosen']} | {r['frame']} | {r['gpu frame']} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        write_out(text, a.out, append=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "arch": arch, "load_s": load_s, "clicks": dict(rows)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
