"""First audio of a repeated Base clone request, with and without the reference cache, through the speech API.

    python -m bench clone --arch tiny          # tiny random Base checkpoint
    python -m bench clone --arch 0.6b          # the real 0.6B Base architecture, random weights

A server on loopback (uvicorn, this process) with one Base checkpoint; the client posts the same request
`repeats` times (`ref_audio` = presets/oliver.flac, 5 s, with its transcript; `stream=true`, pcm) and times
request -> first audio bytes. Rows: the caches off (every request runs the speaker and codec encoders and
primes the codec decoder with the reference codes), the caches on (the first request fills them, the rest are
timed), the same voice uploaded once and named in `voice`, and a `speaker_embedding` request (x-vector voice: no
reference codes, what a preset-like voice costs). Also the clone step alone (engine.clone_voice, miss vs hit).
Median (min) of the repeats. Writes its section of docs/benchmarks.md with the CPU/GPU named.
"""
from __future__ import annotations

import argparse
import base64
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.common import ROOT, free_port

CLIP = ROOT / "presets" / "oliver.flac"
TRANSCRIPT = "Good morning. I hope you slept well, because today we have a great deal of work to do."


def serve(app):
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return srv, f"http://127.0.0.1:{port}"


def first_audio(url: str, body: dict) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(r.read().decode())
        dt = None
        for chunk in r.iter_bytes():            # read to the end (max_new_tokens is small)
            if chunk and dt is None:
                dt = time.perf_counter() - t0
    return dt


def stats(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.0f} ({min(xs) * 1000:.0f})"


def main(argv=None) -> int:
    from fastapi import FastAPI

    from tts_engine.audio import load_audio
    from bench.common import device_name, load1, random_checkpoint, write_markdown

    from serving.limits import Limits
    from server.openai_api import install
    from serving.registry import EngineRegistry
    from serving.voice_store import VoiceStore

    p = argparse.ArgumentParser(prog="python -m bench clone", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["tiny", "small", "0.6b", "1.7b"], default="tiny")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--frames", type=int, default=4, help="max_new_tokens per request")
    p.add_argument("--dtype")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)

    import tempfile

    ckpt = random_checkpoint(a.arch, "base")
    registry = EngineRegistry({"base": str(ckpt)}, device=None, dtype=a.dtype, offline_fallback=False)
    registry.uploaded = VoiceStore(tempfile.mkdtemp(prefix="bench-voices-"), admin_key="")
    app = FastAPI()
    install(app, registry, Limits(max_new_tokens=a.frames))
    srv, url = serve(app)
    load_before = load1()
    engine = registry.get("base")
    ref = "data:audio/flac;base64," + base64.b64encode(CLIP.read_bytes()).decode()
    body = {"input": "Hello there, this is a cloned voice.", "task_type": "Base", "ref_audio": ref,
            "ref_text": TRANSCRIPT, "language": "english", "stream": True, "response_format": "pcm",
            "max_new_tokens": a.frames, "seed": 1}
    first_audio(url, dict(body, voice="warm-up"))                     # warm-up
    with open(CLIP, "rb") as f:
        r = httpx.post(f"{url}/v1/audio/voices", data={"name": "bench", "ref_text": TRANSCRIPT, "consent": "bench"},
                       files={"audio_sample": ("oliver.flac", f, "audio/flac")}, timeout=600)
    r.raise_for_status()
    named = {k: v for k, v in body.items() if k not in ("task_type", "ref_audio", "ref_text")} | {"voice": "bench"}

    caches = (engine.reference_cache, engine.worker.primed)
    sizes = [c.max_entries for c in caches]
    for c in caches:
        c.clear()
    miss_first = first_audio(url, body)                                 # fills both caches
    emb = engine.clone_voice((load_audio(str(CLIP))), x_vector_only=True).embedding.tolist()
    xvec = {k: v for k, v in body.items() if k not in ("ref_audio", "ref_text")} | {"speaker_embedding": emb}
    off, on, uploaded, vector = [], [], [], []
    for _ in range(a.repeats):   # interleaved, so the load of a shared machine hits every row alike
        saved = [c.items() for c in caches]
        for c in caches:                                                # before: no caches
            c.max_entries = 0
            c.clear()
        off.append(first_audio(url, body))
        for c, n, items in zip(caches, sizes, saved):                   # after: the caches, filled
            c.max_entries = n
            for k, v in items:
                c.put(k, v)
        on.append(first_audio(url, body))
        uploaded.append(first_audio(url, named))
        vector.append(first_audio(url, xvec))
    rows = [("clone request, caches off (encoders + decoder priming every time)", off),
            ("clone request, caches on: the first one (miss)", [miss_first]),
            ("clone request, caches on: repeats (hit)", on),
            ("uploaded voice (same clip, ICL) named in `voice`", uploaded),
            ("`speaker_embedding` request (x-vector: no reference codes; the preset-like floor)", vector)]

    wav, sr = load_audio(str(CLIP))
    engine.reference_cache.clear()
    miss, hit = [], []
    for _ in range(a.repeats):
        engine.reference_cache.clear()
        t0 = time.perf_counter()
        engine.clone_voice((wav, sr), ref_text=TRANSCRIPT)
        miss.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.clone_voice((wav, sr), ref_text=TRANSCRIPT)
        hit.append(time.perf_counter() - t0)
    srv.should_exit = True
    registry.close()

    table = ["| request | first audio, ms: median (min) |", "|---|---|"]
    table += [f"| {name} | {stats(xs)} |" for name, xs in rows]
    table += [f"| `engine.clone_voice` alone (speaker + codec encoders), miss | {stats(miss)} |",
              f"| `engine.clone_voice` alone, hit (hash of the clip) | {stats(hit)} |"]
    body_md = (f"Device: **{device_name(engine.model.device)}**. Checkpoint: random-weight {a.arch} Base architecture "
               f"({engine.precision}). Reference: presets/oliver.flac (5 s) with its transcript (in-context clone). "
               f"Request: `stream=true`, pcm, {a.frames} frames, {a.repeats} repeats; first audio = request sent to "
               f"first audio bytes at the client, through the HTTP server on loopback. Command: "
               f"`python -m bench clone --arch {a.arch}`. Load average (1 min) at the start / end: "
               f"{load_before:.1f} / {load1():.1f} (for {os.cpu_count()} CPUs): on a shared machine "
               "compare the rows of one run, which are interleaved.\n\n" + "\n".join(table))
    print(body_md)
    if not a.no_write:
        write_markdown(Path(a.out),
                       f"## Reference cache: a repeated Base clone request — {a.arch}, {engine.precision}", body_md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
