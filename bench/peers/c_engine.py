"""Peer: the pure-C Qwen3-TTS engine (github.com/gabriele-mastrapasqua/qwen3-tts, MIT) at a pinned commit,
built from source with gcc + OpenBLAS and run on a view of our random checkpoint.

Setup (each step skipped when already done, everything under `<peers dir>/c_engine/`):
  1. source: `git archive` of the pinned commit from `--c-engine-src` (a clone or mirror holding the commit),
     a copy of `--c-engine-src` when it is a plain source tree, or else a `git clone` from GitHub;
  2. build: `make blas SIMD=<from the CPU flags>` (avx512bf16 / avx512vnni / avx512 / the AVX2 default / scalar),
     then its kernel self-test;
  3. OpenBLAS: Debian 12's OpenBLAS 0.3.21 takes recent Xeons (family 6 model 207) for "Prescott" (SSE3 sgemm,
     ~3x slower prefill and speech decoder): then OPENBLAS_CORETYPE=SkylakeX on AVX-512 CPUs;
  4. a view of the checkpoint: symlinks, plus `speech_tokenizer/model.safetensors` upcast to float32 (the engine
     reads every codec tensor through a raw float pointer; `make_tiny(dtype=bf16)` stores the codec in bf16).
Runs: `qwen_tts --stream --max-tokens N --seed 42 [--int8|--int4] -j T`; its own stderr prints give the
generation wall (RTF x audio: tokenizer + prefill + generation + decoder drain, no load), first audio (TTFA)
and the talker / code predictor split. It has no ignore-end-of-speech switch: frames produced are recorded.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.peers.table import Run

NAME = "C engine"
URL = "https://github.com/gabriele-mastrapasqua/qwen3-tts"
COMMIT = "328ab9cb241774572bb59917af199bdf64a17227"
FLAGS = {"bf16": [], "int8": ["--int8"], "int4": ["--int4"]}
SEED = 42
# bytes per weight of its per-frame linears, for effective GB/s: bf16; int8 = per-row absmax (f32 scale per row,
# negligible); int4 = Q4_0 (32 weights in 18 bytes). The codec head stays bf16 in every mode.
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0, "int4": 18 / 32}


class SetupError(RuntimeError):
    """The peer cannot be set up here; the message says why (the benchmark prints it and goes on)."""


def simd_for(flags: set[str]) -> str:
    """The Makefile's SIMD level for a CPU with these /proc/cpuinfo flags."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"} <= flags:
        return "avx512bf16"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags:
        return "avx512vnni"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "auto"          # the Makefile's portable default: -mavx2 -mfma
    return "scalar"


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _has_commit(git_dir: Path) -> bool:
    return _run(["git", "-C", str(git_dir), "cat-file", "-e", f"{COMMIT}^{{commit}}"]).returncode == 0


def _export(git_dir: Path, dest: Path) -> None:
    """`git archive` the pinned commit into dest (samples/ is audio only; a mirror may lack its blobs)."""
    tmp = Path(tempfile.mkdtemp(prefix="src-", dir=dest.parent))
    arch = subprocess.Popen(["git", "-C", str(git_dir), "archive", COMMIT, "--", ".", ":(exclude)samples"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tar = _run(["tar", "-x", "-C", str(tmp)], stdin=arch.stdout)
    arch.stdout.close()
    err = arch.stderr.read().decode(errors="replace")
    arch.wait()
    if not (tmp / "Makefile").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise SetupError(f"git archive {COMMIT[:7]} from {git_dir} gave no Makefile: {(err or tar.stderr)[-300:]}")
    tmp.rename(dest)


def get_source(root: Path, src: str | None) -> tuple[Path, str]:
    """The engine's source at the pinned commit under root; returns (folder, where it came from)."""
    dest = root / f"src-{COMMIT[:7]}"
    if (dest / "Makefile").is_file():
        origin = (dest / ".origin").read_text().strip() if (dest / ".origin").exists() else "cached"
        return dest, origin
    root.mkdir(parents=True, exist_ok=True)
    if src:
        s = Path(src).expanduser()
        if not s.exists():
            raise SetupError(f"--c-engine-src {s} does not exist")
        if _run(["git", "-C", str(s), "rev-parse", "--git-dir"]).returncode == 0:
            if not _has_commit(s):
                raise SetupError(f"{s} is a git repository without commit {COMMIT} (fetch it there first)")
            _export(s, dest)
            origin = f"git archive {COMMIT[:7]} of {s}"
        elif (s / "Makefile").is_file() and (s / "qwen_tts.c").is_file():
            shutil.copytree(s, dest, ignore=shutil.ignore_patterns(".git", "samples", "*.o", "qwen_tts"))
            origin = f"copy of the source tree {s} (its commit is not checked)"
        else:
            raise SetupError(f"--c-engine-src {s} is neither a git repository nor the engine's source tree")
    else:
        clone = root / "clone"
        if not _has_commit(clone):
            shutil.rmtree(clone, ignore_errors=True)
            p = _run(["git", "clone", "-q", "--no-checkout", URL, str(clone)], timeout=600)
            if p.returncode != 0 or not _has_commit(clone):
                raise SetupError(f"git clone {URL} failed ({(p.stderr or '').strip()[-200:]}); get the repository "
                                 f"another way and pass --c-engine-src DIR (or QWEN_TTS_C_ENGINE_SRC)")
        _export(clone, dest)
        origin = f"git clone {URL} @ {COMMIT[:7]}"
    (dest / ".origin").write_text(origin + "\n")
    return dest, origin


def build(src: Path, simd: str, jobs: int) -> Path:
    """make blas SIMD=simd (a clean build when the SIMD level changed); returns the binary."""
    missing = [t for t in ("make", "gcc") if shutil.which(t) is None]
    if missing:
        raise SetupError(f"missing {' and '.join(missing)} (apt-get install build-essential libopenblas-dev)")
    stamp, binary = src / ".simd", src / "qwen_tts"
    if stamp.exists() and stamp.read_text().strip() != simd:
        _run(["make", "-C", str(src), "clean"])
    if not (binary.exists() and stamp.exists()):
        p = _run(["make", "-C", str(src), f"-j{jobs}", "blas", f"SIMD={simd}"])
        (src / f"build-{simd}.log").write_text(p.stdout + p.stderr)
        if p.returncode != 0 or not binary.exists():
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            hint = " (libopenblas-dev missing?)" if "cblas.h" in p.stdout + p.stderr else ""
            raise SetupError(f"make blas SIMD={simd} failed{hint}: {' | '.join(tail)[-300:]}")
        stamp.write_text(simd + "\n")
    return binary


def blas_env(binary: Path, flags: set[str]) -> tuple[dict, str]:
    """Environment for the runs and a note: the OpenBLAS core as detected, and the SkylakeX fix where needed."""
    env = {"OPENBLAS_VERBOSE": "2"}
    p = _run([str(binary), "--caps"], env={**os.environ, **env}, timeout=60)
    m = re.search(r"^Core: (\S+)", p.stdout + p.stderr, re.M)
    core = m.group(1) if m else "unknown"
    if os.environ.get("OPENBLAS_CORETYPE"):
        return {}, f"OpenBLAS core {core} (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} as set)"
    if core == "Prescott" and "avx512f" in flags:
        return {"OPENBLAS_CORETYPE": "SkylakeX"}, "OpenBLAS took this CPU for Prescott (SSE3): OPENBLAS_CORETYPE=SkylakeX"
    return {}, f"OpenBLAS core {core}"


def self_test(binary: Path, threads: int) -> str:
    p = _run([str(binary), "-j", str(threads), "--self-test"], timeout=300)
    return "self-test passed" if p.returncode == 0 else "self-test FAILED (see its --self-test output)"


def make_view(ckpt: Path, view: Path) -> Path:
    """Symlinks to ckpt's files, and a float32 copy of speech_tokenizer/model.safetensors (lossless upcast)."""
    target = view / "speech_tokenizer" / "model.safetensors"
    if target.exists():
        return view
    import torch
    from safetensors.torch import load_file, save_file

    (view / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    for sub in ("", "speech_tokenizer"):
        for p in (ckpt / sub).iterdir():
            if p.is_file() and not (sub and p.name == "model.safetensors"):
                link = view / sub / p.name
                if not link.exists():
                    link.symlink_to(p.resolve())
    tensors = load_file(str(ckpt / "speech_tokenizer" / "model.safetensors"))
    tensors = {k: (v.float() if v.dtype in (torch.bfloat16, torch.float16) else v).contiguous() for k, v in tensors.items()}
    tmp = target.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(target)
    return view


PATTERNS = {
    "load_ms": r"Model loaded in (\d+) ms",
    "frames": r"Generated (\d+) frames",
    "talker_ms": r"Talker step: \d+ ms \(([\d.]+) ms/f\)",
    "cp_ms": r"Code Predictor: \d+ ms \(([\d.]+) ms/f\)",
    "audio_s": r"Audio: ([\d.]+)s generated in",
    "rtf": r"\(RTF ([\d.]+)\)",
    "ttfa_ms": r"TTFA: (\d+) ms",
    "samples": r"Wrote \S+ \((\d+) samples",
    "eos": r"EOS at frame (\d+)",
}


def parse_output(text: str) -> dict:
    """The engine's own prints -> {frames, wall_s (generation, no load), first_audio_s, talker_ms, cp_ms, load_s};
    raises ValueError when the run printed no result."""
    v = {}
    for k, p in PATTERNS.items():
        m = re.search(p, text, re.M)
        v[k] = float(m.group(1)) if m else None
    if v["frames"] is None or v["rtf"] is None:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise ValueError(f"no 'Generated N frames' / 'RTF' line in its output: {tail[-300:]}")
    audio_s = v["samples"] / 24000 if v["samples"] else v["frames"] * 0.08
    return {"frames": v["frames"], "wall_s": v["rtf"] * audio_s,
            "first_audio_s": v["ttfa_ms"] / 1000 if v["ttfa_ms"] is not None else None,
            "talker_ms": v["talker_ms"], "cp_ms": v["cp_ms"],
            "load_s": v["load_ms"] / 1000 if v["load_ms"] is not None else None, "eos_at": v["eos"]}


class CEngine:
    """Set up once (`CEngine.setup`), then `run(precision, frames, rep)` times one streaming synthesis."""

    name = NAME
    precisions = tuple(FLAGS)

    def __init__(self, binary: Path, view: Path, env: dict, notes: list[str], threads: int, text: str):
        self.binary, self.view, self.env, self.notes, self.threads, self.text = binary, view, env, notes, threads, text

    @classmethod
    def setup(cls, peers_dir: Path, ckpt: Path, src: str | None, flags: set[str], threads: int, text: str) -> "CEngine":
        root = peers_dir / "c_engine"
        source, origin = get_source(root, src)
        simd = simd_for(flags)
        binary = build(source, simd, max(1, os.cpu_count() or 1))
        env, blas_note = blas_env(binary, flags)
        notes = [origin, f"make blas SIMD={simd}", self_test(binary, threads), blas_note]
        view = make_view(ckpt, root / f"{ckpt.name}-f32codec")
        return cls(binary, view, env, notes, threads, text)

    def command(self, precision: str, frames: int, wav: Path) -> list[str]:
        return [str(self.binary), "-d", str(self.view), "--text", self.text, "-s", "ryan", "-l", "English",
                "-j", str(self.threads), "--max-tokens", str(frames), "--seed", str(SEED), *FLAGS[precision],
                "--stream", "-o", str(wav)]

    def run(self, precision: str, frames: int, rep: int) -> Run:
        with tempfile.TemporaryDirectory(prefix="c-engine-") as d:
            cmd = self.command(precision, frames, Path(d) / "out.wav")
            try:
                p = _run(cmd, env={**os.environ, **self.env}, timeout=60 + 20 * frames)
                out = parse_output(p.stdout + p.stderr)
            except (subprocess.TimeoutExpired, ValueError) as e:
                return Run(NAME, precision, frames, rep=rep, error=(str(e).strip().splitlines() or ["?"])[0][:300])
        return Run(NAME, precision, frames, frames=out["frames"], wall_s=out["wall_s"],
                   first_audio_s=out["first_audio_s"], talker_ms=out["talker_ms"], cp_ms=out["cp_ms"], rep=rep,
                   extra={"load_s": out["load_s"], "eos_at": out["eos_at"]})

    def weight_bytes(self, counts: dict, precision: str) -> tuple[float, float]:
        return weight_bytes(counts, precision)


def weight_bytes(counts: dict, precision: str) -> tuple[float, float]:
    """Estimated (talker, code predictor) weight bytes read per frame in its format, from our model's weight
    counts (`ours.weight_counts`): quantised layers (and the predictor's heads), the talker's bf16 codec head."""
    b = BYTES_PER_WEIGHT[precision]
    talker = counts["talker_layers"] * b + counts["codec_head"] * 2.0
    cp = counts["cp_passes"] * counts["cp_layers"] * b + counts["cp_heads"] * b
    return talker, cp
