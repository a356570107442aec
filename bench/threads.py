"""The OpenMP stall: `python -m bench threads [--busy] [--frames-mode int8]`.

Part 1 times the small ops of a decode frame alone (attention matmuls and softmax of 2 queries, a one-row RMSNorm,
top-k, argmax) at 1 thread and at the process's threads, median and mean over many calls: a 2-thread median at or
below the 1-thread one means the op is split between threads (it enters the OpenMP pool); a mean far above the
median means some calls waited for a descheduled pool thread. Part 2 (`--frames-mode`) runs whole frames of the
random-weight 0.6b talker (one row) with the thread governor's three options interleaved: 1 thread, all threads,
all threads inside the linear layers only. `--busy` starts a busy-looping process beside it (another program keeping
one core busy) for the whole run. Prints markdown with the load average; nothing is written.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from bench.common import build_talker, device_name, load1, make_runner, random_config


def _time(fn, n: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return 1e6 * ts[len(ts) // 2], 1e6 * sum(ts) / len(ts)


def small_ops(keys_len: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 128, generator=g)
    k = torch.randn(1, 8, keys_len, 128, generator=g)
    v = torch.randn(1, 8, keys_len, 128, generator=g)
    sc = torch.randn(1, 8, 2, keys_len, generator=g)
    x = torch.randn(1, 1, 1024, generator=g).bfloat16()
    w = torch.ones(1024).bfloat16()
    lg, lg3 = torch.randn(1, 2048, generator=g), torch.randn(1, 3072, generator=g)

    def rms():
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)
    return {f"attention q·kᵀ fp32 [1,8,2,128] x [1,8,128,{keys_len}]": lambda: torch.matmul(q, k.transpose(-1, -2)),
            "attention p·v fp32": lambda: torch.matmul(sc, v),
            f"softmax [1,8,2,{keys_len}]": lambda: sc.softmax(-1),
            "bf16 RMSNorm of one row": rms,
            "top-k 50 of 2048": lambda: torch.topk(lg, 50),
            "argmax of 3072": lambda: lg3.argmax(-1)}


def frames(mode: str, n: int, threads: int) -> dict:
    from tts_engine.cpu.threads import serial_between_matmuls

    cfg = random_config("0.6b")
    quant = mode if mode in ("int8", "int4", "w8a8") else None
    t, _ = build_talker("tts_engine", cfg, torch.bfloat16, quant)
    switch = serial_between_matmuls(t, threads)
    r, _, _ = make_runner("tts_engine", t, cfg, torch.bfloat16, 1, 3 * n + 80)
    opts = {"1 thread": (1, False), f"{threads} threads": (threads, False),
            f"{threads} threads in the linear layers only": (1, True)}
    res: dict = {k: [] for k in opts}
    names = list(opts)
    with torch.inference_mode():
        for i in range(n + 1):
            for name in names[i % 3:] + names[:i % 3]:
                nt, serial = opts[name]
                torch.set_num_threads(nt)
                switch.set(serial)
                t0, c0 = time.perf_counter(), time.thread_time()
                r.decode([0])
                if i:   # the first round warms up
                    res[name].append((time.perf_counter() - t0, time.thread_time() - c0))
                switch.set(False)
    torch.set_num_threads(threads)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench threads", description=__doc__.split("\n")[0])
    p.add_argument("--busy", action="store_true", help="a busy-looping process beside the run")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--keys", type=int, default=200, help="attention keys (cache positions read)")
    p.add_argument("--frames-mode", choices=["bf16", "int8", "int4", "w8a8"], help="also whole 0.6b frames")
    p.add_argument("--frames", type=int, default=8, help="frames per option (interleaved)")
    a = p.parse_args(argv)
    threads = torch.get_num_threads()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
    try:
        time.sleep(0.5 if busy else 0)
        load = load1()
        ops = small_ops(a.keys)
        res = {}
        for nt in (1, threads):
            torch.set_num_threads(nt)
            for name, fn in ops.items():
                res.setdefault(name, []).append(_time(fn, a.calls))
        torch.set_num_threads(threads)
        out = [f"Device: **{device_name(torch.device('cpu'))}**; {'a busy-looping process beside it; ' if busy else ''}"
               f"load average {load:.2f} at the start.", "",
               f"| op | 1 thread: median / mean µs | {threads} threads: median / mean µs |", "|---|---|---|"]
        for name, ((m1, a1), (m2, a2)) in res.items():
            out.append(f"| {name} | {m1:.1f} / {a1:.1f} | {m2:.1f} / {a2:.1f} |")
        if a.frames_mode:
            fr = frames(a.frames_mode, a.frames, threads)
            out += ["", f"Whole {a.frames_mode} frames of the 0.6b talker, one row, options interleaved "
                    f"({a.frames} each; load average {load1():.2f} at the end):", "",
                    "| option | wall ms median (best) | CPU ms of the frame's thread, median |", "|---|---|---|"]
            for name, xs in fr.items():
                w = sorted(x[0] for x in xs)
                c = sorted(x[1] for x in xs)
                out.append(f"| {name} | {1000 * w[len(w) // 2]:.0f} ({1000 * w[0]:.0f}) | {1000 * c[len(c) // 2]:.0f} |")
        print("\n".join(out))
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
