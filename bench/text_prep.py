"""What the model reads (serving/text_prep.py) at the size narrators use: `python -m bench text_prep`.

A dictionary of N entries (default 10,000: single words, two- and three-word phrases, capitalised and lowercase
keys, abbreviations with a final period) built once, then applied to a narration text of about 2,000 characters
with numbers, dates, times and currencies in it: the dictionary alone, and the whole preparation (pause tags,
dictionary, numbers read out). Median and 95th percentile of repeated runs; the target is a few ms for 10,000
entries (docs/text-and-takes.md).
"""
from __future__ import annotations

import random
import time


def make_dictionary(n: int, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word():
        return "".join(rng.choice(letters) for _ in range(rng.randint(3, 10)))
    out = {}
    while len(out) < n:
        kind = rng.random()
        k = word()
        if kind < 0.2:
            k = k.capitalize()
        elif kind < 0.3:
            k = k.upper()
        elif kind < 0.5:
            k = f"{k} {word()}"
        elif kind < 0.55:
            k = f"{k} {word()} {word()}"
        elif kind < 0.6:
            k = k[:4] + "."
        out[k] = word()
    return out


def narration(entries: dict[str, str], chars: int = 2000, seed: int = 1) -> str:
    """Prose of about `chars` characters, one word in five a dictionary key, with numbers and pause tags."""
    rng = random.Random(seed)
    keys = list(entries)
    filler = ("the of and a to in is was he for it with as his on be at by had are but from or have an they which "
              "one you were all we her she there would their").split()
    extras = ["$12.50", "2024-03-05", "9:30", "15%", "1,234", "3rd", "[pause 0.5s]", "Dr."]
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        r = rng.random()
        words.append(rng.choice(keys) if r < 0.2 else rng.choice(extras) if r < 0.25 else rng.choice(filler))
        if rng.random() < 0.08:
            words[-1] += "."
    return " ".join(words)


def measure(n: int = 10000, chars: int = 2000, runs: int = 50) -> dict:
    from serving import text_prep

    entries = make_dictionary(n)
    t = time.perf_counter()
    lexicon = text_prep.Lexicon(entries)
    build_ms = (time.perf_counter() - t) * 1000
    text = narration(entries, chars)
    text_prep.prepare(text, "english", lexicon)            # num2words' first import outside the timing

    def timed(fn):
        xs = []
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t) * 1000)
        xs.sort()
        return xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.95))]
    apply_ms = timed(lambda: lexicon.apply(text))
    prepare_ms = timed(lambda: text_prep.prepare(text, "english", lexicon))
    changed = sum(1 for a, b in zip(text.split(), lexicon.apply(text).split()) if a != b)
    return {"entries": len(lexicon), "chars": len(text), "build_ms": build_ms, "apply_ms": apply_ms,
            "prepare_ms": prepare_ms, "words_changed": changed}


def main(argv=None) -> int:
    import argparse

    from bench.common import load_average

    ap = argparse.ArgumentParser(prog="python -m bench text_prep", description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10000, help="dictionary entries (default 10000)")
    ap.add_argument("--chars", type=int, default=2000, help="characters of text (default 2000)")
    ap.add_argument("--runs", type=int, default=50)
    a = ap.parse_args(argv)
    r = measure(a.entries, a.chars, a.runs)
    print(f"CPU, load {load_average()}")
    print(f"dictionary of {r['entries']} entries built in {r['build_ms']:.1f} ms (once per change)")
    print(f"text of {r['chars']} characters, {r['words_changed']}+ words respelled")
    print(f"dictionary applied:      median {r['apply_ms'][0]:.2f} ms, p95 {r['apply_ms'][1]:.2f} ms")
    print(f"whole preparation:       median {r['prepare_ms'][0]:.2f} ms, p95 {r['prepare_ms'][1]:.2f} ms "
          "(pause tags, dictionary, numbers read out)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
