"""The CPU engine on an emulated AVX2 CPU without AVX-512 (QEMU user mode, `qemu-x86_64 -cpu Haswell`), against
the same run on this machine (tests/emulated_cpu.py does the work; its module doc says how and why).

On the emulated CPU: cpu_info sees that CPU; our kernels, the fused SnakeBeta and the fused step's bf16 matmul
pick their AVX2 paths (cpuid); every kernel candidate offered runs; the W8A8 kernel gives exact int32 sums and the
same bytes as the native AVX-512 VNNI path, the W4A8 kernel (its AVX2 path, vpmaddubsw) the same bytes as the native
VNNI one; a whole tiny synthesis in w8a8, w4a8 and bf16 (fused step and predictor frame on) gives finite audio; teacher-forced on the native run's codes, hidden
states and logits stay within test_fused_step's bounds of native; the codec (fp32 aten and packed, bf16) decodes
those codes as natively. A SIGILL anywhere fails it (the emulated process dies).

Skips when qemu-x86_64 (apt-get install qemu-user; QEMU >= 7.2 emulates AVX2) or gcc is absent; CI installs
qemu-user for it (.ci/run). Its duration on the 2-vCPU Zen 4 (session 7): 60 s at load 1 (58 s of CPU: the run is
serial; ~50 s of it is importing torch, transformers and torch._dynamo under TCG), 73-135 s while other work loaded
the machine (load 3-7).
The fuller check (Haswell and Nehalem, more frames, the codec's measured choice): `python tests/emulated_cpu.py`."""
from __future__ import annotations

import shutil

import pytest

import emulated_cpu

pytestmark = [pytest.mark.skipif(emulated_cpu.qemu() is None, reason="qemu-x86_64 not installed (apt-get install qemu-user)"),
              pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None, reason="no gcc/g++")]


def test_an_avx2_cpu_takes_its_own_paths_and_matches_native(tmp_path):
    results = emulated_cpu.check(["Haswell"], tmp_path, quick=True, log=lambda *a: None)
    rc, err, checks = results["Haswell"]
    assert rc == 0, err
    report = emulated_cpu.report(results, tmp_path)
    assert len(checks) >= 25, report
    assert all(ok for _, ok, _ in checks), report
