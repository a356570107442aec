"""What a remembered GPU verdict (`cpu/measured.py` MeasuredChoice's key) holds for: the model's shapes as one short
hash (`model_shapes`: the fused frame's key in `backend.verdict_key`, the prefill graphs'), and the device, versions
and measured code (`device_key`: the prefill and codec graphs' and the codec stream's), so a verdict taken on another model, GPU, library
or source is not reused."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def device_key(device: torch.device, *sources: Path) -> dict:
    """{"gpu", "torch", "cuda", "code"}: the device's name ("cpu" off CUDA), torch's and CUDA's versions and sha1 (12 hex
    digits) of the given source files (the code whose speed and results the verdict measured)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    code = hashlib.sha1(b"".join(Path(p).read_bytes() for p in sources)).hexdigest()[:12]
    return {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "code": code}


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
