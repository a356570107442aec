"""A small byte-level BPE text tokenizer in the Qwen2 layout (vocab.json, merges.txt, tokenizer_config.json),
for the tiny test checkpoints. Same pre-tokenizer regex and byte-level alphabet as Qwen2, so any text
encodes; ~600 merges trained deterministically on a built-in multilingual corpus."""
from __future__ import annotations

import json
from pathlib import Path

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
CORPUS = [
    "Hello world, this is a test. The quick brown fox jumps over the lazy dog. How are you today?",
    "Ladies and gentlemen, please remain calm. Speech synthesis turns text into sound, 1234567890.",
    "Guten Tag, wie geht es Ihnen? Bonjour, comment allez-vous? Hola, ¿cómo estás? Ciao, come stai?",
    "Olá, tudo bem? Привет, как дела? Сегодня хорошая погода.",
    "你好，世界！今天天气不错。我们一起去公园散步吧。语音合成。",
    "こんにちは、世界。今日はいい天気ですね。音声合成のテストです。",
    "안녕하세요, 세계. 오늘 날씨가 좋네요. 음성 합성 테스트입니다.",
    "\n\n  multiple   spaces\tand tabs! 😀 emoji.",
] + ["assistant\nuser\nassistant\n"] * 40  # the role words must be single tokens (prompt slicing)
VOCAB_TARGET = 600


def write_tiny_tokenizer(folder: str | Path, seed: int = 0) -> dict[str, int]:
    """Write the tokenizer files into `folder`; returns the special ids for config.json."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    corpus = CORPUS[seed % len(CORPUS):] + CORPUS[:seed % len(CORPUS)]
    tok.train_from_iterator(corpus * 3, trainer)
    vocab = tok.get_vocab()
    # vocab.json sorted by id, merges.txt in rank order: the layout Qwen2Tokenizer reads
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]
    (folder / "vocab.json").write_text(json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1])),
                                                  ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [m if isinstance(m, str) else " ".join(m) for m in merges]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    base = len(vocab)
    ids = {s: base + i for i, s in enumerate(SPECIALS)}
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for s, i in ids.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "model_max_length": 32768, "split_special_tokens": False,
        "clean_up_tokenization_spaces": False, "add_prefix_space": False,
    }, indent=2, ensure_ascii=False), encoding="utf-8")
    (folder / "preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen3TTSProcessor"}))
    total = base + len(SPECIALS)
    return {"im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
            "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"],
            "tts_eos_token_id": ids["<tts_text_eod>"], "text_vocab_size": -(-total // 64) * 64}
