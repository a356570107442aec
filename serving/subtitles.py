"""Subtitles: cues (start, end, text) as SRT and WebVTT, and SRT read back in (for dubbing, serving/dubbing.py).

Cues are timed from the samples the engine made: the generation loop (ui/speak.py) records, for each sentence group,
where its audio starts and ends in what it emitted; a long-form chapter (serving/longform.py) knows where it placed
each segment. Nothing here guesses timing from text. `estimated=True` marks cues that a transcriber aligned (word
level): the files then say so in a note (WebVTT) or a first cue (SRT has no comments). SRT is composed and read by
the `srt` library; WebVTT (the same cues, a header and dotted timings) is written here."""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import srt

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


def _delta(t: float) -> timedelta:
    return timedelta(milliseconds=max(0, int(round(t * 1000))))      # to the nearest millisecond, as written


def _one_line(text: str) -> str:
    # a blank line would end the cue early; "-->" would read as a timing line
    return re.sub(r"\n\s*\n+", "\n", text.strip()).replace("-->", "→")


ESTIMATED_NOTE = "[word timings estimated by speech recognition]"


def to_srt(cues: list[Cue], estimated: bool = False) -> str:
    """SRT (the `srt` library's composer): numbered from 1; `estimated`: a first cue says the timings are
    estimated (SRT has no comments)."""
    subs = [srt.Subtitle(0, _delta(0), _delta(0.001), ESTIMATED_NOTE)] if estimated and cues else []
    subs += [srt.Subtitle(0, _delta(c.start), _delta(c.end), _one_line(c.text)) for c in cues]
    return srt.compose(subs, reindex=True, start_index=1)


def _vtt_stamp(t: float) -> str:
    return srt.timedelta_to_srt_timestamp(_delta(t)).replace(",", ".")


def to_vtt(cues: list[Cue], estimated: bool = False) -> str:
    """WebVTT: the header, a NOTE when `estimated`, one numbered cue each (the SRT timings with a dot)."""
    head = "WEBVTT\n\n" + (f"NOTE {ESTIMATED_NOTE[1:-1]}\n\n" if estimated else "")
    return head + "\n".join(f"{i + 1}\n{_vtt_stamp(c.start)} --> {_vtt_stamp(c.end)}\n{_one_line(c.text)}\n"
                            for i, c in enumerate(cues))


def parse_srt(text: str) -> list[Cue]:
    """An SRT file's cues, in order. Cues are the file's blocks (lines between blank lines), each read by the `srt`
    library (optional number, timing line, text); a malformed file raises TTSError naming the line and what is
    wrong (a block that is no cue, such as text after a blank line, is refused, never spoken as part of a cue)."""
    if not isinstance(text, str) or not text.strip():
        raise TTSError("the SRT file is empty")
    if len(text) > MAX_SRT_CHARS:
        raise TTSError(f"the SRT file is too long: {len(text)} characters; the limit is {MAX_SRT_CHARS}")
    if "\x00" in text:
        raise TTSError("the SRT file is not text")
    lines = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    cues: list[Cue] = []
    i, n = 0, len(lines)
    while i < n:
        if not lines[i].strip():
            i += 1
            continue
        first = i
        while i < n and lines[i].strip():
            i += 1
        block = "\n".join(lines[first:i]) + "\n"
        try:
            subs = list(srt.parse(block))
        except srt.SRTParseError as e:
            at = first + 1 + block.count("\n", 0, e.expected_start)
            raise TTSError(f"the SRT file is malformed at line {at}: expected a cue number and a timing line such "
                           "as 00:00:01,000 --> 00:00:03,500") from None
        if not subs:
            raise TTSError(f"the SRT file is malformed at line {first + 1}: expected a cue number and a timing "
                           "line such as 00:00:01,000 --> 00:00:03,500")
        for sub in subs:
            start, end = sub.start.total_seconds(), sub.end.total_seconds()
            stamp = f"{srt.timedelta_to_srt_timestamp(sub.start)} --> {srt.timedelta_to_srt_timestamp(sub.end)}"
            if end < start:
                raise TTSError(f"the SRT cue at line {first + 1} ends before it starts ({stamp})")
            body = " ".join(w for w in (re.sub(r"<[^>]+>|\{[^}]*\}", "", ln).strip()
                                        for ln in sub.content.split("\n")) if w)
            if not body:
                raise TTSError(f"the SRT cue at line {first + 1} has no text")
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
