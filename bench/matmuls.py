"""`python -m bench matmuls int8,w8a8[,int4,bf16] [ROUNDS]`: one frame's matmuls of the real 0.6B
architecture (random weights) in each mode, interleaved A, B, A, B... in one process, one input row, in model
order as ModelRunner runs them (the talker's linear layers once, the code predictor's and one lm_head 15 times,
under the runner's oneDNN switch for bf16 rows). Prints the min and median ms per frame of each mode: the part of
the frame the kernel choice decides, without the rest of the engine. Loads one model per mode (~1 GB each).

`python -m bench matmuls gbps [ROUNDS] [ROWS[,ROWS...]] [--base DIR]`: the int8 kernels alone, in GB/s
of weight read: the talker's per-layer shapes (fused q/k/v, o, fused gate/up, down) x 28 layers of random int8
weights (~430 MB, more than any L3), one call each, ROWS input rows (default 1; several streams decode several rows),
candidates interleaved round by round: the plain read (the floor, `common.PlainRead`), a read of the same weights,
`_weight_int8pack_mm` (the int8 mode), the W8A8 mode through `_int_mm` (`kernels.w8a8_int_mm`, quantising included)
and our own fused kernel (`kernels.w8a8_vnni`), with its lower code paths where this CPU runs a higher one
(`w8a8_own_avx512bw_path`: AVX-512 without VNNI, `w8a8_own_avx2_path`: AVX2; the same bits). `--base DIR`: also another checkout's cpu_ext.cpp (same layout),
built beside ours, its W8A8 and W4A8 calls interleaved with ours (an A/B of the kernel source). `TTS_THREADS`
sets the threads (default 2).

`python -m bench matmuls levels [ROUNDS] [ROWS] [LAYERS]`: our kernels (plain read, W8A8, W4A8, the fused step's
bf16 matmul) at every CPU level this CPU runs (TTS_CPU_ISA's levels: avx2, avx512, avx512vnni, avx512bf16), levels
interleaved, GB/s over weights rotated over > 300 MB (`levels`; LAYERS 1: ~16 MB of weights, served from the L3:
each path's compute ceiling, which a busy machine's memory contention does not hide).

`python -m bench matmuls share [ROUNDS] [ROWS[,ROWS...]] [LAYERS]`: our W8A8 and W4A8 calls with their output
blocks split in fixed halves and claimed (`cpu_ext.set_share`: each thread its own part in order, then what is left
of the other's) at every CPU level this CPU runs, the talker's per-layer shapes x LAYERS (default 28: weights far
beyond the L3), interleaved with the plain read (`common.PlainRead`); GB/s best (median) and % of the plain read's
median in the same rounds (`share`).

`python -m bench matmuls ceilings [ROUNDS]`: each kernel's compute ceiling per level, weights resident in L2,
1 and 4 rows, one thread (`ceilings`).

`python -m bench matmuls quant_u8 [ROUNDS] [--base DIR]`: the codec's int8 activation quantisation
(`cpu_ext.quant_u8`, two passes over the input) on fp32 and bf16 inputs of codec sizes, each of its loops (AVX-512,
AVX2, scalar: those this CPU runs) and with --base another checkout's (DIR/tts_engine/cpu/csrc/cpu_ext.cpp), all
interleaved round by round; best and median us per call (`quant_u8_ab`)."""
from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

from bench.common import PlainRead, device_name, load1, random_checkpoint
from tts_engine.cpu.backend import aten_bf16_gemv
from tts_engine.loader import Qwen3TTSModel
from tts_engine.model import quant

LINEARS = (nn.Linear, quant.Int8Linear, quant.W8A8Linear, quant.Int4Linear, quant.W4A8Linear)


def frame_calls(talker) -> list[nn.Module]:
    lin = lambda root: [m for m in root.modules() if isinstance(m, LINEARS)]   # noqa: E731
    cp = talker.code_predictor
    return lin(talker.model.layers) + [talker.codec_head] + [
        m for step in range(cp.lm_head.__len__()) for m in lin(cp.model.layers) + [cp.lm_head[step]]]


def sweep(calls: list[nn.Module], xs: dict) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode(), aten_bf16_gemv(True):
        for m in calls:
            m(xs.setdefault(m.in_features, torch.randn(1, m.in_features, dtype=torch.bfloat16)))
    return time.perf_counter() - t0


def gbps(rounds: int = 7, rows_list=(1,), base: str | None = None) -> None:
    for rows in rows_list:
        _gbps(rounds, rows, base)


def _base_source(base: str):
    """Another checkout's cpu_ext.cpp: tts_engine/cpu/csrc/ (tts_engine/model/ in checkouts before the move)."""
    from pathlib import Path

    new = Path(base) / "tts_engine" / "cpu" / "csrc" / "cpu_ext.cpp"
    return new if new.exists() else Path(base) / "tts_engine" / "model" / "cpu_ext.cpp"


def _with_lib(lib, f):
    """f() with cpu_ext's calls going to `lib` (another build of the same layout)."""
    from tts_engine.cpu import cpu_ext

    def run():
        with cpu_ext.calls_to(lib):
            return f()
    return run


def _gbps(rounds: int, rows: int, base: str | None) -> None:
    from tts_engine.cpu import cpu_ext
    from tts_engine.cpu import kernels

    D, Dq, Dkv, inter, layers = 1024, 2048, 1024, 3072, 28        # the 0.6B talker
    shapes = [(Dq + 2 * Dkv, D), (D, Dq), (2 * inter, D), (D, inter)] * layers
    g = torch.Generator().manual_seed(0)
    W = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for n, k in shapes]
    S = [torch.rand(n, generator=g) * 1e-4 for n, _ in shapes]
    SB = [s.to(torch.bfloat16) for s in S]
    xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}
    total = sum(w.numel() for w in W)
    cands = {"int8pack": lambda: [torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]], w, s) for w, s in zip(W, SB)],
             "w8a8_int_mm": lambda: [kernels.w8a8_int_mm(xs[w.shape[1]], w, s) for w, s in zip(W, S)]}
    if cpu_ext.available():
        P = [cpu_ext.pack(w) for w in W]
        pr = PlainRead()
        cands = {"plain read": pr.read_once, "read of the same weights": lambda: [cpu_ext.read_bytes(w) for w in W],
                 **cands,
                 "w8a8_vnni": lambda: [kernels.w8a8_vnni(xs[w.shape[1]], p, s) for w, p, s in zip(W, P, S)]}
        lower = {"avx512-vnni": (3, 1), "avx512bw": (1,)}.get(cpu_ext.isa(), ())   # cpu_ext.ISA_NAMES
        for path in lower:   # the lower code paths of the same kernel (what a CPU without VNNI / AVX-512 runs)
            cands[f"w8a8_own_{cpu_ext.ISA_NAMES[path]}_path"] = \
                lambda path=path: [cpu_ext.w8a8(xs[w.shape[1]], p, s, s.numel(), path=path) for w, p, s in zip(W, P, S)]
    else:
        print(f"own kernels not available: {cpu_ext.why_unavailable()}")
    base_lib = None
    if base and cpu_ext.available():
        base_lib = cpu_ext.load_library(_base_source(base))
        cands["w8a8_vnni (base)"] = _with_lib(base_lib, cands["w8a8_vnni"])
    # int4 (the same shapes; GB/s of the int4 bytes and scales each kernel reads): aten's int4pack, our W4A8
    q4 = [torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g) for n, k in shapes]
    sz = [torch.rand(k // 64, n, 2, generator=g).to(torch.bfloat16) for n, k in shapes]
    A4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, quant.INT4_INNER_K_TILES) for q in q4]
    bytes4 = sum(a.numel() * a.element_size() + s.numel() * 2 for a, s in zip(A4, sz))
    cands["int4pack (int4)"] = lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], a, 64, s)
                                        for (_, k), a, s in zip(shapes, A4, sz)]
    if cpu_ext.has_w4a8():
        P4 = [cpu_ext.pack4(q, s) for q, s in zip(q4, sz)]
        cands["w4a8_vnni (int4)"] = lambda: [kernels.w4a8_vnni(xs[k], p, n) for (n, k), p in zip(shapes, P4)]
        if base_lib is not None:
            cands["w4a8_vnni (int4, base)"] = _with_lib(base_lib, cands["w4a8_vnni (int4)"])
    del q4
    times = {n: [] for n in cands}
    with torch.inference_mode():
        for _ in range(rounds):
            for n, f in cands.items():
                t0 = time.perf_counter()
                f()
                times[n].append(time.perf_counter() - t0)
    print(f"own kernels: {cpu_ext.isa()}")
    print(f"{device_name(torch.device('cpu'))}, load average {load1():.1f}, {rounds} rounds, "
          f"{rows} row(s), {total / 1e6:.0f} MB of int8 weights rotated ({len(W)} matmuls)")
    for n, v in times.items():
        v, b = sorted(v), (bytes4 if "int4" in n else pr.nbytes if n == "plain read" else total)
        print(f"{n}: best {b / v[0] / 1e9:.1f} GB/s, median {b / v[len(v) // 2] / 1e9:.1f} GB/s, "
              f"best {1e3 * v[0]:.1f} ms")


def levels(rounds: int = 7, rows: int = 1, layers: int = 28) -> list[str]:
    """Our kernels at every CPU level this CPU runs (`cpu_ext.set_level`, as TTS_CPU_ISA forces it), interleaved
    level by level within each round: per level the plain read, W8A8, W4A8 and the fused step's bf16 matmul on the
    0.6B talker's shapes x `layers` layers (int8 ~430 MB, int4 ~250 MB, bf16 (half the layers) ~440 MB: each more
    than any L3), `rows` input rows, one call per weight. GB/s of the bytes each kernel reads (best and median of
    `rounds`). A forced level runs that level's code on THIS CPU (its memory system, its core): the AVX2 row on a Zen 4
    is our AVX2 code on a Zen 4, not a Haswell's figure. -> the table's lines (also printed)."""
    from tts_engine.cpu import cpu_ext
    from tts_engine.cpu import fused_step
    from tts_engine.cpu import kernels
    from tts_engine.model.quant import INT4_GROUP

    if not cpu_ext.available():
        print(f"own kernels not available: {cpu_ext.why_unavailable()}")
        return []
    lib16 = fused_step.library()
    D, Dq, Dkv, inter = 1024, 2048, 1024, 3072        # the 0.6B talker
    shapes = [(Dq + 2 * Dkv, D), (D, Dq), (2 * inter, D), (D, inter)] * layers
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}
    xf = {k: v.float() for k, v in xs.items()}
    P8, S8, P4, W16 = [], [], [], []
    for i, (n, k) in enumerate(shapes):
        P8.append(cpu_ext.pack(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)))
        S8.append(torch.rand(n, generator=g) * 1e-4)
        q4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        P4.append(cpu_ext.pack4(q4, torch.rand(k // INT4_GROUP, n, 2, generator=g).to(torch.bfloat16)))
        if i < len(shapes) // 2:
            W16.append(torch.randn(n, k, generator=g).to(torch.bfloat16))
    pr = PlainRead()
    nbytes = {"plain read": pr.nbytes, "w8a8": sum(p.numel() for p in P8), "w4a8": sum(p.numel() for p in P4),
              "bf16": sum(w.numel() * 2 for w in W16)}
    calls = {"plain read": pr.read_once,   # at each level: cpu_ext's reader follows it (AVX2 loads at avx2)
             "w8a8": lambda: [kernels.w8a8_vnni(xs[p_k], p, s) for p, s, p_k in zip(P8, S8, (k for _, k in shapes))],
             "w4a8": lambda: [cpu_ext.w4a8(xs[k], p, n) for (n, k), p in zip(shapes, P4)],
             "bf16": lambda: [fused_step.bf16_matmul(w, xf[w.shape[1]], lib16.ttsf_bf16_isa()) for w in W16]}
    was = cpu_ext.level()
    lvls = list(range(1, cpu_ext.cpu_level() + 1))
    times = {(lv, n): [] for lv in lvls for n in calls}
    paths = {}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for lv in lvls:
                    cpu_ext.set_level(lv)
                    paths[lv] = (cpu_ext.isa(), lib16.ttsf_bf16_isa())
                    for n, f in calls.items():
                        t0 = time.perf_counter()
                        f()
                        times[(lv, n)].append(time.perf_counter() - t0)
    finally:
        cpu_ext.set_level(was)
    bf16_names = {3: "avx512-bf16", 2: "avx512f", 1: "avx2"}
    lines = [f"{device_name(torch.device('cpu'))}; torch threads {torch.get_num_threads()}; load average "
             f"{load1():.1f}; {rounds} rounds, {rows} row(s), levels interleaved; GB/s best (median)",
             "| level (TTS_CPU_ISA) | W8A8/W4A8 path | bf16 path | plain read | W8A8 | W4A8 | bf16 |", "|---|---|---|---|---|---|---|"]
    for lv in lvls:
        cells = []
        for n in calls:
            v = sorted(times[(lv, n)])
            cells.append(f"{nbytes[n] / v[0] / 1e9:.1f} ({nbytes[n] / v[len(v) // 2] / 1e9:.1f})")
        lines.append(f"| {cpu_ext.LEVEL_NAMES[lv]}{' (native)' if lv == lvls[-1] else ''} | {paths[lv][0]} | "
                     f"{bf16_names.get(paths[lv][1], paths[lv][1])} | " + " | ".join(cells) + " |")
    lines.append("bytes per sweep: " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in nbytes.items()))
    print("\n".join(lines))
    return lines


def share(rounds: int = 7, rows_list=(1, 4), layers: int = 28) -> list[str]:
    """`share` (module doc) -> the table's lines (also printed)."""
    import statistics

    from tts_engine.cpu import cpu_ext
    from tts_engine.model.quant import INT4_GROUP

    if not cpu_ext.available():
        print(f"own kernels not available: {cpu_ext.why_unavailable()}")
        return []
    D, Dq, Dkv, inter = 1024, 2048, 1024, 3072        # the 0.6B talker (the code predictor's layers are the same)
    shapes = [(Dq + 2 * Dkv, D), (D, Dq), (2 * inter, D), (D, inter)] * layers
    g = torch.Generator().manual_seed(0)
    P8, S8, P4 = [], [], []
    for n, k in shapes:
        P8.append(cpu_ext.pack(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)))
        S8.append(torch.rand(n, generator=g) * 1e-4)
        q4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        P4.append(cpu_ext.pack4(q4, torch.rand(k // INT4_GROUP, n, 2, generator=g).to(torch.bfloat16)))
    pr = PlainRead()
    nbytes = {"w8a8": sum(p.numel() for p in P8), "w4a8": sum(p.numel() for p in P4)}
    lvls = list(range(1, cpu_ext.cpu_level() + 1))
    was_level, was_share = cpu_ext.level(), cpu_ext.share()
    times: dict = {}
    reads = []
    try:
        with torch.inference_mode():
            for rows in rows_list:
                xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}
                calls = {"w8a8": lambda: [cpu_ext.w8a8(xs[k], p, s, n) for (n, k), p, s in zip(shapes, P8, S8)],
                         "w4a8": lambda: [cpu_ext.w4a8(xs[k], p, n) for (n, k), p in zip(shapes, P4)]}
                for r in range(rounds):
                    for lv in lvls:
                        cpu_ext.set_level(lv)
                        for name, f in calls.items():
                            modes = ("split", "claim") if (r + lv) % 2 == 0 else ("claim", "split")
                            for mode in modes:
                                cpu_ext.set_share(mode)
                                t0 = time.perf_counter()
                                f()
                                times.setdefault((rows, lv, name, mode), []).append(time.perf_counter() - t0)
                    cpu_ext.set_level(was_level)
                    reads.append(pr.sample())
    finally:
        cpu_ext.set_level(was_level)
        cpu_ext.set_share(was_share)
    floor = statistics.median(reads)
    lines = [f"{device_name(torch.device('cpu'))}; torch threads {torch.get_num_threads()}; load average "
             f"{load1():.1f}; {rounds} rounds, levels, modes and the plain read interleaved; plain read "
             f"{floor:.1f} GB/s median ({min(reads):.1f}-{max(reads):.1f}); GB/s best (median), % of the plain read's "
             f"median; `python -m bench matmuls share {rounds} {','.join(map(str, rows_list))} {layers}`",
             "", "| rows | level | W8A8 split | W8A8 claim | W4A8 split | W4A8 claim |", "|---|---|---|---|---|---|"]
    for rows in rows_list:
        for lv in lvls:
            cells = []
            for name in ("w8a8", "w4a8"):
                for mode in ("split", "claim"):
                    v = sorted(times[(rows, lv, name, mode)])
                    best, med = nbytes[name] / v[0] / 1e9, nbytes[name] / v[len(v) // 2] / 1e9
                    cells.append(f"{best:.1f} ({med:.1f}) {100 * med / floor:.0f} %")
            lines.append(f"| {rows} | {cpu_ext.LEVEL_NAMES[lv]} | " + " | ".join(cells) + " |")
    lines.append("bytes per sweep: " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in nbytes.items()))
    print("\n".join(lines))
    return lines


def ceilings(rounds: int = 5, calls: int = 200) -> list[str]:
    """Each kernel's compute ceiling at every CPU level this CPU runs: weights resident in L2 (int8 768 x 1024,
    int4 1024 x 1024, bf16 384 x 1024; a core's private cache, so neither memory nor another process's L3 traffic
    hides the compute), 1 and 4 rows, best of `rounds` x `calls` calls; GB/s raw and net of a tiny call's fixed
    cost (wrapper, ctypes, parallel_for; the fused step calls the kernels from C++ without it). Run it with
    TTS_THREADS=1 (one core's ceiling). -> the table's lines (also printed)."""
    from tts_engine.cpu import cpu_ext
    from tts_engine.cpu import fused_step
    from tts_engine.model.quant import int4_quantize

    if not cpu_ext.available():
        print(f"own kernels not available: {cpu_ext.why_unavailable()}")
        return []
    g = torch.Generator().manual_seed(0)
    K = 1024
    lib = fused_step.library()

    def weights(n8, n4, n16):
        q4, sz = int4_quantize(torch.randn(n4, K, generator=g), 64)
        return {"w8a8": (n8, cpu_ext.pack(torch.randint(-127, 128, (n8, K), dtype=torch.int8, generator=g)),
                         torch.rand(n8, generator=g) * 1e-4),
                "w4a8": (n4, cpu_ext.pack4(q4, sz)), "bf16": (n16, torch.randn(n16, K, generator=g).bfloat16())}
    big, tiny = weights(768, 1024, 384), weights(16, 16, 8)

    def call(name, w, x, xf):
        if name == "w8a8":
            return lambda: cpu_ext.w8a8(x, w[1], w[2], w[0])
        if name == "w4a8":
            return lambda: cpu_ext.w4a8(x, w[1], w[0])
        return lambda: fused_step.bf16_matmul(w[1], xf, lib.ttsf_bf16_isa())
    nbytes = {n: w[1].numel() * w[1].element_size() for n, w in big.items()}
    lvls = list(range(1, cpu_ext.cpu_level() + 1))
    best: dict = {}
    was = cpu_ext.level()
    try:
        with torch.inference_mode():
            for rows in (1, 4):
                x = torch.randn(rows, K, generator=g).bfloat16()
                xf = x.float()
                for _ in range(rounds):
                    for lv in lvls:
                        cpu_ext.set_level(lv)
                        for n in big:
                            for which, ws in (("big", big), ("tiny", tiny)):
                                f = call(n, ws[n], x, xf)
                                for _ in range(calls):
                                    t0 = time.perf_counter()
                                    f()
                                    t = time.perf_counter() - t0
                                    k = (rows, lv, n, which)
                                    best[k] = min(best.get(k, 1e9), t)
    finally:
        cpu_ext.set_level(was)
    lines = [f"{device_name(torch.device('cpu'))}; load average {load1():.1f}; weights in L2; GB/s "
             f"raw (net of a tiny call's cost), best of {rounds} x {calls} calls",
             "| level | W8A8 1 row | W4A8 1 row | bf16 1 row | W8A8 4 rows | W4A8 4 rows | bf16 4 rows |",
             "|---|---|---|---|---|---|---|"]
    for lv in lvls:
        cells = []
        for rows in (1, 4):
            for n in big:
                b, t = best[(rows, lv, n, "big")], best[(rows, lv, n, "tiny")]
                cells.append(f"{nbytes[n] / b / 1e9:.1f} ({nbytes[n] / max(b - t, 1e-9) / 1e9:.1f})")
        lines.append(f"| {cpu_ext.LEVEL_NAMES[lv]} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return lines


def quant_u8_ab(rounds: int = 15, base: str | None = None) -> list[str]:
    """`quant_u8` (module doc): {(label, dtype, n): [seconds per call]} over interleaved rounds -> table lines."""
    import ctypes
    import statistics

    from tts_engine.cpu import cpu_ext

    if not cpu_ext.available():
        print(f"own kernels not available: {cpu_ext.why_unavailable()}")
        return []
    libs = {"": cpu_ext.library()}
    if base:
        libs[" (base)"] = cpu_ext.load_library(_base_source(base))
    for lib in libs.values():
        P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.ttsx_quant_u8.argtypes, lib.ttsx_quant_u8.restype = [P, I, I64, P, P, I], None
    paths = {"avx512": 2, "avx2": 1, "scalar": 0} if cpu_ext.level() >= 2 else {"avx2": 1, "scalar": 0}
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(n, generator=g) * 2).to(dt) for n in (1024 * 64, 1024 * 1400) for dt in (torch.float32,
                                                                                                   torch.bfloat16)]
    out = torch.empty(2)
    cands = {f"{p}{tag}": (lib, isa) for tag, lib in libs.items() for p, isa in paths.items()
             if not (tag and isa == 0)}   # (a base's scalar loops: its avx2 row, where it has no AVX2 loops)
    times: dict = {}
    for r in range(rounds):
        for name, (lib, isa) in (list(cands.items()) if r % 2 == 0 else list(cands.items())[::-1]):
            for x in inputs:
                q = torch.empty(x.numel(), dtype=torch.uint8)
                reps = 20 if x.numel() < 1 << 20 else 3
                t0 = time.perf_counter()
                for _ in range(reps):
                    lib.ttsx_quant_u8(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel(), q.data_ptr(),
                                      out.data_ptr(), isa)
                times.setdefault((name, x.dtype, x.numel()), []).append((time.perf_counter() - t0) / reps)
    cols = [(x.dtype, x.numel()) for x in inputs]
    lines = [f"cpu_ext.quant_u8, {device_name(torch.device('cpu'))}, "
             f"load average {load1():.2f}; {rounds} rounds interleaved; us per call, best (median)", "",
             "| loops | " + " | ".join(f"{str(d).split('.')[-1]} {n / 1e6:.2f} M" for d, n in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for name in cands:
        cells = [f"{1e6 * min(times[(name, d, n)]):.0f} ({1e6 * statistics.median(times[(name, d, n)]):.0f})"
                 for d, n in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    base = None   # --base DIR (gbps, quant_u8): another checkout's cpu_ext.cpp beside ours
    if "--base" in argv:
        i = argv.index("--base")
        base, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if argv and argv[0] == "quant_u8":
        torch.set_num_threads(int(os.environ.get("TTS_THREADS", "2")))
        quant_u8_ab(int(argv[1]) if len(argv) > 1 else 15, base)
        return 0
    if argv and argv[0] == "share":
        torch.set_num_threads(int(os.environ.get("TTS_THREADS", "2")))
        share(int(argv[1]) if len(argv) > 1 else 7,
              tuple(int(r) for r in argv[2].split(",")) if len(argv) > 2 else (1, 4),
              int(argv[3]) if len(argv) > 3 else 28)
        return 0
    if argv and argv[0] == "ceilings":
        torch.set_num_threads(int(os.environ.get("TTS_THREADS", "1")))
        ceilings(int(argv[1]) if len(argv) > 1 else 5)
        return 0
    if argv and argv[0] == "levels":
        torch.set_num_threads(int(os.environ.get("TTS_THREADS", "2")))
        levels(int(argv[1]) if len(argv) > 1 else 7, int(argv[2]) if len(argv) > 2 else 1,
               int(argv[3]) if len(argv) > 3 else 28)
        return 0
    if argv and argv[0] == "gbps":
        torch.set_num_threads(int(os.environ.get("TTS_THREADS", "2")))
        gbps(int(argv[1]) if len(argv) > 1 else 7,
             tuple(int(r) for r in argv[2].split(",")) if len(argv) > 2 else (1,), base)
        return 0
    modes = (argv[0] if argv else "int8,w8a8").split(",")
    rounds = int(argv[1]) if len(argv) > 1 else 7
    torch.set_num_threads(int(os.environ.get("TTS_THREADS", "2")))
    ck = random_checkpoint("0.6b", "custom_voice")
    calls = {}
    for m in modes:
        model = Qwen3TTSModel.from_pretrained(str(ck), device="cpu", dtype="bf16", quantize=None if m == "bf16" else m)
        model.talker.model.text_embedding = None   # not read here
        calls[m] = frame_calls(model.talker)
    xs: dict = {}
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            times[m].append(1e3 * sweep(calls[m], xs))
    from tts_engine.cpu import cpu_ext

    print(f"own kernels: {cpu_ext.isa()}")
    print(f"{device_name(torch.device('cpu'))}, load average {load1():.1f}, {rounds} rounds")
    for m in modes:
        v = sorted(times[m])
        print(f"{m}: {len(calls[m])} matmuls per frame, min {v[0]:.1f} ms, median {v[len(v) // 2]:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
