"""Test helper: a tiny random Whisper checkpoint made here (no hub): the same classes as openai/whisper-*
(WhisperConfig, WhisperForConditionalGeneration, WhisperTokenizer, WhisperFeatureExtractor, GenerationConfig with
languages and tasks), tiny dimensions. Its byte-level vocabulary has the 256 byte symbols and no merges. The
end-of-text embedding row is zero (so is its logit) and every byte but a-z is suppressed: the random model writes
lower-case letters rather than stopping at once, up to `max_target_positions` tokens."""
from __future__ import annotations

from pathlib import Path

LANGS = ["en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "it"]


def make_tiny_whisper(folder: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    specials = (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{c}|>" for c in LANGS]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
                   "<|notimestamps|>"])
    for s in specials:
        vocab[s] = len(vocab)
    tok = WhisperTokenizer(vocab=dict(vocab), merges=[], unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                           eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    fe = WhisperFeatureExtractor(feature_size=80)
    WhisperProcessor(feature_extractor=fe, tokenizer=tok).save_pretrained(str(folder))
    ids = {s: vocab[s] for s in specials}
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    cfg = WhisperConfig(vocab_size=len(vocab), num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=32,
                        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                        begin_suppress_tokens=None, suppress_tokens=None, init_std=0.5)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[eot].zero_()
    gen = GenerationConfig(decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                           max_length=32, is_multilingual=True,
                           lang_to_id={f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGS},
                           task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
                           no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
                           forced_decoder_ids=None, begin_suppress_tokens=[eot],
                           suppress_tokens=[i for i, b in enumerate(bytes_to_unicode()) if not 97 <= b <= 122])
    model.generation_config = gen
    model.save_pretrained(str(folder))
    return folder
