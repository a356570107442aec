"""A long-form job end to end on this machine: a book of `--minutes` of speech rendered by the app's /audiobook
handler (the page's generation loop, each segment written to disk as it ends), then the chapter files, the whole
book, subtitles and the zip. Reported: wall time (generation and building apart), x real time, CPU time and the
load average (a shared machine), peak memory of the process, disk use of the job folder.

    python -m bench longform --minutes 30              # tiny random checkpoints (the default)
    python -m bench longform --minutes 30 --size 0b6   # 0.6B random weights (minutes of CPU time per minute)

A random checkpoint never ends its speech, so every segment is `--frames` frames long (80 ms each); the book has
as many segments as the length needs, in `--chapters` chapters."""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path


def _book(segments: int, chapters: int) -> str:
    per = max(1, segments // chapters)
    out = ["# Benchmark book"]
    for c in range(chapters):
        out.append(f"\n## Chapter {c + 1}\n")
        n = per if c < chapters - 1 else segments - per * (chapters - 1) - 1
        out += [f"Sentence {i + 1} of chapter {c + 1} is read aloud here." + "\n" for i in range(max(1, n))]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench longform", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the book in minutes of speech")
    ap.add_argument("--chapters", type=int, default=None, help="default: 10, fewer for a short book")
    ap.add_argument("--frames", type=int, default=100, help="frames (80 ms) per segment")
    ap.add_argument("--size", default="tiny", choices=["tiny", "0b6"], help="random weights: tiny or 0.6B shape")
    args = ap.parse_args(argv)

    from serving import longform
    from tts_engine import make_tiny
    from ui.app import TTSApp
    from ui.config import AppConfig
    from serving.limits import Limits

    work = Path(tempfile.mkdtemp(prefix="bench-longform-"))
    try:
        if args.size == "tiny":
            cv = str(make_tiny(work / "cv", kind="custom_voice", size="0b6", seed=0))
        else:
            cv = str(make_tiny(work / "cv", kind="custom_voice", size="0b6", seed=0, arch="0.6b"))
        app = TTSApp(AppConfig(checkpoints={"custom_voice": cv, "base": "", "voice_design": ""}, device="cpu",
                               cache_dir=work / "cache", limits=Limits(max_new_tokens=args.frames)))
        app.build()
        app.engine("custom_voice")
        seg_s = args.frames * 0.08
        segments = max(2, int(round(args.minutes * 60 / seg_s)))
        args.chapters = args.chapters or max(1, min(10, segments // 4))
        segments = max(segments, 2 * args.chapters)
        book = _book(segments - args.chapters, args.chapters)       # + each chapter's title is a segment
        load0 = os.getloadavg()
        t0, wall0 = time.perf_counter(), time.time()
        last = {}
        for update in app.audiobook(text=book, voice="ryan", seed=1, randomize=False, max_new_tokens=args.frames):
            last = update
            if app.c.lf_zip in update and update.get(app.c.lf_zip) is not None:
                break
        wall = time.perf_counter() - t0
        load1 = os.getloadavg()
        job = longform.list_jobs(app.jobs_root())[0]
        # generation ends when the last segment's file was written; the chapter files, the book and the zip follow
        gen = max(p.stat().st_mtime for p in (job.folder / "segments").glob("*.wav")) - wall0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        k = job.counts()
        disk = sum(p.stat().st_size for p in job.folder.rglob("*") if p.is_file())
        seg_disk = sum(p.stat().st_size for p in (job.folder / "segments").glob("*.wav"))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        audio = k["audio_s"]
        print(f"long-form, {args.size} random weights, {k['chapters']} chapters, {k['segments']} segments of "
              f"{args.frames} frames")
        print(f"  audio (segments)   {audio / 60:.1f} min")
        print(f"  wall time          {wall:.1f} s  ({audio / wall:.1f}x real time): generation {gen:.1f} s "
              f"({audio / max(gen, 1e-9):.1f}x), building the files and the zip {wall - gen:.1f} s")
        print(f"  CPU time           {usage.ru_utime + usage.ru_stime:.0f} s (user + system; load average "
              f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end, {os.cpu_count()} CPUs)")
        print(f"  peak memory (RSS)  {peak:.0f} MiB")
        print(f"  disk: job folder   {disk / 2**20:.1f} MiB (segments {seg_disk / 2**20:.1f} MiB, outputs "
              f"{(disk - seg_disk) / 2**20:.1f} MiB)")
        print(f"  status             {str(last.get(app.c.status, ''))[:160]}")
        app.close()
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
