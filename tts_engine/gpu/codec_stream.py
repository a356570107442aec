"""The codec's decodes on a CUDA stream of their own, beside the frames, where that measures faster: `CodecStream`.

Why: on a GPU the frames (CUDA graph replays) and the codec's decodes share one stream, so while a decode handed to the
codec thread (`EngineWorker.overlap_codec`) runs, the frames the worker queues after it wait for it, however idle the
GPU is: both are launch- and latency-bound at a few dozen streams. On a stream of its own a decode runs beside the
next frames.

How (`scope()`, around one decode): the codec's stream first waits for what is queued so far on the caller's stream
(the decode's inputs: codes copied in, states written by the worker), the decode is queued on its own stream, and
before the scope ends the caller's thread waits on the host for that stream alone (an event), not for the frames
queued meanwhile, so whatever follows the decode (the audio's copy to the host, the next decode, a state pool that
grows) reads finished outputs, and memory the decode made is never reused while it runs.

Which (a measured choice, `cpu.measured.MeasuredChoice`, "codec stream" in `TTSEngine.paths()`): `measure(frame,
decode)` times a decode on a second thread while this one queues frames, on the frames' stream ("same stream") and on
its own ("own stream"), wall time until both are done; the faster is remembered per machine (GPU, versions, this
code). Serving never measures inside a request: it takes the remembered verdict, else the same stream, until
`python -m bench gpu_frame --codec-rows ...` (the GPU session's step) has measured it on this machine.
`TTS_CODEC_STREAM`: unset/auto as above; 1/on: its own stream; 0/off: the same stream. A stream operation that raises
turns the own stream off for this process, with one log line; the decode then runs on the caller's stream.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import torch

from tts_engine.cpu.measured import FELL_BACK, MeasuredChoice, setting

log = logging.getLogger("tts_engine")
ENV = "TTS_CODEC_STREAM"
SAME, OWN = "same stream", "own stream"
FOLDER = "codec_stream"


class CudaStreams:
    """The CUDA stream operations `CodecStream` uses (a seam: CPU tests put a recording stand-in here)."""

    def available(self, device) -> bool:
        return torch.device(device).type == "cuda"

    def new(self, device):
        return torch.cuda.Stream(device=device)

    def current(self, device):
        return torch.cuda.current_stream(device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def done_event(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def synchronize(self, device) -> None:
        torch.cuda.synchronize(device)


class CodecStream:
    """Where one process's codec decodes run on a GPU (module doc). `scope(device)` around a decode; `entry()` says
    what serves."""

    def __init__(self, mode: str | None = None, streams: CudaStreams | None = None):
        self.mode = mode or setting(ENV)
        self.streams = streams or CudaStreams()
        self.side: dict = {}   # device -> its own stream
        self.failed = False
        self.choice = self._new_choice()
        self._resolved = False

    @staticmethod
    def _new_choice() -> MeasuredChoice:
        return MeasuredChoice("codec stream", (SAME, OWN), env=ENV, folder=FOLDER, label="codec's own CUDA stream",
                              fallback="the frames' stream", process=True)

    def key(self, device) -> dict:
        """What a remembered verdict holds for: this GPU, the versions, this code."""
        from tts_engine.gpu.shapes import device_key

        return device_key(torch.device(device), Path(__file__))

    def _resolve(self, device) -> None:
        """The choice for this process, once: forced by the variable, remembered, or the same stream until measured."""
        if self._resolved:
            return
        self._resolved = True
        c = self.choice
        if not self.streams.available(device):
            c.default(SAME, "no CUDA: one stream")
            return
        c.key = self.key(device)
        if self.mode == "on":
            c.force(OWN)
        elif self.mode == "off":
            c.force(SAME)
        elif not c.recall():
            c.default(SAME, "not measured on this GPU yet (python -m bench gpu_frame --codec-rows measures it)")

    def own(self, device) -> bool:
        """Whether a decode on `device` runs on the codec's own stream now."""
        self._resolve(device)
        return self.choice.chosen == OWN and not self.failed

    @contextlib.contextmanager
    def scope(self, device, force: bool | None = None):
        """Around one decode on `device`: on the codec's own stream where chosen (`force`: True/False overrides the
        choice, for `measure`), else nothing changes (module doc)."""
        use = self.own(device) if force is None else force
        if not use:
            yield
            return
        s = self.streams
        ctx = None
        try:
            side = self.side.get(device)
            if side is None:
                side = self.side[device] = s.new(device)
            side.wait_stream(s.current(device))
            ctx = s.use(side)
            ctx.__enter__()
        except Exception as e:   # noqa: BLE001 - the decode runs on the caller's stream instead
            self._fail(e)
            ctx = None
        if ctx is None:
            yield
            return
        ok = False
        try:
            yield
            ok = True
        finally:
            ctx.__exit__(None, None, None)
            try:
                s.done_event(side).synchronize()   # this thread waits for the decode only
            except Exception as e:   # noqa: BLE001
                self._fail(e)
                if ok:
                    s.synchronize(device)   # (everything, to be safe, before the outputs are read)

    def _fail(self, e: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self.choice.fall_back(f"{type(e).__name__}: {e}".splitlines()[0][:300])

    def measure(self, device, frame, decode, frames: int = 4, rounds: int = 5) -> dict:
        """Time a decode on a second thread while this thread queues `frames` frames, on the same stream and on the
        codec's own -> {candidate: median ms} (also the choice made and remembered, `entry()`). frame(): queue one
        frame on this thread's stream; decode(): one decode, as the codec thread runs it (it ends with its audio on the
        host, or a synchronisation)."""
        c = self.choice = self._new_choice()
        c.key = self.key(device)
        self.failed, self._resolved = False, True

        def both(own: bool):
            err = []

            def codec():
                try:
                    with self.scope(device, force=own):
                        decode()
                except Exception as e:   # noqa: BLE001
                    err.append(e)

            t = threading.Thread(target=codec)
            t.start()
            for _ in range(frames):
                frame()
            t.join()
            self.streams.synchronize(device)
            if err:
                raise err[0]

        for fn in (lambda: both(False), lambda: both(True)):   # warm-up (the stream, the allocator)
            fn()
        if c.trial({SAME: lambda: both(False), OWN: lambda: both(True)}, rounds):
            c.decide(min_samples=2, note=f"a decode beside {frames} frames")
        if self.failed or c.record.how == FELL_BACK:
            return {}
        return {k: round(1e3 * v, 3) for k, v in c.medians().items()}

    def entry(self) -> dict[str, str]:
        return self.choice.entry()


_shared: CodecStream | None = None
_lock = threading.Lock()


def shared() -> CodecStream:
    """This process's `CodecStream` (one choice per machine: every codec decoder of the process uses it)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = CodecStream()
        return _shared
