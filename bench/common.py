"""What the benchmarks share, defined once: the machine they run on, timing, the plain large read (the memory floor),
random-weight checkpoints, talkers and model runners, the streaming measurement and the report's plumbing.

Every benchmark uses the engine through its public API (and the documented hooks at the end of `ModelRunner`,
`TTSEngine` and `EngineWorker`), never a private attribute: tests/test_bench_public_api.py checks it.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tts_engine.cpu import cpu_info as _cpu_info
from tts_engine.tiny import random_checkpoint   # the benchmarks' random-weight checkpoints (in the library: the codec
                                                # quality check runs on them too)

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Ladies and gentlemen, please remain calm."   # every benchmark's request text


# --- the machine -------------------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    """The device as every benchmark names it beside its figures (a forced CPU level of our kernels said so)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = _cpu_info.cpu_info().name
    forced = ""
    if os.environ.get("TTS_CPU_ISA", "native").strip().lower() not in ("", "native", "auto") \
            or os.environ.get("TTS_CPU_EXT_ISA"):
        from tts_engine.cpu import cpu_ext

        if cpu_ext.available() and cpu_ext.level() < cpu_ext.cpu_level():
            forced = f", our kernels forced to {cpu_ext.level_name()} (TTS_CPU_ISA; this CPU: " \
                     f"{cpu_ext.LEVEL_NAMES[cpu_ext.cpu_level()]})"
    return f"CPU: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads{forced}"


def cpuinfo(text: str | None = None) -> dict:
    """{model, family, model_no, flags (set), cpus} of the first processor in /proc/cpuinfo (or in `text`)."""
    info = _cpu_info.cpu_info() if text is None else _cpu_info.parse(text)
    return {"model": info.name, "family": info.family or None, "model_no": info.model or None,
            "flags": set(info.flags), "cpus": os.cpu_count()}


def machine_key(info: dict) -> str:
    """How docs/benchmarks.md names the machine: one table per key."""
    fam = f" (family {info['family']} model {info['model_no']})" if info.get("family") else ""
    return f"{info['model']}{fam}, {info['cpus']} CPUs"


def simd_flags(info: dict) -> str:
    have = [f for f in _cpu_info.SIMD_FLAGS if f in info["flags"]]
    return " ".join(have) or "none of " + ", ".join(_cpu_info.SIMD_FLAGS[:4])


def load_average() -> str:
    """"load average 1.23 0.98 0.87" (or "load average n/a"), printed beside a benchmark's figures."""
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


def load1() -> float:
    """The one-minute load average (nan where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# --- timing ------------------------------------------------------------------------------------------------------
class Laps:
    """`laps = Laps()`, then `laps.mark("prefill")` after each part: laps.ms["prefill"] = (wall ms, CPU ms) since
    the previous mark (or since the start). CPU: the calling thread's (the steadier figure on a shared machine)."""

    def __init__(self):
        self.ms: dict[str, tuple[float, float]] = {}
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def mark(self, label: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.ms[label] = (1000 * (wall - self._wall), 1000 * (cpu - self._cpu))
        self._wall, self._cpu = wall, cpu


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


def median_ms(xs) -> float:
    """The median of seconds, in ms (one decimal)."""
    return round(1000 * statistics.median(xs), 1)


# --- the plain large read ----------------------------------------------------------------------------------------
# The memory floor that every CPU benchmark compares weight reads with (issue 14's "bandwidth the benchmark measures
# for a plain large read on the same machine"). Definition: one pass over a buffer of `buffer_bytes()` (1 GiB, or 32x
# the last-level cache where that is larger, so at most ~3 % of it can be served from the L3), filled with
# non-repeating bytes (no two pages alike: a constant fill could be served by shared or zero pages), written once when
# the buffer is made and never between reads, read with 64-byte loads on torch's threads, the threads claiming 1 MiB
# chunks (`cpu_ext.read_bytes(claim=True)`, the loads our weight kernels use; torch's sum of the buffer as float32
# where the extension is not built). GB/s = bytes / wall time of one pass. Claimed, not split in fixed halves: on a VM
# the two vCPUs read at different rates (17-27 GB/s each, changing by the minute), and a fixed split takes threads x
# the SLOWER one's rate, while claimed chunks take the sum of the rates: the floor of what the memory gives the
# threads at that moment, which a kernel that claims its work (fused_step's claim team) can reach.
#
# How a bench uses it: make one `PlainRead()` and call `.sample()` BETWEEN its own timings (part, read, part, read,
# ...) so that a ratio compares reads taken at the same moment of a shared machine; report `.spread()` (min / median /
# max and the count), never one best read, and compare a part's GB/s with the median of the reads taken beside it
# (`percent`). On a cloud VM the floor itself moves; the spread shows by how much. `python -m bench plain_read`
# watches it over time.
GIB = 1 << 30
L3_MULTIPLE = 32   # the buffer is at least this many last-level caches
READERS = ("cpu_ext", "cpu_ext_claim", "torch_sum")
FULL_CPU = 0.9     # a read whose threads held their cores (process CPU time / (wall x threads)) at least this much


def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest cache size sysfs lists for CPU 0 (the L3 on x86), 0 when unknown."""
    best = 0
    for idx in Path(sysfs).glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best


def buffer_bytes(llc: int | None = None) -> int:
    """Bytes of the plain read's buffer: 1 GiB, or L3_MULTIPLE x the last-level cache where that is more."""
    llc = last_level_cache_bytes() if llc is None else llc
    return max(GIB, L3_MULTIPLE * llc)


def _fill(buf: torch.Tensor) -> None:
    """Non-repeating bytes: an int64 counter times an odd constant (every 8-byte word distinct; no two pages alike)."""
    words = buf.view(torch.int64)
    torch.arange(words.numel(), dtype=torch.int64, out=words)
    words.mul_(0x9E3779B97F4A7C15 - (1 << 64))   # wraps: a bijection on 64-bit words


class PlainRead:
    """The buffer and the reads taken so far. `reader`: "cpu_ext_claim" (default where built: the threads claim 1 MiB
    chunks, so a faster core reads more), "cpu_ext" (each thread its fixed half) or "torch_sum" (fixed halves too)."""

    def __init__(self, nbytes: int | None = None, reader: str | None = None):
        from tts_engine.cpu import cpu_ext

        self.nbytes = (buffer_bytes() if nbytes is None else int(nbytes)) // 64 * 64
        if reader is None:
            reader = "cpu_ext_claim" if cpu_ext.available() else "torch_sum"
        if reader not in READERS:
            raise ValueError(f"unknown reader {reader!r}")
        self.reader = reader
        self.threads = torch.get_num_threads()   # at the latest read
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8)
        _fill(self.buf)
        self._f32 = self.buf.view(torch.float32)
        self.samples: list[float] = []
        self.cpu_shares: list[float] = []   # per sample: process CPU time / (wall x threads), ~1 = held the cores
        self.read_once()   # the first pass after the fill is not a sample (page tables, caches)

    def read_once(self) -> float:
        """One pass over the buffer -> seconds (not recorded)."""
        return self._timed()[0]

    def _timed(self) -> tuple[float, float]:
        from tts_engine.cpu import cpu_ext

        c0, t0 = time.process_time(), time.perf_counter()
        if self.reader == "cpu_ext":
            cpu_ext.read_bytes(self.buf)
        elif self.reader == "cpu_ext_claim":
            cpu_ext.read_bytes(self.buf, claim=True)
        else:
            self._f32.sum()
        wall = time.perf_counter() - t0
        self.threads = torch.get_num_threads()
        return wall, (time.process_time() - c0) / (wall * self.threads)

    def sample(self) -> float:
        """One pass, recorded -> GB/s."""
        wall, share = self._timed()
        gbs = self.nbytes / wall / 1e9
        self.samples.append(gbs)
        self.cpu_shares.append(share)
        return gbs

    def mark(self) -> int:
        """The number of samples so far: `spread(since=mark)` covers only the reads taken after it."""
        return len(self.samples)

    def spread(self, since: int = 0) -> dict:
        """{"min", "median", "max", "n"} GB/s of the samples taken since `since` (sample once when there are none)."""
        xs = self.samples[since:] or [self.sample()]
        full = sum(s >= FULL_CPU for s in self.cpu_shares[since:])
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs), "full_cpu": full}

    def describe(self, since: int = 0) -> str:
        s = self.spread(since)
        return (f"plain read {s['median']:.1f} GB/s median ({s['min']:.1f}-{s['max']:.1f}, {s['n']} reads of "
                f"{self.nbytes >> 20} MiB interleaved, {s['full_cpu']} of them with every thread on its core, "
                f"{self.reader}, {self.threads} threads)")

    def close(self) -> None:
        self.buf = self._f32 = None


def percent(gbs: float | None, floor: dict | float | None) -> float | None:
    """100 x gbs / the plain read (a spread's median, or a number); None when either is unknown."""
    f = floor["median"] if isinstance(floor, dict) else floor
    return None if not gbs or not f else 100.0 * gbs / f


# --- random-weight talkers and model runners (no engine, no codec), from this checkout or another ---------------
def load_checkout(name: str, repo: str):
    """Another checkout's `tts_engine` imported under the package name `name` (e.g. "tts_base"), for A/B runs in one
    process. Its benchmarks' hooks must be the ones this checkout uses (the public API at the end of the runner)."""
    spec = importlib.util.spec_from_file_location(name, f"{repo}/tts_engine/__init__.py",
                                                  submodule_search_locations=[f"{repo}/tts_engine"])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def build_talker(pkg: str, cfg, dtype, quant, state=None):
    """The talker of package `pkg` (tts_engine, or a checkout from `load_checkout`) with random weights (or `state`),
    without the 151936-row text embedding; projections fused and quantised as the loader does -> (talker, state)."""
    from torch import nn

    talker_mod = importlib.import_module(f"{pkg}.model.talker")
    quant_mod = importlib.import_module(f"{pkg}.model.quant")
    with torch.device("meta"):
        t = talker_mod.Talker(cfg.talker)
    t.model.text_embedding = nn.Embedding(4, cfg.talker.text_hidden_size, device="meta")
    t = t.to_empty(device="cpu").to(dtype)
    if state is None:
        with torch.no_grad():
            for n, p in t.named_parameters():
                p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0, 0.02)
        state = {k: v.clone() for k, v in t.state_dict().items()}
    else:
        t.load_state_dict(state)
    t.build_frame_table()
    if hasattr(t, "fuse_projections") and (quant or dtype != torch.float32):   # as the loader does
        t.fuse_projections()
    if quant:
        quant_mod.quantize_talker(t, quant)
    return t.eval(), state


def make_runner(pkg: str, talker, cfg, dtype, batch: int, max_len: int):
    """A model runner of `pkg` over `talker` with `batch` rows, each prefilled with the same random 40-position prompt
    (end-of-speech ignored) -> (runner, its model_runner module, its sampling module)."""
    mr = importlib.import_module(f"{pkg}.engine.model_runner")
    pr = importlib.import_module(f"{pkg}.model.prompt")
    sp = importlib.import_module(f"{pkg}.model.sampling")
    D = cfg.talker.hidden_size
    r = mr.ModelRunner(talker, torch.zeros(D, dtype=dtype), rows=batch, max_len=max_len,
                       eos_id=cfg.talker.codec_eos_token_id)
    g = torch.Generator().manual_seed(1)
    p = pr.Prompt(prefill=(torch.randn(40, D, generator=g) * 0.05).to(dtype),
                  trailing=(torch.randn(8, D, generator=g) * 0.05).to(dtype))
    for row in range(batch):
        r.prefill(row, p, sp.SamplingParams(seed=row, ignore_eos=True))
    return r, mr, sp


def random_config(arch: str = "0.6b", **talker_changes):
    """The `ModelConfig` of the random `arch` checkpoint (its talker's fields changed by `talker_changes`)."""
    from tts_engine.checkpoint import read_json
    from tts_engine.config import ModelConfig

    d = read_json(random_checkpoint(arch) / "config.json")
    if talker_changes:
        d["talker_config"] = dict(d["talker_config"], **talker_changes)
    return ModelConfig.from_dict(d)


# --- the streaming measurement -----------------------------------------------------------------------------------
def run_concurrency(engine, c: int, frames: int, first_chunk: int) -> dict:
    """`c` streams of `frames` frames each (end-of-speech ignored) through the public streaming API, started together
    -> {concurrency, first audio p50 / p99 ms (from submit), x real time per stream p50 and the worst p99, audio s per
    wall s, audio s, wall s}. The voices: `engine.speakers_for_bench`."""
    results = [None] * c
    start = threading.Barrier(c)

    def client(i):
        start.wait()
        t0 = time.perf_counter()
        voices = engine.speakers_for_bench
        s = engine.stream(TEXT, voice=voices[i % len(voices)], seed=i, max_new_tokens=frames + 1,
                          sampling={"ignore_eos": True}, first_chunk_frames=first_chunk)
        first, n = None, 0
        for chunk in s:
            if first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
        results[i] = (first, time.perf_counter() - t0, n / engine.sample_rate)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfa = [r[0] for r in results]
    xrt = [r[2] / r[1] for r in results]
    return {"concurrency": c, "ttfa_p50_ms": 1000 * pct(ttfa, 50), "ttfa_p99_ms": 1000 * pct(ttfa, 99),
            "xrt_p50": pct(xrt, 50), "xrt_p99_worst": pct(xrt, 1), "audio_s_per_s": sum(r[2] for r in results) / wall,
            "audio_s": sum(r[2] for r in results), "wall_s": wall}


def bench_request(engine, frames: int, first_chunk_frames: int = 2):
    """The benchmarks' one request (TEXT, the first bench voice, seed 0, end-of-speech ignored, `frames` frames),
    built and not submitted (`TTSEngine.make_request`) -> Request."""
    voices = getattr(engine, "speakers_for_bench", None) or engine.speakers
    req, _ = engine.make_request(TEXT, voice=voices[0], seed=0, sampling={"ignore_eos": True},
                                 max_new_tokens=frames, first_chunk_frames=first_chunk_frames)
    return req


def free_port() -> int:
    """A free TCP port on the loopback interface (for a server a benchmark starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the report --------------------------------------------------------------------------------------------------
def command(name: str, argv=None) -> str:
    """The command line that ran benchmark `name`, as its report quotes it."""
    return f"python -m bench {name} {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()


def report(text: str, path: str | None, append: bool = False) -> None:
    """A benchmark's report printed, and written to `path` (--out) where one is given."""
    print(text)
    write_out(text, path, append)


def write_out(text: str, path: str | None, append: bool = False) -> None:
    """A benchmark's report written to `path` (--out) where one is given."""
    if path:
        with open(path, "a" if append else "w", encoding="utf-8") as f:
            f.write(("\n" if append else "") + text + "\n")


def write_markdown(path: Path, header: str, body: str) -> None:
    """Replace (or add) the section that starts with `header` in a markdown file (docs/benchmarks.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\nWritten by `python -m bench speed`.\n"
    sections = text.split("\n## ")
    kept = [sections[0]] + ["## " + s for s in sections[1:] if not ("## " + s).startswith(header)]
    path.write_text("\n".join(k.rstrip("\n") + "\n" for k in kept) + "\n" + header + "\n\n" + body + "\n",
                    encoding="utf-8")
