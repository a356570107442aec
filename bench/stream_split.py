"""Where a stream's per-frame wall time goes, measured in the running engine: `stream_split(engine, frames)`, or
`python -m bench stream_split [--arch small] [--quantize w8a8] [--frames 24]` on a random-weight CPU engine.

`speed.profile_frame` times the frame's parts one after another in the caller's thread with nothing beside them
(no codec thread, no thread governor): the parts' own cost. This one times a real stream through the public API
(`common.run_concurrency`, one stream) with the engine's own threads as they serve it, by wrapping the engine's parts
on this instance (`TTSEngine.wrap`, restored after; nothing else changes), and splits the wall time per
frame into:
  code_predictor_ms   the predictor's frame ("code predictor": 15 passes, heads, sampling)
  talker_step_ms      the talker step ("talker step": embeddings, stack, codec head, codebook-0 sampling),
  talker_stack_ms       of which the talker's decoder stack call (`DecoderStack.run`)
  between_halves_ms   between the two halves of a split frame: the chunk decoded here, or handed to the codec thread
  emit_ms             chunks emitted after a frame (outside the halves; a stream's last chunk)
  prefill_ms          the request's prompt, per frame
  glue_ms             the rest of the worker's frame steps: Python and host work between the parts (row views,
                      sampling settings, end flags, bookkeeping, the thread governor)
  outside_steps_ms    wall time outside the worker's frame steps: submit, the worker's wake-up, the codec thread's
                      decode of the last chunks after the last frame, the stream's reader (less the end of the last
                      step, which may run on after the reader got its end: the parts add up to the wall time only
                      about that closely)
  codec_thread_ms / codec_thread_cpu_ms   the codec thread's decodes (wall, and its CPU time), overlapped
  worker_cpu_ms       the worker thread's CPU time per frame in its steps (its wall minus this: waiting for a core,
                      for OpenMP threads, or on locks)
Every figure is ms per frame (the stream's wall time over its frames). Wrapping costs a few microseconds per call.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

from bench.common import run_concurrency

PARTS = ("code_predictor", "talker_step", "talker_stack", "between_halves", "emit", "prefill", "glue",
         "outside_steps", "codec_thread", "codec_thread_cpu", "worker_cpu")


class _Timer:
    """Inclusive wall time per key and, per thread, the time of each call less the wrapped calls inside it."""

    def __init__(self):
        self.incl = defaultdict(float)
        self.excl = defaultdict(float)
        self.cpu = defaultdict(float)
        self.calls = defaultdict(int)
        self._local = threading.local()

    def wrap(self, engine, part: str, key: str, only_inside: str | None = None, cpu: bool = False):
        """Time every call of the engine's `part` (`TTSEngine.wrap`) under `key`; only_inside: count only calls made
        while the innermost timed call is `only_inside`. -> a function that restores it."""
        return engine.wrap(part, lambda orig: self._timed(orig, key, only_inside, cpu))

    def _timed(self, orig, key: str, only_inside: str | None, cpu: bool):
        def timed(*args, **kw):
            stack = getattr(self._local, "stack", None)
            if stack is None:
                stack = self._local.stack = []
            if only_inside is not None and (not stack or stack[-1][0] != only_inside):
                return orig(*args, **kw)
            entry = [key, 0.0]
            stack.append(entry)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return orig(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                stack.pop()
                self.incl[key] += dt
                self.excl[key] += dt - entry[1]
                self.calls[key] += 1
                if cpu:
                    self.cpu[key] += time.thread_time() - c0
                if stack:
                    stack[-1][1] += dt
        return timed


@contextlib.contextmanager
def _instrumented(engine, timer: _Timer):
    undo = [timer.wrap(engine, "worker step", "step", cpu=True),
            timer.wrap(engine, "prefill", "prefill"),
            timer.wrap(engine, "emit", "emit"),
            timer.wrap(engine, "code predictor", "code_predictor"),
            timer.wrap(engine, "talker step", "talker_step"),
            timer.wrap(engine, "between halves", "between_halves"),
            timer.wrap(engine, "talker stack", "talker_stack", only_inside="talker_step")]
    if engine.worker.codec is not None:
        undo.append(timer.wrap(engine, "codec thread", "codec_thread", cpu=True))
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def stream_split(engine, frames: int, first_chunk: int = 1) -> dict:
    """One stream of `frames` frames through the engine as it is configured -> {part_ms: ms per frame} (module doc),
    with "wall_ms" (the stream's wall time per frame) and "xrt" (its x real time)."""

    timer = _Timer()
    with _instrumented(engine, timer):
        row = run_concurrency(engine, 1, frames, first_chunk)
        if engine.worker.codec is not None:
            engine.worker.codec.drain(30)
    per = 1000.0 / frames
    wall = row["wall_s"] * per
    out = {"wall_ms": wall, "xrt": row["xrt_p50"],
           "code_predictor_ms": timer.incl["code_predictor"] * per,
           "talker_step_ms": timer.incl["talker_step"] * per,
           "talker_stack_ms": timer.incl["talker_stack"] * per,
           "between_halves_ms": timer.incl["between_halves"] * per,
           "emit_ms": (timer.incl["emit"] - _emit_inside_halves(timer)) * per,
           "prefill_ms": timer.incl["prefill"] * per,
           "glue_ms": timer.excl["step"] * per,
           "outside_steps_ms": wall - timer.incl["step"] * per,
           "codec_thread_ms": timer.incl["codec_thread"] * per,
           "codec_thread_cpu_ms": timer.cpu["codec_thread"] * per,
           "worker_cpu_ms": timer.cpu["step"] * per}
    return out


def _emit_inside_halves(timer: _Timer) -> float:
    """Seconds of "emit" calls made between the halves (counted in between_halves already)."""
    return timer.incl["between_halves"] - timer.excl["between_halves"]


def split_line(s: dict, label: str) -> str:
    """One line of the split for the bench's report."""
    return (f"{label}: wall {s['wall_ms']:.1f} ms per frame ({s['xrt']:.2f}x real time) = code predictor "
            f"{s['code_predictor_ms']:.1f} + talker step {s['talker_step_ms']:.1f} (its stack call "
            f"{s['talker_stack_ms']:.1f}) + between the halves {s['between_halves_ms']:.1f} + chunks after frames "
            f"{s['emit_ms']:.1f} + prefill {s['prefill_ms']:.1f} + glue {s['glue_ms']:.1f} + outside the frame steps "
            f"{s['outside_steps_ms']:.1f}; codec thread {s['codec_thread_ms']:.1f} wall / "
            f"{s['codec_thread_cpu_ms']:.1f} CPU (overlapped); worker CPU {s['worker_cpu_ms']:.1f}.")


@contextlib.contextmanager
def codec_in_worker(engine):
    """Every chunk decodes in the worker thread between frames for a while (the engine's codec thread, if any,
    set aside idle and put back after): the same stream with nothing running beside its frames."""
    worker = engine.worker
    codec = worker.codec
    if codec is not None:
        codec.drain(30)
    worker.codec = None
    try:
        yield
    finally:
        worker.codec = codec


def split_lines(engine, frames: int) -> list[str]:
    """The bench's lines: the stream as the engine serves it, and (where it has a codec thread) the same stream with
    the chunks decoded in the worker; the difference in the predictor's and the talker's time is what the codec
    thread beside them costs them."""
    s = stream_split(engine, frames)
    lines = [split_line(s, "One stream as served")]
    if engine.worker.codec is not None:
        with codec_in_worker(engine):
            w = stream_split(engine, frames)
        lines.append(split_line(w, "The same with every chunk decoded in the worker"))
        lost = (s["code_predictor_ms"] + s["talker_step_ms"]) - (w["code_predictor_ms"] + w["talker_step_ms"])
        lines.append(f"The codec thread beside the frames: code predictor + talker step {lost:+.1f} ms per frame; "
                     f"wall {s['wall_ms'] - w['wall_ms']:+.1f} ms per frame.")
    return lines


def main(argv=None) -> int:
    import argparse

    import torch

    from bench.common import command, device_name, load_average, random_checkpoint
    from tts_engine.engine.engine import TTSEngine

    p = argparse.ArgumentParser(prog="python -m bench stream_split", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="small", choices=["tiny", "small", "0.6b", "1.7b"])
    p.add_argument("--quantize", default="none", help="int8, int4, w8a8, w4a8, auto or none")
    p.add_argument("--frames", type=int, default=24)
    a = p.parse_args(argv)
    engine = TTSEngine.from_pretrained(str(random_checkpoint(a.arch)), device="cpu",
                                       quantize=None if a.quantize == "none" else a.quantize, max_batch=1,
                                       max_seq_len=a.frames + 200)
    engine.speakers_for_bench = engine.speakers
    run_concurrency(engine, 1, 4, 1)   # warm-up
    print(f"{device_name(torch.device('cpu'))}; {a.arch} random weights, {engine.precision}; {load_average()}. "
          f"Command: `{command('stream_split', argv)}`\n")
    print("\n".join(f"- {line}" for line in split_lines(engine, a.frames)))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
