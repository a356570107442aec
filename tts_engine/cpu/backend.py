"""The CPU backend: the one place where a model runner gets its CPU fast paths.

`CpuBackend(...).attach(runner)` runs once, when the runner has allocated its state (`engine/backends.py` calls
it for a runner on a CPU). In this order, each step falling back to the plain PyTorch path with one log line:

  1. our one C++ library, loaded (built at install), else built now or in the background (`build_libraries`);
  2. 16-bit and quantised models: q/k/v and gate/up as one matmul each (`Talker.fuse_projections`; fp32 keeps the
     checkpoint's layout, for bit-for-bit parity with the official implementation);
  3. each decoder stack's decode step in one C++ call (`fused_step`), its trial run now;
  4. the code predictor's 15 passes of a frame in one call (`predictor_frame`), its trial run now on random inputs;
  5. the talker's whole step in one call (`talker_step`), its trial run now on row 0;
     (3-5 at a fresh bounded start, `deferred_trials.bounded()`: only their agreement checks run now, the fast path
     serves as the default, and the timed trials run while idle on scratch state (`deferred_trials.AtBoundary`);
     each verdict is remembered and applied by the engine's thread at a frame boundary with no row held,
     `between_frames`)
  6. optionally, one-row predictor passes through a compiled graph (`compiled_predictor`);
  7. the thread governor's "matmul" option: every linear layer's forward wrapped (`threads.serial_between_matmuls`);
     the governor itself goes to the engine's worker (`thread_governor`);
  8. the runner's step scope: oneDNN off around 1-2 row bf16 steps (`aten_bf16_gemv`).

What serves each part afterwards: the records each step writes to `runner.path_entries` (a `measured.MeasuredChoice`
or `measured.Record` per part; `TTSEngine.paths()` lists them).

`set_hooks()` gives model/quant.py and codec/decoder.py the CPU kernels they call (the quantised layouts' own
kernels and kernel table; the codec's packed and int8 convolutions and fused snake): run when this package is
imported (tts_engine/cpu/__init__.py), it is the only way model/ and codec/ code reaches tts_engine.cpu.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from tts_engine.cpu.kernels import onednn_off, onednn_on, onednn_outside

log = logging.getLogger("tts_engine")

ATEN_GEMV_MAX_ROWS = 2   # bf16 on a CPU: up to this many rows, PyTorch's own gemv beats oneDNN's (see below)
GOVERN_THREADS_ENV = "TTS_GOVERN_THREADS"   # 0 / off: keep the process's threads in every frame


@contextlib.contextmanager
def aten_bf16_gemv(on: bool):
    """On a CPU, a bf16 linear with 1-2 input rows reads its weights ~1.7x faster through PyTorch's own
    matrix-vector kernel than through oneDNN's (measured on a 2-core Zen 4: 3072x1024, 1 row, 0.23 vs 0.39 ms;
    from 4 rows on oneDNN wins), so the per-frame step of a small bf16 batch turns oneDNN off while it runs.
    The switch is process-wide (another thread running a linear meanwhile only takes the other kernel)."""
    if not on:
        yield
        return
    with onednn_off():
        yield


@contextlib.contextmanager
def onednn_as_outside():
    """oneDNN as it is outside every thread's `aten_bf16_gemv` (the codec decodes between a frame's halves: its
    layers need oneDNN), read from the switch itself: another engine's worker may hold oneDNN off meanwhile."""
    if torch._C._get_mkldnn_enabled() or not onednn_outside():
        yield
        return
    with onednn_on():
        yield


def build_libraries() -> str:
    """Our one C++ library: loaded where it was built (at install: `python -m tts_engine.cpu.build`), else built now
    or in the background (`cpu_build.prepare`, TTS_CPU_BUILD) before any measured choice is timed -> what happened,
    one line. The one place the backend builds; never raises."""
    from tts_engine.cpu import cpu_build

    return cpu_build.prepare()


class CpuBackend:
    """The CPU fast paths of one model runner. compile_predictor: serve one-row predictor passes through a compiled
    graph (None: env TTS_COMPILE_PREDICTOR, off by default); govern_threads: let a `threads.ThreadGovernor` choose
    each frame's OpenMP threads (None: env TTS_GOVERN_THREADS, on by default; 16-bit and quantised models with 2+
    threads only)."""

    name = "cpu"

    def __init__(self, compile_predictor: bool | None = None, govern_threads: bool | None = None):
        self.compile_predictor_wanted = compile_predictor
        self.govern_threads_wanted = govern_threads
        self.runner = None
        self.gemv_rows = 0             # steps of up to this many rows run with oneDNN off (`aten_bf16_gemv`)
        self.governor = None           # threads.ThreadGovernor for the worker (None: the process's threads)
        self.matmul_threads = None     # threads.MatmulThreads wrapped around the linear layers (governor's option)
        self.between_frames = None     # poll(no_row_held) -> done: the worker calls it at its frame boundaries
        self.deferred = None           # deferred_trials.AtBoundary: this runner's trials deferred to idle time
        self._build_poll = None        # cpu_build.attach_later's poll: our kernels once a background build ends

    # --- attach -----------------------------------------------------------------------------------------------------
    def attach(self, runner) -> "CpuBackend":
        """Give `runner` its CPU fast paths (see the module's docstring); never raises. Sets on the runner:
        `talker_step`, `step_scope`, and an entry per part in `path_entries`."""
        from tts_engine.cpu import compiled_predictor, cpu_build, deferred_trials
        from tts_engine.cpu.measured import DEFAULT, Record

        self.runner = runner
        self.deferred = deferred_trials.AtBoundary()
        deferred_trials.watch(_holds_a_row(runner))   # (a request being prefilled stops the deferred trials too)
        talker = runner.talker
        runner.backend = self   # (from here on the runner's steps run in `step_scope`)
        self.gemv_rows = ATEN_GEMV_MAX_ROWS if runner.dtype == torch.bfloat16 else 0
        build_libraries()
        if runner.dtype != torch.float32:
            talker.fuse_projections()   # fewer calls per frame; fp32 keeps the official layout (parity)
        self.attach_kernels(runner)
        # where the library is still building in the background: the same three parts once it is loaded, at a frame
        # boundary with no row held (the engine's worker calls `between_frames`); there too the deferred trials'
        # verdicts are applied
        self._build_poll = cpu_build.attach_later(runner, attach=self.attach_kernels)
        if self._build_poll is not None or self.deferred.waiting():
            self.between_frames = self._between_frames
        want = self.compile_predictor_wanted
        if want if want is not None else compiled_predictor.wanted():
            self.compile_predictor(runner)
        else:
            runner.path_entries["compiled predictor"] = Record(
                "eager", DEFAULT, f"off unless {compiled_predictor.ENV}=1 or compile_predictor=True")
        self._attach_thread_governor(runner)
        runner.path_entries["small bf16 steps"] = Record(
            "PyTorch's gemv", DEFAULT, f"oneDNN off up to {self.gemv_rows} rows: it reads the weights faster") \
            if self.gemv_rows else Record("oneDNN", DEFAULT, "not bf16")
        return self

    def attach_kernels(self, runner) -> None:
        """The parts that run in our C++ library, each with its trial now (at a fresh bounded start: its agreement
        check now, its timing deferred): each decoder stack's step in one call, the predictor's frame in one call,
        the talker's step in one call (each off, with its reason, where the library is not loaded)."""
        from tts_engine.cpu import deferred_trials, fused_step, predictor_frame

        later = self.deferred.defer if deferred_trials.bounded() else None
        with self.step_scope(1):   # the fused step's trial times the eager path as a one-row step runs it
            runner.path_entries.update(fused_step.attach(runner.talker, later=later))
        runner.path_entries.update(predictor_frame.attach(runner.talker))
        self._measure_predictor_frame(runner, later)
        self._attach_talker_step(runner, later)

    def _between_frames(self, no_row_held: bool) -> bool:
        """The worker's poll at each frame boundary (`between_frames`): our kernels once a background build ends,
        then the verdicts of the deferred trials, applied with no row held -> True once nothing is left to do."""
        if self._build_poll is not None and self._build_poll(no_row_held):
            self._build_poll = None
        return self.deferred.poll(no_row_held) and self._build_poll is None

    def scratch_runner(self, runner):
        """A runner of the same model whose rows no request holds, with no fast paths of its own (the model's hooks
        serve it as they serve `runner`): the state the deferred trials time on, in their own thread. Its predictor
        cache has `runner`'s shape (a compiled predictor pass is not compiled again for another).

        The deferred trials run outside `step_scope`: its oneDNN switch is process-wide, and a request served beside
        a trial (its prefill above all) would take the other bf16 kernel, so its audio would depend on the trial.
        Timed with oneDNN as the process has it, a 1-2 row bf16 reference (eager layers, a head) can only look
        slower than it serves: a verdict for the reference holds, and `TTS_START_TRIALS=all` times it as served."""
        from tts_engine.cpu import talker_step

        scratch = type(runner)(runner.talker, runner.tts_pad, rows=1,
                               max_len=talker_step.TRIAL_POS + talker_step.TRIAL_PAIRS + 1, eos_id=runner.eos_id,
                               fast_paths=False)
        scratch.cp_cache = runner.talker.code_predictor.new_cache(runner.rows, runner.device, runner.dtype)
        return scratch

    def step_scope(self, rows: int):
        """What a frame step of `rows` rows runs inside (`ModelRunner.step_scope`): oneDNN off for 1-2 bf16 rows."""
        return aten_bf16_gemv(0 < rows <= self.gemv_rows)

    @staticmethod
    def outside_step_scope():
        """What the codes' hand-over between a frame's halves runs inside (`ModelRunner._hand_over`)."""
        return onednn_as_outside()

    @torch.inference_mode()
    def _measure_predictor_frame(self, runner, later=None) -> None:
        """Run the predictor frame's trial (`PredictorFrame`, state "trial": both paths timed on the same input, the
        choice remembered) now, on random inputs in row 0 of the predictor's cache (every frame rewrites the
        positions it reads, so nothing stays behind), as a one-row frame runs. later (a bounded fresh start): only
        its agreement check now (`PredictorFrame.check_at_load`), the timed trial to `later`, on a scratch
        runner's predictor cache. Never raises."""
        frame = getattr(runner.talker.code_predictor, "frame", None)
        if frame is None or frame.state != "trial":
            return
        if not frame.takes(1):   # (its fused stack does not serve: nothing to time)
            frame.choice.default("loop", "the code predictor's fused step does not serve")
            return
        g = torch.Generator().manual_seed(0)
        D, V = runner.hidden.shape[1], runner.talker.cfg.vocab_size
        h = torch.randn(1, D, generator=g).to(runner.dtype)
        c0 = torch.randint(0, min(V, 2048), (1,), generator=g)
        frame_idx = torch.zeros(1, dtype=torch.long)
        rp = runner.default_params(1)
        try:
            with self.step_scope(1):
                if later is not None:
                    if frame.check_at_load((h, c0, frame_idx, rp), runner.cp_cache,
                                           lambda: runner._predict_residuals_loop(h, c0, frame_idx, rp)):
                        later("code predictor frame", lambda: self._predictor_frame_trial(runner, frame, h, c0),
                              frame.verdict)
                    return
                while frame.state == "trial":
                    frame.run(h, c0, frame_idx, rp, runner.cp_cache,
                              lambda: runner._predict_residuals_loop(h, c0, frame_idx, rp))
        except Exception as e:   # (run() already falls back on its own failures; anything else: off, one line)
            frame.disable(f"{type(e).__name__}: {e}")

    @torch.inference_mode()
    def _predictor_frame_trial(self, runner, frame, h, c0):
        """The predictor frame's timed trial while idle (the trials' thread), on a scratch runner's predictor cache
        -> its twin choice, decided or fallen back."""
        scratch = self.scratch_runner(runner)
        frame_idx = torch.zeros(1, dtype=torch.long)
        rp = scratch.default_params(1)
        return frame.deferred_trial((h, c0, frame_idx, rp), scratch.cp_cache,
                                    lambda: scratch._predict_residuals_loop(h, c0, frame_idx, rp))

    @torch.inference_mode()
    def _attach_talker_step(self, runner, later=None) -> None:
        """Attach `talker_step.TalkerStep` where it runs and run its trial (`TalkerStep.measure`, on row 0 before any
        request holds it). later (a bounded fresh start): only its agreement check on row 0 now
        (`TalkerStep.check_at_load`), the timed trial to `later`, on a scratch runner's row. Never raises."""
        from tts_engine.cpu import talker_step

        runner.talker_step, runner.path_entries["talker step"] = talker_step.attach(runner)
        step = runner.talker_step
        if step is None or step.state != "trial":
            return

        def python_step(r, rp, codes):
            return runner._advance_python(r, slice(0, 1), rp, int(runner.pos[0]) + 1, codes)

        with self.step_scope(1):
            if later is None:
                step.measure(runner, runner.default_params(1), python_step)
            elif step.check_at_load(runner, runner.default_params(1), python_step):
                later("talker step in one call", lambda: self._talker_step_trial(runner, step), step.verdict)

    @torch.inference_mode()
    def _talker_step_trial(self, runner, step):
        """The talker step's timed trial while idle (the trials' thread), on row 0 of a scratch runner -> its twin
        choice, decided or fallen back."""
        scratch = self.scratch_runner(runner)

        def python_step(r, rp, codes):
            return scratch._advance_python(r, slice(0, 1), rp, int(scratch.pos[0]) + 1, codes)

        return step.deferred_trial(scratch, scratch.default_params(1), python_step)

    def compile_predictor(self, runner) -> str:
        """Serve one-row code-predictor passes through a compiled graph (`compiled_predictor`), compiled now as a
        warm-up; models with fused projections only (16-bit or quantised). -> its status line. A failure leaves the
        eager path serving. Its entry: `runner.path_entries["compiled predictor"]`."""
        from tts_engine.cpu.compiled_predictor import CompiledPredictorPass
        from tts_engine.cpu.measured import DEFAULT, FELL_BACK, Record

        cp = runner.talker.code_predictor
        if cp.model.layers[0].self_attn.qkv_proj is None:
            runner.path_entries["compiled predictor"] = Record("eager", DEFAULT, "CPU 16-bit or quantised engines only")
            return "off (CPU 16-bit or quantised engines only)"
        try:
            cp.compiled = CompiledPredictorPass(cp, runner.device, runner.dtype)
        except Exception as e:   # e.g. no C++ compiler: never an outage
            log.warning("compiled code predictor not used: %s", e)
            runner.path_entries["compiled predictor"] = Record("eager", FELL_BACK, type(e).__name__)
            return f"off ({type(e).__name__})"
        runner.path_entries["compiled predictor"] = cp.compiled
        cp.compiled.warm_up(runner.cp_cache)
        return cp.compiled.status

    def _attach_thread_governor(self, runner) -> None:
        """The thread governor (16-bit and quantised models, 2+ threads): each frame's OpenMP threads (1, all, or all
        inside the linear layers only) measured fastest at the moment; the worker runs it (`thread_governor`)."""
        want = self.govern_threads_wanted
        if want is None:
            want = os.environ.get(GOVERN_THREADS_ENV, "1").lower() not in ("0", "off", "no", "false")
        self.governor, self.matmul_threads = self.thread_governor(want and runner.dtype != torch.float32)

    def thread_governor(self, on: bool):
        """(threads.ThreadGovernor, threads.MatmulThreads or None) for the worker, or (None, None) when `on` is False
        or torch has one thread. The linear layers are wrapped once (not around a compiled predictor's: its graph is
        traced from their forwards). The runner's "threads" entry says which (the governor's own once it runs)."""
        from tts_engine.cpu.measured import DEFAULT, Record, forced_by

        threads = torch.get_num_threads()
        entries = self.runner.path_entries
        if not on or threads < 2:
            if self.runner.dtype == torch.float32:
                entries["threads"] = Record(f"{threads} threads", DEFAULT, "fp32 keeps the process's threads")
            elif on:
                entries["threads"] = Record("1 thread", DEFAULT, "one thread")
            else:
                entries["threads"] = Record(f"{threads} threads", forced_by(GOVERN_THREADS_ENV),
                                            f"{GOVERN_THREADS_ENV}=0 or govern_threads=False")
            return None, None
        from tts_engine.cpu.threads import ThreadGovernor, serial_between_matmuls

        talker = self.runner.talker
        mm = serial_between_matmuls(talker, threads) if talker.code_predictor.compiled is None else None
        governor = ThreadGovernor(threads, matmul_option=mm is not None)
        entries["threads"] = governor
        return governor, mm


def _holds_a_row(runner):
    """() -> whether `runner` holds a request now (a row's sampling settings are written at the start of its
    prefill and cleared at its release), None once the runner is gone: `deferred_trials.watch`'s probe."""
    import weakref

    ref = weakref.ref(runner)

    def probe():
        r = ref()
        return None if r is None else any(p is not None for p in r.params)
    return probe


# --- hooks of model/ and codec/ ---------------------------------------------------------------------------------------
class CodecKernels:
    """The codec decoder's CPU kernels (codec/decoder.py `cpu_kernels`): `PackedConv` (weights reordered once,
    channels-last), `Int8Conv` (int8 weights, rows quantised per call) and `snake(x, exp_alpha, inv_beta)` (one fused
    pass; None where our kernels do not build)."""

    def __init__(self):
        from tts_engine.cpu import cpu_ext
        from tts_engine.cpu.int8_conv import Int8Conv
        from tts_engine.cpu.packed_conv import PackedConv

        self.PackedConv, self.Int8Conv, self.snake = PackedConv, Int8Conv, cpu_ext.snake


def set_hooks() -> None:
    """Give model/quant.py its kernels (`cpu_ext`: our own kernels, `kernels`: the measured kernel table) and
    codec/decoder.py its conv kernels (`CodecKernels`). Idempotent."""
    from tts_engine.codec import decoder
    from tts_engine.cpu import cpu_ext, kernels
    from tts_engine.model import quant

    quant.cpu_ext, quant.kernels = cpu_ext, kernels
    if decoder.cpu_kernels is None:
        decoder.cpu_kernels = CodecKernels()
