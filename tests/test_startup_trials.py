"""Cold start (issue 14): the load-time trials are bounded, our one C++ library is built once (at install, else in the
background while the plain paths serve), and measured choices are kept where a Hugging Face Space keeps files across
restarts. Figures: `python -m bench startup` (never asserted here)."""
from __future__ import annotations

import collections
import json
import os
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


# --- our one C++ library: built once, at install or in the background ------------------------------------------
def _require_compiler():
    if cpu_ext._compiler() is None or "x86_64" not in (os.uname().machine or ""):
        pytest.skip("needs g++ on x86-64")


def test_every_wrapper_uses_the_one_library_built_once_per_process():
    """cpu_ext, the fused step, the predictor frame, the talker step and the codec's rows epilogue call one library
    (one CDLL of csrc/ttsx.cpp), compiled at most once in this process (tests/conftest.py: one build folder per run)."""
    _require_compiler()
    from tts_engine.cpu import fused_step, int8_conv, predictor_frame, talker_step

    lib = cpu_ext.library()
    assert lib is not None, cpu_ext.why_unavailable()
    for wrapper in (fused_step.library, predictor_frame.library, talker_step.library, int8_conv.rows_library):
        assert wrapper() is lib
    name = cpu_ext.library_file()
    assert name.startswith("ttsx-") and cpu_ext.built() == cpu_ext.build_dirs()[0] / name
    # (other tests may build other sources or levels into their own folders: this library, at most once)
    assert sum(b.name == name for b in cpu_ext.builds) <= 1, cpu_ext.builds
    for fn in ("ttsx_w8a8", "ttsf_stack_step", "ttsp_frame", "ttst_step", "ttsc_int8_epilogue"):
        assert hasattr(lib, fn), fn
    assert sorted(p.name for p in cpu_ext.LIBRARY.parent.glob("*.cpp")) == sorted(
        [cpu_ext.LIBRARY.name] + [p.name for p in cpu_ext._local_includes(cpu_ext.LIBRARY)])   # every source in it


def test_one_compile_when_threads_ask_at_once(tmp_path, monkeypatch):
    _require_compiler()
    monkeypatch.setenv(cpu_ext.BUILD_DIR_ENV, str(tmp_path / "build"))   # (conftest's folder has it built already)
    compiles = []

    def fake_compile(cxx, source, out, torch_dir):
        compiles.append(out)
        time.sleep(0.3)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"")
        return out

    monkeypatch.setattr(cpu_ext, "_compile", fake_compile)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cpu_ext.build())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiles) == 1 and len(set(got)) == 1 and got[0].parent == tmp_path / "build"
    assert got[0].name == cpu_ext.library_file() and cpu_ext.built() == got[0]


def test_an_installed_library_is_found_from_an_empty_cache_folder(tmp_path, monkeypatch):
    """Built at install into the user's cache folder (`installed_dir`): an app started with --cache-dir EMPTY (a
    fresh TTS_CACHE_DIR) loads it from there instead of compiling; without one it is built into the cache folder."""
    _require_compiler()
    monkeypatch.delenv(cpu_ext.BUILD_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path / "empty"))
    assert cpu_ext.build_dirs() == [tmp_path / "empty" / "cpu_ext", tmp_path / "xdg" / "qwen3-tts-live" / "cpu_ext"]
    assert cpu_ext.built() is None
    installed = tmp_path / "xdg" / "qwen3-tts-live" / "cpu_ext" / cpu_ext.library_file()
    installed.parent.mkdir(parents=True)
    installed.write_bytes(b"")
    monkeypatch.setattr(cpu_ext, "_compile", lambda *a: pytest.fail("compiled although a build was installed"))
    assert cpu_ext.built() == installed and cpu_ext.build() == installed


def _fresh_process(monkeypatch, built: bool, build=None):
    """cpu_ext and cpu_build as in a fresh process whose library is (not) built; `build`: cpu_ext.build's stand-in."""
    monkeypatch.setattr(cpu_ext, "_state", {})
    monkeypatch.setattr(cpu_ext, "_building", [None])
    monkeypatch.setattr(cpu_ext, "_bg", {})
    monkeypatch.delenv("TTS_CPU_EXT", raising=False)
    monkeypatch.setattr(cpu_ext, "built", lambda source=None: Path("/built.so") if built else None)
    if build is not None:
        monkeypatch.setattr(cpu_ext, "build", build)


def test_the_build_policy(monkeypatch):
    monkeypatch.delenv(cpu_build.ENV, raising=False)
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert cpu_build.policy() == "wait"                                 # scripts, benchmarks, tests
    monkeypatch.setenv("SPACE_ID", "someone/qwen3-tts-live")
    assert cpu_build.policy() == "background"                           # a Space: no install step
    monkeypatch.setenv(cpu_build.ENV, "wait")
    assert cpu_build.policy() == "wait"
    monkeypatch.setenv(cpu_build.ENV, "background")
    monkeypatch.delenv("SPACE_ID")
    assert cpu_build.policy() == "background"


def test_prepare_waits_for_the_compiler_only_where_told_to(monkeypatch):
    calls = []
    real = cpu_ext.library

    def fake_build(force=False, source=None):
        calls.append(threading.current_thread().name)
        return Path("/nonexistent.so")

    def fake_load(source=None):
        cpu_ext.build()
        raise OSError("not a library")

    _fresh_process(monkeypatch, built=False, build=fake_build)
    monkeypatch.setattr(cpu_ext, "load_library", fake_load)
    monkeypatch.setenv(cpu_build.ENV, "wait")
    line = cpu_build.prepare()
    assert calls == [threading.current_thread().name] and line.startswith("off (OSError")   # built here, then tried
    assert real() is None and "not a library" in cpu_ext.why_unavailable()
    monkeypatch.setenv(cpu_ext.ENABLE_ENV, "0")
    assert cpu_build.prepare() == f"off ({cpu_ext.ENABLE_ENV}=0)"


def test_a_background_build_serves_the_plain_paths_until_it_is_loaded(monkeypatch):
    """TTS_CPU_BUILD=background where nothing is built: prepare returns at once, `library()` answers None in every
    other thread (nothing remembered, no waiting) while the build runs in its own thread, then the library is there."""
    release, started = threading.Event(), threading.Event()

    def slow_build(force=False, source=None):
        started.set()
        assert release.wait(10)
        return Path("/nonexistent.so")

    _fresh_process(monkeypatch, built=False, build=slow_build)
    sentinel = object()
    monkeypatch.setattr(cpu_ext, "_load", lambda: (cpu_ext.build(), sentinel)[1])
    monkeypatch.setattr(cpu_ext, "_choose_share", lambda: cpu_ext._state.setdefault("share", "split"))
    monkeypatch.setenv(cpu_build.ENV, "background")
    t0 = time.perf_counter()
    assert cpu_build.prepare() == "building in the background" and time.perf_counter() - t0 < 1
    assert started.wait(5)
    assert cpu_build.pending() and cpu_ext.building()
    assert cpu_ext.library() is None and not cpu_ext.available() and cpu_ext.isa() is None
    assert cpu_ext.why_unavailable() == "being built in the background" and "lib" not in cpu_ext._state
    assert cpu_build.prepare() == "building in the background"          # a second engine: the same one build
    release.set()
    assert cpu_build.wait(10)
    assert cpu_ext.library() is sentinel and not cpu_ext.building() and not cpu_build.pending()
    assert cpu_build.prepare() == "loaded before"


def test_attach_later_runs_once_the_library_is_loaded_and_no_row_is_held(monkeypatch):
    release = threading.Event()
    _fresh_process(monkeypatch, built=False, build=lambda force=False, source=None: (release.wait(10), "x")[1])
    sentinel = object()
    monkeypatch.setattr(cpu_ext, "_load", lambda: (cpu_ext.build(), sentinel)[1])
    monkeypatch.setattr(cpu_ext, "_choose_share", lambda: cpu_ext._state.setdefault("share", "split"))

    class Runner:
        device = torch.device("cpu")

    attached = []
    assert cpu_build.attach_later(Runner(), attached.append) is None   # nothing building: nothing to wait for
    monkeypatch.setenv(cpu_build.ENV, "background")
    cpu_build.prepare()
    poll = cpu_build.attach_later(Runner(), attached.append)
    assert poll is not None and poll(True) is False and attached == []   # still building
    release.set()
    assert cpu_build.wait(10)
    assert poll(False) is False and attached == []                     # a row is held: not now
    assert poll(True) is True and len(attached) == 1                   # the next free frame boundary


@pytest.fixture(scope="module")
def tiny_cv(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("bg") / "cv", kind="custom_voice", seed=0)


@pytest.fixture
def library_in_the_background(monkeypatch):
    """A process whose library is not built yet, TTS_CPU_BUILD=background: -> release(), which lets the background
    build end (it then loads the real library, built for this test run)."""
    _require_compiler()
    from tts_engine.cpu import fused_step, int8_conv, predictor_frame, talker_step

    real_build = cpu_ext.build
    assert real_build() is not None                                    # (built before the "fresh process" below)
    go = threading.Event()

    def slow_build(force=False, source=None):
        assert go.wait(60)
        return real_build(force, source)

    saved = {k: cpu_ext._state.get(k) for k in ("lib", "level")}
    _fresh_process(monkeypatch, built=False, build=slow_build)
    for wrapper in (fused_step.library, predictor_frame.library, talker_step.library, int8_conv.rows_library):
        monkeypatch.setattr(wrapper, "_lib", None)
    monkeypatch.setattr(int8_conv, "_rows_state", {})
    monkeypatch.setenv(cpu_build.ENV, "background")
    yield go.set
    go.set()
    cpu_build.wait(60)
    if saved["lib"] is not None:   # (the level this run's earlier tests left; the library is the same)
        saved["lib"].ttsx_set_level(saved["level"])


def _speak(engine):
    import numpy as np

    wav = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=3, max_new_tokens=8)
    assert wav.dtype == np.float32 and wav.size > 0 and np.isfinite(wav).all()
    return wav


def test_an_engine_serves_while_the_library_builds_and_takes_its_fast_paths_after(library_in_the_background,
                                                                                   tiny_cv, monkeypatch):
    """TTS_CPU_BUILD=background, nothing built: the engine loads and answers at once on the plain paths; once the
    background build has loaded the library, its own thread attaches the fast paths at the next frame boundary with
    no row held; an fp32 engine's audio is the same bits before and after."""
    from tts_engine.cpu.backend import CpuBackend
    from tts_engine.engine.engine import TTSEngine

    attached = []
    real_attach = CpuBackend.attach_kernels

    def attach(self, runner):
        attached.append(threading.current_thread().name)
        real_attach(self, runner)

    monkeypatch.setattr(CpuBackend, "attach_kernels", attach)
    engine = TTSEngine.from_pretrained(str(tiny_cv), device="cpu", dtype="fp32", max_batch=1, max_seq_len=128)
    try:
        assert cpu_build.pending() and engine.worker.between_frames is not None
        before = _speak(engine)                                        # served while the library is being built
        assert cpu_build.pending() and not cpu_ext.available() and attached == ["MainThread"]   # (at load: nothing)
        library_in_the_background()
        assert cpu_build.wait(60) and cpu_ext.available()
        after = _speak(engine)
        assert attached == ["MainThread", "tts-engine-worker"] and engine.worker.between_frames is None
        assert before.tobytes() == after.tobytes()
    finally:
        engine.close()


def test_a_bf16_engine_gets_its_fused_paths_once_the_library_is_there(library_in_the_background, tiny_cv,
                                                                       monkeypatch):
    from tts_engine.cpu import fused_step
    from tts_engine.engine.engine import TTSEngine

    for env in (fused_step.ENV, "TTS_PREDICTOR_FRAME", "TTS_TALKER_STEP"):
        monkeypatch.setenv(env, "1")                                   # on without a trial wherever they run
    engine = TTSEngine.from_pretrained(str(tiny_cv), device="cpu", dtype="bf16", max_batch=1, max_seq_len=128)
    try:
        from tts_engine.cpu.measured import entry_of

        stacks = ("talker stack", "predictor stack")
        assert all(entry_of(engine.runner.path_entries[p])["path"] != "fused" for p in stacks), engine.paths()
        _speak(engine)
        library_in_the_background()
        assert cpu_build.wait(60)
        _speak(engine)
        assert all(engine.paths()[p] == {"path": "fused", "how": f"forced by {fused_step.ENV}",
                                         "why": f"{fused_step.ENV}=1"} for p in stacks), engine.paths()
        assert engine.model.talker.model.fused.state == "on" and engine.runner.talker_step is not None
    finally:
        engine.close()


def test_the_install_command(tmp_path):
    """`python -m tts_engine.cpu.build`: says where the library is (built now or before) and exits 0; without a
    compiler it exits 0 too, saying so; --check exits 1 where nothing is built."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))

    def run(*args, **extra):
        return subprocess.run([sys.executable, "-m", "tts_engine.cpu.build", *args], cwd=root, capture_output=True,
                              text=True, env=dict(env, **extra), timeout=600)

    r = run("--check", TTS_BUILD_DIR=str(tmp_path / "none"))
    assert r.returncode == 1 and "not built" in r.stdout
    r = run("--force", TTS_BUILD_DIR=str(tmp_path / "none"), PATH=str(tmp_path), CXX="")
    assert r.returncode == 0 and "nothing built" in r.stdout and not (tmp_path / "none").exists()
    r = run("--force", TTS_BUILD_DIR=str(tmp_path / "none"), TTS_CPU_EXT="0")
    assert r.returncode == 0 and "nothing built (TTS_CPU_EXT=0" in r.stdout
    if cpu_ext.built() is not None:   # (built for this run: conftest's folder) found, not compiled again
        r = run()
        assert r.returncode == 0 and f"already built: {cpu_ext.built()}" in r.stdout, r.stdout + r.stderr
        assert run("--check").returncode == 0


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


# --- trials that do not fit in a fresh start: deferred to idle time --------------------------------------------------
@pytest.fixture
def quiet_trials(monkeypatch):
    from tts_engine.cpu import deferred_trials

    monkeypatch.setattr(deferred_trials, "QUIET_S", 0.3)
    monkeypatch.setattr(deferred_trials, "_state", {"last_busy": time.monotonic() - 60, "served": True, "thread": None,
                                                    "done": []})
    monkeypatch.setattr(deferred_trials, "_jobs", collections.deque())
    monkeypatch.setattr(deferred_trials, "_probes", [])     # (engines of earlier tests: not this test's requests)
    monkeypatch.setattr(deferred_trials, "_engaged", {})
    monkeypatch.setenv(deferred_trials.ENV, "bounded")
    yield deferred_trials
    assert deferred_trials.wait(120)


def test_a_deferred_trial_waits_for_quiet_and_is_measured_again_when_a_request_came(quiet_trials):
    trials = quiet_trials
    runs, kept = [], []

    def measure():
        runs.append(time.monotonic())
        if len(runs) == 1:
            trials.mark_busy()          # a frame served while it measured: thrown away, measured again
        return len(runs)

    trials.mark_busy()
    trials.defer("test trial", measure, kept.append)
    time.sleep(0.1)
    assert runs == [] and trials.pending() == ["test trial"]          # not while frames are being served
    assert trials.wait(30)
    assert kept == [2] and len(runs) == 2 and trials._state["done"] == ["test trial"]
    assert runs[1] - runs[0] >= trials.QUIET_S                         # after another quiet spell


def test_a_request_stops_a_deferred_trial_at_its_next_check(quiet_trials):
    """A frame served while a deferred trial times: its next `check()` stops it (the CPU goes back to the request),
    and it runs again at the next quiet moment; outside a deferred job `check()` never stops anything."""
    trials = quiet_trials
    steps, kept = [], []

    def measure():
        for i in range(50):
            trials.check()
            steps.append(i)
            if len(steps) == 3:
                trials.mark_busy()            # a request came
            time.sleep(0.01)
        return "done"

    trials.defer("stoppable", measure, kept.append)
    assert trials.wait(30) and kept == ["done"]
    assert steps[:3] == [0, 1, 2] and steps[3:] == list(range(50))   # stopped at once, then run whole
    trials.mark_busy()
    trials.check()                                                     # (not in a deferred job: nothing)


def test_nothing_runs_before_the_first_frame_is_served(quiet_trials, monkeypatch):
    """An engine still loading (no frame served yet) times its own choices: no deferred trial runs beside them."""
    monkeypatch.setitem(quiet_trials._state, "served", False)
    ran = []
    quiet_trials.defer("early", lambda: ran.append(1), lambda got: None)
    quiet_trials.mark_busy(frame=False)                                # a load-time timing: no frame yet
    time.sleep(quiet_trials.QUIET_S + 0.5)
    assert ran == [] and quiet_trials.pending() == ["early"]
    quiet_trials.mark_busy()                                           # the first frame
    assert quiet_trials.wait(30) and ran == [1]


def test_a_trial_disturbed_every_time_is_left_for_the_next_start(quiet_trials):
    kept = []
    quiet_trials.defer("noisy", lambda: quiet_trials.mark_busy(), kept.append)
    assert quiet_trials.wait(30) and kept == [] and quiet_trials._state["done"] == []


def test_a_fresh_start_defers_the_codec_conv_choice_to_idle_time(quiet_trials, tmp_path, monkeypatch):
    """No remembered codec choice (a fresh cache folder): the bf16 decoder serves on its usual lossless path at once,
    nothing timed; the measurement runs later while idle and is remembered, so the next start reads it."""
    from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
    from tts_engine.cpu import codec_dtype
    from tts_engine.cpu import measured
    from tts_engine.tiny import tiny_speech_tokenizer_config

    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(codec_dtype.ENV, raising=False)
    monkeypatch.delenv(codec_dtype.CONV_ENV, raising=False)
    monkeypatch.setattr(codec_dtype, "_bf16_convs", lambda: True)
    timed = []
    real = codec_dtype.time_decoder
    monkeypatch.setattr(codec_dtype, "time_decoder", lambda dec, rounds=3: (timed.append(1), real(dec, rounds))[1])
    torch.manual_seed(0)
    dec = CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"]))
    dec = dec.to(torch.bfloat16).eval()
    got = codec_dtype.choose(dec)
    default = "packed" if codec_dtype.packed_conv.available() else "aten"   # the lossless path that usually wins
    assert got is dec and dec.conv_mode == default and timed == [] and not codec_dtype.cache_file().exists()
    assert measured.made()["codec"]["path"] == f"bf16 {default}"
    assert quiet_trials.pending() == ["codec conv choice"]
    assert quiet_trials.wait(120) and timed
    entry = json.loads(codec_dtype.cache_file().read_text())[codec_dtype.machine_key(dec)]
    assert entry["v"] == codec_dtype.ENTRY_VERSION and entry["ms_per_frame"]
    assert dec.conv_mode == default                                    # the serving decoder was not touched
    timed.clear()
    codec_dtype.choose(CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"]))
                       .to(torch.bfloat16).eval())
    assert timed == [] and quiet_trials.pending() == []                # the next start reads it


def test_a_bounded_start_times_one_row_kernels_now_and_batches_while_idle(quiet_trials, tmp_path, monkeypatch):
    """At a bounded start the kernel table times the 1-row bucket of each shape now; the 3+-row bucket takes that
    winner (one log line) and is timed while idle, saved for the next start."""
    monkeypatch.setenv(kernels.TUNE_ENV, "1")
    timed = []

    def fake(fmt, N, K, rows, buf=None, candidates=None):
        timed.append((N, rows))
        return {"int_mm": 2e-6, "int8pack_a8": 1e-6} if rows == 1 else {"int_mm": 1e-6, "int8pack_a8": 2e-6}

    monkeypatch.setattr(kernels, "time_candidates", fake)
    monkeypatch.setattr(kernels, "scratch_buffer", lambda: torch.zeros(16, dtype=torch.uint8))
    t = kernels.KernelTable(key={"test": 1}, path=tmp_path / "kernels.json")
    quiet_trials.mark_busy()
    assert t.ensure("w8a8", [(64, 32), (96, 32)]) == 2
    assert timed == [(64, 1), (96, 1)]                                  # the 1-row bucket only, now
    assert t.choice("w8a8", 64, 32, 1) == t.choice("w8a8", 64, 32, 4) == "int8pack_a8"   # its winner stands in
    assert quiet_trials.wait(30)
    assert sorted(timed[2:]) == [(64, 4), (96, 4)] and t.choice("w8a8", 64, 32, 4) == "int_mm"
    again = kernels.KernelTable(key={"test": 1}, path=tmp_path / "kernels.json")   # the next start reads them
    assert again.lookup("w8a8", 96, 32, 4)["winner"] == "int_mm" and again.ensure("w8a8", [(64, 32), (96, 32)]) == 0
    monkeypatch.setenv(quiet_trials.ENV, "all")                          # everything at start
    timed.clear()
    assert t.ensure("w8a8", [(128, 32)]) == 2 and sorted(timed) == [(128, 1), (128, 4)]


def test_any_first_use_starts_the_background_build_instead_of_compiling(monkeypatch):
    """TTS_CPU_BUILD=background: the first caller of `library()` (the page asking for the precision label, a kernel
    table) starts the background build and gets None at once, not a compile in its own thread."""
    release = threading.Event()
    _fresh_process(monkeypatch, built=False, build=lambda force=False, source=None: (release.wait(10), "x")[1])
    sentinel = object()
    monkeypatch.setattr(cpu_ext, "_load", lambda: (cpu_ext.build(), sentinel)[1])
    monkeypatch.setattr(cpu_ext, "_choose_share", lambda: cpu_ext._state.setdefault("share", "split"))
    monkeypatch.setenv(cpu_build.ENV, "background")
    t0 = time.perf_counter()
    assert cpu_ext.library() is None and not cpu_ext.available() and time.perf_counter() - t0 < 1
    assert cpu_build.pending() and cpu_build.prepare() == "building in the background"
    release.set()
    assert cpu_build.wait(10) and cpu_ext.library() is sentinel


def test_a_runner_left_holding_a_row_stops_counting_as_busy(quiet_trials, monkeypatch):
    """A request held with no frame served (a prefill) counts as busy, but only for STALE_S: a runner left holding a
    row (an engine closed mid-stream) must not keep every deferred trial of the process waiting for ever."""
    trials = quiet_trials
    monkeypatch.setattr(trials, "STALE_S", 0.5)
    held = [True]
    trials.watch(lambda: held[0])
    ran = []
    trials.defer("test trial", lambda: ran.append(1) or 1, lambda got: None)
    time.sleep(0.4)
    assert ran == []                                  # held moments ago: busy (a prefill before its first frame)
    assert trials.wait(10) and ran == [1]             # still held after STALE_S: no longer counted
    held[0] = False
    trials._note_engaged()
    held[0] = True                                    # a new spell counts as busy again
    before = trials._state["last_busy"]
    trials._note_engaged()
    assert trials._state["last_busy"] > before
