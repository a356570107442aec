"""Measure (not a test) the silences a listener hears inside streamed speech, in headless Chromium: the three-line
dialogue of issue 17 (two voices, 0.3 s pause) and the five-sentence long-text example of issue 15.

Starts `python app.py --tiny` once per `--root` (checkouts to compare, each on its own port), opens each page,
warms it with one click on the Preset tab, then plays, round after round and interleaved across the roots, the
dialogue and the long text. Prints per run the player's own figures (click -> first sound, rebuffers, the silence
in them, the longest silence heard anywhere and at a join) and a summary per root (medians; totals of rebuffers).

    python -m tests.stream_gaps --rounds 3                            # this checkout
    python -m tests.stream_gaps --rounds 3 --root /work/main --root . # before / after, interleaved
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from tests import browser as B
from tests.click_to_sound import ROOT, cpu_name, long_text
from tests.live_server import app_process, wait_answering

DIALOGUE = ("Ryan: Good morning, did you sleep well?\n"
            "Vivian: Not at all, the neighbours were singing.\n"
            "Ryan: Then let us buy them a piano.")


def play(drv, kind: str) -> dict:
    if kind == "dialogue":
        B.tab(drv, "Dialogue")
        B.set_text(drv, "#dialogue-script textarea", DIALOGUE, settle=0.4)
        return B.play_once(drv, "#dialogue-generate", timeout=180)
    B.tab(drv, "Preset")
    B.set_text(drv, "#preset-text textarea", long_text(), settle=0.4)
    return B.play_once(drv, timeout=180)


def row(root: str, kind: str, m: dict) -> str:
    f = lambda x: "-" if m.get(x) is None else f"{m[x]:.0f}"   # noqa: E731
    return (f"| {root} | {kind} | {f('clickToSoundMs')} | {m.get('secondsPlayed', 0):.1f} | {m.get('underruns')} | "
            f"{f('stallMs')} (max {f('maxStallMs')}) | {f('longestGapMs')} | {f('longestJoinGapMs')} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, action="append", help="a checkout whose app.py to run (repeat to compare)")
    p.add_argument("--port", type=int, default=7851, help="the first root's port (the next ones count up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default="dialogue,long", help="what each round plays: dialogue, long")
    p.add_argument("--log", action="store_true", help="print each run's player log (play / underrun events)")
    p.add_argument("--timelines", type=Path,
                   help="write each run's chunk arrivals here (JSON, for tests/player_replay.js)")
    p.add_argument("--extra", nargs="*", default=[], help="more flags for app.py")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # (the `with` block stops servers and browser)
    roots = [r.resolve() for r in (a.root or [ROOT])]
    kinds = [k for k in a.kinds.split(",") if k]
    with contextlib.ExitStack() as stack:
        servers = [(root, stack.enter_context(app_process(root, a.port + i, a.extra, "stream-gaps-")))
                   for i, root in enumerate(roots)]
        drv = stack.enter_context(B.chrome_session())
        handles = {}
        for root, url in servers:
            wait_answering(url, 300)
            if handles:
                drv.switch_to.new_window("tab")
            handles[root] = drv.current_window_handle
            B.open_page(drv, url + "/")
            B.wait(lambda: "ready" in str(drv.execute_script("return window.liveModels && window.liveModels.summary"))
                   .lower(), 120, "the models to be ready")
            B.play_once(drv)                       # warm: one click on the Preset tab, as a visitor's first
        print("\n| checkout | what | first sound (ms) | played (s) | rebuffers | silence in them (ms) "
              "| longest silence (ms) | longest at a join (ms) |\n|---|---|---|---|---|---|---|---|")
        results = {r: {k: [] for k in kinds} for r in roots}
        for _ in range(a.rounds):
            for kind in kinds:
                for root, _ in servers:
                    drv.switch_to.window(handles[root])
                    m = play(drv, kind)
                    results[root][kind].append(m)
                    print(row(root.name, kind, m), flush=True)
                    if a.log:
                        print("    log:", m.get("log"))
                    time.sleep(0.5)
        print(f"\nCPU: {cpu_name()}; load average at the end: {os.getloadavg()[0]:.1f}")
        if a.timelines:
            a.timelines.write_text(json.dumps({"cpu": cpu_name(), "runs": [
                {"root": str(root), "kind": kind, "hint": m.get("rateHint"), "expected": m.get("expectedSeconds"),
                 "chunks": [[t, round(n / 24)] for t, n in m.get("timeline") or []]}
                for root in roots for kind in kinds for m in results[root][kind]]}, indent=1))
        for root in roots:
            for kind in kinds:
                ms = results[root][kind]
                if not ms:
                    continue
                med = statistics.median(m['clickToSoundMs'] for m in ms)
                print(f"{root.name} {kind}: click -> sound median {med:.0f}"
                      f" ms; rebuffers {[m['underruns'] for m in ms]}; longest silence (ms) "
                      f"{[round(m['longestGapMs']) for m in ms]}")


if __name__ == "__main__":
    main()
