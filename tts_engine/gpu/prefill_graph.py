"""Batched prefill on a GPU as CUDA graphs, one per (batch bucket, token bucket, read bucket): `PrefillGraphs`.

Why: `ModelRunner.prefill_batch` runs the talker's stack over the prompts of the requests admitted together (ragged,
right-padded to the longest) eagerly: hundreds of kernel launches per call, every call, whatever its size; when 16 or
64 requests arrive at once their first audio waits for it. The stack's call has static shapes once its inputs are
padded to a bucket, so each bucket is captured once and replayed.

What a graph computes: exactly the eager call (`DecoderStack.run` over x [b, T, D] from each row's `start`, reading
R cache positions), on inputs padded to the bucket:
  - tokens: x is right-padded with zeros to the token bucket T. A row's padded positions come after its prompt, so
    causal attention hides them from its real positions; their keys land past the row's end, where its frames
    overwrite them before any read (as the eager call's own padding does);
  - batch: the bucket's extra rows run a zero prompt into rows of the cache that no sequence holds (free rows,
    `ModelRunner.params[row] is None`), which the next prefill of such a row rewrites before any read; where too few
    rows are free the batch is not padded (its exact size is the bucket);
  - read length: R = the read bucket >= the eager call's read length; keys past a row's query are masked.
So the real rows get the same values as the eager call (same computations; at other shapes, within rounding: fp32
gives the same codes, tested on a CPU with the padded step run eagerly, `capture=False`).

How a shape is chosen: on its first call it is captured (a warm-up on a side stream, then the capture) and the graph
and the eager call run on the same input through the one measured-choice mechanism (`cpu.measured.MeasuredChoice`):
the graph serves that shape where its hidden states agree with eager (relative error <= 1e-3 in fp32, 5e-2 in 16-bit)
and it is faster, else the eager call serves that shape, with one log line; the chosen path then runs once more for
real (so the cache holds the chosen path's keys). The verdict is remembered per machine (GPU, versions, dtype, the
model's shapes, these sources, the shape): a later process captures without the trial. At most MAX_SHAPES shapes are
captured (then eager). A capture or replay that raises turns that shape eager, with one log line, never a failed
request. Graphs share one memory pool (they never run at once: the model runner's one worker thread runs them).

Served only while the engine's frame graphs serve (`runner.graphs`; `follow_frame_graphs=False` for tools), in the
process that captured them. `TTS_PREFILL_GRAPHS`: unset/auto (default) as above; 0/off: never; 1/on: captured without
the timing (still checked). `TTSEngine.paths()` lists it as "prefill graphs".
"""
from __future__ import annotations

import bisect
import logging
import os
from pathlib import Path

import torch

from tts_engine.cpu.measured import DEFAULT, FELL_BACK, MEASURED, REMEMBERED, MeasuredChoice, forced_by, setting

log = logging.getLogger("tts_engine")
ENV = "TTS_PREFILL_GRAPHS"
MAX_SHAPES = 48
EAGER, GRAPH = "eager", "cuda graph"
PART = "prefill graphs"   # its `TTSEngine.paths()` entry


def _ladder(top: int, first: int) -> list[int]:
    """first, then powers of two and 1.5x between them up to `top` (1, 2, 3, 4, 6, 8, 12, 16, ...), top included: at
    most a third of a bucket is padding."""
    out, n = [], first
    while n < top:
        out.append(n)
        half = n + n // 2
        if n >= 2 and half < top and half != n:
            out.append(half)
        n *= 2
    return sorted(set(out) | {top})


def bucket(n: int, ladder: list[int]) -> int | None:
    """The smallest bucket of `ladder` >= n (None: past its top)."""
    i = bisect.bisect_left(ladder, n)
    return ladder[i] if i < len(ladder) else None


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _tol(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 5e-2


def disagree(want: torch.Tensor, got: torch.Tensor) -> str | None:
    """None where two results of the stack (hidden [B, T, D]) agree within the dtype's rounding (relative error of
    each row), else why not."""
    if want.shape != got.shape:
        return f"hidden shape {tuple(got.shape)} vs {tuple(want.shape)}"
    a, b = want.float().flatten(1), got.float().flatten(1)
    rel = ((a - b).norm(dim=1) / a.norm(dim=1).clamp_min(1e-12)).max().item()
    if not rel <= _tol(want.dtype):   # (NaN fails too)
        return f"hidden differs from eager (relative error {rel:.2e})"
    return None


class _Shape:
    """One bucket (b rows, T tokens, R read positions): static inputs (x, start, cache rows) and, captured, the graph
    and its static output hidden [b, T, D]. Without capture the same static-buffer call runs eagerly at each `run`
    (CPU tests: the padded, bucketed computation a graph would replay)."""

    def __init__(self, stack, cache, b: int, T: int, R: int, D: int, dtype, device, pool, capture: bool,
                 fill, warmups: int = 2):
        self.stack, self.cache, self.R = stack, cache, R
        self.x = torch.zeros(b, T, D, dtype=dtype, device=device)
        self.start = torch.zeros(b, dtype=torch.long, device=device)
        self.rows = torch.zeros(b, dtype=torch.long, device=device)
        self.graph = None
        self.out = None
        if not capture:
            return
        fill(self)   # the call's own inputs: the warm-up and the capture write only what the real call writes
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():   # warm-up: library handles, workspaces
            for _ in range(warmups):
                stack.run(self.x, cache, self.rows, self.start, R)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), torch.inference_mode():
            self.out = stack.run(self.x, cache, self.rows, self.start, R)
        self.graph = graph

    def run(self) -> torch.Tensor:
        """The stack over the static inputs -> hidden [b, T, D] (the graph's static output: valid until the next
        prefill)."""
        if self.graph is None:
            self.out = self.stack.run(self.x, self.cache, self.rows, self.start, self.R)
        else:
            self.graph.replay()
        return self.out


class PrefillGraphs:
    """`ModelRunner.prefill_graphs`: serves the stack call of `prefill_batch` (`run`, with `DecoderStack.run`'s
    arguments and result) per bucket as the module doc says; `entry()` says what serves (`TTSEngine.paths()`)."""

    def __init__(self, runner, capture: bool = True, mode: str | None = None, follow_frame_graphs: bool = True,
                 max_batch: int | None = None):
        """capture: False runs each bucket's padded static-buffer call eagerly instead of replaying a graph (on any
        device: how a CPU test checks the padding and the choice around the graphs). mode: "auto", "on" or "off"
        (default: TTS_PREFILL_GRAPHS). follow_frame_graphs: serve only while `runner.graphs` serves (the engine's
        CUDA graphs); False for a tool that times prefill on its own."""
        self.runner = runner
        self.capture = capture
        self.mode = mode or setting(ENV)
        self.follow = follow_frame_graphs
        top = max(1, min(max_batch or runner.rows, runner.rows))
        self.batch_ladder = _ladder(top, 1)
        self.token_ladder = _ladder(runner.max_len, 16)
        self.read_ladder = self.token_ladder
        self.shapes: dict[tuple[int, int, int], _Shape | None] = {}   # (b, T, R) -> its graph, or None: eager
        self.whys: dict[tuple[int, int, int], str] = {}
        self.hows: dict[tuple[int, int, int], str] = {}
        self.pool = None
        self.pid = os.getpid()
        self.calls = {EAGER: 0, GRAPH: 0}   # stack calls served each way (benchmarks)

    # --- serving ----------------------------------------------------------------------------------------------------
    def active(self) -> bool:
        """Whether a call now may be served by a bucket (else the eager call serves it)."""
        return self.mode != "off" and (not self.follow or self.runner.graphs is not None)

    def run(self, x: torch.Tensor, cache, rows, start: torch.Tensor, read_len: int,
            write_start: int | None = None) -> torch.Tensor:
        """`DecoderStack.run(x, cache, rows, start, read_len, write_start=...)` of the runner's talker (x [B, T, D] new
        inputs of cache rows `rows` (a slice or an index tensor) from positions `start` [B]) -> normed hidden
        [B, T, D], from a bucket's graph where one serves (a view of its static output, valid until the next prefill),
        else from the eager call."""
        stack = self.runner.talker.model

        def eager():
            self.calls[EAGER] += 1
            return stack.run(x, cache, rows, start, read_len, write_start=write_start)

        if not self.active() or (self.capture and (not x.is_cuda or torch.cuda.is_current_stream_capturing())):
            return eager()
        if self.pid != os.getpid():   # forked: the parent's graphs (if any) are not this process's
            self.shapes, self.whys, self.hows, self.pool, self.pid = {}, {}, {}, None, os.getpid()
        key, pad_rows = self._shape_of(x, read_len, write_start)
        if key is None:
            return eager()
        B, T = x.shape[:2]

        def fill(s: _Shape) -> None:
            s.x[:B, :T].copy_(x)
            s.x[:B, T:].zero_()
            s.x[B:].zero_()
            s.start[:B].copy_(start)
            s.start[B:].zero_()
            s.rows[:B].copy_(self.runner.row_index[rows] if isinstance(rows, slice) else rows)
            if pad_rows:
                s.rows[B:].copy_(torch.tensor(pad_rows, dtype=torch.long).to(s.rows.device, non_blocking=True))

        def graphed(s: _Shape):
            self.calls[GRAPH] += 1
            fill(s)
            return s.run()[:B, :T]

        if key not in self.shapes:
            return self._first(key, fill, graphed, eager, x)
        s = self.shapes[key]
        if s is None:
            return eager()
        try:
            return graphed(s)
        except Exception as e:   # noqa: BLE001 - never a failed request for it: eager from now on for this shape
            self.shapes[key] = None
            self._note(key, FELL_BACK, f"replay raised {_why(e)}")
            log.warning("tts_engine: prefill CUDA graph %s not used, eager from now on: %s", _name(key),
                        self.whys[key])
            return eager()

    def _shape_of(self, x: torch.Tensor, read_len: int, write_start: int | None):
        """(the bucket (b, T, R) of this call, the free cache rows its padding rows use) or (None, None) where the
        call has no bucket: too many rows or positions, or its padded positions would run past the cache."""
        r = self.runner
        B, T = x.shape[:2]
        b, Tb, R = bucket(B, self.batch_ladder), bucket(T, self.token_ladder), bucket(read_len, self.read_ladder)
        if b is None or Tb is None or R is None:
            return None, None
        last_start = write_start if write_start is not None else read_len - 1   # (each row's start < its length)
        if last_start + Tb > r.max_len:
            return None, None
        free = [i for i in range(r.rows) if r.params[i] is None]   # (the call's own rows hold their settings)
        if len(free) < b - B:
            b = B   # too few free rows to pad into: the exact batch is the bucket
        return (b, Tb, R), free[:b - B]

    def _first(self, key, fill, graphed, eager, x):
        """A shape's first call: capture it, choose between it and eager (module doc), serve the chosen one."""
        b, T, R = key
        if sum(s is not None for s in self.shapes.values()) >= MAX_SHAPES:
            self.shapes[key] = None
            self._note(key, DEFAULT, f"more than {MAX_SHAPES} shapes captured")
            return eager()
        choice = MeasuredChoice(f"prefill graph {_name(key)}", (EAGER, GRAPH), env=ENV, key=self._key(x, key),
                                folder="prefill_graphs", label=f"prefill CUDA graph ({_name(key)})")
        r = self.runner
        make = lambda warmups: _Shape(r.talker.model, r.cache, b, T, R, x.shape[2], x.dtype, x.device,  # noqa: E731
                                      self._pool(), self.capture, fill, warmups)
        if self.mode == "auto" and choice.recall():
            s = None
            if choice.chosen == GRAPH:
                try:
                    s = make(1)
                except Exception as e:   # noqa: BLE001
                    choice.fall_back(f"capture raised {_why(e)}")
            self.shapes[key] = s
            self._note(key, choice.record.how, choice.record.why)
            return graphed(s) if s is not None else eager()
        try:
            s = make(2)
        except Exception as e:   # noqa: BLE001 - a shape that cannot be captured is served eagerly
            choice.fall_back(f"capture raised {_why(e)}")
            s = None
        if s is not None:
            sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

            def timed(fn):
                def call():
                    out = fn().clone()   # (a graph's output is overwritten by the next replay)
                    sync()
                    return out
                return call

            rounds = 1 if self.mode == "on" else 3
            if self.mode != "on":
                # one untimed eager call: the graph was warmed before its capture, and the eager call's first run at
                # a new shape (cuBLAS's choices, the allocator) must not count against it either (where it raises,
                # the trial meets that again and falls back)
                try:
                    timed(eager)()
                except Exception:   # noqa: BLE001
                    pass
            if choice.trial({EAGER: timed(eager), GRAPH: timed(lambda: graphed(s))}, rounds, check=disagree):
                if self.mode == "on":
                    choice.force(GRAPH, f"{ENV}=on (checked against eager)")
                else:
                    choice.decide(min_samples=2)
        chosen = choice.chosen if s is not None else EAGER
        self.shapes[key] = s if chosen == GRAPH else None
        self._note(key, choice.record.how, choice.record.why)
        return graphed(s) if chosen == GRAPH else eager()   # once more, for real: the cache holds this path's keys

    def _pool(self):
        if self.pool is None and self.capture:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _key(self, x: torch.Tensor, key) -> dict:
        """What a remembered verdict holds for: this GPU, the versions, the dtype, the model's shapes, this code (and
        the stack's), the bucket."""
        from tts_engine.gpu.shapes import device_key, model_shapes

        here = Path(__file__).resolve()
        return {**device_key(x.device, here, here.parent.parent / "model" / "layers.py"), "dtype": str(x.dtype),
                "shapes": model_shapes(self.runner), "bucket": list(key)}

    def _note(self, key, how: str, why: str) -> None:
        self.whys[key] = f"{_name(key)}: {why}" if why else _name(key)
        self.hows[key] = how

    # --- what serves --------------------------------------------------------------------------------------------------
    def entry(self) -> dict[str, str]:
        """{"path", "how", "why"}: the buckets served by graphs and those served eagerly, and why."""
        if self.mode == "off":
            return {"path": EAGER, "how": forced_by(ENV), "why": f"{ENV}=off"}
        if self.follow and self.runner.graphs is None:
            return {"path": EAGER, "how": DEFAULT, "why": "the engine's CUDA graphs are off"}
        graphed = sorted(k for k, s in self.shapes.items() if s is not None)
        eager = sorted(k for k, s in self.shapes.items() if s is None)
        path = GRAPH + "s" if graphed else EAGER
        why = (f"graphs for {', '.join(map(_name, graphed)) or 'no bucket yet'} (rows x tokens x read positions; "
               f"captured on first use)")
        if eager:
            why += "; eager for " + "; ".join(self.whys[k] for k in eager)
        hows = {self.hows.get(k) for k in self.shapes}
        how = forced_by(ENV) if self.mode == "on" else REMEMBERED if hows == {REMEMBERED} else \
            MEASURED if self.shapes else DEFAULT
        return {"path": path, "how": how, "why": why}


def _name(key) -> str:
    return "x".join(map(str, key))


def attach(runner) -> PrefillGraphs | None:
    """Serve `runner`'s batched prefill through CUDA graphs per bucket (module doc) where it runs on a CUDA device and
    the variable allows -> the `PrefillGraphs` set as `runner.prefill_graphs` and listed in its `path_entries` (None:
    nothing changed)."""
    if runner.device.type != "cuda":
        return None
    pg = PrefillGraphs(runner)
    runner.prefill_graphs = pg
    runner.path_entries[PART] = pg
    return pg
