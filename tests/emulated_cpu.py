"""Our CPU engine on emulated x86-64 CPUs (QEMU user mode), compared with the same run on this machine.

This machine has AVX-512 (BF16/VNNI); the engine's other code paths (AVX2 + FMA, SSE-only) are otherwise only forced
here by environment variables. `qemu-x86_64 -cpu MODEL` runs the Python process on an emulated CPU, so the
kernels' own run-time checks (cpuid: `__builtin_cpu_supports` in cpu_ext.cpp / fused_step.cpp, torch's and
oneDNN's dispatch) see that CPU and pick its paths; an instruction it lacks is a SIGILL. Child processes (g++
building our kernels) start by execve and run natively (no binfmt_misc here): the build is native, the run emulated.

Two quirks of QEMU user mode this module works around:
- /proc/cpuinfo is the HOST's (AVX-512 flags and all). `cpu_info` reads it, so under emulation the process is given
  a copy whose model name and SIMD flags are the emulated CPU's own, read with cpuid (`probe`, a tiny C library
  loaded in-process) before anything reads cpu_info (`patch_cpu_info`).
- QEMU 7.2's TCG emulates up to AVX2 (no AVX-512): an "AVX-512 without VNNI/BF16" CPU cannot be emulated
  (checked in session 9: under `-cpu Skylake-Server`, `Cascadelake-Server`, `Icelake-Server` and `max`, cpuid has no
  avx512f and one zmm instruction is a SIGILL; `-cpu max,+avx-vnni` warns that TCG lacks AVX-VNNI). The AVX-512
  paths without VNNI are tested natively at the forced `avx512` level (tests/test_cpu_isa_levels.py).
numpy 2.x needs x86-64-v2 (SSE4.2 + POPCNT), so `-cpu Nehalem` is the plainest CPU the engine runs on
(`-cpu qemu64` dies in numpy's import; torch 2.13 alone imports there, with capability DEFAULT).

Timings under emulation mean nothing (TCG is 10-100x slower); nothing here measures speed.

    python tests/emulated_cpu.py                         # Haswell and Nehalem, vs native; prints a table
    python tests/emulated_cpu.py --quick --cpu Haswell   # what tests/test_emulated_cpu.py runs (~60 s)
    python tests/emulated_cpu.py --cpu Haswell --pytest  # also the kernel test files under emulation
    python tests/emulated_cpu.py payload OUT_DIR [--reference NATIVE_DIR]   # one side (what the driver runs)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QEMU = "qemu-x86_64"
# the emulated CPUs the check runs on, and what they lack next to an AVX-512 machine
CPUS = {"Haswell": "AVX2 + FMA, no AVX-512", "Nehalem": "SSE4.2 (x86-64-v2), no AVX"}
MODES = ("w8a8", "w4a8", "bf16")
FRAMES, ROWS = 6, 2
QUICK = dict(rows=1, frames=4)   # the pytest variant (tests/test_emulated_cpu.py): fewer frames, codec path forced
QUICK_ENV = {"TTS_CODEC_DTYPE": "fp32", "TTS_CODEC_CONV": "aten"}   # nothing timed (the payload decodes both paths)
# the flags probed with cpuid: /proc/cpuinfo name -> __builtin_cpu_supports name
PROBED = {"sse4_2": "sse4.2", "popcnt": "popcnt", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
          "bmi2": "bmi2", "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512bw": "avx512bw",
          "avx512vl": "avx512vl", "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16",
          "avx512_fp16": "avx512fp16", "avx_vnni": "avxvnni", "amx_tile": "amx-tile", "amx_int8": "amx-int8",
          "amx_bf16": "amx-bf16"}
PROBE_C = r"""
#include <cpuid.h>
#include <string.h>
int probe_flag(const char* f) {
  __builtin_cpu_init();
#define F(s) if (!strcmp(f, s)) return __builtin_cpu_supports(s) ? 1 : 0;
  %s
  return -1;
}
/* vendor (12 chars), brand string (48 chars), family and model as /proc/cpuinfo gives them */
void probe_ident(char* vendor, char* brand, int* family, int* model) {
  unsigned a, b, c, d;
  __get_cpuid(0, &a, &b, &c, &d);
  memcpy(vendor, &b, 4); memcpy(vendor + 4, &d, 4); memcpy(vendor + 8, &c, 4); vendor[12] = 0;
  __get_cpuid(1, &a, &b, &c, &d);
  int fam = (a >> 8) & 15, mod = (a >> 4) & 15;
  if (fam == 15) fam += (a >> 20) & 255;
  if (fam == 6 || fam >= 15) mod += ((a >> 16) & 15) << 4;
  *family = fam; *model = mod;
  brand[0] = 0;
  if (__get_cpuid_max(0x80000000, 0) >= 0x80000004) {
    unsigned* p = (unsigned*)brand;
    for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002 + i, p + 4 * i, p + 4 * i + 1, p + 4 * i + 2, p + 4 * i + 3);
    brand[48] = 0;
  }
}
"""


def qemu() -> str | None:
    return shutil.which(QEMU)


def qemu_version() -> str:
    exe = qemu()
    if not exe:
        return ""
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"version (\S+)", out)
    return m.group(1) if m else out.strip()[:40]


# --- the emulated CPU's own view (cpuid, in-process) -------------------------------------------------------------
def probe_library(folder: Path) -> Path:
    """Build the cpuid probe (native g++/cc child) into `folder`; raises when there is no compiler."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler (gcc) on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    src = PROBE_C % " ".join(f'F("{v}")' for v in PROBED.values())
    out = folder / "cpuid_probe.so"
    (folder / "cpuid_probe.c").write_text(src)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", str(folder / "cpuid_probe.c"), "-o", str(out)], check=True,
                   capture_output=True)
    return out


def probe(lib_path: Path) -> dict:
    """What the CPU running this process says about itself (cpuid): vendor, brand, family, model, flags."""
    lib = ctypes.CDLL(str(lib_path))
    lib.probe_flag.argtypes, lib.probe_flag.restype = [ctypes.c_char_p], ctypes.c_int
    vendor, brand = ctypes.create_string_buffer(16), ctypes.create_string_buffer(64)
    fam, mod = ctypes.c_int(), ctypes.c_int()
    lib.probe_ident(vendor, brand, ctypes.byref(fam), ctypes.byref(mod))
    flags = {k: lib.probe_flag(v.encode()) for k, v in PROBED.items()}
    return {"vendor": vendor.value.decode(), "model_name": brand.value.decode().strip(), "family": fam.value,
            "model": mod.value, "flags": sorted(k for k, v in flags.items() if v == 1),
            "unprobed": sorted(k for k, v in flags.items() if v < 0)}


def emulated_cpuinfo(host_text: str, view: dict) -> str:
    """`host_text` (/proc/cpuinfo as QEMU shows it: the host's) with the first processor's model name, vendor,
    family, model and SIMD flags replaced by the CPU's own (`probe`). A probed flag stays only where cpuid has it;
    without avx512f every avx512* flag goes, without avx every avx* flag."""
    block = host_text.split("\n\n")[0]
    have = set(view["flags"])
    out = []
    for line in block.splitlines():
        k, sep, v = line.partition(":")
        key = k.strip()
        if key == "model name":
            v = " " + (view["model_name"] or "emulated cpu")
        elif key == "vendor_id":
            v = " " + view["vendor"]
        elif key == "cpu family":
            v = f" {view['family']}"
        elif key == "model":
            v = f" {view['model']}"
        elif key == "flags":
            kept = []
            for f in v.split():
                if f in PROBED and f not in view["unprobed"]:
                    if f in have:
                        kept.append(f)
                elif f.startswith("avx512") and "avx512f" not in have:
                    continue
                elif f.startswith(("avx", "amx")) and "avx" not in have:
                    continue
                else:
                    kept.append(f)
            kept += [f for f in sorted(have) if f not in kept]
            v = " " + " ".join(kept)
        out.append(f"{k}{sep}{v}" if sep else line)
    return "\n".join(out) + "\n\n"


def patch_cpu_info(folder: Path) -> dict:
    """Make `tts_engine.cpu.cpu_info` read the running CPU's own identity (see the module doc); -> that view. Call
    before anything reads cpu_info (it caches)."""
    from tts_engine.cpu import cpu_info

    view = probe(probe_library(folder))
    path = folder / "cpuinfo"
    path.write_text(emulated_cpuinfo(Path("/proc/cpuinfo").read_text(), view))
    cpu_info.PROC_CPUINFO = path
    cpu_info.cpu_info.cache_clear()
    return view


def pytest_configure(config):   # `-p emulated_cpu`: the test files see the emulated CPU in cpu_info too
    if os.environ.get("TTS_EMULATED_CPU"):
        patch_cpu_info(Path(tempfile.mkdtemp(prefix="emucpu-")))


# --- one side of the check (natively, or under qemu) ---------------------------------------------------------------
def _digest(t) -> str:
    import hashlib

    return hashlib.sha1(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()).hexdigest()[:16]


def identity(view: dict | None) -> dict:
    """What the process and our code see of this CPU, and which code paths they pick."""
    import torch

    from tts_engine.cpu import cpu_info
    from tts_engine.model import quant
    from tts_engine.cpu import cpu_ext
    from tts_engine.cpu import fused_step
    from tts_engine.loader import default_dtype

    torch_cpu = {n[4:-10]: bool(getattr(torch.cpu, n)()) for n in ("_is_avx2_supported", "_is_avx512_supported",
                                                                   "_is_vnni_supported", "_is_avx512_bf16_supported")
                 if hasattr(torch.cpu, n)}
    try:
        ttsf = fused_step.library().ttsf_bf16_isa()
    except Exception as e:   # noqa: BLE001 - reported
        ttsf = f"unavailable: {e}"[:200]
    snake = None
    if cpu_ext.available():
        cpu_ext.snake(torch.zeros(1, 1, 1), torch.ones(1), torch.ones(1))
        snake = cpu_ext._state.get("snake_isa")
    return {"cpuid": view, "cpu_info": {"name": cpu_info.cpu_info().name, "simd": cpu_info.cpu_info().simd_flags()},
            "host_proc_cpuinfo_has_avx512f": "avx512f" in Path("/proc/cpuinfo").read_text(),
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "torch_cpu": torch_cpu,
            "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "default_cpu_dtype": str(default_dtype(torch.device("cpu"))).replace("torch.", ""),
            "cpu_ext_isa": cpu_ext.isa(), "cpu_ext_why_not": cpu_ext.why_unavailable(),
            "w4a8_kernel": cpu_ext.has_w4a8(), "quant_modes": list(quant.available_modes()),
            "snake_isa": snake, "fused_bf16_isa": ttsf}


def kernel_checks() -> dict:
    """Our kernels against exact / float64 references on this CPU's own paths; digests of their outputs (the W8A8
    layer's math is the same on every path: native and emulated must give the same bytes)."""
    import torch

    from tts_engine.cpu import cpu_ext
    from tts_engine.cpu import kernels

    out: dict = {}
    if not cpu_ext.available():
        return {"skipped": f"our kernels do not run here: {cpu_ext.why_unavailable()}"}
    g = torch.Generator().manual_seed(11)
    res = []
    for N, K in [(37, 50), (256, 1024)]:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        s127 = torch.rand(N, generator=g) * 1e-4
        packed = cpu_ext.pack(q)
        for rows in (1, 2, 3, 5):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, K, generator=g) * 3).to(dtype)
                acc = torch.empty(rows, N, dtype=torch.int32)
                y = cpu_ext.w8a8(x, packed, s127, N, acc)
                xq, _ = kernels.quantize_rows(x)
                exact = bool(torch.equal(acc.long(), xq.long() @ q.long().T))
                same = bool(torch.equal(y, kernels.w8a8_int_mm(x, q, s127).to(dtype)))
                res.append({"shape": [rows, N, K], "dtype": str(dtype)[6:], "exact_sums": exact, "equals_aten": same,
                            "digest": _digest(y)})
    out["w8a8"] = res
    if cpu_ext.has_w4a8():
        from tts_engine.model.quant import int4_quantize

        w = torch.randn(96, 256, generator=g) * 0.05
        q, sz = int4_quantize(w, 64)
        packed4 = cpu_ext.pack4(q, sz)
        wdeq = ((q - 8) * sz[..., 0].float().T.repeat_interleave(64, 1) + sz[..., 1].float().T.repeat_interleave(64, 1)).double()
        x = torch.randn(3, 256, generator=g)
        xq, amax = kernels.quantize_rows(x)
        exact = (xq.double() @ wdeq.T) * amax.double() / 127
        y = cpu_ext.w4a8(x, packed4, 96)
        ys = [cpu_ext.w4a8(x[:m].to(dt), packed4, 96) for m in (1, 2, 3) for dt in (torch.float32, torch.bfloat16)]
        out["w4a8"] = {"rel_err": ((y.double() - exact).norm() / exact.norm()).item(),
                       "digests": [_digest(t) for t in ys]}   # the same bytes on every path (AVX2 or VNNI)
    snake = []
    for dtype in (torch.float32, torch.bfloat16):   # test_codec_snake's case and bounds
        for time_major in (False, True):
            x = (torch.randn(2, 48, 37, generator=g) * 4).to(dtype)
            a, ib = torch.exp(torch.randn(48, generator=g) * 0.7), 1 / (torch.exp(torch.randn(48, generator=g) * 0.7) + 1e-9)
            if time_major:
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
            xd = x.double()
            ref = xd + ib.double()[None, :, None] * torch.sin(xd * a.double()[None, :, None]) ** 2
            y = cpu_ext.snake(x, a, ib)
            err = None if y is None else (y.double() - ref).abs()
            ok = y is not None and y.stride() == x.stride() and (
                float((err - 2e-6 * ref.abs()).max()) < 4e-6 if dtype == torch.float32
                else float((err - 2 ** -8 * ref.abs()).max()) <= 1e-6)
            snake.append({"dtype": str(dtype)[6:], "time_major": time_major, "ok": bool(ok),
                          "max_err": None if y is None else float(err.max()), "digest": None if y is None else _digest(y)})
    out["snake"] = snake
    return out


def candidate_checks() -> dict:
    """Every kernel candidate offered here runs (the kernel table times them all at load: one that raises is left
    out, one that executes an instruction this CPU lacks kills the process). Small weights: a correctness check."""
    import torch

    from tts_engine.cpu import kernels

    kernels.register_cpu_ext()
    buf = torch.full((4 << 20,), 0x3C, dtype=torch.uint8)
    out = {}
    for fmt, f in kernels.FORMATS.items():
        times = kernels.time_candidates(fmt, 128, 256, 1, buf) if f.candidates else {}
        out[fmt] = {"offered": sorted(f.candidates), "ran": sorted(times), "default": f.default}
    return out


def _stream_decode(dec, codes, splits=(1, 2, 3)):
    import torch

    st, wavs, t = dec.init_state(1), [], 0
    with torch.inference_mode():
        for n in list(splits) + [codes.shape[-1] - sum(splits)]:
            if n > 0:
                wavs.append(dec.decode_step(codes[:, :, t:t + n], st).float())
                t += n
    return torch.cat(wavs, dim=-1)


def engine_check(mode: str, ckpt: Path, ref: dict | None, rows: int, frames: int) -> tuple[dict, dict]:
    """One mode in a whole engine (fused step forced on where it runs): a short synthesis, greedy codes, the
    teacher-forced stepwise trace on the reference codes (native run's where given), and the codec decoding those
    codes on both convolution paths (fp32; bf16 packed). -> (json summary, tensors)."""
    import copy

    import numpy as np
    import torch

    from tts_engine.cpu import talker_quality as quality
    from tts_engine.engine.engine import TTSEngine
    from tts_engine.errors import TTSError
    from tts_engine.model.quant import decode_kernels_only

    kw = dict(dtype="bf16") if mode == "bf16" else dict(dtype="bf16", quantize=mode)
    try:
        engine = TTSEngine.from_pretrained(str(ckpt), device="cpu", max_batch=2, max_seq_len=256, **kw)
    except TTSError as e:
        return {"refused": str(e)}, {}
    try:
        wav = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=1, max_new_tokens=frames)
        model = engine.model
        paths = engine.paths()
        summary = {"precision": engine.precision if hasattr(engine, "precision") else "",
                   "fused": {"talker": paths["talker stack"], "predictor": paths["predictor stack"]},
                   "frame": paths["predictor frame"], "talker_step": paths["talker step"],
                   "synth_samples": int(wav.size),
                   "synth_finite": bool(np.isfinite(wav).all()),
                   "codec": {"dtype": str(model.speech_tokenizer.decoder.pre_conv.conv.weight.dtype)[6:],
                             "conv": getattr(model.speech_tokenizer.decoder, "conv_mode", "?")}}
        prompts = quality.build_prompts(model, rows)
        codes = quality.generate_codes(model, prompts, frames)
        ref_codes = ref["codes"] if ref is not None else codes
        with decode_kernels_only():
            trace = quality.teacher_forced_stepwise(model.talker, model.prompts.tts_pad, prompts, ref_codes)
        dec32 = copy.deepcopy(model.speech_tokenizer.decoder).float()
        c = ref_codes[0].T[None].clone()   # [1, 16, F]
        wavs = {}
        for conv in ("aten", "packed"):
            dec32.set_conv_mode(conv)
            wavs[f"fp32_{conv}"] = _stream_decode(dec32, c)
        dec16 = copy.deepcopy(dec32).bfloat16()
        dec16.set_conv_mode("packed")
        wavs["bf16_packed"] = _stream_decode(dec16, c)
        return summary, {"codes": codes, "trace": trace, "wavs": wavs}
    finally:
        engine.close()


def payload(out: Path, ckpt: Path, reference: Path | None, modes, rows: int, frames: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    view = patch_cpu_info(out / "probe") if os.environ.get("TTS_EMULATED_CPU") else None
    import torch

    torch.set_num_threads(1)
    os.environ["TTS_FUSED_STEP"] = "1"               # the fused step wherever it runs (no timing) ...
    os.environ.setdefault("TTS_PREDICTOR_FRAME", "1")  # ... and the predictor's frame in one call on top of it
    os.environ.setdefault("TTS_TALKER_STEP", "1")      # ... and the talker's step in one call
    os.environ.setdefault("TTS_KERNEL_TUNE", "0")    # no timing of 100 MB of weights per shape (minutes under TCG)
    from tts_engine.cpu import cpu_ext
    from tts_engine.cpu import kernels

    stage = {"start_to_payload": round(time.perf_counter() - T_START, 1)}   # the check's own durations, not speeds
    t0 = time.perf_counter()
    res = {"identity": identity(view)}
    stage["identity (builds our kernels)"], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()
    res["kernels"], res["candidates"], res["engine"] = kernel_checks(), candidate_checks(), {}
    stage["kernels"] = round(time.perf_counter() - t0, 1)
    res["stage_s"] = stage
    # W8A8 layers in our kernels' layout wherever they run (as tests/test_fused_step.py's own_kernels): the same
    # kernel natively and emulated, and the fused step reads that layout
    if cpu_ext.available():
        kernels.KernelTable.choice = lambda self, fmt, N, K, rows=1: "vnni" if fmt == "w8a8" else kernels.FORMATS[fmt].default
    for mode in modes:
        ref = torch.load(reference / f"{mode}.pt") if reference is not None and (reference / f"{mode}.pt").exists() else None
        t0 = time.perf_counter()
        summary, tensors = engine_check(mode, ckpt, ref, rows, frames)
        stage[mode] = round(time.perf_counter() - t0, 1)
        res["engine"][mode] = summary
        if tensors:
            torch.save(tensors, out / f"{mode}.pt")
    (out / "result.json").write_text(json.dumps(res, indent=1))
    return res


# --- native vs emulated ----------------------------------------------------------------------------------------------
def expected_paths(flags: set) -> dict:
    """The code paths our kernels must pick on a CPU with these (cpuid) flags."""
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    avx2 = {"avx2", "fma"} <= flags
    isa = "avx512-vnni" if avx512 and "avx512_vnni" in flags else "avx2" if avx2 else None
    return {"cpu_ext_isa": isa, "w4a8_kernel": isa is not None,   # W4A8: the VNNI or the AVX2 path
            "snake_isa": None if isa is None else 2 if avx512 else 1,
            "fused_bf16_isa": None if isa is None else 3 if avx512 and "avx512_bf16" in flags else 2 if avx512 else 1}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-12))


def compare(native_dir: Path, emu_dir: Path) -> list[tuple[str, bool, str]]:
    """Checks of the emulated side against its own CPU's expectations and against the native side:
    [(what, passed, detail)]."""
    import torch

    from tts_engine.cpu import talker_quality as quality

    nat = json.loads((native_dir / "result.json").read_text())
    emu = json.loads((emu_dir / "result.json").read_text())
    ident, checks = emu["identity"], []

    def check(what, ok, detail=""):
        checks.append((what, bool(ok), str(detail)))

    flags = set(ident["cpuid"]["flags"])
    check("cpu_info sees the emulated CPU (cpuid), not the host's /proc/cpuinfo",
          set(ident["cpu_info"]["simd"]) == flags & set(ident["cpu_info"]["simd"]) and
          ("avx512f" in flags) == ("avx512f" in ident["cpu_info"]["simd"]), ident["cpu_info"])
    for k, want in expected_paths(flags).items():
        got = ident[k]
        if k == "fused_bf16_isa" and want is None:
            ok = isinstance(got, str) and got.startswith("unavailable")
        else:
            ok = got == want
        check(f"{k} follows cpuid", ok, f"got {got!r}, want {want!r}")
    check("no w4a8 quantisation offered without its kernel",
          ident["w4a8_kernel"] == ("w4a8" in ident["quant_modes"]), ident["quant_modes"])
    for fmt, c in emu["candidates"].items():
        check(f"{fmt}: every kernel candidate offered here runs", c["offered"] == c["ran"] and
              (c["offered"] or fmt == "w4a8"), f"offered {c['offered']}, ran {c['ran']}")
    kn, ke = nat["kernels"], emu["kernels"]
    if "skipped" in ke:
        check("own kernels unavailable, said why", ident["cpu_ext_isa"] is None and ke["skipped"], ke["skipped"])
    else:
        w = ke["w8a8"]
        check("w8a8: exact int32 sums, result equal to aten's W8A8 path",
              all(r["exact_sums"] and r["equals_aten"] for r in w), f"{len(w)} shapes x dtypes")
        if "w8a8" in kn:
            same = sum(a["digest"] == b["digest"] for a, b in zip(w, kn["w8a8"]))
            check("w8a8: the same bytes as the native (AVX-512 VNNI) path", same == len(w), f"{same}/{len(w)}")
        if "w4a8" in ke:
            check("w4a8 kernel close to float64", ke["w4a8"]["rel_err"] < 2e-6, ke["w4a8"]["rel_err"])
            if "w4a8" in kn:
                d_e, d_n = ke["w4a8"].get("digests", []), kn["w4a8"].get("digests", [])
                same = sum(a == b for a, b in zip(d_e, d_n))
                check("w4a8: the same bytes as the native path", same == len(d_n) > 0, f"{same}/{len(d_n)}")
        for s, sn in zip(ke["snake"], kn.get("snake", [{}] * 4)):
            check(f"snake {s['dtype']} {'time-major' if s['time_major'] else 'channel-major'} within "
                  "test_codec_snake's bounds", s["ok"], f"max err {s['max_err']:.3g}; same bytes as native: "
                  f"{s['digest'] == sn.get('digest')}")
    for mode, se in emu["engine"].items():
        sn = nat["engine"].get(mode, {})
        if not ident["w4a8_kernel"] and mode == "w4a8":
            check(f"{mode}: refused with a clear message", "w4a8" in se.get("refused", ""), se.get("refused"))
            continue
        if "refused" in se:
            check(f"{mode}: engine loads", False, se["refused"])
            continue
        check(f"{mode}: synthesis gives finite audio", se["synth_finite"] and se["synth_samples"] > 0,
              f"{se['synth_samples']} samples, fused {se['fused']}, codec {se['codec']}")
        if ident["cpu_ext_isa"] is not None:   # the same stacks fused as natively
            check(f"{mode}: fused step as natively", se["fused"] == sn.get("fused") and
                  any(v["path"] == "fused" for v in se["fused"].values()), se["fused"])
            # on wherever the predictor's stack is fused (tiny w4a8: some predictor layers' K is no multiple of 64,
            # they stay dense and the predictor is not fused, natively too)
            check(f"{mode}: predictor frame in one call on, as natively", se["frame"] == sn.get("frame") and
                  (se["frame"]["path"] != "loop" or se["fused"]["predictor"]["path"] != "fused"), se["frame"])
            check(f"{mode}: talker step in one call on, as natively", se.get("talker_step") == sn.get("talker_step")
                  and (se["talker_step"]["path"] == "step" or se["fused"]["talker"]["path"] != "fused"),
                  se.get("talker_step"))
        else:
            check(f"{mode}: fused step off", not any(v["path"] == "fused" for v in se["fused"].values()), se["fused"])
            check(f"{mode}: predictor frame off", se["frame"]["path"] == "loop", se["frame"])
            check(f"{mode}: talker step off", se["talker_step"]["path"] != "step", se.get("talker_step"))
        if "refused" in sn or not (native_dir / f"{mode}.pt").exists():
            continue
        tn, te = torch.load(native_dir / f"{mode}.pt"), torch.load(emu_dir / f"{mode}.pt")
        same = (tn["codes"] == te["codes"]).all(-1).float().mean().item()
        check(f"{mode}: free-running greedy codes equal to native's (frames)", True, f"{100 * same:.0f}% (informative: "
              "near-ties of random weights may flip)")
        r = quality.compare(tn["trace"], te["trace"], mode)
        ok = (r.hidden_cos_min > 0.999 and r.c0_logits_cos_min > 0.999 and r.cp_logits_cos_min > 0.999
              and r.c0_top1 >= 0.75 and r.cp_top1 >= 0.85)
        check(f"{mode}: teacher-forced on native codes, close to native", ok,
              f"hidden cos min {r.hidden_cos_min:.6f}, logits cos min {r.c0_logits_cos_min:.6f} / "
              f"{r.cp_logits_cos_min:.6f}, top-1 {r.c0_top1:.2f} / {r.cp_top1:.2f}")
        for k, tol in (("fp32_aten", 1e-4), ("fp32_packed", 1e-4), ("bf16_packed", 0.05)):
            e = _rel(te["wavs"][k], tn["wavs"][k])
            check(f"{mode}: codec {k} on native codes, close to native", e < tol, f"rel err {e:.2e} (< {tol})")
    return checks


def run_side(out: Path, ckpt: Path, cache: Path, cpu: str | None, reference: Path | None, modes, rows: int,
             frames: int, timeout: float, extra_env: dict | None = None) -> tuple[int, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "payload", str(out), "--ckpt", str(ckpt),
           "--modes", ",".join(modes), "--rows", str(rows), "--frames", str(frames)]
    if reference is not None:
        cmd += ["--reference", str(reference)]
    env = dict(os.environ, TTS_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    for k in ("TTS_EMULATED_CPU", "TTS_CPU_DTYPE", "TTS_CODEC_DTYPE", "TTS_CODEC_CONV", "TTS_FUSED_STEP",
              "TTS_PREDICTOR_FRAME", "TTS_TALKER_STEP", "TTS_KERNEL_TUNE"):   # tests/conftest.py's settings do not apply here
        env.pop(k, None)
    env.update(extra_env or {})
    if cpu:
        cmd = [qemu(), "-cpu", cpu] + cmd
        env["TTS_EMULATED_CPU"] = cpu
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    err = "\n".join(ln for ln in r.stderr.splitlines() if "TCG doesn't support" not in ln)
    return r.returncode, err[-3000:]


def run_pytest(cpu: str, files, cache: Path, timeout: float) -> tuple[int, str]:
    env = dict(os.environ, TTS_CACHE_DIR=str(cache), TTS_EMULATED_CPU=cpu,
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    cmd = [qemu(), "-cpu", cpu, sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
           "emulated_cpu", *files]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    out = "\n".join(ln for ln in (r.stdout + r.stderr).splitlines() if "TCG doesn't support" not in ln)
    return r.returncode, out[-6000:]


PYTEST_FILES = ("tests/test_cpu_ext_kernels.py", "tests/test_codec_snake.py", "tests/test_codec_packed.py",
                "tests/test_fused_step.py", "tests/test_codec_dtype.py", "tests/test_cpu_isa_levels.py",
                "tests/test_codec_int8.py")


def check(cpus, work: Path, modes=MODES, rows: int = ROWS, frames: int = FRAMES, timeout: float = 1800,
          log=print, quick: bool = False) -> dict:
    """Native side, then each emulated CPU; -> {cpu: (rc, stderr tail, checks)}. quick: QUICK sizes and QUICK_ENV."""
    extra = QUICK_ENV if quick else None
    if quick:
        rows, frames = QUICK["rows"], QUICK["frames"]
    from tts_engine.tiny import make_tiny

    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").exists():
        make_tiny(ckpt, kind="custom_voice", seed=0)
    cache = work / "cache"
    rc, err = run_side(work / "native", ckpt, cache, None, None, modes, rows, frames, timeout, extra)
    if rc:
        raise RuntimeError(f"the native side failed ({rc}): {err}")
    results = {}
    for cpu in cpus:
        t0 = time.perf_counter()
        rc, err = run_side(work / cpu, ckpt, cache, cpu, work / "native", modes, rows, frames, timeout, extra)
        checks = compare(work / "native", work / cpu) if rc == 0 else []
        results[cpu] = (rc, err, checks)
        log(f"{cpu}: exit {rc} after {time.perf_counter() - t0:.0f} s (emulated: not a speed)")
    return results


def report(results: dict, work: Path) -> str:
    lines = [f"QEMU {qemu_version()} user mode; host: {json.loads((work / 'native' / 'result.json').read_text())['identity']['cpu_info']}"]
    for cpu, (rc, err, checks) in results.items():
        ident = json.loads((work / cpu / "result.json").read_text())["identity"] if rc == 0 else {}
        lines.append(f"\n## -cpu {cpu} ({CPUS.get(cpu, '')}): exit {rc}")
        if ident:
            lines.append(f"cpuid: {ident['cpuid']['model_name']}, flags {' '.join(ident['cpuid']['flags'])}; torch "
                         f"{ident['torch_capability']}; our kernels: {ident['cpu_ext_isa']} "
                         f"({ident['cpu_ext_why_not'] or 'built'}), w4a8 {ident['w4a8_kernel']}, snake "
                         f"{ident['snake_isa']}, fused bf16 {ident['fused_bf16_isa']}; default dtype "
                         f"{ident['default_cpu_dtype']}")
            res = json.loads((work / cpu / "result.json").read_text())
            lines.append(f"durations of the check (s, emulated: not speeds): {res.get('stage_s')}")
        if rc:
            lines.append(err)
        for what, ok, detail in checks:
            lines.append(f"  {'ok  ' if ok else 'FAIL'} {what}: {detail}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["payload"]:
        p = argparse.ArgumentParser()
        p.add_argument("out", type=Path)
        p.add_argument("--ckpt", type=Path, required=True)
        p.add_argument("--reference", type=Path)
        p.add_argument("--modes", default=",".join(MODES))
        p.add_argument("--rows", type=int, default=ROWS)
        p.add_argument("--frames", type=int, default=FRAMES)
        a = p.parse_args(argv[1:])
        payload(a.out, a.ckpt, a.reference, [m for m in a.modes.split(",") if m], a.rows, a.frames)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="append", help=f"QEMU CPU model (repeatable; default {' and '.join(CPUS)})")
    p.add_argument("--work", type=Path, help="working folder (default: a new temporary one)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--quick", action="store_true", help="the pytest variant: fewer frames, codec path forced")
    p.add_argument("--pytest", action="store_true", help=f"also run {', '.join(PYTEST_FILES)} under emulation")
    a = p.parse_args(argv)
    if not qemu():
        print(f"{QEMU} not found: apt-get install qemu-user (QEMU >= 7.2 emulates AVX2)")
        return 2
    work = a.work or Path(tempfile.mkdtemp(prefix="emulated-cpu-"))
    cpus = a.cpu or list(CPUS)
    results = check(cpus, work, [m for m in a.modes.split(",") if m], quick=a.quick)
    print(report(results, work))
    bad = any(rc or not all(ok for _, ok, _ in checks) for rc, _, checks in results.values())
    if a.pytest:
        for cpu in cpus:
            t0 = time.perf_counter()
            rc, out = run_pytest(cpu, PYTEST_FILES, work / "cache", 3600)
            print(f"\n## pytest under -cpu {cpu}: exit {rc} ({time.perf_counter() - t0:.0f} s, emulated)\n{out}")
            bad |= rc != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
