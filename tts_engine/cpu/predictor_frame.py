"""The code predictor's whole frame in one C++ call (`predictor_frame.cpp`, built on first use beside fused_step.cpp and
called through ctypes): the 15 passes of `ModelRunner._predict_residuals` (embedding lookup, the fused decoder stack,
final norm, lm_head, the codebook's sampling, the next pass's embedding) without Python or aten between them.

Where it serves: CPU engines whose code-predictor stack is served by the fused step (`fused_step.FusedStep` state "on":
W8A8, W4A8, bf16), frames of 1..MAX_ROWS rows. fp32 engines, the other modes, GPUs and prompt prefills never get it.

Numerics: the Python loop over the fused stack's, computation for computation: the same stack code (fused_step.cpp,
included), the heads through the stack's own matmul kernel on the heads' packed weights (W8A8: cpu_ext's layout,
exact int32 sums with the fp32 epilogue of the "vnni" / "int_mm" / "own_avx2" kernels; a head that holds only the
[N, K] int8 weight gets a packed copy here), every tensor the loop hands between aten calls rounded to the engine's
dtype, and sampling.choose's rules (temperature -> top-k -> top-p -> counter-hash Gumbel-max, greedy rows by argmax)
with torch.topk's partial sort re-done so equal logits come out in the same order. Differences that remain:
bf16 heads (the Python loop's aten/oneDNN bf16 gemv sums in another order than fused_step.cpp's bf16 tiles), W8A8
heads whose measured kernel is "int8pack_a8" (bf16 scales), and top-p < 1 rows, where torch's unstable sort may drop
another of several equal candidates at the cut (tests/test_predictor_frame.py measures how often that changes a draw).

Chosen by measuring, as the fused step (`TTS_PREDICTOR_FRAME`):
  auto (default)  once the predictor's fused step serves, TRIAL_FRAMES frames run three paths on the same input
                  (the Python loop; the frame with one parallel region per matmul, "frame"; the whole frame in one
                  parallel region, "frame-team", whose codes must equal "frame"'s), when the model runner is built (`cpu.backend.CpuBackend._measure_predictor_frame`: random inputs, so no request
                  sees the trial; the predictor's cache is scratch, and a frame's draws depend only on its seeds and
                  logits, so both give the same codes up to the rounding differences above), timed, alternating which
                  goes first; the first codebook's codes must mostly agree (a bug detector), else the path is off; the
                  faster by median serves from then on, remembered per machine and model shape in the cache folder
                  (`$TTS_CACHE_DIR/predictor_frame/`). At a fresh bounded start (`deferred_trials`) only CHECK_FRAMES
                  frames of the loop and "frame-team" run at load, as the agreement check: "frame-team" serves as the default
                  ("measurement pending"), and the timed trial of the three runs while idle on a scratch cache
                  (`deferred_trial`); its verdict is remembered and applied at a frame boundary with no row held.
  1 / on          whenever the predictor's fused step serves (benchmarks' A/B, tests), its threads as
                  TTS_FUSED_TEAM says (`set_team`).

Threads (predictor_frame.cpp): "split" runs each matmul (and the heads) as one at::parallel_for; a team mode
(fused_step.TEAM_MODES) runs the whole frame in one OpenMP region (run_frame_team; with small_to_mtp_projection, one
region per pass): the threads claim chunks of every matmul, head and attention, and each computes the small ops,
the sampling and the next embedding itself; the same numbers bit for bit.
  0 / off         never.
Any failure (no library, a refused input, an exception) logs one line and leaves the Python loop serving for good.
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
from tts_engine.cpu import measured
from tts_engine.cpu.measured import DEFAULT, FELL_BACK, MeasuredChoice, Record, forced_by, one_line

log = logging.getLogger("tts_engine")

ENV = "TTS_PREDICTOR_FRAME"
PART = "predictor frame"                 # its entry in TTSEngine.paths()
SOURCE = Path(__file__).parent / "csrc" / "predictor_frame.cpp"
MAX_ROWS = fused_step.MAX_ENTRIES // 2   # the first pass has two entries a row
TRIAL_FRAMES = 4                         # timed (loop, frame) pairs before choosing
CHECK_FRAMES = 2                         # a bounded fresh start: (loop, frame) frames run at load as the check only
# a bounded fresh start serves this until timed: the whole frame in one parallel region, fastest at the 0.6B shape in 6
# of the 7 trials remembered on the 2-vCPU Zen 4 here (a thread the OS takes away holds back only its chunk)
DEFAULT_PATH = "frame-team"
MIN_AGREE = 0.5                          # first-codebook codes of the two paths that must agree in the trial


def setting() -> str:
    """"auto", "on" or "off" (env TTS_PREDICTOR_FRAME)."""
    return measured.setting(ENV)


def _declare(lib: ctypes.CDLL) -> None:
    P, I64, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.ttsp_frame.argtypes = [P, F, P, P, P, P, P, P, I, I64, I64, I64, P, P, P, P, P, P,
                               P, P, P, P, P, P, I, I64, I, P, P]
    lib.ttsp_frame.restype = I
    lib.ttsp_frame_team.argtypes = lib.ttsp_frame.argtypes + [I]
    lib.ttsp_frame_team.restype = I
    lib.ttsp_choose.argtypes = [P, I64, I64, I64, P, P, P, P, P, P, I, I64, I, P]
    lib.ttsp_choose.restype = None
    lib.ttsp_set_team.argtypes, lib.ttsp_set_team.restype = [I, I], I
    lib.ttsp_set_team(int(fused_step.team_setting()), 1)
    lib.ttsp_profile_read.argtypes, lib.ttsp_profile_read.restype = [P], I
    fused_step.declare_profile(lib)


# library(): the one library (cpu_ext.library) with the frame's functions declared; raises where it cannot run here
library = cpu_ext.Beside(_declare)


# predictor_frame.cpp FStage: the frame's stages (the last a count)
FRAME_STAGES = ("setup", "proj", "stack", "norm", "head", "round", "sample", "embed", "call", "calls")


class profile(fused_step.profile):
    """`with predictor_frame.profile() as prof: ...` times the stages of the frames run inside (predictor_frame.cpp's
    profile) -> prof.frame {FRAME_STAGES: ns summed}, prof.stack {fused_step.STAGES: ns summed over the stack calls
    inside the frames} (also prof.ns, as fused_step.profile)."""

    @staticmethod
    def library() -> ctypes.CDLL:
        return library()

    def __enter__(self):
        super().__enter__()
        self.lib.ttsp_profile_read(self._buf)   # zero the frame's sums
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.stack = self.ns
        n = self.lib.ttsp_profile_read(self._buf)
        self.frame = dict(zip(FRAME_STAGES, list(self._buf)[:n]))
        return False


def set_team(mode, frame_region: bool = True) -> int:
    """How the frame uses torch's threads (benchmarks' A/B, tests): a name of fused_step.TEAM_MODES or its number;
    "split": one at::parallel_for per matmul; a team mode: each pass's stack in one parallel region, or (frame_region,
    and no projection) the whole frame in one -> the mode before. The default follows TTS_FUSED_TEAM
    (fused_step.team_setting), the whole frame in one region in a team mode."""
    if isinstance(mode, str):
        mode = fused_step.TEAM_MODES[mode]
    return int(library().ttsp_set_team(int(mode), int(bool(frame_region))))


def tag() -> str:
    """The identity of the frame's code (its sources, torch) for the remembered choice."""
    return hashlib.sha1(SOURCE.read_bytes() + fused_step.SOURCE.read_bytes() + cpu_ext.SOURCE.read_bytes()
                        + torch.__version__.encode()).hexdigest()[:12]


def _sampler_args(rp, frame_idx: torch.Tensor, keep: list) -> list[int]:
    """Pointers of the sub-talker sampling rows (sampling.RowParams) and the frame indices, as ttsp_* read them (a
    converted copy only where a tensor is not already contiguous in the dtype read; a bool is read as uint8)."""
    def c(t, dtypes):
        if t.dtype not in dtypes or not t.is_contiguous():
            t = t.to(dtypes[0]).contiguous()
            keep.append(t)
        return t.data_ptr()
    u8, i64, f32 = (torch.uint8, torch.bool), (torch.int64,), (torch.float32,)
    return [c(rp.sub_do_sample, u8), c(rp.sub_top_k, i64), c(rp.sub_top_p, f32), c(rp.sub_temperature, f32),
            c(rp.seed, i64), c(frame_idx, i64)]


def _facts(host: dict) -> list[int]:
    h = host["sub"]
    return [int(bool(h["any_sample"])), int(h["k_max"] or 0), int(bool(h["any_top_p"]))]


def choose(logits: torch.Tensor, frame_idx: torch.Tensor, book: int, rp) -> torch.Tensor:
    """The C++ sampler alone on logits [B, V] fp32 -> ids [B] (as sampling.choose_residual; tests)."""
    lib = library()
    logits = logits.float().contiguous()
    B, V = logits.shape
    keep: list = []
    out = torch.empty(B, dtype=torch.int64)
    lib.ttsp_choose(logits.data_ptr(), B, V, book, *_sampler_args(rp, frame_idx, keep), *_facts(rp.host),
                    out.data_ptr())
    return out


def _head_fields(m, N: int, K: int, wbits: int, keep: list) -> tuple[int, int]:
    """(weight pointer, scale127 pointer or 0) of an lm_head or the projection (N x K) in the stack's kernel layout,
    as fused_step._linear_fields but with or without a bias (the projection's is added in predictor_frame.cpp); a
    W8A8 layer that holds only the [N, K] int8 weight (its measured kernels read that) gets a packed copy, in `keep`."""
    from tts_engine.model.quant import W4A8Linear, W8A8Linear

    if (m.out_features, m.in_features) != (N, K):
        raise ValueError(f"a {type(m).__name__} of {m.out_features}x{m.in_features} where {N}x{K} is needed")
    if wbits == 8 and isinstance(m, W8A8Linear):
        packed = m.packed
        if packed is None:
            packed = cpu_ext.pack(m.int8_weight())
            keep.append(packed)
        return packed.data_ptr(), m.scale127.data_ptr()
    if wbits == 4 and isinstance(m, W4A8Linear):
        return m.packed4.data_ptr(), 0
    if wbits == 16 and type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16:
        if not m.weight.is_contiguous() or K % 32 or N % 8:   # fused_step.cpp linear16: K % 32, N % R4
            raise ValueError(f"a bf16 weight of {N}x{K}: not contiguous, or K not a multiple of 32 or N of 8")
        return m.weight.data_ptr(), 0
    raise ValueError(f"{type(m).__name__} is not in the stack's kernel layout (wbits {wbits})")


class FramePlan:
    """Pointers of everything one frame reads: the predictor stack's `fused_step.StackPlan`, the 15 heads, the 14
    codec embeddings, the talker's codec embedding (codebook 0) and small_to_mtp_projection."""

    def __init__(self, talker, stack_plan: fused_step.StackPlan):
        cp = talker.code_predictor
        self.stack = stack_plan
        wbits, D = stack_plan.wbits, stack_plan.D
        dtype = talker.model.norm.weight.dtype
        self.keep: list = []
        self.books = len(cp.lm_head)
        self.V = cp.lm_head[0].out_features
        self.heads = torch.tensor([_head_fields(h, self.V, D, wbits, self.keep) for h in cp.lm_head],
                                  dtype=torch.int64)
        embs = [e.weight for e in cp.model.codec_embedding]
        e0 = talker.model.codec_embedding.weight
        self.Dt = e0.shape[1]
        for e in embs + [e0]:
            if e.dtype != dtype or e.shape[1] != self.Dt or e.stride(1) != 1 or e.stride(0) != self.Dt:
                raise ValueError("a codec embedding is not a dense table in the activation dtype")
        if len(embs) < self.books - 1:
            raise ValueError("fewer codec embeddings than passes")
        self.embeds = torch.tensor([e.data_ptr() for e in embs[:self.books - 1]], dtype=torch.int64)
        self.emb0 = e0
        self.emb_refs = embs
        proj = cp.small_to_mtp_projection
        if isinstance(proj, torch.nn.Identity):
            if self.Dt != D:
                raise ValueError("talker and predictor widths differ without a projection")
            self.proj = torch.zeros(4, dtype=torch.int64)
        else:
            w, s = _head_fields(proj, D, self.Dt, wbits, self.keep)
            bias = proj.bias
            if bias is not None:
                bias = bias.detach().to(dtype).contiguous()
                self.keep.append(bias)
            self.proj = torch.tensor([w, s, 0 if bias is None else bias.data_ptr(), self.Dt], dtype=torch.int64)
        self.dtype = dtype

    def run(self, h: torch.Tensor, c0: torch.Tensor, frame_idx: torch.Tensor, rp, cache,
            with_logits: bool = False, team: int | None = None):
        """h [B, Dt] talker hidden, c0 [B] -> codes [B, 1 + books] (c0 first; as _predict_residuals), and the
        logits [books, B, V] fp32 when asked. Writes cache rows 0..B-1 (the predictor's scratch). team: how the
        call uses torch's threads (fused_step.TEAM_MODES value; None: `set_team`'s setting)."""
        lib = library()
        sp = self.stack
        k, v = cache.k, cache.v
        B = h.shape[0]
        if h.dtype != self.dtype or k.dtype != self.dtype or not k.is_contiguous() or not v.is_contiguous() \
                or k.shape[0] != sp.layers.shape[0] or B > k.shape[1] or B < 1 or h.shape[1] != self.Dt:
            raise ValueError("the cache or the input is not in a layout the predictor frame reads")
        h = h.contiguous()
        if c0.dtype != torch.int64 or not c0.is_contiguous():
            c0 = c0.to(torch.int64).contiguous()
        lo, hi = torch.aminmax(c0)
        if int(lo) < 0 or int(hi) >= self.emb0.shape[0]:
            raise ValueError("codebook-0 id out of range")
        keep: list = []
        strides = sp.cache_strides(k)
        codes = torch.empty(B, self.books, dtype=torch.int64)
        logits = torch.empty(self.books, B, self.V) if with_logits else None
        bf16 = int(k.dtype == torch.bfloat16)
        rc = lib.ttsp_frame_team(sp.dims.data_ptr(), sp.eps, sp.layers.data_ptr(), sp.inv_freq.data_ptr(),
                            sp.final_norm.data_ptr(), k.data_ptr(), v.data_ptr(), strides.data_ptr(), bf16, B,
                            self.V, self.books, self.heads.data_ptr(), self.embeds.data_ptr(), self.proj.data_ptr(),
                            h.data_ptr(), self.emb0.data_ptr(), c0.data_ptr(),
                            *_sampler_args(rp, frame_idx, keep), *_facts(rp.host), codes.data_ptr(),
                            None if logits is None else logits.data_ptr(), -1 if team is None else int(team))
        if rc != 0:
            raise RuntimeError(f"the predictor frame refused its input (code {rc})")
        out = torch.cat([c0[:, None], codes], dim=1)
        return (out, logits) if with_logits else out


# --- the choice between the frame and the Python loop ----------------------------------------------------------------
CANDIDATES = ("loop", "frame", "frame-team")   # the reference first (measured.MeasuredChoice)


class PredictorFrame:
    """Serves `ModelRunner._predict_residuals` through a `FramePlan` where that was measured faster (module doc).
    `choice` (a `measured.MeasuredChoice`, part "predictor frame") holds the answer and its record; state: "trial",
    "on", "off"; team: the frame's way with torch's threads once on (fused_step.TEAM_MODES value; None: `set_team`'s
    setting, as TTS_FUSED_TEAM says)."""

    TEAM = fused_step.TEAM_MODES["claim"]   # the trial's "frame-team": the whole frame in one parallel region

    def __init__(self, plan: FramePlan, fused: fused_step.FusedStep, threads_switch=None, force: bool = False):
        self.plan, self.fused = plan, fused
        self.threads_switch = threads_switch
        self.agree = [0, 0]
        key = None
        if not force:
            from tts_engine.cpu.kernels import machine_key

            key = {"machine": machine_key(), "frame": tag(), "wbits": plan.stack.wbits,
                   "dims": plan.stack.dims.tolist(), "V": plan.V, "Dt": plan.Dt}
        self.choice = MeasuredChoice("predictor frame", CANDIDATES, env=ENV, key=key, folder="predictor_frame",
                                     label="code predictor frame", fallback="the Python loop")
        self.times = self.choice.times
        if force:
            self.choice.force("frame")
            self.team = None   # as `set_team` says
        else:
            self.choice.recall()
            self.team = self._team_of(self.choice.chosen)

    def _team_of(self, chosen: str | None) -> int | None:
        return self.TEAM if chosen == "frame-team" else 0 if chosen == "frame" else None

    @property
    def state(self) -> str:
        c = self.choice.chosen
        return "trial" if c is None else "off" if c == "loop" else "on"

    @property
    def record(self) -> Record:
        return self.choice.record

    def takes(self, B: int) -> bool:
        """The frame may serve B rows now: it is not off, B fits, and the predictor's fused step serves."""
        return self.state != "off" and 1 <= B <= MAX_ROWS and self.fused.state == "on"

    def run(self, h, c0, frame_idx, rp, cache, loop):
        """codes [B, 16] of this frame; loop: () -> the Python loop's codes (same cache rows)."""
        if self.state == "trial":
            return self._trial(h, c0, frame_idx, rp, cache, loop)
        try:
            return self._frame(h, c0, frame_idx, rp, cache, self.team)
        except Exception as e:   # one line, then the Python loop for good
            self.disable(f"{type(e).__name__}: {e}")
            return loop()

    def _frame(self, h, c0, frame_idx, rp, cache, team=None):
        # the governor's "matmul" option (engine/threads.MatmulThreads) gives our call its threads
        switch = self.threads_switch() if self.threads_switch is not None else None
        if switch is not None:
            return switch.call(self.plan.run, h, c0, frame_idx, rp, cache, team=team)
        return self.plan.run(h, c0, frame_idx, rp, cache, team=team)

    def _trial(self, h, c0, frame_idx, rp, cache, loop):
        """One frame of the trial at load (`_round`); the last path's codes, decided after TRIAL_FRAMES frames."""
        try:
            res, last = self._round(self.choice, self.agree, h, c0, frame_idx, rp, cache, loop)
        except Exception as e:
            self.disable(f"{type(e).__name__}: {e}")
            return loop()
        if len(self.times["frame"]) >= TRIAL_FRAMES:
            self._decide()
        return res[last]

    def _round(self, choice: MeasuredChoice, agree: list, h, c0, frame_idx, rp, cache, loop):
        """Each path of `choice` once on this frame's input, the order rotating, timed into `choice`: the Python
        loop, the frame with one parallel region per matmul ("frame", split) and the whole frame in one
        ("frame-team", claim; the same as split where the call gets one thread); the two frames must give the same
        codes (they compute the same numbers), else the team one is dropped; `agree` counts the first codebook's
        agreement of "frame" (else "frame-team") with the loop -> ({path: codes}, the path whose codes stand for the frame). Raises
        where a path raises."""
        n = len(choice.times["loop"])
        paths = [p for p in CANDIDATES if p in choice.times]
        paths = paths[n % len(paths):] + paths[:n % len(paths)]
        res = {}
        for which in paths:
            res[which] = (choice.time(which, loop) if which == "loop" else
                          choice.time(which, self._frame, h, c0, frame_idx, rp, cache,
                                      self.TEAM if which == "frame-team" else 0))
        if "frame-team" in res and "frame" in res and not torch.equal(res["frame-team"], res["frame"]):
            choice.drop("frame-team", "the frame in one parallel region gave other codes than the split frame")
        same = res["frame" if "frame" in res else "frame-team"][:, 1] == res["loop"][:, 1]
        agree[0] += int(same.sum())
        agree[1] += same.numel()
        return res, paths[-1] if paths[-1] != "frame-team" or "frame-team" in choice.times else "loop"

    def _decide(self) -> None:
        best = self._verdict_of(self.choice, self.agree)
        self.team = self._team_of(best) if best is not None else None

    def _verdict_of(self, choice: MeasuredChoice, agree: list) -> str | None:
        """`choice` decided from its timings (the fastest by median), or fallen back where the first codebook
        agreed too rarely -> the candidate chosen, None where it fell back."""
        rate = agree[0] / max(1, agree[1])
        if rate < MIN_AGREE:
            choice.fall_back(f"its first codebook agrees with the Python loop's on {rate:.0%} of rows only")
            return None
        return choice.decide(min_samples=TRIAL_FRAMES // 2, names={"loop": "Python loop"},
                             note=f"first codebook agreeing {rate:.0%}")

    def check_at_load(self, inputs, cache, loop) -> bool:
        """A bounded fresh start: CHECK_FRAMES frames of the Python loop and "frame-team" on `inputs` (h, c0,
        frame_idx, rp) in `cache` (the predictor's scratch; loop: () -> the loop's codes on the same), as the
        agreement check only; agreeing, "frame-team" (DEFAULT) serves as the default while the timing waits
        (-> True), else the loop, one log line (-> False)."""
        twin, agree = self.choice.twin(), [0, 0]
        twin.times.pop("frame")   # (the split frame, with the same codes bit for bit, is compared in the trial)
        try:
            for _ in range(CHECK_FRAMES):
                self._round(twin, agree, *inputs, cache, loop)
        except Exception as e:
            self.disable(f"{type(e).__name__}: {e}")
            return False
        rate = agree[0] / max(1, agree[1])
        if rate < MIN_AGREE:
            self.disable(f"its first codebook agrees with the Python loop's on {rate:.0%} of rows only")
            return False
        self.choice.serve_until_measured(DEFAULT_PATH, f"checked against the Python loop at load (first codebook "
                                                       f"agreeing {rate:.0%} in {CHECK_FRAMES} frames)")
        self.team = self._team_of(DEFAULT_PATH)
        return True

    def deferred_trial(self, inputs, cache, loop) -> MeasuredChoice:
        """The timed trial while idle (`deferred_trials`, the trials' thread), TRIAL_FRAMES frames on `inputs` in
        `cache` (a scratch runner's predictor cache: no request's), into a twin of the choice -> the twin, decided
        or fallen back."""
        def trial(twin):
            agree = [0, 0]
            for _ in range(TRIAL_FRAMES):
                deferred_trials.check()
                self._round(twin, agree, *inputs, cache, loop)
            self._verdict_of(twin, agree)
        return self.choice.deferred(trial)

    def verdict(self, twin: MeasuredChoice):
        """Remember what the deferred trial measured -> what applies it (at a frame boundary with no row held)."""
        def team():
            self.team = self._team_of(self.choice.chosen) if self.state == "on" else None
        return self.choice.applier(twin, then=team)

    def disable(self, why: str) -> None:
        self.choice.fall_back(why)
        self.team = None


def attach(talker) -> dict[str, MeasuredChoice | Record]:
    """Give the code predictor a `PredictorFrame` (`talker.code_predictor.frame`) where its stack has a fused step
    (fused_step.attach ran first) and the library runs here -> {"predictor frame": the frame's choice, or the record
    of why there is none} (`ModelRunner.path_entries`). Never raises."""
    cp = talker.code_predictor
    cp.frame = None
    mode = setting()
    if mode == "off":
        return {PART: Record("loop", forced_by(ENV), f"{ENV}={os.environ.get(ENV, '')}")}
    fused = getattr(cp.model, "fused", None)
    if fused is None:
        return {PART: Record("loop", DEFAULT, "the code predictor has no fused step")}
    try:
        plan = FramePlan(talker, fused.plan)
        library()
        cp.frame = PredictorFrame(plan, fused, lambda: getattr(talker, "_matmul_threads", None),
                                  force=mode == "on")
        return {PART: cp.frame.choice}
    except Exception as e:   # an unsupported layer, no compiler, ...: the Python loop, one line
        why = one_line(f"{type(e).__name__}: {e}")
        if not isinstance(e, ValueError):
            log.warning("tts_engine: code predictor frame not used: %s", why)
        return {PART: Record("loop", DEFAULT if isinstance(e, ValueError) else FELL_BACK, why)}
