"""Voice-blending math (tts_engine/voices/blend.py): pure functions, no model."""
from __future__ import annotations

import numpy as np
import pytest

from tts_engine import TTSError
from tts_engine.voices import blend as B


def _rand(n=64, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def _angle(x, y):
    c = np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y))
    return float(np.arccos(np.clip(c, -1, 1)))


def test_slerp_endpoints_exact_and_norm_interpolated():
    a, b = _rand(seed=1, scale=2.0), _rand(seed=2, scale=5.0)
    assert np.array_equal(B.slerp(a, b, 0.0), a)
    assert np.array_equal(B.slerp(a, b, 1.0), b)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    for t in (0.1, 0.25, 0.5, 0.9):
        v = B.slerp(a, b, t)
        assert v.dtype == np.float32 and v.shape == a.shape
        assert np.linalg.norm(v) == pytest.approx((1 - t) * na + t * nb, rel=1e-5)


def test_slerp_constant_angular_speed_and_on_the_great_circle():
    a, b = _rand(seed=3), _rand(seed=4)
    omega = _angle(a, b)
    for t in (0.25, 0.5, 0.75):
        v = B.slerp(a, b, t)
        assert _angle(a, v) == pytest.approx(t * omega, abs=1e-5)
        assert _angle(v, b) == pytest.approx((1 - t) * omega, abs=1e-5)
    # the midpoint of two equal-norm vectors keeps the norm (plain lerp would shrink it)
    a1, b1 = a / np.linalg.norm(a), b / np.linalg.norm(b)
    assert np.linalg.norm(B.slerp(a1, b1, 0.5)) == pytest.approx(1.0, abs=1e-6)
    assert np.linalg.norm((a1 + b1) / 2) < 0.9


def test_slerp_parallel_and_antiparallel_are_finite():
    a = _rand(seed=5)
    v = B.slerp(a, 3 * a, 0.5)
    assert np.isfinite(v).all() and _angle(v, a) < 1e-3
    assert np.linalg.norm(v) == pytest.approx(2 * np.linalg.norm(a), rel=1e-5)
    w = B.slerp(a, -a, 0.5)
    assert np.isfinite(w).all()
    assert abs(np.dot(w, a)) / (np.linalg.norm(w) * np.linalg.norm(a)) < 1e-5   # halfway = orthogonal
    assert np.linalg.norm(w) == pytest.approx(np.linalg.norm(a), rel=1e-5)


def test_nlerp_order_independent_norm_restore_and_single_weight():
    vs = [_rand(seed=s, scale=s) for s in (1, 2, 3, 4)]
    w = [1, 2, 3, 4]
    v = B.nlerp(vs, w)
    perm = [2, 0, 3, 1]
    assert np.allclose(B.nlerp([vs[i] for i in perm], [w[i] for i in perm]), v, atol=1e-5)
    wn = np.array(w) / 10
    assert np.linalg.norm(v) == pytest.approx(sum(wi * np.linalg.norm(x) for wi, x in zip(wn, vs)), rel=1e-5)
    assert np.allclose(B.nlerp(vs, [0, 0, 5, 0]), vs[2], atol=1e-5)
    # weights are scale-free
    assert np.allclose(B.nlerp(vs, [10, 20, 30, 40]), v, atol=1e-6)


def test_nlerp_close_to_slerp_for_moderate_angles():
    a = _rand(seed=7)
    b = a + 0.3 * _rand(seed=8)   # moderate angle
    s, n = B.slerp(a, b, 0.5), B.nlerp([a, b], [1, 1])
    assert _angle(s, n) < 0.01
    assert np.linalg.norm(s) == pytest.approx(np.linalg.norm(n), rel=1e-5)


def test_blend_dispatch():
    a, b, c = _rand(seed=1), _rand(seed=2), _rand(seed=3)
    assert np.allclose(B.blend([a, b], [3, 1]), B.slerp(a, b, 0.25))
    assert np.allclose(B.blend([a, b, c], [1, 1, 2]), B.nlerp([a, b, c], [1, 1, 2]))
    assert np.array_equal(B.blend([a], [1]), a)
    assert np.array_equal(B.blend([a, b, c], [0, 2, 0]), b)


def test_normalize_weights_and_shares():
    assert np.allclose(B.normalize_weights([1, 1, 2]), [0.25, 0.25, 0.5])
    assert B.shares_percent([1, 1, 1]) == [34, 33, 33]
    assert sum(B.shares_percent([1, 2, 3, 7])) == 100
    assert B.shares_percent([0, 0]) == [0, 0]
    assert B.shares_percent([0, 5]) == [0, 100]
    for bad in ([0, 0], [], [-1, 2], [float("nan"), 1], ["x"]):
        with pytest.raises(TTSError):
            B.normalize_weights(bad)


def test_sweep_five_points():
    a, b = _rand(seed=1), _rand(seed=2)
    pts = B.sweep(a, b)
    assert len(pts) == 5 == len(B.SWEEP)
    assert np.array_equal(pts[0], a) and np.array_equal(pts[-1], b)
    angles = [_angle(a, p) for p in pts]
    assert angles == sorted(angles)
    assert np.allclose(np.diff(angles), angles[-1] / 4, atol=1e-5)


def test_bad_vectors_raise_readable_errors():
    a = _rand()
    with pytest.raises(TTSError, match="different sizes"):
        B.blend([a, _rand(32)], [1, 1])
    with pytest.raises(TTSError, match="NaN"):
        B.slerp(a, np.full(64, np.nan), 0.5)
    with pytest.raises(TTSError, match="zeros"):
        B.nlerp([a, np.zeros(64)], [1, 1])
    with pytest.raises(TTSError, match="between 0 and 1"):
        B.slerp(a, _rand(seed=3), 1.5)
    with pytest.raises(TTSError, match="cancel"):
        B.nlerp([a, -a], [1, 1])
    with pytest.raises(TTSError, match="at most"):
        B.blend([a] * 5, [1] * 5)
    with pytest.raises(TTSError, match="weights"):
        B.blend([a, a], [1])


def test_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    a, b = _rand(seed=1), _rand(seed=2)
    assert np.allclose(B.slerp(torch.from_numpy(a), torch.from_numpy(b), 0.5), B.slerp(a, b, 0.5))
