"""The CPU this process runs on, read once from /proc/cpuinfo (first processor): model name, vendor, family and
model numbers, feature flags, and the key that machine-dependent measurements (the kernel table) are filed under.
Where there is no /proc/cpuinfo (macOS, Windows) the fields are empty and the name falls back to `platform`."""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

PROC_CPUINFO = Path("/proc/cpuinfo")

# the flags that decide which kernels a CPU engine can use, in the order a benchmark table prints them
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")
# the flags (and their order) in `cache_key`: unchanged from the first kernel tables, so tables measured before stay
# valid (a different list or order would be another machine key and measure everything again)
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile", "asimd", "sve", "bf16", "i8mm")


@dataclass(frozen=True)
class CpuInfo:
    model_name: str = ""            # "model name" ("" where the kernel gives none, e.g. many ARM boards)
    vendor: str = ""                # "vendor_id"
    family: str = ""                # "cpu family"
    model: str = ""                 # "model" (the number)
    flags: frozenset[str] = frozenset()   # "flags" (x86) or "Features" (ARM)
    found: bool = False             # False: no /proc/cpuinfo could be read

    @property
    def name(self) -> str:
        """The model name, else what `platform` says (never empty)."""
        return self.model_name or platform.processor() or platform.machine() or "unknown cpu"

    def simd_flags(self) -> list[str]:
        """The SIMD_FLAGS this CPU has, in SIMD_FLAGS order."""
        return [f for f in SIMD_FLAGS if f in self.flags]


def parse(text: str) -> CpuInfo:
    """The first processor of a /proc/cpuinfo text."""
    keys = {"model name": "model_name", "vendor_id": "vendor", "cpu family": "family", "model": "model"}
    fields: dict = {}
    for line in text.split("\n\n")[0].splitlines():
        k, _, v = line.partition(":")
        k, v = k.strip(), v.strip()
        if k in keys:
            fields[keys[k]] = v
        elif k in ("flags", "Features"):
            fields["flags"] = frozenset(v.split())
    return CpuInfo(**fields, found=True)


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU (read once per process)."""
    try:
        return parse(PROC_CPUINFO.read_text(encoding="utf-8"))
    except OSError:
        return CpuInfo()


def cache_key(info: CpuInfo | None = None) -> dict:
    """The CPU part of a machine key: model name, vendor, family, model and the KEY_FLAGS it has. Without
    /proc/cpuinfo the model name is what `platform` says."""
    info = info or cpu_info()
    name = info.model_name if info.found else (platform.processor() or platform.machine())
    return {"model_name": name, "vendor": info.vendor, "family": info.family, "model": info.model,
            "flags": [f for f in KEY_FLAGS if f in info.flags]}
