"""The machine a CPU benchmark runs on: model, family/model numbers, SIMD flags (from /proc/cpuinfo), and a
plain large memory read measured with torch (the floor a one-stream decoder's weight reads can reach)."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

# the flags that decide which kernels a CPU engine can use
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")


def cpuinfo(text: str | None = None) -> dict:
    """{model, family, model_no, flags (set), cpus} of the first processor in /proc/cpuinfo."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    info = {"model": platform.processor() or platform.machine(), "family": None, "model_no": None, "flags": set()}
    for line in text.split("\n\n")[0].splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "model name":
            info["model"] = val
        elif key == "cpu family":
            info["family"] = val
        elif key == "model":
            info["model_no"] = val
        elif key in ("flags", "Features"):
            info["flags"] = set(val.split())
    info["cpus"] = os.cpu_count()
    return info


def machine_key(info: dict) -> str:
    """How docs/benchmarks.md names the machine: one table per key."""
    fam = f" (family {info['family']} model {info['model_no']})" if info.get("family") else ""
    return f"{info['model']}{fam}, {info['cpus']} CPUs"


def simd_flags(info: dict) -> str:
    return " ".join(f for f in SIMD_FLAGS if f in info["flags"]) or "none of " + ", ".join(SIMD_FLAGS[:4])


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> dict:
    """GB/s of a plain large read (sum of a float32 tensor of `mib` MiB, far beyond the caches) and of a copy
    (read + write counted), best of `repeats`, at torch's current thread count."""
    threads = torch.get_num_threads()
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        t1 = time.perf_counter()
        y.copy_(x)
        t2 = time.perf_counter()
        best_read, best_copy = min(best_read, t1 - t0), min(best_copy, t2 - t1)
    return {"read_gbs": nbytes / best_read / 1e9, "copy_gbs": 2 * nbytes / best_copy / 1e9, "mib": mib,
            "threads": threads}


def best_read_bandwidth(threads: int, mib: int = 1024) -> dict:
    """read_bandwidth at 1..threads threads (on a busy machine fewer threads can read faster); the best read."""
    saved = torch.get_num_threads()
    try:
        rows = []
        for t in range(1, threads + 1):
            torch.set_num_threads(t)
            rows.append(read_bandwidth(mib))
    finally:
        torch.set_num_threads(saved)
    return max(rows, key=lambda r: r["read_gbs"])
