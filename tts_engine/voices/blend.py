"""Voice blending: pure functions on speaker-embedding vectors (no model, no torch needed).

The speaker slot of a Qwen3-TTS prompt is an LM input vector, so its norm matters: plain linear
interpolation of two vectors with cosine c shrinks the midpoint's norm by sqrt((1+c)/2). Hence:

- two voices: spherical interpolation (`slerp`) of the directions, with the norm interpolated linearly;
- two to four voices: normalised-direction interpolation with norm restore (`nlerp`):
      d = sum w_i * v_i/|v_i| ;  v = d/|d| * sum w_i * |v_i|      (weights normalised to sum 1)
  which is order-independent and close to slerp for moderate angles;
- `sweep(a, b)`: the five points 0, 25, 50, 75 and 100 % from A to B (slerp), for A/B listening.

Vectors may be numpy arrays, lists or torch tensors (anything `np.asarray` takes); results are float32
numpy arrays. Bad input raises `TTSError` with a message a person can act on.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from tts_engine.errors import TTSError

SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_VOICES = 4
_PARALLEL_EPS = 1e-7


def _as_vector(v, what: str = "voice") -> np.ndarray:
    if hasattr(v, "detach"):  # torch tensor
        v = v.detach().float().cpu().numpy()
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise TTSError(f"the {what} embedding must be a list of numbers") from None
    if a.ndim != 1 or a.shape[0] == 0:
        raise TTSError(f"the {what} embedding must be a non-empty 1-D vector, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise TTSError(f"the {what} embedding contains NaN or infinite values")
    if not np.linalg.norm(a) > 0:
        raise TTSError(f"the {what} embedding is all zeros")
    return a


def _vectors(vectors) -> list[np.ndarray]:
    vs = [_as_vector(v, f"voice {chr(ord('A') + i)}" if i < 26 else "voice") for i, v in enumerate(vectors)]
    if not vs:
        raise TTSError("choose at least one voice to blend")
    if len({v.shape[0] for v in vs}) > 1:
        raise TTSError("these voices have embeddings of different sizes (" +
                       ", ".join(str(v.shape[0]) for v in vs) + "): they come from different models "
                       "and cannot be blended")
    return vs


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Non-negative weights -> shares that sum to 1 (float64). All-zero, negative or non-finite weights are
    an error."""
    try:
        w = np.asarray([float(x) for x in weights], dtype=np.float64)
    except (TypeError, ValueError):
        raise TTSError("blend weights must be numbers") from None
    if w.size == 0:
        raise TTSError("choose at least one voice to blend")
    if not np.isfinite(w).all():
        raise TTSError("blend weights must be finite numbers")
    if (w < 0).any():
        raise TTSError("blend weights cannot be negative")
    total = w.sum()
    if not total > 0:
        raise TTSError("at least one blend weight must be above zero")
    return w / total


def shares_percent(weights: Sequence[float]) -> list[int]:
    """Normalised shares as whole percentages that add up to exactly 100 (largest-remainder rounding);
    all zeros when every weight is zero."""
    try:
        w = normalize_weights(weights)
    except TTSError:
        return [0] * len(list(weights))
    raw = w * 100.0
    out = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - out), kind="stable")[: 100 - int(out.sum())]:
        out[i] += 1
    return [int(x) for x in out]


def _orthogonal_unit(u: np.ndarray) -> np.ndarray:
    """A unit vector orthogonal to the unit vector u (deterministic)."""
    e = np.zeros_like(u)
    e[int(np.argmin(np.abs(u)))] = 1.0
    o = e - np.dot(e, u) * u
    return o / np.linalg.norm(o)


def slerp(a, b, t: float) -> np.ndarray:
    """Spherical interpolation from `a` (t=0) to `b` (t=1): the direction moves along the great circle at
    constant angular speed and the norm goes linearly from |a| to |b|. Nearly parallel vectors fall back to
    normalised linear interpolation; exactly opposite ones turn through a fixed orthogonal direction (no NaN)."""
    a, b = _vectors([a, b])
    t = float(t)
    if not (0.0 <= t <= 1.0) or math.isnan(t):
        raise TTSError("the A-to-B position must lie between 0 and 1 (0 % and 100 %)")
    if t == 0.0:
        return a.astype(np.float32)
    if t == 1.0:
        return b.astype(np.float32)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    ua, ub = a / na, b / nb
    cos = float(np.clip(np.dot(ua, ub), -1.0, 1.0))
    omega = math.acos(cos)
    s = math.sin(omega)
    if s < _PARALLEL_EPS:
        if cos > 0:   # (nearly) the same direction
            d = (1 - t) * ua + t * ub
        else:         # opposite: any great circle through both is valid; pick a fixed one
            d = math.cos(t * math.pi) * ua + math.sin(t * math.pi) * _orthogonal_unit(ua)
    else:
        d = (math.sin((1 - t) * omega) * ua + math.sin(t * omega) * ub) / s
    d = d / np.linalg.norm(d)
    return (d * ((1 - t) * na + t * nb)).astype(np.float32)


def nlerp(vectors, weights) -> np.ndarray:
    """Normalised-direction interpolation with norm restore for any number of voices:
    d = sum w_i v_i/|v_i|, result = d/|d| * sum w_i |v_i| (weights normalised to sum 1)."""
    vs = _vectors(vectors)
    w = normalize_weights(weights)
    if len(w) != len(vs):
        raise TTSError(f"{len(vs)} voices but {len(w)} weights")
    norms = np.array([np.linalg.norm(v) for v in vs])
    d = sum(wi * v / n for wi, v, n in zip(w, vs, norms))
    nd = np.linalg.norm(d)
    if nd < 1e-6:
        raise TTSError("these voices cancel each other out at these weights (their embeddings point in "
                       "opposite directions); change the weights")
    return (d / nd * float(np.dot(w, norms))).astype(np.float32)


def blend(vectors, weights) -> np.ndarray:
    """One to four voices with non-negative weights: slerp for two, nlerp for more (a single voice, or
    a single non-zero weight, returns that voice)."""
    vs = _vectors(vectors)
    if len(vs) > MAX_VOICES:
        raise TTSError(f"at most {MAX_VOICES} voices can be blended")
    w = normalize_weights(weights)
    if len(w) != len(vs):
        raise TTSError(f"{len(vs)} voices but {len(w)} weights")
    nz = np.flatnonzero(w)
    if len(nz) == 1:
        return vs[int(nz[0])].astype(np.float32)
    if len(vs) == 2:
        return slerp(vs[0], vs[1], float(w[1]))
    return nlerp(vs, w)


def sweep(a, b, points: Sequence[float] = SWEEP) -> list[np.ndarray]:
    """slerp(a, b, t) for each t in `points` (default 0, .25, .5, .75, 1)."""
    return [slerp(a, b, t) for t in points]
