"""Cold start of the app on a CPU: seconds from `python app.py` to the page being served and to the first audio of
a request, on an EMPTY cache folder (as on a free Hugging Face CPU Space without persistent storage), and every
load-time trial (measured choice) with its seconds.

    python -m bench startup --out /tmp/startup.md                 # tiny and 0.6b, this checkout
    python -m bench startup --arch 0.6b --rounds 3 \\
        --checkout A=/work/wt/startup-base --checkout B=. --out /tmp/startup.md   # A/B interleaved

Each run starts `python app.py` (in the checkout named, on a port of --port's range) with a fresh empty cache
folder (`--cache-dir`), `--tiny` or the benchmarks' random-weight 0.6B CustomVoice checkpoint (the one
`python -m bench speed --arch 0.6b` builds, only the custom_voice role), polls the page until it answers 200
("served"), then sends one streamed `POST /v1/audio/speech` (voice ryan, pcm) and notes the first audio bytes
("first audio", from process start; the request waits for the model to load and warm up; MAX_FRAMES frames at
most), then a second one ("warm first audio", from its own request). The trials are timed inside the app's process: a small wrapper
(`PROBE`) times the named functions of TRIALS that exist in that checkout (a trial inside another is listed with
it, "in"), each counted once at its outermost call. Figures are the median over rounds; the load average is
printed with them. No figure here is asserted anywhere. Our C++ library built at install (`python -m
tts_engine.cpu.build`, into the user's cache folder) is found from the empty cache folder; a checkout without that step
compiles it at start. "first audio after the model loaded" counts from the end of the first
`Qwen3TTSModel.from_pretrained` (weights read and quantised); --wait-deferred waits for the trials deferred to idle time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import load_average

# (label, module, attribute path, label of the trial it runs inside or "")
TRIALS = (
    ("tiny checkpoints written", "tts_engine.tiny", "make_tiny", ""),
    ("engine load (all of it)", "tts_engine.engine.engine", "TTSEngine.from_pretrained", ""),
    ("model loaded (weights, quantised)", "tts_engine.loader", "Qwen3TTSModel.from_pretrained",
     "engine load (all of it)"),
    ("C++ library: found and loaded, or built", "tts_engine.cpu.cpu_build", "prepare", "engine load (all of it)"),
    ("C++ library builds (each, summed over threads)", "tts_engine.cpu.cpu_ext", "build", ""),
    ("quantize=auto pick", "tts_engine.cpu.auto_precision", "pick", "engine load (all of it)"),
    ("kernel table (matmul kernels per shape)", "tts_engine.cpu.kernels", "KernelTable.ensure", ""),
    ("codec conv choice", "tts_engine.cpu.codec_dtype", "choose", "engine load (all of it)"),
    ("codec conv timing", "tts_engine.cpu.codec_dtype", "_measure", "codec conv choice"),
    ("codec int8 quality", "tts_engine.cpu.codec_dtype", "int8_quality", "codec conv choice"),
    ("codec int8 threshold", "tts_engine.cpu.codec_int8_threshold", "apply", "codec conv choice"),
    ("fused step trial (at load)", "tts_engine.cpu.fused_step", "FusedStep._measure", ""),
    ("fused step check (at load; timing deferred)", "tts_engine.cpu.fused_step", "FusedStep._check_at_load", ""),
    ("predictor frame trial or check (at load)", "tts_engine.cpu.backend", "CpuBackend._measure_predictor_frame", ""),
    ("talker step attach: trial or check (at load)", "tts_engine.cpu.backend", "CpuBackend._attach_talker_step", ""),
    ("warm-up synthesis", "ui.roles", "Models.warm_up", ""),
    ("fused step trial, deferred (idle)", "tts_engine.cpu.fused_step", "FusedStep._deferred_trial", ""),
    ("predictor frame trial, deferred (idle)", "tts_engine.cpu.predictor_frame", "PredictorFrame.deferred_trial", ""),
    ("talker step trial, deferred (idle)", "tts_engine.cpu.talker_step", "TalkerStep.deferred_trial", ""),
    ("trials deferred to idle time (after the answers)", "tts_engine.cpu.deferred_trials", "_run", ""),
)
MODEL_LOADED = "model loaded (weights, quantised)"
TRIAL_TAG = "@@startup-trial"
MAX_FRAMES = 24   # frames per request (random weights never end on their own)

# Runs in the app's process (python -c, cwd = the checkout): wraps the functions of TRIALS that exist, then runs
# app.py as __main__ with the arguments after "--".
PROBE = r'''
import functools, importlib, json, os, sys, threading, time
T0 = float(os.environ["STARTUP_T0"])
TRIALS = json.loads(os.environ["STARTUP_TRIALS"])
_depth = threading.local()

def _wrap(label, fn):
    @functools.wraps(fn)
    def timed(*a, **k):
        d = getattr(_depth, label, 0)
        setattr(_depth, label, d + 1)
        t = time.time()
        try:
            return fn(*a, **k)
        finally:
            setattr(_depth, label, d)
            if d == 0:
                print(json.dumps({"tag": "%s", "trial": label, "s": time.time() - t, "end": time.time() - T0}),
                      file=sys.stderr, flush=True)
    return timed

sys.path.insert(0, os.getcwd())
for label, mod, attr, _ in TRIALS:
    try:
        m = importlib.import_module(mod)
    except Exception:
        continue
    owner, parts = m, attr.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p, None)
    fn = getattr(owner, parts[-1], None) if owner is not None else None
    if fn is None:
        continue
    if isinstance(owner, type) and isinstance(owner.__dict__.get(parts[-1]), (staticmethod, classmethod)):
        raw = owner.__dict__[parts[-1]]
        setattr(owner, parts[-1], type(raw)(_wrap(label, raw.__func__)))
    else:
        setattr(owner, parts[-1], _wrap(label, fn))
import runpy
sys.argv = ["app.py"] + sys.argv[sys.argv.index("--") + 1:]
runpy.run_path("app.py", run_name="__main__")
''' % TRIAL_TAG


def free_port(lo: int, hi: int) -> int:
    for p in range(lo, hi + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise SystemExit(f"no free port in {lo}-{hi}")


def app_args(arch: str, cache: Path, port: int, checkpoint: Path | None) -> list[str]:
    a = ["--host", "127.0.0.1", "--port", str(port), "--cache-dir", str(cache)]
    if arch == "tiny":
        return a + ["--tiny"]
    return a + ["--custom-voice-model", str(checkpoint), "--base-model", "", "--voice-design-model", ""]


def _first_audio(port: int, timeout: float) -> tuple[float, float]:
    """(seconds to the first audio bytes, seconds to the whole answer) of one streamed request."""
    body = json.dumps({"input": "Hello there, this is a cold start.", "voice": "ryan", "response_format": "pcm",
                       "stream": True, "seed": 0, "max_new_tokens": MAX_FRAMES}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/audio/speech", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            if first is None:
                first = time.perf_counter() - t
    return (first if first is not None else float("nan")), time.perf_counter() - t


def cold_start(checkout: Path, arch: str, port: int, scratch: Path, checkpoint: Path | None,
               timeout: float, env_extra: dict, wait_deferred: float = 0.0) -> dict:
    """One cold start of `checkout`'s app: {served, first_audio, warm_first_audio, trials: {label: [s, ...]}}."""
    cache = Path(tempfile.mkdtemp(prefix="cold-", dir=scratch))
    log = cache.parent / f"{cache.name}.log"
    env = dict(os.environ, STARTUP_TRIALS=json.dumps(TRIALS), PYTHONPATH=str(checkout), **env_extra)
    env.pop("TTS_CACHE_DIR", None)
    t0 = time.time()
    env["STARTUP_T0"] = repr(t0)
    out = {"served": float("nan"), "first_audio": float("nan"), "warm_first_audio": float("nan"), "trials": {},
           "after_load": float("nan")}
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-c", PROBE, "--", *app_args(arch, cache, port, checkpoint)],
                                cwd=checkout, env=env, stdout=lf, stderr=subprocess.STDOUT)
        try:
            while time.time() - t0 < timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"the app exited ({proc.returncode}); see {log}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                        if r.status == 200:
                            out["served"] = time.time() - t0
                            break
                except OSError:
                    time.sleep(0.05)
            fa, _ = _first_audio(port, timeout)
            out["first_audio"] = (time.time() - t0) - (_ - fa)
            out["warm_first_audio"] = _first_audio(port, timeout)[0]
            time.sleep(0.5)   # trials that finish after the answer still get their line
            if wait_deferred:   # the deferred trials, once no request runs (their line comes when they end)
                t1 = time.time()
                while time.time() - t1 < wait_deferred and '"trials deferred to idle time' not in \
                        log.read_text(errors="replace"):
                    time.sleep(0.5)
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and TRIAL_TAG in line:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            out["trials"].setdefault(d["trial"], []).append(round(d["s"], 3))
            out.setdefault("ends", {})[d["trial"]] = d["end"]
    # the first answer counted from the end of the model's load (its first load: the app may load it twice)
    loaded = [json.loads(ln)["end"] for ln in log.read_text(errors="replace").splitlines()
              if ln.startswith("{") and TRIAL_TAG in ln and f'"{MODEL_LOADED}"' in ln]
    out["after_load"] = out["first_audio"] - min(loaded) if loaded else float("nan")
    out["log"] = str(log)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def _med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report(results: dict, rounds: int, load: list[str], cpu: str) -> str:
    """A markdown section: per arch and checkout the median seconds, then every trial."""
    lines = [f"Cold start (empty cache folder), `python app.py`, median of {rounds} round(s), {cpu}; "
             f"{'; '.join(load)}.", "",
             "| model | checkout | served, s | first audio, s | first audio after the model loaded, s | "
             "warm first audio, s |",
             "|---|---|---|---|---|---|"]
    for (arch, name), runs in results.items():
        lines.append(f"| {arch} | {name} | {_med([r['served'] for r in runs]):.1f} | "
                     f"{_med([r['first_audio'] for r in runs]):.1f} | "
                     f"{_med([r['after_load'] for r in runs]):.1f} | "
                     f"{_med([r['warm_first_audio'] for r in runs]):.2f} |")
    lines += ["", "Trials (seconds, median over rounds; calls in brackets when more than one; \"in\": runs inside "
              "that one):", "", "| model | checkout | trial | in | s |", "|---|---|---|---|---|"]
    parent = {t[0]: t[3] for t in TRIALS}
    for (arch, name), runs in results.items():
        for label, *_ in TRIALS:
            got = [r["trials"][label] for r in runs if label in r["trials"]]
            if not got:
                continue
            s = _med([sum(g) for g in got])
            calls = max(len(g) for g in got)
            lines.append(f"| {arch} | {name} | {label}{f' ({calls})' if calls > 1 else ''} | {parent[label]} | "
                         f"{s:.2f} |")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} vCPUs"
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", choices=["tiny", "0.6b"], help="model(s) (default: both)")
    p.add_argument("--checkout", action="append", default=[],
                   help="NAME=PATH of a checkout to start (repeatable, interleaved; default: this one as 'this')")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--port", type=int, default=7840, help="first port of the range to use (ten ports)")
    p.add_argument("--scratch", default=None, help="folder for the cold cache folders (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the app's environment (repeatable)")
    p.add_argument("--out", default="docs/benchmarks.md", help="markdown file whose section this run replaces")
    p.add_argument("--wait-deferred", type=float, default=0.0,
                   help="seconds to wait after the answers for the trials deferred to idle time (0: do not wait)")
    a = p.parse_args(argv)
    archs = a.arch or ["tiny", "0.6b"]
    here = Path(__file__).resolve().parent.parent
    checkouts = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in a.checkout] or [("this", here)]
    env_extra = dict(e.split("=", 1) for e in a.env)
    checkpoint = None
    if "0.6b" in archs:
        from bench.common import random_checkpoint

        checkpoint = random_checkpoint("0.6b").resolve()
    scratch = Path(a.scratch) if a.scratch else Path(tempfile.mkdtemp(prefix="bench-startup-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    load = []
    for r in range(a.rounds):
        for arch in archs:
            order = checkouts if r % 2 == 0 else checkouts[::-1]
            for name, path in order:
                port = free_port(a.port, a.port + 9)
                load.append(load_average())
                got = cold_start(path, arch, port, scratch, checkpoint, a.timeout, env_extra, a.wait_deferred)
                results.setdefault((arch, name), []).append(got)
                print(f"round {r + 1} {arch} {name}: served {got['served']:.1f} s, first audio "
                      f"{got['first_audio']:.1f} s ({got['after_load']:.1f} s after the model loaded), warm "
                      f"{got['warm_first_audio']:.2f} s; trials "
                      f"{ {k: round(sum(v), 2) for k, v in got['trials'].items()} }; {load[-1]}", flush=True)
    load.append(load_average())
    text = report(results, a.rounds, [load[0], load[-1]], cpu_name())
    print(text)
    if a.out:
        from bench.common import write_markdown
        write_markdown(Path(a.out), "## Cold start on a CPU", text)


if __name__ == "__main__":
    main()
