"""The codec decode of emitted chunks on its own thread, overlapped with the generation of the next frames.

On a CPU the speech-tokenizer decoder is compute bound (its convolutions) while the per-frame generation reads
weights and is memory bound, so the two can share a few cores: the worker thread hands a chunk's codes to this
thread and goes on generating; this thread decodes the chunks one after another, in the order they were handed
over (so each sequence's chunks stay in order and its decoder state advances chunk by chunk), and puts the audio
on the sequences' output queues.

What the worker must route through here while it is on, so that nothing overtakes a chunk still being decoded:
a sequence's end (`finish`: the error or end-of-stream marker goes on its queue after its last audio). A decode
that raises fails the sequences of that decode only: their `codec_error` is set, the worker sees it at the next
frame boundary and ends them (freeing their rows), and their stream reads the error. Cancelled or failed
sequences' chunks are skipped.

`threads`: intra-op threads of this thread's torch ops (each thread that calls torch ops has its own OpenMP team;
torch.set_num_threads in a thread sets that thread's team and the process default that later threads start
with, so the default is put back right after). `nice`: this thread's scheduling priority lowered by that much (Linux:
per thread), so that where it and the frame's OpenMP threads want the same core the frame gets it first.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback

import numpy as np
import torch

log = logging.getLogger("tts_engine")

_STOP = object()


class ChunkGroup(list):
    """[(seq, frames [n, 16])] of one decode, with `frames`: the same frames already stacked [G, n, 16] (a host
    tensor), as the worker cuts them from its row buffer in one gather, so that no one stacks them again."""

    def __init__(self, items=(), frames: torch.Tensor | None = None):
        super().__init__(items)
        self.frames = frames


def decode_group(codec, items: list) -> None:
    """Decode [(seq, frames [n, 16])] (all with the same n; host arrays or tensors; a `ChunkGroup` brings them
    stacked) as one batch through `codec.decode_step`, advance each sequence's decoder state, and put each row's audio
    (float32 [n*1920]) on its sequence's output queue. Used by the worker (first chunks, or every chunk when there is
    no codec thread) and by the codec thread. The states are rows of one `CodecStatePool` (the engine's: one gather and
    one write-back per decode, whatever the batch) or standalone `CodecDecoderState`s (joined and split here). Raises
    what the decode raises; the caller fails the group's sequences."""
    states = [s.decoder_state for s, _ in items]
    frames = getattr(items, "frames", None)
    if frames is None or frames.shape[0] != len(items):
        frames = torch.stack([torch.as_tensor(f) for _, f in items])
    frames = frames.transpose(1, 2)                                                    # [G, 16, n]
    pool = getattr(states[0], "pool", None)
    if pool is not None and all(getattr(st, "pool", None) is pool for st in states):
        device = pool.state.pos.device
        wav = pool.decode(codec, [st.slot for st in states], frames.to(device, non_blocking=True))
        _put_audio(items, wav)
        return
    if any(getattr(st, "pool", None) is not None for st in states):   # (streams of two pools: each on its own)
        for item in items:
            decode_group(codec, [item])
        return
    state = states[0] if len(states) == 1 else type(states[0]).concat(states)
    wav = codec.decode_step(frames.to(state.pos.device, non_blocking=True), state)   # [G, n*1920]
    for i, (s, _) in enumerate(items):
        s.decoder_state = state if len(items) == 1 else state.select(torch.tensor([i], device=wav.device))
    _put_audio(items, wav)


def _put_audio(items: list, wav: torch.Tensor) -> None:
    """Each row of `wav` [G, samples] to its sequence's output queue (one device-to-host copy for the group)."""
    audio = wav.float().cpu().numpy()
    for i, (s, _) in enumerate(items):
        s.out.put(np.ascontiguousarray(audio[i]))


def drop_state(seq) -> None:
    """A sequence that ends gives its decoder state back (its pool slot is free again)."""
    st, seq.decoder_state = seq.decoder_state, None
    if getattr(st, "pool", None) is not None:
        st.free()


class CodecThread:
    def __init__(self, decoder_of, threads: int | None = 1, on_error=None, nice: int = 0):
        """decoder_of: () -> the CodecDecoder (read on the thread, so a lazily loaded decoder loads there once);
        threads: intra-op threads for this thread's ops (None: the process default); on_error(seq, exc): turns
        an exception into what the request's reader gets (the worker's `_user_error`)."""
        self._decoder_of = decoder_of
        self.threads = threads
        self.nice = int(nice)
        self._on_error = on_error or (lambda seq, e: e)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._in_flight = 0
        self.wake = None            # threading.Event of the worker, set after a decode failed (set by the worker)
        self.decoded_chunks = 0     # decodes done on this thread (tests, benchmarks)
        self.failed = 0             # decodes that failed (counted after their sequences' codec_error is set)

    # --- the worker's side ---------------------------------------------------------------------------------
    def decode(self, items: list, on_done=None) -> None:
        """Decode [(seq, frames [n, 16])] (all with the same n) as one batch, then put each row's audio on its
        sequence's queue; on_done(seconds): called on this thread after a decode that succeeded (its wall time)."""
        self._put(("decode", items, on_done))

    def finish(self, seq, item) -> None:
        """`seq.finish(item)` (or its codec error) once every chunk handed over before has been decoded."""
        self._put(("finish", seq, item))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job handed over so far is done; False on timeout."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Run the jobs handed over so far, then stop the thread."""
        t = self._thread
        if t is not None and t.is_alive():
            self._jobs.put(_STOP)
            t.join(timeout)
        self._thread = None

    @property
    def busy(self) -> bool:
        """A decode (or an ending) handed over is still waiting or running."""
        return not self._idle.is_set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _put(self, job) -> None:
        with self._lock:
            self._in_flight += 1
            self._idle.clear()
            if self._thread is None or not self._thread.is_alive():
                started = threading.Event()
                self._thread = threading.Thread(target=self._loop, args=(started,), name="tts-codec", daemon=True)
                self._thread.start()
                started.wait()
        self._jobs.put(job)

    # --- this thread ---------------------------------------------------------------------------------------
    def _own_threads(self) -> None:
        if self.threads is None:
            return
        default = torch.get_num_threads()   # (also initialises this thread's team from the process default)
        torch.set_num_threads(max(1, int(self.threads)))
        # torch.set_num_threads also changed the default of threads started later; put it back without touching
        # this thread's team (which is now initialised, so it keeps its own size)
        _restore_default_threads(default)

    def _lower_priority(self) -> None:
        if self.nice > 0 and hasattr(os, "setpriority"):
            tid = threading.get_native_id()   # Linux: PRIO_PROCESS with a thread id sets that thread's nice value
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))

    def _loop(self, started: threading.Event) -> None:
        try:
            self._own_threads()
        except Exception:   # never fatal: the thread just runs with the default team
            log.warning("codec thread: could not set its threads:\n%s", traceback.format_exc())
        try:
            self._lower_priority()
        except OSError as e:   # never fatal: the thread keeps the process's priority
            log.warning("codec thread: could not lower its priority: %s", e)
        started.set()
        while True:
            job = self._jobs.get()
            if job is _STOP:
                self._done()
                return
            try:
                with torch.inference_mode():
                    if job[0] == "decode":
                        self._decode(job[1], job[2])
                    else:
                        self._finish(job[1], job[2])
            except Exception:   # a bug here must not kill the thread (the requests got their error in _decode)
                log.error("codec thread job failed:\n%s", traceback.format_exc())
            finally:
                self._done()

    def _done(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight <= 0:
                self._in_flight = 0
                self._idle.set()

    def _decode(self, items: list, on_done=None) -> None:
        kept = [(s, f) for s, f in items if s.codec_error is None and not s.cancelled.is_set()
                and s.decoder_state is not None]
        if not kept:
            return
        if len(kept) != len(items):
            items = kept   # (its frames stacked again from the items kept)
        try:
            t0 = time.perf_counter()
            decode_group(self._decoder_of(), items)
            self.decoded_chunks += 1
            if on_done is not None:
                try:
                    on_done(time.perf_counter() - t0)
                except Exception:   # a measurement must never fail a decode
                    log.warning("codec thread: on_done failed:\n%s", traceback.format_exc())
        except Exception as e:
            log.error("codec decode failed for request(s) %s: %s", [s.id for s, _ in items], e)
            for s, _ in items:
                s.codec_error = self._on_error(s, e)
            self.failed += 1
            if self.wake is not None:
                self.wake.set()

    def _finish(self, seq, item) -> None:
        drop_state(seq)
        if item is None and seq.codec_error is not None:
            item = seq.codec_error
        seq.finish() if item is None else seq.finish(item)


def _restore_default_threads(n: int) -> None:
    """Set the process default of intra-op threads (what threads started later begin with) back to `n` from a
    short-lived helper thread, so the calling thread keeps its own team size."""
    t = threading.Thread(target=torch.set_num_threads, args=(n,), daemon=True)
    t.start()
    t.join()
