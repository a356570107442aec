"""A small byte-level BPE text tokenizer in the official Qwen3-TTS checkpoint layout, for tiny test checkpoints.

`write_tiny_tokenizer(folder)` writes

- `vocab.json` / `merges.txt`: a byte-level BPE with `VOCAB_SIZE` (600) entries: the 256-symbol GPT-2 byte
  alphabet, so every string encodes, plus merges trained with `tokenizers`' BpeTrainer under the Qwen2
  pre-tokenizer regex on a built-in multilingual corpus (English, German, French, Spanish, Italian,
  Portuguese, Russian, Chinese, Japanese, Korean, digits, punctuation, whitespace, emoji);
- `tokenizer_config.json`: `"tokenizer_class": "Qwen2Tokenizer"`, the added tokens right after the BPE
  vocabulary in `added_tokens_decoder` (the kinds the released checkpoints carry: `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>`, the TTS tokens, two non-special ones, the audio ones) and the released
  checkpoints' special-token settings (no BOS, eos `<|im_end|>`, pad `<|endoftext|>`);
- `preprocessor_config.json`: `{"processor_class": "Qwen3TTSProcessor"}`, which lets the official
  `AutoProcessor.from_pretrained(folder)` find the processor even without a config.json (with the qwen3_tts
  config registered, config.json's "model_type": "qwen3_tts" alone also does).

As in the real vocabulary, the role words "assistant" and "user" are single tokens, so the official prompt
slicing ([:3] role, [3:-5] text) holds. The output is byte-identical across runs and processes and does not
depend on `seed` (kept for symmetry with make_tiny): it is a fixed fixture.
"""
from __future__ import annotations

import json
from pathlib import Path

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB_SIZE = 600        # BPE entries (256 byte symbols + merges); the added tokens follow

# (content, special) in id order, right after the BPE vocabulary; the released checkpoints carry the same
# kinds (special ones, two non-special ones, the audio / TTS ones). The first six ids are the ones the model
# config uses; the total (612) stays below text_vocab_size (640).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True),
    ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]

# Fixed: tests that compare with the official code on random tiny weights were tuned on exactly this
# tokenizer (a different one changes every prompt), so keep its output unchanged.
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


def _train():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(CORPUS * 3, trainer)  # pair counts, so the order of the lines does not matter
    vocab = tok.get_vocab()
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    if len(vocab) != VOCAB_SIZE or sorted(vocab.values()) != list(range(VOCAB_SIZE)):
        raise RuntimeError(f"tiny tokenizer training gave {len(vocab)} entries, expected {VOCAB_SIZE}")
    for word in ("assistant", "user"):
        if word not in vocab:
            raise RuntimeError(f"tiny tokenizer: {word!r} is not a single token")
    return vocab, merges


def write_tiny_tokenizer(folder: str | Path, seed: int = 0) -> dict[str, int]:
    """Write vocab.json, merges.txt, tokenizer_config.json and preprocessor_config.json into `folder`.

    Returns the text-side ids for the model's config.json: im_start_token_id (601), im_end_token_id (602),
    tts_pad_token_id (603), tts_bos_token_id (604), tts_eos_token_id (605) and text_vocab_size (640: all 612
    tokens, rounded up to a multiple of 64, the size of the text embedding table). `seed` changes nothing."""
    del seed
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = _train()

    # vocab.json ordered by id and merges.txt in rank order, as the released checkpoints store them
    ordered = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    (folder / "vocab.json").write_text(json.dumps(ordered, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n", encoding="utf-8")

    ids = {content: VOCAB_SIZE + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    added = {str(ids[content]): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": special}
             for content, special in ADDED_TOKENS}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS
                                      if special and c != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"processor_class": "Qwen3TTSProcessor"}, indent=2) + "\n", encoding="utf-8")

    total = VOCAB_SIZE + len(ADDED_TOKENS)
    return {"im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
            "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"],
            "tts_eos_token_id": ids["<tts_text_eod>"], "text_vocab_size": -(-total // 64) * 64}
