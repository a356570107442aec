"""The fused SnakeBeta kernel (cpu_ext.cpp, codec section; `cpu_ext.snake`, used by the decoder's packed mode):
y = x + ib[c] * sin(x * a[c])^2 in one pass, against the same formula in fp64, in both layouts, fp32 and bf16, on
each code path (AVX-512F, AVX2 + FMA, scalar: forced, where this CPU has them). Tolerances: fp32 |diff| < 4e-6 +
2e-6 |ref| (range reduction + a 6-term series, computed in fp32); bf16 within one bf16 rounding of the fp64 value
of the bf16 input (|diff| <= 2^-8 |ref| + 1e-6)."""
from __future__ import annotations

import pytest
import torch

from tts_engine.codec.decoder import SnakeBeta
from tts_engine.cpu import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="our CPU kernels do not build/run here")


def _isas():
    cpu_ext.snake(torch.zeros(1, 1, 1), torch.ones(1), torch.ones(1))   # loads the kernel, detects the ISA
    return list(range(cpu_ext._state["snake_isa"], -1, -1))


def _case(dtype, time_major, B=2, C=24, L=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, C, L, generator=g) * 4).to(dtype)
    x[0, 0, :5] = torch.tensor([0.0, -0.0, 1e-3, 157.3, -400.1])     # zero, tiny, far from the reduced range
    if time_major:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    a = torch.exp(torch.randn(C, generator=g) * 0.7)
    ib = 1.0 / (torch.exp(torch.randn(C, generator=g) * 0.7) + 1e-9)
    return x, a, ib


def _ref(x, a, ib):
    xd = x.double()
    return xd + ib.double()[None, :, None] * torch.sin(xd * a.double()[None, :, None]) ** 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("time_major", [False, True])
def test_snake_matches_the_formula_on_every_code_path(dtype, time_major, monkeypatch):
    x, a, ib = _case(dtype, time_major)
    ref = _ref(x, a, ib)
    for isa in _isas():
        monkeypatch.setitem(cpu_ext._state, "snake_isa", isa)
        y = cpu_ext.snake(x, a, ib)
        assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride(), isa
        err = (y.double() - ref).abs()
        if dtype == torch.float32:
            assert float((err - 2e-6 * ref.abs()).max()) < 4e-6, isa
        else:
            assert float((err - 2 ** -8 * ref.abs()).max()) <= 1e-6, isa


def test_snake_declines_what_it_cannot_take():
    x = torch.randn(2, 8, 10)
    a, ib = torch.ones(8), torch.ones(8)
    assert cpu_ext.snake(x[:, :, ::2], a, ib) is None               # neither layout is dense
    assert cpu_ext.snake(x.double(), a, ib) is None
    assert cpu_ext.snake(x, a[:4], ib[:4]) is None
    assert cpu_ext.snake(x, a.bfloat16(), ib) is None


def test_the_module_uses_it_only_when_fused_and_follows_its_parameters():
    torch.manual_seed(0)
    m = SnakeBeta(16)
    with torch.no_grad():
        m.alpha.uniform_(-0.5, 0.5)
        m.beta.uniform_(-0.5, 0.5)
    x = torch.randn(1, 16, 50) * 3
    with torch.no_grad():
        plain = m(x)
        m.fused = True
        fused = m(x)
        assert not torch.equal(plain, fused) and float((plain - fused).abs().max()) < 1e-5
        m.alpha.mul_(2)                                               # a changed parameter is seen
        m.fused = False
        plain2 = m(x)
        m.fused = True
        assert float((m(x) - plain2).abs().max()) < 1e-5
