"""Optional: one code-predictor pass compiled by torch.compile (inductor, CPU), for one stream.

The code predictor runs 15 passes per frame over 5 small layers; eagerly each pass is ~1,500 small aten calls
around its 21 weight matmuls. Compiled, the norms, RoPE, cache writes and attention of a pass become a few
fused C++ loops around the same matmul kernels. One graph serves 14 of the 15 passes: the position is a tensor
and the cache is the static 17-slot predictor cache (slots past the position are masked). The first pass (two
positions: the talker's hidden and codebook 0) stays eager, which halves the compile; batches of several rows
keep the eager path too (a graph per batch size would compile inside a request).

Off by default; TTS_COMPILE_PREDICTOR=1 (or `enable_compiled_predictor`) turns it on. Compiling happens once at
engine load (the warm-up) and is cached on disk under ~/.cache/qwen3-tts-live/inductor (inductor's FX-graph and
C++ caches), so later starts load it. Any failure (a compile error, a warm-up over COMPILE_BUDGET_S, a pass that
raises later) logs one line and leaves the eager path serving; it never takes the engine down. A cold compile
(no cache yet) takes minutes on 2 cores: the engine starts after COMPILE_BUDGET_S and serves eagerly while the
compile finishes in the background.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from tts_engine.cache_paths import cache_root
from tts_engine.cpu.measured import forced_by
from tts_engine.model.layers import rms_norm, signed_sin, rope_cos_sin, apply_rope

log = logging.getLogger("tts_engine")
ENV = "TTS_COMPILE_PREDICTOR"   # 1 / on: compile the predictor pass at load (CPU, 16-bit or quantised modes)
COMPILE_BUDGET_S = 60.0         # a warm-up compile slower than this is not used (it stays cached for next time)


def cache_dir() -> Path:
    return cache_root() / "inductor"


def wanted() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "on", "true", "yes")


class CompiledPredictorPass:
    """`run(x, cache, start)` = `CodePredictor.model.run(projection(x), ...)` for one row at positions
    start..start+T-1, as a compiled graph. Numerics: those of the eager fused CPU path up to fp32/bf16 rounding
    of fused arithmetic (inductor keeps intermediates in fp32)."""

    def __init__(self, cp, device: torch.device, dtype: torch.dtype):
        self.cp = cp
        c = cp.cfg
        self.S = c.num_code_groups + 1
        self.H, self.Hkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        pos = torch.arange(self.S, device=device)[None]
        cos, sin = rope_cos_sin(pos, self.hd, c.rope_theta, dtype)          # [1, 1, S, hd]
        self.cos, self.sin = cos[0, 0], signed_sin(sin)[0, 0]              # [S, hd]
        self.key_idx = torch.arange(self.S, device=device)
        self.positions = [torch.tensor([s], device=device) for s in range(self.S)]
        self.fn = torch.compile(self._pass, dynamic=False, fullgraph=True)
        self.ok = False
        self._set("off", "")

    def _pass(self, x, pos, k_cache, v_cache):
        """x [1, T, talker D], pos [T] int64, k_cache/v_cache [layers, 1, Hkv, S, hd] -> normed hidden [1, T, D]."""
        m = self.cp.model
        H, Hkv, hd = self.H, self.Hkv, self.hd
        g = H // Hkv
        x = self.cp.small_to_mtp_projection(x)
        B, T, _ = x.shape
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]       # [1, 1, T, hd]
        visible = self.key_idx[None, :] <= pos[:, None]                       # [T, S]
        add_mask = torch.zeros(T, self.S, device=x.device).masked_fill(~visible, float("-inf"))
        add_mask = add_mask.repeat(g, 1)[None, None]                          # [1, 1, g*T, S]
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            qkv = a.qkv_proj(layer.input_layernorm(x)).view(B, T, H + 2 * Hkv, hd)
            qk = rms_norm(qkv[:, :, :H + Hkv], a.qk_norm_weight, a.eps).transpose(1, 2)
            q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=1)
            v = qkv[:, :, H + Hkv:].transpose(1, 2)
            k_cache[i].index_copy_(2, pos, k)
            v_cache[i].index_copy_(2, pos, v)
            qg = q.reshape(B, Hkv, g * T, hd).float()
            scores = torch.matmul(qg, k_cache[i].float().transpose(-1, -2)) * (hd ** -0.5) + add_mask
            out = torch.matmul(scores.softmax(dim=-1), v_cache[i].float()).to(x.dtype).view(B, H, T, hd)
            x = x + a.o_proj(out.transpose(1, 2).reshape(B, T, H * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x)

    def warm_up(self, cache, budget_s: float | None = None) -> bool:
        """Compile the one-position graph on a scratch copy of the engine's predictor cache (same shape and
        strides, so the graph is the one `run` uses), in a background thread; wait up to `budget_s`
        (COMPILE_BUDGET_S). -> whether the compiled pass is in use now. A compile still running after the budget
        goes on in the background (it fills the on-disk cache) and turns the pass on when it is done; the engine
        serves eagerly meanwhile."""
        from torch._inductor import config as inductor_config

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))
        inductor_config.fx_graph_cache = True
        budget_s = COMPILE_BUDGET_S if budget_s is None else budget_s
        scratch_k, scratch_v = torch.zeros_like(cache.k), torch.zeros_like(cache.v)
        t0 = time.perf_counter()
        self._set("compiling", "")

        def work():
            try:
                D = self.cp.model.codec_embedding[0].weight.shape[1]
                w = self.cp.model.norm.weight
                with torch.inference_mode():
                    x = torch.zeros(1, 1, D, device=w.device, dtype=w.dtype)
                    for s in (2, 3):   # a second position: the graph does not specialise on it
                        self.fn(x, self.positions[s], scratch_k[:, :1], scratch_v[:, :1])
            except Exception as e:   # a compile error: the eager path serves
                self._set("off", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                log.warning("compiled code predictor not used, serving eagerly: %s", self.status)
                return
            took = time.perf_counter() - t0
            self._set("on", f"warm-up {took:.1f} s")
            self.ok = True
            log.info("code predictor pass compiled (inductor, one row): warm-up %.1f s", took)

        self.thread = threading.Thread(target=work, name="compile-predictor", daemon=True)
        self.thread.start()
        self.thread.join(budget_s if budget_s < 1e6 else None)   # (join cannot take an infinite timeout)
        if self.thread.is_alive():
            self._set("compiling", f"over {budget_s:.0f} s at start; eager until it is done, then on; "
                                   "cached for the next start")
            log.warning("compiled code predictor: %s", self.status)
        return self.ok

    def _set(self, state: str, why: str) -> None:
        """state: "off", "compiling" or "on"; why: one line. `status` ("on (warm-up 3.1 s)") says both for logs."""
        self._state = (state, why)
        self.status = f"{state} ({why})" if why else state

    def entry(self) -> dict[str, str]:
        """Its entry in `TTSEngine.paths()` ("compiled predictor"): "compiled" once the warm-up compiled it, else
        "eager" (still compiling, or fell back: why)."""
        state, why = self._state
        if self.ok:
            return {"path": "compiled", "how": forced_by(ENV) if wanted() else "forced by compile_predictor=True",
                    "why": why}
        if state == "compiling":
            return {"path": "eager", "how": "measuring", "why": f"compiling: {why}" if why else "compiling"}
        return {"path": "eager", "how": "fell back" if why else "default", "why": why}

    def run(self, x, cache, start: int):
        """Normed hidden [1, 1, D] of position `start` (row 0 of `cache`); x [1, 1, talker D]. A call that would
        recompile (no compile inside a request) raises instead: the caller falls back to eager."""
        with torch.compiler.set_stance("fail_on_recompile"):
            return self.fn(x, self.positions[start], cache.k[:, :1], cache.v[:, :1])

    def disable(self, e: BaseException) -> None:
        self.ok = False
        self._set("off", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        log.warning("compiled code predictor failed, serving eagerly from now on: %s", self.status)
