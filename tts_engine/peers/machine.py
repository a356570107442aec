"""The machine a CPU benchmark runs on: model, family/model numbers, SIMD flags (from /proc/cpuinfo), and a
plain large memory read measured with torch (the floor a one-stream decoder's weight reads can reach)."""
from __future__ import annotations

import os
import time

import torch

from .. import cpu_info


def cpuinfo(text: str | None = None) -> dict:
    """{model, family, model_no, flags (set), cpus} of the first processor in /proc/cpuinfo (or in `text`)."""
    info = cpu_info.cpu_info() if text is None else cpu_info.parse(text)
    return {"model": info.name, "family": info.family or None, "model_no": info.model or None,
            "flags": set(info.flags), "cpus": os.cpu_count()}


def machine_key(info: dict) -> str:
    """How docs/benchmarks.md names the machine: one table per key."""
    fam = f" (family {info['family']} model {info['model_no']})" if info.get("family") else ""
    return f"{info['model']}{fam}, {info['cpus']} CPUs"


def simd_flags(info: dict) -> str:
    have = [f for f in cpu_info.SIMD_FLAGS if f in info["flags"]]
    return " ".join(have) or "none of " + ", ".join(cpu_info.SIMD_FLAGS[:4])


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
