"""Stream continuity of our own server, as listeners hear it: N clients each play their stream in real time.

    python -m bench continuity --clients 4 [--arrival burst|poisson:RATE] [--url URL | --app-args "..."]

Each client posts `POST /v1/audio/speech` with `stream=true` and `response_format=pcm` (16-bit mono, 24 kHz) and
plays what arrives from the first byte on, at real time. Whenever the next audio has not arrived by the time the
player needs it, the player waits (an underrun) and resumes where it was. Reported: first audio p50 / p99 (from the
request, as the client sees it), each stream's x real time, audio seconds per wall second over all streams, the
share of streams with at least one underrun (the underrun rate), and the underruns' total time. In the spirit of
vLLM-Omni's `bench_tts_continuity.py`.

Without `--url` the app is started here (`python app.py` with `--app-args`, default `--tiny`) on a free loopback
port and stopped at the end. A random checkpoint never ends its speech, so every request asks for a fixed number
of frames (`--frames`).
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from bench.common import ROOT, free_port, pct

BYTES_PER_S = 24000 * 2            # pcm: int16 mono at 24 kHz
UNDERRUN_MIN_S = 0.010             # a wait shorter than this is not heard as a gap
TEXT = "Ladies and gentlemen, please remain calm; the next train leaves in five minutes from platform two."


class Player:
    """A listener's player: audio arrives in pieces, is played at real time from the first byte on, and waits
    whenever it runs dry."""

    def __init__(self, t_first: float):
        self.start = t_first
        self.have = 0.0        # seconds of audio received
        self.stalled = 0.0     # seconds spent waiting so far
        self.gaps: list[float] = []

    def arrive(self, t: float, seconds: float) -> None:
        playing = t - self.start - self.stalled      # where playback would be at t without a new wait
        if playing > self.have:                       # it ran dry at `have` and has waited since
            gap = playing - self.have
            self.stalled += gap
            if gap >= UNDERRUN_MIN_S:
                self.gaps.append(gap)
        self.have += seconds


def one_stream(base: str, body: dict, start_at: float, out: list, i: int) -> None:
    delay = start_at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    rec = {"i": i, "status": None, "first_s": None, "audio_s": 0.0, "wall_s": None, "gaps": [], "error": None}
    try:
        conn.request("POST", "/v1/audio/speech", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            rec["error"] = resp.read(500).decode("utf-8", "replace")
            return
        player, odd = None, b""
        while True:
            piece = resp.read1(65536)
            if not piece:
                break
            now = time.perf_counter()
            piece = odd + piece
            whole = len(piece) - len(piece) % 2
            odd = piece[whole:]
            if whole == 0:
                continue
            if player is None:
                player = Player(now)
                rec["first_s"] = now - t0
            player.arrive(now, whole / BYTES_PER_S)
        rec["wall_s"] = time.perf_counter() - t0
        if player is not None:
            rec["audio_s"] = player.have
            rec["gaps"] = player.gaps
    except Exception as e:   # a refused or broken stream is a result, not a crash of the benchmark
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        out[i] = rec


def run(base: str, clients: int, arrival: str, frames: int, voice: str | None, model: str | None,
        seed: int = 0) -> dict:
    body = {"input": TEXT, "response_format": "pcm", "stream": True, "max_new_tokens": frames}
    if voice:
        body["voice"] = voice
    if model:
        body["model"] = model
    rng = random.Random(seed)
    t = time.perf_counter() + 0.2
    starts = []
    for _ in range(clients):
        starts.append(t)
        if arrival.startswith("poisson:"):
            t += rng.expovariate(float(arrival.split(":", 1)[1]))
    out: list = [None] * clients
    threads = [threading.Thread(target=one_stream, args=(base, dict(body, seed=i), starts[i], out, i))
               for i in range(clients)]
    t_begin = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t_begin
    ok = [r for r in out if r and r["error"] is None and r["first_s"] is not None]
    first = [r["first_s"] for r in ok]
    xrt = [r["audio_s"] / r["wall_s"] for r in ok if r["wall_s"]]
    gaps = [g for r in ok for g in r["gaps"]]

    return {"clients": clients, "arrival": arrival, "frames": frames, "ok": len(ok),
            "refused_or_failed": [{"i": r["i"], "status": r["status"], "error": (r["error"] or "")[:200]}
                                  for r in out if r and r["error"] is not None],
            "first_audio_p50_ms": 1000 * pct(first, 50), "first_audio_p99_ms": 1000 * pct(first, 99),
            "xrt_p50": pct(xrt, 50), "xrt_worst": min(xrt) if xrt else float("nan"),
            "audio_s_per_s": sum(r["audio_s"] for r in ok) / wall,
            "underrun_rate": (sum(1 for r in ok if r["gaps"]) / len(ok)) if ok else float("nan"),
            "underruns": len(gaps), "underrun_total_s": float(sum(gaps)), "wall_s": wall}


def _wait(url: str, timeout: float, proc) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the app exited with status {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url + "/", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the app did not answer within {timeout} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench continuity", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,4", help="comma-separated client counts, one run each")
    p.add_argument("--arrival", default="burst", help="burst (all at once) or poisson:RATE (requests per second)")
    p.add_argument("--frames", type=int, default=48, help="frames per request (80 ms each)")
    p.add_argument("--voice", default="ryan")
    p.add_argument("--model", default=None)
    p.add_argument("--url", help="an app already running (otherwise one is started here)")
    p.add_argument("--app-args", default="--tiny", help="arguments of the app started here")
    p.add_argument("--warmup", type=int, default=1, help="requests before the timed runs")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    proc = None
    base = a.url
    if base is None:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = open(Path(tempfile.gettempdir()) / f"bench-continuity-{port}.log", "w")
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port),
                                 "--cache-dir", tempfile.mkdtemp(prefix="bench-continuity-"),
                                 *shlex.split(a.app_args)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        if proc is not None:
            _wait(base, 900, proc)
        if a.warmup:
            run(base, a.warmup, "burst", 8, a.voice, a.model)
        results = []
        print(f"Continuity of {base} ({a.arrival} arrivals, {a.frames} frames = {a.frames * 0.08:.1f} s of audio "
              f"each; an underrun is a wait of >= {UNDERRUN_MIN_S * 1000:.0f} ms)")
        print("| clients | ok | first audio p50 / p99 ms | x real time p50 / worst | audio-s/s | underrun rate "
              "| underruns (total s) |")
        print("|---|---|---|---|---|---|---|")
        for c in (int(x) for x in a.clients.split(",")):
            r = run(base, c, a.arrival, a.frames, a.voice, a.model)
            results.append(r)
            print(f"| {c} | {r['ok']} | {r['first_audio_p50_ms']:.0f} / {r['first_audio_p99_ms']:.0f} | "
                  f"{r['xrt_p50']:.2f} / {r['xrt_worst']:.2f} | {r['audio_s_per_s']:.2f} | "
                  f"{r['underrun_rate']:.2f} | {r['underruns']} ({r['underrun_total_s']:.2f}) |")
            for f in r["refused_or_failed"][:3]:
                print(f"  refused/failed: #{f['i']} status {f['status']}: {f['error']}")
        if a.json:
            Path(a.json).write_text(json.dumps({"url": base, "arrival": a.arrival, "results": results}, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
