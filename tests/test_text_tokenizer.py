"""Text tokenizer: our TextTokenizer gives the official wrapper's prompt ids, and the tiny test tokenizer is
deterministic and fast.

One oracle run (tests/oracle/text_tokenizer_ref.py, official AutoProcessor + `_tokenize_texts`) covers:
- "tok":  the tiny tokenizer files plus a minimal config.json ({"model_type": "qwen3_tts"});
- "ckpt": a full tiny checkpoint from make_tiny (the complete config.json the official config class parses);
- "bare": only the files write_tiny_tokenizer writes (preprocessor_config.json names the processor);
- "big_*": the tiny tokenizer padded past 100,000 BPE entries, with config.json saying transformers_version
  absent / 4.57.3 / 4.57.1, where transformers 4.57.3 does (absent, 4.57.3) or does not (4.57.1) swap in its
  "fixed Mistral" split regex; our `pretokenizer="official"` must follow it.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tts_engine.errors import TTSError
from tts_engine.text_tokenizer import TextTokenizer
from tts_engine.tiny_tokenizer import write_tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog! Isn't it? I'm sure they'll say we've won; you'd agree.",
    "In 2024 revenue was $1,234,567.89 (+12.5%); call 555-0100 at 10:45 a.m. #1 @home 3/4 ½ 1e-9",
    "你好，世界！今天天气不错。",
    "こんにちは、世界。音声合成のテストです。カタカナ ｶﾀｶﾅ",
    "안녕하세요, 세계. 오늘 날씨가 좋네요.",
    "Привет, как дела? Сегодня хорошая погода.",
    "Guten Tag! Größe, Straße, Ärger. Où est la bibliothèque ? ¿Cómo estás? ¡Olé!",
    "Emoji 😀👍🏽👨‍👩‍👧 and symbols ♪ ♫ © ™ → ≠ ∞ — “quotes” «guillemets» … ",
    "multiple    spaces   and\ttabs\t\there",
    "line one\nline two\n\nline four\r\nwindows\n",
    "   leading and trailing spaces   ",
    "\nstarts with a newline",
    "\n\n",
    " ",
    "",
    "e\u0301te\u0301 cafe\u0301 (decomposed accents, NFC composes them)",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３",
    "iPhone HelloWorld McDonald's JavaScript eBay 'sup DON'T HTMLParser camelCaseWords",
    "नमस्ते दुनिया, ภาษาไทย, Tiếng Việt, عربى, עברית",
    "special strings <|im_start|> and <|im_end|> and <tts_pad> and <think> inside </think> text",
    "a" * 300,
    "x" + "!" * 50 + "?" * 3 + "..." + "123456789012345",
    "\u200b zero\u200dwidth \ufeff bom \x00 nul \x07 bell",
    "Mixed 中文 English 日本語 한국어 123 text.",
]


def _big_variant(src: Path, dst: Path, transformers_version: str | None) -> None:
    """The tiny tokenizer with its vocabulary padded past 100,000 BPE entries (unreachable padding) and a
    config.json with the given transformers_version. A first-rank merge "i P" makes the split regex visible in
    the ids: the Qwen2 regex keeps "iPhone" in one piece (-> "iP"), the "fixed Mistral" one splits "i|Phone"."""
    dst.mkdir(parents=True)
    vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
    n, size = len(vocab), 100_064
    vocab["iP"] = n
    vocab.update({f"zzpad{i}": i for i in range(n + 1, size)})
    merges = (src / "merges.txt").read_text(encoding="utf-8").split("\n")
    (dst / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (dst / "merges.txt").write_text("\n".join([merges[0], "i P", *merges[1:]]), encoding="utf-8")
    cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["added_tokens_decoder"] = {str(int(k) - n + size): v for k, v in cfg["added_tokens_decoder"].items()}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    config = {"model_type": "qwen3_tts"}
    if transformers_version is not None:
        config["transformers_version"] = transformers_version
    (dst / "config.json").write_text(json.dumps(config))


BIG = {"big_none": None, "big_4573": "4.57.3", "big_4571": "4.57.1"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    root = tmp_path_factory.mktemp("text_tok")
    out = {"tok": root / "tok", "ckpt": root / "ckpt", "bare": root / "bare"}
    ids = write_tiny_tokenizer(out["tok"])
    (out["tok"] / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}))
    make_tiny(out["ckpt"], kind="custom_voice")
    write_tiny_tokenizer(out["bare"])
    for name, tv in BIG.items():
        out[name] = root / name
        _big_variant(out["bare"], out[name], tv)
    return out, ids


@pytest.fixture(scope="module")
def official(folders, run_oracle, tmp_path_factory):
    paths, _ = folders
    d = tmp_path_factory.mktemp("text_tok_ref")
    (d / "texts.json").write_text(json.dumps(TEXTS, ensure_ascii=False), encoding="utf-8")
    names = list(paths)
    extra = [a for n in names[1:] for a in ("--also", str(paths[n]))]
    run_oracle("text_tokenizer_ref.py", paths[names[0]], d / "ref.json", "--texts", d / "texts.json", *extra)
    results = json.loads((d / "ref.json").read_text(encoding="utf-8"))["results"]
    return dict(zip(names, results))


def _ours(tok: TextTokenizer, text: str) -> dict:
    return {"assistant": tok.assistant_ids(text).tolist(), "ref": tok.ref_ids(text).tolist(),
            "instruct": tok.instruct_ids(text).tolist()}


# --- parity with the official processor ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["tok", "ckpt", "bare", *BIG])
def test_prompt_ids_match_official(folders, official, name):
    paths, _ = folders
    ref = official[name]
    assert ref["processor_class"] == "Qwen3TTSProcessor" and ref["tokenizer_class"] == "Qwen2TokenizerFast"
    assert [c["text"] for c in ref["cases"]] == TEXTS
    tok = TextTokenizer.from_pretrained(paths[name])
    assert tok.pretokenizer == ("mistral_fix" if ref["fix_mistral_regex"] else "qwen2")
    for case in ref["cases"]:
        assert _ours(tok, case["text"]) == {k: case[k] for k in ("assistant", "ref", "instruct")}, case["text"]


def test_official_regex_decision_is_exercised(official):
    """The big variants really differ: 4.57.3 swaps the regex for a missing or 4.57.3 transformers_version
    and not for 4.57.1, and the swap changes ids of some texts, so the parity test above can tell."""
    assert not official["tok"]["fix_mistral_regex"] and not official["ckpt"]["fix_mistral_regex"]
    assert official["big_none"]["fix_mistral_regex"] and official["big_4573"]["fix_mistral_regex"]
    assert not official["big_4571"]["fix_mistral_regex"]
    assert official["big_4573"]["split_regex"] != official["big_4571"]["split_regex"]
    differ = [a["text"] for a, b in zip(official["big_4573"]["cases"], official["big_4571"]["cases"])
              if a["assistant"] != b["assistant"]]
    assert any("iPhone" in t for t in differ), differ


def test_special_ids_match_config_and_official(folders, official):
    paths, ids = folders
    tok = TextTokenizer.from_pretrained(paths["tok"])
    want = {"im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>", "tts_pad_token_id": "<tts_pad>",
            "tts_bos_token_id": "<tts_text_bos>", "tts_eos_token_id": "<tts_text_eod>"}
    for key, token in want.items():
        assert tok.token_id(token) == ids[key] == official["tok"]["special_ids"][token]
    assert ids["text_vocab_size"] % 64 == 0 and tok.vocab_size <= ids["text_vocab_size"] < tok.vocab_size + 64
    assert official["tok"]["vocab_size"] + 12 == tok.vocab_size   # 12 added tokens after the BPE entries
    cfg = json.loads((paths["ckpt"] / "config.json").read_text())
    for key in want:
        assert cfg[key] == ids[key]


# --- the slicing offsets the prompt builder relies on ---------------------------------------------------
def test_slicing_offsets(folders):
    paths, ids = folders
    tok = TextTokenizer.from_pretrained(paths["tok"])
    ims, ime = ids["im_start_token_id"], ids["im_end_token_id"]
    asst, user, nl = tok.token_id("assistant"), tok.token_id("user"), tok.token_id("\u010a")
    assert None not in (asst, user, nl)
    role = [ims, asst, nl]
    for text in TEXTS:
        a, r, i = tok.assistant_ids(text), tok.ref_ids(text), tok.instruct_ids(text)
        assert a.dtype == r.dtype == i.dtype == torch.long and a.dim() == r.dim() == i.dim() == 1
        assert a[-5:].tolist() == [ime, nl, ims, asst, nl]
        assert r[-2:].tolist() == [ime, nl]
        assert i[-2:].tolist() == [ime, nl]
        if text.startswith(("\n", "\r")):
            continue  # the role's "\n" merges with the text's leading newline (as in the official code)
        assert a[:3].tolist() == role and r[:3].tolist() == role and i[:3].tolist() == [ims, user, nl]
        body = a[3:-5]
        assert torch.equal(r[3:-2], body) and torch.equal(i[3:-2], body)
        assert tok.count_tokens(text) == body.numel()
        if "<" not in text and "e\u0301" not in text:   # no special strings, already NFC
            assert tok.decode(body) == text
    # the empty reference text edge case: nothing between the role and <|im_end|>
    assert tok.ref_ids("").tolist() == [ims, asst, nl, ime, nl]
    assert tok.assistant_ids("").tolist() == [ims, asst, nl, ime, nl, ims, asst, nl]
    assert tok.count_tokens("") == 0


def test_concurrent_use_gives_the_same_ids(folders):
    paths, _ = folders
    tok = TextTokenizer.from_pretrained(paths["tok"])
    want = [tok.assistant_ids(t).tolist() for t in TEXTS]
    errors, bad = [], []

    def worker(k):
        try:
            for rep in range(40):
                j = (k + rep) % len(TEXTS)
                if tok.assistant_ids(TEXTS[j]).tolist() != want[j]:
                    bad.append(j)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad


def test_bad_input_and_missing_files(tmp_path, folders):
    paths, _ = folders
    tok = TextTokenizer.from_pretrained(paths["tok"])
    with pytest.raises(TTSError):
        tok.assistant_ids(None)
    with pytest.raises(TTSError):
        tok.count_tokens(b"bytes")
    with pytest.raises(TTSError, match="no text tokenizer"):
        TextTokenizer.from_pretrained(tmp_path)
    with pytest.raises(TTSError):
        TextTokenizer.from_pretrained(paths["tok"], pretokenizer="gpt2")


def test_forced_pretokenizer(folders, official):
    """big_4571 and big_4573 differ only in config.json: forcing the regex gives the other folder's ids."""
    paths, _ = folders
    for name, force, other in (("big_4571", "mistral_fix", "big_4573"), ("big_4573", "qwen2", "big_4571")):
        tok = TextTokenizer.from_pretrained(paths[name], pretokenizer=force)
        assert tok.pretokenizer == force
        for case in official[other]["cases"]:
            assert _ours(tok, case["text"]) == {k: case[k] for k in ("assistant", "ref", "instruct")}


# --- the tiny tokenizer itself ------------------------------------------------------------------------
def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tiny_tokenizer_is_deterministic(tmp_path):
    a = write_tiny_tokenizer(tmp_path / "a")
    b = write_tiny_tokenizer(tmp_path / "b")
    assert a == b and _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "merges.txt", "preprocessor_config.json", "tokenizer_config.json", "vocab.json"]
    # another process (other hash seeds, other thread pool) writes the same bytes
    code = ("import sys; from tts_engine.tiny_tokenizer import write_tiny_tokenizer as w; "
            "print(w(sys.argv[1], seed=int(sys.argv[2])))")
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="3")
    for seed in (0, 7):   # the tokenizer is a fixed fixture: the seed changes nothing
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"p{seed}"), str(seed)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.strip() == str(a)
        assert _digest(tmp_path / f"p{seed}") == _digest(tmp_path / "a")
    assert write_tiny_tokenizer(tmp_path / "c", seed=3) == a and _digest(tmp_path / "c") == _digest(tmp_path / "a")
    # the ids the tiny model configs (and the recorded official runs) were built with
    assert a == {"im_start_token_id": 601, "im_end_token_id": 602, "tts_pad_token_id": 603, "tts_bos_token_id": 604,
                 "tts_eos_token_id": 605, "text_vocab_size": 640}


def test_tiny_tokenizer_is_small_and_fast(tmp_path):
    write_tiny_tokenizer(tmp_path / "warm")   # imports
    t0 = time.perf_counter()
    ids = write_tiny_tokenizer(tmp_path / "t", seed=3)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, elapsed
    vocab = json.loads((tmp_path / "t" / "vocab.json").read_text(encoding="utf-8"))
    assert 400 <= len(vocab) <= 1000
    assert 400 <= ids["text_vocab_size"] <= 1088
    tok = TextTokenizer.from_pretrained(tmp_path / "t")
    for text in TEXTS:   # byte-level: everything encodes and decodes back (NFC aside)
        ids_ = tok.encode(text)
        if "<" not in text and "e\u0301" not in text:
            assert tok.decode(ids_) == text
