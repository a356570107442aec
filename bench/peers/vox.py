"""Peer: vox (`vox-tts` on PyPI, Apache-2.0; a native C++ engine with its own CPU kernels).

Setup, under `<peers dir>`: a virtual environment of its own (`vox-venv`, never the project's) with
vox-tts==VERSION from PyPI, then one `.tmod` per quantisation, converted from our checkpoint by its own
`python -m vox build --dtype bf16 --quant q8|q4` (q8 = int8 in blocks of 32 with a scale each, its CPU default;
q4 = 4-bit talker attention and MLP, q8 for the rest). Each run is a fresh process of that venv's python
running `vox_worker.py` in isolated mode (load, a 4-frame warm-up, then one timed streaming synthesis, greedy), so an idle vox
thread pool never spins beside the other engines' runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.peers.c_engine import SetupError
from bench.peers.table import Run

NAME = "vox"
VERSION = "0.19.5"
QUANTS = ("q8", "q4")
WORKER = Path(__file__).with_name("vox_worker.py")
# bytes per weight of the code predictor's linears (q8 in both modes: int8 in blocks of 32, one f32 scale each)
CP_BYTES_PER_WEIGHT = 1 + 4 / 32


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(venv: Path, host_python: str | None = None) -> Path:
    py = _venv_python(venv)
    probe = [str(py), "-c", "import importlib.metadata as m, vox; print(m.version('vox-tts'))"]
    if py.exists():
        p = subprocess.run(probe, capture_output=True, text=True)
        if p.returncode == 0 and p.stdout.strip() == VERSION:
            return py
    host = host_python or getattr(sys, "_base_executable", None) or sys.executable
    if not py.exists():
        p = subprocess.run([host, "-m", "venv", str(venv)], capture_output=True, text=True)
        if p.returncode != 0:
            raise SetupError(f"python -m venv {venv} failed: {p.stderr.strip()[-300:]}")
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", f"vox-tts=={VERSION}"], capture_output=True, text=True,
                       timeout=1800)
    if p.returncode != 0:
        raise SetupError(f"pip install vox-tts=={VERSION} failed: {p.stderr.strip()[-300:]}")
    p = subprocess.run(probe, capture_output=True, text=True)
    if p.returncode != 0:
        raise SetupError(f"vox-tts=={VERSION} installed but does not import: {p.stderr.strip()[-300:]}")
    return py


def build_tmod(py: Path, ckpt: Path, quant: str, out: Path) -> Path:
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.tmod")
    p = subprocess.run([str(py), "-m", "vox", "build", "--model", str(ckpt), "--dtype", "bf16", "--quant", quant,
                        "-o", str(tmp)], capture_output=True, text=True, timeout=3600)
    if p.returncode != 0 or not tmp.exists():
        raise SetupError(f"python -m vox build --quant {quant} failed: {(p.stdout + p.stderr).strip()[-300:]}")
    tmp.rename(out)
    return out


def parse_worker(stdout: str) -> dict:
    """The worker's last stdout line (JSON) -> its result; raises ValueError when there is none."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON result in the worker's output: {stdout.strip()[-200:]}")


def parts_and_bytes(stats: dict) -> tuple[float | None, float | None, float | None]:
    """From vox's stats(): talker ms per frame, code predictor ms per frame, talker stage weight bytes."""
    backend = stats.get("backend") or {}
    ms = backend.get("ms_per_frame") or {}
    stages = {s.get("stage"): s for s in (stats.get("plan") or {}).get("stages", [])}
    return ms.get("talker"), ms.get("predictor"), (stages.get("talker") or {}).get("weight_bytes")


class Vox:
    name = NAME

    def __init__(self, py: Path, tmods: dict, threads: int, text: str, notes: list[str]):
        self.py, self.tmods, self.threads, self.text, self.notes = py, tmods, threads, text, notes
        self.precisions = tuple(tmods)
        self.talker_bytes: dict = {}

    @classmethod
    def setup(cls, peers_dir: Path, ckpt: Path, threads: int, text: str) -> "Vox":
        if shutil.which("python3") is None and not getattr(sys, "_base_executable", None):
            raise SetupError("no python to make vox's virtual environment with")
        py = ensure_venv(peers_dir / "vox-venv")
        tmods = {q: build_tmod(py, ckpt, q, peers_dir / "models" / "vox" / f"{ckpt.name}.{q}.tmod") for q in QUANTS}
        return cls(py, tmods, threads, text, [f"vox-tts=={VERSION} in {peers_dir / 'vox-venv'}"])

    def run(self, precision: str, frames: int, rep: int) -> Run:
        # -I: the worker's folder (which holds this vox.py) must not shadow the vox package
        cmd = [str(self.py), "-I", str(WORKER), "--model", str(self.tmods[precision]), "--threads", str(self.threads),
               "--frames", str(frames), "--text", self.text]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120 + 20 * frames)
            if p.returncode != 0:
                last = (p.stderr.strip().splitlines() or ["no output"])[-1]
                raise ValueError(f"exit {p.returncode}: {last[-300:]}")
            out = parse_worker(p.stdout)
        except (subprocess.TimeoutExpired, ValueError) as e:
            return Run(NAME, precision, frames, rep=rep, error=str(e).splitlines()[0][:300])
        talker, cp, tbytes = parts_and_bytes(out.get("stats") or {})
        if tbytes:
            self.talker_bytes[precision] = tbytes
        return Run(NAME, precision, frames, frames=out["frames"], wall_s=out["wall_s"],
                   first_audio_s=out.get("first_audio_s"), talker_ms=talker, cp_ms=cp, rep=rep,
                   extra={"load_s": out.get("load_s")})

    def weight_bytes(self, counts: dict, precision: str) -> tuple[float, float] | None:
        """(talker bytes as vox's own plan states them, code predictor bytes estimated for q8) per frame."""
        tb = self.talker_bytes.get(precision)
        if tb is None:
            return None
        return tb, (counts["cp_passes"] * counts["cp_layers"] + counts["cp_heads"]) * CP_BYTES_PER_WEIGHT
