"""The model's shapes as one short hash: part of every remembered GPU verdict's key (the fused frame's in
`backend.verdict_key`, the prefill graphs' in `prefill_graph`), so a verdict taken on another model is not reused."""
from __future__ import annotations

import hashlib


def model_shapes(runner) -> str:
    """sha1 (16 hex digits) of the talker's parameter names, shapes and dtypes and the stacks' eps / RoPE theta: the
    shapes every kernel and the fused frame run at."""
    t = runner.talker
    h = hashlib.sha1()
    for name, p in t.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    for st in (t.model, t.code_predictor.model):
        h.update(f"{st.cfg.rms_norm_eps}:{st.cfg.rope_theta}:{len(st.layers)};".encode())
    h.update(f"books:{t.cfg.num_code_groups}".encode())
    return h.hexdigest()[:16]
