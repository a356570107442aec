"""Subtitles: cues (start, end, text) as SRT and WebVTT, and SRT read back in (for dubbing, serving/dubbing.py).

Cues are timed from the samples the engine made: the generation loop (ui/speak.py) records, for each sentence group,
where its audio starts and ends in what it emitted; a long-form chapter (serving/longform.py) knows where it placed
each segment. Nothing here guesses timing from text. `estimated=True` marks cues that a transcriber aligned (word
level): the files then say so in a note (WebVTT) or a first cue (SRT has no comments)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tts_engine import TTSError

MAX_SRT_CHARS = 200_000        # an SRT file read for dubbing (a feature film's is ~100 kB)
MAX_CUES = 500
SENTENCE_PAUSE_S = 0.12        # between the sentences of a subtitled API answer (the page's pause between groups)


@dataclass(frozen=True)
class Cue:
    start: float          # seconds
    end: float
    text: str


def cues_from_spans(spans: list[tuple[str, int, int]], sr: int, offset_s: float = 0.0) -> list[Cue]:
    """[(text, first sample, end sample)] of the audio made for each text -> cues (empty spans dropped)."""
    return [Cue(offset_s + a / sr, offset_s + b / sr, text) for text, a, b in spans if b > a and text.strip()]


def _stamp(t: float, sep: str) -> str:
    ms = max(0, int(round(t * 1000)))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _one_line(text: str) -> str:
    # a blank line would end the cue early; "-->" would read as a timing line
    return re.sub(r"\n\s*\n+", "\n", text.strip()).replace("-->", "→")


def to_srt(cues: list[Cue], estimated: bool = False) -> str:
    out, n = [], 1
    if estimated and cues:
        out.append(f"1\n{_stamp(0, ',')} --> {_stamp(0.001, ',')}\n"
                   "[word timings estimated by speech recognition]\n")
        n = 2
    for i, c in enumerate(cues):
        out.append(f"{n + i}\n{_stamp(c.start, ',')} --> {_stamp(c.end, ',')}\n{_one_line(c.text)}\n")
    return "\n".join(out)


def to_vtt(cues: list[Cue], estimated: bool = False) -> str:
    head = "WEBVTT\n\n" + ("NOTE word timings estimated by speech recognition\n\n" if estimated else "")
    return head + "\n".join(f"{i + 1}\n{_stamp(c.start, '.')} --> {_stamp(c.end, '.')}\n{_one_line(c.text)}\n"
                            for i, c in enumerate(cues))


_TIME = r"(\d{1,2}):(\d{2}):(\d{2})[,.](\d{1,3})"
_TIMING = re.compile(rf"^\s*{_TIME}\s*-->\s*{_TIME}")


def _seconds(h, m, s, ms) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms.ljust(3, "0")) / 1000


def parse_srt(text: str) -> list[Cue]:
    """An SRT file's cues, in order. A malformed file raises TTSError naming the line and what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise TTSError("the SRT file is empty")
    if len(text) > MAX_SRT_CHARS:
        raise TTSError(f"the SRT file is too long: {len(text)} characters; the limit is {MAX_SRT_CHARS}")
    if "\x00" in text:
        raise TTSError("the SRT file is not text")
    lines = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    cues, i, n = [], 0, len(lines)
    while i < n:
        if not lines[i].strip():
            i += 1
            continue
        block_start = i + 1
        if lines[i].strip().isdigit():          # the cue number (optional in practice)
            i += 1
        if i >= n or not (m := _TIMING.match(lines[i])):
            raise TTSError(f"the SRT file is malformed at line {block_start}: expected a cue number and a timing "
                           "line such as 00:00:01,000 --> 00:00:03,500")
        start, end = _seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])
        if end < start:
            raise TTSError(f"the SRT cue at line {i + 1} ends before it starts ({lines[i].strip()})")
        i += 1
        words = []
        while i < n and lines[i].strip():
            words.append(re.sub(r"<[^>]+>|\{[^}]*\}", "", lines[i]).strip())
            i += 1
        body = " ".join(w for w in words if w)
        if not body:
            raise TTSError(f"the SRT cue at line {block_start} has no text")
        cues.append(Cue(start, end, body))
        if len(cues) > MAX_CUES:
            raise TTSError(f"the SRT file has more than {MAX_CUES} cues; split it")
    if not cues:
        raise TTSError("the SRT file has no cues")
    for a, b in zip(cues, cues[1:]):
        if b.start < a.start:
            raise TTSError(f"the SRT cues are not in time order (“{b.text[:40]}” starts before “{a.text[:40]}”)")
    return cues


def speak_with_cues(engine, sentences: list[str], sr: int, seed: int | None = None, pause_s: float = SENTENCE_PAUSE_S,
                    **stream_kw):
    """`sentences` spoken one engine request each, with one seed (the first request's, when `seed` is None) and
    `pause_s` between them: -> (float32 audio, cues timed from each request's samples, seed used). For an answer of
    the speech API that carries subtitles (server/openai_api.py)."""
    import numpy as np

    out, cues, n = [], [], 0
    for i, text in enumerate(sentences):
        if i:
            gap = np.zeros(int(round(pause_s * sr)), np.float32)
            out.append(gap)
            n += len(gap)
        stream = engine.stream(text, seed=seed, **stream_kw)
        try:
            pcm = [np.asarray(x, np.float32) for x in stream]
        finally:
            stream.cancel()
        seed = stream.seed if seed is None else seed
        m = sum(len(x) for x in pcm)
        out += pcm
        if m:
            cues.append(Cue(n / sr, (n + m) / sr, text))
        n += m
    return (np.concatenate(out) if out else np.zeros(0, np.float32)), cues, seed
