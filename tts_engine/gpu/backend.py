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

Elsewhere (no CUDA, no triton, TTS_GPU_FRAME=0, quantised layers) nothing changes and the status says why.

The result is a `GpuBackend`: a dict of status lines, which is also the object a runner can keep as its backend
(`path_entries()`, the CPU backend's protocol) where the engine attaches backends per device.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from tts_engine.cpu.measured import describe
from tts_engine.gpu import ops, variants
from tts_engine.gpu.frame import FusedFrame

log = logging.getLogger("tts_engine")
ENV = "TTS_GPU_FRAME"   # "auto" (default): on CUDA; "0" / "off": never


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


class GpuBackend(dict):
    """What `attach` returns: {entry: status line} (a dict: "gpu frame", and "gpu frame trial" where it ran), and also
    the backend object a runner may record (`runner.backend`, as the CPU backend's): `path_entries()` says what
    serves the frame, {part: {"path", "how", "why"}}."""

    fell_back = False

    def path_entries(self) -> dict[str, dict[str, str]]:
        line = self.get("gpu frame", "eager")
        head, _, rest = line.partition(" (")
        why = rest[:-1] if rest.endswith(")") else rest
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


def attach(runner, force_interpreter: bool = False, force: bool | None = None) -> GpuBackend:
    """Install the fused frame on `runner` where it runs and agrees with eager -> {"gpu frame": status, ...}. Never
    raises. force_interpreter (alias `force`, as bench/census.py calls it): on a CPU too, through Triton's interpreter
    (switched on for this process, `ops.use_interpreter`, if the kernels were compiled ones)."""
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
    try:
        with (ops.force_interpreter() if interp else contextlib.nullcontext()), torch.inference_mode():
            frame = FusedFrame(runner)
            check_kernels(runner, frame)
            trial = frame_trial(runner, frame)
            variant = variants.choose(runner, frame, frame_trial, interp)   # gemm or gemv layers (measured)
    except Exception as e:
        why = _why(e)
        log.warning("tts_engine: fused GPU frame not used, the eager frame serves: %s", why)
        out = GpuBackend({"gpu frame": f"eager ({why})"})
        out.fell_back = True
        return out
    where = "Triton interpreter on CPU tensors" if interp else torch.cuda.get_device_name(runner.device)
    out = GpuBackend({"gpu frame": f"fused (Triton kernels, {where})", "gpu frame trial": trial,
                      "gpu frame variant": describe(variant.entry())})
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
