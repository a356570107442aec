"""Text that arrives piece by piece (an LLM's output) cut into the units it is spoken in, as soon as each is complete.

    s = SentenceStream("sentence")
    s.feed("Hello there. How a")   # -> ["Hello there."]
    s.feed("re you? I")            # -> ["How are you?"]
    s.flush()                      # -> ["I"]

Granularity: "sentence" cuts after . ! ? … ; when whitespace follows (so "3.14" and a '.' at the end of a
piece wait for the next character) and at once after 。！？；…, and at line breaks; closing quotes and brackets stay
with their sentence. "clause" also cuts after , : and ， 、 ：. "none" keeps everything until `flush`. A unit that
grows past `max_chars` without an ending is cut at its last space or comma, so endless text is still spoken.
"""
from __future__ import annotations

GRANULARITIES = ("sentence", "clause", "none")
_SPACED = set(".!?…;")             # end a sentence when whitespace follows
_AT_ONCE = set("。！？；")           # end a sentence right away (CJK)
_CLAUSE_SPACED = set(",:")
_CLAUSE_AT_ONCE = set("，、：")
_CLOSERS = set("\"'”’」』)]）")


class SentenceStream:
    def __init__(self, granularity: str = "sentence", max_chars: int = 300):
        if granularity not in GRANULARITIES:
            raise ValueError(f"split_granularity must be one of {', '.join(GRANULARITIES)}")
        self.granularity, self.max_chars = granularity, max(20, int(max_chars))
        self.buffer = ""
        spaced, at_once = set(_SPACED), set(_AT_ONCE)
        if granularity == "clause":
            spaced |= _CLAUSE_SPACED
            at_once |= _CLAUSE_AT_ONCE
        self._spaced, self._at_once = spaced, at_once

    def __bool__(self) -> bool:
        return bool(self.buffer.strip())

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        return self._cut(final=False)

    def flush(self) -> list[str]:
        out = self._cut(final=True)
        rest = self.buffer.strip()
        self.buffer = ""
        return out + ([rest] if rest else [])

    def _cut(self, final: bool) -> list[str]:
        out: list[str] = []
        if self.granularity != "none":
            start, i, buf = 0, 0, self.buffer
            n = len(buf)
            while i < n:
                ch = buf[i]
                end = None
                if ch == "\n":
                    end = i + 1
                elif ch in self._at_once or ch in self._spaced:
                    j = i + 1
                    while j < n and (buf[j] in _CLOSERS or buf[j] in self._spaced or buf[j] in self._at_once):
                        j += 1
                    if ch in self._at_once or (j < n and buf[j].isspace()) or (final and j == n):
                        end = j
                    elif j == n:          # '.' at the end of what has arrived: wait for the next character
                        break
                    i = j - 1
                if end is not None:
                    unit = buf[start:end].strip()
                    if unit:
                        out.append(unit)
                    start = end
                    i = end
                    continue
                i += 1
            self.buffer = buf[start:]
        while len(self.buffer) > self.max_chars:   # no ending in sight: cut at a space or comma
            window = self.buffer[:self.max_chars]
            cut = max(window.rfind(" "), window.rfind(","), window.rfind("，"))
            cut = cut + 1 if cut > self.max_chars // 3 else self.max_chars
            unit, self.buffer = self.buffer[:cut].strip(), self.buffer[cut:]
            if unit:
                out.append(unit)
        return out
