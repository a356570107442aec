"""Installing the fused GPU frame on a `ModelRunner`: `attach(runner) -> {what: status}`.

On CUDA (and, for tests, on a CPU through Triton's interpreter with `force_interpreter=True`):
1. every kernel runs once on the runner's own shapes, dtype and device against its eager reference (`check_kernels`:
   a kernel that fails to compile raises here, one that disagrees beyond its tolerance too);
2. one frame of row 0 runs eagerly and fused from the same random state (`frame_trial`; the runner's state is
   restored after): fp32 must give the same codes (greedy and seeded sampling) and the same hidden state within
   1e-3; 16-bit dtypes must give a talker hidden within 5e-2 with the eager frame's codes fed to both (their codes
   may legitimately part where two logits are within rounding: reported, not failed);
3. then the runner's two halves of a frame, `_predict_residuals` and `_advance`, are the fused frame's (so `decode`,
   `frame`, the split halves and the CUDA graphs captured afterwards use them). A half that raises later is served
   eagerly and the fused frame is dropped for good.
Any failure in 1-2 leaves the eager frame serving, with ONE log line. Call it before `GraphedFrames.capture_all`.

The verdict of 1-2 is remembered (`cpu.measured.MeasuredChoice`, folder "gpu_frame" of the cache folder), keyed by
what makes it valid (`verdict_key`: the GPU, torch / triton / CUDA versions, the dtype, the model's weight shapes and
a hash of the sources the checks exercise): a later attach with the same key (a new ZeroGPU worker, a restart) skips
the checks and the trial and installs the fused frame at once (`paths()` says "remembered"), or, where the verdict
was a disagreement (or a kernel that does not compile), serves eager without trying again. A failure that may not
repeat (out of memory, a CUDA error) is not remembered. TTS_GPU_FRAME=check runs the checks again and remembers the
new verdict. A kernel that raises while serving still falls back, with one log line, for this process.

Elsewhere (no CUDA, no triton, TTS_GPU_FRAME=0, quantised layers) nothing changes and the status says why.

The result is a `GpuBackend`: a dict of status lines, which is also the object a runner can keep as its backend
(`path_entries()`, the CPU backend's protocol) where the engine attaches backends per device.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import torch

from tts_engine.cpu.measured import MeasuredChoice, describe
from tts_engine.gpu import ops, prefill_graph, variants
from tts_engine.gpu.frame import FusedFrame
from tts_engine.gpu.shapes import model_shapes

log = logging.getLogger("tts_engine")
ENV = "TTS_GPU_FRAME"   # "auto" (default): on CUDA, the remembered verdict or the checks; "check": the checks again;
                        # "0" / "off": never
CANDIDATES = ("eager", "fused")   # the reference first (measured.MeasuredChoice)
FOLDER = "gpu_frame"              # the remembered verdicts, under the cache folder's choices


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


class GpuBackend(dict):
    """What `attach` returns: {entry: status line} (a dict: "gpu frame", and "gpu frame trial" where it ran or was
    remembered), and also the backend object a runner may record (`runner.backend`, as the CPU backend's):
    `path_entries()` says what serves the frame, {part: {"path", "how", "why"}}. `choice`: the verdict's
    `MeasuredChoice` where one was made or remembered (None: nothing to choose, e.g. no CUDA or forced off)."""

    fell_back = False
    choice: MeasuredChoice | None = None

    def path_entries(self) -> dict[str, dict[str, str]]:
        line = self.get("gpu frame", "eager")
        head, _, rest = line.partition(" (")
        why = rest[:-1] if rest.endswith(")") else rest
        if self.choice is not None and self.choice.chosen is not None and not (self.fell_back and head == "eager"
                                                                               and self.choice.chosen == "fused"):
            e = self.choice.entry()
            if e["path"] == "fused" and why and why not in e["why"]:
                e["why"] = f"{why}; {e['why']}"
            return {"gpu frame": e}
        if head == "fused":
            how, why = "default", f"{why}; {self['gpu frame trial']}" if "gpu frame trial" in self else why
        elif ENV in why:
            how = "forced by a variable"
        else:
            how = "fell back" if self.fell_back else "default"
        return {"gpu frame": {"path": head, "how": how, "why": why}}

    def entry(self) -> dict[str, str]:
        """The "gpu frame" part of `TTSEngine.paths()`, live (a fallback while serving shows at once)."""
        return self.path_entries()["gpu frame"]


# --- the remembered verdict's key ---------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]   # tts_engine/
# the code the checks and the trial exercise: the kernels and the fused frame (gpu/), the eager reference (model/,
# the runner's frame halves)
SOURCES = ("gpu/*.py", "model/*.py", "engine/model_runner.py")
_sources_hash: str | None = None


def sources_hash() -> str:
    """sha1 (16 hex digits) of the sources whose change invalidates a verdict (`SOURCES`), computed once."""
    global _sources_hash
    if _sources_hash is None:
        h = hashlib.sha1()
        for pattern in SOURCES:
            for f in sorted(ROOT.glob(pattern)):
                h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        _sources_hash = h.hexdigest()[:16]
    return _sources_hash


def verdict_key(runner, interp: bool) -> dict:
    """What makes a verdict valid: the GPU (or the interpreter), torch / triton / CUDA versions, the dtype, the
    model's shapes and the sources' hash."""
    import triton

    dev = runner.device
    gpu = "Triton interpreter on CPU tensors" if interp else torch.cuda.get_device_name(dev)
    cap = None if interp else list(torch.cuda.get_device_capability(dev))
    return {"gpu": gpu, "capability": cap, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "dtype": str(runner.dtype).removeprefix("torch."),
            "shapes": model_shapes(runner), "sources": sources_hash()}


def _repeats(e: BaseException) -> bool:
    """Whether the same key would fail the same way: a disagreement (AssertionError), a kernel that does not compile
    or does not fit the GPU (Triton's compilation errors, its OutOfResources) or a layout the fused frame refuses
    (ValueError); not out of memory or a CUDA error of the moment."""
    if isinstance(e, (AssertionError, ValueError)):
        return True
    return any("Compil" in c.__name__ or c.__name__ == "OutOfResources" for c in type(e).__mro__)


def keep_triton_cache() -> None:
    """On a Space with persistent storage, Triton's compiled kernels go there too (`<choices>/triton`), unless
    TRITON_CACHE_DIR names a folder: a restarted Space whose verdict is remembered then also finds its kernels
    compiled (without it they are kept in ~/.triton, lost with the container)."""
    from tts_engine.cache_paths import persistent_root

    root = persistent_root()
    if root is not None and not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(root / "triton")   # (read by Triton at each compile; inherited)


def _where(runner, interp: bool) -> str:
    return "Triton interpreter on CPU tensors" if interp else torch.cuda.get_device_name(runner.device)


def attach(runner, force_interpreter: bool = False, force: bool | None = None) -> GpuBackend:
    """The GPU's fast paths on `runner`: the fused frame (`attach_frame`) and, on CUDA, the batched prefill's CUDA
    graphs per bucket (`prefill_graph.attach`: `runner.prefill_graphs`, captured on first use while the engine's frame
    graphs serve) -> the fused frame's status. Never raises."""
    out = attach_frame(runner, force_interpreter, force)
    try:
        prefill_graph.attach(runner)
    except Exception as e:   # noqa: BLE001 - the eager prefill serves
        log.warning("tts_engine: prefill CUDA graphs not attached, the eager prefill serves: %s", _why(e))
    return out


def attach_frame(runner, force_interpreter: bool = False, force: bool | None = None) -> GpuBackend:
    """Install the fused frame on `runner` where it runs and agrees with eager (checked now, or remembered from an
    earlier check with the same `verdict_key`) -> {"gpu frame": status, ...}. Never raises. force_interpreter (alias
    `force`, as bench/census.py calls it): on a CPU too, through Triton's interpreter (switched on for this process,
    `ops.use_interpreter`, if the kernels were compiled ones)."""
    if force is not None:
        force_interpreter = force
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return GpuBackend({"gpu frame": f"eager ({ENV}={setting})"})
    if runner.device.type != "cuda" and not force_interpreter:
        return GpuBackend({"gpu frame": "eager (no CUDA: the fused frame's Triton kernels run on a GPU)"})
    if not ops.available():
        return GpuBackend({"gpu frame": f"eager (triton is not importable: {ops.IMPORT_ERROR})"})
    if force_interpreter and runner.device.type != "cuda" and not ops.use_interpreter():
        return GpuBackend({"gpu frame": "eager (Triton's interpreter could not be switched on)"})
    interp = force_interpreter and runner.device.type != "cuda"
    if not interp:
        keep_triton_cache()
    try:
        key = verdict_key(runner, interp)
    except Exception as e:   # (a key that cannot be made: checked now, not remembered)
        log.info("tts_engine: the fused GPU frame's verdict is not remembered: %s", _why(e))
        key = None
    choice = MeasuredChoice("gpu frame", CANDIDATES, key=key, folder=FOLDER, label="fused GPU frame",
                            fallback="the eager frame serves")
    scope = ops.force_interpreter if interp else contextlib.nullcontext
    if setting != "check" and choice.recall():
        if choice.chosen == "eager":
            log.info("tts_engine: fused GPU frame not used, as checked before (%s=check checks again): %s", ENV,
                     choice.record.why)
            out = GpuBackend({"gpu frame": f"eager (remembered: {choice.record.why})"})
            out.choice = choice
            return out
        try:
            with scope(), torch.inference_mode():
                frame = FusedFrame(runner)
                variant = variants.choose(runner, frame, frame_trial, interp)   # its own verdict, remembered too
        except Exception as e:
            choice.fall_back(_why(e))
            out = GpuBackend({"gpu frame": f"eager ({_why(e)})"})
            out.fell_back, out.choice = True, choice
            return out
        out = GpuBackend({"gpu frame": f"fused (Triton kernels, {_where(runner, interp)})",
                          "gpu frame trial": f"remembered: {choice.record.why}",
                          "gpu frame variant": describe(variant.entry())})
        out.choice = choice
        install(runner, frame, interp, out)
        runner.path_entries["gpu frame variant"] = variant
        return out
    try:
        with scope(), torch.inference_mode():
            frame = FusedFrame(runner)
            check_kernels(runner, frame)
            trial = frame_trial(runner, frame)
            variant = variants.choose(runner, frame, frame_trial, interp)   # gemm or gemv layers (measured)
    except Exception as e:
        choice.fall_back(_why(e), remember_it=_repeats(e))
        out = GpuBackend({"gpu frame": f"eager ({_why(e)})"})
        out.fell_back, out.choice = True, choice
        return out
    where = _where(runner, interp)
    choice.settle("fused", f"Triton kernels, {where}: every kernel agrees with eager; {trial}")
    out = GpuBackend({"gpu frame": f"fused (Triton kernels, {where})", "gpu frame trial": trial,
                      "gpu frame variant": describe(variant.entry())})
    out.choice = choice
    install(runner, frame, interp, out)
    runner.path_entries["gpu frame variant"] = variant   # (engine.paths(): which layers the fused frame runs)
    return out


HALVES = ("_predict_residuals", "_advance")


def install(runner, frame: FusedFrame, interp: bool = False, status: GpuBackend | None = None) -> None:
    """runner._predict_residuals / runner._advance := the fused frame's halves (instance attributes over the class's
    methods), each falling back to the eager one for good (one log line) if it raises; `status` then says so."""
    eager = {name: getattr(type(runner), name).__get__(runner) for name in HALVES}
    fused = {"_predict_residuals": frame.predict, "_advance": frame.advance}

    def half(name):
        def call(*args):
            if runner.__dict__.get("gpu_frame") is not frame:   # dropped meanwhile (the other half failed)
                return eager[name](*args)
            try:
                with ops.force_interpreter() if interp else contextlib.nullcontext():
                    return fused[name](*args)
            except Exception as e:
                log.warning("tts_engine: fused GPU frame failed, the eager frame serves from now on: %s", _why(e))
                uninstall(runner)
                if status is not None:
                    status["gpu frame"] = f"eager (the fused frame raised while serving: {_why(e)})"
                    status.fell_back = True
                return eager[name](*args)
        return call

    for name in HALVES:
        setattr(runner, name, half(name))
    runner.gpu_frame = frame


def uninstall(runner) -> None:
    """The eager frame again (the fused frame's weights, stacked where shared, stay as they are)."""
    for name in HALVES:
        runner.__dict__.pop(name, None)
    runner.gpu_frame = None
    getattr(runner, "path_entries", {}).pop("gpu frame variant", None)


def installed(runner) -> bool:
    return all(name in runner.__dict__ for name in HALVES) and getattr(runner, "gpu_frame", None) is not None


detach = uninstall   # (bench/census.py's name)


# --- the checks at attach -------------------------------------------------------------------------------------------
def check_kernels(runner, frame: FusedFrame) -> dict:
    """Each kernel once on the runner's shapes (both stacks), dtype and device against its reference; raises on a
    failure (compile or mismatch). -> {kernel: "ok"}."""
    dev, dt = runner.device, runner.dtype
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    def same(name, a, b, tol=None):
        try:
            torch.testing.assert_close(a.float(), b.float(), **(tol or _tol(dt)))
        except AssertionError as e:
            raise AssertionError(f"{name} disagrees with eager: {str(e).splitlines()[-1] if str(e) else e}") from None

    out = {}
    for name, st in (("talker", frame.talker), ("predictor", frame.cp)):
        D = st.norm.shape[0]
        x, r = rnd(3, D), rnd(3, D)
        L0 = st.layers[0]
        for a, b in zip(ops.add_rmsnorm(x, r, L0.ln1, st.eps, impl="eager"),
                        ops.add_rmsnorm(x, r, L0.ln1, st.eps, impl="triton")):
            same(f"add_rmsnorm ({name})", a, b)
        H, Hkv, hd = st.H, st.Hkv, st.hd
        qkv = rnd(2, 2, (H + 2 * Hkv) * hd)
        pos = torch.tensor([[3, 4], [0, 1]], device=dev)
        rows = torch.tensor([1, 0], device=dev)
        caches = [rnd(2, Hkv, 8, hd) for _ in range(2)]
        c2 = [c.clone() for c in caches]
        qa = ops.qk_norm_rope_write(qkv, L0.qn, L0.kn, st.eps, pos, rows, *caches, H, Hkv, st.theta, impl="eager")
        qb = ops.qk_norm_rope_write(qkv, L0.qn, L0.kn, st.eps, pos, rows, *c2, H, Hkv, st.theta, impl="triton")
        same(f"qk_norm_rope_write q ({name})", qa, qb)
        same(f"qk_norm_rope_write k cache ({name})", caches[0], c2[0])
        same(f"qk_norm_rope_write v cache ({name})", caches[1], c2[1], dict(atol=0, rtol=0))
        kc, vc = rnd(3, Hkv, 300, hd), rnd(3, Hkv, 300, hd)
        q = rnd(2, 2, H, hd)
        qpos = torch.tensor([[5, 6], [260, 261]], device=dev)
        rows = torch.tensor([2, 0], device=dev)
        want = ops.decode_attention(q, kc, vc, rows, qpos, 262, impl="eager")
        for splits in (1, 2):
            same(f"decode_attention ({name}, {splits} splits)", want,
                 ops.decode_attention(q, kc, vc, rows, qpos, 262, impl="triton", splits=splits))
        gu = rnd(3, L0.wgu.shape[0])
        same(f"silu_mul ({name})", ops.silu_mul(gu, impl="eager"), ops.silu_mul(gu, impl="triton"))
        out[name] = "ok"
    t = runner.talker
    V0, Vc = t.cfg.vocab_size, t.code_predictor.cfg.vocab_size
    D = frame.table.shape[1]
    codes = torch.stack([torch.randint(0, 2048, (3,), generator=g) for _ in range(frame.n_books)], 1).to(dev)
    trailing, tlen = rnd(4, 5, D), torch.tensor([0, 2, 5, 3], device=dev)
    step, rows = torch.tensor([1, 3, 2, 9], device=dev), torch.tensor([3, 1, 2], device=dev)
    pad = rnd(D)
    fe_args = (codes, frame.table, frame.offsets, trailing, tlen, pad, step, rows)
    same("frame_embed", ops.frame_embed(*fe_args, impl="eager"), ops.frame_embed(*fe_args, impl="triton"))
    from tts_engine.model.sampling import RowParams, SamplingParams

    rp = RowParams.stack([SamplingParams(do_sample=False, subtalker_dosample=False),
                          SamplingParams(seed=5, top_p=0.8, subtalker_top_p=0.8),
                          SamplingParams(seed=9, top_k=3, subtalker_top_k=3, temperature=1.3,
                                         subtalker_temperature=0.7)], dev)
    for book, V in ((3, Vc), (0, V0)):
        logits = (torch.randn(3, V, generator=g) * 3).to(dev)
        if book:
            a = ops.sample_residual(logits, rows, step, rp, book, impl="eager")
            b = ops.sample_residual(logits, rows, step, rp, book, impl="triton")
            if not torch.equal(a, b):
                raise AssertionError(f"the sampler (codebook {book}) disagrees with eager: {a.tolist()} vs "
                                     f"{b.tolist()}")
            fidx = step[rows] - 1   # (as the fused frame calls it: frame indices, rows 0..B-1)
            a = ops.sample_residual(logits, torch.arange(3, device=dev), fidx, rp, book, impl="triton", frame_off=0)
        else:
            seen = (torch.rand(4, V, generator=g) < 0.05).to(dev)
            a = ops.sample_c0(logits, rows, rp, runner.c0_proc, seen, step, impl="eager")
            b = ops.sample_c0(logits, rows, rp, runner.c0_proc, seen, step, impl="triton")
        if not torch.equal(a, b):
            raise AssertionError(f"the sampler (codebook {book}) disagrees with eager: {a.tolist()} vs {b.tolist()}")
    out["sampler"] = "ok"
    return out


_STATE = ("pos", "step", "seen", "hidden", "c0", "max_new", "trailing_len")


def frame_trial(runner, frame: FusedFrame) -> str:
    """One frame of row 0 from a random state, eager then fused (greedy, then seeded sampling with top-k / top-p),
    compared as the module docstring says; every tensor it touches is restored. Raises on a disagreement."""
    from tts_engine.model.sampling import RowParams, SamplingParams

    run = runner
    dev, dt = run.device, run.dtype
    P = max(1, min(16, run.max_len - 2))
    saved = {k: getattr(run, k)[0].clone() for k in _STATE}
    saved_kv = (run.cache.k[:, 0, :, :P + 1].clone(), run.cache.v[:, 0, :, :P + 1].clone())
    hook, run.on_frame_codes = run.on_frame_codes, None
    g = torch.Generator(device="cpu").manual_seed(1)
    start = {"k": (torch.randn(run.cache.k[:, 0, :, :P].shape, generator=g)).to(dev, dt),
             "v": (torch.randn(run.cache.v[:, 0, :, :P].shape, generator=g)).to(dev, dt),
             "hidden": (torch.randn(run.hidden.shape[1], generator=g) * 2).to(dev, dt),
             "c0": int(torch.randint(0, 2048, (1,), generator=g))}

    def reset():
        run.cache.k[:, 0, :, :P] = start["k"]
        run.cache.v[:, 0, :, :P] = start["v"]
        run.pos[0], run.step[0], run.max_new[0], run.trailing_len[0] = P, 3, 1 << 20, 0
        run.seen[0] = False
        run.hidden[0], run.c0[0] = start["hidden"], start["c0"]

    r = run.row_index[:1]
    cls = type(run)

    def eager():
        codes = cls._predict_residuals(run, run.hidden[r], run.c0[r], run.step[r] - 1, rp)
        return codes, cls._advance(run, r, slice(0, 1), rp, P + 1, codes)

    def fused():
        codes = frame.predict(run.hidden[r], run.c0[r], run.step[r] - 1, rp)
        return codes, frame.advance(r, slice(0, 1), rp, P + 1, codes)

    notes = []
    try:
        for label, p in (("greedy", SamplingParams(do_sample=False, subtalker_dosample=False)),
                         ("sampled", SamplingParams(seed=11, top_k=50, top_p=0.9, subtalker_top_k=50,
                                                    subtalker_top_p=0.9))):
            rp = RowParams.stack([p], dev)
            reset()
            codes_e, done_e = eager()
            h_e = run.hidden[0].float().clone()
            reset()
            codes_f, done_f = fused()
            h_f = run.hidden[0].float().clone()
            rel = float((h_f - h_e).norm() / h_e.norm().clamp_min(1e-12))
            if dt == torch.float32:
                if not torch.equal(codes_e, codes_f) or not torch.equal(done_e, done_f) or rel > 1e-3:
                    raise AssertionError(f"fused frame ({label}) differs from eager: codes {codes_f.tolist()} vs "
                                         f"{codes_e.tolist()}, hidden rel. error {rel:.2e}")
                notes.append(f"{label}: same codes, hidden rel. error {rel:.1e}")
            else:
                reset()   # the talker step teacher-forced on the eager codes: its hidden must be close
                frame.advance(r, slice(0, 1), rp, P + 1, codes_e)
                rel_tf = float((run.hidden[0].float() - h_e).norm() / h_e.norm().clamp_min(1e-12))
                if rel_tf > 5e-2:
                    raise AssertionError(f"fused talker step ({label}) differs from eager: hidden rel. error "
                                         f"{rel_tf:.2e}")
                n_same = int((codes_e == codes_f).sum())
                notes.append(f"{label}: {n_same}/{codes_e.numel()} codes equal, talker hidden rel. error {rel_tf:.1e}")
    finally:
        for k, v in saved.items():
            getattr(run, k)[0] = v
        run.cache.k[:, 0, :, :P + 1], run.cache.v[:, 0, :, :P + 1] = saved_kv
        run.on_frame_codes = hook
    return "; ".join(notes)
