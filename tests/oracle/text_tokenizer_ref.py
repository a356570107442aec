"""Oracle: the official prompt token ids (qwen-tts 0.1.1 on transformers 4.57.3) for sample texts.

usage: text_tokenizer_ref.py CKPT_DIR OUT_FILE [--texts TEXTS_JSON] [--also DIR ...]

For CKPT_DIR (and every --also DIR) the processor is loaded exactly as `Qwen3TTSModel.from_pretrained`
does it: register the qwen3_tts config and processor, then
`AutoProcessor.from_pretrained(folder, fix_mistral_regex=True)`. A folder therefore needs the tokenizer files
(vocab.json, merges.txt, tokenizer_config.json) plus either config.json with "model_type": "qwen3_tts" or
preprocessor_config.json with "processor_class": "Qwen3TTSProcessor". Each text is then put through the
official `_build_assistant_text` / `_build_ref_text` / `_build_instruct_text` and `_tokenize_texts` of a
`Qwen3TTSModel` wrapping that processor (no model weights are loaded).

OUT_FILE (JSON): {"results": [{"folder", "processor_class", "tokenizer_class", "split_regex",
"fix_mistral_regex", "vocab_size", "special_ids", "cases": [{"text", "assistant", "ref", "instruct"}]}]},
one result per folder, CKPT_DIR first. TEXTS_JSON is a JSON list of strings; without it a built-in list is
used. Runs in the oracle venv only.
"""
import argparse
import json
import types
from pathlib import Path

import torch

import tests.oracle.official  # noqa: F401  (stand-ins first)
from qwen_tts import Qwen3TTSModel
from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSProcessor
from transformers import AutoConfig, AutoProcessor

DEFAULT_TEXTS = [
    "Hello world, this is a test.",
    "你好，世界！今天天气不错。",
    "こんにちは、世界。",
    "안녕하세요, 세계.",
    "I'm 42 years old; it's 3.14 o'clock!",
    "",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
            "assistant", "user", "\u010a"]


def split_regex(tokenizer) -> str | None:
    pre = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    for p in ([pre] if pre and pre.get("type") != "Sequence" else (pre or {}).get("pretokenizers", [])):
        if p.get("type") == "Split":
            return p["pattern"].get("Regex") or p["pattern"].get("String")
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt_dir")
    ap.add_argument("out_file")
    ap.add_argument("--texts")
    ap.add_argument("--also", action="append", default=[])
    args = ap.parse_args()
    texts = json.loads(Path(args.texts).read_text(encoding="utf-8")) if args.texts else DEFAULT_TEXTS

    # as in Qwen3TTSModel.from_pretrained
    AutoConfig.register("qwen3_tts", Qwen3TTSConfig)
    AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor)

    results = []
    for folder in [args.ckpt_dir, *args.also]:
        processor = AutoProcessor.from_pretrained(folder, fix_mistral_regex=True)
        wrapper = Qwen3TTSModel(model=types.SimpleNamespace(device=torch.device("cpu")), processor=processor)
        tok = processor.tokenizer
        cases = []
        for text in texts:
            case = {"text": text}
            for key, build in (("assistant", wrapper._build_assistant_text), ("ref", wrapper._build_ref_text),
                               ("instruct", wrapper._build_instruct_text)):
                ids = wrapper._tokenize_texts([build(text)])[0]
                assert ids.dim() == 2 and ids.shape[0] == 1, ids.shape
                case[key] = ids[0].tolist()
            cases.append(case)
        results.append({
            "folder": str(folder),
            "processor_class": type(processor).__name__,
            "tokenizer_class": type(tok).__name__,
            "split_regex": split_regex(tok),
            "fix_mistral_regex": bool(getattr(tok, "fix_mistral_regex", False)),
            "vocab_size": tok.vocab_size,
            "special_ids": {s: tok.convert_tokens_to_ids(s) for s in SPECIALS},
            "cases": cases,
        })
    Path(args.out_file).write_text(json.dumps({"results": results}, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()
