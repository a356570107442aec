"""The plain large read: the memory floor that every CPU benchmark compares weight reads with (issue 14's "bandwidth
the benchmark measures for a plain large read on the same machine"), defined once here and used by bench_peers,
bench_talker_step, bench_predictor_frame, bench_fused_profile and bench_matmuls.

Definition: one pass over a buffer of `buffer_bytes()` (1 GiB, or 32x the last-level cache where that is larger, so
at most ~3 % of it can be served from the L3), filled with non-repeating bytes (no two pages alike: a constant fill
could be served by shared or zero pages), written once when the buffer is made and never between reads, read with
64-byte loads on torch's threads, the threads claiming 1 MiB chunks (`cpu_ext.read_bytes(claim=True)`, the loads our
weight kernels use; torch's sum of the buffer as float32 where the extension is not built). GB/s = bytes / wall time
of one pass. Claimed, not split in fixed halves: on a VM the two vCPUs read at different rates (17-27 GB/s each,
changing by the minute), and a fixed split takes threads x the SLOWER one's rate (the 34 vs 56-62 GB/s that one
session saw from the same function), while claimed chunks take the sum of the rates: the floor of what the memory
gives the threads at that moment, which a kernel that claims its work (fused_step's claim team) can reach.

How a bench uses it: make one `PlainRead()` and call `.sample()` BETWEEN its own timings (part, read, part, read, ...)
so that a ratio compares reads taken at the same moment of a shared machine; report `.spread()` (min / median / max
and the count), never one best read, and compare a part's GB/s with the median of the reads taken beside it
(`percent`). On a cloud VM the floor itself moves (docs/benchmarks.md, "the plain read"); the spread shows by how much.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

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


def survey(seconds: float, threads: list[int], readers: list[str], nbytes: int | None = None,
           say=print) -> dict:
    """The plain read over time: every (reader, threads) in turn, round after round, for `seconds`; one line per
    round (each read's GB/s and its threads' CPU share) -> {(reader, threads): PlainRead}. A time series shows
    whether the floor moves with the moment (every config fast or slow together) or with the buffer or reader."""
    saved = torch.get_num_threads()
    prs = {}
    try:
        for r in readers:
            for t in threads:
                torch.set_num_threads(t)
                prs[(r, t)] = PlainRead(nbytes, reader=r)
        t_end = time.perf_counter() + seconds
        k = 0
        while k == 0 or time.perf_counter() < t_end:   # one round at least
            cells = []
            for (r, t), pr in prs.items():
                torch.set_num_threads(t)
                g = pr.sample()
                cells.append(f"{r}/{t}t {g:5.1f} ({pr.cpu_shares[-1]:.2f})")
            k += 1
            say(f"{time.strftime('%H:%M:%S', time.gmtime())} load {os.getloadavg()[0]:.2f} | " + " | ".join(cells))
    finally:
        torch.set_num_threads(saved)
    return prs


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.plain_read",
                                description="the plain large read over time, per reader and thread count, interleaved")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--readers", default="cpu_ext,torch_sum")
    p.add_argument("--mib", type=int, help="buffer MiB (default: buffer_bytes())")
    a = p.parse_args(argv)
    prs = survey(a.seconds, [int(x) for x in a.threads.split(",")], a.readers.split(","),
                 None if a.mib is None else a.mib << 20)
    from tts_engine.cpu.cpu_info import cpu_info

    print(f"\nCPU: {cpu_info().name}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for (r, t), pr in prs.items():
        full = [g for g, s in zip(pr.samples, pr.cpu_shares) if s >= FULL_CPU]
        extra = (f"; reads with every thread on its core: median {statistics.median(full):.1f} "
                 f"({min(full):.1f}-{max(full):.1f})") if full else ""
        print(f"{r}, {t} thread(s): {pr.describe()}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
