"""Lap timing for the benchmark scripts: wall time and the calling thread's CPU time (the steadier figure on a
machine shared with other programs) of each part of a sequence of calls."""
from __future__ import annotations

import os
import time


def load_average() -> str:
    """"load average 1.23 0.98 0.87" (or "load average n/a"), printed beside a benchmark's figures."""
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


class Laps:
    """`laps = Laps()`, then `laps.mark("prefill")` after each part: laps.ms["prefill"] = (wall ms, CPU ms) since
    the previous mark (or since the start)."""

    def __init__(self):
        self.ms: dict[str, tuple[float, float]] = {}
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def mark(self, label: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.ms[label] = (1000 * (wall - self._wall), 1000 * (cpu - self._cpu))
        self._wall, self._cpu = wall, cpu
