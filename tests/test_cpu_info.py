"""tts_engine.cpu.cpu_info: the one reader of /proc/cpuinfo, and the five places that name or key the CPU through it."""
from __future__ import annotations

import platform

import pytest
import torch

from tts_engine.cpu import cpu_info

XEON = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
        "model name\t: Intel(R) Xeon(R) Platinum 8581C\n"
        "flags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile\n\n"
        "processor\t: 1\nvendor_id\t: Other\nmodel name\t: second processor\nflags\t\t: fpu\n")
ARM = ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes sve bf16 i8mm\n"
       "CPU implementer\t: 0x41\n\nprocessor\t: 1\nFeatures\t: fp\n")


@pytest.fixture
def fake_proc(monkeypatch, tmp_path):
    """Point the reader at a file of our own (or at none) and forget what it read before."""
    def use(text: str | None):
        path = tmp_path / ("cpuinfo" if text is not None else "missing")
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(cpu_info, "PROC_CPUINFO", path)
        cpu_info.cpu_info.cache_clear()
    yield use
    cpu_info.cpu_info.cache_clear()


def test_parse_reads_the_first_processor_only():
    info = cpu_info.parse(XEON)
    assert (info.model_name, info.vendor, info.family, info.model) == (
        "Intel(R) Xeon(R) Platinum 8581C", "GenuineIntel", "6", "207")
    assert "amx_tile" in info.flags and "fpu" in info.flags and info.found
    assert info.name == info.model_name
    assert info.simd_flags() == ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                 "avx512_vnni", "avx512_bf16", "amx_tile"]


def test_parse_arm_features_and_no_model_name():
    info = cpu_info.parse(ARM)
    assert info.model_name == "" and info.flags == frozenset({"fp", "asimd", "evtstrm", "aes", "sve", "bf16", "i8mm"})
    assert info.name == (platform.processor() or platform.machine() or "unknown cpu")
    assert cpu_info.cache_key(info) == {"model_name": "", "vendor": "", "family": "", "model": "",
                                        "flags": ["asimd", "sve", "bf16", "i8mm"]}


def test_cache_key_keeps_the_kernel_tables_flag_order():
    key = cpu_info.cache_key(cpu_info.parse(XEON))
    assert key == {"model_name": "Intel(R) Xeon(R) Platinum 8581C", "vendor": "GenuineIntel", "family": "6",
                   "model": "207", "flags": ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                                             "avx512_bf16", "amx_tile"]}


def test_no_proc_cpuinfo(fake_proc):
    fake_proc(None)
    info = cpu_info.cpu_info()
    assert not info.found and info.flags == frozenset() and info.name
    assert cpu_info.cache_key()["model_name"] == (platform.processor() or platform.machine())
    assert cpu_info.cache_key()["flags"] == []


def test_the_five_readers_go_through_cpu_info(fake_proc):
    from bench import common as bench
    from tts_engine.cpu import codec_dtype as dtype_choice
    from tts_engine.cpu import kernels
    from tts_engine import loader as qwen3_tts
    from bench import common as machine

    fake_proc(XEON)
    name = "Intel(R) Xeon(R) Platinum 8581C"
    assert kernels.cpu_identity() == cpu_info.cache_key(cpu_info.parse(XEON))
    assert kernels.machine_key()["cpu"]["model_name"] == name
    assert kernels.table_path(kernels.machine_key()).name.startswith("Intel-R--Xeon-R--Platinum-8581C-")
    assert "avx512_bf16" in qwen3_tts.cpu_flags() and "fpu" in qwen3_tts.cpu_flags()
    assert dtype_choice.machine_key().startswith(f"{name} | ")
    assert bench.device_name(torch.device("cpu")).startswith(f"CPU: {name}, ")
    info = machine.cpuinfo()
    assert (info["model"], info["family"], info["model_no"]) == (name, "6", "207")
    assert machine.machine_key(info).startswith(f"{name} (family 6 model 207), ")
    assert machine.simd_flags(info).startswith("sse4_2 avx avx2 fma")

    fake_proc(None)
    assert qwen3_tts.cpu_flags() == set()
    assert dtype_choice.machine_key().startswith("unknown cpu | ")
    assert machine.cpuinfo()["family"] is None and machine.simd_flags(machine.cpuinfo()).startswith("none of ")
