"""Our own CPU kernels (tts_engine/cpu/cpu_ext.py, cpu_ext.cpp): the fused W8A8 layer's int32 sums equal an exact
integer reference and its result equals the aten W8A8 path (`kernels.w8a8_int_mm`) for shapes that are and are not
multiples of the kernel's blocks, 1-9 decode rows (every row tile) and prefill rows; a W8A8 layer that runs it holds the packed
weight only; and when the kernels cannot be built or run, the engine keeps aten's kernels (nothing raises).

Where the CPU has AVX-512 VNNI and a C++ compiler is on PATH the kernels must build (a build failure fails here,
it is not skipped); elsewhere the kernel tests skip and the fallback tests still run."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
from torch import nn

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import kernels
from tts_engine.model.quant import W8A8Linear


def _cpu_has_vnni() -> bool:
    flags = set(kernels.cpu_identity()["flags"])
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags


EXPECTED = _cpu_has_vnni() and shutil.which("g++") is not None and cpu_ext.enabled()


def require(ok: bool, what: str, why: str) -> None:
    """Where `ok` is false: a failure where EXPECTED (this CPU has AVX-512 VNNI and g++ is here: `what` must run),
    else a skip."""
    if not ok:
        if EXPECTED:
            pytest.fail(f"this CPU has AVX-512 VNNI and g++ is here, but {what} failed: {why}")
        pytest.skip(f"{what} not available here: {why}")


def built(load, what: str):
    """load() -> a library that includes our kernels (fused step, predictor frame, talker step), or as `require`."""
    try:
        return load()
    except Exception as e:
        require(False, what, str(e))


def require_kernels() -> None:
    require(cpu_ext.available(), "our CPU kernels", cpu_ext.why_unavailable())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(kernels.TUNE_ENV, raising=False)
    monkeypatch.setattr(kernels, "ROTATE_MIN_BYTES", 4 << 20)
    monkeypatch.setattr(kernels, "ROTATE_MAX_BYTES", 4 << 20)
    kernels.reset_kernel_table()
    yield tmp_path
    kernels.reset_kernel_table()


@pytest.fixture
def ext():
    require_kernels()
    return cpu_ext


@pytest.fixture
def w4a8_ext(ext):
    """The W4A8 kernel (AVX-512 VNNI, or AVX2): wherever our kernels run."""
    if not ext.has_w4a8():
        if EXPECTED:
            pytest.fail(f"this CPU has AVX-512 VNNI, but the W4A8 kernel is not offered (path {ext.isa()})")
        pytest.skip(f"no W4A8 kernel on this CPU (our kernels' path: {ext.isa()})")
    return ext


@pytest.fixture
def fresh_state(cache):
    """cpu_ext forgets what it loaded (the next use tries again); afterwards the loaded library is back (no
    second compile) and the candidates are registered as before."""
    saved = dict(cpu_ext._state)
    cpu_ext.reset()
    yield
    cpu_ext._state.clear()
    cpu_ext._state.update(saved)
    if saved.get("lib") is not None:   # the library's own CPU level back to what the state says (a test may force one)
        saved["lib"].ttsx_set_level(saved["level"])
        cpu_ext._sync_loaded()
    kernels.register_cpu_ext()
    kernels.reset_kernel_table()


SHAPES = [(16, 16), (37, 50), (100, 200), (256, 1024), (1000, 1030)]   # N, K: block multiples and not


@pytest.mark.parametrize("N,K", SHAPES)
def test_sums_are_exact_and_the_result_is_the_aten_w8a8_path(ext, N, K):
    g = torch.Generator().manual_seed(N * 7 + K)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    q[0, :] = 127                                   # the extremes of the grid: the largest sums
    q[-1, :] = -127
    s127 = torch.rand(N, generator=g) * 1e-4
    packed = ext.pack(q)
    assert packed.numel() == ext.packed_bytes(N, K) and torch.equal(ext.unpack(packed, N, K), q)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 20):   # every row tile (1-8 rows per pass) and more passes
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows, K, generator=g) * 3).to(dtype)
            x[0, :] = x[0, :].abs()                   # a row whose every int8 value is >= 0: sums near the int32 top
            acc = torch.empty(rows, N, dtype=torch.int32)
            y = ext.w8a8(x, packed, s127, N, acc)
            xq, amax = kernels.quantize_rows(x)
            exact = xq.long() @ q.long().T          # int64: no rounding anywhere
            assert torch.equal(acc.long(), exact), (N, K, rows, dtype)
            assert y.dtype == dtype and y.shape == (rows, N)
            ref = kernels.w8a8_int_mm(x, q, s127).to(dtype)
            torch.testing.assert_close(y, ref, rtol=0, atol=0)   # the same float operations, in the same order


def test_the_candidate_runs_in_the_kernel_table(ext, cache):
    assert kernels.register_cpu_ext() == ext.tag() and "vnni" in kernels.FORMATS["w8a8"].candidates
    assert kernels.machine_key()["cpu_ext"] == ext.tag()
    times = kernels.time_candidates("w8a8", 96, 160, 1)
    assert set(times) == set(kernels.FORMATS["w8a8"].candidates) and times["vnni"] > 0


def test_a_w8a8_layer_on_the_vnni_kernel_holds_only_the_packed_weight(ext, cache):
    torch.manual_seed(3)
    lin = nn.Linear(200, 70, bias=True)
    t = kernels.kernel_table()
    for b in kernels.ROW_BUCKETS:
        t.entries[t.entry_key("w8a8", 70, 200, b)] = {"winner": "vnni", "us": {}}
    own = W8A8Linear(lin, t)
    assert own.kernel_names == {1: "vnni", 4: "vnni"} and own.qweight is None and own.packed is not None
    for b in kernels.ROW_BUCKETS:
        t.entries[t.entry_key("w8a8", 70, 200, b)] = {"winner": "int_mm", "us": {}}
    aten = W8A8Linear(lin, t)
    assert aten.packed is None and torch.equal(own.int8_weight(), aten.qweight)
    torch.testing.assert_close(own.dequantized(), aten.dequantized(), rtol=0, atol=0)
    for rows in (1, 3, 40):                           # decode buckets and a prefill
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, rows, 200).to(dtype)
            torch.testing.assert_close(own(x), aten(x), rtol=0, atol=0)
    if "own_avx2" in kernels.FORMATS["w8a8"].candidates:   # the AVX2 path, timed beside VNNI on a VNNI CPU
        for b in kernels.ROW_BUCKETS:
            t.entries[t.entry_key("w8a8", 70, 200, b)] = {"winner": "own_avx2", "us": {}}
        avx2 = W8A8Linear(lin, t)
        assert avx2.qweight is None and avx2.kernel_names == {1: "own_avx2", 4: "own_avx2"}
        for rows in (1, 3):
            x = torch.randn(rows, 200).to(torch.bfloat16)
            torch.testing.assert_close(avx2(x), aten(x), rtol=0, atol=0)
    # mixed: one bucket on each kernel -> both layouts held, each bucket runs its own
    t.entries[t.entry_key("w8a8", 70, 200, 1)] = {"winner": "vnni", "us": {}}
    t.entries[t.entry_key("w8a8", 70, 200, 4)] = {"winner": "int_mm", "us": {}}
    mixed = W8A8Linear(lin, t)
    assert mixed.packed is not None and mixed.qweight is not None
    x = torch.randn(1, 200)
    torch.testing.assert_close(mixed(x), aten(x), rtol=0, atol=0)


def test_no_compiler_leaves_the_aten_kernels(fresh_state, monkeypatch, caplog):
    """The build fails (no compiler, a compile error): one logged line, no candidate, W8A8 layers on aten's
    kernels, and the kernel table's machine key says so (a table measured with the kernels is not reused)."""
    def no_compiler(force=False):
        raise RuntimeError("no C++ compiler (g++) on PATH")

    monkeypatch.setattr(cpu_ext, "build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        assert not cpu_ext.available() and not cpu_ext.available()
    assert sum("own CPU kernels not used" in r.message for r in caplog.records) == 1
    assert "no C++ compiler" in cpu_ext.why_unavailable()
    kernels.reset_kernel_table()
    t = kernels.kernel_table()
    assert t.key["cpu_ext"] is None and not set(kernels.OWN_PACKED) & set(kernels.FORMATS["w8a8"].candidates)
    t.ensure("w8a8", [(48, 64)])
    assert set(t.lookup("w8a8", 48, 64, 1)["us"]) == {"int_mm", "int8pack_a8"}
    lin = nn.Linear(64, 48)
    layer = W8A8Linear(lin)
    assert layer.packed is None and layer.qweight is not None and "vnni" not in layer.kernel_names.values()
    x = torch.randn(3, 64)
    y = layer(x)
    assert torch.isfinite(y).all() and ((y - lin(x)).norm() / lin(x).norm()).item() < 0.02


def test_a_compile_error_is_caught(fresh_state, monkeypatch, tmp_path):
    """A real compiler run on a broken source: `available()` is False with the compiler's message, no raise."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_ext, "LIBRARY", bad)
    assert not cpu_ext.available()
    why = cpu_ext.why_unavailable()
    assert why and ("failed" in why or "no C++ compiler" in why or "x86-64 Linux only" in why)


def test_switched_off_by_environment(fresh_state, monkeypatch):
    monkeypatch.setenv(cpu_ext.ENABLE_ENV, "0")
    assert not cpu_ext.available() and cpu_ext.why_unavailable() == f"{cpu_ext.ENABLE_ENV}=0"
    assert kernels.register_cpu_ext() is None and "vnni" not in kernels.FORMATS["w8a8"].candidates


# --- W4A8: int4 weights (quant.Int4Linear's groups, scales and zeros) x int8 activation rows --------------------
@pytest.mark.parametrize("N,K", [(16, 64), (37, 128), (100, 320), (1024, 1024)])
def test_w4a8_matches_the_same_arithmetic_in_float64(w4a8_ext, N, K):
    from tts_engine.model.quant import int4_quantize

    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g) * 0.05
    ext = w4a8_ext
    q, sz = int4_quantize(w, 64)
    packed = ext.pack4(q, sz)
    assert packed.numel() == ext.packed4_bytes(N, K)
    # the weight the kernel must multiply by: (q - 8) * scale + zero with the bf16 scale and zero of each group
    s = sz[..., 0].float().T.repeat_interleave(64, dim=1)
    z = sz[..., 1].float().T.repeat_interleave(64, dim=1)
    wdeq = ((q - 8) * s + z).double()
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, K, generator=g).to(dtype)
            xq, amax = kernels.quantize_rows(x)
            exact = (xq.double() @ wdeq.T) * amax.double() / 127
            y = ext.w4a8(x, packed, N)
            assert y.dtype == dtype and y.shape == (rows, N)
            err = ((y.double() - exact).norm() / exact.norm()).item()
            assert err < (2e-6 if dtype == torch.float32 else 4e-3), (rows, dtype, err)   # fp32 sums / bf16 result


def test_w4a8_layer_is_the_int4_weight_with_int8_activations(w4a8_ext, cache):
    from tts_engine.model import quant

    torch.manual_seed(5)
    lin = nn.Linear(256, 96, bias=True)
    w4 = quant.quantize_linear(lin, "w4a8")
    i4 = quant.quantize_linear(lin, "int4")
    assert isinstance(w4, quant.W4A8Linear) and isinstance(i4, quant.Int4Linear)
    q, sz = quant.int4_quantize(lin.weight.detach().float(), 64)
    exact = (q - 8) * sz[..., 0].float().T.repeat_interleave(64, 1) + sz[..., 1].float().T.repeat_interleave(64, 1)
    torch.testing.assert_close(w4.dequantized(), exact, rtol=1e-5, atol=1e-7)   # the same int4 weight as int4's,
    torch.testing.assert_close(i4.dequantized(), exact, rtol=8e-3, atol=1e-5)   # (read back there in bf16)
    x = torch.randn(3, 256)
    ref = lin(x)
    y4, yi = w4(x), i4(x)
    assert ((y4 - ref).norm() / ref.norm()).item() < 0.12                    # int4's bound in test_quant
    assert ((y4 - yi).norm() / yi.norm()).item() < 0.02                      # + the int8 activation rounding
    assert "w4a8" in quant.available_modes()
    assert quant.precision_label(torch.bfloat16, "w4a8") == "int4 weights x int8 activations"
    assert not quant.W4A8Linear.supports(nn.Linear(100, 16))                 # K not a multiple of 64: stays dense


def test_w4a8_is_not_offered_without_the_kernels(fresh_state, monkeypatch):
    from tts_engine.errors import TTSError
    from tts_engine.model import quant
    from tts_engine.model.talker import Talker  # noqa: F401  (quantize_talker's argument type)

    monkeypatch.setenv(cpu_ext.ENABLE_ENV, "0")
    assert "w4a8" not in quant.available_modes() and "w8a8" in quant.available_modes()
    kernels.register_cpu_ext()
    assert "vnni" not in kernels.FORMATS["w4a8"].candidates

    class FakeTalker(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.norm = nn.LayerNorm(4)

    with pytest.raises(TTSError, match="w4a8"):
        quant.quantize_talker(FakeTalker(), "w4a8")


# --- the AVX2 path (CPUs without AVX-512 VNNI), forced on this CPU ------------------------------------------------
def test_the_avx2_path_gives_the_same_exact_sums(fresh_state, monkeypatch):
    from tts_engine.model import quant

    if not ({"avx2", "fma"} <= set(kernels.cpu_identity()["flags"]) and shutil.which("g++") and cpu_ext.enabled()):
        pytest.skip("no AVX2 + FMA or no g++ here")
    monkeypatch.setenv(cpu_ext.ISA_ENV, "avx2")
    assert cpu_ext.available(), cpu_ext.why_unavailable()
    assert cpu_ext.isa() == "avx2" and cpu_ext.level_name() == "avx2"
    assert cpu_ext.has_w4a8() and "w4a8" in quant.available_modes()   # W4A8 has an AVX2 path too
    assert kernels.register_cpu_ext().endswith("-avx2") and "vnni" in kernels.FORMATS["w4a8"].candidates
    g = torch.Generator().manual_seed(11)
    for N, K in [(37, 50), (256, 1024)]:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        q[0, :] = 127
        s127 = torch.rand(N, generator=g) * 1e-4
        packed = cpu_ext.pack(q)
        for rows in (1, 2, 3, 4, 5):   # pairs of rows per pass and an odd one
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, K, generator=g) * 3).to(dtype)
                x[0, :] = x[0, :].abs()
                acc = torch.empty(rows, N, dtype=torch.int32)
                y = cpu_ext.w8a8(x, packed, s127, N, acc)
                xq, _ = kernels.quantize_rows(x)
                assert torch.equal(acc.long(), xq.long() @ q.long().T), (N, K, rows, dtype)
                torch.testing.assert_close(y, kernels.w8a8_int_mm(x, q, s127).to(dtype), rtol=0, atol=0)
