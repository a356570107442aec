"""The one generation loop every handler uses: text -> sentence groups -> `engine.stream` -> int16 chunks
-> the final lossless WAV and the status line.

Long text is spoken in sentence groups (`chunk_text`), one voice and one seed for all of them. The next group
is submitted to the engine as soon as the current one produces its first chunk (the second group: once the first
has made `SUBMIT_NEXT_AFTER_S` of audio, or has ended), so it is already generating when the current one ends: the
listener hears `SENTENCE_PAUSE_S` of silence between groups and nothing else.
The loop itself runs a list of `Part`s (text, engine, job, the pause before it, the line it belongs to): a
dialogue (ui/dialogue.py) is the same loop over parts of several voices, engines and pauses.

Every sample the listener hears leaves through `emit` (one place): it goes into the final WAV, to the
optional `sink` (the page's own live player: `write(pcm_int16)`, `close()`, and a `cancelled` property that
stops the generation), and, where Gradio's streaming player is used (`live_audio`), to the `live` output.
Every engine request is tracked per browser session (`ActiveStreams`) so that Stop can cancel it."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np

from serving import text_prep
from serving.busy_line import LINE as BUSY_LINE
from serving.speed import StreamStretcher
from serving.take_guard import Redo, TakeGuard
from tts_engine import EngineBusyError, chunk_schedule

from ui.config import ROLE_LABEL, SENTENCE_PAUSE_S, SR
from ui.text import chunk_text, to_int16

# the first two chunks are one frame (80 ms) each: the listener hears sound one frame step after the prompt, and
# the second chunk comes one frame (plus its decode) later, well before the first 80 ms have played, so the page's
# player can start on the first chunk instead of waiting to see whether a chunk of two frames comes in time; later
# chunks double (2, 4, 8, 12 frames), which the player buffers for when generation is slower than playback.
# The player is told these sizes (`first_chunks_s`, header X-Live-Chunks).
FIRST_CHUNK_FRAMES = (1, 1)
FRAME_S = 0.08
QUEUE_POLL_S = 0.02         # how often a queued request's place is checked (it reads its first chunk this soon)


def first_chunks_s(n: int = 6, speed: float = 1.0) -> list[float]:
    """Audio seconds of a part's first `n` chunks as the engine emits them (FIRST_CHUNK_FRAMES, then doubling up
    to 12 frames), played at `speed`."""
    sizes = chunk_schedule(FIRST_CHUNK_FRAMES, 12)
    return [next(sizes) * FRAME_S / speed for _ in range(n)]
# the second part (sentence group, dialogue line) is submitted once the first has made this much audio (or has
# ended): the first part's small first chunks (1, 2, 4, 8 frames: 1.2 s), which the listener hears while they are
# made, with nothing in the buffer yet, are made alone, not slowed down by the next part's prefill and a batch of
# two - unless the engine is slower than real time, where batching the next part at once is what helps (`_slow`).
# Every later part is submitted at the first chunk of the one before (the stream is ahead by then).
SUBMIT_NEXT_AFTER_S = 1.2


class Sink(Protocol):
    """Where a live player takes the audio as it is generated."""

    def write(self, pcm: np.ndarray) -> None: ...     # int16 mono samples at 24 kHz
    def close(self) -> None: ...                        # no more audio (also after a stop or a failure)
    @property
    def cancelled(self) -> bool: ...                    # True: the listener stopped; end the generation


def session_key(request) -> str:
    return getattr(request, "session_hash", None) or "_"


class ActiveStreams:
    """The engine requests each browser session has running or queued (what Stop cancels)."""

    def __init__(self):
        self.by_session: dict[str, set] = {}
        self.stops: dict[str, int] = {}      # how many times each session pressed Stop (a generation compares)
        self._lock = threading.Lock()

    def stop_count(self, session: str) -> int:
        with self._lock:
            return self.stops.get(session, 0)

    def add(self, session: str, stream) -> None:
        with self._lock:
            self.by_session.setdefault(session, set()).add(stream)

    def discard(self, session: str, stream) -> None:
        with self._lock:
            s = self.by_session.get(session)
            if s is not None:
                s.discard(stream)
                if not s:
                    del self.by_session[session]

    def cancel(self, session: str) -> int:
        """Cancel every request of `session`; -> how many there were."""
        with self._lock:
            streams = list(self.by_session.pop(session, ()))
            self.stops[session] = self.stops.get(session, 0) + 1
        for s in streams:
            s.cancel()
        return len(streams)


@dataclass
class SpeechJob:
    """What to say and how: the arguments of `engine.stream`, the same for every sentence group."""
    text: str
    voice: object            # a CustomVoice speaker name, a Voice, or None (VoiceDesign)
    language: str
    instruct: str | None
    seed: int
    sampling: dict
    max_new_tokens: int
    speed: float = 1.0       # played this many times as fast, same pitch (one gapless stretch of the whole answer)
    # what the model reads (serving/text_prep.py): the pronunciation dictionary, numbers etc. read out
    lexicon: text_prep.Lexicon | None = None
    read_out: bool = True
    guard: TakeGuard | None = None   # every part's takes checked and redone (serving/take_guard.py); None: off
    reproducible: bool = False       # the same bits whatever runs beside it (a local TTSEngine's option; long-form)

    def stream(self, engine, text: str, seed: int | None = None, max_new_tokens: int | None = None):
        return engine.stream(text, voice=self.voice, language=self.language or "auto", instruct=self.instruct,
                             seed=self.seed if seed is None else seed, sampling=self.sampling,
                             max_new_tokens=max_new_tokens or self.max_new_tokens,
                             first_chunk_frames=FIRST_CHUNK_FRAMES,
                             **({"reproducible": True} if self.reproducible else {}))


@dataclass
class Part:
    """One request of a generation: `text` spoken by `job` (voice, seed, sampling) on `engine`, after
    `pause_s` of silence (none before the first part). `line`: the dialogue line it belongs to (per-line WAVs)."""
    text: str
    engine: object
    job: SpeechJob
    pause_s: float = 0.0
    line: int = 0
    after_s: float = 0.0     # silence after it (a pause tag at the end of the text)

    def submit(self):
        """The engine request of this part; with a take guard, its guarded takes (serving/take_guard.py)."""
        g = self.job.guard
        if g is None:
            return self.job.stream(self.engine, self.text)
        return g.stream(lambda seed, bound: self.job.stream(self.engine, self.text, seed, bound), self.text,
                        self.job.seed, self.job.max_new_tokens, self.job.language)


def sentence_parts(engine, job: SpeechJob, line: int = 0, pause_s: float = 0.0) -> list[Part]:
    """`job.text` as the model reads it (pause tags, dictionary, numbers: serving/text_prep.py) in sentence groups,
    `SENTENCE_PAUSE_S` apart or as a pause tag says (the first after `pause_s`, plus a leading tag's)."""
    prep = text_prep.prepare(job.text, job.language, job.lexicon, job.read_out)
    parts, gap = [], pause_s + prep.lead_s
    for seg in prep.segments:
        for k, piece in enumerate(chunk_text(seg.spoken)):
            parts.append(Part(piece, engine, job, gap if k == 0 else SENTENCE_PAUSE_S, line))
        gap = SENTENCE_PAUSE_S if seg.pause_s is None else seg.pause_s
    parts[-1].after_s = prep.segments[-1].pause_s or 0.0
    return parts


class Speaker:
    """Runs `SpeechJob`s and turns their progress into Gradio updates {component: value} for the outputs
    `live`, `final`, `status` and `seed` of `c` (filled in by the layout)."""

    def __init__(self, c, status: Callable[..., str], loaded: Callable[[str], bool], active: ActiveStreams,
                 live_audio: bool, poll_s: float = 0.25):
        self.c, self.status, self.loaded, self.active = c, status, loaded, active
        self.live_audio, self.poll_s = live_audio, poll_s
        # per session: (text, first sample, end sample) of each sentence group of its last generation, in what
        # was emitted (the take's subtitles, serving/subtitles.py)
        self.timings: dict[str, list[tuple[str, int, int]]] = {}

    def start(self, role: str, seed: int) -> dict:
        """First update of a generation: clear the lossless player, show the seed (and 'loading' if cold)."""
        if not self.loaded(role):
            msg = self.status(f"Loading the {ROLE_LABEL[role]} model…", role=role)
        else:
            msg = self.status("Starting", seed=seed, role=role)
        return {self.c.final: None, self.c.status: msg, self.c.seed: seed}

    def _wait_in_queue(self, stream, job: SpeechJob, role: str, halted: Callable[[], bool],
                       driven: bool = False) -> Iterator[dict]:
        """Status updates while the request waits for a place in the engine (`position` 0 = next in line).
        driven: the engine steps only while its streams are read (ZeroGPU): next in line is read at once."""
        waited, shown, t0 = False, None, time.perf_counter()
        while (pos := getattr(stream, "position", None)) is not None and not (driven and pos == 0) and not halted():
            # next in line (0) is shown only once it has waited a while (real-time admission may hold it until a
            # stream ends); a part queued ahead that starts at once leaves the status line alone
            if pos != shown and (pos > 0 or time.perf_counter() - t0 >= self.poll_s):
                waited, shown = True, pos
                yield {self.c.status: self.status("Waiting for the engine", queue=pos, seed=job.seed, role=role)}
            time.sleep(QUEUE_POLL_S)
        if waited:
            yield {self.c.status: self.status("Starting", seed=job.seed, role=role)}

    def speak(self, role: str, engine, job: SpeechJob, request=None, *, note: str = "",
              extra_final: dict | None = None, sink: Sink | None = None, on_done=None) -> Iterator[dict]:
        """Stream `job` (sentence group by sentence group) and end with the lossless WAV and the status."""
        yield from self.speak_parts(role, sentence_parts(engine, job), request, note=note, extra_final=extra_final,
                                    sink=sink, on_done=on_done)

    def speak_parts(self, role: str, pieces: list[Part], request=None, *, note: str = "",
                    extra_final: dict | None = None, sink: Sink | None = None,
                    on_done: Callable[[list[tuple[int, np.ndarray]]], dict] | None = None,
                    on_part: Callable[[int, np.ndarray], None] | None = None) -> Iterator[dict]:
        """Stream `pieces` in order, each submitted ahead while the one before plays, and end with the lossless
        WAV and the status. `on_done(lines)`, with each line's audio [(line, int16 samples)] (pauses excluded),
        adds to the final update. `on_part(k, samples)`: part k ended whole (not stopped), with its int16 samples
        (the pause before it excluded), before the next part's audio is emitted (long-form jobs keep it on disk)."""
        c = self.c
        job = pieces[0].job                   # the seed and the status line's figures
        session = session_key(request)
        parts: list[np.ndarray] = []          # everything emitted, in order: the final WAV
        spans: list[tuple[int, int, int]] = []    # (line, first sample, end sample) of each part's speech
        submitted: list = []                  # engine handles, group by group
        t0 = time.perf_counter()
        ttfa, compute, stopped, n = None, 0.0, False, 0
        stops_before = self.active.stop_count(session)
        # speed: every sample (sentence pauses too) goes through one real-time stretcher, so the seams stay gapless
        stretch = StreamStretcher(SR, job.speed) if job.speed != 1.0 else None

        def halted() -> bool:
            """The listener stopped: the page's player went away, or Stop was pressed in this session."""
            return (sink is not None and sink.cancelled) or self.active.stop_count(session) != stops_before

        def emit(pcm: np.ndarray) -> dict:
            """The one exit of audio: the final WAV, the live player (sink), Gradio's live output."""
            nonlocal n
            parts.append(pcm)
            n += len(pcm)
            if sink is not None:
                sink.write(pcm)
            return {c.live: (SR, pcm)} if self.live_audio and sink is None else {}

        def submit(k: int):
            s = pieces[k].submit()
            submitted.append(s)
            self.active.add(session, s)
            return s

        def submit_or_wait(k: int):
            """Submit part k; while the engine's queue is full, wait in line saying "Busy, position N" (updated
            every poll) -> the stream, or None when the listener stopped meanwhile."""
            try:
                return submit(k)
            except EngineBusyError:
                pass
            ticket = BUSY_LINE.join(pieces[k].engine)
            try:
                while (s := BUSY_LINE.try_submit(ticket, lambda: submit(k))) is None and not halted():
                    yield {c.status: self.status(f"Busy, position {BUSY_LINE.ahead(ticket) + 1}", seed=job.seed,
                                                 role=role)}
                    time.sleep(self.poll_s)
                return s
            finally:
                BUSY_LINE.leave(ticket)

        try:
            ahead = yield from submit_or_wait(0)
            for k in range(len(pieces)):
                stream, ahead, busy = ahead, None, False
                if stream is None:                        # the listener stopped while waiting in the busy line
                    stopped = True
                    break
                yield from self._wait_in_queue(stream, job, role, halted,
                                               getattr(pieces[k].engine, "driven_by_caller", False))
                if halted():                              # the listener left while the request was queued
                    stopped = True
                    break
                t_run = time.perf_counter()
                gap_s = pieces[k].pause_s + (pieces[k - 1].after_s if k > 0 else 0.0)   # (a line's end tag)
                if gap_s > 0:
                    pause = np.zeros(int(round(SR * gap_s)), np.float32)
                    gap = to_int16(stretch.push(pause) if stretch else pause)
                    update = emit(gap) if len(gap) else {}
                    if update:
                        yield update
                spans.append((pieces[k].line, n, n))
                first_out = len(parts)                # parts[first_out:]: this part's audio
                take_at = (first_out, n)          # where this part's take starts in the WAV (a redo replaces it)
                made, first = 0, None             # this part's samples so far; (when, samples) of its first chunk
                for chunk in stream:
                    if halted():                  # Stop came while this chunk was queued: no "Streaming" status
                        stopped = True            # may follow the stop's own (it would stay on the page)
                        break
                    if isinstance(chunk, Redo):   # the take guard redoes this part: the WAV drops the failed take
                        del parts[take_at[0]:]
                        n = take_at[1]
                        spans[-1] = (spans[-1][0], n, n)
                        yield {c.status: self.status(f"Redoing part {k + 1}", seed=chunk.next_seed, role=role,
                                                     note=f"take {chunk.failed.describe()}")}
                        continue
                    made += len(chunk)
                    first = first or (time.perf_counter(), len(chunk))
                    if (ahead is None and k + 1 < len(pieces) and not busy and not halted()
                            and (k > 0 or made >= SUBMIT_NEXT_AFTER_S * SR or _slow(made, first))):
                        try:                      # gapless: the next group generates while this one plays
                            ahead = submit(k + 1)
                        except EngineBusyError:   # the queue is full: submit it after this group instead
                            busy = True
                    if stretch is not None:
                        chunk = stretch.push(chunk)
                    if len(chunk) == 0:
                        continue
                    pcm = to_int16(chunk)
                    if ttfa is None:
                        ttfa = time.perf_counter() - t0
                    update = emit(pcm)
                    spans[-1] = (spans[-1][0], spans[-1][1], n)
                    running = compute + time.perf_counter() - t_run
                    update[c.status] = self.status("Streaming", ttfa=ttfa, compute=running, audio_s=n / SR,
                                                   seed=job.seed, piece=k + 1, pieces=len(pieces), note=note,
                                                   role=role)
                    yield update
                    if halted():
                        stopped = True
                        break
                compute += time.perf_counter() - t_run
                stream.cancel()
                self.active.discard(session, stream)
                if on_part is not None and not stopped and not halted():   # (a cancelled request ends early)
                    on_part(k, np.concatenate(parts[first_out:]) if len(parts) > first_out
                            else np.zeros(0, np.int16))
                if stopped or halted():
                    stopped = True
                    break
                if ahead is None and k + 1 < len(pieces):
                    ahead = yield from submit_or_wait(k + 1)   # not queued ahead: no audio came, or the queue was full
            if pieces[-1].after_s > 0 and not stopped:     # a pause tag at the very end
                pause = np.zeros(int(round(SR * pieces[-1].after_s)), np.float32)
                update = emit(to_int16(stretch.push(pause) if stretch else pause))
                if update:
                    yield update
            if stretch is not None and not stopped:
                tail = to_int16(stretch.finish())     # what the stretcher still holds
                update = emit(tail) if len(tail) else {}
                if update:
                    yield update
        finally:
            for s in submitted:                   # the running and the queued-ahead request
                s.cancel()
                self.active.discard(session, s)
            if sink is not None:
                sink.close()
        checked = [(i, getattr(s, "summary", lambda: "")()) for i, s in enumerate(submitted)]
        note = " · ".join(x for x in [note] + [f"part {i + 1} {t}" if len(pieces) > 1 else t
                                                 for i, t in checked if t] if x)
        self.timings.pop(session, None)
        self.timings[session] = [(pieces[k].text, a, b) for k, (_line, a, b) in enumerate(spans)]
        while len(self.timings) > 1000:           # the oldest sessions' first
            self.timings.pop(next(iter(self.timings)))
        if stopped:
            note = " · ".join(x for x in (note, "stopped by the listener") if x)
        if n == 0:
            final = {c.final: None, c.status: self.status("Stopped" if stopped else
                                                          "Done: the model produced no audio (try another seed)",
                                                          seed=job.seed, role=role)}
        else:
            final = {c.final: (SR, np.concatenate(parts)),
                     c.status: self.status("Stopped" if stopped else "Done", ttfa=ttfa, compute=compute,
                                           audio_s=n / SR, seed=job.seed,
                                           pieces=len(pieces), piece=len(pieces), note=note, role=role)}
        final[c.seed] = job.seed
        final.update(extra_final or {})
        if on_done is not None:
            final.update(on_done(_line_audio(parts, spans)))
        yield final

    def render_all(self, engine, jobs: list[SpeechJob], request=None) -> Iterator[np.ndarray | None]:
        """Submit every job at once (they batch in the engine) and yield each one's whole int16 audio in order
        (None when it produced none). Used by the blend sweep."""
        session = session_key(request)
        streams = []
        try:
            for job in jobs:
                s = job.stream(engine, job.text)
                streams.append(s)
                self.active.add(session, s)
            for s in streams:
                audio = [to_int16(x) for x in s]
                yield np.concatenate(audio) if audio and sum(map(len, audio)) else None
        finally:
            for s in streams:
                s.cancel()
                self.active.discard(session, s)


def _slow(made: int, first: tuple[float, int]) -> bool:
    """The part generates slower than real time (its audio since its first chunk over the time since): the next
    part is better submitted now, to batch with it (the player buffers for a slow engine anyway)."""
    dt = time.perf_counter() - first[0]
    return made > first[1] and dt > 0.05 and (made - first[1]) / SR / dt < 1.0


def _line_audio(parts: list[np.ndarray], spans: list[tuple[int, int, int]]) -> list[tuple[int, np.ndarray]]:
    """Each line's speech, in order, cut out of everything emitted (the pauses between lines left out, those
    between the sentence groups of a line kept)."""
    audio = np.concatenate(parts) if parts else np.zeros(0, np.int16)
    out: list[tuple[int, np.ndarray]] = []
    for line, a, b in spans:
        if out and out[-1][0] == line:
            out[-1] = (line, out[-1][1], b)
        else:
            out.append((line, a, b))
    return [(line, audio[a:b]) for line, a, b in out]
