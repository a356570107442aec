"""A dialogue script, pure functions: the text form (`Name: text`, or `Name [instruction]: text`, one line each),
its table form (rows [speaker, instruction, text] for a gr.Dataframe) and the limits of a dialogue.

    Ryan: Did you hear that?
    Vivian [whispering]: It's only the wind.

Blank lines are skipped. The speaker's name ends at the first colon (`:` or the full-width `：`), so the text
itself may contain colons. Names compare case-insensitively and keep the spelling of their first use."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tts_engine import TTSError

MAX_LINES = 40        # lines of one dialogue
MAX_SPEAKERS = 4      # distinct speakers of one dialogue (the page has this many voice slots)
MAX_NAME_CHARS = 40
DEFAULT_PAUSE_S = 0.3
MAX_PAUSE_S = 3.0
HEADERS = ["Speaker", "Instruction", "Text"]

_LINE = re.compile(r"^\s*(?P<name>[^:：\[\]]+?)\s*(?:\[(?P<instruct>[^\]]*)\])?\s*[:：]\s*(?P<text>.*?)\s*$")


@dataclass
class Line:
    speaker: str
    text: str
    instruct: str = ""


def parse_script(script: str | None, strict: bool = True) -> list[Line]:
    """The lines of `script`. strict: a line that is not `Name: text` is an error naming its line number;
    otherwise it becomes a line without a speaker (the table shows it, the handler refuses it)."""
    out: list[Line] = []
    for i, raw in enumerate(str(script or "").splitlines(), 1):
        if not raw.strip():
            continue
        m = _LINE.match(raw)
        if m is None or len(m["name"]) > MAX_NAME_CHARS:
            if strict:
                raise TTSError(f"line {i} of the script is not “Name: text”: {raw.strip()[:60]!r}")
            out.append(Line("", raw.strip()))
            continue
        out.append(Line(m["name"], m["text"], (m["instruct"] or "").strip()))
    return out


def format_script(lines: list[Line]) -> str:
    def one(x: Line) -> str:
        if not x.speaker:
            return x.text
        return f"{x.speaker} [{x.instruct}]: {x.text}" if x.instruct else f"{x.speaker}: {x.text}"
    return "\n".join(one(x) for x in lines)


def to_rows(lines: list[Line]) -> list[list[str]]:
    return [[x.speaker, x.instruct, x.text] for x in lines] or [["", "", ""]]


def from_rows(rows) -> list[Line]:
    """Table rows (a list of lists, or a pandas DataFrame) -> lines; empty rows are dropped."""
    if hasattr(rows, "values") and hasattr(rows, "columns"):    # pandas
        rows = rows.values.tolist()
    out = []
    for row in rows or []:
        cells = [("" if v is None or v != v else str(v)).strip() for v in list(row)[:3]]   # v != v: NaN
        cells += [""] * (3 - len(cells))
        name, instruct, text = cells
        if name or text:
            out.append(Line(name, text, instruct))
    return out


def speakers(lines: list[Line]) -> list[str]:
    """Distinct speakers in order of first appearance (case-insensitive, first spelling kept)."""
    seen: dict[str, str] = {}
    for x in lines:
        if x.speaker and x.speaker.lower() not in seen:
            seen[x.speaker.lower()] = x.speaker
    return list(seen.values())


def check_lines(lines: list[Line], max_chars: int) -> list[str]:
    """Refuse what a dialogue may not be (empty, too many lines or speakers, too long, a line without a
    speaker or text); -> its speakers."""
    if not lines:
        raise TTSError("write the dialogue first: one line per turn, “Name: text”")
    if len(lines) > MAX_LINES:
        raise TTSError(f"the dialogue has {len(lines)} lines; the limit is {MAX_LINES}. Split it in parts.")
    for i, x in enumerate(lines, 1):
        if not x.speaker:
            raise TTSError(f"line {i} has no speaker: write it as “Name: text”")
        if not x.text:
            raise TTSError(f"line {i} ({x.speaker}) has no text")
    names = speakers(lines)
    if len(names) > MAX_SPEAKERS:
        raise TTSError(f"the dialogue has {len(names)} speakers ({', '.join(names)}); the limit is "
                       f"{MAX_SPEAKERS}")
    total = sum(len(x.text) for x in lines)
    if total > max_chars:
        raise TTSError(f"the dialogue is too long: {total} characters of text; the limit is {max_chars}")
    return names


def check_pause(pause) -> float:
    try:
        p = float(DEFAULT_PAUSE_S if pause is None or pause == "" else pause)
    except (TypeError, ValueError):
        raise TTSError("the pause between turns must be a number of seconds") from None
    if not 0 <= p <= MAX_PAUSE_S:
        raise TTSError(f"the pause between turns must lie between 0 and {MAX_PAUSE_S:g} s")
    return p
