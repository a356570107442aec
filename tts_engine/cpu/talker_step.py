"""The talker's whole per-frame step in one C++ call (`talker_step.cpp`, built on first use beside predictor_frame.cpp
and called through ctypes): what `ModelRunner._advance` does from Python around the fused talker stack (the frame's
16 code embeddings plus the trailing text vector, the stack, the final norm, the codec head, codebook 0's repetition
penalty, EOS and suppression rules and draw, the row state updates) without aten calls between them.

Where it serves: CPU engines whose talker stack is served by the fused step (`fused_step.FusedStep` state "on": W8A8,
W4A8, bf16), decode steps of 1..fused_step.MAX_ENTRIES rows. fp32 engines, the other modes, GPUs and prompt prefills
never get it.

Numerics: the Python path's, computation for computation, so the codes are the same: the embedding sum in fp32 in code
order rounded to the activation dtype (torch's bf16 sum), the same stack code (fused_step.cpp, included through
predictor_frame.cpp), every tensor the Python path hands between aten calls rounded to the activation dtype, and
sampling's rules through predictor_frame.cpp's port (choose_row). The codec head runs in the C++ call where its kernel
gives the eager layer's exact numbers (W8A8 heads on the "int_mm" / "vnni" / "own_avx2" kernels: exact int32 sums;
W4A8); elsewhere (bf16 heads, whose aten gemv sums in another order; W8A8 on "int8pack_a8") the step is two calls with
the eager head between them (`ttst_hidden`, head, `ttst_choose`), which keeps the codes the same there too.

Chosen by measuring (`TTS_TALKER_STEP`):
  auto (default)  once the talker's fused step serves, TRIAL_PAIRS steps of row 0 run both paths on the same state when
                  the model runner is built (before any request: random input, the row's state saved and put back),
                  timed, alternating which goes first; their codebook-0 ids and hidden states must be the same (a bug
                  detector), else the path is off; the faster by median serves from then on, remembered per machine and
                  model shape in the cache folder (`$TTS_CACHE_DIR/talker_step/`). At a fresh bounded start
                  (`deferred_trials`) only CHECK_PAIRS steps run at load, as the agreement check: the step serves as
                  the default ("measurement pending"), and the timed trial runs while idle on a scratch runner's row
                  (`deferred_trial`); its verdict is remembered and applied at a frame boundary with no row held.
  1 / on          whenever the talker's fused step serves (benchmarks' A/B, tests).
  0 / off         never.
Any failure (no library, a refused input, an exception) logs one line and leaves the Python path serving for good.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

import torch

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import deferred_trials
from tts_engine.cpu import fused_step
from tts_engine.cpu import kernels
from tts_engine.cpu import measured
from tts_engine.cpu import predictor_frame
from tts_engine.cpu.measured import DEFAULT, FELL_BACK, MeasuredChoice, Record, forced_by, one_line

log = logging.getLogger("tts_engine")

ENV = "TTS_TALKER_STEP"
PART = "talker step"     # its entry in TTSEngine.paths()
SOURCE = Path(__file__).parent / "csrc" / "talker_step.cpp"
MAX_ROWS = fused_step.MAX_ENTRIES
TRIAL_PAIRS = 4         # timed (python, step) pairs before choosing
CHECK_PAIRS = 1         # a bounded fresh start: (python, step) steps run at load as the agreement check only
TRIAL_POS = 32          # the trial's steps write positions TRIAL_POS.. of row 0 (unused while the runner is built)
EXACT_W8A8 = ("int_mm", "vnni", "own_avx2")   # W8A8 head kernels whose numbers ours equal (exact int32 sums)


def setting() -> str:
    """"auto", "on" or "off" (env TTS_TALKER_STEP)."""
    return measured.setting(ENV)


def _declare(lib: ctypes.CDLL) -> None:
    P, I64, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    stack = [P, F, P, P, P, P, P, P, I]
    state = [P, P, P, P, P, P, P, P, P, I64, I64]
    rules = [I64, I64, I64, P, P, P, P, P, P, P, I, I64, I]
    frame = [I64, P, P, I64, P, P, I64]
    lib.ttst_step.argtypes = stack + state + frame + [P, P, I64] + rules + [P, P, P]
    lib.ttst_step.restype = I
    lib.ttst_hidden.argtypes = stack + state + frame + [P]
    lib.ttst_hidden.restype = I
    lib.ttst_choose.argtypes = [I64] + state + [I64, P, P, I64, P, I] + rules + [P, P]
    lib.ttst_choose.restype = I


# library(): the one library (cpu_ext.library) with the step's functions declared; raises where it cannot run here
library = cpu_ext.Beside(_declare)


def tag() -> str:
    """The identity of the step's code (its sources, torch) for the remembered choice."""
    return hashlib.sha1(SOURCE.read_bytes() + predictor_frame.SOURCE.read_bytes() + fused_step.SOURCE.read_bytes()
                        + cpu_ext.SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]


def _ptr(t: torch.Tensor, dtype: torch.dtype, keep: list) -> int:
    if t.dtype != dtype or not t.is_contiguous():
        t = t.to(dtype).contiguous()
        keep.append(t)
    return t.data_ptr()


class StepPlan:
    """Pointers of everything one step reads and writes: the talker stack's `fused_step.StackPlan`, the frame table,
    the codec head (when it runs in the call) and the model runner's state tensors (they never move: rows are
    written in place)."""

    def __init__(self, runner, stack_plan: fused_step.StackPlan):
        t = runner.talker
        if runner.device.type != "cpu" or runner.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("the talker step serves CPU engines only")
        self.runner, self.stack = runner, stack_plan
        self.keep: list = []
        if t._frame_table is None:
            t.build_frame_table()
        self.table, self.offsets = t._frame_table, t._frame_offsets.to(torch.int64).contiguous()
        D = stack_plan.D
        if self.table.dtype != runner.dtype or not self.table.is_contiguous() or self.table.shape[1] != D:
            raise ValueError("the frame table is not a dense table in the activation dtype")
        self.books = self.offsets.numel()
        ends = torch.cat([self.offsets[1:], torch.tensor([self.table.shape[0]])])
        self.min_book_size = int((ends - self.offsets).min())   # ids every codebook's table holds (the trial's codes)
        head = t.codec_head
        self.V = head.out_features
        self.head = self._head_in_call(head, stack_plan.wbits, D)
        k = runner.cache.k
        if k.dtype != runner.dtype or not k.is_contiguous() or not runner.cache.v.is_contiguous():
            raise ValueError("the talker cache is not in a layout the step reads")
        self.strides = torch.tensor([k.stride(0), k.stride(1), k.stride(2), k.shape[3]], dtype=torch.int64)
        sp = stack_plan
        self.stack_args = (sp.dims.data_ptr(), sp.eps, sp.layers.data_ptr(), sp.inv_freq.data_ptr(),
                           sp.final_norm.data_ptr(), k.data_ptr(), runner.cache.v.data_ptr(), self.strides.data_ptr(),
                           int(k.dtype == torch.bfloat16))
        tts_pad = runner.tts_pad.contiguous()
        self.keep.append(tts_pad)
        for name in ("pos", "step", "max_new", "c0", "trailing_len"):
            x = getattr(runner, name)
            if x.dtype != torch.int64 or not x.is_contiguous():
                raise ValueError(f"the runner's {name} is not a dense int64 tensor")
        for x in (runner.seen, runner.hidden, runner.trailing):
            if not x.is_contiguous():
                raise ValueError("the runner's state is not dense")
        self.state_args = (runner.pos.data_ptr(), runner.step.data_ptr(), runner.max_new.data_ptr(),
                           runner.seen.data_ptr(), runner.hidden.data_ptr(), runner.c0.data_ptr(),
                           runner.trailing.data_ptr(), runner.trailing_len.data_ptr(), tts_pad.data_ptr(),
                           runner.trailing.shape[1], runner.max_len)
        proc = runner.c0_proc
        sup = proc.suppress.nonzero()
        self.suppress_from = self.V - 1024
        expect = torch.zeros(self.V, dtype=torch.bool)
        expect[max(0, self.suppress_from):] = True
        expect[proc.eos_id] = False
        if not torch.equal(proc.suppress.cpu(), expect):
            raise ValueError(f"the suppressed ids are not [V - 1024, V) except EOS ({sup.numel()} ids)")
        self.rules = (proc.eos_id, proc.min_new_tokens)

    def _head_in_call(self, head, wbits: int, D: int):
        """(weight pointer, scale pointer or 0, the W8A8 layer or None) when the codec head runs in the call with
        the eager layer's numbers, else None (bf16: the eager head between two calls)."""
        from tts_engine.model.quant import W4A8Linear, W8A8Linear

        if wbits == 8 and isinstance(head, W8A8Linear) and head.bias is None:
            w, s = predictor_frame._head_fields(head, self.V, D, wbits, self.keep)
            return w, s, head
        if wbits == 4 and isinstance(head, W4A8Linear) and head.bias is None:
            w, s = predictor_frame._head_fields(head, self.V, D, wbits, self.keep)
            return w, s, None
        return None

    def head_in_call(self, B: int) -> bool:
        if self.head is None:
            return False
        layer = self.head[2]
        return layer is None or layer.kernel_names.get(kernels.row_bucket(B)) in EXACT_W8A8

    def run(self, r: torch.Tensor, rp, codes: torch.Tensor, with_logits: bool = False):
        """One step of runner rows `r` [B] (int64, distinct) consuming frame `codes` [B, books] -> done [B] (bool);
        the runner's pos, step, seen, hidden, c0 and the talker cache updated as `ModelRunner._advance` does them
        (and the head's logits [B, V] fp32 when asked: tests)."""
        lib = library()
        B = r.shape[0]
        keep: list = []
        if codes.shape != (B, self.books):
            raise ValueError(f"codes of shape {tuple(codes.shape)} where ({B}, {self.books}) is needed")
        rptr = _ptr(r, torch.int64, keep)
        cptr = _ptr(codes, torch.int64, keep)
        h = rp.host["c0"]
        rules = (*self.rules, self.suppress_from, _ptr(rp.do_sample, torch.bool, keep), _ptr(rp.top_k, torch.int64, keep),
                 _ptr(rp.top_p, torch.float32, keep), _ptr(rp.temperature, torch.float32, keep),
                 _ptr(rp.penalty, torch.float32, keep), _ptr(rp.seed, torch.int64, keep),
                 _ptr(rp.ignore_eos, torch.bool, keep), int(bool(h["any_sample"])), int(h["k_max"] or 0),
                 int(bool(h["any_top_p"])))
        c0 = torch.empty(B, dtype=torch.int64)
        done = torch.empty(B, dtype=torch.bool)
        frame = (B, rptr, cptr, self.books, self.table.data_ptr(), self.offsets.data_ptr(), self.table.shape[0])
        logits = None
        if self.head_in_call(B):
            if with_logits:
                logits = torch.empty(B, self.V)
            rc = lib.ttst_step(*self.stack_args, *self.state_args, *frame, self.head[0], self.head[1] or None, self.V,
                               *rules, c0.data_ptr(), done.data_ptr(), None if logits is None else logits.data_ptr())
            if rc != 0:
                raise RuntimeError(f"the talker step refused its input (code {rc})")
        else:
            hid = torch.empty(B, self.stack.D, dtype=self.runner.dtype)
            rc = lib.ttst_hidden(*self.stack_args, *self.state_args, *frame, hid.data_ptr())
            if rc != 0:
                raise RuntimeError(f"the talker step refused its input (code {rc})")
            logits = self.runner.talker.codec_head(hid).float().contiguous()
            if with_logits:
                logits_kept = logits.clone()
            rc = lib.ttst_choose(self.stack.D, *self.state_args, B, rptr, logits.data_ptr(), self.V, hid.data_ptr(),
                                 int(hid.dtype == torch.bfloat16), *rules, c0.data_ptr(), done.data_ptr())
            if rc != 0:   # (nothing of the row state written: the caller's Python path may run the whole step again)
                raise RuntimeError(f"the talker step's sampling refused its input (code {rc})")
            logits = logits_kept if with_logits else None
        return (done, logits) if with_logits else done


# --- the choice between the step and the Python path -----------------------------------------------------------------
CANDIDATES = ("python", "step")   # the reference first (measured.MeasuredChoice)


class TalkerStep:
    """Serves `ModelRunner._advance` through a `StepPlan` where that was measured faster (module doc). `choice` (a
    `measured.MeasuredChoice`, part "talker step") holds the answer and its record; state: "trial", "on", "off"."""

    def __init__(self, plan: StepPlan, fused: fused_step.FusedStep, force: bool = False):
        self.plan, self.fused = plan, fused
        self.agree = [0, 0]
        key = None
        if not force:
            from tts_engine.cpu.kernels import machine_key

            sp = plan.stack
            key = {"machine": machine_key(), "step": tag(), "wbits": sp.wbits, "dims": sp.dims.tolist(),
                   "V": plan.V, "head_in_call": plan.head_in_call(1)}
        self.choice = MeasuredChoice(PART, CANDIDATES, env=ENV, key=key, folder="talker_step",
                                     label="talker step in one call", fallback="the Python path")
        self.times = self.choice.times
        if force:
            self.choice.force("step")
        else:
            self.choice.recall()

    @property
    def state(self) -> str:
        c = self.choice.chosen
        return "trial" if c is None else "on" if c == "step" else "off"

    @property
    def record(self) -> Record:
        return self.choice.record

    def takes(self, B: int) -> bool:
        """The step may serve B rows now: it is on, B fits, and the talker's fused step serves."""
        return self.state == "on" and 1 <= B <= MAX_ROWS and self.fused.state == "on"

    def run(self, r, rp, codes, python):
        """done [B] of this step; python: () -> the Python path's done (the same state changes)."""
        try:
            return self._step(r, rp, codes)
        except Exception as e:   # one line, then the Python path for good (nothing written when it refused)
            self.disable(f"{type(e).__name__}: {e}")
            return python()

    def _step(self, r, rp, codes, plan: StepPlan | None = None):
        # the governor's "matmul" option (engine/threads.MatmulThreads) gives our call its threads
        plan = plan or self.plan
        switch = self.fused.threads_switch() if self.fused.threads_switch is not None else None
        if switch is not None:
            return switch.call(plan.run, r, rp, codes)
        return plan.run(r, rp, codes)

    def measure(self, runner, rp, python_step) -> None:
        """The trial (module doc) on runner row 0, which no request holds yet: TRIAL_PAIRS steps, each run by both paths
        from the same saved state, alternating which goes first -> state "on" or "off", remembered. python_step:
        (r, rp, codes) -> done, the Python path. The row's state is put back afterwards. Never raises."""
        if self.state != "trial":
            return
        try:
            self.agree = self._pairs(self.choice, runner, rp, python_step, self.plan, TRIAL_PAIRS)
        except Exception as e:
            self.disable(f"{type(e).__name__}: {e}")
            return
        self._verdict_of(self.choice, self.agree)

    def _pairs(self, choice: MeasuredChoice, runner, rp, python_step, plan: StepPlan, pairs: int) -> list[int]:
        """`pairs` steps of `runner`'s row 0 (no request's), each run by both paths from the same saved state,
        alternating which goes first, timed into `choice` -> [steps whose ids and hidden states agreed, steps].
        The row's state is put back afterwards; raises where a path raises."""
        g = torch.Generator().manual_seed(0)
        r = runner.row_index[:1]
        names = ("pos", "step", "seen", "hidden", "c0", "trailing_len", "max_new")
        saved = {n: getattr(runner, n)[0].clone() for n in names}
        V = plan.V
        agree = [0, 0]
        try:
            runner.pos[0], runner.step[0], runner.max_new[0], runner.trailing_len[0] = TRIAL_POS, 3, 1 << 20, 0
            runner.seen[0] = torch.rand(V, generator=g) < 0.02
            for i in range(pairs):
                deferred_trials.check()   # (a deferred trial: a request stops it here)
                codes = torch.randint(0, plan.min_book_size, (1, plan.books), generator=g)
                start = {n: getattr(runner, n)[0].clone() for n in names}
                got = {}
                for which in (("step", "python") if i % 2 else ("python", "step")):
                    for n in names:
                        getattr(runner, n)[0] = start[n]
                    if which == "step":
                        choice.time(which, self._step, r, rp, codes, plan)
                    else:
                        choice.time(which, python_step, r, rp, codes)
                    got[which] = (int(runner.c0[0]), runner.hidden[0].clone())
                agree[1] += 1
                agree[0] += int(got["step"][0] == got["python"][0] and torch.equal(got["step"][1], got["python"][1]))
        finally:
            for n in names:
                getattr(runner, n)[0] = saved[n]
        return agree

    def _verdict_of(self, choice: MeasuredChoice, agree: list[int]) -> None:
        if agree[0] < agree[1]:
            choice.fall_back(f"its codebook-0 ids or hidden states differ from the Python path's in "
                             f"{agree[1] - agree[0]} of {agree[1]} trial steps")
            return
        choice.decide(names={"python": "Python"}, note="the same ids and hidden states")

    def check_at_load(self, runner, rp, python_step) -> bool:
        """A bounded fresh start: CHECK_PAIRS steps of runner row 0 (no request's yet) by both paths as the
        agreement check only; agreeing, the step serves as the default while the timing waits (-> True), else the
        Python path, one log line (-> False). Never raises."""
        if self.state != "trial":
            return False
        twin = self.choice.twin()
        try:
            agree = self._pairs(twin, runner, rp, python_step, self.plan, CHECK_PAIRS)
        except Exception as e:
            self.disable(f"{type(e).__name__}: {e}")
            return False
        if agree[0] < agree[1]:
            self.disable(f"its codebook-0 ids or hidden states differ from the Python path's in "
                         f"{agree[1] - agree[0]} of {agree[1]} check steps")
            return False
        self.choice.serve_until_measured("step", f"checked against the Python path at load (the same ids and "
                                                 f"hidden states in {agree[1]} step(s))")
        return True

    def deferred_trial(self, scratch, rp, python_step) -> MeasuredChoice:
        """The timed trial while idle (`deferred_trials`, the trials' thread) on row 0 of `scratch`, a runner of the
        same model whose rows no request holds (its own `StepPlan`; python_step: its Python path) -> a twin of the
        choice, decided or fallen back."""
        def trial(twin):
            self._verdict_of(twin, self._pairs(twin, scratch, rp, python_step, StepPlan(scratch, self.plan.stack),
                                               TRIAL_PAIRS))
        return self.choice.deferred(trial)

    def verdict(self, twin: MeasuredChoice):
        """Remember what the deferred trial measured -> what applies it (at a frame boundary with no row held)."""
        return self.choice.applier(twin)

    def disable(self, why: str) -> None:
        self.choice.fall_back(why)


def attach(runner) -> tuple[TalkerStep | None, MeasuredChoice | Record]:
    """A `TalkerStep` for `runner` where its talker stack has a fused step (fused_step.attach ran first) and the library
    runs here -> (step or None, the step's choice or the record of why there is none: `ModelRunner.path_entries`'s
    "talker step"). Never raises. The caller runs its trial (`TalkerStep.measure`)."""
    mode = setting()
    if mode == "off":
        return None, Record("python", forced_by(ENV), f"{ENV}={os.environ.get(ENV, '')}")
    fused = getattr(runner.talker.model, "fused", None)
    if fused is None or fused.state != "on":
        return None, Record("python", DEFAULT, "the talker's fused step does not serve")
    try:
        plan = StepPlan(runner, fused.plan)
        library()
        step = TalkerStep(plan, fused, force=mode == "on")
        return step, step.choice
    except Exception as e:   # not a fused stack, no compiler, ...: the Python path, one line
        why = one_line(f"{type(e).__name__}: {e}")
        if not isinstance(e, ValueError):
            log.warning("tts_engine: talker step in one call not used: %s", why)
        return None, Record("python", DEFAULT if isinstance(e, ValueError) else FELL_BACK, why)
