"""The Long-form tab: a book or a script in, chapters out (/audiobook), one segment redone (/audiobook_redo), the
list of jobs (/audiobook_jobs), and SRT in -> a timed track (/dub). Also the subtitles of every take
(`take_subtitles`, offered under the player).

The job itself (reading the book, its folder, segments on disk, loudness, files, zip) is serving/longform.py; the
generation is the page's one loop (`speak.Speaker.speak_parts`): every unfinished segment is a part (its chapter's
voice, engine and seed), the next submitted while one plays, streamed to the page's player; each segment is written
to disk the moment it ends (`on_part`), so a Stop, a reload or a restart loses at most the segment being spoken."""
from __future__ import annotations

import html
import logging
import re
import threading
import time
from pathlib import Path

import gradio as gr
import numpy as np

from serving import dubbing, longform, text_prep
from serving.subtitles import cues_from_spans, parse_srt, to_srt, to_vtt
from tts_engine import TTSError

from ui import live_player as lp
from ui.config import SENTENCE_PAUSE_S, SR
from ui.handlers import check_sampling, check_seed
from ui.live_player import expected_seconds
from ui.roles import cache_root
from ui.speak import Part, SpeechJob, session_key
from ui.text import chunk_text, to_int16

log = logging.getLogger("qwen3_tts_live")

EXAMPLE = ("# The Lighthouse\n\n## Chapter 1\n\nThe keeper climbed the stairs at dusk. The lamp was cold.\n\n"
           "He lit it, and the sea turned gold.\n\n## Chapter 2\n\nA ship came close in the night. It passed "
           "safely.\n")


def _file_path(f) -> str | None:
    """A gr.File value as a path (a path, or the FileData dict the page's player sends)."""
    if isinstance(f, dict):
        f = f.get("path")
    return str(f) if f else None


def parse_chapter_numbers(spec, n: int) -> list[int] | None:
    """'1-3, 5' -> [0, 1, 2, 4] (chapters to render now); empty -> None (all)."""
    s = str(spec or "").strip()
    if not s:
        return None
    out: set[int] = set()
    for part in s.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", part)
        if not m:
            raise TTSError(f"chapters to render: write numbers and ranges such as “1-3, 5”, not {part.strip()!r}")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if not 1 <= a <= b <= n:
            raise TTSError(f"chapters to render: {part.strip()} is outside 1-{n}")
        out.update(range(a - 1, b))
    return sorted(out)


def progress_html(job: longform.Job, t0: float | None = None, chars0: int = 0, note: str = "") -> str:
    """Chapters and segments done, audio so far, the time left (from this run's pace)."""
    k = job.counts()
    frac = k["chars_done"] / max(1, k["chars"])
    left = ""
    if t0 is not None and k["chars_done"] > chars0 and frac < 1:
        rate = (time.perf_counter() - t0) / (k["chars_done"] - chars0)        # seconds per character
        left = f" · about {longform._clock(rate * (k['chars'] - k['chars_done']))} left"
    return (f'<div id="longform-progress"><progress max="{k["segments"]}" value="{k["segments_done"]}" '
            f'style="width:100%"></progress><div>Chapters {k["chapters_done"]}/{k["chapters"]} · segments '
            f'{k["segments_done"]}/{k["segments"]} · {longform._clock(k["audio_s"])} of audio so far{left}'
            f'{" · " + html.escape(note) if note else ""}</div></div>')


_running: set[str] = set()              # the jobs being rendered in this process (one run per job at a time)
_running_lock = threading.Lock()


def _running_now() -> set[str]:
    with _running_lock:
        return set(_running)


class LongformHandler:
    """Mixed into the app's handlers (it uses their models, voices, speaker, live streams, files and checks)."""

    def jobs_root(self) -> Path:
        """Where this server keeps its long-form jobs (<cache folder>/longform)."""
        return longform.jobs_root(cache_root(self.cfg))

    @property
    def retention(self) -> longform.Retention:
        """How long this server keeps jobs (TTS_LONGFORM_* variables, read once)."""
        r = getattr(self, "_retention", None)
        if r is None:
            r = self._retention = longform.Retention.from_env()
        return r

    def start_longform_cleanup(self) -> longform.Sweeper:
        """Expired jobs removed now and every hour while the server runs (never one being rendered)."""
        return longform.Sweeper.start(self.jobs_root(), self.retention, _running_now)

    def _job_choices(self) -> list[tuple[str, str]]:
        running = _running_now()
        return [(j.describe(self.retention, j.id in running), j.id) for j in longform.list_jobs(self.jobs_root())]

    def audiobook_chapters(self, text: str = "", book_file=None):
        """Find the chapters of a book (pasted text, or a .txt, .md or .epub file) for the editable chapter list.

        Parameters:
            text: the book as text (Markdown headings or "Chapter N" lines mark chapters)
            book_file: a .txt, .md or .epub file (used instead of the text)
        Returns:
            the chapter list (rows of title, voice, text), status line
        """
        chapters = longform.read_book(text, _file_path(book_file))
        words = sum(len(c.text.split()) for c in chapters)
        return {self.c.lf_table: longform.to_rows(chapters),
                self.c.status: f"**{len(chapters)} chapters** · {words} words · edit titles, voices and text, "
                               "then render"}

    def audiobook(self, text: str = "", book_file=None, chapters=None, voice: str = "ryan",
                  language: str = "auto", job_id: str = "", only_chapters: str = "", target_lufs: float = -18.0,
                  session: dict | None = None, seed: float | None = None, randomize: bool = True,
                  temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0, repetition_penalty: float = 1.05,
                  max_new_tokens: int | None = None, live_token: str = "", request: gr.Request = None):
        """Render a book or a long script into chapters: per chapter a loudness-normalised FLAC (+ MP3), SRT and
        WebVTT subtitles, the whole book, chapters.json with start times (and an .m4b with chapter marks where the
        server has ffmpeg), all in one zip. Every segment is kept on disk as it finishes: a job that was stopped
        (or a server that restarted) continues from its first unfinished segment with the same seeds.

        Parameters:
            text: the book as text (Markdown headings or "Chapter N" lines mark chapters); ignored when book_file or chapters is given
            book_file: a .txt, .md or .epub file
            chapters: the edited chapter list, rows of [title, voice, text] (empty: found from text or book_file)
            voice: the voice of every chapter whose row names none: a CustomVoice speaker, "preset:<id>" or "my:<name>"
            language: "auto" or a language name
            job_id: continue this job (from /audiobook_jobs or an earlier answer) instead of starting a new one
            only_chapters: render only these chapters now, e.g. "1-2, 4" (empty: all); the rest stay pending
            target_lufs: loudness of every chapter in LUFS (-30 to -10; true peak at most -1 dBTP)
            seed: random seed (used when randomize is false), one for every chapter of a new job
            max_new_tokens: maximum frames (80 ms each) per sentence group
        Returns:
            live audio chunks (only where the server has ffmpeg), this run's audio as a lossless WAV, status line, seed used, the zip (once every chapter is done), the job id, the progress
        """
        c = self.c
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens,
                                           self.limits)
        try:
            target = float(target_lufs if target_lufs not in (None, "") else longform.TARGET_LUFS)
        except (TypeError, ValueError):
            raise TTSError("the loudness target must be a number of LUFS, e.g. -18") from None
        if not -30 <= target <= -10:
            raise TTSError(f"the loudness target must be between -30 and -10 LUFS, got {target:g}")
        root = self.jobs_root()
        if str(job_id or "").strip():
            job = longform.Job.load(root, job_id)
            seed = job.chapters[0].seed
        else:
            seed = check_seed(seed, randomize)
            rows = longform.from_rows(chapters) if chapters is not None else []
            path = _file_path(book_file)
            found = rows or longform.read_book(text, path)
            title = (Path(path).stem if path else longform.book_title(text or "")) or found[0].title
            voices = [ch.voice or str(voice or "").strip() for ch in found]
            for ch_voice in set(voices):
                self.voices.resolve(ch_voice, session)            # an unknown voice: refused before any work
            longform.check_chapters(found)
            parse_chapter_numbers(only_chapters, len(found))     # a bad range: refused before the job is made
            settings = longform.Settings(language=language or "auto", sampling=sampling, max_new_tokens=max_new,
                                         target_lufs=target)
            longform.cleanup(root, self.retention, _running_now())     # expired jobs make room first
            job = longform.Job.create(root, title, found, voices, seed, settings,
                                      split=chunk_text)
        todo = job.pending(parse_chapter_numbers(only_chapters, len(job.chapters)))
        yield {**self.speaker.start(self.voices.role_of_key(job.chapters[todo[0][0]].voice, session) or "custom_voice"
                                    if todo else "custom_voice", seed),
               c.lf_job: job.id, c.lf_zip: None,
               c.lf_progress: progress_html(job)}
        if todo:
            yield from self._render(job, todo, session, request, live_token)
        summary = job.build()
        yield self._finish(job, summary, seed)

    def _render(self, job: longform.Job, todo: list[tuple[int, int]], session, request, live_token: str,
                note: str = ""):
        """Speak the segments `todo` through the page's generation loop, each kept on disk as it ends."""
        with _running_lock:
            if job.id in _running:
                raise TTSError("this job is being rendered already (in another tab?): wait for it, or press Stop there")
            _running.add(job.id)
        try:
            yield from self._render_parts(job, todo, session, request, live_token, note)
        finally:
            with _running_lock:
                _running.discard(job.id)

    def _render_parts(self, job: longform.Job, todo: list[tuple[int, int]], session, request, live_token: str,
                      note: str):
        from tts_engine import TTSEngine     # (the engine class: torch, loaded by now)

        c, st = self.c, job.settings
        # the session's dictionary and number reading; the take guard's length bound (a runaway segment is cut and
        # flagged), without automatic redos: a book's segment is redone by hand (`/audiobook_redo`)
        lexicon, read_out, guard = self.text_options(request)
        guard = guard.with_options(retries=0, best_of=1)
        resolved = {}
        parts = []
        for k, (ci, si) in enumerate(todo):
            ch = job.chapters[ci]
            if ch.voice not in resolved:
                try:
                    resolved[ch.voice] = self.voices.resolve(ch.voice, session)
                except TTSError as e:
                    raise TTSError(f"chapter {ci + 1} ({ch.title}): {e}") from None
            role, v = resolved[ch.voice]
            engine = self.models.engine(role)
            # a segment's samples must not depend on what ran beside it (the next segment, other users): a job
            # continued after a stop or a restart gives the files of a straight run, byte for byte
            sj = SpeechJob(text=ch.segments[si].text, voice=v, language=st.language, instruct=None,
                           seed=job.seed_of(ci, si), sampling=st.sampling, max_new_tokens=st.max_new_tokens,
                           lexicon=lexicon, read_out=read_out, guard=guard,
                           reproducible=isinstance(engine, TTSEngine))
            prev = todo[k - 1] if k else None
            pause = (job.chapters[prev[0]].segments[prev[1]].pause_after if prev and prev[0] == ci
                     else longform.TAIL_S + longform.LEAD_IN_S)
            said = text_prep.spoken_form(sj.text, st.language, lexicon, read_out).strip() or sj.text
            parts.append(Part(said, engine, sj, pause, line=k))
        role0 = resolved[job.chapters[todo[0][0]].voice][0]
        job.state = "rendering"
        job.save()
        saved = []

        def keep(k: int, pcm: np.ndarray) -> None:
            ci, si = todo[k]
            if len(pcm):
                job.save_segment(ci, si, pcm)
                saved.append(k)

        sink = self.live.open(live_token, session_key(request), sum(expected_seconds(p.text) for p in parts))
        t0, chars0, shown = time.perf_counter(), job.counts()["chars_done"], 0
        try:
            for update in self.speaker.speak_parts(role0, parts, request, sink=sink, on_part=keep,
                                                   note=note or f"{job.title} · job {job.id[:8]}"):
                if len(saved) != shown:
                    shown = len(saved)
                    update[c.lf_progress] = progress_html(job, t0, chars0)
                yield update
        finally:
            if job.state == "rendering":
                job.state = "stopped"
                job.save()

    def _finish(self, job: longform.Job, summary: dict, seed: int) -> dict:
        c = self.c
        k = job.counts()
        if summary.get("zip"):
            reports = summary.get("reports") or {}
            loud = [r.get("lufs") for r in reports.values() if r.get("lufs") is not None]
            extra = (f" · loudness {min(loud):.1f} to {max(loud):.1f} LUFS" if loud else "")
            m4b = " · .m4b with chapter marks" if summary.get("m4b") else " · no .m4b (the server has no ffmpeg)"
            msg = (f"**Book done** · {k['chapters']} chapters · {longform._clock(summary['duration'])}{extra}{m4b} · "
                   f"seed {seed}")
            zip_out = str(summary["zip"])
        else:
            msg = (f"**Stopped** · {k['segments_done']}/{k['segments']} segments kept · render again with this job "
                   "selected to continue where it stopped")
            zip_out = None
        return {c.lf_zip: zip_out, c.lf_progress: progress_html(job), c.status: msg, c.seed: seed,
                c.lf_job: job.id}

    def audiobook_redo(self, job_id: str, chapter: float = 1, segment: float = 1, text: str = "",
                       seed: float | None = None, randomize: bool = True, session: dict | None = None,
                       live_token: str = "", request: gr.Request = None):
        """Redo one segment of a job (another seed, or edited text) and rebuild its chapter's files, the whole
        book and the zip in place.

        Parameters:
            job_id: the job
            chapter: the chapter's number (from 1)
            segment: the segment's number in the chapter (from 1; /audiobook_segments lists them)
            text: the segment's new text (empty: keep it)
            seed: the segment's new seed (used when randomize is false)
            randomize: draw a new seed for the segment
        Returns:
            live audio chunks (only where the server has ffmpeg), the redone segment as a lossless WAV, status line, seed used, the zip, the job id, the progress
        """
        job = longform.Job.load(self.jobs_root(), job_id)
        try:
            ci, si = int(float(chapter)) - 1, int(float(segment)) - 1
        except (TypeError, ValueError):
            raise TTSError("give the chapter and segment as numbers") from None
        new_seed = check_seed(seed, randomize)
        job.redo(ci, si, text=(text or "").strip() or None, seed=new_seed)
        yield {**self.speaker.start(self.voices.role_of_key(job.chapters[ci].voice, session) or "custom_voice",
                                    new_seed), self.c.lf_progress: progress_html(job)}
        yield from self._render(job, [(ci, si)], session, request, live_token,
                                note=f"chapter {ci + 1}, segment {si + 1} redone")
        final = self._finish(job, job.build(), new_seed)
        final[self.c.seed] = new_seed
        if job.chapters[ci].segments[si].done:
            final[self.c.final] = (SR, job.segment_audio(ci, si))
        yield final

    def audiobook_segments(self, job_id: str):
        """The segments of a job: [chapter, segment, done, seconds, seed, text] rows (the numbers /audiobook_redo takes).

        Parameters:
            job_id: the job
        Returns:
            the segment list, the progress
        """
        job = longform.Job.load(self.jobs_root(), job_id)
        rows = [[ci + 1, si + 1, s.done, round(s.samples / SR, 2), job.seed_of(ci, si), s.text]
                for ci, ch in enumerate(job.chapters) for si, s in enumerate(ch.segments)]
        return {self.c.lf_segments: rows, self.c.lf_progress: progress_html(job)}

    def audiobook_jobs(self):
        """The long-form jobs kept on this server, newest first, with their state and until when they are kept.

        Returns:
            the job list
        """
        return gr.update(choices=self._job_choices())

    # --- dubbing -------------------------------------------------------------------------------------------
    def dub(self, srt_file=None, srt_text: str = "", voice: str = "ryan", language: str = "auto",
            session: dict | None = None, seed: float | None = None, randomize: bool = True,
            temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0, repetition_penalty: float = 1.05,
            max_new_tokens: int | None = None, live_token: str = "", request: gr.Request = None):
        """SRT in -> one timed track: each cue spoken and placed at its start time; a cue longer than its slot
        (until the next cue starts) is sped up to fit (Rubber Band, pitch kept, at most 2x); one that cannot fit
        even so is reported in the status line (and kept whole, running into the next slot).

        Parameters:
            srt_file: an .srt file (used instead of srt_text)
            srt_text: the SRT as text
            voice: a CustomVoice speaker name, "preset:<id>" or "my:<name>"
            language: "auto" or a language name
        Returns:
            live audio chunks (only where the server has ffmpeg), the timed track as a lossless WAV, status line, seed used, the track's report (JSON)
        """
        c = self.c
        seed = check_seed(seed, randomize)
        path = _file_path(srt_file)
        if path:
            p = Path(path)
            if p.stat().st_size > dubbing.MAX_SRT_BYTES:
                raise TTSError(f"the SRT file is too big: the limit is {dubbing.MAX_SRT_BYTES // 1024} kB")
            raw = p.read_bytes()
            try:
                srt_text = raw.decode("utf-8-sig")
            except UnicodeDecodeError:
                raise TTSError("the SRT file is not UTF-8 text") from None
        cues = parse_srt(srt_text)
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens,
                                           self.limits)
        role, v = self.voices.resolve(voice, session)
        engine = self.models.engine(role)
        parts = [Part(q.text, engine, SpeechJob(text=q.text, voice=v, language=language or "auto", instruct=None,
                                                seed=seed, sampling=sampling, max_new_tokens=max_new), 0.0, i)
                 for i, q in enumerate(cues)]
        yield {**self.speaker.start(role, seed), c.dub_report: None}
        spoken: dict[int, np.ndarray] = {}
        sink = self.live.open(live_token, session_key(request), sum(expected_seconds(q.text) for q in cues))
        last = None
        for update in self.speaker.speak_parts(role, parts, request, sink=sink,
                                               on_part=lambda k, pcm: spoken.__setitem__(k, pcm),
                                               note=f"{len(cues)} cues"):
            last = update
            if c.final not in update:
                yield update
        if len(spoken) < len(cues):
            yield {**(last or {}), c.status: last.get(c.status, "**Stopped**") if last else "**Stopped**"}
            return
        track, report = dubbing.build_track(cues, [spoken[i].astype(np.float32) / 32767.0 for i in range(len(cues))],
                                            SR)
        misfits = [r for r in report if not r["fits"]]
        msg = (f"**Track done** · {len(cues)} cues · {len(track) / SR:.1f} s · seed {seed}"
               + (f" · {len(misfits)} cue(s) could not fit their slot even at 2x: "
                  + ", ".join(f"#{r['cue']} ({r['needed_speed']:.2f}x needed)" for r in misfits) if misfits else ""))
        yield {c.final: (SR, to_int16(track)), c.status: msg, c.seed: seed, c.dub_report: {"cues": report}}

    # --- subtitles of every take ------------------------------------------------------------------------------
    def take_subtitles(self, final=None, request: gr.Request = None):
        """The subtitles (SRT and WebVTT, one cue per sentence group, timed from the samples the engine made for
        it) of this session's last generation, as files beside its WAV."""
        spans = self.speaker.timings.get(session_key(request)) if final is not None else None
        if not spans:
            return None
        cues = cues_from_spans(spans, SR)
        if not cues:
            return None
        return [self.files.save_text(to_srt(cues), "take", "srt"), self.files.save_text(to_vtt(cues), "take", "vtt")]


    def take_words(self, final=None, language: str = "auto", request: gr.Request = None):
        """Word-level subtitles of this session's last result: each sentence group's audio (its exact span) given
        to the speech-recognition model (the Clone tab's transcriber, loaded on first use), whose word timings are
        estimates (labelled so in the files).

        Parameters:
            final: the result (the player's lossless WAV)
            language: "auto" or the language's name
        Returns:
            the word-level SRT and WebVTT files (estimated)
        """
        from serving.subtitles import Cue
        from tts_engine import asr

        spans = self.speaker.timings.get(session_key(request)) if final is not None else None
        if not spans:
            raise TTSError("generate something first: word timings are made for the result in the player")
        sr, audio = final
        audio = np.asarray(audio)
        audio = (audio.mean(axis=1) if audio.ndim > 1 else audio).astype(np.float32)
        if audio.dtype != np.float32 or np.abs(audio).max(initial=0) > 1.0:
            audio = audio / 32768.0
        t = asr.shared(device=self.cfg.device)
        words = []
        for text, a, b in spans:
            a, b = int(a * sr / SR), int(b * sr / SR)
            if b - a < int(0.1 * sr):
                continue
            end = b / sr
            words += [Cue(min(a / sr + w0, end), min(max(a / sr + w1, a / sr + w0 + 0.01), end), w)
                      for w, w0, w1 in t.words(audio[a:b], int(sr), language)]
        if not words:
            raise TTSError("no words were recognised in the result")
        return [self.files.save_text(to_srt(words, estimated=True), "take_words", "srt"),
                self.files.save_text(to_vtt(words, estimated=True), "take_words", "vtt")]


def build(app, c, langs) -> None:
    app.start_longform_cleanup()
    choices = app.voices.choices(None)
    default_voice = "ryan" if "ryan" in app.models.speakers() else (choices[0][1] if choices else None)
    with gr.Tab("Long-form", id="tab-longform"):
        gr.Markdown("A book or a long script: paste it or upload a .txt, .md or .epub. Chapters are found from "
                    "headings, “Chapter N” lines or the EPUB's chapters; edit the list (title, voice, text), then "
                    "render. Each segment is kept on disk as it is made: Stop, reload or restart, and rendering "
                    "the job again continues where it stopped. The result: per chapter FLAC + MP3 + subtitles, the "
                    "whole book, a chapter list and (with ffmpeg) an .m4b, in one zip. Jobs on this server: "
                    f"{app.retention.describe()} (each job's date is in the list).")
        with gr.Row():
            c.lf_text = gr.Textbox(EXAMPLE, label="Text (Markdown headings or “Chapter N” lines mark chapters)",
                                   lines=8, scale=3, elem_id="longform-text")
            c.lf_file = gr.File(label="…or a book file", file_types=[".txt", ".md", ".epub"], scale=1,
                                elem_id="longform-file")
        c.lf_find = gr.Button("Find chapters", elem_id="longform-find")
        c.lf_table = gr.Dataframe([], headers=longform.TABLE_HEADERS, type="array", interactive=True,
                                  column_count=3, datatype="str", wrap=True, elem_id="longform-chapters",
                                  label="Chapters (empty voice: the voice below; empty list: found when rendering)")
        with gr.Row():
            c.lf_voice = gr.Dropdown(choices, value=default_voice, label="Voice", allow_custom_value=True, scale=2)
            c.lf_lang = gr.Dropdown(langs, value="auto", label="Language", scale=1)
            c.lf_lufs = gr.Slider(-30, -10, value=longform.TARGET_LUFS, step=0.5, label="Loudness (LUFS)", scale=1)
        with gr.Row():
            c.lf_job = gr.Dropdown(app._job_choices(), value=None, label="Job (choose one to continue it; empty: "
                                   "a new job)", allow_custom_value=True, scale=3, elem_id="longform-job")
            c.lf_only = gr.Textbox("", label="Only chapters (e.g. 1-2)", max_lines=1, scale=1)
            c.lf_refresh = gr.Button("↻ Jobs", scale=0, size="sm")
        c.lf_btn = gr.Button("▶ Render", variant="primary", elem_id="longform-generate",
                             elem_classes=[lp.GENERATE_CLASS])
        c.lf_progress = gr.HTML("", elem_id="longform-progress-box")
        c.lf_zip = gr.File(label="The book (zip)", interactive=False, elem_id="longform-zip")
        with gr.Accordion("Redo one segment", open=False):
            c.lf_seg_btn = gr.Button("List the job's segments", size="sm")
            c.lf_segments = gr.Dataframe([], headers=["Chapter", "Segment", "Done", "Seconds", "Seed", "Text"],
                                         type="array", interactive=False, wrap=True)
            with gr.Row():
                c.lf_rc = gr.Number(1, precision=0, minimum=1, label="Chapter")
                c.lf_rs = gr.Number(1, precision=0, minimum=1, label="Segment")
                c.lf_rtext = gr.Textbox("", label="New text (empty: keep)", scale=3)
            c.lf_redo = gr.Button("↺ Redo the segment (new seed unless the seed is fixed)",
                                  elem_classes=[lp.GENERATE_CLASS])
        with gr.Accordion("SRT in → a timed track (dubbing)", open=False):
            with gr.Row():
                c.dub_file = gr.File(label=".srt file", file_types=[".srt"], scale=1)
                c.dub_text = gr.Textbox("1\n00:00:00,500 --> 00:00:03,000\nHello there.\n\n2\n00:00:03,500 --> "
                                        "00:00:06,000\nThis line starts at three and a half seconds.\n",
                                        label="…or the SRT as text", lines=6, scale=2)
            c.dub_btn = gr.Button("▶ Speak the cues at their times", elem_classes=[lp.GENERATE_CLASS])
            c.dub_report = gr.JSON(label="Cues: speed used, fit")


def wire(app, c, live, on, sampling: list, gen_out: list) -> list:
    """The events (returned, for Stop's `cancels=`). `sampling`: seed, randomize and the sampling settings."""
    ui = dict(queue=False, show_progress="hidden", api_visibility="undocumented")
    on(c.lf_find, app.audiobook_chapters, [c.lf_text, c.lf_file], [c.lf_table, c.status], "audiobook_chapters")
    ev = live(c.lf_btn, app.audiobook, [c.lf_text, c.lf_file, c.lf_table, c.lf_voice, c.lf_lang, c.lf_job, c.lf_only,
                                        c.lf_lufs, c.session] + sampling,
              gen_out + [c.lf_zip, c.lf_job, c.lf_progress], "audiobook")
    redo = live(c.lf_redo, app.audiobook_redo, [c.lf_job, c.lf_rc, c.lf_rs, c.lf_rtext, c.seed, c.randomize,
                                                c.session],
                gen_out + [c.lf_zip, c.lf_job, c.lf_progress], "audiobook_redo")
    on(c.lf_seg_btn, app.audiobook_segments, [c.lf_job], [c.lf_segments, c.lf_progress], "audiobook_segments")
    on(c.lf_refresh, app.audiobook_jobs, None, [c.lf_job], "audiobook_jobs")
    for e in (ev, redo):        # the list of jobs shows the new job and its state
        e.then(app.audiobook_jobs, None, [c.lf_job], api_name=False, **ui)
    dub = live(c.dub_btn, app.dub, [c.dub_file, c.dub_text, c.lf_voice, c.lf_lang, c.session] + sampling,
               gen_out + [c.dub_report], "dub")
    c.session.change(lambda s: gr.update(choices=app.voices.choices(s)), [c.session], [c.lf_voice],
                     api_name="ui_longform_voices", **ui)
    # a new text or file: the chapter list found from the old one would be rendered instead, so it is cleared
    for i, trigger in enumerate((c.lf_text.input, c.lf_file.upload, c.lf_file.clear)):
        trigger(lambda: [], None, [c.lf_table], api_name=f"ui_longform_clear_{i}", **ui)
    return [ev, redo, dub]


def wire_subtitles(app, c, on) -> None:
    """Each new result in the player gets its subtitles beside it; word-level ones on request."""
    c.final.change(app.take_subtitles, [c.final], [c.subs], api_name="ui_take_subtitles", queue=False,
                   show_progress="hidden", api_visibility="undocumented")
    on(c.words_btn, app.take_words, [c.final], [c.subs], "take_words", concurrency_id="asr", concurrency_limit=1,
       show_progress="minimal")
