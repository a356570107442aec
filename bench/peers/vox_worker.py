"""Times one vox synthesis; run by the python of vox's own virtual environment (imports only the standard
library, numpy and vox), never by the project's python:

    <vox venv>/bin/python vox_worker.py --model M.tmod --threads 2 --frames 48 [--warmup-frames 4]

Loads the .tmod, runs a short warm-up synthesis, then one timed streaming synthesis of at most --frames
frames, greedy (top-k 1 for talker and code predictor, no repetition penalty), and prints one JSON line:
frames produced (samples / 1920), wall seconds from the call to the last chunk (generation only: the load is
outside), seconds to the first chunk, load seconds, and vox's own stats after the run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

SAMPLES_PER_FRAME = 1920


def synth(eng, voice, text: str, frames: int, seed: int, language: str) -> dict:
    params = dict(temperature=1.0, top_k=1, top_p=1.0, repetition_penalty=1.0,
                  sub_temperature=1.0, sub_top_k=1, sub_top_p=1.0, max_frames=frames, seed=seed)
    if language:
        params["language"] = language
    t0 = time.perf_counter()
    first, n = None, 0
    for chunk in eng.stream(text, voice, **params):
        if first is None and len(chunk):
            first = time.perf_counter() - t0
        n += len(chunk)
    return {"frames": n / SAMPLES_PER_FRAME, "wall_s": time.perf_counter() - t0, "first_audio_s": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frames", type=int, required=True)
    ap.add_argument("--warmup-frames", type=int, default=4)
    ap.add_argument("--text", default="Ladies and gentlemen, please remain calm.")
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--language", default="english")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    import vox

    t0 = time.perf_counter()
    eng = vox.Engine(a.model, device="cpu", threads=a.threads)
    voice = eng.speaker_voice(a.speaker)
    load_s = time.perf_counter() - t0
    if a.warmup_frames:
        synth(eng, voice, a.text, a.warmup_frames, a.seed, a.language)
    out = synth(eng, voice, a.text, a.frames, a.seed, a.language)
    out["load_s"] = load_s
    out["version"] = vox.devices().get("version") if hasattr(vox, "devices") else None
    try:
        out["stats"] = eng.stats()
    except Exception as e:  # informative only
        out["stats"] = {"error": str(e)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
