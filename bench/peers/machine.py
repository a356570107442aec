"""The machine a CPU benchmark runs on: model, family/model numbers, SIMD flags (from /proc/cpuinfo). The plain
large memory read it is compared with is `bench.plain_read` (one definition for every bench)."""
from __future__ import annotations

import os

from tts_engine.cpu import cpu_info


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
