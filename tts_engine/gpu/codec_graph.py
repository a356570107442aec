"""The codec decoder's step on a GPU as CUDA graphs, one per (rows, frames) shape: `attach(decoder)`.

Why: the decoder (`codec/decoder.py`, `CodecDecoder.decode_step_eager`) is hundreds of small kernels per call; on an
H200 an eager call cost ~120 ms whatever its size, launch-bound, more than the frames it decodes take to generate
(docs/benchmarks.md, "GPU: NVIDIA H200"). Its step has fixed shapes for a given (rows B, frames n): the codes
[B, 16, n] and the streaming state (`CodecDecoderState`: conv histories, the transformer's window, positions), so
each shape is captured once and replayed.

How a shape is served: on its first call it is captured into a static graph (inputs copied in, outputs copied out,
so the caller's state objects stay their own; a `CodecStatePool`'s decode instead gathers its rows straight into the
graph's inputs and writes the outputs straight back, `decode_pooled`: one copy of the state each way) and the graph
and the eager step are run on the same input through the one measured-choice mechanism
(`cpu.measured.MeasuredChoice`): the graph serves that shape when it gives the eager step's audio and state (within
the dtype's rounding) and is faster; otherwise, or when the capture raises, the eager step serves that shape, with one
log line. The verdict is remembered per machine (GPU, versions, dtype, the codec's
config, these sources, the shape): a later process (a restart, a ZeroGPU worker) captures without the trial. At
most MAX_SHAPES shapes are captured (then eager). Graphs share one
memory pool (they never run at once: a lock orders their use across the worker and codec threads).

`TTS_CODEC_GRAPHS`: unset/auto (default) as above; 0/off: never (eager); 1/on: captured without the timing (still
checked). A graph is only valid in the process that captured it: in a forked process (a ZeroGPU worker) the shapes
start over.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import torch

from tts_engine.cpu.measured import (DEFAULT, FELL_BACK, MEASURED, REMEMBERED, MeasuredChoice, forced_by, note,
                                     setting)
from tts_engine.gpu import codec_stream

log = logging.getLogger("tts_engine")
ENV = "TTS_CODEC_GRAPHS"
MAX_SHAPES = 32
EAGER, GRAPH = "eager", "cuda graph"


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def _state_tensors(state) -> list[torch.Tensor]:
    return [*state.convs, state.k, state.v, state.pos]


def _disagree(a, b) -> str | None:
    """None where two results (wav, state) of the same step agree within the dtype's rounding, else why not."""
    (wa, sa), (wb, sb) = a, b
    tol = _tol(wa.dtype)
    pairs = [("audio", wa, wb)] + [(f"state tensor {i}", x, y)
                                    for i, (x, y) in enumerate(zip(_state_tensors(sa), _state_tensors(sb)))]
    for what, x, y in pairs:
        if x.shape != y.shape:
            return f"{what}: shape {tuple(y.shape)} vs {tuple(x.shape)}"
        if x.dtype == torch.long:
            if not torch.equal(x, y):
                return f"{what} differs"
            continue
        d = (x.float() - y.float()).abs().max().item() if x.numel() else 0.0
        if not d <= tol * max(1.0, x.float().abs().max().item()):
            return f"{what} differs by {d:.3g}"
    return None


class _Graph:
    """One captured step of `decoder` for B rows x n frames: static codes and state in, static audio and state out."""

    def __init__(self, decoder, state, n: int, pool, capture: bool = True, warmups: int = 2):
        B = state.batch_size
        dev = state.pos.device
        self.decoder = decoder
        self.codes = torch.zeros(B, decoder.cfg.num_quantizers, n, dtype=torch.long, device=dev)
        self.state_in = state.clone()
        self.graph = None
        if not capture:   # the same static buffers, the step run eagerly on them at each `run` (CPU tests)
            return
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), torch.inference_mode():   # warm-up: library handles, workspaces
            for _ in range(warmups):
                decoder.decode_step_eager(self.codes, self.state_in.clone())
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        s = self.state_in
        out = type(s)(list(s.convs), s.k, s.v, s.pos)   # read by the step, its fields replaced by the outputs
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"), torch.inference_mode():
            self.wav = decoder.decode_step_eager(self.codes, out)
        self.state_out = out

    def replay(self, codes: torch.Tensor) -> torch.Tensor:
        """The step on `codes` [B, 16, n] from the static input state (`state_in`, filled by the caller) -> audio
        [B, n * 1920] (a new tensor); the advanced state is in `state_out` (static buffers, until the next replay)."""
        self.codes.copy_(codes)
        if self.graph is None:
            s = self.state_in
            self.state_out = type(s)(list(s.convs), s.k, s.v, s.pos)
            self.wav = self.decoder.decode_step_eager(self.codes, self.state_out)
        else:
            self.graph.replay()
        return self.wav.clone()

    def run(self, codes: torch.Tensor, state) -> torch.Tensor:
        """The step on `codes` [B, 16, n], advancing `state` (its fields replaced by new tensors, as the eager step
        does) -> audio [B, n * 1920] (a new tensor)."""
        for dst, src in zip(_state_tensors(self.state_in), _state_tensors(state)):
            dst.copy_(src)
        wav = self.replay(codes)
        o = self.state_out
        state.convs, state.k, state.v, state.pos = [c.clone() for c in o.convs], o.k.clone(), o.v.clone(), \
            o.pos.clone()
        return wav


class CodecGraphs:
    """`decoder.fast_step`: serves `decode_step(codes, state)` per shape as the module doc says; `record()` says
    what serves (also listed by `TTSEngine.paths()` as "codec graphs")."""

    def __init__(self, decoder, capture: bool = True):
        """capture: False runs each shape's static-buffer step eagerly instead of replaying a graph (on any
        device: how a CPU test checks the copy-in / copy-out and the choice around the graphs)."""
        self.decoder = decoder
        self.capture = capture
        self.mode = setting(ENV)
        self.shapes: dict[tuple[int, int], _Graph | None] = {}   # (B, n) -> graph, or None: eager for that shape
        self.whys: dict[tuple[int, int], str] = {}
        self.hows: dict[tuple[int, int], str] = {}
        self.pool = None
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.stream = codec_stream.shared()   # where its decodes run: the frames' CUDA stream or their own (measured)

    def __call__(self, codes: torch.Tensor, state) -> torch.Tensor:
        dec = self.decoder
        if self.mode == "off" or (self.capture and (not codes.is_cuda or torch.cuda.is_current_stream_capturing())):
            return dec.decode_step_eager(codes, state)
        with self.lock:
            if self.pid != os.getpid():   # forked: the parent's graphs (if any) are not this process's
                self.shapes, self.whys, self.hows, self.pool, self.pid = {}, {}, {}, None, os.getpid()
            key = (state.batch_size, codes.shape[-1])
            if key not in self.shapes:
                return self._first(key, codes, state)
            g = self.shapes[key]
            if g is None:
                with self.stream.scope(codes.device):   # (its own CUDA stream where that measured faster)
                    return dec.decode_step_eager(codes, state)
            try:
                with self.stream.scope(codes.device):
                    return g.run(codes, state)
            except Exception as e:   # noqa: BLE001 - never a failed decode for it: eager from now on for this shape
                self.shapes[key] = None
                self._why(key, FELL_BACK, f"replay raised {type(e).__name__}: {e}")
                log.warning("tts_engine: codec CUDA graph %dx%d not used, eager from now on: %s", *key,
                            self.whys[key])
                return dec.decode_step_eager(codes, state)

    def decode_pooled(self, codes: torch.Tensor, pool, slots: list[int]) -> torch.Tensor | None:
        """`CodecStatePool.decode`'s step where a graph serves its shape (rows x frames): the pool's rows `slots`
        gathered straight into the graph's static input state, the graph replayed, its static output state written
        straight back into the pool's rows: one copy of the state each way (rather than a gathered state copied in,
        the outputs cloned out, then written back) -> audio [G, n * 1920]. None where no graph serves this shape (not
        captured yet, measured eager, off, not on CUDA): the pool then decodes through `decode_step` as usual (a
        shape's first call is measured there). A replay that raises turns the shape eager (one log line) and gives
        None, the pool's rows untouched where the gather or the replay raised."""
        if self.mode == "off" or (self.capture and (not codes.is_cuda or torch.cuda.is_current_stream_capturing())):
            return None
        with self.lock:
            if self.pid != os.getpid():
                return None   # (`__call__` starts the shapes over in a forked process)
            key = (len(slots), codes.shape[-1])
            g = self.shapes.get(key)
            if g is None:
                return None
            try:
                with self.stream.scope(codes.device):
                    pool.read_into(slots, g.state_in)
                    wav = g.replay(codes)
                    pool.write(slots, g.state_out)
                return wav
            except Exception as e:   # noqa: BLE001 - never a failed decode for it: eager from now on for this shape
                self.shapes[key] = None
                self._why(key, FELL_BACK, f"replay raised {type(e).__name__}: {e}")
                log.warning("tts_engine: codec CUDA graph %dx%d not used, eager from now on: %s", *key,
                            self.whys[key])
                return None

    def _first(self, key, codes, state):
        dec = self.decoder
        B, n = key
        if sum(g is not None for g in self.shapes.values()) >= MAX_SHAPES:
            self.shapes[key] = None
            self._why(key, DEFAULT, f"more than {MAX_SHAPES} shapes captured")
            return dec.decode_step_eager(codes, state)
        choice = MeasuredChoice(f"codec graph {B}x{n}", (EAGER, GRAPH), env=ENV, key=self._key(codes, B, n),
                                folder="codec_graphs", label=f"codec CUDA graph ({B} rows x {n} frames)")
        if self.mode == "auto" and choice.recall():
            g = None
            if choice.chosen == GRAPH:
                try:
                    g = _Graph(dec, state, n, self._pool(), self.capture, warmups=1)
                except Exception as e:   # noqa: BLE001
                    choice.fall_back(f"capture raised {type(e).__name__}: {e}")
            self.shapes[key] = g
            self._why(key, choice.record.how, choice.record.why)
            return g.run(codes, state) if g is not None else dec.decode_step_eager(codes, state)
        try:
            g = _Graph(dec, state, n, self._pool(), self.capture)
        except Exception as e:   # noqa: BLE001 - a shape that cannot be captured is served eagerly
            choice.fall_back(f"capture raised {type(e).__name__}: {e}")
            g = None
        if g is not None:
            sync = torch.cuda.synchronize if codes.is_cuda else (lambda: None)

            def eager(c, s):
                s = s.clone()
                w = dec.decode_step_eager(c, s)
                sync()
                return w, s

            def graphed(c, s):
                s = s.clone()
                w = g.run(c, s)
                sync()
                return w, s

            rounds = 1 if self.mode == "on" else 3
            if choice.trial({EAGER: eager, GRAPH: graphed}, rounds, inputs=lambda i: (codes, state),
                            check=_disagree):
                if self.mode == "on":
                    choice.force(GRAPH, f"{ENV}=on (checked against eager)")
                else:
                    choice.decide(min_samples=2)
        chosen = choice.chosen if g is not None else EAGER
        self.shapes[key] = g if chosen == GRAPH else None
        self._why(key, choice.record.how, choice.record.why)
        return g.run(codes, state) if chosen == GRAPH else dec.decode_step_eager(codes, state)

    def _pool(self):
        if self.pool is None and self.capture:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _key(self, codes, B: int, n: int) -> dict:
        """What a remembered verdict holds for: this GPU, the versions, the dtype, the codec, this code, the shape."""
        from tts_engine.gpu.shapes import device_key

        here = Path(__file__).resolve()
        return {**device_key(codes.device, here, here.parent.parent / "codec" / "decoder.py"),
                "dtype": str(self.decoder.pre_conv.conv.weight.dtype), "rows": B, "frames": n,
                "codec": hashlib.sha1(json.dumps(vars(self.decoder.cfg), sort_keys=True, default=str).encode())
                .hexdigest()[:12]}

    def _why(self, key, how: str, why: str) -> None:
        self.whys[key] = f"{key[0]}x{key[1]}: {why}" if why else f"{key[0]}x{key[1]}"
        self.hows[key] = how
        rec = self.record()
        note("codec graphs", rec["path"], rec["how"], rec["why"])

    def record(self) -> dict[str, str]:
        """{"path", "how", "why"}: the shapes served by graphs and those served eagerly, and why."""
        if self.mode == "off":
            return {"path": EAGER, "how": forced_by(ENV), "why": f"{ENV}=off"}
        graphed = sorted(k for k, g in self.shapes.items() if g is not None)
        eager = sorted(k for k, g in self.shapes.items() if g is None)
        path = GRAPH + "s" if graphed else EAGER
        why = f"graphs for {', '.join(f'{b}x{n}' for b, n in graphed) or 'no shape yet'}"
        if eager:
            why += "; eager for " + "; ".join(self.whys[k] for k in eager)
        hows = {self.hows.get(k) for k in self.shapes}
        how = forced_by(ENV) if self.mode == "on" else REMEMBERED if hows == {REMEMBERED} else \
            MEASURED if self.shapes else DEFAULT
        return {"path": path, "how": how, "why": why}


def attach(decoder) -> CodecGraphs | None:
    """Serve `decoder`'s steps through CUDA graphs per shape (module doc) where it runs on a CUDA device and the
    variable allows -> the `CodecGraphs` installed as `decoder.fast_step` (None: nothing changed)."""
    if setting(ENV) == "off":
        note("codec graphs", EAGER, forced_by(ENV), f"{ENV}=off")
        return None
    p = next(decoder.parameters(), None)
    if p is None or p.device.type != "cuda":
        return None
    decoder.fast_step = CodecGraphs(decoder)
    return decoder.fast_step
