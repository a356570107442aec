"""Kernel census: how many launches one frame of the GPU's path costs.

    python -m bench census --arch 0.6b --batches 1,4,64 [--json FILE] [--path eager|fused|gemv|both]

Without a GPU the frame the GPU serves (`ModelRunner.frame(b, L, general=True)`: the code a CUDA graph captures,
CPU fast paths off, fp32) runs on the CPU under a dispatch counter: every non-view aten op is one launch, and so
is every Triton kernel call (`tts_engine.gpu` reports its launches through `gpu.kernels.LAUNCHES`). Launch counts
depend on the layer counts and the code path, not on the widths, so the census builds the architecture's layer
counts with narrow layers (seconds on a CPU, no checkpoint on disk).

Paths: "eager" (no backend), "fused" (the fused GPU frame's gemm variant: cuBLAS GEMMs and the separate kernels),
"gemv" (its gemv variant: at <= 8 rows per stack our matrix-vector kernels with their neighbours fused in; see
`tts_engine/gpu/variants.py` for how a GPU chooses), "both" (all three).

On a GPU (`--gpu`) the same frame is captured as a CUDA graph and one replay is profiled with torch.profiler: the
CUDA kernels it launches are counted, printed beside the CPU count.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the fast paths a CPU would attach are not what a GPU runs: off for the census
for _var in ("TTS_FUSED_STEP", "TTS_PREDICTOR_FRAME", "TTS_TALKER_STEP", "TTS_COMPILE_PREDICTOR"):
    os.environ.setdefault(_var, "0")

READ_LEN = 64   # talker positions read by attention (a length bucket's size does not change the count)

# aten ops that only reinterpret memory: no kernel on a GPU
VIEW_OPS = {"view", "_unsafe_view", "reshape", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze",
            "permute", "transpose", "t", "detach", "alias", "unflatten", "flatten", "split", "chunk", "narrow",
            "unbind", "_reshape_alias", "lift_fresh", "view_as", "expand_as", "movedim", "diagonal",
            "split_with_sizes", "_to_copy_view", "real", "imag", "_unsafe_split", "unsafe_split",
            "numpy_T", "contiguous_view", "_nested_view_from_buffer",
            # allocations: memory from the caching allocator, no kernel (a graph replays none of them)
            "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


class LaunchCounter(TorchDispatchMode):
    """Counts non-view aten ops (one GPU kernel each, roughly: a few fuse or split, the census says so)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS and not func.is_view:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def narrow_config(arch: str) -> dict:
    """The architecture's config with its layer counts and heads kept and every width made small."""
    from tts_engine.tiny import ARCHS, tiny_config

    real = ARCHS[arch]
    ids = {"text_vocab_size": 1024, "im_start_token_id": 1, "im_end_token_id": 2, "tts_pad_token_id": 3,
           "tts_bos_token_id": 4, "tts_eos_token_id": 5}
    cfg = tiny_config("custom_voice", "0b6" if arch != "1.7b" else "1b7", ids, arch="tiny")
    t = cfg["talker_config"]
    t["num_hidden_layers"] = real["layers"]
    t["code_predictor_config"]["num_hidden_layers"] = real["cp_layers"]
    t["text_vocab_size"] = 1024
    return cfg


def build_runner(arch: str, rows: int, device: str = "cpu", dtype=torch.float32):
    """A ModelRunner over the narrow architecture, with no backend attached (the plain frame; `_fused` adds the
    GPU's fused frame)."""
    from tts_engine.config import ModelConfig
    from tts_engine.engine.model_runner import ModelRunner
    from tts_engine.model.talker import Talker

    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(narrow_config(arch))
    talker = Talker(cfg.talker).to(device=device, dtype=dtype).eval()
    talker.build_frame_table()
    tts_pad = torch.zeros(cfg.talker.hidden_size, device=device, dtype=dtype)
    return ModelRunner(talker, tts_pad, rows=rows, max_len=READ_LEN + 64, eos_id=cfg.talker.codec_eos_token_id,
                       fast_paths=False)


def gpu_launches() -> int:
    """Triton kernel calls reported by tts_engine.gpu (0 where that package is absent)."""
    try:
        from tts_engine.gpu import kernels
    except Exception:
        return 0
    return int(getattr(kernels, "LAUNCHES", collections.Counter()).total()) \
        if hasattr(getattr(kernels, "LAUNCHES", None), "total") else 0


@contextlib.contextmanager
def _fused(runner, on: bool, variant: str | None = None):
    """The runner with the fused GPU frame attached (`tts_engine.gpu.backend`), or as it is; variant: the fused
    frame's variant to count ("gemm", "gemv"; None: what attach chose)."""
    if not on:
        yield None
        return
    from tts_engine.gpu import backend, ops, variants

    if runner.device.type != "cuda":
        # counted through Triton's interpreter: the frame is installed as it is, without attach's agreement checks and
        # trial (minutes in the interpreter, and no part of a frame's launches; tests/test_gpu_frame*.py check its
        # codes against the eager frame)
        from tts_engine.gpu.frame import FusedFrame

        if not ops.use_interpreter():
            raise RuntimeError("Triton's interpreter could not be switched on")
        frame = FusedFrame(runner)
        frame.variant = variant or "gemm"
        backend.install(runner, frame, interp=True)
        try:
            yield {"gpu frame": "fused (Triton's interpreter, installed for the count)"}
        finally:
            backend.detach(runner)
        return
    forced, before = {"gemm": "0", "gemv": "1"}.get(variant), os.environ.get(variants.ENV)
    if forced is not None:   # the variant counted is forced: no timing trial on a GPU
        os.environ[variants.ENV] = forced
    try:
        entries = backend.attach(runner, force=runner.device.type != "cuda")
    finally:
        if forced is not None:
            if before is None:
                os.environ.pop(variants.ENV, None)
            else:
                os.environ[variants.ENV] = before
    if variant is not None:
        if getattr(runner, "gpu_frame", None) is None:
            raise RuntimeError(f"the fused frame did not attach: {entries.get('gpu frame')}")
        runner.gpu_frame.variant = variant
    try:
        yield entries
    finally:
        backend.detach(runner)


def count_cpu(arch: str, batch: int, fused: bool = False, device: str = "cpu", variant: str | None = None) -> dict:
    """{"launches": N, "aten": N, "triton": N, "top": [(op, n), ...]} of one frame at `batch` rows, counted by the
    dispatch counter (on `device`: "cuda" where a GPU is there, so the fused frame's kernels are the compiled ones);
    variant: the fused frame's ("gemm", "gemv")."""
    runner = build_runner(arch, rows=batch, device=device)
    with torch.inference_mode(), _fused(runner, fused, variant):
        runner.frame(batch, READ_LEN, general=True)   # warm-up: lazily built tables are not per-frame work
        try:
            from tts_engine.gpu import kernels as gk
            gk.LAUNCHES.clear()
        except Exception:
            pass
        counter = LaunchCounter()
        with counter:
            runner.frame(batch, READ_LEN, general=True)
        triton = gpu_launches()
    aten = sum(counter.ops.values())
    return {"launches": aten + triton, "aten": aten, "triton": triton, "top": counter.ops.most_common(12)}


def count_gpu(arch: str, batch: int, fused: bool = False, variant: str | None = None) -> dict:
    """CUDA kernels of one replay of the captured frame (torch.profiler), eager or fused (in `variant`)."""
    from torch.profiler import ProfilerActivity, profile

    from tts_engine.engine.cuda_graphs import GraphedFrames

    runner = build_runner(arch, rows=batch, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode(), _fused(runner, fused, variant):
        g = GraphedFrames(runner, batch_buckets=(batch,), len_step=READ_LEN)
        graph, _, _ = g.capture(batch, READ_LEN)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    names = collections.Counter(e.name[:60] for e in kernels)
    return {"kernels": len(kernels), "top": names.most_common(12)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench census", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    p.add_argument("--batches", default="1,4,64")
    p.add_argument("--path", default="eager", choices=["eager", "fused", "gemv", "both"],
                   help="the eager frame, the fused GPU frame (tts_engine.gpu, Triton interpreter on a CPU) in its "
                   "gemm variant, in its gemv variant, or all three")
    p.add_argument("--gpu", action="store_true", help="also profile one captured replay on the GPU (the dispatch "
                   "count then runs on the GPU too)")
    p.add_argument("--json", help="write {path: {batch: counts}} here")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    on_gpu = a.gpu and torch.cuda.is_available()
    paths = ["eager", "fused", "gemv"] if a.path == "both" else [a.path]
    variant = {"eager": None, "fused": "gemm", "gemv": "gemv"}
    out: dict = {"arch": a.arch, "read_len": READ_LEN, "counted": "non-view aten ops + Triton kernel calls, CPU"}
    print(f"Kernel census, {a.arch} (layer counts of the real model, narrow widths), one frame, read length "
          f"{READ_LEN}")
    print(f"| path | batch | launches (CPU count) | aten | triton |" + (" CUDA kernels (replay) |" if a.gpu else ""))
    print("|---|---|---|---|---|" + ("---|" if a.gpu else ""))
    for path in paths:
        out[path] = {}
        for b in batches:
            c = count_cpu(a.arch, b, fused=path != "eager", device="cuda" if on_gpu else "cpu", variant=variant[path])
            row = f"| {path} | {b} | {c['launches']} | {c['aten']} | {c['triton']} |"
            if on_gpu:
                gpu = count_gpu(a.arch, b, fused=path != "eager", variant=variant[path])
                c["cuda_kernels"] = gpu["kernels"]
                c["cuda_top"] = gpu["top"]
                row += f" {gpu['kernels']} |"
            elif a.gpu:
                row += " - |"
            out[path][str(b)] = c
            print(row)
    first = out[paths[0]][str(batches[0])]
    print("top ops at batch %d (%s): %s" % (batches[0], paths[0],
                                             ", ".join(f"{k} {v}" for k, v in first["top"])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
