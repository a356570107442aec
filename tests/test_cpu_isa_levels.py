"""The CPU level our kernels run at (tts_engine/cpu/cpu_ext.py `level`, cpu_ext.cpp `level_of_cpu`), and the lower
levels forced on this CPU (`TTS_CPU_ISA`, `cpu_ext.set_level`):

- the level follows cpuid; TTS_CPU_ISA (and the older TTS_CPU_EXT_ISA=avx2) lowers it, never raises it, and every
  library that includes cpu_ext.cpp (the fused step's too) and every kernel (W8A8 / W4A8 path, the fused step's bf16
  matmul path, SnakeBeta, the codec's quant_u8) follows it;
- at every level this CPU can run, the W8A8 and W4A8 layers give the same bits as at the native level (exact integer
  sums, the same fp32 epilogue), quant_u8 the same bits as at the native level and in its scalar loops, and a whole fused stack (W8A8, W4A8, bf16) gives what the native level gives up to
  the float summation order of its norms and attention (AVX-512 vs AVX2 vector widths) and, for bf16, one bf16
  rounding.

On an AVX2-only CPU only the avx2 level exists and the comparisons are with itself (they still run)."""
from __future__ import annotations

import copy

import pytest
import torch

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import fused_step
from tts_engine.cpu import kernels
from tts_engine.model.quant import int4_quantize

from test_cpu_ext_kernels import require_kernels
from test_fused_step import CFG, cos_rows, filled_cache, make_stack


@pytest.fixture
def levels():
    """The levels this CPU runs (1 .. cpuid's); afterwards the kernels are back at the level they ran at before."""
    require_kernels()
    fused_step.library()   # loaded, so that set_level reaches it too
    was = cpu_ext.level()
    yield list(range(1, cpu_ext.cpu_level() + 1))
    cpu_ext.set_level(was)


@pytest.fixture
def reload(levels, monkeypatch):
    """load(env) -> cpu_ext loaded afresh with these environment variables (as a new process would); afterwards the
    state before (and the library's level) is back."""
    saved = dict(cpu_ext._state)

    def load(**env):
        for k in (cpu_ext.LEVEL_ENV, cpu_ext.ISA_ENV):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        cpu_ext.reset()
        assert cpu_ext.available(), cpu_ext.why_unavailable()
        return cpu_ext
    yield load
    cpu_ext._state.clear()
    cpu_ext._state.update(saved)
    saved["lib"].ttsx_set_level(saved["level"])
    cpu_ext._sync_loaded()


def test_the_level_follows_cpuid_and_tts_cpu_isa_only_lowers_it(reload):
    from tts_engine.cpu import kernels

    flags = set(kernels.cpu_identity()["flags"])
    ext = reload()
    cpu = ext.cpu_level()
    want = (0 if not {"avx2", "fma"} <= flags else 1 if not {"avx512f", "avx512bw", "avx512vl"} <= flags
            else 2 if "avx512_vnni" not in flags else 3 if "avx512_bf16" not in flags else 4)
    assert cpu == want and ext.level() == cpu
    lib = fused_step.library()
    for name, lvl in [("avx2", 1), ("AVX512", 2), ("avx512-vnni", 3), ("avx512_bf16", 4), ("native", cpu),
                      ("no-such-cpu", cpu)]:
        ext = reload(TTS_CPU_ISA=name)
        got = min(lvl, cpu)
        assert ext.level() == got, name
        assert ext.isa() == ("avx512-vnni" if got >= 3 else "avx512bw" if got == 2 else "avx2"), name
        assert ext.has_w4a8()                                             # W4A8 at every level (AVX2 or VNNI)
        assert lib.ttsx_level() == got                                    # the fused step's library follows
        assert lib.ttsf_bf16_isa() == (3 if got == 4 else 2 if got >= 2 else 1), name
        ext.snake(torch.zeros(1, 1, 1), torch.ones(1), torch.ones(1))
        assert ext._state["snake_isa"] == (2 if got >= 2 else 1), name
        ext.quant_u8(torch.zeros(3))
        assert ext._state["quant_u8"] == (2 if got >= 2 else 1), name       # quant_u8's AVX-512 / AVX2 loops
        assert ext.tag().endswith(f"-forced-{ext.level_name()}") == (got < cpu), name   # a forced level: its own key
    assert reload(TTS_CPU_EXT_ISA="avx2").level() == 1                    # the older name
    assert reload(TTS_CPU_EXT_ISA="avx512").level() == cpu
    ext = reload()
    assert ext.set_level(1) == cpu and ext.level() == 1 and lib.ttsx_level() == 1
    assert ext.set_level(9) == 1 and ext.level() == cpu                   # never above cpuid


@torch.inference_mode()
def test_w8a8_and_w4a8_layers_give_the_same_bits_at_every_level(levels):
    g = torch.Generator().manual_seed(5)
    cases = []
    for N, K in [(37, 64), (256, 1024), (1040, 192)]:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        s127 = torch.rand(N, generator=g) * 1e-4
        q4, sz = int4_quantize(torch.randn(N, K, generator=g) * 0.05, 64)
        xs = [(torch.randn(M, K, generator=g) * 3).to(dt) for M in (1, 2, 3, 5, 9) for dt in (torch.float32, torch.bfloat16)]
        cases.append((N, cpu_ext.pack(q), s127, cpu_ext.pack4(q4, sz), xs))

    def outputs():
        return [(cpu_ext.w8a8(x, p8, s, N), cpu_ext.w4a8(x, p4, N)) for N, p8, s, p4, xs in cases for x in xs]
    cpu_ext.set_level(levels[-1])
    native = outputs()
    for lvl in levels:
        cpu_ext.set_level(lvl)
        for (a8, a4), (b8, b4) in zip(outputs(), native):
            assert torch.equal(a8, b8) and torch.equal(a4, b4), cpu_ext.level_name()


@torch.inference_mode()
def test_quant_u8_gives_the_same_bits_at_every_level_and_in_its_scalar_loops(levels):
    """cpu_ext.quant_u8 (the codec's int8 activations): its AVX-512 and AVX2 loops and the scalar reference give the
    same q, scale and zero point on fp32 and bf16 input: lengths with and without a vector tail, more than one
    thread chunk (2**16 values), all-negative, all-positive and all-zero tensors, values that land on exact halves
    of a step, a NaN (passed over by min/max, quantised to 0) and -0."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=g) * 3 + 0.5 for n in (1, 7, 8, 15, 16, 17, 31, 33, 1000, 3 * 65536 + 5)]
    xs += [-torch.rand(100, generator=g) - 0.1, torch.rand(70, generator=g) + 2, torch.zeros(40)]
    # a range of [-2, 2] (scale 4/255) and values on and one ulp beside the halves of its steps: where one rounding
    # (fma) and a product rounded before the add give other q
    mid = (torch.arange(-127, 128, dtype=torch.float32) + 0.5) * torch.tensor(4 / 255, dtype=torch.float32)
    xs.append(torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1), torch.tensor([-2.0, 2.0])]))
    nan_last = torch.randn(32, generator=g)
    nan_last[[15, 31]] = float("nan")                                    # in the last lane of every vector
    xs += [nan_last, torch.tensor([1.5, -0.0, -3.0, 4.0, float("nan")] * 5)]
    xs = [x.to(dt) for x in xs for dt in (torch.float32, torch.bfloat16)]

    def outputs():
        got = [cpu_ext.quant_u8(x) for x in xs]
        assert all(r is not None for r in got)
        return got
    cpu_ext.set_level(levels[-1])
    native = outputs()
    cpu_ext._state["quant_u8"] = 0                                        # the scalar loops (set_level forgets it)
    scalar = outputs()
    paths = set()
    for lvl in levels:
        cpu_ext.set_level(lvl)
        for x, a, b, c in zip(xs, outputs(), native, scalar):
            for o in (b, c):
                assert torch.equal(a[0], o[0]) and a[1:] == o[1:], (cpu_ext.level_name(), x.dtype, x.numel())
        paths.add(cpu_ext._state["quant_u8"])
    assert paths == ({1, 2} if levels[-1] >= 2 else {1})
    q, s, zp = native[-2]                                                 # a NaN row: the others' range, NaN -> 0
    assert s == pytest.approx(7 / 255) and zp == 109 and int(q[4]) == 0 and int(q[0]) == 109 + round(1.5 * 255 / 7)


def test_a_path_above_the_level_runs_the_levels_own(levels):
    """W8A8 / W4A8 paths (cpu_ext.ISA_NAMES: 1 AVX2, 3 AVX-512 without VNNI, 2 VNNI; ranked 1 < 3 < 2): a call that
    asks for a path the level lacks (or for none) runs the level's own, never one above it (a SIGILL on a CPU
    without it)."""
    lib = cpu_ext.library()
    own = {1: 1, 2: 3, 3: 2, 4: 2}
    for lvl in levels:
        cpu_ext.set_level(lvl)
        top = own[lvl]
        assert lib.ttsx_isa() == top and cpu_ext.isa() == cpu_ext.ISA_NAMES[top]
        rank = {1: 1, 3: 2, 2: 3}
        for asked in (0, 1, 2, 3, 7):
            want = asked if asked in rank and rank[asked] <= rank[top] else top
            assert lib.ttsx_isa_clamp(asked) == want, (lvl, asked)


@torch.inference_mode()
def test_every_w8a8_and_w4a8_path_gives_the_vnni_bits(levels):
    """At the native level every path this CPU runs (AVX2, AVX-512 without VNNI, VNNI) gives the same outputs and
    the same exact int32 sums: row counts across the kernels' row groups (1-8 rows per pass, 9 and 17 in several),
    K not a multiple of 64 (W8A8), extreme weights (+-127) and activations (a zero row, one huge value)."""
    cpu_ext.set_level(levels[-1])
    paths = [p for p in (2, 3, 1) if cpu_ext.library().ttsx_isa_clamp(p) == p]
    g = torch.Generator().manual_seed(11)
    for N, K in [(37, 64), (48, 80), (1040, 192), (768, 1024)]:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        q[0], q[1, ::2], q[1, 1::2] = 127, -127, 127
        s127 = torch.rand(N, generator=g) * 1e-4
        p8 = cpu_ext.pack(q)
        p4 = None
        if K % 64 == 0:
            q4, sz = int4_quantize(torch.randn(N, K, generator=g) * 0.05, 64)
            p4 = cpu_ext.pack4(q4, sz)
        for M in (1, 2, 3, 4, 5, 8, 9, 17):
            for dt in (torch.float32, torch.bfloat16):
                x = (torch.randn(M, K, generator=g) * 3).to(dt)
                if M >= 3:
                    x[1] = 0
                    x[2, 5] = 1e4
                outs = {}
                for path in paths:
                    acc = torch.zeros(M, N, dtype=torch.int32)
                    y8 = cpu_ext.w8a8(x, p8, s127, N, acc=acc, path=path)
                    outs[path] = (y8, acc, None if p4 is None else cpu_ext.w4a8(x, p4, N, path=path))
                ref = outs[paths[0]]
                xq, _ = kernels.quantize_rows(x)   # the exact sums, independently of any path of ours
                assert torch.equal(ref[1].long(), xq.long() @ q.long().t()), (N, K, M, dt)
                for path in paths[1:]:
                    got = outs[path]
                    assert torch.equal(got[0], ref[0]), (cpu_ext.ISA_NAMES[path], N, K, M, dt)
                    assert torch.equal(got[1], ref[1]), (cpu_ext.ISA_NAMES[path], N, K, M, dt)
                    if p4 is not None:
                        assert torch.equal(got[2], ref[2]), (cpu_ext.ISA_NAMES[path], N, K, M, dt)


@pytest.mark.parametrize("mode,dtype", [("w8a8", torch.float32), ("w4a8", torch.bfloat16), ("bf16", torch.bfloat16)])
@torch.inference_mode()
def test_a_fused_stack_at_every_level_matches_the_native_one(levels, own_kernels, mode, dtype):
    stack = make_stack(mode, dtype)
    base = filled_cache(stack, dtype)
    x = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    rows, pos = torch.tensor([0, 1, 2]), torch.tensor([12, 12, 5])
    got = {}
    for lvl in reversed(levels):
        cpu_ext.set_level(lvl)
        plan = fused_step.StackPlan(stack)   # the plan takes the level's matmul path
        c = copy.deepcopy(base)
        got[lvl] = (plan.run(x, c, rows, pos).float(), c.k.float(), c.v.float())
    for lvl, outs in got.items():
        for a, b in zip(outs, got[levels[-1]]):
            if dtype == torch.float32:   # float summation order of the norms and the attention (vector widths)
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            else:                        # and bf16 outputs: equal, or one bf16 rounding apart
                torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)
                assert (a == b).float().mean() > 0.97, lvl
        assert cos_rows(outs[0], got[levels[-1]][0]).min() > 0.9999, lvl
