"""The take guard: every take (one engine request's audio) checked against its text, for the page and the API
(docs/text-and-takes.md).

- Length: a take may run at most `frame_bound(text)` frames (2 s + 2.5x the text's expected duration, at least
  `MIN_BOUND_S`), passed to the engine as the request's `max_new_tokens`, so a runaway generation (no end of speech,
  endless repeats) ends there and frees its engine row instead of running to the frame limit; a take that reaches
  the bound is flagged "runaway". One far shorter than its text (stray syllables, an early end) is flagged "too
  short". A take that reaches a lower maximum the user set is not judged on length (the user asked for that cut).
- Transcript (optional): with a transcriber, the take's words against the text the model read, as a character error
  rate (jiwer); above `max_cer` the take fails.

`TakeGuard.stream(submit, text, ...)` runs a text's takes: a failed take is redone with another seed up to
`retries` times (the iteration yields `Redo` between takes, so a caller that keeps the audio drops the failed one),
or, with `best_of` > 1, renders that many takes at once and yields only the one with the lowest error.
The transcriber is a documented parameter: any object with `transcribe(wav, sr, language)` returning a string or
something with `.text` (tts_engine.asr.Transcriber does), or such a function; `TakeGuard.from_env()` uses the
server's Whisper when `TTS_TAKE_ASR=1`."""
from __future__ import annotations

import logging
import math
import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from tts_engine import TTSError

log = logging.getLogger("tts_server")

SR = 24000
FRAME_HZ = 12.5
SAMPLES_PER_FRAME = int(SR / FRAME_HZ)
MIN_BOUND_S = 4.0            # the shortest bound: one word may take a breath and a second
BOUND_FACTOR = 2.5           # x the expected duration (slow speaking styles stay inside), plus BOUND_PAD_S
BOUND_PAD_S = 2.0
TOO_SHORT = 0.2              # under this share of the expected duration (texts expected to last 2 s or more)
MAX_CER = 0.4                # a transcript further from the text than this fails the take
MAX_RETRIES = 5
MAX_BEST_OF = 5
RETRIES_ENV, ASR_ENV = "TTS_TAKE_RETRIES", "TTS_TAKE_ASR"


def expected_seconds(text: str) -> float:
    """A rough duration of `text` spoken: ~14 characters a second for alphabetic scripts, ~4.5 for CJK."""
    cjk = sum(1 for ch in text if "\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af")
    return (len(text) - cjk) / 14.0 + cjk / 4.5


def frame_bound(text: str, limit: int | None = None) -> int:
    """The most frames a take of `text` may run (see the module's docstring), at most `limit`."""
    s = max(MIN_BOUND_S, BOUND_PAD_S + BOUND_FACTOR * expected_seconds(text))
    frames = int(math.ceil(s * FRAME_HZ))
    return min(frames, int(limit)) if limit else frames


def _normalise(s: str) -> str:
    s = unicodedata.normalize("NFKC", s).casefold()
    s = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in s)
    return re.sub(r"\s+", " ", s).strip()


def char_error_rate(reference: str, hypothesis: str) -> float:
    """Character error rate of `hypothesis` against `reference`, case and punctuation ignored (jiwer)."""
    import jiwer

    ref, hyp = _normalise(reference), _normalise(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    if not hyp:
        return 1.0
    return float(jiwer.cer(ref, hyp))


@dataclass
class TakeCheck:
    """One take's check. `problem`: "" (passed), "runaway", "too short" or "transcript"."""
    seed: int
    seconds: float
    expected_s: float
    frames: int
    bound: int
    problem: str = ""
    capped: bool = False            # reached a maximum the user set (not judged on length)
    cer: float | None = None
    transcript: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problem

    @property
    def score(self) -> float:
        """Lower is better: the transcript's error where there is one, else how far the length is from the
        expected one; a failed take ranks after every passing one."""
        s = self.cer if self.cer is not None else abs(math.log((self.seconds + 0.1) / (self.expected_s + 0.1)))
        return s + (10.0 if self.problem else 0.0)

    def describe(self) -> str:
        if self.problem == "runaway":
            what = f"runaway, cut at {self.seconds:.1f} s (bound {self.bound / FRAME_HZ:.1f} s)"
        elif self.problem == "too short":
            what = f"too short: {self.seconds:.1f} s for ~{self.expected_s:.1f} s of text"
        elif self.problem == "transcript":
            what = f"transcript off (CER {self.cer:.2f})"
        else:
            what = "ok"
        if self.ok and self.cer is not None:
            what += f" (CER {self.cer:.2f})"
        if self.capped:
            what += " (reached the maximum length)"
        return what

    def header(self) -> str:
        parts = ["pass" if self.ok else f"fail={self.problem.replace(' ', '-')}", f"seed={self.seed}",
                 f"seconds={self.seconds:.2f}", f"expected={self.expected_s:.2f}", f"bound_frames={self.bound}"]
        if self.cer is not None:
            parts.append(f"cer={self.cer:.3f}")
        if self.capped:
            parts.append("capped")
        return ",".join(parts)


@dataclass
class Redo:
    """Yielded between a failed take and the next one: drop the failed take's audio."""
    failed: TakeCheck
    next_seed: int


class TakeGuard:
    """How takes are checked and redone. `retries`: takes redone after a failure (0: checked and flagged only);
    `best_of`: takes rendered at once per text, the lowest error kept (1: off); `transcriber`: see the module's
    docstring (None: length checks only); `enabled`: False turns the guard off (no bound, no checks)."""

    def __init__(self, retries: int = 2, best_of: int = 1, transcriber=None, max_cer: float = MAX_CER,
                 enabled: bool = True):
        if not 0 <= int(retries) <= MAX_RETRIES:
            raise TTSError(f"the take retries must be between 0 and {MAX_RETRIES}, got {retries}")
        if not 1 <= int(best_of) <= MAX_BEST_OF:
            raise TTSError(f"best of N takes: N must be between 1 and {MAX_BEST_OF}, got {best_of}")
        self.retries, self.best_of, self.transcriber = int(retries), int(best_of), transcriber
        self.max_cer, self.enabled = float(max_cer), bool(enabled)

    @classmethod
    def from_env(cls, transcriber=None) -> "TakeGuard":
        """`TTS_TAKE_RETRIES` (default 2) and `TTS_TAKE_ASR=1` (the server's Whisper checks transcripts)."""
        try:
            retries = int(os.environ.get(RETRIES_ENV, "2"))
        except ValueError:
            log.warning("%s is not a whole number; using 2", RETRIES_ENV)
            retries = 2
        if transcriber is None and os.environ.get(ASR_ENV, "") == "1":
            from tts_engine import asr
            transcriber = asr.shared()
        return cls(retries=max(0, min(MAX_RETRIES, retries)), transcriber=transcriber)

    def with_options(self, retries=None, best_of=None, enabled=None) -> "TakeGuard":
        """This guard with a request's own choices (None: keep this guard's)."""
        return TakeGuard(self.retries if retries is None else retries, self.best_of if best_of is None else best_of,
                         self.transcriber, self.max_cer, self.enabled if enabled is None else enabled)

    # --- one take ---------------------------------------------------------------------------------------------
    def bound(self, text: str, limit: int) -> int:
        return frame_bound(text, limit) if self.enabled else int(limit)

    def check(self, audio: np.ndarray, text: str, seed: int, limit: int, frames: int | None = None,
              language: str | None = None) -> TakeCheck:
        """Check a finished take: `audio` (float or int16 mono, 24 kHz) of `text` (what the model read), made with
        `seed` under the request's maximum `limit` (frames); `frames`: the frames generated (else from the audio)."""
        seconds = len(audio) / SR
        frames = int(frames if frames is not None else round(len(audio) / SAMPLES_PER_FRAME))
        bound, expected = self.bound(text, limit), expected_seconds(text)
        c = TakeCheck(seed=seed, seconds=seconds, expected_s=expected, frames=frames, bound=bound)
        if frames >= bound - 1:     # the engine completes at most max_new_tokens - 1 frames (the last id ends it)
            if bound < int(limit):
                c.problem = "runaway"
            else:
                c.capped = True
        elif expected >= 2.0 and seconds < TOO_SHORT * expected:
            c.problem = "too short"
        if self.transcriber is not None and not c.problem and len(audio):
            c.transcript = self._transcribe(audio, language)
            c.cer = char_error_rate(text, c.transcript)
            if c.cer > self.max_cer:
                c.problem = "transcript"
        return c

    def _transcribe(self, audio: np.ndarray, language: str | None) -> str:
        wav = np.asarray(audio)
        wav = wav.astype(np.float32) / 32767.0 if wav.dtype == np.int16 else wav.astype(np.float32)
        t = self.transcriber
        fn = getattr(t, "transcribe", t)
        try:
            out = fn(wav, SR, language if language and language != "auto" else None)
        except TTSError as e:           # no speech-recognition model here: length checks only
            log.warning("take check without a transcript: %s", e)
            return ""
        return str(getattr(out, "text", out) or "")

    @staticmethod
    def next_seed(seed: int, k: int) -> int:
        """The seed of the k-th take after the one made with `seed` (reproducible: the same seed redoes the same)."""
        return (int(seed) + 1_000_003 * k) % 2**31

    # --- a text's takes -----------------------------------------------------------------------------------------
    def stream(self, submit: Callable[[int, int], object], text: str, seed: int, limit: int,
               language: str | None = None) -> "GuardedTakes":
        """The takes of `text`: `submit(seed, max_new_tokens)` starts one engine request (a TTSStream) -> an
        iterable of float32 chunks, with `Redo` markers between a failed take and its redo."""
        return GuardedTakes(self, submit, text, seed, limit, language)


class GuardedTakes:
    """Iterate for a text's audio chunks as `TakeGuard.stream` describes; `.checks`: every take's `TakeCheck`,
    `.kept`: the kept one's; `.cancel()`, `.position` and `.seed` as a TTSStream's (what the caller tracks)."""

    def __init__(self, guard: TakeGuard, submit, text: str, seed: int, limit: int, language: str | None):
        self.guard, self.submit, self.text, self.seed, self.limit = guard, submit, text, int(seed), int(limit)
        self.language = language
        self.checks: list[TakeCheck] = []
        self.kept: TakeCheck | None = None
        self._live: list = []
        self._cancelled = False
        self._it: Iterator | None = None
        # the first take is submitted now, as a plain engine request would be (errors and queue position at once)
        n = guard.best_of if guard.enabled else 1
        self._first = [self._submit(self.guard.next_seed(self.seed, k)) for k in range(n)]

    def _submit(self, seed: int):
        s = self.submit(seed, self.guard.bound(self.text, self.limit))
        self._live.append(s)
        return s

    @property
    def position(self):
        return getattr(self._live[-1], "position", None) if self._live else None

    def cancel(self) -> None:
        self._cancelled = True
        for s in self._live:
            s.cancel()

    close = cancel

    def __iter__(self):
        if self._it is None:
            self._it = self._run()
        return self._it

    def __next__(self):
        return next(iter(self))

    def _frames(self, stream, samples: int) -> int:
        codes = getattr(stream, "codes", None)
        return int(codes.shape[0]) if codes is not None and hasattr(codes, "shape") else \
            int(round(samples / SAMPLES_PER_FRAME))

    def _finish(self, stream, chunks: list, seed: int) -> TakeCheck:
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        c = self.guard.check(audio, self.text, seed, self.limit, self._frames(stream, len(audio)), self.language)
        self.checks.append(c)
        return c

    def _run(self):
        if not self.guard.enabled:
            self.kept = None
            yield from self._first[0]
            return
        if self.guard.best_of > 1:
            yield from self._best()
            return
        stream, seed = self._first[0], self.seed
        for k in range(self.guard.retries + 1):
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                yield chunk
            if self._cancelled:
                return
            check = self._finish(stream, chunks, seed)
            self.kept = check
            if check.ok or k == self.guard.retries:
                return
            seed = self.guard.next_seed(self.seed, k + 1)
            yield Redo(check, seed)
            stream = self._submit(seed)

    def _best(self):
        takes = []
        for k, stream in enumerate(self._first):      # they ran batched; read them in order
            chunks = list(stream)
            if self._cancelled:
                return
            takes.append((self._finish(stream, chunks, self.guard.next_seed(self.seed, k)), chunks))
        check, chunks = min(takes, key=lambda t: t[0].score)
        self.kept = check
        yield from chunks

    def summary(self) -> str:
        """For the status line: what the guard did with this text's takes ("" when the first take passed alone)."""
        if not self.checks:
            return ""
        if self.guard.best_of > 1:
            k = self.checks.index(self.kept) + 1
            return f"best of {len(self.checks)}: kept take {k} (seed {self.kept.seed}, {self.kept.describe()})"
        if len(self.checks) == 1:
            c = self.checks[0]
            return "" if c.ok and not c.capped else f"take check: {c.describe()}"
        tries = "; ".join(f"take {i + 1} (seed {c.seed}): {c.describe()}" for i, c in enumerate(self.checks))
        verdict = "redone" if self.kept.ok else f"still failing after {len(self.checks)} takes"
        return f"{verdict}: {tries}"

    def header(self) -> str:
        """The X-Take-Check value of this text: the kept take's check, and how many takes were made."""
        if not self.guard.enabled:
            return "off"
        if self.kept is None:
            return "not checked"
        return f"{self.kept.header()},takes={len(self.checks)}"


class SpokenTakes:
    """A prepared text (serving/text_prep.py `Prepared`) as one stream of float32 chunks, for the speech API: each
    segment's guarded takes, the pause tags as zeros (exactly their length), the next segment submitted as soon as
    the current one sounds. `streaming`: the audio goes out as it is made, so a failed take cannot be taken back:
    takes are checked and a runaway cut at its bound, but not redone (best of N still works: it yields the kept
    take only). Otherwise each segment's kept take alone is yielded. `submit(text, seed, max_new_tokens)` starts an
    engine request. `.seed`, `.cancel()` as a TTSStream's; `.header()`: the X-Take-Check value."""

    def __init__(self, prepared, submit, guard: TakeGuard, seed: int, limit: int, language: str | None = None,
                 streaming: bool = False):
        if streaming:
            guard = guard.with_options(retries=0)
        self.prepared, self.guard, self.seed, self.limit, self.language = prepared, guard, int(seed), limit, language
        self.streaming = streaming
        self._submit = submit
        self.takes: list[GuardedTakes] = []
        self._cancelled = False
        self._start(0)        # errors (bad language, a full queue) come from here, before any audio
        self._it = self._run()

    def _start(self, j: int) -> GuardedTakes:
        text = self.prepared.segments[j].spoken
        t = self.guard.stream(lambda seed, bound: self._submit(text, seed, bound), text, self.seed, self.limit,
                              self.language)
        self.takes.append(t)
        return t

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        return next(self._it)

    @property
    def position(self):
        """Requests ahead of the segment being made while it waits in the engine's queue (None once it runs)."""
        return self.takes[-1].position if self.takes else None

    def cancel(self) -> None:
        self._cancelled = True
        for t in self.takes:
            t.cancel()

    close = cancel

    def _silence(self, seconds: float) -> np.ndarray:
        return np.zeros(int(round(SR * seconds)), np.float32)

    def _run(self):
        segs = self.prepared.segments
        if self.prepared.lead_s:
            yield self._silence(self.prepared.lead_s)
        for j, seg in enumerate(segs):
            takes = self.takes[j]
            kept: list[np.ndarray] = []
            for chunk in takes:
                if self._cancelled:
                    return
                if isinstance(chunk, Redo):
                    kept.clear()
                    continue
                if j + 1 < len(segs) and len(self.takes) == j + 1:
                    self._start(j + 1)            # the next segment generates while this one is heard
                if self.streaming:
                    yield chunk
                else:
                    kept.append(chunk)
            yield from kept
            if self._cancelled:
                return
            if j + 1 < len(segs) and len(self.takes) == j + 1:
                self._start(j + 1)
            if seg.pause_s:
                yield self._silence(seg.pause_s)

    def header(self) -> str:
        """Each segment's check, `; `-separated ("streamed" first for a stream: its takes were not redone)."""
        if self.streaming and not all(t.kept for t in self.takes):
            return f"streamed: checked as generated, not redone; bound_frames=" + "/".join(
                str(self.guard.bound(s.spoken, self.limit)) for s in self.prepared.segments)
        return "; ".join(t.header() for t in self.takes)
