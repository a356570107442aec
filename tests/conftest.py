"""Shared fixtures: the oracle runner, tiny checkpoints and the tiny random Whisper.

The official implementation (qwen-tts 0.1.1) lives in a separate virtual environment because it pins
transformers 4.57.3 / huggingface-hub<1 while gradio 6 needs huggingface-hub>=1. Parity tests run small
scripts from tests/oracle/ in that environment (`run_oracle`) which write reference tensors to a file that
the test then compares with tts_engine's output.
"""
from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORACLE_DIR = ROOT / "tests" / "oracle"


def oracle_python() -> str | None:
    exe = os.environ.get("QWEN_TTS_ORACLE_PYTHON") or str(ROOT / ".venv-oracle" / "bin" / "python")
    return exe if Path(exe).exists() else None


class _OracleServer:
    """tests/oracle/fork_server.py in the oracle venv: the official implementation imported once for the whole run,
    a forked child per script (as a fresh process would run it)."""

    def __init__(self, exe: str, logs: Path):
        self.exe, self.logs, self.n, self.proc = exe, logs, 0, None

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
        with open(self.logs / "server.err", "w") as err:   # (the child keeps its own copy of the file)
            self.proc = subprocess.Popen([self.exe, str(ORACLE_DIR / "fork_server.py")], cwd=ROOT, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)

    def run(self, script: str, args, env: dict, timeout: float) -> tuple[int, str]:
        """-> (exit status, the script's output); status None: the server itself failed (its stderr then)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.n += 1
        log = self.logs / f"{self.n}-{script}.log"
        req = {"script": str(ORACLE_DIR / script), "args": list(args), "env": env, "timeout": timeout, "log": str(log)}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()   # the server kills a child past `timeout` and answers 124
        except OSError:
            answer = ""
        if not answer:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return None, (self.logs / "server.err").read_text(errors="replace")[-8000:]
        return json.loads(answer)["rc"], log.read_text(errors="replace") if log.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="session")
def run_oracle(tmp_path_factory):
    """Returns run(script_name, *args) -> None; runs tests/oracle/<script_name> in the oracle venv (in one process
    that imports the official implementation once: `_OracleServer`; a script that fails there runs again in a
    process of its own, and only a failure there too fails the test)."""
    exe = oracle_python()
    if exe is None:
        if os.environ.get("REQUIRE_ORACLE") == "1":
            pytest.fail("oracle venv missing: run tests/oracle/setup_venv.sh")
        pytest.skip("oracle venv missing (tests/oracle/setup_venv.sh); parity tests skipped")
    server = _OracleServer(exe, tmp_path_factory.mktemp("oracle_logs"))

    def run(script: str, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
        rc, out = server.run(script, [str(a) for a in args], env, 900)
        if rc == 0:
            return
        proc = subprocess.run([exe, str(ORACLE_DIR / script), *map(str, args)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"oracle script {script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        warnings.warn(f"oracle script {script} failed in the oracle server (exit {rc}) but ran in a process of its "
                      f"own:\n{out[-4000:]}")

    yield run
    server.close()


@pytest.fixture(scope="session")
def official(run_oracle, tmp_path_factory):
    """official(kind, size) -> (checkpoint folder, recorded cases, reference tensors), built once a session
    by tests/oracle/full_model_ref.py with the official classes (random tiny weights, official layout)."""
    from oracle_records import read_record

    made = {}

    def get(kind: str, size: str = "0b6"):
        key = (kind, size)
        if key not in made:
            d = tmp_path_factory.mktemp(f"official_{kind}_{size}")
            ckpt, ref = d / "ckpt", d / "ref.safetensors"
            run_oracle("full_model_ref.py", ckpt, ref, kind, size, 7)
            made[key] = (ckpt, *read_record(ref))
        return made[key]

    return get


# Tests that load a checkpoint without a dtype get fp32 on every machine (the engine's CPU default is bf16 where
# the CPU has native bf16; tests/test_cpu_dtype.py checks that choice with a mocked capability).
os.environ.setdefault("TTS_CPU_DTYPE", "fp32")
# Tests do not time matmul kernels into the user's cache folder (tests/test_kernels.py turns it on in a temporary one).
os.environ.setdefault("TTS_KERNEL_TUNE", "0")
# Nor the codec decoder's dtype: a bf16 model keeps a bf16 decoder (tests/test_codec_dtype.py measures the choice in a
# temporary cache folder). Timing a tiny decoder picks either dtype by noise.
os.environ.setdefault("TTS_CODEC_DTYPE", "model")
# Nor the fused decode step (cpu/fused_step.py) and with it the code predictor's frame in one call
# (cpu/predictor_frame.py) and the talker's step in one call (cpu/talker_step.py): their trials (at engine load;
# no request sees them) would remember choices for the tiny stacks in the user's cache folder.
# tests/test_fused_step.py, tests/test_predictor_frame.py and tests/test_talker_step.py set them per test (trial, on,
# off) and check that the trials never change a request.
os.environ.setdefault("TTS_FUSED_STEP", "0")
# Our C++ library (csrc/ttsx.cpp: the kernels, fused step, predictor frame, talker step, codec rows) is built once
# for the whole run, into the cache folder in force when the run starts: tests that give themselves a fresh cache
# folder (TTS_CACHE_DIR=tmp, for remembered choices) and the processes they start (app servers, the emulated CPU)
# load those builds instead of compiling again (each compile is seconds of CPU; 2-3x that on a busy machine).
from tts_engine import cache_paths as _cache_paths  # noqa: E402  (after the settings above)

os.environ.setdefault("TTS_BUILD_DIR", str(_cache_paths.cache_root() / "cpu_ext"))
# the CPU package gives model/quant.py and codec/decoder.py their kernels when imported (cpu/backend.py `set_hooks`):
# tests that build a W8A8 layer or a packed codec directly need it as an engine would have it
import tts_engine.cpu  # noqa: E402,F401
# ... built when first needed, before the engine that needs it measures anything (not in the background, as on a
# Space: tests/test_startup_trials.py covers that), and every load-time trial runs at load, none deferred to idle time
# (tests/test_startup_trials.py covers the deferral).
os.environ.setdefault("TTS_CPU_BUILD", "wait")
os.environ.setdefault("TTS_START_TRIALS", "all")


@pytest.fixture
def own_kernels(monkeypatch, tmp_path):
    """W8A8 layers hold our kernels' packed layout whatever the kernel table measured (the fused step and the
    predictor frame read it); the cache folder (remembered choices) is a fresh one. For tests/test_fused_step.py,
    test_fused_team.py and test_predictor_frame.py."""
    from tts_engine.cpu import kernels

    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels.KernelTable, "choice",
                        lambda self, fmt, N, K, rows=1: "vnni" if fmt == "w8a8" else kernels.FORMATS[fmt].default)
    kernels.reset_kernel_table()
    yield tmp_path
    kernels.reset_kernel_table()


@pytest.fixture(scope="module")
def drv():
    """A headless chromium (tests/browser.py), one per test module; browser test modules call
    `browser.require_browser()` first, so that a machine without one skips them."""
    from tests import browser

    with browser.chrome_session() as d:
        yield d


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory):
    """A tiny random Whisper in the hub layout (tests/tiny_whisper.py), built once a session."""
    from tests.tiny_whisper import make_tiny_whisper

    return make_tiny_whisper(tmp_path_factory.mktemp("tiny_whisper"))


@pytest.fixture
def asr_env(whisper_dir, monkeypatch):
    """The tiny random Whisper as the server's ASR model (TTS_ASR_MODEL), and no transcriber made yet in this
    process. Returns the `tts_engine.asr` module."""
    from tts_engine import asr

    monkeypatch.setenv("TTS_ASR_MODEL", str(whisper_dir))
    monkeypatch.setattr(asr, "_shared", {})
    return asr


@pytest.fixture(scope="session")
def tiny_cv_folder(tmp_path_factory):
    """A tiny CustomVoice checkpoint (0.6B layout, random weights, seed 0), built once a session. Tests must not
    change its files."""
    from tts_engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_cv") / "cv", kind="custom_voice", size="0b6", seed=0)


@pytest.fixture(scope="module")
def tiny_cv_pair(tiny_cv_folder, request):
    """(a, b): two fp32 engines (max_batch 3) on `tiny_cv_folder` for an A/B of one setting, closed after the module.
    The module says how they differ: PAIR = (keyword arguments of a, of b) for `TTSEngine.from_pretrained`, where
    `split_frames` is set on the engine's worker instead."""
    from tts_engine import TTSEngine

    pair = []
    for kw in request.module.PAIR:
        kw = dict(kw)
        split = kw.pop("split_frames", None)
        eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=3, **kw)
        if split is not None:
            eng.worker.split_frames = split
        pair.append(eng)
    yield tuple(pair)
    for eng in pair:
        eng.close()
