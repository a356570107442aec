"""Text and samples, pure functions: sentences (`split_sentences`), the sentence groups long text is spoken in
(`chunk_text`), and float32 -> int16 PCM (`to_int16`)."""
from __future__ import annotations

import numpy as np

from ui.config import SENTENCE_CHARS

_ENDERS = set(".!?…;。！？；")
_CJK_ENDERS = set("。！？；…")
_CLOSERS = set("\"'”’」』)]）")


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`: cut after . ! ? … ; (followed by a space) or 。！？； and at line breaks;
    closing quotes and brackets stay with their sentence, '3.14' is not cut."""
    out, cur, i, n = [], [], 0, len(text)

    def flush():
        s = "".join(cur).strip()
        if s:
            out.append(s)
        cur.clear()

    while i < n:
        ch = text[i]
        if ch == "\n":
            flush()
            i += 1
            continue
        cur.append(ch)
        i += 1
        if ch in _ENDERS:
            while i < n and (text[i] in _ENDERS or text[i] in _CLOSERS):
                cur.append(text[i])
                i += 1
            if i >= n or text[i].isspace() or ch in _CJK_ENDERS:
                flush()
    flush()
    return out


def _hard_split(s: str, max_chars: int) -> list[str]:
    """A sentence longer than max_chars, cut at the last comma or space before the limit."""
    parts = []
    while len(s) > max_chars:
        window = s[:max_chars]
        cut = max(window.rfind(", "), window.rfind("，"), window.rfind("、"))
        if cut < max_chars // 3:
            cut = window.rfind(" ")
        if cut < max_chars // 3:
            cut = max_chars - 1
        parts.append(s[:cut + 1].strip())
        s = s[cut + 1:].strip()
    if s:
        parts.append(s)
    return parts


def chunk_text(text: str, max_chars: int = SENTENCE_CHARS) -> list[str]:
    """Whole sentences grouped in order into pieces of at most `max_chars` characters (a longer sentence is
    cut at a comma or space). Every piece is spoken with the same voice and seed."""
    pieces, cur = [], ""
    for sent in split_sentences(text):
        for part in _hard_split(sent, max_chars):
            if cur and len(cur) + 1 + len(part) > max_chars:
                pieces.append(cur)
                cur = part
            elif cur:
                cur = cur + ("" if cur[-1] in _CJK_ENDERS else " ") + part
            else:
                cur = part
    if cur:
        pieces.append(cur)
    return pieces


def to_int16(wav: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16, one fixed scale for every chunk (Gradio would peak-normalise each float
    chunk on its own, which makes the loudness jump at chunk joins)."""
    return (np.clip(np.asarray(wav, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)
