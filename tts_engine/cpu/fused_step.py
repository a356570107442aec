"""A fused CPU decode step: one call of our own C++ (`fused_step.cpp`) runs every layer of a quantised or bf16 decoder
stack (the talker's, the code predictor's) for a few rows at one new position each, instead of ~60 aten calls per
layer around the matmuls (norms, RoPE, cache writes, attention, views, residual adds).

Where it serves: CPU engines in the W8A8, W4A8 and bf16 modes, in `DecoderStack.run` calls of at most MAX_ENTRIES
(row, position) entries and at most 2 positions per row: the talker's decode step (one position per row) and the
code predictor's 15 passes (the first has two positions: the talker's hidden and codebook 0). Prompt prefills, the
quality tool's teacher-forced passes, fp32, int8, int4 and GPU engines keep the eager path (`layers.py`).

Numerics: the same quantised weights and the same int8 activation rounding per matmul as the eager layers
(cpu_ext.cpp's kernels, included in fused_step.cpp); bf16 stacks: the nn.Linear layers' own bf16 weights, read in
place (no copy), activations rounded to bf16 per matmul as the eager bf16 layers take them, fp32 sums (AVX-512
BF16 `vdpbf16ps`, else bf16 widened to fp32 with AVX-512F or AVX2 + FMA: `ttsf_bf16_isa`). Between the matmuls
everything stays fp32 where the eager path rounds to the engine's dtype (bf16) after each op. The KV cache is
written in its own dtype, as eager.

Chosen by measuring, never assumed (`TTS_FUSED_STEP`):
  auto (default)  a trial when the step is attached (engine load), before any request: TRIAL_PAIRS one-position
                  calls of one row on a private scratch cache (random keys, values and inputs) run both paths,
                  timed, alternating which goes first; their hidden states must agree (cosine >= MIN_COS, else the
                  fused step is off); the faster by median serves from then on, from a request's first call on (no
                  request sees the trial: a lossy engine's first request decodes as its later ones). The choice is
                  remembered per machine (kernel table's machine key: CPU model and flags, torch, threads, our
                  kernels) and stack in the cache folder (`$TTS_CACHE_DIR/fused_step/`), so a later start does not
                  measure again. At a fresh bounded start (`deferred_trials`, TTS_START_TRIALS=bounded, attached by
                  the CPU backend) only CHECK_PAIRS pairs run at load, untimed, as the agreement check: the fused
                  step serves as the default ("measurement pending"), and the timed trial runs on its own scratch
                  cache while idle; its verdict is remembered and applied at a frame boundary with no row held.
  1 / on          fused wherever it runs, without timing (benchmarks' A/B, tests).
  0 / off         never.
Any failure (no compiler, a build error, an unsupported layer or CPU path, an exception or a refused input later)
logs one line and leaves the eager path serving for good; it never takes the engine down.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import measured
from tts_engine.cpu.measured import DEFAULT, FELL_BACK, MeasuredChoice, Record, forced_by, one_line
from tts_engine.model.layers import KVCache

log = logging.getLogger("tts_engine")

ENV = "TTS_FUSED_STEP"
TEAM_ENV = "TTS_FUSED_TEAM"
SOURCE = Path(__file__).parent / "csrc" / "fused_step.cpp"
MAX_ENTRIES = 16        # (row, position) entries per call: decode batches; more is a prefill (eager)
MAX_T = 2               # positions per row per call (the predictor's first pass has 2)
TRIAL_PAIRS = 4         # timed (eager, fused) pairs per stack before choosing
CHECK_PAIRS = 1         # a bounded fresh start: (eager, fused) pairs run at load as the agreement check only
TRIAL_POS = 32          # the trial's calls write positions TRIAL_POS.. of its scratch cache (attention over ~32 keys)
MIN_COS = 0.99          # the two paths' hidden states must agree at least this well (a bug detector, not quality)
LAYER_FIELDS = 12       # fused_step.cpp LayerField


def setting() -> str:
    """"auto", "on" or "off" (env TTS_FUSED_STEP)."""
    return measured.setting(ENV)


TEAM_MODES = {"split": 0, "barrier": 1, "claim": 2}   # fused_step.cpp TeamMode


def team_setting() -> int:
    """How a call uses torch's threads (env TTS_FUSED_TEAM; fused_step.cpp): "split" (default; also 0 / off): one
    at::parallel_for per matmul, the small ops in the caller; "claim" (also 1 / on): the whole stack in one parallel
    region, the threads claiming chunks of each matmul's output and of the attention's heads, a thread the OS takes
    away holding back no more than its chunk; "barrier": one parallel region, a fixed split and a barrier after each
    stage. All give the same numbers bit for bit. Split stays the default until the team modes are measured faster
    on a quiet machine and not slower on a busy one (an engine A/B under load had claim slower)."""
    v = os.environ.get(TEAM_ENV, "split").strip().lower()
    if v in ("0", "off", "no", "false"):
        v = "split"
    elif v in ("1", "on", "yes", "true"):
        v = "claim"
    return TEAM_MODES.get(v, TEAM_MODES["split"])


def set_team(mode) -> int:
    """Switch this process's team mode (benchmarks' A/B, tests): a name of TEAM_MODES, its number, or a bool
    (True: claim, False: split) -> the mode before (a number)."""
    if isinstance(mode, str):
        mode = TEAM_MODES[mode]
    elif isinstance(mode, bool):
        mode = TEAM_MODES["claim" if mode else "split"]
    return int(library().ttsf_set_team(int(mode)))


# fused_step.cpp Stage: the profile's stages, in order (the last two are counts); "other": input, output, scratch
# and what lies outside the stages (a team's fork and join)
STAGES = ("other", "norm_in", "quant", "qkv", "rope_cache", "attn", "o_proj", "resid", "norm_post", "gate_up", "silu",
          "down", "busy_max", "busy_min", "call", "calls", "matmuls")


class profile:
    """`with fused_step.profile() as prof: ...` times every stage of the fused calls made inside (fused_step.cpp's
    profile; off, it costs nothing but a branch per stage); prof.ns: {stage: nanoseconds summed} (calls, matmuls:
    counts) once the block is left. (predictor_frame.profile: the same over the frame's library.)"""

    @staticmethod
    def library() -> ctypes.CDLL:
        return library()

    def __enter__(self):
        self.lib = self.library()
        self._buf = (ctypes.c_int64 * 64)()
        self.lib.ttsf_profile_read(self._buf)   # zero the sums
        self._was = self.lib.ttsf_profile_set(1)
        return self

    def __exit__(self, *exc):
        self.lib.ttsf_profile_set(self._was)
        n = self.lib.ttsf_profile_read(self._buf)
        self.ns = dict(zip(STAGES, list(self._buf)[:n]))
        return False


def declare_profile(lib: ctypes.CDLL) -> None:
    """The C types of the profile's functions (`profile`), in this library or one that includes fused_step.cpp."""
    I = ctypes.c_int
    lib.ttsf_profile_set.argtypes, lib.ttsf_profile_set.restype = [I], I
    lib.ttsf_profile_read.argtypes, lib.ttsf_profile_read.restype = [ctypes.c_void_p], I


def _declare(lib: ctypes.CDLL) -> None:
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ttsf_layer_fields.restype = I
    lib.ttsf_bf16_isa.restype = I
    lib.ttsf_stack_step.argtypes = [P, ctypes.c_float, P, P, P, P, I, I64, P, P, P, P, P, I]
    lib.ttsf_stack_step.restype = I
    lib.ttsf_set_team.argtypes, lib.ttsf_set_team.restype = [I], I
    declare_profile(lib)
    lib.ttsf_set_spin.argtypes, lib.ttsf_set_spin.restype = [I], I
    lib.ttsf_matmuls.argtypes, lib.ttsf_matmuls.restype = [P, P, I64, I64, I], I
    lib.ttsf_set_team(int(team_setting()))
    lib.ttsf_mm16.argtypes = [P, I64, I64, P, I64, P, I]
    lib.ttsf_mm16.restype = I
    if lib.ttsf_layer_fields() != LAYER_FIELDS:
        raise RuntimeError("fused_step.cpp and fused_step.py disagree on the plan's layout")


# library(): the one library (cpu_ext.library) with the fused step's functions declared; raises where it cannot run here
library = cpu_ext.Beside(_declare)


def bf16_matmul(w: torch.Tensor, x: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """The fused step's bf16 matmul alone (tests, kernel timing): fp32 [M, N] = bf16(x [M, K]) @ w [N, K] (bf16,
    read in place) transposed, on ISA path `isa` (`ttsf_bf16_isa` numbering; None: the best this CPU runs)."""
    lib = library()
    assert w.dtype == torch.bfloat16 and w.is_contiguous() and x.dim() == 2
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    rc = lib.ttsf_mm16(w.data_ptr(), w.shape[0], w.shape[1], x.data_ptr(), x.shape[0], y.data_ptr(),
                       lib.ttsf_bf16_isa() if isa is None else int(isa))
    if rc != 0:
        raise RuntimeError(f"bf16 matmul refused the shapes {tuple(w.shape)}, {tuple(x.shape)} or ISA path {isa}")
    return y


def tag() -> str:
    """The identity of the fused code (its source, the kernels', torch) for the remembered choice."""
    return hashlib.sha1(SOURCE.read_bytes() + cpu_ext.SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]


# --- the plan: raw pointers of one quantised stack -------------------------------------------------------------------
def _fp32(t: torch.Tensor, keep: list) -> int:
    c = t.detach().float().contiguous()
    keep.append(c)
    return c.data_ptr()


def _linear_fields(m, N: int, K: int, wbits: int) -> tuple[int, int]:
    """(packed weight pointer, scale127 pointer or 0) of a quantised layer of shape N x K; raises if it is not one
    the fused step reads."""
    from tts_engine.model.quant import W4A8Linear, W8A8Linear

    if (m.out_features, m.in_features) != (N, K) or getattr(m, "bias", None) is not None:
        raise ValueError(f"a {type(m).__name__} of {m.out_features}x{m.in_features} where {N}x{K} without bias is needed")
    if wbits == 8 and isinstance(m, W8A8Linear) and m.packed is not None:
        return m.packed.data_ptr(), m.scale127.data_ptr()
    if wbits == 4 and isinstance(m, W4A8Linear):
        return m.packed4.data_ptr(), 0
    if wbits == 16 and type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16:
        if not m.weight.is_contiguous() or K % 32 or N % 8:   # fused_step.cpp linear16: K % 32, N % R4
            raise ValueError(f"a bf16 weight of {N}x{K}: not contiguous, or K not a multiple of 32 or N of 8")
        return m.weight.data_ptr(), 0   # read in place: no copy
    raise ValueError(f"{type(m).__name__} is not in our kernels' packed layout")


class StackPlan:
    """Pointers and sizes of one quantised (W8A8 / W4A8) or bf16 `DecoderStack` as fused_step.cpp reads them. Built once after
    quantisation; holds fp32 copies of the norm weights and the RoPE frequencies (born here, alive as long as the
    plan) and points at the layers' own packed weights (alive as long as the model: the plan keeps the stack)."""

    def __init__(self, stack):
        from tts_engine.model.quant import W4A8Linear, W8A8Linear

        cfg = stack.cfg
        first = stack.layers[0].self_attn.qkv_proj
        if first is None:
            raise ValueError("the stack's projections are not fused")
        bf16 = type(first) is torch.nn.Linear and first.weight.dtype == torch.bfloat16
        self.wbits = 8 if isinstance(first, W8A8Linear) else 4 if isinstance(first, W4A8Linear) else 16 if bf16 else 0
        if not self.wbits:
            raise ValueError(f"the stack's layers are {type(first).__name__} "
                             f"({getattr(getattr(first, 'weight', None), 'dtype', '')}), not W8A8 / W4A8 / bf16")
        isa = cpu_ext._state.get("isa", 0)   # W8A8 / W4A8: 2 AVX-512 VNNI, 3 AVX-512 no VNNI, 1 AVX2 (ttsx_isa)
        if self.wbits in (4, 8) and isa not in (1, 2, 3):
            raise ValueError("our W8A8 / W4A8 kernels do not run here")
        if self.wbits == 16:   # fused_step.cpp's bf16 matmul path: 3 AVX-512 BF16, 2 AVX-512F, 1 AVX2 + FMA
            isa = library().ttsf_bf16_isa()
            if not isa:
                raise ValueError("the bf16 matmul needs AVX-512F or AVX2 + FMA")
        self.stack = stack
        L, D, H, Hkv, hd = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim)
        I = cfg.intermediate_size
        if hd % 2 or H % Hkv:
            raise ValueError(f"head_dim {hd} odd or {H} heads not a multiple of {Hkv}")
        self.keep: list = []
        rows = []
        for layer in stack.layers:
            a, m = layer.self_attn, layer.mlp
            rows.append([
                _fp32(layer.input_layernorm.weight, self.keep),
                *_linear_fields(a.qkv_proj, (H + 2 * Hkv) * hd, D, self.wbits),
                _fp32(a.q_norm.weight, self.keep), _fp32(a.k_norm.weight, self.keep),
                *_linear_fields(a.o_proj, D, H * hd, self.wbits),
                _fp32(layer.post_attention_layernorm.weight, self.keep),
                *_linear_fields(m.gate_up_proj, 2 * I, D, self.wbits),
                *_linear_fields(m.down_proj, D, I, self.wbits)])
        self.layers = torch.tensor(rows, dtype=torch.int64)                      # [L, LAYER_FIELDS]
        self.dims = torch.tensor([L, D, H, Hkv, hd, I, self.wbits, isa], dtype=torch.int64)
        # as layers.rope_cos_sin: 1 / theta^(2i / hd) in fp32
        self.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))).contiguous()
        self.final_norm = stack.norm.weight.detach().float().contiguous()
        self.eps = float(cfg.rms_norm_eps)
        self.D = D
        self._strides = {}   # (k's shape, strides) -> the int64 tensor the call reads

    def cache_strides(self, k: torch.Tensor) -> torch.Tensor:
        key = (tuple(k.shape), tuple(k.stride()))
        t = self._strides.get(key)
        if t is None:
            t = self._strides[key] = torch.tensor([k.stride(0), k.stride(1), k.stride(2), k.shape[3]], dtype=torch.int64)
        return t

    def run(self, x: torch.Tensor, cache, rows: torch.Tensor, pos: torch.Tensor, rows_checked: bool = False) -> torch.Tensor:
        """x [M, D] (the cache's dtype) inputs of M entries; rows, pos [M] int64: each entry's cache row and new
        position -> normed hidden [M, D] (a new tensor; the entries' keys and values are written to `cache`).
        rows_checked: the caller knows every row is one of the cache's (FusedStep: rows from a slice of it)."""
        lib = library()
        k, v = cache.k, cache.v
        if x.dtype != k.dtype or k.dtype not in (torch.float32, torch.bfloat16) or not k.is_contiguous() \
                or not v.is_contiguous() or k.shape[0] != self.layers.shape[0]:
            raise ValueError("the cache or the input is not in a layout the fused step reads")
        out = x.reshape(-1, self.D).clone(memory_format=torch.contiguous_format)   # born here, returned
        if rows.dtype != torch.int64 or not rows.is_contiguous():
            rows = rows.to(torch.int64).contiguous()
        if pos.dtype != torch.int64 or not pos.is_contiguous():
            pos = pos.to(torch.int64).contiguous()
        M = out.shape[0]
        if rows.numel() != M or pos.numel() != M:
            raise ValueError("rows / positions do not fit the cache")
        if not rows_checked and (int(rows.max()) >= k.shape[1] or int(rows.min()) < 0):
            raise ValueError("rows / positions do not fit the cache")
        strides = self.cache_strides(k)
        bf16 = int(k.dtype == torch.bfloat16)
        rc = lib.ttsf_stack_step(self.dims.data_ptr(), self.eps, self.layers.data_ptr(), self.inv_freq.data_ptr(),
                                 self.final_norm.data_ptr(), out.data_ptr(), bf16, M, rows.data_ptr(),
                                 pos.data_ptr(), k.data_ptr(), v.data_ptr(), strides.data_ptr(), bf16)
        if rc != 0:
            raise RuntimeError(f"the fused step refused its input (code {rc})")
        return out


# --- the choice between the fused and the eager step -----------------------------------------------------------------
CANDIDATES = ("eager", "fused")   # the reference first (measured.MeasuredChoice)


class FusedStep:
    """Serves `DecoderStack.run` calls through a `StackPlan` where that was measured faster (module doc): built with
    nothing remembered, it runs the trial at once (`_measure`, on the plan's stack). `choice` (a
    `measured.MeasuredChoice`, part "<name> stack") holds the answer and its record; state: "on", "off" ("trial"
    only while it measures)."""

    def __init__(self, plan: StackPlan, name: str, threads_switch=None, force: bool = False, later=None):
        """later: where nothing is remembered, the trial's timing goes there (`deferred_trials.AtBoundary.defer`:
        a bounded fresh start) after the agreement check at load; None: the whole trial now."""
        self.plan, self.name = plan, name
        self.threads_switch = threads_switch   # () -> threads.MatmulThreads or None (the governor's "matmul" option)
        self.min_cos = 1.0
        self._index: dict = {}   # (first row, B, T) -> (cache rows of the B T entries, position offsets [1, T])
        key = None
        if not force:
            from tts_engine.cpu.kernels import machine_key

            key = {"machine": machine_key(), "fused": tag(), "stack": name, "wbits": plan.wbits,
                   "dims": plan.dims.tolist()}
        self.choice = MeasuredChoice(f"{name} stack", CANDIDATES, env=ENV, key=key, folder="fused_step",
                                     prefix=f"{name}-", label=f"fused {name} step", fallback="eager")
        self.times = self.choice.times
        if force:
            self.choice.force("fused")
        elif not self.choice.recall():
            if later is None:
                self._measure()
            elif self._check_at_load():
                later(f"fused {name} step", self._deferred_trial, self._verdict)

    @property
    def state(self) -> str:
        c = self.choice.chosen
        return "trial" if c is None else "on" if c == "fused" else "off"

    @property
    def record(self) -> Record:
        return self.choice.record

    def takes(self, B: int, T: int) -> bool:
        return self.state != "off" and T <= MAX_T and B * T <= MAX_ENTRIES

    def run(self, x: torch.Tensor, cache, rows, start: torch.Tensor, eager):
        """x [B, T, D]; rows: cache rows (slice or index tensor [B]); start [B] each row's first new position;
        eager: () -> the eager result (same cache writes). -> normed hidden [B, T, D]."""
        if self.state != "on":
            return eager()
        try:
            return self._fused(x, cache, rows, start)
        except Exception as e:   # one line, then the eager path for good
            self.disable(f"{type(e).__name__}: {e}")
            return eager()

    def _entries(self, rows, start, B: int, T: int, cache_rows: int):
        """(rows_e, pos_e [B T] int64, rows known to fit the cache): rows given as a slice are built once per
        (first row, B, T) shape; T == 1 positions are `start` itself."""
        if isinstance(rows, slice):
            r0 = rows.start or 0
            key = (r0, B, T)
            got = self._index.get(key)
            if got is None:
                got = self._index[key] = (torch.arange(r0, r0 + B)[:, None].expand(B, T).reshape(-1).contiguous(),
                                          torch.arange(T)[None, :])
            rows_e, t = got
            checked = 0 <= r0 and r0 + B <= cache_rows
        else:
            rows_e = rows.reshape(B)[:, None].expand(B, T).reshape(-1)                   # [B T]
            t = torch.arange(T)[None, :]
            checked = False
        if T == 1 and start.dtype == torch.int64:
            pos_e = start.reshape(B)
        else:
            pos_e = (start.reshape(B, 1) + t).reshape(-1)                                  # [B T]
        return rows_e, pos_e, checked

    def _fused(self, x, cache, rows, start):
        B, T, D = x.shape
        rows_e, pos_e, checked = self._entries(rows, start, B, T, cache.k.shape[1])
        # the governor's "matmul" option (engine/threads.MatmulThreads) gives our call its threads
        switch = self.threads_switch() if self.threads_switch is not None else None
        args = (x.reshape(B * T, D), cache, rows_e, pos_e, checked)
        out = switch.call(self.plan.run, *args) if switch is not None else self.plan.run(*args)
        return out.view(B, T, D)

    def _measure(self) -> None:
        """The trial (module doc), now: TRIAL_PAIRS pairs timed, then the faster serves -> state "on" or "off"."""
        if self._run_trial(self.choice, TRIAL_PAIRS):
            self._decide()

    def _run_trial(self, choice: MeasuredChoice, pairs: int) -> bool:
        """`pairs` one-position calls of one row on a private scratch cache, both paths on the same random input
        each, alternating which goes first (`MeasuredChoice.trial`, timed into `choice`; a disagreement makes it
        fall back) -> whether the fused path is still a candidate. No engine cache and no request sees it."""
        stack = self.plan.stack
        cfg, dtype = stack.cfg, stack.norm.weight.dtype
        g = torch.Generator().manual_seed(0)
        cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, TRIAL_POS + pairs, cfg.head_dim,
                        "cpu", dtype)
        for t in (cache.k, cache.v):   # earlier positions' keys and values: something to attend to
            t.copy_(torch.randn(t.shape, generator=g))

        def inputs(i):
            pos = TRIAL_POS + i
            return torch.randn(1, 1, cfg.hidden_size, generator=g).to(dtype), torch.tensor([pos]), pos

        run = {"eager": lambda x, start, pos: stack._run_eager(x, cache, slice(0, 1), start, pos + 1, None, None),
               "fused": lambda x, start, pos: self._fused(x, cache, slice(0, 1), start)}
        with torch.inference_mode():
            return choice.trial(run, pairs, inputs, self._check)

    def _check_at_load(self) -> bool:
        """A bounded fresh start: CHECK_PAIRS pairs as the agreement check only; agreeing, the fused step serves as
        the default while its timing waits (-> True), else it falls back (one log line) -> False."""
        twin = self.choice.twin()
        if not self._run_trial(twin, CHECK_PAIRS):
            self.choice.take(twin)
            return False
        self.choice.serve_until_measured("fused", f"checked against eager at load (hidden cos {self.min_cos:.5f})")
        return True

    def _deferred_trial(self) -> MeasuredChoice:
        """The timed trial while idle (`deferred_trials`, the trials' thread): on its own scratch cache, into a twin
        of the choice -> the twin, decided (or fallen back)."""
        twin = self.choice.twin()
        if self._run_trial(twin, TRIAL_PAIRS):
            twin.decide(note=f"per call, hidden cos >= {self.min_cos:.5f}, measured while idle")
        return twin

    def _verdict(self, twin: MeasuredChoice):
        """Remember what the deferred trial measured -> what applies it (at a frame boundary with no row held)."""
        return self.choice.applier(twin)

    def _check(self, eager: torch.Tensor, fused: torch.Tensor) -> str | None:
        """Why the fused hidden states do not agree with the eager ones (cosine < MIN_COS: a bug detector), or None."""
        cos = float(F.cosine_similarity(fused.float().reshape(1, -1), eager.float().reshape(1, -1)))
        self.min_cos = min(self.min_cos, cos)
        if cos < MIN_COS:
            return f"its hidden states differ from the eager path's (cosine {cos:.4f} < {MIN_COS})"
        return None

    def _decide(self) -> None:
        self.choice.decide(note=f"per call, hidden cos >= {self.min_cos:.5f}")

    def disable(self, why: str) -> None:
        self.choice.fall_back(why)


def attach(talker, later=None) -> dict[str, MeasuredChoice | Record]:
    """Give the talker's and the code predictor's stacks a `FusedStep` where they are quantised W8A8 / W4A8 or bf16
    on a CPU and the fused library runs here -> {"talker stack": .., "predictor stack": ..}: the step's choice, or
    the record of why there is none (`ModelRunner.path_entries`). later: where a trial's timing goes at a bounded
    fresh start (`FusedStep`). Never raises."""
    out = {}
    mode = setting()
    stacks = {"talker": talker.model, "predictor": talker.code_predictor.model}
    for name, stack in stacks.items():
        part = f"{name} stack"
        stack.fused = None
        if mode == "off":
            out[part] = Record("eager", forced_by(ENV), f"{ENV}={os.environ.get(ENV, '')}")
            continue
        if stack.norm.weight.device.type != "cpu":
            out[part] = Record("eager", DEFAULT, "CPU only")
            continue
        try:
            plan = StackPlan(stack)
            library()
            stack.fused = FusedStep(plan, name, lambda: getattr(talker, "_matmul_threads", None), force=mode == "on",
                                    later=later)
            out[part] = stack.fused.choice
        except Exception as e:   # not a quantised stack, no compiler, ...: eager, one line
            why = one_line(f"{type(e).__name__}: {e}")
            # (a stack the fused step does not read is no failure: that is the default)
            out[part] = Record("eager", DEFAULT if isinstance(e, ValueError) else FELL_BACK, why)
            if not isinstance(e, ValueError):
                log.warning("tts_engine: fused %s step not used: %s", name, why)
    return out
