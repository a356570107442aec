"""What the model reads, prepared once for the page and the API: pause tags, the pronunciation dictionary, and
numbers, dates, times, currencies and common abbreviations read out (docs/text-and-takes.md).

`prepare(text, ...)` -> `Prepared`: the text cut at its pause tags into `Segment`s (what to say, and the silence
that follows it), each segment's text as the model will read it (dictionary first, then abbreviations and
numbers), and `preview` (the whole text the model reads, with the pauses shown as tags). The user's own text is
never changed: the history and the page show what was typed, only the engine gets `Segment.spoken`.

Pause tags: `[pause 0.5s]`, `[pause 500ms]` everywhere; the API also takes SSML's `<break time="500ms"/>` (and
`strength="..."`). A bad tag raises `TextPrepError` (a `TTSError`) naming the tag and what is allowed.

The dictionary (`Lexicon`): whole words or phrases -> respellings. A key with a capital letter matches that exact
spelling only ("US" is not "us"); an all-lowercase key matches any case ("gif" also matches "GIF"). Entries come
from the server's file (`TTS_LEXICON_FILE`), the page's table for the session, the API request's `lexicon` field;
the later ones win (`Lexicon.merged`).

Reading out numbers uses num2words for the languages of the model it supports (english, german, french, spanish,
italian, portuguese, russian, japanese, korean); other languages (chinese) keep their digits. "auto" guesses the
language from the script (Latin -> english, Cyrillic -> russian, Hangul -> korean, kana -> japanese, Han only ->
unchanged)."""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterable, Mapping

from tts_engine import TTSError

log = logging.getLogger("tts_server")

PAUSE_MAX_S = 10.0          # the longest pause a tag may ask for
LEXICON_MAX_ENTRIES = 20000  # per dictionary (a request's, a session's, the server's file)
LEXICON_MAX_CHARS = 200      # per key and per respelling
REQUEST_LEXICON_MAX = 1000   # entries of one API request's own dictionary (the server's file holds the big one)
LEXICON_ENV = "TTS_LEXICON_FILE"


class TextPrepError(TTSError):
    """A bad pause tag or dictionary entry; `param`: the API field it came from."""

    def __init__(self, message: str, param: str = "input"):
        super().__init__(message)
        self.param = param


# --- pause tags -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """A run of text between pause tags: `text` as typed, `spoken` as the model reads it, then `pause_s` of
    silence (0: the next segment follows with the usual pause between sentence groups; None: no tag follows)."""
    text: str
    spoken: str
    pause_s: float | None = None


_PAUSE_HINT = "write e.g. [pause 0.5s] or [pause 500ms]"
_TAG = re.compile(r"\[\s*pause\b([^\[\]]*)\]", re.I)
_TAG_OPEN = re.compile(r"\[\s*pause\b", re.I)
_BREAK = re.compile(r"<\s*break\b([^<>]*?)/\s*>", re.I)
_BREAK_OPEN = re.compile(r"<\s*break\b", re.I)
_SPEAK = re.compile(r"</?\s*speak\b[^<>]*>", re.I)
_DURATION = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*(ms|s|sec|secs|seconds?)?\s*$", re.I)
_STRENGTH_S = {"none": 0.0, "x-weak": 0.1, "weak": 0.25, "medium": 0.5, "strong": 0.75, "x-strong": 1.0}


def parse_duration(value: str, tag: str) -> float:
    """'0.5s', '500ms', '1' (seconds) -> seconds, checked against 0..PAUSE_MAX_S."""
    m = _DURATION.match(value or "")
    if not m:
        raise TextPrepError(f"bad pause tag {tag!r}: give a length in s or ms ({_PAUSE_HINT})")
    x = float(m.group(1))
    s = x / 1000.0 if (m.group(2) or "s").lower() == "ms" else x
    if not 0 <= s <= PAUSE_MAX_S:
        raise TextPrepError(f"bad pause tag {tag!r}: a pause must be between 0 and {PAUSE_MAX_S:g} s, got {s:g} s")
    return s


def _break_seconds(attrs: str, tag: str) -> float:
    a = dict((k.lower(), v) for k, _q, v in re.findall(r"([\w-]+)\s*=\s*(['\"])(.*?)\2", attrs))
    if "time" in a:
        return parse_duration(a["time"], tag)
    if "strength" in a:
        s = _STRENGTH_S.get(a["strength"].strip().lower())
        if s is None:
            raise TextPrepError(f"bad break tag {tag!r}: strength must be one of {', '.join(_STRENGTH_S)}")
        return s
    raise TextPrepError(f"bad break tag {tag!r}: give its length, e.g. <break time=\"500ms\"/>")


def split_pauses(text: str, ssml: bool = False) -> list[tuple[str, float | None]]:
    """`text` cut at its pause tags -> [(text before the tag, seconds of the tag)], the last with None.
    `ssml`: also SSML's <break .../> (and <speak> wrappers are dropped). Raises TextPrepError on a bad tag."""
    if ssml:
        text = _SPEAK.sub(" ", text)
    tags = [(m.start(), m.end(), lambda m=m: parse_duration(m.group(1), m.group(0).strip())) for m in _TAG.finditer(text)]
    if ssml:
        tags += [(m.start(), m.end(), lambda m=m: _break_seconds(m.group(1), m.group(0).strip()))
                 for m in _BREAK.finditer(text)]
    tags.sort(key=lambda t: t[0])
    covered = [(a, b) for a, b, _ in tags]
    for rx, kind in ((_TAG_OPEN, "[pause ...]"), (_BREAK_OPEN, "<break .../>") if ssml else (None, None)):
        if rx is None:
            continue
        for m in rx.finditer(text):
            if not any(a <= m.start() < b for a, b in covered):
                snippet = text[m.start():m.start() + 24].split("\n")[0]
                raise TextPrepError(f"unclosed or malformed pause tag {snippet!r}: close it as {kind} ({_PAUSE_HINT})")
    out, pos = [], 0
    for a, b, seconds in tags:
        out.append((text[pos:a], seconds()))
        pos = b
    out.append((text[pos:], None))
    return out


# --- the pronunciation dictionary ---------------------------------------------------------------------------

_WORD = re.compile(r"\w+(?:['’.\-]\w+)*", re.U)


def _key_words(key: str) -> tuple[tuple[str, ...], str]:
    """A key's words and the punctuation that must follow its last word ("e.g." -> (("e.g",), "."))."""
    found = list(_WORD.finditer(key))
    tail = key[found[-1].end():].strip() if found else ""
    return tuple(m.group(0) for m in found), tail


class Lexicon:
    """Whole words or phrases -> respellings, case-aware (see the module's docstring). Applied in one pass over the
    text's words: at each word the longest key that starts there wins; a respelling is not looked up again.
    `merged` stacks dictionaries without rebuilding them (a request's few entries over the server's thousands)."""

    def __init__(self, entries: Mapping[str, str] | Iterable[tuple[str, str]] = (), source: str = "dictionary"):
        items = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
        if len(items) > LEXICON_MAX_ENTRIES:
            raise TextPrepError(f"the {source} has {len(items)} entries; the limit is {LEXICON_MAX_ENTRIES}",
                                "lexicon")
        self.entries: dict[str, str] = {}
        exact: dict[tuple[str, ...], list[tuple[str, str]]] = {}     # words -> [(punctuation tail, respelling)]
        folded: dict[tuple[str, ...], list[tuple[str, str]]] = {}    # the same for all-lowercase keys, casefolded
        for k, v in items:
            k, v = ("" if k is None else str(k)).strip(), ("" if v is None else str(v)).strip()
            if not k and not v:
                continue
            if not k or not v:
                raise TextPrepError(f"{source}: every entry needs a word and its respelling (got {k!r} -> {v!r})",
                                    "lexicon")
            if len(k) > LEXICON_MAX_CHARS or len(v) > LEXICON_MAX_CHARS:
                raise TextPrepError(f"{source}: entries are at most {LEXICON_MAX_CHARS} characters ({k[:40]!r}...)",
                                    "lexicon")
            words, tail = _key_words(k)
            if not words:
                raise TextPrepError(f"{source}: {k!r} has no word to match", "lexicon")
            self.entries[k] = v
            if any(ch.isupper() for ch in k):
                exact.setdefault(words, []).append((tail, v))
            else:
                folded.setdefault(tuple(w.casefold() for w in words), []).append((tail, v))
        for d in (exact, folded):       # the longest punctuation tail is tried first
            for opts in d.values():
                opts.sort(key=lambda o: -len(o[0]))
        # (exact, folded, first words of its phrases: exact, folded), most important first
        self._tables = [(exact, folded, {w[0] for w in exact if len(w) > 1}, {w[0] for w in folded if len(w) > 1})] \
            if self.entries else []
        self.max_words = max((len(w) for d in (exact, folded) for w in d), default=0)

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    @classmethod
    def merged(cls, *lexicons: "Lexicon | None") -> "Lexicon":
        """One dictionary from several, the later ones winning on the same key."""
        used = [lx for lx in lexicons if lx]
        if len(used) == 1:
            return used[0]
        out = cls()
        for lx in used:
            out.entries.update(lx.entries)
        out._tables = [t for lx in reversed(used) for t in lx._tables]
        out.max_words = max((lx.max_words for lx in used), default=0)
        return out

    def _lookup(self, key, fkey, text: str, end: int):
        for exact, folded, _fe, _ff in self._tables:
            for opts in (exact.get(key), folded.get(fkey)):
                for tail, resp in opts or ():
                    if text.startswith(tail, end) and not (tail and text[end + len(tail):end + len(tail) + 1].isalnum()):
                        return tail, resp
        return None

    def apply(self, text: str) -> str:
        if not self._tables or not text:
            return text
        words = list(_WORD.finditer(text))
        strs = [m.group(0) for m in words]
        low = [w.casefold() for w in strs]
        out, pos, i, n = [], 0, 0, len(words)
        while i < n:
            hit = None
            longest = 1
            if self.max_words > 1 and any(strs[i] in fe or low[i] in ff for _e, _f, fe, ff in self._tables):
                longest = min(self.max_words, n - i)
            for k in range(longest, 0, -1):
                # a phrase's words are apart by whitespace only
                if k > 1 and any(text[words[j].end():words[j + 1].start()].strip() for j in range(i, i + k - 1)):
                    continue
                end = words[i + k - 1].end()
                found = self._lookup(tuple(strs[i:i + k]), tuple(low[i:i + k]), text, end)
                if found:
                    hit = (words[i].start(), end + len(found[0]), found[1], k)
                    break
            if hit:
                a, b, resp, k = hit
                out.append(text[pos:a])
                out.append(resp)
                pos, i = b, i + k
            else:
                i += 1
        out.append(text[pos:])
        return "".join(out)


def parse_lexicon(data, source: str = "dictionary") -> Lexicon:
    """A dictionary from what a user or a file gives: a dict, a list of pairs / rows (the page's table), or text
    (JSON object, or lines of `word = respelling`, `word<TAB>respelling` or `word,respelling`; # comments)."""
    if data is None or data == "":
        return Lexicon()
    if isinstance(data, Lexicon):
        return data
    if isinstance(data, Mapping):
        return Lexicon(data, source)
    if hasattr(data, "values") and hasattr(data, "columns"):        # a pandas DataFrame (gr.Dataframe's value)
        data = data.values.tolist()
    if isinstance(data, (list, tuple)):
        rows = []
        for r in data:
            if isinstance(r, Mapping):
                r = (r.get("word") or r.get("key"), r.get("say") or r.get("respelling") or r.get("value"))
            r = list(r) + ["", ""]
            rows.append((r[0], r[1]))
        return Lexicon(rows, source)
    if not isinstance(data, str):
        raise TextPrepError(f"the {source} must be a JSON object of word -> respelling", "lexicon")
    s = data.strip()
    if s.startswith("{"):
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise TextPrepError(f"the {source} is not valid JSON: {e}", "lexicon") from None
        return Lexicon(obj, source)
    rows = []
    for ln, line in enumerate(s.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for sep in ("\t", "=", ","):
            if sep in line:
                k, v = (next(csv.reader(io.StringIO(line))) + [""])[:2] if sep == "," else line.split(sep, 1)
                rows.append((k, v))
                break
        else:
            raise TextPrepError(f"the {source}, line {ln}: write `word = respelling` (got {line[:60]!r})", "lexicon")
    return Lexicon(rows, source)


_server_lexicon: tuple[str, float, Lexicon] | None = None


def server_lexicon(path: str | os.PathLike | None = None) -> Lexicon:
    """The server-wide dictionary from `path` or `TTS_LEXICON_FILE` (read again when the file changes; an empty
    dictionary, with one log line, when it cannot be read)."""
    global _server_lexicon
    p = str(path or os.environ.get(LEXICON_ENV, "")).strip()
    if not p:
        return Lexicon()
    try:
        mtime = Path(p).stat().st_mtime
        if _server_lexicon and _server_lexicon[0] == p and _server_lexicon[1] == mtime:
            return _server_lexicon[2]
        lx = parse_lexicon(Path(p).read_text(encoding="utf-8"), f"dictionary file {p}")
    except (OSError, UnicodeDecodeError, TTSError) as e:
        log.warning("pronunciation dictionary %s not used: %s", p, e)
        return Lexicon()
    _server_lexicon = (p, mtime, lx)
    return lx


# --- numbers, dates, times, currencies, abbreviations ------------------------------------------------------------

NUM2WORDS_LANG = {"english": "en", "german": "de", "french": "fr", "spanish": "es", "italian": "it",
                  "portuguese": "pt", "russian": "ru", "japanese": "ja", "korean": "ko"}
# decimal comma languages (1.234,5): the others write 1,234.5
_DECIMAL_COMMA = {"de", "fr", "es", "it", "pt", "ru"}
_WORDS = {   # percent, and, o'clock style joiners; per num2words language code
    "en": {"%": "percent", "h": "", "and": "and"},
    "de": {"%": "Prozent", "h": "Uhr", "and": "und"},
    "fr": {"%": "pour cent", "h": "heures", "and": "et"},
    "es": {"%": "por ciento", "h": "y", "and": "y"},
    "it": {"%": "per cento", "h": "e", "and": "e"},
    "pt": {"%": "por cento", "h": "e", "and": "e"},
    "ru": {"%": "процентов", "h": "", "and": "и"},
    "ja": {"%": "パーセント", "h": "時", "and": ""},
    "ko": {"%": "퍼센트", "h": "시", "and": ""},
}
_MONTHS = {
    "en": "January February March April May June July August September October November December",
    "de": "Januar Februar März April Mai Juni Juli August September Oktober November Dezember",
    "fr": "janvier février mars avril mai juin juillet août septembre octobre novembre décembre",
    "es": "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre",
    "it": "gennaio febbraio marzo aprile maggio giugno luglio agosto settembre ottobre novembre dicembre",
    "pt": "janeiro fevereiro março abril maio junho julho agosto setembro outubro novembro dezembro",
}
ABBREVIATIONS = {
    "en": {"Dr.": "Doctor", "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miz", "Prof.": "Professor",
           "e.g.": "for example", "i.e.": "that is", "etc.": "et cetera", "vs.": "versus", "approx.": "approximately",
           "No.": "number", "Jan.": "January", "Feb.": "February", "Aug.": "August", "Sept.": "September",
           "Oct.": "October", "Nov.": "November", "Dec.": "December", "km": "kilometers", "kg": "kilograms",
           "cm": "centimeters", "mm": "millimeters", "km/h": "kilometers per hour", "mph": "miles per hour"},
    "de": {"Dr.": "Doktor", "Prof.": "Professor", "z.B.": "zum Beispiel", "z. B.": "zum Beispiel",
           "usw.": "und so weiter", "bzw.": "beziehungsweise", "ca.": "circa", "d.h.": "das heißt",
           "Nr.": "Nummer", "km": "Kilometer", "kg": "Kilogramm", "km/h": "Kilometer pro Stunde"},
    "fr": {"M.": "Monsieur", "Mme": "Madame", "Dr": "Docteur", "etc.": "et cetera", "km": "kilomètres",
           "kg": "kilogrammes"},
    "es": {"Sr.": "Señor", "Sra.": "Señora", "Dr.": "Doctor", "etc.": "etcétera", "km": "kilómetros",
           "kg": "kilogramos"},
    "it": {"Sig.": "Signor", "Dott.": "Dottor", "ecc.": "eccetera", "km": "chilometri", "kg": "chilogrammi"},
    "pt": {"Sr.": "Senhor", "Sra.": "Senhora", "Dr.": "Doutor", "etc.": "et cetera", "km": "quilômetros",
           "kg": "quilogramas"},
}
_CURRENCY = {"$": "USD", "€": "EUR", "£": "GBP", "¥": "JPY", "₩": "KRW", "₽": "RUB"}
_CURRENCY_CODES = {"USD", "EUR", "GBP", "JPY", "KRW", "RUB", "CHF", "CNY"}
_abbrev_lexicons: dict[str, Lexicon] = {}


def number_language(language: str | None, text: str) -> str | None:
    """The num2words language code for `language` ("auto": guessed from the script), None: read digits as they are."""
    lang = (language or "auto").strip().lower()
    if lang != "auto":
        return NUM2WORDS_LANG.get(lang)
    if re.search(r"[\u3040-\u30ff]", text):
        return "ja"
    if re.search(r"[\uac00-\ud7af]", text):
        return "ko"
    if re.search(r"[\u4e00-\u9fff]", text):
        return None
    if re.search(r"[\u0400-\u04ff]", text):
        return "ru"
    return "en"


def _n2w(value, lang: str, to: str = "cardinal", **kw) -> str:
    from num2words import num2words
    try:
        return num2words(value, lang=lang, to=to, **kw)
    except (NotImplementedError, OverflowError, ValueError, TypeError, KeyError, AttributeError, IndexError):
        if to != "cardinal":
            return _n2w(value, lang)
        return str(value)


def _number(s: str, lang: str) -> Decimal | None:
    """'1,234.5' (en) / '1.234,5' (de) -> Decimal; None when it is not one number."""
    thousands, point = (".", ",") if lang in _DECIMAL_COMMA else (",", ".")
    s = s.replace("\u202f", "").replace("\u00a0", "")
    if thousands in s:
        head, *groups = s.split(point)[0].split(thousands)
        if not (1 <= len(head) <= 3 and all(len(g) == 3 for g in groups)):
            return None
    s = s.replace(thousands, "").replace(point, ".")
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def _read_number(d: Decimal, lang: str) -> str:
    return _n2w(int(d) if d == d.to_integral_value() and "." not in str(d) else d, lang)


_NUM = r"\d+(?:[.,\u202f\u00a0]\d+)*"
_RX_DATE = re.compile(r"(?<![\d/.-])(\d{4})-(\d{2})-(\d{2})(?![\d/-])")
_RX_TIME = re.compile(r"(?<![\d:])([01]?\d|2[0-3]):([0-5]\d)(?![\d:])(\s*([AaPp])\.?[Mm]\.?)?")
_RX_CUR_PRE = re.compile(r"(?<!\w)([$€£¥₩₽])\s?(" + _NUM + r")(?![\d])")
_RX_CUR_POST = re.compile(r"(?<![\w.,])(" + _NUM + r")\s?(€|£|\$|¥|" + "|".join(sorted(_CURRENCY_CODES)) + r")(?!\w)")
_RX_PCT = re.compile(r"(?<![\w.,])(-?" + _NUM + r")\s?%")
_RX_ORD_EN = re.compile(r"(?<![\w.,])(\d+)(st|nd|rd|th)\b", re.I)
# "in 1999", "since 2024": a year after the words that usually introduce one (other 4-digit numbers are amounts)
_RX_YEAR_EN = re.compile(r"\b((?:in|since|from|until|till|by|of|year|circa|around|before|after|during|early|late|"
                         r"mid|summer|winter|spring|autumn|fall)\s+)(1[1-9]\d\d|20\d\d)(?![\w.,]\d)\b", re.I)
_RX_NUM = re.compile(r"(?<![\w.,])(-(?=\d))?(" + _NUM + r")(?![\w])")


def read_numbers(text: str, lang: str) -> str:
    """Numbers, ISO dates (2024-03-05), times (9:30, 9:30 pm), currencies ($5, 5 €, 12.50 EUR), percentages and
    (English) ordinals as words of `lang` (a num2words code)."""
    w = _WORDS.get(lang, _WORDS["en"])

    def date(m):
        y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if not (1 <= mo <= 12 and 1 <= d <= 31):
            return m.group(0)
        months = _MONTHS.get(lang)
        if months is None:
            return m.group(0).replace("-", " ")
        month = months.split()[mo - 1]
        year = _n2w(y, lang, "year")
        if lang == "en":
            return f"{month} {_n2w(d, lang, 'ordinal')}, {year}"
        if lang == "de":
            return f"{_n2w(d, lang, 'ordinal')} {month} {year}"
        return f"{_n2w(d, lang)} {month} {year}"

    def time_(m):
        h, mi, ap = int(m.group(1)), int(m.group(2)), m.group(4)
        if lang == "en":
            hh = _n2w(h, lang)
            mm = "o'clock" if mi == 0 and not ap else ("" if mi == 0 else
                                                         ("oh " + _n2w(mi, lang) if mi < 10 else _n2w(mi, lang)))
            out = " ".join(x for x in (hh, mm) if x)
            return out + (f" {ap.lower()}.m." if ap else "")
        joiner = w["h"]
        parts = [_n2w(h, lang), joiner] + ([_n2w(mi, lang)] if mi else [])
        return " ".join(x for x in parts if x)

    def currency(code: str, amount: str):
        d = _number(amount, lang)
        if d is None:
            return None
        if d != int(d):               # 12.50 -> "twelve euro, fifty cents"
            return _n2w(float(d), lang, "currency", currency=code)
        return f"{_read_number(d, lang)} {_currency_name(code, lang, int(d))}"

    def cur_pre(m):
        return currency(_CURRENCY[m.group(1)], m.group(2)) or m.group(0)

    def cur_post(m):
        sym = m.group(2)
        return currency(_CURRENCY.get(sym, sym), m.group(1)) or m.group(0)

    def pct(m):
        s = m.group(1)
        d = _number(s.lstrip("-"), lang)
        if d is None:
            return m.group(0)
        return f"{_read_number(-d if s.startswith('-') else d, lang)} {w['%']}"

    def num(m):
        d = _number(m.group(2), lang)
        if d is None:
            return m.group(0)
        return _read_number(-d if m.group(1) else d, lang)

    text = _RX_DATE.sub(date, text)
    text = _RX_TIME.sub(time_, text)
    text = _RX_CUR_PRE.sub(cur_pre, text)
    text = _RX_CUR_POST.sub(cur_post, text)
    text = _RX_PCT.sub(pct, text)
    if lang == "en":
        text = _RX_ORD_EN.sub(lambda m: _n2w(int(m.group(1)), lang, "ordinal"), text)
        text = _RX_YEAR_EN.sub(lambda m: m.group(1) + _n2w(int(m.group(2)), lang, "year"), text)
    return _RX_NUM.sub(num, text)


def _currency_name(code: str, lang: str, amount: int) -> str:
    """The currency's name as num2words spells it for a whole amount ('dollars'), else the code."""
    try:
        from num2words import CONVERTER_CLASSES
        forms = CONVERTER_CLASSES[lang].CURRENCY_FORMS[code][0]
        return forms[0] if amount == 1 else forms[-1]
    except (KeyError, AttributeError, IndexError, TypeError):
        return code


def abbreviations(lang: str | None) -> Lexicon:
    if lang not in ABBREVIATIONS:
        return Lexicon()
    if lang not in _abbrev_lexicons:
        _abbrev_lexicons[lang] = Lexicon(ABBREVIATIONS[lang], "abbreviations")
    return _abbrev_lexicons[lang]


def spoken_form(text: str, language: str | None = "auto", lexicon: Lexicon | None = None,
                read_out: bool = True) -> str:
    """`text` as the model reads it: the dictionary's respellings, then (with `read_out`) common abbreviations and
    numbers, dates, times, currencies in words of `language` (unchanged for a language num2words lacks)."""
    if lexicon:
        text = lexicon.apply(text)
    if read_out:
        lang = number_language(language, text)
        if lang is not None:
            text = read_numbers(abbreviations(lang).apply(text), lang)
    return text


# --- the whole preparation --------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """A text ready for the engine: `segments` (pause-free runs, each with its spoken form and the pause after it),
    `lead_s` (silence before the first word: a pause tag at the very start) and `preview`."""
    segments: list[Segment] = field(default_factory=list)
    lead_s: float = 0.0

    @property
    def preview(self) -> str:
        """The text the model will read, the pauses shown as [pause Xs]."""
        out = [f"[pause {self.lead_s:g}s]"] if self.lead_s else []
        for s in self.segments:
            out.append(s.spoken)
            if s.pause_s is not None:
                out.append(f"[pause {s.pause_s:g}s]")
        return " ".join(out)

    @property
    def spoken(self) -> str:
        return " ".join(s.spoken for s in self.segments)

    @property
    def pause_total_s(self) -> float:
        return self.lead_s + sum(s.pause_s or 0.0 for s in self.segments)


def prepare(text: str, language: str | None = "auto", lexicon: Lexicon | None = None, read_out: bool = True,
            ssml: bool = False) -> Prepared:
    """`text` cut at its pause tags, each run in its spoken form (see `spoken_form`); runs with nothing to say add
    their pause to the one before. Raises TextPrepError for a bad tag or a text that is only pauses."""
    out = Prepared()
    for chunk, pause in split_pauses(text, ssml=ssml):
        said = chunk.strip()
        if said:
            out.segments.append(Segment(said, spoken_form(said, language, lexicon, read_out).strip() or said, pause))
        elif pause is not None:
            if out.segments:        # two tags in a row: their pauses add up
                last = out.segments[-1]
                out.segments[-1] = Segment(last.text, last.spoken, (last.pause_s or 0.0) + pause)
            else:
                out.lead_s += pause
    if not out.segments:
        raise TextPrepError("the text has nothing to say between its pause tags")
    return out
