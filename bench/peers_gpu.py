"""Peers on the same GPU: qwen3-tts-triton 0.3.0 and faster-qwen3-tts-batch 0.2.0 on the same random weights.

    bash bench/gpu_wheels.sh                          (where there is network: the wheels into .whl/)
    python -m bench peers_gpu --out gpu-out/peers_gpu.json [--models 0.6B,1.7B] [--batches 1,4,16,64]
        [--frames 128] [--budget-s 200] [--engines triton,batch,triton_batch]
    python -m bench peers_gpu --dry-run               (a CPU: every engine at a tiny size, graphs run eagerly)

Engines, each (engine, model) in its own subprocess with its own PYTHONPATH (they pin transformers versions the
project does not use; one that fails or runs out of time never stops the others):
- `triton`: qwen3-tts-triton's hybrid runner (`TritonFasterRunner`): faster-qwen3-tts 0.5.4 with the fused Triton
  RMSNorm, SwiGLU and residual-add + RMSNorm kernels patched into the model before its CUDA graphs are captured
  (the runner's default layer range, 0-24). One stream: codes, end to end, streaming first audio - the rows of
  faster-qwen3-tts in ../shared/bench/gpu_anchors/anchor_bench.py, whose code this driver reuses.
- `batch`: faster-qwen3-tts-batch's `BatchedFasterQwen3TTS.generate_voice_clone_batch`, B requests at once
  (batched prefill, batched CUDA graphs), at each of --batches.
- `triton_batch`: qwen3-tts-triton's `generate_batch` on the hybrid runner (a B-batched CUDA graph holding the
  Triton kernels), B texts at once, at each of --batches.
- `faster`: faster-qwen3-tts 0.5.4 alone (the baseline; the peers step of bench/gpu_session.sh also runs it).

The weights are random, bf16, at the real 12Hz-0.6B-Base / 1.7B-Base sizes, built from the configuration by
anchor_bench.py (no download, no network): the same weights for every engine, seed 0. The codec's end-of-speech id
can never be sampled (a -1e4 bias on the talker's codec head), so every request yields exactly --frames frames;
the check column says whether it did. The workload is anchor_bench's: an x-vector voice prompt, 32 fake text
tokens, temperature 0.9, top-k 50, repetition penalty 1.05. `triton_batch` is a custom-voice API: the same
weights get one speaker id, whose prompt has the x-vector prompt's length.

Figures: x real time per stream (audio s / wall s), audio s per wall s (streams x that), first audio (the
streaming call's first chunk; the batch APIs do not stream: their first audio is the whole clip), ms per frame,
GPU memory (torch.cuda.max_memory_allocated during the series). Medians of --runs after --warmup warm-up calls; a
timed run that would end past --budget-s is not started. JSON (--out) and a markdown table (--md, default beside
the JSON) are written after every worker, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE

# engine -> (what it is, the wheel folders on its PYTHONPATH, first wins)
# The batch engines build their graphs with the transformers 4.x API (create_causal_mask(input_embeds=...,
# cache_position=...), lazy_initialization(key)), which transformers 5 removed; faster-qwen3-tts >= 0.4 needs
# transformers 5. They run on the stack they were written for: faster-qwen3-tts 0.3.2 (the last on transformers 4.x,
# the same API) over the official set (qwen-tts 0.1.1, transformers 4.57.3).
ENGINES = {
    "triton": ("qwen3-tts-triton 0.3.0 hybrid runner (faster-qwen3-tts 0.5.4 + fused Triton kernels), one stream",
               ("triton", "faster", "common")),
    "batch": ("faster-qwen3-tts-batch 0.2.0 generate_voice_clone_batch (batched CUDA graphs) on faster-qwen3-tts "
              "0.3.2, transformers 4.57.3", ("batch", "faster4", "official", "common")),
    "triton_batch": ("qwen3-tts-triton 0.3.0 generate_batch on the hybrid runner (B-batched CUDA graph) on "
                     "faster-qwen3-tts 0.3.2, transformers 4.57.3", ("triton", "faster4", "official", "common")),
    "faster": ("faster-qwen3-tts 0.5.4, one stream (baseline)", ("faster", "common")),
}
DEFAULT_ENGINES = "triton,batch,triton_batch"
WHEEL_SETS = ("faster", "common", "triton", "batch", "faster4", "official")
# the wheels are for CPython 3.12 on x86-64 Linux (the GPU image's Python); under another Python (a dry run) the
# ones built for 3.12 only are left out (their modules are stubbed or come from the base environment)
NOT_312 = ["--ignore-requires-python"]
SPEAKER, SPEAKER_ID = "vivian", 3000     # the speaker triton_batch's custom-voice API asks for (a codec id < 3072)
TRITON_PATCH_RANGE = (0, 24)             # TritonFasterRunner's default: the last 4 talker layers stay PyTorch
KILL_GRACE_S = 30.0


def default_anchor() -> Path:
    for p in (ROOT / ".whl" / "anchor_bench.py", ROOT.parent / "shared" / "bench" / "gpu_anchors" / "anchor_bench.py"):
        if p.is_file():
            return p
    return ROOT / ".whl" / "anchor_bench.py"


# ----------------------------------------------------------------------------------------------------------------
# install: each wheel folder into its own --target folder (once per set of wheels)
# ----------------------------------------------------------------------------------------------------------------
def install(wheels: Path, site: Path, sets=WHEEL_SETS) -> dict:
    """pip-installs .whl/<set>/*.whl into <site>/<set> for each set (no index, no dependencies); a folder whose
    stamp matches its wheels is kept. Returns {set: "installed" | "kept"}; raises SystemExit when a set is empty."""
    out = {}
    for name in sets:
        files = sorted((wheels / name).glob("*.whl"))
        if not files:
            raise SystemExit(f"no wheels in {wheels / name}: run `bash bench/gpu_wheels.sh` where there is network")
        key = [sys.version] + [f"{f.name}:{f.stat().st_size}" for f in files]
        stamp = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
        target = site / name
        mark = target / ".peers_gpu_stamp"
        if mark.is_file() and mark.read_text() == stamp:
            out[name] = "kept"
            continue
        shutil.rmtree(target, ignore_errors=True)
        usable, skipped = usable_wheels(files)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", str(target)]
        if sys.version_info[:2] != (3, 12):
            cmd += NOT_312
        r = subprocess.run(cmd + [str(f) for f in usable], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"installing {wheels / name} into {target} failed:\n{r.stderr[-2000:]}")
        if skipped:
            print(f"{name}: not for this Python, left out: {', '.join(f.name for f in skipped)}", flush=True)
        mark.write_text(stamp)
        out[name] = "installed"
    return out


def usable_wheels(files):
    """(wheels this interpreter can import, the others) by their file-name tags."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    mine = set(sys_tags())
    usable, skipped = [], []
    for f in files:
        (usable if parse_wheel_filename(f.name)[3] & mine else skipped).append(f)
    return usable, skipped


def engine_path(engine: str, site: Path) -> str:
    return os.pathsep.join(str(site / s) for s in ENGINES[engine][1])


# ----------------------------------------------------------------------------------------------------------------
# worker side (runs in a subprocess with the engine's PYTHONPATH; imports nothing of the project)
# ----------------------------------------------------------------------------------------------------------------
def load_anchor(path: str):
    spec = importlib.util.spec_from_file_location("anchor_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["anchor_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def emulate_on_cpu(ctx, anchor):
    """CPU dry run only: torch.cuda's synchronize / memory calls made harmless and the batched CUDA graphs of both
    batch engines run their bodies eagerly (anchor_bench.emulate_cuda_graphs_on_cpu does the same for
    faster-qwen3-tts's own graphs, and qwen3-tts-triton's batched graphs inherit its capture/run)."""
    import types

    import torch
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.empty_cache = lambda *a, **k: None
    ctx.env["cuda_graphs"] = "EMULATED (eager) - CPU dry run, timings meaningless"
    anchor.emulate_cuda_graphs_on_cpu()
    try:
        from faster_qwen3_tts_batch.batched_predictor_graph import BatchedPredictorGraph
        from faster_qwen3_tts_batch.batched_talker_graph import BatchedTalkerGraph
    except ImportError:
        return

    def talker_capture(self, prefill_len=100, num_warmup=3):
        self._init_cache_layers()
        self._attention_mask_2d.fill_(1)
        self.cache_position[0] = prefill_len
        self.attn_mask = self._mask_fn(config=self.model.config, input_embeds=self.input_buf,
                                       attention_mask=self._attention_mask_2d, cache_position=self.cache_position,
                                       past_key_values=self.static_cache).clone()
        self.graph = types.SimpleNamespace(replay=self._decode_step)
        self.captured = True

    def predictor_capture(self, num_warmup=3):
        self._init_cache_layers()
        self._build_attention_masks()
        self.graph = types.SimpleNamespace(replay=self._full_loop)
        self.captured = True

    BatchedTalkerGraph.capture = talker_capture
    BatchedPredictorGraph.capture = predictor_capture


def interpretable_triton():
    """CPU dry run only, so that qwen3-tts-triton's kernels run through Triton's interpreter: the interpreter has
    no libdevice, so the two kernels that call libdevice.rsqrt get tl.rsqrt (the same function), and the SwiGLU
    wrapper, which refuses CPU tensors, is replaced by the same launch without that check. On a GPU none of this
    runs: the wheel's kernels and wrappers are compiled and called as shipped."""
    try:
        import torch
        import triton.language as tl
        from qwen3_tts_triton.kernels import fused_norm_residual, rms_norm, swiglu
        from qwen3_tts_triton.kernels.utils import calculate_settings
        from qwen3_tts_triton.models import patching
    except ImportError:
        return []
    for mod in (fused_norm_residual, rms_norm):
        mod.rsqrt = lambda x: tl.rsqrt(x)    # looked up at call time: the interpreter patches tl while it runs

    def swiglu_forward(gate, up):
        shape, n_cols = gate.shape, gate.shape[-1]
        g, u = gate.contiguous().view(-1, n_cols), up.contiguous().view(-1, n_cols)
        out = torch.empty_like(g)
        block, warps = calculate_settings(n_cols)
        swiglu._swiglu_forward_kernel[(g.shape[0],)](g, u, out, out.stride(0), n_cols=n_cols, BLOCK_SIZE=block,
                                                     num_warps=warps)
        return out.view(*shape)

    patching.triton_swiglu_forward = swiglu_forward
    return ["rms_norm", "fused_norm_residual", "swiglu"]


def patch_triton(fq, patch_range):
    """What TritonFasterRunner.load_model does after FasterQwen3TTS.from_pretrained: the Triton kernels patched
    into the model inside the FasterQwen3TTS wrapper, before any CUDA graph is captured. Returns the counts."""
    from qwen3_tts_triton import TritonRMSNorm, apply_triton_kernels
    from qwen3_tts_triton.models.patching import find_patchable_model

    internal = find_patchable_model(fq.model)
    apply_triton_kernels(internal, enable_fused_norm=True, patch_range=patch_range)
    return {"triton_rmsnorm_modules": sum(isinstance(m, TritonRMSNorm) for m in internal.modules()),
            "patch_range": list(patch_range) if patch_range else "all"}


def with_voice_prompt(fq, vcp):
    """faster-qwen3-tts-batch builds each request's prompt from a reference clip path; the random model has no clip,
    so every request gets the precomputed x-vector prompt instead (the prompt the faster/triton rows use)."""
    from faster_qwen3_tts import FasterQwen3TTS

    class WithVoicePrompt(type(fq)):
        def _prepare_generation(self, *a, **k):
            k["ref_audio"] = None
            k["voice_clone_prompt"] = vcp
            return FasterQwen3TTS._prepare_generation(self, *a, **k)

    fq.__class__ = WithVoicePrompt


def batch_row(ctx, anchor, size, b, n, walls, lib_s, frames, samples, base, note):
    peak, over = ctx.mem_peak(base)
    row = {"model": size, "mode": "batch", "batch": b, "n_frames": n, **anchor.summarize(walls, n, b),
           "frames_ok": len(frames) == b and all(f == n for f in frames)
           and all(s == n * SAMPLES_PER_FRAME for s in samples),
           "frames": frames[:4], "peak_gb": peak, "peak_over_resident_gb": over,
           "first_audio_ms": round(statistics.median(walls) * 1000, 1),
           "first_audio_note": "no streaming: the whole clip (codes + codec decode of every clip)", "note": note}
    if lib_s:
        med = statistics.median(lib_s)
        row.update({"codes_s": round(med, 4), "codes_rtf": round(n * FRAME_S / med, 3),
                    "codes_agg_audio_s_per_s": round(b * n * FRAME_S / med, 3)})
    return row


def build_pair(ctx, anchor, size, ids):
    import torch
    with torch.no_grad():
        model, info = anchor.build_official_model(ctx, size)
        fq = anchor.build_faster(ctx, model, ids)
    return model, fq, info


def sweep_batches(ctx, anchor, build, make_call, measured) -> None:
    """The loop both batch workers run: per model size of --models, `build(size) -> (state, info)` (its build row, or
    its error row); then per B of --batches, `make_call(state, b) -> call(frames)` timed by the anchor's `timed_runs`
    (--frames, warmed up at `warm_frames`) and `measured(out, runs) -> (frames per row, samples per row, the library's
    own seconds per run or [])` -> its batch row; the time budget, error rows and memory release around each."""
    a = ctx.args
    n = a.frames
    wf = anchor.warm_frames(ctx, 16)
    for size in a.models.split(","):
        if ctx.time_left() < 30:
            ctx.add(anchor.skipped_row(size, "batch", None, f"time budget ({ctx.time_left():.0f}s left)"))
            continue
        try:
            state, info = build(size)
            ctx.add({"model": size, "mode": "build", **info})
        except Exception as e:  # noqa: BLE001
            ctx.add(anchor.err_row(size, "build", None, e))
            continue
        for b in [int(x) for x in a.batches.split(",") if x]:
            if ctx.time_left() < 20:
                ctx.add(anchor.skipped_row(size, "batch", b, f"time budget ({ctx.time_left():.0f}s left)"))
                continue
            call = None
            try:
                call = make_call(state, b)
                base = ctx.mem_reset()
                walls, out, note = anchor.timed_runs(ctx, lambda: call(n), lambda: call(wf), n / wf)
                if not walls:
                    ctx.add(anchor.skipped_row(size, "batch", b, note))
                    continue
                frames, samples, lib_s = measured(out, len(walls))
                ctx.add(batch_row(ctx, anchor, size, b, n, walls, lib_s, frames, samples, base, note))
            except Exception as e:  # noqa: BLE001
                ctx.add(anchor.err_row(size, "batch", b, e))
            finally:
                call = None            # (what a call holds, e.g. a batched model and its graphs, goes with it)
                anchor.release(ctx)
        state = None
        anchor.release(ctx)


def worker_batch(ctx, anchor):
    """faster-qwen3-tts-batch: generate_voice_clone_batch with B identical requests, B in --batches."""
    import faster_qwen3_tts_batch.batched_generate as bg
    from faster_qwen3_tts_batch import BatchedFasterQwen3TTS

    a = ctx.args
    ids = anchor.fake_text_ids(a.text_tokens).to(ctx.device)
    lib = []
    original = bg.batched_fast_generate

    def timed_generate(*args, **kw):     # the library's own codes time: prefill (amortised per row) + decode loop
        res = original(*args, **kw)
        t = res[0][1]
        lib.append(t["prefill_ms"] * t["batch_size"] / 1000 + t["decode_s"])
        return res

    bg.batched_fast_generate = timed_generate
    req = {"text": "fixed text (ids come from FixedProcessor)", "language": "english", "ref_audio": None,
           "ref_text": ""}

    def build(size):
        model, fq, info = build_pair(ctx, anchor, size, ids)
        with_voice_prompt(fq, anchor.voice_prompt(ctx, model, 1))
        return (model, fq), info

    def make_call(state, b):
        bm = BatchedFasterQwen3TTS(state[1], max_batch_size=b, max_seq_len=a.batch_max_seq_len)
        lib.clear()

        def call(frames):
            return bm.generate_voice_clone_batch(
                [dict(req) for _ in range(b)], max_new_tokens=frames, min_new_tokens=2, temperature=0.9,
                top_k=50, top_p=1.0, do_sample=True, repetition_penalty=1.05, xvec_only=True,
                non_streaming_mode=False, append_silence=False)
        return call

    def measured(out, runs):
        samples = [int(sum(len(x) for x in arrays)) for arrays, _ in out]
        return [s // SAMPLES_PER_FRAME for s in samples], samples, lib[-runs:]

    sweep_batches(ctx, anchor, build, make_call, measured)


def worker_triton_batch(ctx, anchor):
    """qwen3-tts-triton: TritonFasterRunner.generate_batch (B texts, one speaker) on the same random weights."""
    from qwen3_tts_triton import TritonFasterRunner

    a = ctx.args
    ids = anchor.fake_text_ids(a.text_tokens).to(ctx.device)
    lib = []

    def build(size):
        model, fq, info = build_pair(ctx, anchor, size, ids)
        tcfg = model.config.talker_config
        tcfg.spk_id = {SPEAKER: SPEAKER_ID}
        tcfg.spk_is_dialect = {SPEAKER: False}
        model.supported_speakers = tcfg.spk_id.keys()     # what the model's __init__ reads from the config
        runner = TritonFasterRunner(device=str(fq.device), dtype=ctx.dtype, patch_range=a.patch_range)
        runner.model = fq        # what load_model's FasterQwen3TTS.from_pretrained would have set
        info.update(patch_triton(fq, runner.patch_range))
        return (runner, model, fq), info   # (the runner keeps each B's graphs until it is dropped after the last B)

    def make_call(state, b):
        runner = state[0]
        lib.clear()

        def call(frames):
            res = runner.generate_batch(["fixed text"] * b, language="english", speaker=SPEAKER,
                                        batch_size=b, max_new_tokens=frames, min_new_tokens=2,
                                        repetition_penalty=1.05, temperature=0.9, top_k=50, top_p=1.0,
                                        max_seq_len=a.batch_max_seq_len, bucket=True)
            lib.append(res["wall_s"])
            return res
        return call

    def measured(res, runs):
        frames = [int(r["codec_steps"]) for r in res["results"]]
        return frames, [int(len(r["audio"])) for r in res["results"]], lib[-runs:]

    sweep_batches(ctx, anchor, build, make_call, measured)


def run_worker(args) -> int:
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p not in (here, "")]    # bench/'s own modules must not shadow anything
    t0 = time.time()
    anchor = load_anchor(args.anchor)
    shims = anchor.install_import_shims()
    import logging

    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    for name in ("faster_qwen3_tts", "faster_qwen3_tts_batch", "qwen3_tts_triton"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("CUDA requested but torch.cuda.is_available() is False")
    ctx = anchor.Ctx(args)
    ctx.env = {"import_shims": shims, "engine": ENGINES[args.worker][0]}
    if ctx.cuda:
        ctx.env["gpu"] = torch.cuda.get_device_name(ctx.device)
        ctx.env["cuda"] = torch.version.cuda
    else:
        torch.set_num_threads(args.threads or 1)
        emulate_on_cpu(ctx, anchor)
        if os.environ.get("TRITON_INTERPRET") == "1":
            ctx.env["interpreted_triton"] = interpretable_triton()
    ctx.env["versions"] = anchor.versions()
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("qwen3-tts-triton", "faster-qwen3-tts-batch", "triton"):
        try:
            ctx.env["versions"][dist] = version(dist)
        except PackageNotFoundError:
            pass
    print(f"[{args.worker}] env: {json.dumps(ctx.env)}", flush=True)
    ctx.flush()
    if args.worker in ("faster", "triton"):
        if args.worker == "triton":
            build_faster = anchor.build_faster

            def build_triton(c, model, ids):      # anchor's faster worker, with the hybrid runner's patch
                fq = build_faster(c, model, ids)
                c.env["triton_patch"] = patch_triton(fq, args.patch_range)
                return fq

            anchor.build_faster = build_triton
        anchor.worker_faster(ctx)
    elif args.worker == "batch":
        worker_batch(ctx, anchor)
    else:
        worker_triton_batch(ctx, anchor)
    ctx.env["worker_wall_s"] = round(time.time() - t0, 1)
    ctx.flush()
    return 0


# ----------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------
def _f(v, spec="", none="–"):
    return none if v is None else format(v, spec)


MODE_ORDER = {"codes": 0, "e2e": 1, "stream": 2, "ttfa": 3, "batch": 4, "decode": 5}


def markdown(results: dict) -> str:
    """The table of one run: one line per measured series, then the failures and skips (never hidden)."""
    meta = results.get("meta", {})
    rows = results.get("rows", [])
    dev = meta.get("device_name") or meta.get("device", "?")
    size = "TINY configuration (dry run: timings meaningless)" if meta.get("tiny") else \
        f"real sizes, random weights, {meta.get('dtype', 'bf16')}"
    out = [f"Peers on the same GPU: {dev}, {meta.get('started', '')}; {size}; N = {meta.get('frames')} frames "
           f"({_f(meta.get('frames') and meta['frames'] * FRAME_S, '.2f')} s of audio) per stream; median of "
           f"{meta.get('runs')} after {meta.get('warmup')} warm-up.", "",
           "| engine | model | mode | streams | x real time per stream | audio s per wall s | first audio (ms) | "
           "ms per frame | peak GB | check |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    good = [r for r in rows if r.get("mode") in MODE_ORDER and not r.get("error") and not r.get("skipped")
            and r.get("median_s") is not None or (r.get("mode") == "ttfa" and r.get("ttfa_ms") is not None
                                                    and not r.get("error"))]
    good.sort(key=lambda r: (list(ENGINES).index(r["engine"]) if r.get("engine") in ENGINES else 9,
                             r.get("model") or "", MODE_ORDER[r["mode"]], r.get("batch") or 0, r.get("chunk") or 0))
    for r in good:
        mode = r["mode"] + (f" (chunk {r['chunk']})" if r.get("chunk") else "")
        first = r.get("ttfa_ms") if r.get("ttfa_ms") is not None else r.get("first_audio_ms")
        first_s = _f(first, ".0f") + (" (whole clip)" if r.get("ttfa_ms") is None and first is not None else "")
        if r["mode"] == "batch" and r.get("codes_rtf") is not None:
            mode += f"; codes only {r['codes_rtf']:.2f}x / {r['codes_agg_audio_s_per_s']:.1f} audio s/s"
        ok = r.get("frames_ok")
        check = "" if ok is None else ("ok" if ok else "LENGTH MISMATCH")
        if r.get("note") and "time budget" in r["note"]:
            check += f" ({r['note']})"
        out.append(f"| {r.get('engine', '?')} | {r.get('model', '')} | {mode} | {_f(r.get('batch'))} | "
                   f"{_f(r.get('rtf'), '.2f')} | {_f(r.get('agg_audio_s_per_s'), '.2f')} | {first_s} | "
                   f"{_f(r.get('ms_per_frame'), '.2f')} | {_f(r.get('peak_gb'), '.2f')} | {check} |")
    bad = [r for r in rows if r.get("error") or r.get("skipped")]
    if bad:
        out.append("")
        for r in bad:
            what = " ".join(str(x) for x in (r.get("engine", "?"), r.get("model") or "", r.get("mode") or "",
                                              f"B={r['batch']}" if r.get("batch") else "") if x)
            out.append(f"- {what}: " + (f"ERROR {r['error']}" if r.get("error") else f"skipped: {r['skipped']}"))
    workers = results.get("workers", [])
    if workers:
        out += ["", "Workers: " + "; ".join(f"{w['engine']} {w.get('model', '')} rc={w['rc']} {w['wall_s']} s"
                                            for w in workers)]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------------------------
def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench peers_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--models", default="0.6B", help="0.6B, 1.7B or both (every engine on the first model first)")
    p.add_argument("--batches", default="1,4,16,64", help="concurrent requests for the batch engines")
    p.add_argument("--frames", type=int, default=128, help="frames per stream (12.5 frames = 1 s of audio)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--warmup-frames", type=int, default=0, help="frames per warm-up call (0: 16, one stream 40)")
    p.add_argument("--chunk", type=int, default=8, help="streaming chunk (frames) of the one-stream engines")
    p.add_argument("--ttfa-chunks", default="4", help="extra chunk sizes timed to the first chunk only")
    p.add_argument("--text-tokens", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=2048, help="one-stream static KV length (their default)")
    p.add_argument("--batch-max-seq-len", type=int, default=512,
                   help="the batch engines' static KV length (their READMEs use 512; >= prompt + --frames)")
    p.add_argument("--patch-range", default="0,24",
                   help="qwen3-tts-triton's patched talker layers, start,end (the runner's default) or 'all'")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configuration (CPU check)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-decode", dest="decode", action="store_false",
                   help="one-stream engines: skip the codec-decode row")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="wall budget for all workers: no timed run starts that would end past it; a worker is "
                        f"killed {KILL_GRACE_S:.0f} s after it")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="the folder bench/gpu_wheels.sh filled")
    p.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "peers-gpu-site"),
                   help="where each wheel folder is installed (its own --target folder)")
    p.add_argument("--anchor", default=str(default_anchor()), help="anchor_bench.py (copied into .whl/)")
    p.add_argument("--out", default="peers_gpu.json", help="JSON results")
    p.add_argument("--md", default=None, help="markdown table (default: --out with .md)")
    p.add_argument("--dry-run", action="store_true",
                   help="on a CPU: install the wheels, then every engine at the tiny size, 4 frames, batches 1,2, "
                        "CUDA graphs run eagerly, Triton kernels through the interpreter; exit 1 on any failure")
    # internal
    p.add_argument("--worker", choices=list(ENGINES), default=None)
    p.add_argument("--part", default=None)
    p.add_argument("--deadline", type=float, default=None)
    a = p.parse_args(argv)
    if a.dry_run:
        a.tiny, a.device, a.frames, a.runs, a.warmup, a.warmup_frames = True, "cpu", 4, 1, 1, 2
        a.chunk, a.ttfa_chunks, a.batches, a.budget_s = 2, "", "1,2", max(a.budget_s, 600.0)
        a.batch_max_seq_len = min(a.batch_max_seq_len, 128)
        if a.out == "peers_gpu.json":
            a.out = os.path.join(tempfile.gettempdir(), "peers_gpu_dry.json")
    a.anchor = os.path.abspath(a.anchor)      # the workers run in the temporary folder
    a.patch_range = None if a.patch_range == "all" else tuple(int(x) for x in a.patch_range.split(","))
    a.decode = a.decode and not a.dry_run
    return a


def check_args(a) -> list[str]:
    errs = []
    bad = [e for e in a.engines.split(",") if e and e not in ENGINES]
    if bad:
        errs.append(f"unknown engine(s) {bad}: choose from {list(ENGINES)}")
    if any(m not in ("0.6B", "1.7B") for m in a.models.split(",")):
        errs.append(f"--models {a.models!r}: 0.6B and/or 1.7B")
    try:
        bs = [int(x) for x in a.batches.split(",") if x]
        if not bs or min(bs) < 1:
            raise ValueError
    except ValueError:
        errs.append(f"--batches {a.batches!r}: a comma list of positive integers")
    if a.frames < 2:
        errs.append("--frames must be at least 2")
    if a.batch_max_seq_len < a.frames + a.text_tokens + 16:
        errs.append(f"--batch-max-seq-len {a.batch_max_seq_len} cannot hold the prompt (~{a.text_tokens + 16}) "
                    f"and {a.frames} frames")
    if not Path(a.anchor).is_file():
        errs.append(f"anchor_bench.py not found at {a.anchor} (bench/gpu_wheels.sh copies it into .whl/)")
    return errs


def worker_cmd(a, engine, model, part, deadline):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--part", part, "--deadline",
           str(deadline), "--anchor", a.anchor, "--models", model, "--frames", str(a.frames), "--runs", str(a.runs),
           "--warmup", str(a.warmup), "--warmup-frames", str(a.warmup_frames), "--batches", a.batches,
           "--chunk", str(a.chunk), "--ttfa-chunks", a.ttfa_chunks, "--text-tokens", str(a.text_tokens),
           "--max-seq-len", str(a.max_seq_len), "--batch-max-seq-len", str(a.batch_max_seq_len),
           "--patch-range", "all" if a.patch_range is None else ",".join(map(str, a.patch_range)),
           "--attn", a.attn, "--device", a.device, "--threads", str(a.threads)]
    if a.dtype:
        cmd += ["--dtype", a.dtype]
    if a.tiny:
        cmd.append("--tiny")
    if not a.decode:
        cmd.append("--no-decode")
    return cmd


def write(results, a):
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out)
    md = Path(a.md) if a.md else out.with_suffix(".md")
    md.write_text(markdown(results))
    return md


class Terminated(Exception):
    pass


def on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return run_worker(a)
    errs = check_args(a)
    if errs:
        print("\n".join(errs), file=sys.stderr)
        return 2
    t_start = time.time()
    deadline = t_start + a.budget_s
    site = Path(a.site)
    engines = [e for e in a.engines.split(",") if e]
    try:
        installed = install(Path(a.wheels), site, sorted({s for e in engines for s in ENGINES[e][1]}))
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wheels {a.wheels} -> {site}: {installed}", flush=True)
    meta = {"frames": a.frames, "runs": a.runs, "warmup": a.warmup, "tiny": a.tiny, "device": a.device,
            "dtype": a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"), "models": a.models,
            "batches": a.batches, "chunk": a.chunk, "text_tokens": a.text_tokens, "budget_s": a.budget_s,
            "batch_max_seq_len": a.batch_max_seq_len, "patch_range": a.patch_range or "all",
            "engines": {e: ENGINES[e][0] for e in engines}, "host": platform.node(), "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)), "dry_run": a.dry_run,
            "eos": "codec_head bias -1e4 at codec_eos_token_id (2150): exactly N frames per request",
            "rtf_definition": "audio seconds (N * 0.08 s) / median wall seconds, per stream"}
    results = {"meta": meta, "rows": [], "env": {}, "workers": []}
    plan = [(model, engine) for model in a.models.split(",") for engine in engines]
    stopped = False
    signal.signal(signal.SIGTERM, on_sigterm)     # `timeout` (bench/gpu_session.sh) ends the driver this way
    for i, (model, engine) in enumerate(plan):
        left = deadline - time.time()
        if left < 25:
            results["rows"].append({"engine": engine, "model": model, "mode": "worker",
                                    "skipped": f"time budget before the worker started ({left:.0f}s left)"})
            write(results, a)
            continue
        part = os.path.join(tempfile.gettempdir(), f"peers_gpu_{os.getpid()}_{engine}_{model}.json")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=engine_path(engine, site), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        if not a.device.startswith("cuda"):
            env["TRITON_INTERPRET"] = "1"      # the Triton kernels on CPU tensors (dry run)
        print(f"\n### {engine} {model} (PYTHONPATH={env['PYTHONPATH']}) budget left {left:.0f}s", flush=True)
        t0 = time.time()
        # a fair share of what is left, so that one slow engine cannot starve the ones after it (what an
        # engine leaves unused goes to the next)
        share = min(deadline, t0 + max(left / (len(plan) - i), 60.0))
        proc = subprocess.Popen(worker_cmd(a, engine, model, part, share), env=env, cwd=tempfile.gettempdir())
        try:
            rc = proc.wait(timeout=max(30.0, share - t0 + KILL_GRACE_S))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except Terminated:
            rc, stopped = "terminated (the driver got SIGTERM)", True
        finally:
            if proc.poll() is None:      # never leave a worker holding the GPU behind
                proc.kill()
                proc.wait()
        wrec = {"engine": engine, "model": model, "rc": rc, "wall_s": round(time.time() - t0, 1)}
        try:
            d = json.loads(Path(part).read_text())
            for r in d.get("rows", []):
                r.setdefault("engine", engine)
            results["rows"].extend(d.get("rows", []))
            results["env"][f"{engine} {model}"] = d.get("env", {})
            os.remove(part)
        except (OSError, ValueError) as e:
            wrec["part_error"] = str(e)
        if rc != 0:
            results["rows"].append({"engine": engine, "model": model, "mode": "worker",
                                    "error": f"worker exited rc={rc}; see the log above"})
        results["workers"].append(wrec)
        meta["total_wall_s"] = round(time.time() - t_start, 1)
        meta["device_name"] = next((e.get("gpu") for e in results["env"].values() if e.get("gpu")), a.device)
        write(results, a)
        if stopped:
            break
    md = write(results, a)
    print("\n" + markdown(results))
    print(f"wrote {a.out} and {md}")
    if a.dry_run:
        bad = [r for r in results["rows"] if r.get("error") or r.get("skipped") or r.get("frames_ok") is False]
        measured = {r.get("engine") for r in results["rows"] if r.get("median_s") is not None}
        missing = [e for e in engines if e not in measured]
        ok = not bad and not missing and all(w["rc"] == 0 and "part_error" not in w for w in results["workers"])
        print(f"dry run: {'ok' if ok else 'FAILED'} ({len(results['rows'])} rows; {len(bad)} failed, skipped or "
              f"short; engines without a measured row: {missing or 'none'})")
        return 0 if ok else 1
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
