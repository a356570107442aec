"""Listening tests: blind A/B preference, ABX and MUSHRA-style rating of stimuli rendered on the spot, every one
loudness-matched, with results to share (docs/listening-tests.md).

A test is a `Definition`: the kind (`ab`, `abx`, `mushra`), one sentence per trial, and 2-6 configurations that
differ in exactly one factor (voice, model, precision, seed, speed, temperature or blend ratio). `Listening.start`
checks it (loading nothing), opens the engines it needs (the app's own, or an extra one for another checkpoint or
precision, from `EnginePool`), makes the plan (per trial a shuffle seeded by the test's `shuffle_seed` and the
trial's number, recorded) and renders the trials in a background thread, trial by trial, each trial's stimuli
together in one engine batch; the extra engines are let go once the last trial is rendered. Each trial's stimuli
are matched to one integrated loudness (ITU-R BS.1770, pyloudnorm) before they are written. The statistics
(preference share with a Wilson interval, ABX correct count with an exact binomial p-value, MUSHRA mean with a 95 %
t-interval) and the CSV / JSON exports are pure functions of the answers. An exported JSON loaded again
(`Definition.from_json`) makes the same test: same texts, seeds, configurations and shuffles.

The page and gradio_client reach this through ui/listen_tab.py; the app side (`Source`) says which voices and
models exist and resolves them, so that this module stays below the page."""
from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import math
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from serving.speed import SPEED_MAX, SPEED_MIN, StreamStretcher, change_speed
from tts_engine import TTSError

log = logging.getLogger("tts_server")

SR = 24000
KINDS = ("ab", "abx", "mushra")
KIND_LABEL = {"ab": "A/B preference", "abx": "ABX", "mushra": "MUSHRA-style rating"}
MIN_STIMULI, MAX_STIMULI = 2, 6
MIN_TRIALS, MAX_TRIALS = 1, 20
MAX_SENTENCE_CHARS = 300
MAX_TESTS = 64                     # tests kept at once (the oldest finished, then the oldest, go first)
MAX_DEFINITION_CHARS = 100_000     # an imported definition
TARGET_LUFS = -23.0                # EBU R128's programme loudness, lowered for a trial whose peaks need it
PEAK_CEILING_DB = -1.0             # no matched stimulus peaks above this (dBFS)
ANCHOR_HZ = 3500.0                 # MUSHRA's low-pass anchor (ITU-R BS.1534)
NO_PREFERENCE = "none"
OFFLINE_STRETCH_MAX = 1 << 19      # samples Rubber Band's offline mode processes in one call
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4", "w8a8", "w4a8")
QUANTISED = ("int8", "int4", "w8a8", "w4a8")
FACTORS = ("voice", "model", "precision", "seed", "speed", "temperature", "blend")
CONFIG_KEYS = {"voice", "model", "precision", "seed", "speed", "temperature", "blend_with", "blend", "language",
               "reference"}
FORMAT = "qwen3-tts-live listening test"

# built-in sentences per language: short, phonetically varied, no names or numbers that a model may read oddly
SENTENCES = {
    "english": ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
                "It's easy to tell the depth of a well.", "These days a chicken leg is a rare dish.",
                "Rice is often served in round bowls.", "The juice of lemons makes fine punch.",
                "The box was thrown beside the parked truck.", "Four hours of steady work faced us.",
                "A large size in stockings is hard to sell.", "The boy was there when the sun rose."],
    "chinese": ["今天的天气很好，我们去公园散步吧。", "他每天早上都会喝一杯热茶。", "这本书讲的是一个关于友谊的故事。",
                "请把窗户关上，外面有点冷。", "我们明天下午三点在车站见面。"],
    "japanese": ["今日はとても良い天気ですね。", "駅までの道を教えていただけますか。", "この本はとても面白かったです。",
                 "明日の朝は早く起きなければなりません。", "窓を開けると涼しい風が入ってきた。"],
    "korean": ["오늘은 날씨가 정말 좋네요.", "역까지 가는 길을 알려 주시겠어요?", "이 책은 정말 재미있었어요.",
               "내일 아침에는 일찍 일어나야 해요.", "창문을 열자 시원한 바람이 들어왔다."],
    "german": ["Der Zug fährt pünktlich um acht Uhr ab.", "Im Garten blühen die ersten Rosen.",
               "Kannst du mir bitte das Salz geben?", "Wir haben den ganzen Abend Karten gespielt.",
               "Die Brücke über den Fluss ist sehr alt."],
    "french": ["Le train part à huit heures précises.", "Les premières roses fleurissent dans le jardin.",
               "Peux-tu me passer le sel, s'il te plaît ?", "Nous avons joué aux cartes toute la soirée.",
               "Le pont sur la rivière est très ancien."],
    "spanish": ["El tren sale a las ocho en punto.", "En el jardín florecen las primeras rosas.",
                "¿Me pasas la sal, por favor?", "Jugamos a las cartas toda la noche.",
                "El puente sobre el río es muy antiguo."],
    "italian": ["Il treno parte alle otto in punto.", "Nel giardino fioriscono le prime rose.",
                "Mi passi il sale, per favore?", "Abbiamo giocato a carte tutta la sera.",
                "Il ponte sul fiume è molto antico."],
    "portuguese": ["O comboio parte às oito em ponto.", "No jardim florescem as primeiras rosas.",
                   "Podes passar-me o sal, por favor?", "Jogámos às cartas a noite toda.",
                   "A ponte sobre o rio é muito antiga."],
    "russian": ["Поезд отправляется ровно в восемь часов.", "В саду расцвели первые розы.",
                "Передай мне, пожалуйста, соль.", "Мы весь вечер играли в карты.",
                "Мост через реку очень старый."],
}


# --- statistics (pure) ------------------------------------------------------------------------------------

def binom_sf(k: int, n: int, p: float = 0.5) -> float:
    """P(X >= k) for X ~ Binomial(n, p) (scipy's exact binomial)."""
    from scipy.stats import binom

    return float(binom.sf(k - 1, n, p)) if k > 0 else 1.0


def abx_p_value(correct: int, n: int) -> float:
    """One-sided exact binomial p-value of `correct` right answers in `n` ABX trials against guessing (p = 1/2):
    the chance of at least that many by luck."""
    return binom_sf(correct, n, 0.5)


def sign_test_p(a: int, b: int) -> float:
    """Two-sided exact binomial (sign test) p-value of a preference split a : b (ties left out)."""
    from scipy.stats import binomtest

    return float(binomtest(max(a, b), a + b, 0.5).pvalue) if a + b else 1.0


def wilson_interval(k: int, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion k / n ((0, 1) when n = 0)."""
    from scipy.stats import binomtest

    if n == 0:
        return 0.0, 1.0
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return max(0.0, float(ci.low)), min(1.0, float(ci.high))


def t_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its Student-t confidence interval (NaN bounds for fewer than 2 values)."""
    from scipy.stats import t as student_t

    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(x.mean())
    if x.size < 2:
        return mean, float("nan"), float("nan")
    half = float(student_t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, mean - half, mean + half


# --- loudness ---------------------------------------------------------------------------------------------

def integrated_loudness(wav: np.ndarray, sr: int = SR) -> float:
    """ITU-R BS.1770-4 integrated loudness (LUFS) of float mono audio; -inf for silence. A clip shorter than the
    400 ms gating block is measured repeated to that length (its loudness, not that of padding)."""
    import pyloudnorm

    x = np.asarray(wav, dtype=np.float64).reshape(-1)
    if x.size == 0 or not np.any(x):
        return float("-inf")
    need = int(0.4 * sr) + 1
    if x.size < need:
        x = np.tile(x, -(-need // x.size))
    return float(pyloudnorm.Meter(sr).integrated_loudness(x))


def match_loudness(wavs: list[np.ndarray], sr: int = SR, target: float = TARGET_LUFS,
                   ceiling_db: float = PEAK_CEILING_DB) -> tuple[list[np.ndarray], list[float], float]:
    """The clips scaled to one integrated loudness: `target` LUFS, or lower where a clip's peak would otherwise
    pass `ceiling_db` dBFS (so none clips and all stay matched). -> (scaled float32 clips, gain of each in dB,
    the loudness they share). A silent clip is left as it is (gain 0)."""
    levels = [integrated_loudness(w, sr) for w in wavs]
    common = target
    for w, lv in zip(wavs, levels):
        peak = float(np.max(np.abs(w))) if len(w) else 0.0
        if math.isfinite(lv) and peak > 0:
            common = min(common, lv + ceiling_db - 20 * math.log10(peak))
    out, gains = [], []
    for w, lv in zip(wavs, levels):
        g = common - lv if math.isfinite(lv) else 0.0
        gains.append(g)
        out.append((np.asarray(w, np.float32) * np.float32(10 ** (g / 20))).astype(np.float32))
    return out, gains, common


def low_pass_anchor(wav: np.ndarray, sr: int = SR, cutoff: float = ANCHOR_HZ) -> np.ndarray:
    """MUSHRA's low-pass anchor: the reference through a zero-phase low-pass at `cutoff` Hz (aligned in time
    with it, so switching keeps the words in place)."""
    from scipy.signal import butter, sosfiltfilt

    x = np.asarray(wav, np.float64)
    if x.size < 64:
        return x.astype(np.float32)
    sos = butter(8, cutoff, btype="low", fs=sr, output="sos")
    return sosfiltfilt(sos, x).astype(np.float32)


def stretch(wav: np.ndarray, speed: float) -> np.ndarray:
    """`wav` at `speed` (pitch kept): Rubber Band's offline mode, or its real-time one for clips longer than the
    offline mode takes in one call (about 20 s)."""
    if wav.size <= OFFLINE_STRETCH_MAX:
        return change_speed(wav, SR, speed)
    st = StreamStretcher(SR, speed)
    return np.concatenate([st.push(wav), st.finish()])


# --- the definition ---------------------------------------------------------------------------------------

def split_sentences(text: str) -> list[str]:
    """Sentences of `text`: one per line, each line cut after . ! ? … (followed by a space) and 。！？."""
    out = []
    for line in str(text or "").splitlines():
        for s in re.split(r"(?<=[.!?…])\s+|(?<=[。！？])", line):
            s = s.strip()
            if s:
                out.append(s)
    return out


def builtin_sentences(language: str) -> list[str]:
    lang = str(language or "auto").strip().lower()
    return SENTENCES.get(lang, SENTENCES["english"])


def _num(cfg: dict, key: str, lo: float, hi: float, what: str, integer: bool = False):
    v = cfg[key]
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise TTSError(f"{what} must be a number, got {v!r}") from None
    if not (lo <= x <= hi) or (integer and x != int(x)):
        kind = "a whole number" if integer else "a number"
        raise TTSError(f"{what} must be {kind} between {lo:g} and {hi:g}, got {v!r}")
    return int(x) if integer else x


def parse_configs(configs) -> list[dict]:
    """The JSON list of configurations (or the list itself), each checked for its keys and value ranges."""
    if isinstance(configs, str):
        if len(configs) > MAX_DEFINITION_CHARS:
            raise TTSError("the configurations are too long")
        try:
            configs = json.loads(configs) if configs.strip() else []
        except json.JSONDecodeError as e:
            raise TTSError(f"the configurations are not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise TTSError('configs must be a JSON list of objects, e.g. [{"voice": "ryan"}, {"voice": "vivian"}]')
    if not MIN_STIMULI <= len(configs) <= MAX_STIMULI:
        raise TTSError(f"a test compares {MIN_STIMULI} to {MAX_STIMULI} configurations; {len(configs)} were given")
    out = []
    for i, cfg in enumerate(configs, 1):
        unknown = sorted(set(cfg) - CONFIG_KEYS)
        if unknown:
            raise TTSError(f"configuration {i}: unknown key(s) {', '.join(unknown)}; use "
                           f"{', '.join(sorted(CONFIG_KEYS))}")
        c = {k: v for k, v in cfg.items() if v is not None and v != ""}
        where = f"configuration {i}"
        for key in ("voice", "model", "blend_with", "language"):
            if key in c and not isinstance(c[key], str):
                raise TTSError(f"{where}: {key} must be a string")
            if key in c:
                c[key] = c[key].strip()
        if "precision" in c:
            p = str(c["precision"]).strip().lower()
            if p not in PRECISIONS:
                raise TTSError(f"{where}: unknown precision {c['precision']!r}; use one of {', '.join(PRECISIONS)}")
            c["precision"] = p
        if "seed" in c:
            c["seed"] = _num(c, "seed", 0, 2**31 - 1, f"{where}: seed", integer=True)
        if "speed" in c:
            c["speed"] = _num(c, "speed", SPEED_MIN, SPEED_MAX, f"{where}: speed")
        if "temperature" in c:
            c["temperature"] = _num(c, "temperature", 0.05, 2.0, f"{where}: temperature")
        if "blend" in c:
            c["blend"] = _num(c, "blend", 0, 100, f"{where}: blend (percent of blend_with)")
            if "blend_with" not in c:
                raise TTSError(f"{where}: blend needs blend_with (the second voice of the mix)")
        if "reference" in c:
            if not isinstance(c["reference"], bool):
                raise TTSError(f"{where}: reference must be true or false")
            if not c["reference"]:
                del c["reference"]
        out.append(c)
    if sum(1 for c in out if c.get("reference")) > 1:
        raise TTSError("only one configuration can be the reference")
    return out


def factor_values(cfg: dict) -> dict:
    """A filled configuration's value of each factor (blend = the second voice and its share)."""
    out = {k: cfg.get(k) for k in FACTORS if k != "blend"}
    out["blend"] = (cfg.get("blend_with"), cfg.get("blend")) if cfg.get("blend_with") else None
    return out


def varied_factor(configs: list[dict]) -> str:
    """The one factor in which the (filled) configurations differ; TTSError when none or several do."""
    values = [factor_values(c) for c in configs]
    differ = [f for f in FACTORS if len({json.dumps(v[f], sort_keys=True) for v in values}) > 1]
    if len({str(c.get("language", "auto")) for c in configs}) > 1:
        raise TTSError("every configuration must use the same language")
    if not differ:
        raise TTSError("the configurations are identical: vary one factor (voice, model, precision, seed, speed, "
                       "temperature or blend)")
    if len(differ) > 1:
        raise TTSError(f"vary one factor at a time: these differ between the configurations: {', '.join(differ)}")
    keys = [json.dumps(v[differ[0]], sort_keys=True) for v in values]
    if len(set(keys)) != len(keys):
        raise TTSError(f"two configurations have the same {differ[0]}: each stimulus must differ")
    return differ[0]


def describe(cfg: dict, factor: str) -> str:
    """A stimulus's name in the results: its value of the varied factor ("precision int8", "speed 1.25")."""
    if factor == "blend":
        return f"{cfg.get('blend', 0):g} % {cfg.get('blend_with')}"
    v = cfg.get(factor)
    return f"{factor} {v:g}" if isinstance(v, float) else f"{factor} {v}"


@dataclass
class Definition:
    """What makes a test reproducible: kind, one text per trial, the filled configurations (the render seed in
    each), the shuffle seed. `to_dict` / `from_json` are the exported and imported form."""
    kind: str
    texts: list[str]
    configs: list[dict]
    shuffle_seed: int
    language: str = "auto"
    takes: list[dict] = field(default_factory=list)   # a test of a session's takes: what each was (no configs)

    @property
    def trials(self) -> int:
        return len(self.texts)

    @property
    def sources(self) -> int:
        """How many configurations (or takes) are compared."""
        return len(self.takes) if self.takes else len(self.configs)

    @property
    def reference(self) -> int | None:
        """The index of the reference configuration or take (MUSHRA with a reference), else None."""
        if self.kind != "mushra":
            return None
        return next((i for i, c in enumerate(self.takes or self.configs) if c.get("reference")), None)

    def to_dict(self) -> dict:
        d = {"format": FORMAT, "version": 1, "kind": self.kind, "language": self.language, "texts": self.texts,
             "configs": self.configs, "shuffle_seed": self.shuffle_seed}
        if self.takes:
            d["takes"] = self.takes
        return d

    @classmethod
    def from_json(cls, text: str | bytes) -> "Definition":
        """A definition exported by `to_dict` (or a whole exported test: its "definition"), checked."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if len(text) > MAX_DEFINITION_CHARS:
            raise TTSError("the test definition is too large")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise TTSError(f"the test definition is not valid JSON ({e.msg})") from None
        if isinstance(d, dict) and isinstance(d.get("definition"), dict):
            d = d["definition"]
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise TTSError("this file is not a listening test exported by this app")
        if d.get("takes"):
            raise TTSError("this test compared takes of one browser session: their audio is not in the file, so it "
                           "cannot be run again (its answers and results are); a test of rendered configurations can")
        texts = d.get("texts")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise TTSError("the test definition has no list of texts")
        seed = d.get("shuffle_seed")
        if not isinstance(seed, int) or seed < 0:
            raise TTSError("the test definition has no shuffle seed")
        return cls(kind=str(d.get("kind")), texts=texts, configs=parse_configs(d.get("configs")), shuffle_seed=seed,
                   language=str(d.get("language") or "auto"))


def check_kind(kind) -> str:
    k = str(kind or "").strip().lower()
    if k not in KINDS:
        raise TTSError(f"unknown test kind {kind!r}; use ab, abx or mushra")
    return k


def check_trials(trials) -> int:
    try:
        n = float(trials)
    except (TypeError, ValueError):
        raise TTSError(f"trials must be a whole number from {MIN_TRIALS} to {MAX_TRIALS}") from None
    if n != int(n) or not MIN_TRIALS <= n <= MAX_TRIALS:
        raise TTSError(f"trials must be a whole number from {MIN_TRIALS} to {MAX_TRIALS}, got {trials!r}")
    return int(n)


def trial_texts(text, language: str, trials: int, max_chars: int) -> list[str]:
    """One sentence per trial: the user's sentences (or the language's built-in list) in turn."""
    text = text if isinstance(text, str) else ""
    if len(text) > max_chars:
        raise TTSError(f"the text is too long: {len(text)} characters; the limit is {max_chars}")
    sentences = split_sentences(text) or builtin_sentences(language)
    long = [s for s in sentences if len(s) > MAX_SENTENCE_CHARS]
    if long:
        raise TTSError(f"a trial's sentence may have at most {MAX_SENTENCE_CHARS} characters; one has {len(long[0])}")
    return [sentences[i % len(sentences)] for i in range(trials)]


# --- the plan -----------------------------------------------------------------------------------------------

@dataclass
class Stimulus:
    """One thing a listener hears: a configuration's rendering, the hidden reference (the reference's rendering
    again) or the low-pass anchor (the reference filtered)."""
    name: str
    config: int              # the configuration it is rendered from
    role: str = "config"     # "config", "hidden reference", "anchor"


@dataclass
class TrialPlan:
    trial: int                       # 1-based
    seed: int                        # this trial's shuffle seed
    labels: list[str]                # in play order
    stimulus: dict[str, int]         # label -> index into the test's stimuli
    rated: list[str]                 # the labels the answer is about
    answer_key: str | None = None    # ABX: the label X really is (A or B)

    def to_dict(self, stimuli: list[Stimulus], reveal: bool = True) -> dict:
        """The trial's plan; what each label is only with `reveal` (an answered trial: the test stays blind)."""
        d = {"trial": self.trial, "shuffle_seed": self.seed, "labels": self.labels}
        if reveal:
            d["stimuli"] = {lab: stimuli[i].name for lab, i in self.stimulus.items()}
            if self.answer_key:
                d["x_is"] = self.answer_key
        return d


def trial_seed(shuffle_seed: int, trial: int) -> int:
    """Trial `trial`'s own shuffle seed, derived from the test's (recorded in the results)."""
    return random.Random(f"{shuffle_seed}:{trial}").randrange(2**31)


def make_stimuli(d: Definition, factor: str) -> list[Stimulus]:
    if d.takes:
        stimuli = [Stimulus(str(t.get("name") or f"take {i + 1}"), i) for i, t in enumerate(d.takes)]
    else:
        stimuli = [Stimulus(describe(c, factor), i) for i, c in enumerate(d.configs)]
    ref = d.reference
    if ref is not None:
        stimuli.append(Stimulus(f"hidden reference ({stimuli[ref].name})", ref, "hidden reference"))
        stimuli.append(Stimulus(f"anchor (low-pass {ANCHOR_HZ / 1000:g} kHz)", ref, "anchor"))
    return stimuli


def make_plan(d: Definition, stimuli: list[Stimulus]) -> list[TrialPlan]:
    """Each trial's labels, which stimulus each is, in an order shuffled by the trial's seed. A/B and ABX with
    more than two configurations go through the pairs in turn (their order shuffled by the test's seed)."""
    letters = "ABCDEFGH"
    pairs = list(itertools.combinations(range(d.sources), 2))
    random.Random(f"{d.shuffle_seed}:pairs").shuffle(pairs)
    plans = []
    for t in range(1, d.trials + 1):
        seed = trial_seed(d.shuffle_seed, t)
        rng = random.Random(seed)
        if d.kind in ("ab", "abx"):
            pair = list(pairs[(t - 1) % len(pairs)])
            rng.shuffle(pair)
            mapping = {"A": pair[0], "B": pair[1]}
            if d.kind == "ab":
                plans.append(TrialPlan(t, seed, ["A", "B"], mapping, ["A", "B"]))
            else:
                x = rng.choice("AB")
                mapping["X"] = mapping[x]
                plans.append(TrialPlan(t, seed, ["A", "B", "X"], mapping, ["X"], answer_key=x))
        else:
            ref = d.reference
            rated = [i for i, s in enumerate(stimuli) if not (ref is not None and s.role == "config" and i == ref)]
            rng.shuffle(rated)
            mapping = {letters[k]: i for k, i in enumerate(rated)}
            labels = list(mapping)
            if ref is not None:
                mapping = {"R": ref, **mapping}
                labels = ["R"] + labels
            plans.append(TrialPlan(t, seed, labels, mapping, [lab for lab in labels if lab != "R"]))
    return plans


# --- engines ----------------------------------------------------------------------------------------------

@dataclass
class Target:
    """What renders one configuration: an engine and what its `stream` takes."""
    engine: object
    voice: object
    language: str
    seed: int
    sampling: dict
    speed: float
    instruct: str | None = None


class Source:
    """The app's side of a listening test (ui/listen_tab.py implements it): the default configuration, a check of a
    filled configuration that loads nothing (TTSError for an unknown voice or model, a precision the device cannot
    hold), and `open`, which resolves it into a `Target` (loading an extra engine from `pool` for `owner` where
    the app's own engines do not run that model or precision). `ctx`: what the app passes along (the page's
    session, whose own voices a test may use)."""

    def defaults(self) -> dict:
        raise NotImplementedError

    def check(self, cfg: dict, ctx=None) -> None:
        raise NotImplementedError

    def check_factor(self, factor: str) -> None:
        """TTSError where this app cannot vary `factor` (e.g. a remote server that takes no temperature)."""

    def open(self, cfg: dict, pool: "EnginePool", owner: str, ctx=None) -> Target:
        raise NotImplementedError


class EnginePool:
    """Extra engines of listening tests (another checkpoint, another precision): loaded when a test starts, shared
    by the tests that need the same one, closed when the last of them lets go. At most `max_engines` at once: a
    test that would need more is refused (it changes nothing)."""

    def __init__(self, max_engines: int = 2, load: Callable | None = None):
        self.max_engines = max_engines
        self._load = load or self._from_pretrained
        self._engines: dict[tuple, object] = {}
        self._owners: dict[tuple, set[str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _from_pretrained(folder, device, dtype, quantize, engine_kw):
        from tts_engine import TTSEngine

        return TTSEngine.from_pretrained(str(folder), device=device, dtype=dtype, quantize=quantize, **engine_kw)

    def acquire(self, key: tuple, owner: str, engine_kw: dict | None = None):
        """The engine of `key` = (folder, device, dtype, quantize) for `owner` (a test id), loaded if needed."""
        with self._lock:
            if key in self._engines:
                self._owners[key].add(owner)
                return self._engines[key]
            if len(self._engines) >= self.max_engines:
                raise TTSError(f"the server already holds {self.max_engines} extra models for listening tests; "
                               "try again when those tests have finished rendering")
            log.info("listening test %s: loading an extra engine %s", owner, key)
            eng = self._load(*key, engine_kw or {})
            self._engines[key] = eng
            self._owners[key] = {owner}
            return eng

    def release(self, owner: str) -> None:
        """`owner` lets go of its engines; those no test uses any more are closed."""
        closing = []
        with self._lock:
            for key in list(self._owners):
                self._owners[key].discard(owner)
                if not self._owners[key]:
                    closing.append(self._engines.pop(key))
                    del self._owners[key]
        for eng in closing:
            try:
                eng.close()
            except Exception as e:   # an engine that fails to close must not keep the test alive
                log.warning("closing an extra engine failed: %s", e)

    def count(self) -> int:
        with self._lock:
            return len(self._engines)


# --- a test -----------------------------------------------------------------------------------------------

@dataclass
class Answer:
    trial: int
    answer: str | dict
    at: str


@dataclass
class ListenTest:
    id: str
    definition: Definition
    factor: str
    stimuli: list[Stimulus]
    plan: list[TrialPlan]
    created: float = field(default_factory=time.time)
    answers: dict[int, Answer] = field(default_factory=dict)
    files: dict[int, dict[str, str]] = field(default_factory=dict)     # trial -> label -> WAV path
    gains: dict[int, dict[str, float]] = field(default_factory=dict)   # trial -> stimulus name -> dB
    loudness: dict[int, float] = field(default_factory=dict)           # trial -> the matched LUFS
    identical: dict[int, list[str]] = field(default_factory=dict)      # trial -> configurations that came out equal
    fixed: list[np.ndarray] | None = None   # a test of takes: each take's audio (nothing is rendered)
    error: str = ""
    cancelled: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def finished(self) -> bool:
        return len(self.answers) == self.definition.trials

    def plan_json(self) -> str:
        """What /listen_start returns: each trial's stimulus labels in play order."""
        return json.dumps([p.labels for p in self.plan])

    def trial(self, n) -> TrialPlan:
        try:
            t = int(float(n))
        except (TypeError, ValueError):
            raise TTSError(f"trial must be a number from 1 to {self.definition.trials}") from None
        if not 1 <= t <= self.definition.trials:
            raise TTSError(f"this test has trials 1 to {self.definition.trials}; there is no trial {n}")
        return self.plan[t - 1]


def parse_answer(kind: str, plan: TrialPlan, answer) -> str | dict:
    """A checked answer: "A" / "B" / "none" (A/B), "A" / "B" (ABX: what X is), {label: 0-100} for every rated
    label (MUSHRA)."""
    if kind in ("ab", "abx"):
        a = str(answer or "").strip()
        if a.lower() in ("none", "no preference", "="):
            a = NO_PREFERENCE
        a = a.upper() if a != NO_PREFERENCE else a
        allowed = ["A", "B"] + ([NO_PREFERENCE] if kind == "ab" else [])
        if a not in allowed:
            what = "A, B or none (no preference)" if kind == "ab" else "A or B (which one X is)"
            raise TTSError(f"the answer must be {what}, got {answer!r}")
        return a
    scores = answer
    if isinstance(answer, str):
        try:
            scores = json.loads(answer)
        except json.JSONDecodeError:
            raise TTSError('a MUSHRA answer is a JSON object of label → score 0-100, e.g. {"A": 80, "B": 35}') \
                from None
    if not isinstance(scores, dict):
        raise TTSError('a MUSHRA answer is a JSON object of label → score 0-100, e.g. {"A": 80, "B": 35}')
    scores = {str(k).strip().upper(): v for k, v in scores.items()}
    missing = [lab for lab in plan.rated if lab not in scores]
    extra = [lab for lab in scores if lab not in plan.rated]
    if missing or extra:
        raise TTSError(f"rate every stimulus of the trial ({', '.join(plan.rated)}), and only those"
                       + (f"; missing: {', '.join(missing)}" if missing else "")
                       + (f"; not in this trial: {', '.join(extra)}" if extra else ""))
    out = {}
    for lab in plan.rated:
        v = scores[lab]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 100:
            raise TTSError(f"the score of {lab} must be a number from 0 to 100, got {v!r}")
        out[lab] = float(v)
    return out


def results(test: ListenTest) -> dict:
    """The statistics of the answers so far: per stimulus (A/B: wins, ties, share with its interval; MUSHRA: mean
    with its 95 % t-interval) and per pair (A/B: sign-test p; ABX: correct count and its binomial p)."""
    d, stimuli = test.definition, test.stimuli
    answers = [test.answers[t] for t in sorted(test.answers)]
    out = {"kind": d.kind, "answered": len(answers), "trials": d.trials, "factor": test.factor}
    if d.kind == "mushra":
        per = {i: [] for i in range(len(stimuli))}
        for a in answers:
            plan = test.plan[a.trial - 1]
            for lab, score in a.answer.items():
                per[plan.stimulus[lab]].append(score)
        rows = []
        for i, s in enumerate(stimuli):
            if not per[i]:
                continue
            mean, lo, hi = t_interval(per[i])
            rows.append({"stimulus": s.name, "role": s.role, "n": len(per[i]), "mean": mean, "low": lo, "high": hi})
        out["stimuli"] = rows
        hidden = next((r for r in rows if r["role"] == "hidden reference"), None)
        if hidden is not None:
            below = sum(1 for a in answers for lab, v in a.answer.items()
                        if stimuli[test.plan[a.trial - 1].stimulus[lab]].role == "hidden reference" and v < 90)
            out["hidden_reference_below_90"] = below
        return out
    pairs: dict[tuple[int, int], dict] = {}
    seen = {i: 0 for i in range(d.sources)}
    wins = {i: 0 for i in range(d.sources)}
    ties = {i: 0 for i in range(d.sources)}
    for a in answers:
        plan = test.plan[a.trial - 1]
        ia, ib = plan.stimulus["A"], plan.stimulus["B"]
        key = tuple(sorted((ia, ib)))
        p = pairs.setdefault(key, {"first": key[0], "second": key[1], "n": 0, "first_wins": 0, "second_wins": 0,
                                   "ties": 0, "correct": 0})
        p["n"] += 1
        seen[ia] += 1
        seen[ib] += 1
        if d.kind == "ab":
            if a.answer == NO_PREFERENCE:
                p["ties"] += 1
                ties[ia] += 1
                ties[ib] += 1
            else:
                chosen = plan.stimulus[a.answer]
                wins[chosen] += 1
                p["first_wins" if chosen == key[0] else "second_wins"] += 1
        else:
            p["correct"] += int(a.answer == plan.answer_key)
    rows = []
    for i in range(d.sources):
        if not seen[i]:
            continue
        row = {"stimulus": stimuli[i].name, "n": seen[i]}
        if d.kind == "ab":
            lo, hi = wilson_interval(wins[i], seen[i])
            row.update(wins=wins[i], ties=ties[i], share=wins[i] / seen[i], low=lo, high=hi)
        rows.append(row)
    out["stimuli"] = rows
    prs = []
    for p in pairs.values():
        r = {"pair": f"{stimuli[p['first']].name} vs {stimuli[p['second']].name}", "n": p["n"]}
        if d.kind == "ab":
            r.update(first_wins=p["first_wins"], second_wins=p["second_wins"], ties=p["ties"],
                     p_value=sign_test_p(p["first_wins"], p["second_wins"]))
        else:
            lo, hi = wilson_interval(p["correct"], p["n"])
            r.update(correct=p["correct"], p_value=abx_p_value(p["correct"], p["n"]), low=lo, high=hi)
        prs.append(r)
    out["pairs"] = prs
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def summary_markdown(test: ListenTest) -> str:
    """The results as a few lines for the page and the API."""
    r = results(test)
    d = test.definition
    what = "compared: takes of a session" if d.takes else f"varied: {test.factor}"
    head = (f"**{KIND_LABEL[d.kind]}** · {r['answered']}/{d.trials} trials answered · {what} · "
            f"test `{test.id}` · shuffle seed {d.shuffle_seed}")
    lines = [head, ""]
    if not r["answered"]:
        return head + "\n\nNo answers yet."
    same = sorted({p for t in test.answers for p in test.identical.get(t, [])})
    if same:
        lines += [f"⚠ Sample for sample the same in some trials (nothing to hear there): {'; '.join(same)}.", ""]
    if d.kind == "mushra":
        lines += ["| stimulus | n | mean | 95 % interval |", "|---|---|---|---|"]
        for s in r["stimuli"]:
            ci = "n < 2" if math.isnan(s["low"]) else f"{s['low']:.1f} – {s['high']:.1f}"
            lines.append(f"| {s['stimulus']} | {s['n']} | {s['mean']:.1f} | {ci} |")
        if "hidden_reference_below_90" in r and r["hidden_reference_below_90"]:
            lines += ["", f"The hidden reference was rated below 90 in {r['hidden_reference_below_90']} of "
                          f"{r['answered']} trials (ITU-R BS.1534 post-screening excludes a listener who does so in "
                          "more than 15 % of them)."]
    elif d.kind == "ab":
        lines += ["| stimulus | trials | preferred | no preference | share (95 % interval) |", "|---|---|---|---|---|"]
        for s in r["stimuli"]:
            lines.append(f"| {s['stimulus']} | {s['n']} | {s['wins']} | {s['ties']} | {_pct(s['share'])} "
                         f"({_pct(s['low'])} – {_pct(s['high'])}) |")
        for p in r["pairs"]:
            lines.append(f"\n{p['pair']}: {p['first_wins']} : {p['second_wins']} ({p['ties']} no preference), "
                         f"sign test p = {p['p_value']:.3g}")
    else:
        lines += ["| pair | trials | correct | p (binomial, one-sided) |", "|---|---|---|---|"]
        for p in r["pairs"]:
            lines.append(f"| {p['pair']} | {p['n']} | {p['correct']} | {p['p_value']:.3g} |")
        lines += ["", "p is the chance of getting at least that many right by guessing; below 0.05 the difference "
                      "was heard."]
    return "\n".join(lines)


def csv_text(test: ListenTest) -> str:
    """One row per answered trial: what was played under each label, the answer, and (ABX) whether it was right
    and the binomial p-value of all answers up to that row."""
    d = test.definition
    buf = io.StringIO()
    w = csv.writer(buf)
    header = ["test_id", "kind", "trial", "text", "shuffle_seed", "order", "answer", "answered_at"]
    names = [s.name for s in test.stimuli]
    if d.kind == "ab":
        header += ["chosen"]
    elif d.kind == "abx":
        header += ["x_is", "correct", "correct_so_far", "p_value"]
    else:
        header += [f"score: {n}" for n in names]
    w.writerow(header)
    correct = 0
    for k, t in enumerate(sorted(test.answers), 1):
        a, plan = test.answers[t], test.plan[t - 1]
        order = "; ".join(f"{lab}={test.stimuli[i].name}" for lab, i in plan.stimulus.items())
        ans = json.dumps(a.answer) if isinstance(a.answer, dict) else a.answer
        row = [test.id, d.kind, t, d.texts[t - 1], plan.seed, order, ans, a.at]
        if d.kind == "ab":
            row.append("" if a.answer == NO_PREFERENCE else test.stimuli[plan.stimulus[a.answer]].name)
        elif d.kind == "abx":
            ok = a.answer == plan.answer_key
            correct += ok
            row += [plan.answer_key, int(ok), correct, repr(abx_p_value(correct, k))]
        else:
            by = {test.stimuli[plan.stimulus[lab]].name: v for lab, v in a.answer.items()}
            row += [by.get(n, "") for n in names]
        w.writerow(row)
    return buf.getvalue()


def export_dict(test: ListenTest) -> dict:
    """The whole test: definition (enough to run it again), stimuli, the plan with each trial's shuffle seed and
    labels (what each label is, for the answered trials only: a test exported midway stays blind), the answers,
    the loudness matching, the results."""
    return {"test_id": test.id, "definition": test.definition.to_dict(), "factor": test.factor,
            "stimuli": [{"name": s.name, "role": s.role, "config": s.config} for s in test.stimuli],
            "plan": [p.to_dict(test.stimuli, reveal=p.trial in test.answers) for p in test.plan],
            "answers": [{"trial": a.trial, "answer": a.answer, "at": a.at}
                        for a in (test.answers[t] for t in sorted(test.answers))],
            "loudness": {"target_lufs": TARGET_LUFS, "peak_ceiling_dbfs": PEAK_CEILING_DB,
                         "trials": [{"trial": t, "lufs": round(test.loudness[t], 2),
                                     "gains_db": {k: round(v, 2) for k, v in test.gains[t].items()}}
                                    for t in sorted(test.loudness)]},
            "identical": [{"trial": t, "same": v} for t, v in sorted(test.identical.items())],
            "results": results(test)}


# --- the service ------------------------------------------------------------------------------------------

class Listening:
    """The listening tests of one server. `save_wav(int16 samples, name) -> path` writes a WAV the page may serve
    (the app's private file folder); `save_text(text, name, ext) -> path` a download. Tests live `ttl_seconds`."""

    def __init__(self, source: Source, save_wav: Callable, save_text: Callable, max_text_chars: int = 2000,
                 max_new_tokens: int = 2048, ttl_seconds: float = 3600, pool: EnginePool | None = None):
        self.source, self.save_wav, self.save_text = source, save_wav, save_text
        self.max_text_chars, self.max_new_tokens, self.ttl_seconds = max_text_chars, max_new_tokens, ttl_seconds
        self.pool = pool or EnginePool()
        self.tests: dict[str, ListenTest] = {}
        self._lock = threading.Lock()

    # --- starting ---------------------------------------------------------------------------------------
    def start(self, kind, text, configs, trials, ctx=None) -> ListenTest:
        """A new test of `kind` over `trials` sentences of `text` (empty: the built-in list of the configurations'
        language) and the configurations `configs`; the shuffle seed is drawn now (and recorded). `ctx` goes to
        the source (the page's session)."""
        kind = check_kind(kind)
        n = check_trials(trials)
        cfgs = parse_configs(configs)
        language = str(cfgs[0].get("language") or "auto")
        texts = trial_texts(text, language, n, self.max_text_chars)
        d = Definition(kind=kind, texts=texts, configs=cfgs, shuffle_seed=random.randrange(2**31), language=language)
        return self.start_definition(d, fill=True, ctx=ctx)

    def start_takes(self, kind, takes: list[dict], audio: list[np.ndarray], trials) -> ListenTest:
        """A new test of `kind` over recorded audio (a session's takes): `takes` describes each (its "name" is
        its name in the results; "reference": true on one makes a MUSHRA test's reference), `audio` is each one's
        float32 samples at 24 kHz. Every trial plays the same clips in a new order; loudness-matched as usual."""
        kind = check_kind(kind)
        n = check_trials(trials)
        if not MIN_STIMULI <= len(takes) <= MAX_STIMULI or len(audio) != len(takes):
            raise TTSError(f"a test compares {MIN_STIMULI} to {MAX_STIMULI} takes; {len(takes)} were given")
        if any(len(a) < SR // 10 for a in audio):
            raise TTSError("every take must have at least 0.1 s of audio")
        texts = sorted({str(t.get("text") or "") for t in takes})
        title = texts[0] if len(texts) == 1 else " / ".join(t[:60] for t in texts)
        d = Definition(kind=kind, texts=[title] * n, configs=[], shuffle_seed=random.randrange(2**31), takes=takes)
        stimuli = make_stimuli(d, "take")
        test = ListenTest(id=secrets.token_hex(6), definition=d, factor="take", stimuli=stimuli,
                          plan=make_plan(d, stimuli), fixed=[np.asarray(a, np.float32) for a in audio])
        self._keep(test, [])
        return test

    def load(self, definition: str | bytes) -> ListenTest:
        """A new test exactly as an exported one: same texts, configurations (seeds included) and shuffles."""
        d = Definition.from_json(definition)
        check_kind(d.kind)
        check_trials(d.trials)
        if any(len(t) > MAX_SENTENCE_CHARS or not t.strip() for t in d.texts):
            raise TTSError(f"each text of the definition must have 1 to {MAX_SENTENCE_CHARS} characters")
        return self.start_definition(d, fill=False)

    def start_definition(self, d: Definition, fill: bool, ctx=None) -> ListenTest:
        if fill:   # the defaults written into each configuration: the definition then names everything it used
            base = {**self.source.defaults(), "seed": random.randrange(2**31)}
            d.configs = [{**base, **c} for c in d.configs]
        factor = varied_factor(d.configs)
        self.source.check_factor(factor)
        for i, cfg in enumerate(d.configs, 1):
            try:
                self.source.check(cfg, ctx)
            except TTSError as e:
                raise TTSError(f"configuration {i}: {e}") from None
        stimuli = make_stimuli(d, factor)
        test = ListenTest(id=secrets.token_hex(6), definition=d, factor=factor, stimuli=stimuli,
                          plan=make_plan(d, stimuli))
        targets = []
        try:
            for i, cfg in enumerate(d.configs, 1):
                try:
                    targets.append(self.source.open(cfg, self.pool, test.id, ctx))
                except TTSError as e:
                    raise TTSError(f"configuration {i}: {e}") from None
        except BaseException:
            self.pool.release(test.id)
            raise
        self._keep(test, targets)
        return test

    def _keep(self, test: ListenTest, targets: list[Target]) -> None:
        """Keep `test` and start rendering its trials."""
        with self._lock:
            self._prune()
            self.tests[test.id] = test
        threading.Thread(target=self._render_all, args=(test, targets), name=f"listen-{test.id}",
                         daemon=True).start()
        log.info("listening test %s: %s, %d trials, %d stimuli, varied %s", test.id, test.definition.kind,
                 test.definition.trials, len(test.stimuli), test.factor)

    def _prune(self) -> None:
        now = time.time()
        for tid, t in list(self.tests.items()):
            if now - t.created > self.ttl_seconds:
                self._drop(tid)
        while len(self.tests) >= MAX_TESTS:
            done = [tid for tid, t in self.tests.items() if t.finished] or list(self.tests)
            self._drop(min(done, key=lambda tid: self.tests[tid].created))

    def _drop(self, tid: str) -> None:
        t = self.tests.pop(tid, None)
        if t is not None:
            with t.cond:
                t.cancelled = True
                t.cond.notify_all()

    def get(self, test_id) -> ListenTest:
        tid = str(test_id or "").strip()
        with self._lock:
            t = self.tests.get(tid)
            if t is not None and time.time() - t.created > self.ttl_seconds:
                self._drop(tid)
                t = None
        if t is None:
            raise TTSError(f"there is no listening test {tid!r} (unknown, or expired: tests and their audio live "
                           f"{self.ttl_seconds / 3600:g} h); start or load one")
        return t

    # --- rendering --------------------------------------------------------------------------------------
    def _render_all(self, test: ListenTest, targets: list[Target]) -> None:
        try:
            for plan in test.plan:
                if test.cancelled:
                    return
                self._render_trial(test, plan, targets)
        except Exception as e:
            if test.cancelled:     # the test was closed (the server stops): its engines went with it
                return
            msg = str(e) if isinstance(e, TTSError) else f"{type(e).__name__}: {e}"
            log.warning("listening test %s: rendering failed: %s", test.id, msg)
            with test.cond:
                test.error = msg.splitlines()[0][:300] if msg else type(e).__name__
                test.cond.notify_all()
        finally:
            self.pool.release(test.id)    # extra engines are let go as soon as every trial is rendered

    def _render_trial(self, test: ListenTest, plan: TrialPlan, targets: list[Target]) -> None:
        text = test.definition.texts[plan.trial - 1]
        streams = []
        for tg in targets:    # opened together: the engine generates them in one batch
            streams.append(tg.engine.stream(text, voice=tg.voice, language=tg.language, instruct=tg.instruct,
                                            seed=tg.seed, sampling=tg.sampling, max_new_tokens=self.max_new_tokens))
        audio = list(test.fixed) if test.fixed is not None else []
        for tg, s in zip(targets, streams):
            parts = list(s)
            wav = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
            if tg.speed != 1.0:
                wav = stretch(wav, tg.speed)
            audio.append(wav)
        same = [f"{test.stimuli[i].name} = {test.stimuli[j].name}"
                for i, j in itertools.combinations(range(len(audio)), 2)
                if audio[i].shape == audio[j].shape and np.array_equal(audio[i], audio[j])]
        clips = []
        for s in test.stimuli:
            wav = audio[s.config]
            clips.append(low_pass_anchor(wav) if s.role == "anchor" else wav)
        matched, gains, lufs = match_loudness(clips)
        files = {}
        for lab in plan.labels:
            pcm = np.clip(matched[plan.stimulus[lab]], -1.0, 1.0)
            files[lab] = self.save_wav((pcm * 32767.0).round().astype(np.int16), f"stimulus_{lab}")
        with test.cond:
            test.files[plan.trial] = files
            test.gains[plan.trial] = {s.name: g for s, g in zip(test.stimuli, gains)}
            test.loudness[plan.trial] = lufs
            if same:
                test.identical[plan.trial] = same
            test.cond.notify_all()

    def stimulus(self, test_id, trial, label, timeout: float = 600) -> str:
        """The loudness-matched WAV of `label` in `trial` (waits while that trial is being rendered)."""
        test = self.get(test_id)
        plan = test.trial(trial)
        lab = str(label or "").strip().upper()
        if lab not in plan.labels:
            raise TTSError(f"trial {plan.trial} has the stimuli {', '.join(plan.labels)}; there is no {label!r}")
        return self.files_of(test, plan.trial, timeout)[lab]

    def files_of(self, test: ListenTest, trial: int, timeout: float = 600) -> dict[str, str]:
        """Trial `trial`'s files by label, once rendered."""
        deadline = time.monotonic() + timeout
        with test.cond:
            while trial not in test.files:
                if test.error:
                    raise TTSError(f"rendering this test failed: {test.error}")
                if test.cancelled:
                    raise TTSError("this listening test was closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TTSError(f"trial {trial} is still being rendered; try again in a moment")
                test.cond.wait(min(left, 1.0))
            return dict(test.files[trial])

    # --- answers and results ----------------------------------------------------------------------------
    def answer(self, test_id, trial, answer) -> str:
        """Record the answer of `trial`; -> the progress line. A finished test, a trial answered already or a
        malformed answer is refused and changes nothing."""
        test = self.get(test_id)
        plan = test.trial(trial)
        with test.cond:
            if test.finished:
                raise TTSError(f"this test is finished (all {test.definition.trials} trials answered): get the report")
            if plan.trial in test.answers:
                raise TTSError(f"trial {plan.trial} is answered already; the next unanswered is trial "
                               f"{self.next_trial(test)}")
            value = parse_answer(test.definition.kind, plan, answer)
            test.answers[plan.trial] = Answer(plan.trial, value, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        return self.progress(test)

    @staticmethod
    def next_trial(test: ListenTest) -> int | None:
        return next((p.trial for p in test.plan if p.trial not in test.answers), None)

    def progress(self, test: ListenTest) -> str:
        n, total = len(test.answers), test.definition.trials
        if test.finished:
            return f"**Finished** · {n}/{total} trials answered · the results are in the report"
        return f"**{n}/{total} answered** · next: trial {self.next_trial(test)}"

    def report(self, test_id) -> tuple[str, str, str]:
        """(summary, CSV path, JSON path) of the answers so far."""
        test = self.get(test_id)
        with test.cond:
            summary, text, whole = summary_markdown(test), csv_text(test), export_dict(test)
        return (summary, self.save_text(text, f"listening_{test.id}", "csv"),
                self.save_text(json.dumps(whole, indent=1, ensure_ascii=False), f"listening_{test.id}", "json"))

    def close(self) -> None:
        with self._lock:
            for tid in list(self.tests):
                self._drop(tid)

