"""The plain large read over time: `python -m bench plain_read [--seconds 60] [--threads 1,2] [--readers
cpu_ext,torch_sum]`: every (reader, threads) in turn, round after round, one line per round, then each one's spread.
The read itself (`PlainRead`, the memory floor every CPU benchmark compares weight reads with) is defined in
bench/common.py.
"""
from __future__ import annotations

import statistics
import time

import torch

from bench.common import FULL_CPU, PlainRead, device_name, load1


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
            say(f"{time.strftime('%H:%M:%S', time.gmtime())} load {load1():.2f} | " + " | ".join(cells))
    finally:
        torch.set_num_threads(saved)
    return prs


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench plain_read",
                                description="the plain large read over time, per reader and thread count, interleaved")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--readers", default="cpu_ext,torch_sum")
    p.add_argument("--mib", type=int, help="buffer MiB (default: buffer_bytes())")
    a = p.parse_args(argv)
    prs = survey(a.seconds, [int(x) for x in a.threads.split(",")], a.readers.split(","),
                 None if a.mib is None else a.mib << 20)
    print(f"\n{device_name(torch.device('cpu'))}, load average {load1():.2f}")
    for (r, t), pr in prs.items():
        full = [g for g, s in zip(pr.samples, pr.cpu_shares) if s >= FULL_CPU]
        extra = (f"; reads with every thread on its core: median {statistics.median(full):.1f} "
                 f"({min(full):.1f}-{max(full):.1f})") if full else ""
        print(f"{r}, {t} thread(s): {pr.describe()}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
