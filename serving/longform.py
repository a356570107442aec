"""Long-form jobs: a book or a script in, chapters out, nothing lost (docs/long-form.md).

- **Reading** (`read_book`): pasted text or a file (.txt, .md, .epub through ebooklib), checked (size, text or
  binary, a zip bomb), cut into chapters at Markdown headings, "Chapter N" lines or the EPUB's own documents.
- **The job** (`Job`): a folder under the cache folder (`jobs_root`) with `job.json` (chapters, their voice and seed,
  their segments = sentence groups of each paragraph) and one WAV per finished segment, written atomically as each
  one finishes. Whatever rendered it (the page's generation loop, ui/longform_tab.py), a job continues after a Stop,
  a reload or a restart from its first unfinished segment: the same seeds give the same segments. A segment can be
  redone (another seed, edited text); its chapter's files are rebuilt.
- **Output** (`Job.build`): per chapter the segments with their silence trimmed, a fixed pause between sentence
  groups and a longer one between paragraphs, a fixed lead-in and tail, loudness-normalised (ITU-R BS.1770 through
  pyloudnorm, true peak limited); FLAC (+ MP3 where libsndfile writes it), SRT and WebVTT (one cue per segment, timed
  from where its samples were placed), the whole book, `chapters.json` with start times, an .m4b with chapter marks
  where ffmpeg exists, and one zip of it all.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import soundfile as sf

from tts_engine import TTSError, cache_paths

from serving.subtitles import Cue, to_srt, to_vtt
from serving.text_prep import split_pauses

log = logging.getLogger("qwen3_tts_live")

SR = 24000
MAX_BOOK_CHARS = 1_000_000        # about 20 hours of speech
MAX_FILE_BYTES = 10 * 2**20       # an uploaded book (an EPUB's pictures are not read)
MAX_EPUB_UNPACKED = 100 * 2**20   # what an EPUB unpacks to (a zip bomb is refused before it is opened)
MAX_CHAPTERS = 100
MAX_SEGMENT_CHARS = 2000          # one redone segment's text
TARGET_LUFS = -18.0
TRUE_PEAK_DBTP = -1.0
LEAD_IN_S = 0.5                   # silence before a chapter's first word
TAIL_S = 1.0                      # after its last
SENTENCE_PAUSE_S = 0.12           # between the sentence groups of a paragraph (the page's pause)
PARAGRAPH_PAUSE_S = 0.6           # between paragraphs
TITLE_PAUSE_S = 1.0               # after the chapter's title
SILENCE_DB = -45.0                # below the segment's peak by this much: silence (trimmed at the ends)
TEXT_EXT = {".txt", ".md", ".markdown", ".text"}
ID_RE = re.compile(r"^[0-9a-f]{32}$")


def jobs_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where jobs live: <cache folder>/longform (the app's --cache-dir, else TTS_CACHE_DIR, ...)."""
    return Path(cache_dir or cache_paths.cache_root()) / "longform"


# --- reading a book ------------------------------------------------------------------------------------------

@dataclass
class Chapter:
    title: str
    paragraphs: list[str]
    voice: str = ""

    @property
    def text(self) -> str:
        return "\n\n".join(self.paragraphs)


def _decode(data: bytes, what: str) -> str:
    if not data.strip():
        raise TTSError(f"the {what} is empty")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16")
    else:
        if b"\x00" in data[:65536]:
            raise TTSError(f"the {what} is not text (it looks like a binary file): upload .txt, .md or .epub")
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise TTSError(f"the {what} is not UTF-8 text: save it as UTF-8 (.txt or .md), or upload an .epub") \
                from None
    control = sum(1 for ch in text[:65536] if ord(ch) < 32 and ch not in "\n\r\t\f")
    if control > 0.01 * min(len(text), 65536):
        raise TTSError(f"the {what} is not text (it looks like a binary file): upload .txt, .md or .epub")
    return text


def _clean_markdown(line: str) -> str:
    line = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", line)               # images
    line = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line)           # links -> their text
    line = re.sub(r"<[^>]+>", "", line)                              # inline HTML
    line = re.sub(r"^\s{0,3}#{1,6}\s+", "", line)                   # a heading inside a chapter
    line = re.sub(r"^\s{0,3}(>\s?)+", "", line)                      # block quotes
    line = re.sub(r"^\s*([-*+]|\d+[.)])\s+", "", line)               # list markers
    line = re.sub(r"(\*\*|__|\*|`|~~)", "", line)                   # emphasis, code
    return line.strip()


_CHAPTER_LINE = re.compile(r"^\s*(chapter|chapitre|kapitel|cap[ií]tulo|capitolo|hoofdstuk|part|book)\s+"
                           r"([0-9]+|[ivxlcdm]+|[a-z-]+)\b.{0,70}$|^\s*第\s*[0-9一二三四五六七八九十百千]+\s*[章回节]\s*.{0,40}$",
                           re.IGNORECASE)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.+?)\s*#*\s*$")


def _paragraphs(lines: list[str]) -> list[str]:
    out, cur, fence = [], [], False
    for ln in lines:
        if ln.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if re.match(r"^\s*([-*_]\s*){3,}$", ln):                     # a rule
            ln = ""
        text = _clean_markdown(ln)
        if cur and re.match(r"^\s*([-*+]|\d+[.)])\s+", ln):        # a list item: a paragraph of its own
            out.append(" ".join(cur))
            cur = []
        if not text:
            if cur:
                out.append(" ".join(cur))
                cur = []
            continue
        cur.append(text)
    if cur:
        out.append(" ".join(cur))
    return [p for p in out if re.search(r"\w", p)]


def split_chapters(text: str) -> list[Chapter]:
    """Chapters of plain or Markdown text: at headings (the level that repeats: `## Chapter` under a `# Book`
    title), else at "Chapter N" lines, else one chapter. Text before the first chapter is a chapter of its own
    ("Opening") unless it is only the book's title."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    heads = [(i, len(m.group(1)), _clean_markdown(m.group(2))) for i, ln in enumerate(lines)
             if (m := _HEADING.match(ln))]
    marks: list[tuple[int, str]] = []
    if heads:
        levels = sorted({lv for _, lv, _ in heads})
        level = next((lv for lv in levels if sum(1 for _, x, _ in heads if x == lv) >= 2), levels[0])
        marks = [(i, t) for i, lv, t in heads if lv == level]
        # a heading above the chapters' level is the book's title (`book_title`), not text to read
        lines = [ln if (m := _HEADING.match(ln)) is None or len(m.group(1)) >= level else "" for ln in lines]
    else:
        marks = [(i, ln.strip()) for i, ln in enumerate(lines) if _CHAPTER_LINE.match(ln)]
    chapters = []
    if not marks:
        paras = _paragraphs(lines)
        return [Chapter("Text", paras)] if paras else []
    before = _paragraphs(lines[:marks[0][0]])
    if before:
        chapters.append(Chapter("Opening", before))
    for k, (i, title) in enumerate(marks):
        end = marks[k + 1][0] if k + 1 < len(marks) else len(lines)
        paras = _paragraphs(lines[i + 1:end])
        if paras or title:
            chapters.append(Chapter(title or f"Chapter {k + 1}", paras))
    return chapters


def book_title(text: str) -> str:
    """The first Markdown heading of a level above the chapters' (`# Book` over `## Chapter` headings), else ""."""
    heads = [(len(m.group(1)), _clean_markdown(m.group(2))) for ln in text.split("\n")[:2000]
             if (m := _HEADING.match(ln))]
    levels = sorted({lv for lv, _ in heads})
    level = next((lv for lv in levels if sum(1 for x, _ in heads if x == lv) >= 2), None)
    return next((t for lv, t in heads if level is not None and lv < level), "")


def _epub_chapters(path: Path) -> list[Chapter]:
    try:
        with zipfile.ZipFile(path) as z:
            unpacked = sum(i.file_size for i in z.infolist())
    except (zipfile.BadZipFile, OSError):
        raise TTSError("the file is not a readable EPUB (an EPUB is a zip archive)") from None
    if unpacked > MAX_EPUB_UNPACKED:
        raise TTSError(f"the EPUB unpacks to {unpacked // 2**20} MiB; the limit is {MAX_EPUB_UNPACKED // 2**20} MiB")
    import ebooklib
    from ebooklib import epub
    from lxml import html as lhtml

    try:
        book = epub.read_epub(str(path), {"ignore_ncx": True})
    except Exception as e:     # ebooklib raises many kinds on a broken file; the user gets one message
        raise TTSError(f"the EPUB could not be read ({type(e).__name__}): is it a valid EPUB file?") from None
    titles = {}
    for item in _flat_toc(book.toc):
        href = getattr(item, "href", "") or ""
        titles.setdefault(href.split("#")[0], getattr(item, "title", "") or "")
    blocks = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "blockquote", "pre", "dd", "dt"}
    chapters = []
    for idref, _linear in book.spine:
        item = book.get_item_with_id(idref)
        if item is None or item.get_type() != ebooklib.ITEM_DOCUMENT:
            continue
        try:
            root = lhtml.fromstring(item.get_content())
        except Exception:
            continue
        for bad in root.xpath("//script|//style|//nav"):
            bad.drop_tree()
        paras, title = [], ""
        for el in root.iter():
            if not isinstance(el.tag, str) or el.tag.split("}")[-1] not in blocks:
                continue
            if any(isinstance(a.tag, str) and a.tag.split("}")[-1] in blocks for a in el.iterancestors()):
                continue
            text = " ".join(el.text_content().split())
            if not re.search(r"\w", text):
                continue
            if not title and el.tag.split("}")[-1] in ("h1", "h2", "h3"):
                title = text
                continue
            paras.append(text)
        if not paras and not title:
            body = " ".join(root.text_content().split())
            if re.search(r"\w", body):
                paras = [body]
        if not paras:
            continue
        title = titles.get(item.get_name()) or title or f"Chapter {len(chapters) + 1}"
        chapters.append(Chapter(title, paras))
    if not chapters:
        raise TTSError("the EPUB has no text to read (only pictures, or an empty book)")
    return chapters


def _flat_toc(toc) -> list:
    out = []
    for x in toc or []:
        if isinstance(x, (list, tuple)):
            out += _flat_toc(list(x))
        else:
            out.append(x)
    return out


def read_book(text: str | None = None, path: str | os.PathLike | None = None) -> list[Chapter]:
    """The chapters of pasted `text` or of the file at `path` (.txt, .md, .epub). TTSError with a message for the
    user on anything that cannot be read (empty, binary, too big, too many chapters); the file is only read."""
    if path:
        p = Path(path)
        try:
            size = p.stat().st_size
        except OSError:
            raise TTSError("the uploaded file could not be read; upload it again") from None
        if size > MAX_FILE_BYTES:
            raise TTSError(f"the file is too big: {size / 2**20:.1f} MiB; the limit is {MAX_FILE_BYTES // 2**20} MiB")
        ext = p.suffix.lower()
        if ext == ".epub":
            chapters = _epub_chapters(p)
        elif ext in TEXT_EXT or not ext:
            with open(p, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
            chapters = _text_chapters(_decode(data, "file"))
        else:
            raise TTSError(f"unsupported file type {ext!r}: upload a .txt, .md or .epub file")
    else:
        t = text if isinstance(text, str) else ""
        if not t.strip():
            raise TTSError("paste some text or upload a book (.txt, .md or .epub)")
        chapters = _text_chapters(t)
    return check_chapters(chapters)


def _text_chapters(text: str) -> list[Chapter]:
    if len(text) > MAX_BOOK_CHARS:
        raise TTSError(f"the book is too long: {len(text)} characters; the limit is {MAX_BOOK_CHARS}. Split it "
                       "into parts.")
    return split_chapters(text)


def check_chapters(chapters: list[Chapter]) -> list[Chapter]:
    chapters = [c for c in chapters if c.paragraphs or c.title.strip()]
    if not chapters or not any(re.search(r"\w", c.text + c.title) for c in chapters):
        raise TTSError("there is no text to read")
    if len(chapters) > MAX_CHAPTERS:
        raise TTSError(f"the book has {len(chapters)} chapters; the limit is {MAX_CHAPTERS}: merge some in the "
                       "chapter list, or split the book into parts")
    total = sum(len(c.text) + len(c.title) for c in chapters)
    if total > MAX_BOOK_CHARS:
        raise TTSError(f"the book is too long: {total} characters; the limit is {MAX_BOOK_CHARS}. Split it.")
    return chapters


# the editable chapter list (the page's table): one row per chapter
TABLE_HEADERS = ["Title", "Voice", "Text"]


def to_rows(chapters: list[Chapter]) -> list[list[str]]:
    return [[c.title, c.voice, c.text] for c in chapters]


def from_rows(rows) -> list[Chapter]:
    """The table back into chapters (empty rows dropped; paragraphs are separated by blank lines)."""
    if hasattr(rows, "values") and hasattr(rows, "columns"):      # a pandas DataFrame
        rows = rows.values.tolist()
    elif isinstance(rows, dict):                                   # the page's value: {"headers", "data"}
        rows = rows.get("data") or []
    out = []
    for row in rows or []:
        cells = ["" if x is None or (isinstance(x, float) and x != x) else str(x) for x in list(row)[:3]]
        cells += [""] * (3 - len(cells))
        title, voice, text = (c.strip() for c in cells)
        if not (title or text):
            continue
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
        out.append(Chapter(title or f"Chapter {len(out) + 1}", paras, voice))
    return out


# --- the job ---------------------------------------------------------------------------------------------------

@dataclass
class Segment:
    text: str
    pause_after: float             # seconds of silence after it in the chapter file (none after the last)
    seed: int | None = None        # None: the chapter's seed (a redone segment may have its own)
    samples: int = 0               # > 0: finished, its WAV is on disk

    @property
    def done(self) -> bool:
        return self.samples > 0


@dataclass
class ChapterJob:
    title: str
    voice: str
    seed: int
    segments: list[Segment]
    built: str = ""                # the fingerprint of the segments its files were built from


@dataclass
class Settings:
    language: str = "auto"
    sampling: dict = field(default_factory=dict)
    max_new_tokens: int = 2048
    target_lufs: float = TARGET_LUFS
    speak_titles: bool = True


def segments_of(chapter: Chapter, split: Callable[[str], list[str]], speak_title: bool = True) -> list[Segment]:
    """A chapter's segments: its title (if spoken), then each paragraph's sentence groups (`split`, the page's
    `chunk_text`); the pause after each is the paragraph pause at a paragraph's end, or what a pause tag in the text
    asks for (serving/text_prep.py; a bad tag raises TextPrepError, a clear message). Segments keep the text as
    written (subtitles, the job's list); what the model reads is made from it at render time."""
    segs: list[Segment] = []
    if speak_title and chapter.title.strip():
        segs += [Segment(t, SENTENCE_PAUSE_S) for t in split(chapter.title)]
        if segs:
            segs[-1].pause_after = TITLE_PAUSE_S
    for para in chapter.paragraphs:
        pieces = []
        for run, pause in split_pauses(para):   # a pause tag ([pause 1s]) gives exactly its silence after its run
            got = [Segment(t, SENTENCE_PAUSE_S) for t in split(run)] if run.strip() else []
            if pause is not None:
                if got:
                    got[-1].pause_after = pause
                elif pieces:
                    pieces[-1].pause_after += pause
            pieces += got
        if pieces and pieces[-1].pause_after == SENTENCE_PAUSE_S:
            pieces[-1].pause_after = PARAGRAPH_PAUSE_S
        segs += pieces
    if not segs:
        raise TTSError(f"the chapter “{chapter.title}” has no text to read")
    return segs


def check_job_id(job_id) -> str:
    jid = str(job_id or "").strip()
    if not ID_RE.match(jid):
        raise TTSError("unknown job: choose one from the list of jobs")
    return jid


class Job:
    """One long-form job in its own folder; every method keeps `job.json` and the files consistent on disk."""

    def __init__(self, folder: Path, data: dict):
        self.folder, self.id = Path(folder), Path(folder).name
        self.title: str = data.get("title", "")
        self.created: float = data.get("created", now())
        self.updated: float = data.get("updated", self.created)   # last change (a segment, a build, a redo)
        self.settings = Settings(**data.get("settings", {}))
        self.chapters = [ChapterJob(c["title"], c["voice"], int(c["seed"]), [Segment(**s) for s in c["segments"]],
                                    c.get("built", "")) for c in data.get("chapters", [])]
        self.state: str = data.get("state", "new")
        self._lock = threading.RLock()

    # -- on disk
    @classmethod
    def create(cls, root: Path, title: str, chapters: list[Chapter], voices: list[str], seed: int,
               settings: Settings, split: Callable[[str], list[str]]) -> "Job":
        chapters = check_chapters(chapters)
        jobs = [ChapterJob(c.title, v, seed, segments_of(c, split, settings.speak_titles))
                for c, v in zip(chapters, voices)]
        folder = Path(root) / uuid.uuid4().hex
        (folder / "segments").mkdir(parents=True)
        job = cls(folder, {"title": title, "settings": asdict(settings)})
        job.chapters = jobs
        job.save()
        return job

    @classmethod
    def load(cls, root: Path, job_id: str) -> "Job":
        folder = Path(root) / check_job_id(job_id)
        try:
            data = json.loads((folder / "job.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise TTSError("that job no longer exists (or its folder was removed)") from None
        return cls(folder, data)

    def save(self) -> None:
        with self._lock:
            self.updated = now()
            data = {"title": self.title, "created": self.created, "updated": self.updated, "state": self.state,
                    "settings": asdict(self.settings),
                    "chapters": [{"title": c.title, "voice": c.voice, "seed": c.seed, "built": c.built,
                                  "segments": [asdict(s) for s in c.segments]} for c in self.chapters]}
            _write_atomic(self.folder / "job.json", json.dumps(data, ensure_ascii=False, indent=1).encode())

    def segment_path(self, ci: int, si: int) -> Path:
        return self.folder / "segments" / f"c{ci + 1:03d}_s{si + 1:04d}.wav"

    @property
    def out(self) -> Path:
        return self.folder / "out"

    # -- progress
    def pending(self, chapters: list[int] | None = None) -> list[tuple[int, int]]:
        """(chapter, segment) of every unfinished segment, in order (of `chapters` only, when given)."""
        return [(ci, si) for ci, c in enumerate(self.chapters) if chapters is None or ci in chapters
                for si, s in enumerate(c.segments) if not s.done]

    def counts(self) -> dict:
        segs = [s for c in self.chapters for s in c.segments]
        done_chars = sum(len(s.text) for s in segs if s.done)
        return {"chapters": len(self.chapters),
                "chapters_done": sum(all(s.done for s in c.segments) for c in self.chapters),
                "segments": len(segs), "segments_done": sum(s.done for s in segs),
                "audio_s": sum(s.samples for s in segs) / SR, "chars": sum(len(s.text) for s in segs),
                "chars_done": done_chars}

    def seed_of(self, ci: int, si: int) -> int:
        s = self.chapters[ci].segments[si]
        return self.chapters[ci].seed if s.seed is None else s.seed

    def save_segment(self, ci: int, si: int, pcm: np.ndarray) -> None:
        """A finished segment (int16 mono at 24 kHz) onto disk: the WAV first (atomically), then job.json."""
        pcm = np.asarray(pcm, dtype=np.int16)
        buf = io.BytesIO()
        sf.write(buf, pcm, SR, format="WAV", subtype="PCM_16")
        with self._lock:
            _write_atomic(self.segment_path(ci, si), buf.getvalue())
            self.chapters[ci].segments[si].samples = max(1, len(pcm))
            self.save()

    def redo(self, ci: int, si: int, text: str | None = None, seed: int | None = None) -> None:
        """Forget segment (ci, si) so that it is rendered again: with new text and/or its own seed."""
        if not 0 <= ci < len(self.chapters):
            raise TTSError(f"there is no chapter {ci + 1}: the job has {len(self.chapters)}")
        segs = self.chapters[ci].segments
        if not 0 <= si < len(segs):
            raise TTSError(f"chapter {ci + 1} has no segment {si + 1}: it has {len(segs)}")
        seg = segs[si]
        if text is not None and text.strip():
            if len(text) > MAX_SEGMENT_CHARS:
                raise TTSError(f"the segment's text is too long: {len(text)} characters; the limit is "
                               f"{MAX_SEGMENT_CHARS}")
            seg.text = " ".join(text.split())
        if seed is not None:
            seg.seed = int(seed)
        seg.samples = 0
        self.segment_path(ci, si).unlink(missing_ok=True)
        self.save()

    def segment_audio(self, ci: int, si: int) -> np.ndarray:
        pcm, _ = sf.read(str(self.segment_path(ci, si)), dtype="int16")
        return pcm

    def shown_state(self, running: bool = False) -> str:
        """The state to show: "rendering" only while a render runs (a process that died mid-render left it)."""
        return "rendering" if running else ("stopped" if self.state == "rendering" else self.state)

    def describe(self, retention: "Retention | None" = None, running: bool = False) -> str:
        k = self.counts()
        exp = retention.expires(self) if retention is not None and not running else None
        until = "" if exp is None else f" · kept until {time.strftime('%Y-%m-%d', time.localtime(exp))}"
        return (f"{self.title or 'untitled'} · {k['chapters_done']}/{k['chapters']} chapters · "
                f"{_clock(k['audio_s'])} · {self.shown_state(running)} · "
                f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(self.created))}{until}")

    # -- output
    def _fingerprint(self, ci: int) -> str:
        c = self.chapters[ci]
        h = hashlib.sha1(json.dumps([self.settings.target_lufs, [(s.text, s.pause_after, self.seed_of(ci, i),
                                                                  s.samples) for i, s in
                                                                 enumerate(c.segments)]]).encode())
        return h.hexdigest()[:16]

    def chapter_name(self, ci: int) -> str:
        safe = re.sub(r"[^\w-]+", "_", self.chapters[ci].title, flags=re.UNICODE).strip("_")[:40] or "chapter"
        return f"{ci + 1:02d}_{safe}"

    def build_chapter(self, ci: int) -> tuple[np.ndarray, list[Cue], dict]:
        """Chapter `ci` from its segment files: trimmed, paused, lead-in and tail, loudness-normalised; its FLAC,
        MP3, SRT and WebVTT written into out/. -> (float32 audio, cues, loudness report)."""
        c = self.chapters[ci]
        if not all(s.done for s in c.segments):
            raise TTSError(f"chapter {ci + 1} is not finished")
        pieces, cues, n = [np.zeros(int(LEAD_IN_S * SR), np.float32)], [], int(LEAD_IN_S * SR)
        for si, s in enumerate(c.segments):
            x = trim_silence(self.segment_audio(ci, si).astype(np.float32) / 32767.0)
            cues.append(Cue(n / SR, (n + len(x)) / SR, s.text))
            pieces.append(x)
            n += len(x)
            gap = int(round((s.pause_after if si + 1 < len(c.segments) else TAIL_S) * SR))
            pieces.append(np.zeros(gap, np.float32))
            n += gap
        audio, report = normalize_loudness(np.concatenate(pieces), SR, self.settings.target_lufs)
        self.out.mkdir(exist_ok=True)
        name = self.chapter_name(ci)
        write_audio(self.out / f"{name}.flac", audio)
        if mp3_available():
            write_audio(self.out / f"{name}.mp3", audio)
        _write_atomic(self.out / f"{name}.srt", to_srt(cues).encode())
        _write_atomic(self.out / f"{name}.vtt", to_vtt(cues).encode())
        c.built = self._fingerprint(ci)
        self.save()
        return audio, cues, report

    def chapter_built(self, ci: int) -> bool:
        c = self.chapters[ci]
        return bool(c.built) and c.built == self._fingerprint(ci) and (self.out / f"{self.chapter_name(ci)}.flac").exists()

    def build(self, on_chapter: Callable[[int], None] | None = None) -> dict:
        """Every finished chapter's files (rebuilt only where a segment changed), then, when all are finished, the
        whole book, chapters.json, the .m4b (with ffmpeg) and the zip. -> summary with the zip's path (or None)."""
        with self._lock:
            reports = {}
            for ci, c in enumerate(self.chapters):
                if all(s.done for s in c.segments) and not self.chapter_built(ci):
                    _a, _c, reports[ci] = self.build_chapter(ci)
                    if on_chapter:
                        on_chapter(ci)
            if not all(s.done for c in self.chapters for s in c.segments):
                self.state = "stopped" if any(s.done for c in self.chapters for s in c.segments) else "new"
                self.save()
                return {"zip": None, "reports": reports}
            whole, entries, cues, t = [], [], [], 0.0
            for ci in range(len(self.chapters)):
                name = self.chapter_name(ci)
                audio, _ = sf.read(str(self.out / f"{name}.flac"), dtype="float32")
                ch_cues = _read_cues(self.out / f"{name}.srt")
                entries.append({"index": ci + 1, "title": self.chapters[ci].title, "start": round(t, 3),
                                "duration": round(len(audio) / SR, 3), "file": f"{name}.flac",
                                "voice": self.chapters[ci].voice, "seed": self.chapters[ci].seed})
                cues += [Cue(q.start + t, q.end + t, q.text) for q in ch_cues]
                whole.append(audio)
                t += len(audio) / SR
            book = np.concatenate(whole)
            write_audio(self.out / "book.flac", book)
            if mp3_available():
                write_audio(self.out / "book.mp3", book)
            _write_atomic(self.out / "book.srt", to_srt(cues).encode())
            _write_atomic(self.out / "book.vtt", to_vtt(cues).encode())
            meta = {"title": self.title, "sample_rate": SR, "duration": round(t, 3),
                    "loudness_target_lufs": self.settings.target_lufs, "true_peak_max_dbtp": TRUE_PEAK_DBTP,
                    "chapters": entries}
            _write_atomic(self.out / "chapters.json", json.dumps(meta, ensure_ascii=False, indent=1).encode())
            m4b = write_m4b(self.out / "book.m4b", self.out / "book.flac", entries, self.title)
            zpath = self._zip()
            self.state = "done"
            self.save()
            return {"zip": zpath, "reports": reports, "m4b": m4b, "duration": t}

    def _zip(self) -> Path:
        names = [self.chapter_name(ci) for ci in range(len(self.chapters))]
        files = [f"{n}.{e}" for n in names for e in ("flac", "mp3", "srt", "vtt")]
        files += ["book.flac", "book.mp3", "book.srt", "book.vtt", "book.m4b", "chapters.json"]
        zpath = self.out / f"{_safe(self.title) or 'book'}.zip"
        tmp = zpath.with_suffix(".zip.part")
        with zipfile.ZipFile(tmp, "w") as z:
            for f in files:
                p = self.out / f
                if p.exists():
                    packed = f.endswith((".srt", ".vtt", ".json"))
                    z.write(p, f, compress_type=zipfile.ZIP_DEFLATED if packed else zipfile.ZIP_STORED)
        os.replace(tmp, zpath)
        return zpath


def _safe(name: str) -> str:
    return re.sub(r"[^\w-]+", "_", name or "", flags=re.UNICODE).strip("_")[:60]


def _read_cues(path: Path) -> list[Cue]:
    from serving.subtitles import parse_srt
    return parse_srt(path.read_text(encoding="utf-8")) if path.stat().st_size else []


def list_jobs(root: Path) -> list[Job]:
    """Every job under `root`, newest first (a folder without a readable job.json is skipped)."""
    out = []
    if Path(root).is_dir():
        for d in Path(root).iterdir():
            if ID_RE.match(d.name) and (d / "job.json").exists():
                try:
                    out.append(Job.load(root, d.name))
                except TTSError:
                    continue
    return sorted(out, key=lambda j: -j.created)


# --- retention: jobs expire ----------------------------------------------------------------------------------

def now() -> float:
    """The clock of job times and expiry (a test replaces it)."""
    return time.time()


RECENT_S = 3600.0          # a job changed this recently is never removed (it may be rendering in another process)
SWEEP_EVERY_S = 3600.0     # how often a running server looks for expired jobs (besides at start and new jobs)
ENV_KEEP_DAYS = "TTS_LONGFORM_KEEP_DAYS"
ENV_KEEP_UNFINISHED_DAYS = "TTS_LONGFORM_KEEP_UNFINISHED_DAYS"
ENV_MAX_GB = "TTS_LONGFORM_MAX_GB"


@dataclass(frozen=True)
class Retention:
    """How long jobs are kept. A finished job is removed `keep_days` after its last change (its last segment, build
    or redo), an unfinished one (new or stopped) after `keep_unfinished_days`; while all jobs together pass
    `max_bytes` on disk, finished jobs go oldest first, then unfinished ones idle for a day or more. A job being
    rendered, or changed within the last hour, is never removed. 0 (or less): no such limit."""
    keep_days: float = 7.0
    keep_unfinished_days: float = 30.0
    max_bytes: int = 20 * 2**30

    @classmethod
    def from_env(cls, env=None) -> "Retention":
        """TTS_LONGFORM_KEEP_DAYS, TTS_LONGFORM_KEEP_UNFINISHED_DAYS, TTS_LONGFORM_MAX_GB (docs/configuration.md);
        a value that is not a number is reported in the log and the default kept."""
        env = os.environ if env is None else env
        d = cls()

        def num(name: str, default: float) -> float:
            raw = str(env.get(name, "") or "").strip()
            if not raw:
                return default
            try:
                v = float(raw)
                if v != v:
                    raise ValueError
                return v
            except ValueError:
                log.warning("%s=%r is not a number; using %g", name, raw, default)
                return default

        return cls(num(ENV_KEEP_DAYS, d.keep_days), num(ENV_KEEP_UNFINISHED_DAYS, d.keep_unfinished_days),
                   int(num(ENV_MAX_GB, d.max_bytes / 2**30) * 2**30))

    def keep_s(self, job: "Job") -> float | None:
        days = self.keep_days if job.state == "done" else self.keep_unfinished_days
        return days * 86400 if days > 0 else None

    def expires(self, job: "Job") -> float | None:
        """When `job` expires by age (None: never; the disk limit may remove it sooner)."""
        keep = self.keep_s(job)
        return None if keep is None else job.updated + keep

    def describe(self) -> str:
        def days(d):
            return "forever" if d <= 0 else f"{d:g} days"
        return (f"finished jobs kept {days(self.keep_days)}, unfinished {days(self.keep_unfinished_days)}, "
                + (f"at most {self.max_bytes / 2**30:g} GiB in all" if self.max_bytes > 0 else "no disk limit"))


def folder_bytes(folder: Path) -> int:
    total = 0
    for p in Path(folder).rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def _remove(folder: Path) -> bool:
    """A job's folder away: renamed first (a reader sees the job gone at once, never half of it), then deleted."""
    trash = folder.with_name(f".removed-{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(folder, trash)
    except OSError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def cleanup(root: Path, retention: Retention, running=(), at: float | None = None) -> list[tuple[str, str]]:
    """Remove the jobs under `root` that `retention` lets go (its doc) -> [(job id, why)]. `running`: ids of the
    jobs being rendered now (never removed); `at`: the time to judge by (default `now()`). Also clears leftovers:
    folders of a removal that was cut short, and job folders without a readable job.json older than a day."""
    root = Path(root)
    if not root.is_dir():
        return []
    t = now() if at is None else at
    removed: list[tuple[str, str]] = []
    for d in root.iterdir():
        if d.name.startswith(".removed-") and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        elif ID_RE.match(d.name) and d.is_dir() and not (d / "job.json").exists():
            try:
                if t - d.stat().st_mtime > 86400 and _remove(d):
                    removed.append((d.name, "no job.json"))
            except OSError:
                continue
    protected = set(running)
    kept: list[Job] = []
    for job in list_jobs(root):
        if job.id in protected or t - job.updated < RECENT_S:
            continue
        exp = retention.expires(job)
        if exp is not None and t >= exp:
            if _remove(job.folder):
                removed.append((job.id, f"{'finished' if job.state == 'done' else 'unfinished'}, "
                                        f"last changed {(t - job.updated) / 86400:.1f} days ago"))
            continue
        kept.append(job)
    if retention.max_bytes > 0:
        sizes = {d.name: folder_bytes(d) for d in root.iterdir() if ID_RE.match(d.name) and d.is_dir()}
        total = sum(sizes.values())
        if total > retention.max_bytes:
            order = sorted((j for j in kept if j.state == "done"), key=lambda j: j.updated) + \
                sorted((j for j in kept if j.state != "done" and t - j.updated >= 86400), key=lambda j: j.updated)
            for job in order:
                if total <= retention.max_bytes:
                    break
                if _remove(job.folder):
                    total -= sizes.get(job.id, 0)
                    removed.append((job.id, f"over the disk limit ({retention.max_bytes / 2**30:g} GiB), oldest "
                                            "first"))
            if total > retention.max_bytes:
                log.warning("long-form jobs use %.1f GiB, over the %.1f GiB limit (the rest are being rendered or "
                            "unfinished and recent)", total / 2**30, retention.max_bytes / 2**30)
    for jid, why in removed:
        log.info("long-form job %s removed: %s", jid, why)
    return removed


class Sweeper:
    """`cleanup` at start and every `every_s` seconds on a daemon thread, for one jobs folder (one per folder in
    a process: `Sweeper.start` returns the running one)."""

    _by_root: dict[Path, "Sweeper"] = {}
    _lock = threading.Lock()

    def __init__(self, root: Path, retention: Retention, running: Callable[[], set], every_s: float):
        self.root, self.retention, self.running, self.every_s = Path(root), retention, running, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="longform-sweeper", daemon=True)

    @classmethod
    def start(cls, root: Path, retention: Retention, running: Callable[[], set],
              every_s: float = SWEEP_EVERY_S) -> "Sweeper":
        """Clean `root` now (in the caller) and then periodically; the same folder's sweeper is shared."""
        key = Path(root).resolve()
        with cls._lock:
            sw = cls._by_root.get(key)
            if sw is not None and sw.thread.is_alive():
                sw.retention, sw.running = retention, running
                sw.sweep()
                return sw
            sw = cls._by_root[key] = cls(key, retention, running, every_s)
        sw.sweep()
        sw.thread.start()
        return sw

    def sweep(self) -> list[tuple[str, str]]:
        try:
            return cleanup(self.root, self.retention, self.running())
        except Exception as e:       # a sweep never takes the server down; the next one tries again
            log.warning("long-form cleanup failed: %s", e)
            return []

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sweep()


def _write_atomic(path: Path, data: bytes) -> None:
    """A file that is either whole or absent: written beside and renamed (a killed process leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# --- audio: trimming, loudness, files ---------------------------------------------------------------------------

def trim_silence(x: np.ndarray, threshold_db: float = SILENCE_DB, keep_s: float = 0.01) -> np.ndarray:
    """`x` without the silence at its ends: what lies more than `threshold_db` below its peak (in 10 ms windows),
    keeping `keep_s` around the first and last sound."""
    if len(x) == 0:
        return x
    win = int(0.01 * SR)
    n = len(x) // win
    if n == 0:
        return x
    rms = np.sqrt(np.mean(x[:n * win].reshape(n, win).astype(np.float64) ** 2, axis=1) + 1e-20)
    level = 20 * np.log10(rms)
    loud = np.nonzero(level > level.max() + threshold_db)[0]
    if len(loud) == 0:
        return x[:0]
    keep = int(keep_s * SR)
    a = max(0, loud[0] * win - keep)
    b = min(len(x), (loud[-1] + 1) * win + keep)
    return x[a:b]


def true_peak_db(x: np.ndarray) -> float:
    """The true peak (dBTP, ITU-R BS.1770-4 annex 2: 4x oversampled)."""
    from scipy.signal import resample_poly

    if len(x) == 0:
        return -np.inf
    up = resample_poly(np.asarray(x, np.float64), 4, 1)
    peak = max(float(np.max(np.abs(up))), float(np.max(np.abs(x))))
    return 20 * np.log10(peak) if peak > 0 else -np.inf


def _limit(x: np.ndarray, ceiling_db: float) -> np.ndarray:
    """A look-ahead peak limiter: gain reduction where the 4x-oversampled peak would pass `ceiling_db`, attacked over
    5 ms before a peak and released over 50 ms after it (no clipping, no pumping of the quiet parts)."""
    from scipy.ndimage import maximum_filter1d, uniform_filter1d
    from scipy.signal import resample_poly

    ceil = 10 ** (ceiling_db / 20)
    up = np.abs(resample_poly(np.asarray(x, np.float64), 4, 1))
    env = up[: 4 * len(x)].reshape(len(x), 4).max(axis=1) if len(up) >= 4 * len(x) else np.abs(x)
    need = np.minimum(1.0, ceil / np.maximum(env, 1e-12))
    att, rel = int(0.005 * SR) | 1, int(0.05 * SR) | 1
    g = -maximum_filter1d(-need, size=2 * rel + 1)          # held over the release time: no quick recoveries
    g = uniform_filter1d(g, size=att)                       # smoothed over the attack
    g = np.minimum(g, need)                                 # never above what a peak needs
    return (x * g).astype(np.float32)


def normalize_loudness(x: np.ndarray, sr: int, target_lufs: float = TARGET_LUFS,
                       ceiling_db: float = TRUE_PEAK_DBTP) -> tuple[np.ndarray, dict]:
    """`x` at `target_lufs` integrated loudness (BS.1770, pyloudnorm) with its true peak at most `ceiling_db`:
    a gain, then the peak limiter where a peak passes the ceiling, then the gain corrected again (up to 3 times).
    Audio too short to measure (< 0.4 s of sound) is left as it is. -> (audio, report)."""
    import pyloudnorm

    meter = pyloudnorm.Meter(sr)
    x = np.asarray(x, np.float32)
    if len(x) < int(0.4 * sr) + 1:
        return x, {"lufs": None, "note": "too short to measure"}
    before = meter.integrated_loudness(x.astype(np.float64))
    if not np.isfinite(before):
        return x, {"lufs": None, "note": "silent"}
    y, loud = x, before
    for _ in range(4):
        y = (y * 10 ** ((target_lufs - loud) / 20)).astype(np.float32)
        if true_peak_db(y) > ceiling_db:
            y = _limit(y, ceiling_db - 0.1)
        loud = meter.integrated_loudness(y.astype(np.float64))
        if abs(loud - target_lufs) < 0.1:
            break
    return y, {"lufs": round(float(loud), 2), "before_lufs": round(float(before), 2),
               "true_peak_dbtp": round(float(true_peak_db(y)), 2)}


def mp3_available() -> bool:
    return "MP3" in sf.available_formats()


def write_audio(path: Path, x: np.ndarray) -> None:
    """FLAC (16-bit), MP3 (libsndfile's LAME, ~128 kb/s) or WAV by the suffix, written atomically."""
    fmt = {".flac": ("FLAC", "PCM_16"), ".mp3": ("MP3", "MPEG_LAYER_III"), ".wav": ("WAV", "PCM_16")}[path.suffix]
    buf = io.BytesIO()
    sf.write(buf, np.clip(x, -1, 1), SR, format=fmt[0], subtype=fmt[1])
    _write_atomic(path, buf.getvalue())


def ffmpeg() -> str | None:
    return shutil.which("ffmpeg")


def write_m4b(path: Path, source: Path, chapters: list[dict], title: str) -> Path | None:
    """The book as an .m4b (AAC) with chapter marks, where an ffmpeg executable exists; else None."""
    exe = ffmpeg()
    if exe is None:
        return None
    lines = [";FFMETADATA1", f"title={_ffesc(title or 'Audiobook')}"]
    for e in chapters:
        start, end = int(e["start"] * 1000), int((e["start"] + e["duration"]) * 1000)
        lines += ["[CHAPTER]", "TIMEBASE=1/1000", f"START={start}", f"END={end}", f"title={_ffesc(e['title'])}"]
    meta = path.with_suffix(".ffmeta")
    meta.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp = path.with_suffix(".part.m4b")
    try:
        subprocess.run([exe, "-y", "-loglevel", "error", "-i", str(source), "-i", str(meta), "-map_metadata", "1",
                        "-map_chapters", "1", "-c:a", "aac", "-b:a", "64k", "-f", "mp4", str(tmp)],
                       check=True, capture_output=True, timeout=3600)
        os.replace(tmp, path)
        return path
    except (subprocess.SubprocessError, OSError) as e:
        log.warning("m4b not written: %s", e)
        tmp.unlink(missing_ok=True)
        return None
    finally:
        meta.unlink(missing_ok=True)


def _ffesc(s: str) -> str:
    return re.sub(r"([=;#\\\n])", r"\\\1", s)
