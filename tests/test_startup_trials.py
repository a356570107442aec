"""Cold start (issue 14): the load-time trials are bounded, our C++ libraries are built together, and measured
choices are kept where a Hugging Face Space keeps files across restarts. Figures: `python -m
bench startup` (never asserted here)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tts_engine import cache_paths
from tts_engine.cpu import measured
from tts_engine.cpu import cpu_build
from tts_engine.cpu import cpu_ext
from tts_engine.cpu import kernels


# --- the kernel table: rounds stop once the winner is settled ------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _timed(monkeypatch, costs: dict[str, float], rounds_busy: bool = False):
    """time_candidates over fake candidates whose calls 'take' costs[name] seconds -> (times, calls per name)."""
    clock, calls = FakeClock(), {n: 0 for n in costs}

    def make(name):
        def fn(x, w):
            calls[name] += 1
            clock.t += costs[name]
            return torch.zeros(x.shape[0], w.shape[0])
        return fn

    monkeypatch.setattr(kernels.time, "perf_counter", clock)
    monkeypatch.setattr(kernels, "load_average", lambda: 100.0 if rounds_busy else 0.0)
    buf = torch.full((64 * 64 * 4 * kernels.MIN_COPIES,), 0x3C, dtype=torch.uint8)
    times = kernels.time_candidates("fp32", 64, 64, 1, buf, candidates={n: make(n) for n in costs})
    return times, calls


def test_a_lone_kernel_is_timed_for_min_rounds_only(monkeypatch):
    times, calls = _timed(monkeypatch, {"linear": 1e-4})
    copies = kernels.MIN_COPIES
    assert calls["linear"] == 1 + kernels.MIN_ROUNDS * copies       # a check call, then MIN_ROUNDS rounds
    assert times["linear"] == pytest.approx(1e-4)


def test_a_clear_winner_stops_the_rounds_and_slow_ones_are_dropped(monkeypatch):
    _, calls = _timed(monkeypatch, {"fast": 1e-4, "slow": 2e-4})   # 2x: clearly ahead, settled after MIN_ROUNDS
    assert calls["fast"] == calls["slow"] == 1 + kernels.MIN_ROUNDS * kernels.MIN_COPIES
    _, calls = _timed(monkeypatch, {"a": 1e-4, "b": 1.1e-4, "c": 3e-4})   # a and b close: every round; c dropped
    rounds = kernels.ROUNDS
    assert calls["a"] == calls["b"] == 1 + rounds * kernels.MIN_COPIES
    assert calls["c"] == 1 + kernels.MIN_ROUNDS * kernels.MIN_COPIES


def test_clearly_ahead():
    assert kernels.clearly_ahead({"a": 1.0}) and kernels.clearly_ahead({"a": 1.0, "b": 1.3})
    assert not kernels.clearly_ahead({"a": 1.0, "b": 1.2})


# --- our C++ libraries: built together, each once ------------------------------------------------------------------
def test_every_wanted_library_is_built_at_once(monkeypatch):
    running, peak, built = [0], [0], []
    lock = threading.Lock()

    def fake_build(force=False, source=None):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
            built.append(Path(source).name)
        return Path("/nonexistent.so")

    monkeypatch.setattr(cpu_ext, "build", fake_build)
    monkeypatch.setattr(cpu_build, "_loaded", lambda src: False)
    monkeypatch.delenv("TTS_CPU_EXT", raising=False)
    for env in ("TTS_FUSED_STEP", "TTS_PREDICTOR_FRAME", "TTS_TALKER_STEP"):
        monkeypatch.delenv(env, raising=False)
    took = cpu_build.build_all(workers=2)
    assert sorted(built) == sorted(["cpu_ext.cpp", "fused_step.cpp", "predictor_frame.cpp", "talker_step.cpp"])
    assert peak[0] == 2 and set(took) == set(built)
    built.clear()
    cpu_build.build_all(includers=False)                 # an fp32 / int8 / int4 engine: the kernels alone
    assert built == ["cpu_ext.cpp"]
    built.clear()
    monkeypatch.setenv("TTS_FUSED_STEP", "0")            # no fused step: nothing includes it
    cpu_build.build_all()
    assert built == ["cpu_ext.cpp"]
    monkeypatch.setenv("TTS_CPU_EXT", "0")
    built.clear()
    assert cpu_build.build_all() == {} and built == []


def test_a_library_this_process_has_is_not_built_again(monkeypatch):
    built = []
    monkeypatch.setattr(cpu_ext, "build", lambda force=False, source=None: built.append(Path(source).name))
    from tts_engine.cpu import fused_step
    from tts_engine.cpu import predictor_frame
    from tts_engine.cpu import talker_step

    monkeypatch.setattr(cpu_build, "_done", set())
    monkeypatch.setattr(cpu_ext, "_state", {})                       # (as in a fresh process)
    for m in (fused_step, predictor_frame, talker_step):
        monkeypatch.setattr(m.library, "_lib", None)
    monkeypatch.delenv("TTS_CPU_EXT", raising=False)
    for env in ("TTS_FUSED_STEP", "TTS_PREDICTOR_FRAME", "TTS_TALKER_STEP"):
        monkeypatch.delenv(env, raising=False)
    cpu_build.build_all()
    assert len(built) == 4
    built.clear()
    cpu_build.build_all()               # (another engine; in tests another cache folder): nothing compiled again
    assert built == []


def test_one_compile_per_library_when_threads_ask_at_once(tmp_path, monkeypatch):
    if cpu_ext._compiler() is None or "x86_64" not in (__import__("os").uname().machine or ""):
        pytest.skip("needs g++ on x86-64")
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_ext.BUILD_DIR_ENV, raising=False)   # (conftest's one build folder per run: built there already)
    compiles = []

    def fake_compile(cxx, source, out, torch_dir):
        compiles.append(out)
        time.sleep(0.3)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"")
        return out

    monkeypatch.setattr(cpu_ext, "_compile", fake_compile)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cpu_ext.build(source=cpu_ext.SOURCE))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiles) == 1 and len(set(got)) == 1 and got[0].parent == tmp_path / "cpu_ext"


# --- where measured choices are kept -------------------------------------------------------------------------------
def test_choices_go_to_a_spaces_persistent_storage(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setattr(cache_paths, "PERSISTENT", data)
    monkeypatch.delenv("TTS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert cache_paths.choices_root() == tmp_path / "xdg" / "qwen3-tts-live"     # not a Space: the cache folder
    monkeypatch.setenv("SPACE_ID", "someone/qwen3-tts-live")
    assert cache_paths.choices_root() == data / "qwen3-tts-live"                 # a Space with /data
    assert kernels.cache_root() == data / "qwen3-tts-live"                       # kernel table, quality, libraries
    assert measured.path_for("codec_int8", {"k": 1}).parent == data / "qwen3-tts-live" / "codec_int8"
    assert cache_paths.cache_root() == tmp_path / "xdg" / "qwen3-tts-live"       # voices, checkpoints: not moved
    data.chmod(0o500)
    try:
        if not __import__("os").access(data, __import__("os").W_OK):              # (root may write anyway)
            assert cache_paths.choices_root() == tmp_path / "xdg" / "qwen3-tts-live"
    finally:
        data.chmod(0o700)
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path / "mine"))                   # --cache-dir: everything there
    assert cache_paths.choices_root() == tmp_path / "mine"
    monkeypatch.delenv("TTS_CACHE_DIR")
    monkeypatch.setattr(cache_paths, "PERSISTENT", tmp_path / "absent")
    assert cache_paths.choices_root() == tmp_path / "xdg" / "qwen3-tts-live"     # a Space without persistent storage
