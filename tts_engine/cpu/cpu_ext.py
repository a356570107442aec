"""Our own CPU matmul kernels (`cpu_ext.cpp`): a fused W8A8 layer for the decode shapes (1-4 activation rows) that
reads its int8 weights at memory speed with AVX-512 VNNI (vpdpbusd, 64 multiply-adds per instruction), with
512-bit (AVX-512BW) and 256-bit (AVX2) paths of 16-bit products (vpmaddwd) for CPUs without VNNI, and a W4A8 layer
(int4 weights x int8 activations: AVX-512 VNNI, or vpmaddubsw + vpmaddwd in 512 or 256 bits); every path gives the
same bits.

CPU levels (`level()`, cpu_ext.cpp `level_of_cpu`): 1 AVX2 + FMA (Haswell .. Zen 3), 2 AVX-512F/BW/VL without VNNI
(Skylake-X), 3 + AVX-512 VNNI (Cascade Lake, Ice Lake), 4 + AVX-512 BF16 (Zen 4, Sapphire Rapids). Every kernel of
ours (these layers, the fused step and predictor frame that include this source, the codec's SnakeBeta) picks its
path from the level: W8A8 / W4A8 VNNI from 3, AVX-512BW at 2 (`isa()` "avx512bw"), AVX2 at 1; the fused step's bf16 matmul vdpbf16ps at 4, AVX-512F at
2-3, AVX2 at 1; SnakeBeta and the small helpers AVX-512F from 2, else AVX2. `TTS_CPU_ISA` = avx2 / avx512 /
avx512vnni / avx512bf16 / native (default) forces a LOWER level (never above what cpuid says: a higher one is
clamped, with a logged line), read when a library loads: the lower paths then run natively on a bigger CPU, to be
tested for equality and timed (a forced avx2 on a Zen 4 times our AVX2 code on that CPU's memory system, not a
Haswell's). torch's own kernels follow their own switches (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`).
`TTS_CPU_EXT_ISA=avx2` (older name) is `TTS_CPU_ISA=avx2`.

One shared library holds every kernel of ours: `csrc/ttsx.cpp` includes cpu_ext.cpp, fused_step.cpp,
predictor_frame.cpp, talker_step.cpp and codec_int8_rows.cpp in one translation unit; each Python wrapper declares
the functions it calls on it (`Beside`). It is built with the system's C++ compiler (`g++`, or $CXX) at install
(`python -m tts_engine.cpu.build`), else when an engine loads (`cpu_build`: now, or in the background while the plain
paths serve), into the cache folder (`build_dirs`: `$TTS_BUILD_DIR`, else `$TTS_CACHE_DIR/cpu_ext/` or
`~/.cache/qwen3-tts-live/cpu_ext/`, where it is also looked for; one file per source and torch: ~10 s of one core
once) and loaded with ctypes: a plain C ABI against the already loaded torch, so neither
ninja nor pybind nor torch's C++ headers beyond `ATen/Parallel.h` are needed (a `torch.utils.cpp_extension`
module with a registered op compiles ~4x longer for the same ~1.5-2 us per call). The work of a call is split over
output rows with `at::parallel_for`, i.e. torch's own OpenMP pool, never a second one.

`available()` is False, with one logged line saying why, when anything fails: no compiler, a build error, a CPU
without AVX2 + FMA, `TTS_CPU_EXT=0`. The engine then keeps aten's kernels (kernels.py lists this one as a
candidate only when it is available); nothing here may take the engine down.

Layer math (as kernels.w8a8_int_mm, with exact int32 sums): xq = round(x * 127 / amax_row) (int8),
y = (xq @ q.T) * amax_row * scale127[n], written in x's dtype. Weights are prepared once (`pack`): blocks of 16
output rows, 4 consecutive k per 32-bit lane, stored as q + 128 (see cpu_ext.cpp).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tts_engine.cpu import deferred_trials

log = logging.getLogger("tts_engine")

ENABLE_ENV = "TTS_CPU_EXT"      # 0 / off / no: never build or use the extension
LEVEL_ENV = "TTS_CPU_ISA"       # native (default) / avx2 / avx512 / avx512vnni / avx512bf16: a lower CPU level
ISA_ENV = "TTS_CPU_EXT_ISA"     # the older switch: avx2 = TTS_CPU_ISA=avx2; auto / avx512: native
ISA_NAMES = {2: "avx512-vnni", 3: "avx512bw", 1: "avx2"}   # cpu_ext.cpp ttsx_isa (3: AVX-512 without VNNI)
LEVELS = {"avx2": 1, "avx512": 2, "avx512vnni": 3, "avx512bf16": 4}
LEVEL_NAMES = {0: "none", **{v: k for k, v in LEVELS.items()}}
SOURCE = Path(__file__).parent / "csrc" / "cpu_ext.cpp"
BLOCK_N, BLOCK_K = 16, 16        # padding of the packed layout (cpu_ext.cpp BLK, KU)

_state: dict = {}
_lock = threading.Lock()
_build_locks: dict[Path, threading.Lock] = {}
_build_locks_guard = threading.Lock()


BUILD_DIR_ENV = "TTS_BUILD_DIR"  # the one folder the library is built into and loaded from (tests/conftest.py: one folder
                                 # for a whole test run, whatever cache folder each test uses)
LIBRARY = Path(__file__).parent / "csrc" / "ttsx.cpp"   # the one translation unit: every source of csrc/ (its doc)

builds: list[Path] = []   # every library this process compiled, in order (tests count them)


def _cache_dir() -> Path:
    """Where this process builds a library it does not find (`build_dirs()[0]`)."""
    return build_dirs()[0]


def installed_dir() -> Path:
    """Where `python -m tts_engine.cpu.build` puts the library when no cache folder is named: the user's default cache
    folder (~/.cache/qwen3-tts-live/cpu_ext, $XDG_CACHE_HOME), whatever cache folder the app is given later."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen3-tts-live" / "cpu_ext"


def build_dirs() -> list[Path]:
    """The folders a built library is looked for in, in order; the first is where one is built. $TTS_BUILD_DIR alone
    where set; else the cache folder in force (`cache_paths.choices_root()`: $TTS_CACHE_DIR, a Space's persistent storage,
    the user's cache folder), then the install folder (`installed_dir`: built by `python -m tts_engine.cpu.build`, so
    an app started with an empty cache folder still finds it)."""
    if os.environ.get(BUILD_DIR_ENV):
        return [Path(os.environ[BUILD_DIR_ENV]).expanduser()]
    from tts_engine import cache_paths

    return list(dict.fromkeys([cache_paths.choices_root() / "cpu_ext", installed_dir()]))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _local_includes(source: Path, seen: set | None = None) -> list[Path]:
    """The files beside `source` that it `#include "..."`s, directly or through each other (cpu_ext.cpp at least)."""
    seen = set() if seen is None else seen
    out = []
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.startswith('#include "'):
            f = source.with_name(line.split('"')[1])
            if f not in seen and f.exists():
                seen.add(f)
                out += [f] + _local_includes(f, seen)
    return out


def _check_platform() -> None:
    if sys.platform != "linux" or not any(m in (os.uname().machine or "") for m in ("x86_64", "amd64")):
        raise RuntimeError(f"built for x86-64 Linux only (this is {sys.platform} {os.uname().machine})")


def library_file(source: Path | None = None) -> str:
    """The file name of `source`'s library (default: the one library, `LIBRARY`): the stem and a digest of its
    sources (the file and what it includes), torch's version and folder. The code is the same on every x86-64 CPU
    (each kernel picks its path from cpuid at run time), so one file serves every machine with this torch; the
    compiler is not part of the name (a library built at install is found where no compiler is left)."""
    source = Path(source) if source is not None else LIBRARY
    src = source.read_bytes()
    if source.name != "cpu_ext.cpp":   # a file that includes the kernels: their sources are part of its identity
        src += b"".join(f.read_bytes() for f in _local_includes(source))
    torch_dir = Path(torch.__file__).parent
    tag = hashlib.sha1(src + torch.__version__.encode() + str(torch_dir).encode()).hexdigest()[:16]
    return f"{'ttsx' if source == LIBRARY or source.name == 'cpu_ext.cpp' else source.stem}-{tag}.so"


def built(source: Path | None = None) -> Path | None:
    """The built library of `source` (default: the one library) in the first of `build_dirs()` that has it, or None
    (nothing is compiled here)."""
    try:
        _check_platform()
        name = library_file(source)
    except (OSError, RuntimeError):
        return None
    for d in build_dirs():
        if (d / name).is_file():
            return d / name
    return None


def build(force: bool = False, source: Path | None = None) -> Path:
    """The one library (`LIBRARY`; or `source`: another checkout's cpu_ext.cpp, benchmarks) for this torch: found
    where it was built before (`built`), else compiled into `build_dirs()[0]` (once per process and file: threads
    that ask at once wait for the one compile). Raises on any failure (no compiler, compile error)."""
    _check_platform()
    source = Path(source) if source is not None else LIBRARY
    if not force and (found := built(source)) is not None:
        return found
    cxx = _compiler()
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    out = _cache_dir() / library_file(source)
    with _build_lock(out):   # one compile per library in this process (the background build and a caller at once)
        if out.exists() and not force:
            return out
        return _compile(cxx, source, out, Path(torch.__file__).parent)


def _build_lock(out: Path) -> threading.Lock:
    with _build_locks_guard:   # (not `_lock`: `library()` holds that while it builds)
        return _build_locks.setdefault(out, threading.Lock())


def _compile(cxx: str, source: Path, out: Path, torch_dir: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.so")
    cmd = [cxx, "-O3", "-shared", "-fPIC", "-fopenmp", "-std=c++17", "-w", f"-I{torch_dir / 'include'}",
           str(source), "-o", str(tmp), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{torch_dir / 'lib'}"]
    t0 = time.perf_counter()
    builds.append(out)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cxx} did not run: {e}") from e
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        msg = (r.stderr or r.stdout).strip().splitlines()
        first = [ln for ln in msg if "error" in ln][:2] or msg[-2:]
        raise RuntimeError(f"{cxx} failed ({r.returncode}): {' | '.join(first)[:400]}")
    tmp.replace(out)   # atomic: a concurrent process sees the old file or the whole new one
    log.info("tts_engine: built the CPU kernels %s in %.1f s", out, time.perf_counter() - t0)
    _state["build_seconds"] = time.perf_counter() - t0
    return out


def load_library(source: Path | None = None) -> ctypes.CDLL:
    """Build `source` (if needed) and load it with its functions' C types (no state kept: `library()` is the
    engine's; another checkout's source is loaded here by `python -m bench matmuls gbps --base`)."""
    lib = ctypes.CDLL(str(build() if source is None else build(source=source)))
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    types = {   # name: (argtypes, restype)
        "ttsx_supported": ([], I), "ttsx_isa": ([], I), "ttsx_isa_clamp": ([I], I), "ttsx_cpu_level": ([], I),
        "ttsx_level": ([], I), "ttsx_set_level": ([I], I), "ttsx_version": ([], I),
        "ttsx_packed_bytes": ([I64, I64], I64), "ttsx_pack": ([P, I64, I64, I64, P], None),
        "ttsx_unpack": ([P, I64, I64, P], None), "ttsx_w8a8": ([P, I, I64, I64, I64, P, P, I64, P, P, I], None),
        "ttsx_packed4_bytes": ([I64, I64], I64), "ttsx_pack4": ([P, P, I64, I64, P], None),
        "ttsx_w4a8": ([P, I, I64, I64, I64, P, I64, P, I], None), "ttsx_read": ([P, I64], I64),
        "ttsx_read_claim": ([P, I64], I64), "ttsx_set_share": ([I], I), "ttsx_claim_chunk": ([I64, I64, I], I64)}
    for name, (args, res) in types.items():
        if source is not None and not hasattr(lib, name):
            continue   # an older checkout's source (python -m bench matmuls --base) lacks the newer functions
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def asked_level() -> int | None:
    """The level TTS_CPU_ISA (or the older TTS_CPU_EXT_ISA=avx2) asks for; None: native (unset, "native", "auto",
    or a value it does not know: logged)."""
    raw = os.environ.get(LEVEL_ENV)
    if raw is None:
        raw = "avx2" if os.environ.get(ISA_ENV, "").strip().lower() == "avx2" else "native"
    want = raw.strip().lower().replace("-", "").replace("_", "").replace(" ", "")
    if want in ("", "native", "auto"):
        return None
    if want not in LEVELS:
        log.warning("tts_engine: %s=%r is not one of native, %s; native level", LEVEL_ENV, raw, ", ".join(LEVELS))
        return None
    return LEVELS[want]


def sync_level(lib: ctypes.CDLL) -> None:
    """Give a second library built from this source (a file that includes cpu_ext.cpp loaded beside the one
    library, e.g. a benchmark's) the level the kernels run at here, now and after every `set_level`, so one process
    never mixes paths (it reads TTS_CPU_ISA itself too; this also covers set_level and the older TTS_CPU_EXT_ISA),
    and the way its matmuls share work between threads (`set_share`). A loader calls it once, right after loading
    that library. (The one library's fused step, predictor frame, talker step and codec rows share its level.)"""
    lib.ttsx_set_level.argtypes, lib.ttsx_set_level.restype = [ctypes.c_int], ctypes.c_int
    lib.ttsx_set_level(int(_state.get("level", 99)))
    if hasattr(lib, "ttsx_set_share"):   # and the way its matmuls share work between threads (`set_share`)
        lib.ttsx_set_share.argtypes, lib.ttsx_set_share.restype = [ctypes.c_int], ctypes.c_int
        lib.ttsx_set_share(SHARES[_state.get("share", "split")])
    if all(other is not lib for other in _synced):
        _synced.append(lib)


_synced: list = []   # the libraries sync_level has seen (loaded once per process, never unloaded)


class Beside:
    """`library = cpu_ext.Beside(declare)`: a module's view of the one library (`library()`: fused_step,
    predictor_frame, talker_step, int8_conv's rows epilogue): on its first call declare(lib) gives the functions that
    module calls their C types (it may raise: nothing is kept then), and the library is kept for the process.
    Raises when our kernels cannot run here (the next call tries again)."""

    def __init__(self, declare):
        self.declare = declare
        self._lib: ctypes.CDLL | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ctypes.CDLL:
        with self._lock:
            if self._lib is None:
                lib = library()
                if lib is None:
                    raise RuntimeError(f"our CPU kernels are not available ({why_unavailable()})")
                self.declare(lib)
                self._lib = lib
            return self._lib


def _load() -> ctypes.CDLL:
    lib = load_library()
    cpu = lib.ttsx_cpu_level()
    asked = asked_level()
    if asked is not None and asked > cpu:
        log.warning("tts_engine: %s asks for %s, above this CPU's %s; running at %s", LEVEL_ENV, LEVEL_NAMES[asked],
                    LEVEL_NAMES[cpu], LEVEL_NAMES[cpu])
    level = cpu if asked is None else min(asked, cpu)
    lib.ttsx_set_level(level)
    _state.update(cpu_level=cpu, level=level)
    isa = lib.ttsx_isa()
    if isa == 0:
        raise RuntimeError("this CPU has neither AVX-512 VNNI nor AVX2 + FMA")
    _state["isa"] = isa
    _sync_loaded()
    if level < cpu:
        log.info("tts_engine: own CPU kernels forced to level %s (this CPU: %s)", LEVEL_NAMES[level], LEVEL_NAMES[cpu])
    return lib


def level() -> int:
    """The CPU level our kernels run at (module doc): 1..4, 0 where they are not available."""
    return _state.get("level", 0) if available() else 0


def level_name() -> str:
    return LEVEL_NAMES[level()]


def cpu_level() -> int:
    """The level cpuid gives this CPU (0 where our kernels are not available)."""
    return _state.get("cpu_level", 0) if available() else 0


def set_level(new: int) -> int:
    """Run our kernels at `new` (clamped to cpuid's level; tests and benchmarks: the same as TTS_CPU_ISA at load,
    for every kernel of the one library, and any library `sync_level` has seen). Returns the level before. Layers packed before keep working: the layouts are the same on every path."""
    lib = library()
    assert lib is not None
    was = _state["level"]
    lib.ttsx_set_level(int(new))
    _state["level"] = lib.ttsx_level()
    _state["isa"] = lib.ttsx_isa()
    _state.pop("snake_isa", None)
    _state.pop("quant_u8", None)
    _state.pop("tag", None)
    _sync_loaded()
    return was


def _sync_loaded() -> None:
    for lib in list(_synced):
        sync_level(lib)


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


_building: list = [None]   # the thread that builds the library in the background (`start_background`), while it does


BUILD_ENV = "TTS_CPU_BUILD"     # auto (default) / wait / background: where the library is not built yet (cpu_build)
BUILD_POLICIES = ("auto", "wait", "background")
_bg: dict = {}   # "thread": the background build (started once per process), "seconds": its build and load


def build_policy() -> str:
    """"wait" or "background": what happens where the library is not built yet (TTS_CPU_BUILD; `auto`: background
    on a Hugging Face Space, SPACE_ID set, else wait; cpu_build's doc)."""
    v = os.environ.get(BUILD_ENV, "auto").strip().lower()
    if v not in BUILD_POLICIES:
        log.warning("tts_engine: %s=%r is not one of %s; auto", BUILD_ENV, v, ", ".join(BUILD_POLICIES))
        v = "auto"
    if v == "auto":
        from tts_engine import cache_paths

        v = "background" if os.environ.get(cache_paths.SPACE_ENV) else "wait"
    return v


def start_background() -> threading.Thread:
    """Build and load the library in a daemon thread (once per process); `library()` answers None in other threads
    meanwhile (the plain paths serve)."""
    with _bg_lock:
        t = _bg.get("thread")
        if t is None:
            t = threading.Thread(target=_build_in_background, name="tts-cpu-build", daemon=True)
            _bg["thread"] = t
            _building[0] = t
            t.start()
            log.info("tts_engine: our C++ kernels are not built here yet: building them in the background; the plain "
                     "PyTorch paths serve until they are loaded (`python -m tts_engine.cpu.build` at install avoids it)")
        return t


_bg_lock = threading.Lock()


def _build_in_background() -> None:
    from tts_engine.cpu import measured

    t = time.perf_counter()
    try:
        lib = library()   # build, load, and the share trial; never raises
    finally:
        _building[0] = None
    _bg["seconds"] = time.perf_counter() - t
    measured.note("cpu library", "our C++ kernels" if lib is not None else "plain PyTorch",
                  measured.DEFAULT if lib is not None else measured.FELL_BACK,
                  f"built in the background in {_bg['seconds']:.1f} s" if lib is not None else why_unavailable())
    if lib is not None:
        log.info("tts_engine: our C++ kernels built and loaded in the background in %.1f s; engines take their fast "
                 "paths at their next idle frame boundary", _bg["seconds"])


def background_pending() -> bool:
    """A background build (or its load) is under way: our kernels are not there yet, and will be."""
    t = _bg.get("thread")
    return t is not None and t.is_alive()


def _starts_in_background() -> bool:
    """Not built here yet and TTS_CPU_BUILD says background: the build starts in its thread, and whoever asked
    first (an engine's load, the page's precision label) does not wait for it."""
    if not enabled() or build_policy() != "background" or built() is not None:
        return False
    start_background()
    return True


def building() -> bool:
    """The library is being built in the background and is not loaded yet (`library()` answers None meanwhile)."""
    return _building[0] is not None and "lib" not in _state


def library() -> ctypes.CDLL | None:
    """The loaded library: found built (`built`), else built now, or None while the background build runs in
    another thread (`start_background`, TTS_CPU_BUILD); None (logged once) when it cannot be built or run here."""
    if "lib" in _state:
        return _state["lib"]
    t = _building[0]
    if t is not None and t is not threading.current_thread():
        return None
    if t is None and _starts_in_background():
        return None
    with _lock:
        if "lib" not in _state:
            lib = None
            if not enabled():
                _state["why"] = f"{ENABLE_ENV}=0"
            else:
                try:
                    lib = _load()
                except Exception as e:   # any failure leaves aten's kernels serving
                    _state["why"] = f"{type(e).__name__}: {e}"[:300]
                    log.warning("tts_engine: own CPU kernels not used (%s); aten's kernels serve", _state["why"])
            _state["lib"] = lib
    if _state["lib"] is not None and "share" not in _state:
        _choose_share()
    return _state["lib"]


def available() -> bool:
    """The W8A8 kernel runs here (AVX-512 VNNI, or the AVX2 path)."""
    return library() is not None


def isa() -> str | None:
    """The code path in use: "avx512-vnni", "avx512bw" (AVX-512 without VNNI), "avx2", or None where the kernels
    are not available."""
    return ISA_NAMES.get(_state.get("isa", 0)) if available() else None


def has_w4a8() -> bool:
    """The W4A8 kernel runs here (AVX-512 VNNI, AVX-512 without VNNI, or AVX2: wherever our kernels run)."""
    return available() and _state.get("isa", 0) >= 1


def why_unavailable() -> str | None:
    if library() is None and building():
        return "being built in the background"
    return _state.get("why")


def tag() -> str:
    """The identity of the kernels (source and torch version) for the kernel table's machine key."""
    if "tag" not in _state:
        _state["tag"] = hashlib.sha1(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12] + \
            f"-{isa()}" + ("" if level() == cpu_level() else f"-forced-{level_name()}")
    return _state["tag"]


def reset() -> None:
    """Forget the loaded state (tests: a later `library()` tries again)."""
    with _lock:
        _state.clear()


# --- how a call shares its output blocks between torch's threads ---------------------------------------------------
# cpu_ext.cpp share_units: "split" (at::parallel_for's fixed parts: halves at two threads) or "claim" (chunks of
# ~1/8 of a thread's share, at least 64 KB of weight, claimed from a counter: the thread on the faster or less busy
# vCPU does more). Both give the same bits. It applies to ttsx_w8a8 / ttsx_w4a8 and to the matmuls of the fused
# step, talker step and predictor frame where they split one matmul at a time (their team modes claim anyway).
SHARE_ENV = "TTS_MATMUL_SHARE"   # split / claim (also 0 / 1) force one; auto (default): measured here (`_choose_share`)
SHARES = {"split": 0, "claim": 1}
SHARE_ROUNDS = 5                 # sweeps per mode in the trial (alternating which goes first)
SHARE_SHAPE = (2048, 1024)       # N, K of the trial's weights (W8A8 2 MiB, W4A8 1.1 MiB each), 1 and 4 rows


def share_setting() -> str:
    """"split", "claim" or "auto" (env TTS_MATMUL_SHARE; 0/off/no/false: split, 1/on/yes/true: claim)."""
    v = os.environ.get(SHARE_ENV, "auto").strip().lower()
    v = {"0": "split", "off": "split", "no": "split", "false": "split",
         "1": "claim", "on": "claim", "yes": "claim", "true": "claim"}.get(v, v)
    return v if v in SHARES else "auto"


def share() -> str:
    """The way W8A8 / W4A8 calls share work between threads in this process: "split" or "claim"."""
    library()
    return _state.get("share", "split")


def set_share(mode: str) -> str:
    """Share work as `mode` ("split" / "claim") from now on, in this library and every library built beside it
    (benchmarks' A/B, tests, the trial) -> the mode before."""
    lib = library()
    assert lib is not None and mode in SHARES
    was = _state.get("share", "split")
    _state["share"] = mode
    lib.ttsx_set_share(SHARES[mode])
    _sync_loaded()
    return was


def measure_share(total_bytes: int | None = None, rounds: int = SHARE_ROUNDS) -> dict[str, float]:
    """{"split": s, "claim": s}: the fastest of `rounds` sweeps (modes alternating which goes first) over W8A8 and
    W4A8 weights of SHARE_SHAPE rotated over `total_bytes` (default: the kernel table's, more than the L3), one and
    four activation rows each, so every call reads its weight from memory. The mode is restored afterwards."""
    N, K = SHARE_SHAPE
    w8, w4 = packed_bytes(N, K), packed4_bytes(N, K)
    n = max(4, (total_bytes or _machine["rotate_bytes"]()) // (w8 + w4))
    buf = torch.full((n * (w8 + w4),), 0x3C, dtype=torch.uint8)   # touched once: no page faults in the sweeps
    weights = [(buf[i * (w8 + w4): i * (w8 + w4) + w8], buf[i * (w8 + w4) + w8: (i + 1) * (w8 + w4)]) for i in range(n)]
    s127 = torch.full((N,), 1e-4)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(m, K, generator=g) for m in (1, 4)]
    best = {m: float("inf") for m in SHARES}
    was = _state.get("share", "split")
    try:
        with torch.inference_mode():
            for r in range(rounds):
                deferred_trials.check()   # (measured while idle: a request stops it)
                for mode in (list(SHARES) if r % 2 == 0 else list(SHARES)[::-1]):
                    set_share(mode)
                    t0 = time.perf_counter()
                    for p8, p4 in weights:
                        for x in xs:
                            w8a8(x, p8, s127, N)
                            w4a8(x, p4, N)
                    best[mode] = min(best[mode], time.perf_counter() - t0)
    finally:
        set_share(was)
    return best


# what the share trial takes from the kernel table (kernels.py gives it when imported: it imports this module):
# "key" () -> its machine key, "rotate_bytes" () -> bytes a timing rotates over, "tuning" () -> whether to measure,
# "tune_env" the switch's name
_machine: dict = {}


def use_machine(**facts) -> None:
    """kernels.py: the machine facts the share trial needs (`_machine`)."""
    _machine.update(facts)


def _share_key() -> dict:
    return {"machine": _machine["key"](), "shape": list(SHARE_SHAPE)}


def _choose_share() -> None:
    """The process's share mode (`share`): TTS_MATMUL_SHARE where it forces one; else what was measured before on
    this machine (`measured`, key: the kernel table's machine key), else the trial now (`measure_share`,
    ~0.1-0.7 s once per machine; at a bounded start split now and the trial while idle, `deferred_trials`) when
    kernel tuning is on (TTS_KERNEL_TUNE), else split. Never raises."""
    with _share_lock:
        if "share" in _state:
            return
        _state["share"] = "split"
        from tts_engine.cpu import measured

        mode, why = share_setting(), f"{SHARE_ENV}={os.environ.get(SHARE_ENV, '')}"
        how = measured.forced_by(SHARE_ENV)
        try:
            if mode == "auto":
                tune_env = _machine.get("tune_env", "kernel tuning")
                mode, why, how = "split", f"not measured ({tune_env}=0)", measured.forced_by(tune_env)
                if torch.get_num_threads() < 2:
                    why, how = "one thread", measured.DEFAULT
                elif "key" not in _machine:
                    why, how = "not measured (the kernel table is not loaded in this process)", measured.DEFAULT
                elif _machine["tuning"]():
                    key = _share_key()
                    path = measured.path_for("matmul_share", key)
                    got = measured.recall(path, key, tuple(SHARES))
                    if got is not None:
                        mode, why, how = got["choice"], f"measured before: {got['why']}", measured.REMEMBERED
                    elif deferred_trials.bounded():   # a fresh start: split until measured while idle
                        why, how = "default until measured while idle", measured.DEFAULT
                        deferred_trials.defer("matmul share", measure_share,
                                              lambda t: measured.remember(path, key, *_share_pick(t)))
                    else:
                        mode, why = _share_pick(measure_share())
                        how = measured.MEASURED
                        measured.remember(path, key, mode, why)
                        log.info("tts_engine: W8A8/W4A8 calls share work by %s (%s)", mode, why)
        except Exception as e:   # the trial must never take the kernels down: split, as before
            mode, why, how = "split", f"trial failed: {type(e).__name__}: {e}"[:200], measured.FELL_BACK
            log.warning("tts_engine: %s", why)
        set_share(mode)
        _state["share_why"] = why
        measured.note("matmul share", mode, how, why)


def _share_pick(t: dict[str, float]) -> tuple[str, str]:
    """(mode, why) from `measure_share`'s times."""
    return ("claim" if t["claim"] < t["split"] else "split",
            f"claim {1e3 * t['claim']:.1f} ms vs split {1e3 * t['split']:.1f} ms per sweep")


_share_lock = threading.RLock()


# --- the W8A8 layer -----------------------------------------------------------------------------------------------
def packed_bytes(N: int, K: int) -> int:
    return -(-N // BLOCK_N) * BLOCK_N * -(-K // BLOCK_K) * BLOCK_K


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout (uint8, 1-D, packed_bytes(N, K))."""
    lib = library()
    assert lib is not None and q.dtype == torch.int8 and q.dim() == 2 and q.stride(1) == 1
    N, K = q.shape
    out = torch.empty(packed_bytes(N, K), dtype=torch.uint8)
    lib.ttsx_pack(q.data_ptr(), N, K, q.stride(0), out.data_ptr())
    return out


def unpack(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The inverse of `pack`: int8 [N, K]."""
    lib = library()
    assert lib is not None and packed.numel() >= packed_bytes(N, K)
    q = torch.empty(N, K, dtype=torch.int8)
    lib.ttsx_unpack(packed.data_ptr(), N, K, q.data_ptr())
    return q


def _activation_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels read it: fp32 or bf16, unit stride along K, rows at least K apart."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    return x


def w8a8(x: torch.Tensor, packed: torch.Tensor, scale127: torch.Tensor, N: int,
         acc: torch.Tensor | None = None, path: int | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 -> y [M, N] in x's dtype (module doc). packed: `pack(q)`; scale127 [N] fp32.
    acc: an int32 [M, N] tensor to receive the exact sums (tests). path (ISA_NAMES): 1 = the AVX2 code path even on
    a CPU with AVX-512 (timed beside the best by the kernel table there), 3 = the AVX-512 path without VNNI, 2 = VNNI;
    None = the best at the level; a path above the level runs the level's own (cpu_ext.cpp isa_clamp)."""
    lib = _state.get("lib") or library()
    x = _activation_rows(x)
    M, K = x.shape
    if packed.numel() < packed_bytes(N, K) or scale127.dtype != torch.float32 or scale127.numel() < N \
            or not scale127.is_contiguous():
        raise ValueError(f"packed weight / scale do not fit {N}x{K}")
    y = torch.empty(M, N, dtype=x.dtype)
    lib.ttsx_w8a8(x.data_ptr(), int(x.dtype == torch.bfloat16), M, K, x.stride(0), packed.data_ptr(),
                  scale127.data_ptr(), N, y.data_ptr(), None if acc is None else acc.data_ptr(),
                  path or _state["isa"])
    return y


def read_bytes(buf: torch.Tensor, claim: bool = False) -> int:
    """A plain read of a contiguous tensor's bytes with 64-byte loads on torch's threads (the memory floor): in fixed
    halves (one per thread), or with claim=True in 1 MiB chunks the threads claim (a faster core reads more)."""
    lib = library()
    assert lib is not None and buf.is_contiguous()
    f = lib.ttsx_read_claim if claim else lib.ttsx_read
    return f(buf.data_ptr(), buf.numel() * buf.element_size())


# --- the W4A8 layer (int4 weights of quant.Int4Linear x int8 activation rows) -------------------------------------
INT4_GROUP = 64   # the kernel's group (quant.INT4_GROUP)


def packed4_bytes(N: int, K: int) -> int:
    return -(-N // BLOCK_N) * (-(-K // INT4_GROUP)) * (8 * 64 + 64)


def pack4(q: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..15, any integer dtype), scale_zero [K/64, N, 2] bf16 -> the W4A8 kernel's layout (uint8)."""
    lib = library()
    N, K = q.shape
    assert lib is not None and has_w4a8() and scale_zero.dtype == torch.bfloat16 and scale_zero.shape == (-(-K // 64), N, 2)
    q8 = q.to(torch.uint8).contiguous()
    sz = scale_zero.contiguous()
    out = torch.empty(packed4_bytes(N, K), dtype=torch.uint8)
    lib.ttsx_pack4(q8.data_ptr(), sz.data_ptr(), N, K, out.data_ptr())
    return out


def w4a8(x: torch.Tensor, packed4: torch.Tensor, N: int, path: int | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 -> y [M, N] in x's dtype: x rounded to int8 per row (as w8a8) times the int4 weights.
    path: as `w8a8` (1 AVX2, 3 AVX-512 without VNNI, 2 VNNI: the same bits), None = the best at the level."""
    lib = _state.get("lib") or library()
    x = _activation_rows(x)
    M, K = x.shape
    if packed4.numel() < packed4_bytes(N, K) or not has_w4a8():
        raise ValueError(f"packed int4 weight does not fit {N}x{K}")
    y = torch.empty(M, N, dtype=x.dtype)
    lib.ttsx_w4a8(x.data_ptr(), int(x.dtype == torch.bfloat16), M, K, x.stride(0), packed4.data_ptr(), N,
                  y.data_ptr(), path or _state["isa"])
    return y


# === codec decoder: fused SnakeBeta (the end section of cpu_ext.cpp) ==============================================
def snake(x: torch.Tensor, a: torch.Tensor, ib: torch.Tensor) -> torch.Tensor | None:
    """x + ib[c] * sin(x * a[c])^2 in one pass (tts_engine/codec/decoder.py SnakeBeta); x [B, C, L] fp32 or bf16,
    channel-major (contiguous) or time-major (channels-last strides); a, ib fp32 [C] (a = exp(alpha),
    ib = 1 / (exp(beta) + 1e-9)). Returns y in x's dtype and layout, or None where the kernel cannot run here or
    on this input (the caller computes it with aten's ops)."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 3:
        return None
    if "snake_isa" not in _state:
        P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.ttsx_snake.argtypes, lib.ttsx_snake.restype = [P, P, I, I64, I64, I64, I, P, P, I], None
        lib.ttsx_snake_isa.restype = I
        _state["snake_isa"] = lib.ttsx_snake_isa()
    B, C, L = x.shape
    if x.is_contiguous():
        time_major = 0
    elif x.transpose(1, 2).is_contiguous():
        time_major = 1
    else:
        return None
    if a.dtype != torch.float32 or ib.dtype != torch.float32 or a.numel() != C or ib.numel() != C:
        return None
    a, ib = a.contiguous(), ib.contiguous()
    y = torch.empty_like(x)   # same strides as x (dense)
    lib.ttsx_snake(x.data_ptr(), y.data_ptr(), int(x.dtype == torch.bfloat16), B, C, L, time_major,
                   a.data_ptr(), ib.data_ptr(), _state["snake_isa"])
    return y


def quant_u8(x: torch.Tensor) -> tuple[torch.Tensor, float, int] | None:
    """Dynamic per-tensor asymmetric uint8 quantisation of a dense fp32 or bf16 CPU tensor in one call (two passes:
    min/max, then quantise): -> (q uint8 with x's shape and strides, scale, zero point), so that
    x ~ (q - zp) * scale; the range always includes 0. None where the kernel cannot run here (the caller quantises
    with aten's ops). Used by the codec's int8 convolutions (tts_engine/cpu/int8_conv.py)."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
            or (x.dim() == 3 and x.transpose(1, 2).is_contiguous())):
        return None
    if "quant_u8" not in _state:
        P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.ttsx_quant_u8.argtypes, lib.ttsx_quant_u8.restype = [P, I, I64, P, P, I], None
        lib.ttsx_snake_isa.restype = I
        _state["quant_u8"] = lib.ttsx_snake_isa()   # 2: the AVX-512 F/BW/VL loops, 1: the AVX2 ones (0: scalar)
    q = torch.empty_like(x, dtype=torch.uint8)   # same (dense) strides as x
    out = torch.empty(2, dtype=torch.float32)
    lib.ttsx_quant_u8(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel(), q.data_ptr(), out.data_ptr(),
                      _state["quant_u8"])
    return q, float(out[0]), int(out[1])


# --- for tools and benchmarks: documented, stable ----------------------------------------------------------------
def calls_to(lib: ctypes.CDLL):
    """A context manager: this module's kernel calls go to `lib` (another build of the same source layout, from
    `load_library`) while inside, then back to the loaded library. Benchmarks A/B two kernel sources in one process."""
    import contextlib

    @contextlib.contextmanager
    def switched():
        own = _state["lib"]
        _state["lib"] = lib
        try:
            yield
        finally:
            _state["lib"] = own
    return switched()
