"""Measure (not a test) click-to-first-sound of the app as it is really started, in headless Chromium.

Starts `python app.py --tiny --port PORT` (the models load in the background while the page is served), waits
until the server answers and then `--delay` seconds more, opens the page and clicks Generate `--clicks` times
on the Preset tab (each run played to its end), then plays the long-text example `--long` times. Prints, per
click, the player's own figures (click -> request sent; whether the player's request started the generation; the
server's first byte as the browser's network stack had it; the page reading it; the click's Gradio event sent;
the start rule deciding to play; the first sample rendered; output latency; first sound; rebuffers and the
silence inside them) and a summary: the median of each step, the median click-to-sound, the first click against
the median of the next four, and the long text's rebuffers. `--json` keeps every run's metrics.

    python -m tests.click_to_sound --port 7941 --delay 20 --clicks 5 --long 3
    chrt -r 1 python -m tests.click_to_sound ...     # on a shared machine: the server and browser first (root)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

from tests import browser as B
from tests.live_server import app_process, wait_answering
from tts_engine.cpu.cpu_info import cpu_info

ROOT = Path(__file__).resolve().parent.parent


def long_text() -> str:
    ex = json.loads((ROOT / "assets" / "examples.json").read_text(encoding="utf-8"))
    return max((e["text"] for e in ex["preset"]), key=len)   # the five-sentence example


def cpu_name() -> str:
    return f"{cpu_info().name}, {os.cpu_count()} cores"


def started_playing(m) -> float | None:
    """When the player decided to play (ms after the click; its start rule), from its log."""
    return next((e[0] for e in m.get("log") or [] if len(e) > 1 and e[1] == "play"), None)


def breakdown(runs: list[dict]) -> str:
    """Median of each step, where the player measured it: the server's first byte (Resource Timing), the page
    reading it, the start rule deciding to play, the first sample rendered, audible."""
    steps = (("clickToResponseStartMs", "server's first byte"), ("clickToFirstByteMs", "page read it"),
             ("playMs", "play decided"), ("clickToRenderedMs", "rendered"), ("clickToSoundMs", "audible"))
    out = []
    for key, name in steps:
        v = [x for m in runs if (x := (started_playing(m) if key == "playMs" else m.get(key))) is not None]
        if v:
            out.append(f"{name} {statistics.median(v):.0f}")
    return ", ".join(out)


HEADER = ("| click | request sent (ms) | started by the player's request | server's first byte (ms) | page read it (ms) "
          "| Gradio event sent (ms) | play decided (ms) | first sample rendered (ms) | output latency (ms) "
          "| first sound (ms) | played (s) | rebuffers | silence in them (ms) |\n" + "|---" * 13 + "|")


def row(k, m) -> str:
    m = dict(m, playMs=started_playing(m))
    f = lambda x: "-" if m.get(x) is None else f"{m[x]:.0f}"   # noqa: E731
    return (f"| {k} | {f('clickToRequestMs')} | {'yes' if m.get('early') else 'no'} | {f('clickToResponseStartMs')} "
            f"| {f('clickToFirstByteMs')} | {f('clickToEventMs')} | {f('playMs')} | {f('clickToRenderedMs')} "
            f"| {f('outputLatencyMs')} | {f('clickToSoundMs')} | {m.get('secondsPlayed', 0):.1f} | {m.get('underruns')} | "
            f"{f('stallMs')} (max {f('maxStallMs')}) |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=7941)
    p.add_argument("--delay", type=float, default=20.0, help="seconds between the server answering and the first click")
    p.add_argument("--clicks", type=int, default=5)
    p.add_argument("--long", type=int, default=3, help="runs of the long-text example")
    p.add_argument("--extra", nargs="*", default=[], help="more flags for app.py")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose app.py to run (to compare versions)")
    p.add_argument("--json", type=Path, default=None, help="write every run's metrics (the player's own) here")
    a = p.parse_args(argv)

    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(app_process(a.root, a.port, a.extra, "click-to-sound-"))
        t_answer = wait_answering(url, 300)
        print(f"server answering {t_answer - t_start:.1f} s after start")
        drv = stack.enter_context(B.chrome_session())
        B.open_page(drv, url + "/")
        state = drv.execute_script("return window.liveModels")
        print("models at page load:", state and state.get("summary"))
        time.sleep(max(0.0, t_answer + a.delay - time.monotonic()))
        print("models at the first click:", drv.execute_script("return window.liveModels && window.liveModels.summary"))
        print("\n" + HEADER)
        clicks = []
        for k in range(a.clicks):
            m = B.play_once(drv)
            clicks.append(m)
            print(row(k + 1, m), flush=True)
            time.sleep(0.5)
        longs = []
        if a.long:
            B.set_text(drv, "#preset-text textarea", long_text(), settle=0.5)
            for k in range(a.long):
                m = B.play_once(drv, timeout=180)
                longs.append(m)
                print(row(f"long {k + 1}", m), flush=True)
                time.sleep(0.5)
        if a.json:
            a.json.write_text(json.dumps({"clicks": clicks, "long": longs}, indent=1))
        t = [m["clickToSoundMs"] for m in clicks]
        print(f"\nCPU: {cpu_name()}; load average at the end: {os.getloadavg()[0]:.1f}")
        if t:
            print("medians (ms after the click): " + breakdown(clicks))
            print(f"click -> first sound: median {statistics.median(t):.0f} ms over {len(t)} clicks; first click "
                  f"{t[0]:.0f} ms" + (f", median of the next {len(t) - 1}: {statistics.median(t[1:]):.0f} ms "
                                      f"(ratio {t[0] / statistics.median(t[1:]):.2f})" if len(t) > 1 else ""))
        if longs:
            print(f"long text: rebuffers {[m['underruns'] for m in longs]}, silence in them (ms) "
                  f"{[round(m.get('stallMs') or 0) for m in longs]}")


if __name__ == "__main__":
    main()
