"""One mechanism for every measured choice of a fast path: time the candidates, check they agree with the readable
reference, keep the fastest, remember it, fall back with one log line (`MeasuredChoice`), and a record of what was
chosen, how and why (`Record`) that `TTSEngine.paths()` lists.

How a choice comes (`Record.how`):
  "measured now"        timed here and now (and remembered);
  "remembered"          measured on an earlier start of this machine: read from the cache folder;
  "default"             nothing to measure (the path cannot run here, tuning is off, or a default that is not timed),
                        or, at a fresh bounded start, the path expected to win, checked against the reference, while
                        its timing waits for an idle moment ("... measurement pending": `serve_until_measured`);
  "forced by TTS_X"     the environment variable that forces it (0/off/no/false: the reference, 1/on/yes/true: the
                        fast path; anything else, or unset: auto);
  "fell back"           the fast path failed (a build error, a refused input, an exception, results that disagree
                        with the reference): the reference serves from then on, after one log line;
  "measuring"           its trial is under way.

Remembered choices are small JSON files in the cache folder (`cache_paths.choices_root()/<folder>/`; on a Space with
persistent storage under /data): {"key", "choice", "why"}, one per key (machine, code version, model shape), so a later
start reads the answer instead of timing again. A file written for another key, naming a choice no longer offered, or
damaged, is ignored.

Records live where the choice is made: a per-engine choice (the fused step of an engine's stacks, its predictor
frame, its talker step) on the object that serves it, which the engine's model runner lists (`ModelRunner.path_entries`);
a machine-wide one (the codec decoder's dtype, its int8 threshold, the matmul share, quantize=auto, the kernel table)
in this process's list (`note`, `made`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tts_engine.cache_paths import choices_root
from tts_engine.cpu import deferred_trials

log = logging.getLogger("tts_engine")

MEASURED, REMEMBERED, DEFAULT, FELL_BACK, MEASURING = "measured now", "remembered", "default", "fell back", "measuring"
PENDING = "measurement pending (timed while idle)"   # the end of a default's reason while its deferred trial waits


def forced_by(env: str) -> str:
    return f"forced by {env}"


@dataclass(frozen=True)
class Record:
    """What serves (`path`: one of the choice's candidates, or a word such as "eager"), how that came (module doc)
    and why (one line: the times, the variable, the error)."""
    path: str
    how: str
    why: str = ""

    def entry(self) -> dict[str, str]:
        """{"path", "how", "why"}: one entry of `TTSEngine.paths()`."""
        return {"path": self.path, "how": self.how, "why": self.why}


def entry_of(x) -> dict[str, str]:
    """`TTSEngine.paths()`'s entry of a Record, a MeasuredChoice (anything with `.entry()`) or a dict of the same
    three keys (a backend's own entries)."""
    if hasattr(x, "entry"):
        return x.entry()
    return {"path": str(x.get("path", "")), "how": str(x.get("how", "")), "why": str(x.get("why", ""))}


def describe(entry: dict) -> str:
    """One `TTSEngine.paths()` entry as one line for logs and benchmarks: "fused (measured now: fused by median: ...)"."""
    e = entry_of(entry)
    detail = ": ".join(x for x in (e["how"], e["why"]) if x)
    return f"{e['path']} ({detail})" if detail else e["path"]


def one_line(why: str, limit: int = 200) -> str:
    return str(why).splitlines()[0][:limit] if why else ""


# --- the process's machine-wide choices --------------------------------------------------------------------------------
_made: dict[str, Record] = {}
_made_lock = threading.Lock()


def note(name: str, path: str, how: str, why: str = "") -> Record:
    """Record that this process uses `path` for the machine-wide choice `name` (module doc) -> the record."""
    rec = Record(str(path), how, one_line(why, 300))
    with _made_lock:
        _made[name] = rec
    return rec


def made() -> dict[str, dict[str, str]]:
    """{name: {"path", "how", "why"}} of every machine-wide choice this process made, in the order they were made
    (the app's footer; `TTSEngine.paths()` adds them to an engine's own parts)."""
    with _made_lock:
        return {k: r.entry() for k, r in _made.items()}


# --- the switch and the remembered files -----------------------------------------------------------------------------
def setting(env: str) -> str:
    """"auto" (measure, or use what was measured before), "on" or "off": the environment variable `env` that forces a
    measured choice (0/off/no/false, 1/on/yes/true; anything else is auto)."""
    v = os.environ.get(env, "auto").strip().lower()
    if v in ("0", "off", "no", "false"):
        return "off"
    if v in ("1", "on", "yes", "true"):
        return "on"
    return "auto"


def path_for(folder: str, key: dict, prefix: str = "") -> Path:
    """The file of `key` (a JSON-able dict): <cache>/<folder>/<prefix><16 hex digits of its sha1>.json."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return choices_root() / folder / f"{prefix}{digest}.json"


def recall(path: Path, key: dict, choices: tuple[str, ...]) -> dict | None:
    """{"choice": one of `choices`, "why": ...} remembered for exactly `key` at `path`, else None (no file, another
    key, an unknown choice or a damaged file)."""
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("key") != key or got.get("choice") not in choices:
        return None
    return {"choice": got["choice"], "why": str(got.get("why", ""))}


def remember(path: Path, key: dict, choice: str, why: str) -> None:
    """Write the choice for `key` to `path` (whole or not at all: a temporary file renamed); a folder that cannot be
    written costs one log line, never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "choice": choice, "why": why}, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        log.info("choice not saved to %s: %s", path, err)


# --- the choice -------------------------------------------------------------------------------------------------------
class MeasuredChoice:
    """A choice between `candidates` (the reference first: the readable path every other is checked against, and what
    serves after a failure). Its owner runs the trial, the way its path needs it (both paths on the same input, the
    order alternating), through `time`, checks agreement itself and calls `decide` (the fastest by median wins; a
    tie goes to the reference), or `fall_back` when a candidate disagrees or fails. `chosen` is None while the trial
    runs; `record` says what serves, how and why.

    env: the variable that forces it (`setting`; the owner calls `force` with the candidate it names).
    key, folder, prefix: where the answer is remembered (`path_for`; no key: never remembered, e.g. when forced).
    process: a machine-wide choice, also listed in this process's `made()`.
    label, fallback: the log lines' words ("fused talker step", "eager")."""

    def __init__(self, name: str, candidates: tuple[str, ...], *, env: str | None = None, key: dict | None = None,
                 folder: str | None = None, prefix: str = "", label: str | None = None, fallback: str | None = None,
                 process: bool = False):
        if len(candidates) < 1:
            raise ValueError("a measured choice needs candidates")
        self.name, self.candidates, self.reference = name, tuple(candidates), candidates[0]
        self.env, self.key, self.folder, self.prefix = env, key, folder, prefix
        self.label, self.fallback = label or name, fallback or candidates[0]
        self.process = process
        self.times: dict[str, list[float]] = {c: [] for c in self.candidates}
        self.chosen: str | None = None
        self.record = Record(self.reference, MEASURING, "its trial is under way")

    # --- how it came ---------------------------------------------------------------------------------------------
    def mode(self) -> str:
        """"auto", "on" or "off" as `env` says ("auto" without one)."""
        return setting(self.env) if self.env else "auto"

    @property
    def file(self) -> Path | None:
        """Where the answer is remembered (None: not remembered)."""
        if self.key is None or self.folder is None:
            return None
        return path_for(self.folder, self.key, self.prefix)

    def entry(self) -> dict[str, str]:
        return self.record.entry()

    def _set(self, chosen: str, how: str, why: str) -> None:
        self.chosen = chosen
        self.record = Record(chosen, how, one_line(why, 300))
        if self.process:
            with _made_lock:
                _made[self.name] = self.record

    def force(self, candidate: str, why: str | None = None) -> None:
        """Serve `candidate` without timing: the variable forces it."""
        if candidate not in self.candidates:
            raise ValueError(f"{candidate!r} is not one of {self.candidates}")
        how = forced_by(self.env) if self.env else DEFAULT
        self._set(candidate, how, why if why is not None else
                  f"{self.env}={os.environ.get(self.env, '')}" if self.env else "")

    def default(self, candidate: str, why: str) -> None:
        """Serve `candidate` without timing, for `why` (nothing to measure)."""
        self._set(candidate, DEFAULT, why)

    def serve_until_measured(self, candidate: str, why: str) -> None:
        """Serve `candidate` (the path expected to win, already checked against the reference: `why` says how) as the
        default while its timing is deferred to an idle moment (`deferred_trials`); the record says so."""
        self.default(candidate, f"{why}; {PENDING}")
        log.info("tts_engine: %s: %s serves until it is timed while idle (%s; %s=all times it at load)", self.label,
                 candidate, why, deferred_trials.ENV)

    def twin(self) -> "MeasuredChoice":
        """A choice between the same candidates that remembers nothing and serves nothing: the timings and verdict of
        a deferred trial, taken over by this one once applied (`take`)."""
        return MeasuredChoice(self.name, self.candidates, label=self.label, fallback=self.fallback)

    def take(self, twin: "MeasuredChoice") -> bool:
        """Serve what `twin` (this choice's deferred trial) decided: its candidate and record, or the reference where
        it fell back; nothing where this one fell back meanwhile (the first failure stands) or twin decided
        nothing -> whether anything changed."""
        if self.record.how == FELL_BACK or twin.chosen is None:
            return False
        self.times.clear()
        self.times.update(twin.times)   # (in place: owners keep a reference to it)
        self._set(twin.chosen, twin.record.how, twin.record.why)   # (a fallback: the reference; twin logged it)
        return True

    def remember_verdict(self, twin: "MeasuredChoice") -> None:
        """Remember under this choice's key what `twin` measured (a fallback is not remembered, as in `trial`)."""
        f = self.file
        if f is not None and twin.chosen is not None and twin.record.how == MEASURED:
            remember(f, self.key, twin.chosen, twin.record.why)

    def deferred(self, trial) -> "MeasuredChoice":
        """A timed trial while idle (`deferred_trials`, the trials' thread) into a twin of this choice: trial(twin)
        times the candidates into it and decides; a request's `deferred_trials.Interrupted` passes through, any
        other exception makes the twin fall back -> the twin."""
        twin = self.twin()
        try:
            trial(twin)
        except deferred_trials.Interrupted:
            raise
        except Exception as e:   # noqa: BLE001 - a failing trial falls back, never an outage
            twin.fall_back(f"{type(e).__name__}: {e}")
        return twin

    def applier(self, twin: "MeasuredChoice", then=None):
        """Remember what `twin` (a deferred trial) measured -> a function that serves it (`take`, run at a frame
        boundary with no row held) and then calls then() where that changed what serves; it returns whether it did."""
        self.remember_verdict(twin)

        def apply() -> bool:
            changed = self.take(twin)
            if changed and then is not None:
                then()
            return changed
        return apply

    def recall(self) -> bool:
        """Take the answer measured before for this key, if any -> whether there was one."""
        f = self.file
        got = recall(f, self.key, self.candidates) if f is not None else None
        if got is None:
            return False
        self._set(got["choice"], REMEMBERED, got["why"])
        return True

    # --- the trial ---------------------------------------------------------------------------------------------------
    def time(self, candidate: str, fn, *args, **kw):
        """fn(*args, **kw), its wall time added to `candidate`'s."""
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.times[candidate].append(time.perf_counter() - t0)
        return out

    def trial(self, run: dict, rounds: int, inputs=lambda i: (), check=None) -> bool:
        """The usual trial: `rounds` rounds, each running every candidate of `run` ({candidate: fn(*args)}, the
        reference among them) once on the same input, args = inputs(round), the order rotating from round to round,
        each call timed (`time`). check(reference's result, candidate's result) -> None where they agree, else why
        not: a candidate that disagrees or raises is left out (`drop`); when only the reference is left, or the
        reference itself raised, it falls back (`fall_back`: one log line) -> True when candidates beside the
        reference are left to `decide` between."""
        names = [self.reference] + [c for c in run if c != self.reference]
        for i in range(rounds):
            deferred_trials.check()   # (a deferred trial: a request stops it here, between two rounds)
            args = inputs(i)
            order = names[i % len(names):] + names[:i % len(names)]
            got = {}
            for c in order:
                try:
                    got[c] = self.time(c, run[c], *args)
                except Exception as e:   # noqa: BLE001 - a failing path is left out, never an outage
                    if c == self.reference:
                        self.fall_back(f"{type(e).__name__}: {e}")
                        return False
                    got[c] = e
            for c in names[1:]:
                out = got[c]
                why = f"{type(out).__name__}: {out}" if isinstance(out, Exception) else \
                    check(got[self.reference], out) if check is not None else None
                if why:
                    names.remove(c)
                    if len(names) == 1:
                        self.fall_back(why)
                        return False
                    self.drop(c, why)
        return True

    def drop(self, candidate: str, why: str) -> None:
        """Leave `candidate` out of this trial (it disagreed with another one): one log line."""
        if self.times.pop(candidate, None) is not None:
            log.warning("tts_engine: %s: %s not used: %s", self.label, candidate, why)

    def medians(self, min_samples: int = 1) -> dict[str, float]:
        """{candidate: median seconds} of the candidates timed at least `min_samples` times, the reference first."""
        return {c: statistics.median(v) for c, v in self.times.items() if v and len(v) >= max(1, min_samples)}

    def decide(self, min_samples: int = 1, names: dict | None = None, note: str = "") -> str:
        """The fastest timed candidate by median serves from now on (a tie: the one named first, the reference), with
        one log line, remembered under the key. names: how the reason names a candidate; note: added to it."""
        med = self.medians(min_samples)
        if not med:
            self.fall_back("nothing was timed")
            return self.reference
        best = min(med, key=med.get)
        names = names or {}
        why = f"{best} by median: " + ", ".join(f"{names.get(c, c)} {1e3 * t:.2f} ms" for c, t in med.items())
        if note:
            why += f", {note}"
        self._set(best, MEASURED, why)
        log.info("tts_engine: %s: %s (%s)", self.label, best, why)
        f = self.file
        if f is not None:
            remember(f, self.key, best, why)
        return best

    def settle(self, candidate: str, why: str) -> None:
        """Serve `candidate`, chosen by its owner's own check rather than by timing (a fast path taken wherever it
        agrees with the reference): recorded as measured now and remembered under the key."""
        if candidate not in self.candidates:
            raise ValueError(f"{candidate!r} is not one of {self.candidates}")
        self._set(candidate, MEASURED, why)
        f = self.file
        if f is not None:
            remember(f, self.key, candidate, self.record.why)

    def fall_back(self, why: str, remember_it: bool = False) -> None:
        """The reference serves from now on, with one log line; a later call changes nothing (the first reason
        stays). remember_it: also remembered under the key (a disagreement that the same key would repeat), so a
        later start serves the reference without trying again."""
        if self.record.how == FELL_BACK:
            return
        self._set(self.reference, FELL_BACK, why)
        log.warning("tts_engine: %s not used, %s from now on: %s", self.label, self.fallback, self.record.why)
        f = self.file
        if remember_it and f is not None:
            remember(f, self.key, self.reference, self.record.why)

    @property
    def measuring(self) -> bool:
        return self.chosen is None
