"""Timing rows of the side-by-side CPU benchmark -> one summary per engine and precision -> one markdown table
with our ratio to the best peer at each precision class. Pure (no timing, no engines): tested with fake rows.

A run is one synthesis at a fixed length: generation wall time (no model load), first audio, frames produced.
x real time = audio seconds / wall seconds (one frame = 80 ms of audio). Per (engine, precision, length) the
table shows the best run (the machine can only slow an engine down, never speed it up) and the median; ratios
compare best runs at the longest length, where the prompt's prefill weighs least.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field

FRAME_S = 0.08
OURS = "tts_engine"
CLASSES = ("16-bit", "8-bit", "4-bit")


def precision_class(precision: str) -> str:
    """Weight bits of a precision label: "bf16"/"fp16" -> "16-bit", "int8"/"q8"/"w8a8"/"Q8_0" -> "8-bit",
    "int4"/"q4"/"w4a8"/"Q4_0" -> "4-bit", "fp32" -> "32-bit"; anything else -> "other"."""
    p = precision.strip().lower()
    m = re.match(r"(?:bf|fp|f)(\d+)", p) or re.search(r"(?:int|uint|w|q)(\d+)", p)
    if not m:
        return "other"
    bits = int(m.group(1))
    return {32: "32-bit", 16: "16-bit", 8: "8-bit", 4: "4-bit"}.get(bits, "other")


@dataclass
class Run:
    """One timed synthesis. wall_s: generation only (no load); frames: produced (may fall short of requested
    when a peer stops at end-of-speech); talker_ms / cp_ms: per frame, where the engine reports its split."""
    engine: str
    precision: str
    frames_requested: int
    frames: float = 0.0
    wall_s: float = 0.0
    first_audio_s: float | None = None
    talker_ms: float | None = None
    cp_ms: float | None = None
    rep: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.frames > 0 and self.wall_s > 0

    @property
    def x_real_time(self) -> float | None:
        return self.frames * FRAME_S / self.wall_s if self.ok else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["x_real_time"] = self.x_real_time
        return d


@dataclass
class Summary:
    engine: str
    precision: str
    cls: str
    best: dict            # frames requested -> best x real time
    median: dict          # frames requested -> median x real time
    n: dict               # frames requested -> good runs
    short: dict           # frames requested -> fewest frames produced when below the request, else absent
    failed: int
    first_audio_s: float | None    # median over every good run
    talker_ms: float | None = None  # least over the runs
    cp_ms: float | None = None
    other_ms: float | None = None   # ours: the rest of the frame (sampling, host work), from the profile
    talker_gbs: float | None = None
    cp_gbs: float | None = None
    talker_pct: float | None = None  # % of the plain read taken beside the part (common.PlainRead)
    cp_pct: float | None = None
    errors: list = field(default_factory=list)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _least(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def summarize(runs: list[Run], parts: dict | None = None, weight_bytes: dict | None = None,
              part_floors: dict | None = None, read_floor: float | None = None) -> list[Summary]:
    """One Summary per (engine, precision), in the order first seen. Talker / code predictor ms per frame: the
    least over the runs (like x real time, the best the machine allowed); parts: {(engine, precision): (talker_ms,
    cp_ms[, other_ms])} from a separate profile (ours: `speed.profile_frame`, each part timed alone with nothing beside
    it; other_ms: the rest of that frame, sampling and host work), used where the runs carry no split; weight_bytes: {(engine, precision):
    (talker bytes, code predictor bytes) read per frame} -> effective GB/s = bytes / time.
    % of the plain read (common.PlainRead): part_floors {(engine, precision): [(talker_ms, cp_ms, plain read GB/s median)
    per profile]}, each profile's parts against the reads taken between its frames, the median over the profiles;
    else (the peers: no profile of ours beside them) the part's GB/s against `read_floor`, the run's median read."""
    parts, weight_bytes, part_floors = parts or {}, weight_bytes or {}, part_floors or {}
    keys: list[tuple[str, str]] = []
    for r in runs:
        if (r.engine, r.precision) not in keys:
            keys.append((r.engine, r.precision))
    out = []
    for key in keys:
        rs = [r for r in runs if (r.engine, r.precision) == key]
        good = [r for r in rs if r.ok]
        best, med, n, short = {}, {}, {}, {}
        for f in sorted({r.frames_requested for r in rs}):
            xs = [r.x_real_time for r in good if r.frames_requested == f]
            n[f] = len(xs)
            if xs:
                best[f], med[f] = max(xs), statistics.median(xs)
            fewest = min((r.frames for r in good if r.frames_requested == f), default=f)
            if fewest < f - 0.5:
                short[f] = fewest
        talker, cp = _least(r.talker_ms for r in good), _least(r.cp_ms for r in good)
        other = None
        if talker is None and cp is None and key in parts:
            talker, cp = parts[key][:2]
            other = parts[key][2] if len(parts[key]) > 2 else None
        s = Summary(engine=key[0], precision=key[1], cls=precision_class(key[1]), best=best, median=med, n=n,
                    short=short, failed=len(rs) - len(good), first_audio_s=_median(r.first_audio_s for r in good),
                    talker_ms=talker, cp_ms=cp, other_ms=other, errors=sorted({r.error for r in rs if r.error}))
        if key in weight_bytes:
            tb, cb = weight_bytes[key]
            s.talker_gbs = tb / (talker * 1e6) if talker else None      # bytes / (ms * 1e-3) / 1e9
            s.cp_gbs = cb / (cp * 1e6) if cp else None
            if part_floors.get(key):
                s.talker_pct = _median(100 * tb / (t * 1e6) / f for t, _, f in part_floors[key] if t and f)
                s.cp_pct = _median(100 * cb / (c * 1e6) / f for _, c, f in part_floors[key] if c and f)
            elif read_floor:
                s.talker_pct = 100 * s.talker_gbs / read_floor if s.talker_gbs else None
                s.cp_pct = 100 * s.cp_gbs / read_floor if s.cp_gbs else None
        out.append(s)
    return out


@dataclass
class Ratio:
    cls: str                          # a precision class or "overall"
    ours: Summary | None
    peer: Summary | None
    frames: int

    @property
    def value(self) -> float | None:
        if self.ours is None or self.peer is None:
            return None
        a, b = self.ours.best.get(self.frames), self.peer.best.get(self.frames)
        return a / b if a and b else None

    @property
    def median_value(self) -> float | None:
        if self.ours is None or self.peer is None:
            return None
        a, b = self.ours.median.get(self.frames), self.peer.median.get(self.frames)
        return a / b if a and b else None


def _fastest(rows: list[Summary], frames: int) -> Summary | None:
    rows = [s for s in rows if s.best.get(frames)]
    return max(rows, key=lambda s: s.best[frames]) if rows else None


def ratios(summaries: list[Summary], frames: int | None = None) -> list[Ratio]:
    """Our fastest precision in each class against the fastest peer precision in that class, then our fastest
    overall against the peers' fastest overall; all at `frames` (default: the longest length measured)."""
    if frames is None:
        frames = max((f for s in summaries for f in s.best), default=0)
    ours = [s for s in summaries if s.engine == OURS]
    peers = [s for s in summaries if s.engine != OURS]
    out = [Ratio(c, _fastest([s for s in ours if s.cls == c], frames), _fastest([s for s in peers if s.cls == c], frames),
                 frames) for c in CLASSES]
    out.append(Ratio("overall", _fastest(ours, frames), _fastest(peers, frames), frames))
    return out


def _f(v, nd=2, unit=""):
    return "–" if v is None else f"{v:.{nd}f}{unit}"


def _label(s: Summary | None, frames: int) -> str:
    if s is None:
        return "none measured"
    return f"{s.engine} {s.precision} ({_f(s.best.get(frames))}x)"


def markdown(summaries: list[Summary], skipped: list[str], lengths: list[int]) -> str:
    """The results table, the ratio table and one line per skipped peer."""
    head = ["engine", "precision", "class"]
    head += [f"x real time, {f} frames: best (median, runs)" for f in lengths]
    head += ["first audio s (median)", "talker / code predictor (/ rest of our frame) ms per frame",
             "weights read GB/s talker / code predictor", "% of plain read talker / code predictor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        cells = [s.engine, s.precision, s.cls]
        for f in lengths:
            if s.best.get(f) is None:
                cells.append("failed" if s.failed else "–")
                continue
            c = f"**{s.best[f]:.2f}** ({s.median[f]:.2f}, {s.n[f]})"
            if f in s.short:
                c += f", only {s.short[f]:g} frames"
            cells.append(c)
        cells.append(_f(s.first_audio_s))
        cells.append((f"{_f(s.talker_ms, 0)} / {_f(s.cp_ms, 0)}" + (f" / {_f(s.other_ms, 1)}" if s.other_ms is not None
                                                                     else "")) if (s.talker_ms or s.cp_ms) else "–")
        cells.append(f"{_f(s.talker_gbs, 1)} / {_f(s.cp_gbs, 1)}" if (s.talker_gbs or s.cp_gbs) else "–")
        cells.append(f"{_f(s.talker_pct, 0)} / {_f(s.cp_pct, 0)}" if (s.talker_pct or s.cp_pct) else "–")
        lines.append("| " + " | ".join(cells) + " |")
    rs = ratios(summaries)
    f = rs[0].frames if rs else 0
    lines += ["", f"Our ratio to the best peer ({f} frames, best runs; median runs in brackets; > 1 = we are faster):",
              "", "| class | ours (fastest) | best peer | ratio |", "|---|---|---|---|"]
    for r in rs:
        val = "–" if r.value is None else f"**{r.value:.2f}** ({_f(r.median_value)})"
        lines.append(f"| {r.cls} | {_label(r.ours, f)} | {_label(r.peer, f)} | {val} |")
    failed = [s for s in summaries if s.failed]
    if failed or skipped:
        lines.append("")
    for s in failed:
        lines.append(f"- {s.engine} {s.precision}: {s.failed} run(s) failed: {'; '.join(s.errors)[:300]}")
    for line in skipped:
        lines.append(f"- skipped: {line}")
    return "\n".join(lines)
