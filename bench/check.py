"""`python -m bench check`: does the fast path work on this machine?

On a GPU: an engine that replays CUDA graphs (captured at start-up) and an engine that runs the very same padded
bucket shapes eagerly (`cuda_graphs.EagerBuckets`) generate greedy codes for the same requests at batch 1 and
batch 4; they must be identical. The batched prefill too: the first engine's prefill replays its CUDA graph per
bucket (`gpu.prefill_graph`, every bucket served by its graph), the second runs the same padded buckets eagerly.
The plain eager path (exact lengths) is compared too and reported. Then the
graphs' one-stream speed is printed. On a CPU there are no graphs: the bucketed path is checked against the
exact eager path instead, and the eager speed is printed. Exit status 0 when every required check passed.
"""
from __future__ import annotations

import collections
import sys
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tts_engine.engine.cuda_graphs import EagerBuckets
from tts_engine.engine.engine import TTSEngine
from tts_engine.gpu.prefill_graph import PrefillGraphs

TEXTS = ["Ladies and gentlemen, please remain calm.", "The quick brown fox jumps over the lazy dog.",
         "A frame is eighty milliseconds of audio.", "Graphs and eager must agree on every code."]


def _frame_path(engine: TTSEngine) -> str:
    """What serves the engine's frame (`TTSEngine.paths()`), in one line."""
    from tts_engine.cpu.measured import describe

    return describe(engine.paths()["frame"])


def _codes(engine: TTSEngine, batch: int, frames: int) -> list[torch.Tensor]:
    voices = engine.speakers_for_check
    streams = [engine.stream(TEXTS[i % len(TEXTS)], voice=voices[i % len(voices)], seed=i, greedy=True,
                             max_new_tokens=frames + 1, sampling={"ignore_eos": True}) for i in range(batch)]
    for s in streams:
        for _ in s:
            pass
    return [s.codes for s in streams]


def _first_mismatch(a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return f"request {i}: {x.shape[0]} vs {y.shape[0]} frames"
        bad = (x != y).any(-1).nonzero()
        if len(bad):
            return f"request {i}: first differing frame {int(bad[0])} of {x.shape[0]}"
    return None


def _speed(engine: TTSEngine, frames: int) -> tuple[float, float, float]:
    """(x real time, ms per frame, first audio ms) of one greedy stream of `frames` frames."""
    t0 = time.perf_counter()
    s = engine.stream(TEXTS[0], voice=engine.speakers_for_check[0], seed=0, greedy=True,
                      max_new_tokens=frames + 1, sampling={"ignore_eos": True})
    first = None
    n = 0
    for chunk in s:
        first = first if first is not None else time.perf_counter() - t0
        n += len(chunk)
    wall = time.perf_counter() - t0
    return n / engine.sample_rate / wall, 1000 * wall / max(1, s.codes.shape[0]), 1000 * (first or 0)


def _voices(engine: TTSEngine):
    if engine.kind == "base":
        import numpy as np

        t = np.arange(24000 * 3) / 24000
        return [engine.clone_voice((0.3 * np.sin(2 * np.pi * 160 * t).astype(np.float32), 24000), x_vector_only=True)]
    return engine.speakers or [None]


def crossing(in_devices: set[str], out_devices: set[str], to_device: str | None) -> str | None:
    """What an op does across host and device, if anything: "mixed" (a CPU tensor beside CUDA ones: a host value
    copied in, which breaks a CUDA-graph capture unless pinned), "to-cuda" (a CPU tensor copied to the GPU) or
    "to-cpu" (a GPU result read back: a host sync); None for an op that stays on one side."""
    if "cpu" in in_devices and "cuda" in in_devices:
        return "mixed"
    if in_devices == {"cpu"} and to_device == "cuda":
        return "to-cuda"
    if in_devices == {"cuda"} and "cpu" in out_devices:
        return "to-cpu"
    return None


class _CrossingSpy(TorchDispatchMode):
    """Records every op of a block that crosses between host and device, with where in our code it was called."""

    def __init__(self):
        super().__init__()
        self.found: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        to = kwargs.get("device")
        kind = crossing({t.device.type for t in ins}, {t.device.type for t in outs},
                        torch.device(to).type if to is not None else None)
        if kind is not None:
            ours = [f for f in traceback.extract_stack()[:-1] if "tts_engine" in f.filename]
            where = " <- ".join(f"{f.filename.rsplit('tts_engine', 1)[-1]}:{f.lineno} {f.line}" for f in ours[::-1][:3])
            self.found[f"{kind} {func}: {where}"] += 1
        return out


def host_crossings(runner, b: int, read_len: int) -> list[str]:
    """Run one eager frame of `runner` (rows 0..b-1, state restored afterwards) and list the ops that cross between
    host and device, most frequent first: what to mend when a CUDA-graph capture fails."""
    state = [runner.pos, runner.step, runner.seen, runner.hidden, runner.c0]
    saved = [t.clone() for t in state]
    spy = _CrossingSpy()
    try:
        with torch.inference_mode(), spy:
            runner.frame(b, read_len, general=True)
    finally:
        for t, s in zip(state, saved):
            t.copy_(s)
    return [f"{n} x {k}" for k, n in spy.found.most_common()]


def run_check(ckpt: str, device: torch.device, dtype, frames: int, out=sys.stdout) -> int:
    gpu = device.type == "cuda"
    kw = dict(device=device, dtype=dtype, max_batch=4, max_seq_len=frames + 256)
    ok = True

    def say(msg):
        print(msg, file=out, flush=True)

    if gpu and torch.backends.cuda.cudnn_sdp_enabled():
        # cuDNN's attention chooses its kernel per call, so a captured frame can round differently from the same
        # frame run eagerly (H100: one greedy code at batch 4, frame 54-63 of 64) although the graph replays the
        # same ops; flash / memory-efficient attention do not. The check compares the graph machinery with that
        # attention; the engine serves with cuDNN's (20 % faster at one stream on an H100, docs/benchmarks.md).
        torch.backends.cuda.enable_cudnn_sdp(False)
        say("cuDNN attention off for this check (it picks kernels per call: captured and eager frames may round "
            "differently); the engine serves with it")

    eager = TTSEngine.from_pretrained(ckpt, use_cuda_graphs=False, **kw)
    eager.speakers_for_check = _voices(eager)
    bucketed = TTSEngine.from_pretrained(ckpt, use_cuda_graphs=False, **kw)
    bucketed.speakers_for_check = eager.speakers_for_check
    bucketed.start_graphs(EagerBuckets(bucketed.runner))
    bucketed.runner.prefill_graphs = PrefillGraphs(bucketed.runner, capture=False, mode="on")   # same buckets, eager
    fast = None
    if gpu:
        t0 = time.perf_counter()
        fast = TTSEngine.from_pretrained(ckpt, use_cuda_graphs=True, capture_graphs_at_start=True, **kw)
        fast.speakers_for_check = eager.speakers_for_check
        say(f"CUDA graphs: {_frame_path(fast)}; engine start {time.perf_counter() - t0:.1f} s")
        if fast.runner.prefill_graphs is not None:
            fast.runner.prefill_graphs.mode = "on"   # every prefill bucket served by its graph (still checked)
        if not fast.uses_cuda_graphs:
            say("FAIL: graphs could not be captured (the app would serve eagerly)")
            for line in host_crossings(fast.runner, 1, 64):
                say(f"  host/device crossing in a frame: {line}")
            ok = False
    else:
        say("no CUDA device: CUDA graphs cannot be checked here; checking the bucketed static step against "
            "the exact eager path instead")
    for batch in (1, 4):
        ref = _codes(eager, batch, frames)
        same_shape = _codes(bucketed, batch, frames)
        if fast is not None and fast.uses_cuda_graphs:
            got = _codes(fast, batch, frames)
            bad = _first_mismatch(got, same_shape)
            say(f"batch {batch}: graphs vs eager at the same shapes: " + ("identical" if bad is None else f"DIFFER ({bad})"))
            ok &= bad is None
            if not fast.uses_cuda_graphs:
                say(f"FAIL: graphs were turned off while serving: {_frame_path(fast)}")
                ok = False
            bad2 = _first_mismatch(got, ref)
            say(f"batch {batch}: graphs vs plain eager (exact lengths): "
                + ("identical" if bad2 is None else f"differ ({bad2}; reported, not required: other attention lengths)"))
        else:
            bad = _first_mismatch(same_shape, ref)
            say(f"batch {batch}: bucketed static step vs exact eager: " + ("identical" if bad is None else f"DIFFER ({bad})"))
            ok &= bad is None
    if fast is not None and "prefill graphs" in fast.paths():
        from tts_engine.cpu.measured import describe

        say(f"prefill: {describe(fast.paths()['prefill graphs'])}")
    engine = fast if fast is not None and fast.uses_cuda_graphs else eager
    xrt, ms, first = _speed(engine, frames)
    path = "CUDA graphs" if engine is fast else "eager"
    say(f"one stream ({path}, greedy, {frames} frames): {xrt:.2f}x real time, {ms:.1f} ms per frame, "
        f"first audio {first:.0f} ms")
    for e in (eager, bucketed, fast):
        if e is not None:
            e.close()
    say("CHECK PASSED" if ok else "CHECK FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    """`python -m bench check [--arch A] [--model M] [--device D] [--dtype T] [--frames N]`: `speed --check`."""
    from bench.speed import main as speed_main

    return speed_main(["--check", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
