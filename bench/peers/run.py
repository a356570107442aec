"""`python -m bench peers`: our engine and the independent CPU engines side by side, in one run.

Every engine gets the same random-weight checkpoint of the real 0.6B CustomVoice architecture (made here by
`make_tiny`, converted for each peer), the same text and speaker, the same thread count (2 by default), one
stream, fixed lengths (24 and 48 frames by default), and is timed on generation only (no model load). The runs
are interleaved: each repeat walks every (engine, precision) once per length, in an order rotated from repeat to
repeat, so a noisy neighbour on a shared machine slows every engine alike instead of one engine's whole series.

Engines: ours at the dtype it picks on this CPU and at every `--quantize` mode it offers; the C engine
(`bench.peers.c_engine`) in bf16 / int8 / int4; vox (`bench.peers.vox`) in q8 / q4. A peer that cannot
be set up is skipped with a line that says why. Also measured: the plain large memory read (`common.PlainRead`, taken
after every run and between the profiles' frames; its min / median / max) and, for each of our precisions, the
weight bytes a frame reads over the bench's per-part profile -> effective GB/s and % of the reads beside them.

Prints one table (x real time and first audio per engine and precision; our ratio to the best peer in each
precision class and overall) and writes it to docs/benchmarks.md ("CPU: side by side with the peers", one
table per machine: a new machine is appended, the same machine replaced), raw rows to docs/bench-results/.
Peers live under $QWEN_TTS_PEERS_DIR (default ~/.cache/qwen3-tts-live/peers).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import torch

from tts_engine.cache_paths import cache_root
from bench import common
from bench.common import PlainRead
from bench.peers.ours import weight_bytes, weight_counts
from bench.peers.table import OURS, Run, markdown, ratios, summarize

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## CPU: side by side with the peers"
INTRO = """Written by `python -m bench peers` (`bench/peers/run.py`; one table per machine, a
rerun on the same machine replaces its table). All engines run the **same random-weight checkpoint of the real 0.6B
CustomVoice architecture** (converted for each peer), the same text ("Ladies and gentlemen, please remain calm.")
and speaker, one stream, the same thread count, fixed lengths, **generation time only** (no model load; the prompt's
prefill is included), streaming (first audio = call to first audio chunk; first chunk: ours 1 frame, the C engine's
`--stream` 2 frames, vox 4 frames, each engine's own default). The runs are **interleaved**: every repeat
walks every engine and precision once per length, in a rotated order, so a busy neighbour hits every engine in
every phase; that is what makes a shared machine's figures comparable with each other (not with a quiet machine's).
It cannot make them equal: an engine whose idle threads spin (the C engine's pool, vox's `spin: true`) or that runs
more threads than cores (the C engine's decoder thread beside its pool and OpenBLAS) loses more on an oversubscribed
machine than one that yields, so only a quiet machine's ratios are the engines' own. x real time
= audio seconds / wall seconds; per cell the best run, then the median and the number of good runs. Ratios compare
best runs at the longest length. Precision classes go by weight bits: vox q4 keeps its code predictor in q8; the C
engine's int8/int4 quantise activations too (W8A8 / W4A8) and decode codebooks 1-15 greedily; vox runs greedy; ours
samples codebooks 1-15 as the official implementation does. GB/s = weight bytes read per frame / time per frame:
ours measured from the loaded modules and the bench's per-part profile (taken after every repeat; the least per
part; each part timed alone in one thread with nothing beside it, so neither the codec thread nor the worker's glue is
in them: the third figure is the rest of our frame, its sampling and host work; `python -m bench speed --profile`
splits a real stream's wall time), the C engine's estimated from its formats (bf16; int8 + a scale per row; Q4_0 18 bytes per 32 weights) and its own
per-frame split, vox's talker from its plan's stage bytes and its own split, its predictor estimated for q8."""


def peers_dir_default() -> Path:
    env = os.environ.get("QWEN_TTS_PEERS_DIR")
    if env:
        return Path(env)
    return cache_root() / "peers"


def checkpoint(peers_dir: Path) -> Path:
    """The shared random checkpoint: 0.6B CustomVoice architecture, seed 11, stored in bf16 like the release."""
    folder = peers_dir / "ck-0b6-cv"
    if not (folder / "speech_tokenizer" / "model.safetensors").exists():
        from tts_engine.tiny import make_tiny

        print(f"writing a random 0.6b custom_voice checkpoint to {folder} ...", file=sys.stderr)
        make_tiny(folder, kind="custom_voice", size="0b6", seed=11, arch="0.6b", dtype=torch.bfloat16)
    return folder


def schedule(n_configs: int, lengths: list[int], repeats: int) -> list[tuple[int, int, int]]:
    """(repeat, frames, config index) in run order: per repeat, per length, every config once, the config order
    rotated by one each repeat."""
    out = []
    for rep in range(repeats):
        order = [(i + rep) % n_configs for i in range(n_configs)]
        for frames in lengths:
            out += [(rep, frames, i) for i in order]
    return out


def update_doc(text: str, key: str, body: str) -> str:
    """Put `### key` + body into the SECTION of a benchmarks.md text: replace that machine's table, or append it
    after the other machines'; create the section (with INTRO) at the end when missing."""
    sub = f"### {key}\n\n{body.strip()}\n"
    if SECTION not in text:
        return text.rstrip("\n") + f"\n\n{SECTION}\n\n{INTRO}\n\n{sub}"
    start = text.index(SECTION)
    m = re.search(r"^## ", text[start + len(SECTION):], re.M)
    end = start + len(SECTION) + m.start() if m else len(text)
    section, rest = text[start:end], text[end:]
    machines = re.split(r"^(?=### )", section, flags=re.M)[1:]     # [0] is the heading + intro, rewritten
    head = f"{SECTION}\n\n{INTRO}\n\n"
    kept = [p if p.endswith("\n\n") else p.rstrip("\n") + "\n\n" for p in machines]
    for i, p in enumerate(kept):
        if p.startswith(f"### {key}\n"):
            kept[i] = sub + "\n"
            break
    else:
        kept.append(sub + "\n")
    new = head + "".join(kept)
    return text[:start] + (new.rstrip("\n") + "\n" + ("\n" + rest if rest else ""))


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def setup_engines(a, ckpt: Path, info: dict, skipped: list[str], notes: list[str]) -> list:
    """Our engine per precision, then the peers; whatever fails to set up becomes a `skipped` line."""
    from bench.peers import c_engine, ours, vox

    engines = []
    if "tts_engine" not in a.skip:
        for mode in ours.modes():
            try:
                e = ours.OurEngine(ckpt, mode, max(a.frames))
                engines.append(e)
                notes.append(f"tts_engine {e.precision}: {e.label}, load {e.load_s:.1f} s")
            except Exception as ex:  # noqa: BLE001 - one precision that does not load is reported, not fatal
                skipped.append(f"tts_engine {mode or 'checkpoint dtype'}: {type(ex).__name__}: {ex}".splitlines()[0])
    if "c_engine" not in a.skip:
        try:
            e = c_engine.CEngine.setup(a.peers_dir, ckpt, a.c_engine_src, info["flags"], a.threads, ours.TEXT)
            engines.append(e)
            notes.append(f"{e.name}: {', '.join(e.notes)}")
        except Exception as ex:  # noqa: BLE001
            skipped.append(f"{c_engine.NAME}: {ex}".splitlines()[0])
    if "vox" not in a.skip:
        try:
            e = vox.Vox.setup(a.peers_dir, ckpt, a.threads, ours.TEXT)
            engines.append(e)
            notes.append(f"{e.name}: {', '.join(e.notes)}")
        except Exception as ex:  # noqa: BLE001
            skipped.append(f"{vox.NAME}: {ex}".splitlines()[0])
    return engines


def interleave(engines: list, lengths: list[int], repeats: int, profile_frames: int,
               floor=None) -> tuple[list[Run], dict]:
    """Ours and the peers' precisions, mixed (ours, C engine, vox, ours, ...), timed in the schedule's order;
    after each repeat, the bench's per-part profile of each of our precisions (so it too sees every phase of a
    shared machine). floor: a `common.PlainRead`, sampled after every run and after each profiled frame (its
    spread over a profile goes in the profile's "plain_read"). Returns (runs, {our precision: [profile per repeat]})."""
    per_engine = [[(e, p) for p in e.precisions] for e in engines]
    configs = []
    while any(per_engine):
        for lst in per_engine:
            if lst:
                configs.append(lst.pop(0))
    runs, profiles = [], {}
    plan = schedule(len(configs), lengths, repeats)
    for k, (rep, frames, i) in enumerate(plan):
        eng, prec = configs[i]
        t0 = time.perf_counter()
        r = eng.run(prec, frames, rep)
        r.extra["load_average"] = _loadavg()
        if floor is not None:
            r.extra["plain_read_gbs"] = round(floor.sample(), 2)
        runs.append(r)
        what = (f"{r.x_real_time:.3f}x real time, first audio {r.first_audio_s or float('nan'):.2f} s, "
                f"{r.frames:g} frames" if r.ok else f"FAILED: {r.error}")
        print(f"[{k + 1}/{len(plan)}] repeat {rep + 1}, {frames} frames, {r.engine} {r.precision}: {what} "
              f"({time.perf_counter() - t0:.0f} s, load average {r.extra['load_average']})", file=sys.stderr, flush=True)
        if k + 1 == len(plan) or plan[k + 1][0] != rep:
            for e in engines:
                if e.name == OURS and profile_frames:
                    try:
                        prof = e.profile(profile_frames) if floor is None else e.profile(profile_frames, floor)
                    except Exception as ex:  # noqa: BLE001 - the profile is informative only
                        print(f"profile of {e.precision} failed: {ex}", file=sys.stderr)
                        continue
                    profiles.setdefault(e.precision, []).append(prof)
    return runs, profiles


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench peers", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    p.add_argument("--frames", type=int, nargs="+", default=[24, 48], help="fixed lengths in frames (80 ms each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers-dir", type=Path, default=peers_dir_default(),
                   help="where peers, their environments and converted checkpoints live (default: %(default)s)")
    p.add_argument("--c-engine-src", default=os.environ.get("QWEN_TTS_C_ENGINE_SRC"),
                   help="the C engine's source: a git clone/mirror holding the pinned commit, or a source tree at it "
                        "(default $QWEN_TTS_C_ENGINE_SRC; without it: git clone from GitHub)")
    p.add_argument("--skip", default="", help="comma list of engines not to run: tts_engine, c_engine, vox")
    p.add_argument("--profile-frames", type=int, default=12, help="frames of the per-part profile of each of our "
                   "precisions after every repeat (0: none)")
    p.add_argument("--note", default="", help="a sentence added to the docs entry (e.g. what else ran on the machine)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--results-dir", type=Path, default=ROOT / "docs" / "bench-results")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    a = p.parse_args(argv)
    a.skip = {s.strip().replace("-", "_") for s in a.skip.split(",") if s.strip()}
    a.frames = sorted(set(a.frames))
    t_start, load_start = time.perf_counter(), _loadavg()
    started = dt.datetime.now(dt.timezone.utc)
    torch.set_num_threads(a.threads)
    info = common.cpuinfo()
    key = common.machine_key(info)
    print(f"{key}; SIMD flags: {common.simd_flags(info)}; {a.threads} threads", file=sys.stderr)
    floor = PlainRead()
    for _ in range(3):
        floor.sample()
    print(floor.describe(), file=sys.stderr)

    ckpt = checkpoint(a.peers_dir)
    skipped, notes = [], []
    engines = setup_engines(a, ckpt, info, skipped, notes)
    for line in skipped:
        print(f"skipped: {line}", file=sys.stderr)
    runs, profiles = interleave(engines, a.frames, a.repeats, a.profile_frames, floor)

    # per-part split (least per part over the repeats' profiles) and weight bytes: ours measured, peers estimated
    parts, wbytes, counts, part_floors = {}, {}, None, {}
    for e in engines:
        if e.name != OURS:
            continue
        if profiles.get(e.precision):
            ps = profiles[e.precision]
            parts[(OURS, e.precision)] = (min(x["talker_ms"] for x in ps), min(x["code_predictor_ms"] for x in ps),
                                          min(x.get("sampling_and_host_ms", 0.0) for x in ps))
            part_floors[(OURS, e.precision)] = [(x["talker_ms"], x["code_predictor_ms"], x["plain_read"]["median"])
                                                for x in ps if "plain_read" in x]
        wbytes[(OURS, e.precision)] = weight_bytes(e.engine)
        counts = counts or weight_counts(e.engine)
        e.close()
    for e in engines:
        if counts and e.name != OURS:
            for prec in e.precisions:
                b = e.weight_bytes(counts, prec)
                if b:
                    wbytes[(e.name, prec)] = b
    for _ in range(3):
        floor.sample()
    bw = {"reader": floor.reader, "bytes": floor.nbytes, "threads": torch.get_num_threads(), **floor.spread(),
          "samples": [round(x, 2) for x in floor.samples]}
    print(floor.describe(), file=sys.stderr)
    floor.close()

    summaries = summarize(runs, parts, wbytes, part_floors, bw["median"])
    table = markdown(summaries, skipped, a.frames)
    minutes = (time.perf_counter() - t_start) / 60
    loads = [float(x) for x in [load_start, _loadavg(), *(r.extra.get("load_average") for r in runs)]
             if x not in (None, "?")]
    body = _doc_body(a, info, key, started, minutes, bw, notes, table, loads, argv)
    body = body.replace(str(ROOT) + "/", "").replace(str(Path.home()), "~")
    print("\n" + body)
    if not a.no_write:
        a.results_dir.mkdir(parents=True, exist_ok=True)
        stem = a.results_dir / f"cpu-peers-{_slug(key)}-{started:%Y%m%dT%H%M}"
        raw = {"machine": key, "cpu_flags": sorted(info["flags"]), "threads": a.threads, "frames": a.frames,
               "repeats": a.repeats, "started_utc": started.isoformat(), "minutes": round(minutes, 1),
               "bandwidth": bw, "notes": notes, "skipped": skipped, "runs": [r.to_dict() for r in runs],
               "our_profiles": profiles, "weight_bytes": {" / ".join(k): v for k, v in wbytes.items()},
               "ratios": [{"class": r.cls, "value": r.value, "median_value": r.median_value,
                           "ours": r.ours and r.ours.precision, "peer": r.peer and f"{r.peer.engine} {r.peer.precision}"}
                          for r in ratios(summaries)]}
        stem.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
        stem.with_suffix(".md").write_text(body + "\n")
        text = a.out.read_text(encoding="utf-8") if a.out.exists() else "# Benchmarks\n"
        a.out.write_text(update_doc(text, key, body), encoding="utf-8")
        print(f"\nwrote {a.out} ({SECTION[3:]}: {key}) and {stem}.{{json,md}}", file=sys.stderr)
    return 0


def _doc_body(a, info, key, started, minutes, bw, notes, table, loads, argv) -> str:
    args, skip_next = [], False
    for x in (argv if argv is not None else sys.argv[1:]):   # the command as run, less --peers and --note's text
        if skip_next or x == "--peers" or x.startswith("--note="):
            skip_next = False
            continue
        if x == "--note":
            skip_next = True
            continue
        args.append(x)
    cmd = shlex.join(["python", "-m", "bench.speed", "--peers", *args])
    shared = ""
    if loads:
        busy = max(loads) > 0.75 * (info["cpus"] or 1)
        shared = (f" 1-minute load average {min(loads):.1f}-{max(loads):.1f} during the run on {info['cpus']} CPUs"
                  + (": **the machine was shared** with other jobs, which the interleaving spreads over all engines."
                     if busy else "."))
    lines = [f"Measured {started:%Y-%m-%d %H:%M} UTC, {minutes:.0f} min for the whole run. CPU: {info['model']}, "
             f"family {info['family']} model {info['model_no']}, {info['cpus']} CPUs; SIMD flags: "
             f"{common.simd_flags(info)}. torch {torch.__version__}. **{a.threads} threads** per engine, one stream, "
             f"{' and '.join(map(str, a.frames))} frames, {a.repeats} interleaved repeats.{shared}"
             + (f" {a.note}" if a.note else ""),
             "",
             f"Command: `{cmd}`",
             "",
             f"Plain large memory read on this machine (`bench/common.py` PlainRead: {bw['bytes'] / 2**30:.0f} GiB, "
             f"{bw['reader']}, {bw['threads']} threads, {bw['n']} reads interleaved with the runs and the profiles' "
             f"frames): **median {bw['median']:.1f} GB/s** (min {bw['min']:.1f}, max {bw['max']:.1f}). A part's % of "
             "plain read compares it with the reads taken between the frames of its own profiles.",
             "",
             table,
             "",
             "Set-up: " + "; ".join(notes) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
