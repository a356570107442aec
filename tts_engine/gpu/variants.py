"""The measured choice between the fused frame's variants (`frame.VARIANTS`): "gemm" (cuBLAS and the separate
kernels, the reference) or "gemv" (at a few rows our matrix-vector kernels with their neighbours fused in: 5
launches per decoder layer instead of 9). Which is faster is a property of the GPU, so it is measured there, through
the one mechanism (`cpu/measured.py` `MeasuredChoice`):

1. the gemv variant must agree with the eager frame as the fused frame must at attach (`backend.frame_trial`: fp32
   the same codes; 16-bit the talker hidden within 5e-2);
2. one frame at batch 1 is captured as a CUDA graph in each variant and replayed (REPLAYS per sample, ROUNDS
   samples each, the order alternating); the faster by median serves, and the answer is remembered per GPU, code
   version, model shape and dtype (the next start reads it instead of timing);
3. any failure (a variant that disagrees, a capture or a launch that raises) leaves "gemm" serving with one log line.

Where nothing can be timed (a CPU, Triton's interpreter) "gemm" serves by default: the interpreter tests decide the
gemv variant's correctness there. TTS_GPU_GEMV=1 forces "gemv" (after the check of 1.), =0 "gemm". `choose` sets
`frame.variant` before any CUDA graph of the engine is captured; its record is `frame.variant_choice.record`."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from tts_engine.cpu.measured import MeasuredChoice
from tts_engine.gpu.frame import VARIANTS

ENV = "TTS_GPU_GEMV"
FOLDER = "gpu_frame_variant"
ROUNDS, REPLAYS, TRIAL_BATCH = 5, 10, 1
_SOURCES = ("kernels.py", "ops.py", "frame.py", "variants.py")


def code_tag() -> str:
    """The identity of the fused frame's code (its sources, triton, torch) for the remembered choice."""
    h = hashlib.sha1(torch.__version__.encode())
    try:
        import triton
        h.update(triton.__version__.encode())
    except Exception:   # (no triton: nothing to time anyway)
        pass
    here = Path(__file__).resolve().parent
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def _key(runner, frame) -> dict:
    dev = runner.device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"

    def dims(st):
        L = st.layers[0]
        return [len(st.layers), int(st.norm.shape[0]), st.H, st.Hkv, st.hd, int(L.wgu.shape[0])]

    return {"gpu": where, "code": code_tag(), "dtype": str(runner.dtype), "talker": dims(frame.talker),
            "predictor": dims(frame.cp), "batch": TRIAL_BATCH}


def choose(runner, frame, check, interp: bool = False, timer=None) -> MeasuredChoice:
    """Set `frame.variant` to the variant that serves (module doc) -> its MeasuredChoice (also
    `frame.variant_choice`). Never raises. check(runner, frame) -> a note, raising where the frame disagrees with
    the eager frame (`backend.frame_trial`); timer(variant, frame) -> seconds of one frame in that variant (default:
    CUDA-graph replays on the runner's GPU; tests give their own)."""
    ch = MeasuredChoice("gpu frame variant", VARIANTS, env=ENV, key=None, folder=FOLDER,
                        label="fused frame's gemv variant", fallback="the gemm variant")
    frame.variant, frame.variant_choice = "gemm", ch
    try:
        mode = ch.mode()
        if mode != "auto":
            if mode == "on":   # forced, not timed; still checked against the eager frame
                frame.variant = "gemv"
                try:
                    check(runner, frame)
                finally:
                    frame.variant = "gemm"
            ch.force("gemv" if mode == "on" else "gemm")
        else:
            ch.key = _key(runner, frame)
            if not ch.recall():
                if timer is None and (interp or runner.device.type != "cuda"):
                    ch.default("gemm", "the variants are timed on a GPU (CUDA-graph replays); on a CPU the "
                                       "interpreter tests check the gemv variant")
                else:
                    _trial(runner, frame, ch, check, timer or _graph_timer(runner))
    except Exception as e:   # noqa: BLE001 - a failing variant is left out, never an outage
        ch.fall_back(f"{type(e).__name__}: {e}")
    frame.variant = ch.chosen if ch.chosen in VARIANTS else "gemm"
    return ch


def _trial(runner, frame, ch: MeasuredChoice, check, timer) -> None:
    frame.variant = "gemv"
    try:
        agree = check(runner, frame)     # raises where gemv disagrees with the eager frame
    finally:
        frame.variant = "gemm"
    order = list(VARIANTS)
    for i in range(ROUNDS):
        for v in (order if i % 2 == 0 else order[::-1]):
            ch.times[v].append(float(timer(v, frame)))
    ch.decide(note=f"batch {TRIAL_BATCH} CUDA-graph replays; gemv vs eager {agree}")


_ROW_STATE = ("pos", "step", "seen", "hidden", "c0", "max_new", "trailing_len")


def _graph_timer(runner, B: int = TRIAL_BATCH):
    """timer(variant, frame) -> ms-level seconds per replay of one frame of rows 0..B-1 captured as a CUDA graph in
    that variant (one graph per variant, kept for the trial). The rows' state and the cache positions the replays
    write are put back after each call (the rows are not serving yet: attach runs before any request)."""
    from tts_engine.model.sampling import RowParams, SamplingParams

    run = runner
    dev = run.device
    P = max(1, min(64, run.max_len - REPLAYS - 8))
    rp = RowParams.stack([SamplingParams(do_sample=False, subtalker_dosample=False)] * B, dev)
    r = run.row_index[:B]
    graphs: dict = {}

    def set_rows():
        run.pos[:B], run.step[:B], run.max_new[:B], run.trailing_len[:B] = P, 3, 1 << 20, 0

    def step(fr):
        codes = fr.predict(run.hidden[r], run.c0[r], run.step[r] - 1, rp)
        fr.advance(r, slice(0, B), rp, P + REPLAYS + 4, codes)

    def timer(variant: str, fr) -> float:
        saved = {k: getattr(run, k)[:B].clone() for k in _ROW_STATE}
        kv = (run.cache.k[:, :B, :, P:P + REPLAYS + 4].clone(), run.cache.v[:, :B, :, P:P + REPLAYS + 4].clone())
        old = fr.variant
        fr.variant = variant
        try:
            set_rows()
            g = graphs.get(variant)
            if g is None:
                s = torch.cuda.Stream(dev)
                s.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(s):   # compiles the kernels and warms the allocator outside the capture
                    step(fr)
                    step(fr)
                torch.cuda.current_stream(dev).wait_stream(s)
                set_rows()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step(fr)
                graphs[variant] = g
                set_rows()
            g.replay()                        # (one untimed replay)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAYS):
                g.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / REPLAYS
        finally:
            fr.variant = old
            for k, v in saved.items():
                getattr(run, k)[:B] = v
            run.cache.k[:, :B, :, P:P + REPLAYS + 4], run.cache.v[:, :B, :, P:P + REPLAYS + 4] = kv
    return timer
