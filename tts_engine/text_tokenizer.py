"""The checkpoint's Qwen2 BPE text tokenizer and the three prompt templates of the official wrapper.

The official wrapper (qwen-tts 0.1.1, `Qwen3TTSModel._tokenize_texts`) tokenizes each template on its own,
with no chat template and no BOS:

- target:    "<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"
- reference: "<|im_start|>assistant\\n{ref_text}<|im_end|>\\n"
- instruct:  "<|im_start|>user\\n{instruct}<|im_end|>\\n"

and the prompt builder slices the ids by position ([:3] role, [3:-5] text, [3:-2] reference text).

Loading. The official code loads the tokenizer with transformers 4.57.3 as
`AutoProcessor.from_pretrained(folder, fix_mistral_regex=True)` (Qwen2TokenizerFast built from vocab.json +
merges.txt + tokenizer_config.json). We load the same files with transformers' Qwen2 tokenizer and then
take its `tokenizers.Tokenizer` pipeline: NFC normalizer, the Qwen2 split regex, byte-level BPE, the added
tokens of tokenizer_config.json.

One quirk of transformers 4.57.3 matters for real checkpoints: for a tokenizer with more than 100,000 BPE
entries loaded from a local folder whose config.json has no "transformers_version", or one between 4.57.2
and 5.0.0, it believes the tokenizer is an affected Mistral one and, because the official code passes
`fix_mistral_regex=True`, replaces the Qwen2 split regex with its "fixed Mistral" regex (which splits
"iPhone" as "i"+"Phone", keeps "'sup" whole, ...). transformers 5 no longer does this for non-Mistral
models. `pretokenizer="official"` (the default) reproduces the 4.57.3 decision from the folder's own
config.json, so our ids equal the official wrapper's for a checkpoint loaded from that folder;
"qwen2" and "mistral_fix" force one regex. Tiny test tokenizers are far below 100,000 entries and always
use the Qwen2 regex.

Thread safety: the `tokenizers.Tokenizer` is configured once in `from_pretrained` and never changed
afterwards (no truncation / padding state, unlike the transformers wrapper, whose calls mutate it), and
`Tokenizer.encode` only reads it, so one TextTokenizer can be used from any number of threads at once.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tts_engine.errors import TTSError

QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# transformers 4.57.3, PreTrainedTokenizerBase._patch_mistral_regex
MISTRAL_FIX_SPLIT_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_MISTRAL_MODEL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")
PRETOKENIZERS = ("official", "qwen2", "mistral_fix")

ASSISTANT_TEMPLATE = "<|im_start|>assistant\n{}<|im_end|>\n<|im_start|>assistant\n"
REF_TEMPLATE = "<|im_start|>assistant\n{}<|im_end|>\n"
INSTRUCT_TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n"
ROLE_PREFIX_LEN = 3       # <|im_start|> assistant \n
ASSISTANT_SUFFIX_LEN = 5  # <|im_end|> \n <|im_start|> assistant \n
REF_SUFFIX_LEN = 2        # <|im_end|> \n


def official_uses_mistral_fix(folder: str | Path, base_vocab_size: int) -> bool:
    """Whether qwen-tts 0.1.1 on transformers 4.57.3 replaces the Qwen2 split regex by the "fixed Mistral"
    one when it loads the tokenizer of the local checkpoint `folder` (`AutoProcessor.from_pretrained(folder,
    fix_mistral_regex=True)`); `base_vocab_size` is the BPE vocabulary without added tokens."""
    from packaging import version

    if base_vocab_size <= 100_000:
        return False
    cfg_file = Path(folder) / "config.json"
    if not cfg_file.is_file():
        return False
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # 4.57.3 would fail to load such a folder at all
    tv, model_type = cfg.get("transformers_version"), cfg.get("model_type")
    if tv:
        try:
            v = version.parse(str(tv))
        except version.InvalidVersion:
            return False  # 4.57.3 would fail to load such a folder at all
        if v <= version.parse("4.57.2") and model_type is not None and model_type not in _MISTRAL_MODEL_TYPES:
            return False
        if v >= version.parse("5.0.0"):
            return False
    return True


def _set_split_regex(backend, pattern: str) -> None:
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(pattern=Regex(pattern), behavior="isolated", invert=False)
    current = backend.pre_tokenizer
    if isinstance(current, pre_tokenizers.Sequence):
        current[0] = split
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, current])


class TextTokenizer:
    """Prompt token ids for Qwen3-TTS. Build with `TextTokenizer.from_pretrained(checkpoint_folder)`."""

    def __init__(self, backend, pretokenizer: str = "qwen2"):
        """`backend`: a configured `tokenizers.Tokenizer`; it must not be changed afterwards."""
        self._backend = backend
        self.pretokenizer = pretokenizer   # which split regex is in use: "qwen2" or "mistral_fix"

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, pretokenizer: str = "official") -> "TextTokenizer":
        """Load the Qwen2 tokenizer of a checkpoint folder (vocab.json + merges.txt + tokenizer_config.json,
        or tokenizer.json), offline. `pretokenizer`: "official" (what the official wrapper does for this
        folder, see the module docstring), "qwen2" or "mistral_fix"."""
        if pretokenizer not in PRETOKENIZERS:
            raise TTSError(f"pretokenizer must be one of {PRETOKENIZERS}, not {pretokenizer!r}")
        folder = Path(folder)
        has_bpe = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
        if not (has_bpe or (folder / "tokenizer.json").is_file()):
            raise TTSError(f"no text tokenizer in {folder}: expected vocab.json and merges.txt "
                           "(and tokenizer_config.json), as in the released checkpoints")
        # the official processor always builds a Qwen2 tokenizer (Qwen3TTSProcessor.tokenizer_class), whatever
        # tokenizer_class tokenizer_config.json names
        from transformers import Qwen2TokenizerFast

        try:
            hf = Qwen2TokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001  (any loader failure is a broken checkpoint for the user)
            raise TTSError(f"could not load the text tokenizer from {folder}: {e}") from e
        backend = hf.backend_tokenizer
        base = backend.get_vocab_size(with_added_tokens=False)
        if pretokenizer == "official":  # like 4.57.3: keep the loaded pipeline unless it swaps the regex
            pretokenizer = "mistral_fix" if official_uses_mistral_fix(folder, base) else "qwen2"
            if pretokenizer == "mistral_fix":
                _set_split_regex(backend, MISTRAL_FIX_SPLIT_REGEX)
        else:
            _set_split_regex(backend, MISTRAL_FIX_SPLIT_REGEX if pretokenizer == "mistral_fix" else QWEN2_SPLIT_REGEX)
        backend.no_truncation()
        backend.no_padding()
        tok = cls(backend, pretokenizer)
        for token in ("<|im_start|>", "<|im_end|>"):
            if tok.token_id(token) is None:
                raise TTSError(f"the text tokenizer in {folder} has no {token} token")
        return tok

    # --- ids -------------------------------------------------------------------------------------------
    def encode(self, s: str) -> list[int]:
        """Token ids of `s` as is (special-token strings in it become their ids; nothing is added)."""
        if not isinstance(s, str):
            raise TTSError(f"text must be a string, not {type(s).__name__}")
        return self._backend.encode(s, add_special_tokens=False).ids

    def _tensor(self, s: str) -> torch.Tensor:
        return torch.tensor(self.encode(s), dtype=torch.long)

    def assistant_ids(self, text: str) -> torch.Tensor:
        """1-D ids of "<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"."""
        return self._tensor(ASSISTANT_TEMPLATE.format(_check(text)))

    def ref_ids(self, ref_text: str) -> torch.Tensor:
        """1-D ids of "<|im_start|>assistant\\n{ref_text}<|im_end|>\\n" (ICL reference transcript)."""
        return self._tensor(REF_TEMPLATE.format(_check(ref_text)))

    def instruct_ids(self, instruct: str) -> torch.Tensor:
        """1-D ids of "<|im_start|>user\\n{instruct}<|im_end|>\\n"."""
        return self._tensor(INSTRUCT_TEMPLATE.format(_check(instruct)))

    def count_tokens(self, text: str) -> int:
        """How many text tokens `text` takes in the prompt: the length of assistant_ids(text)[3:-5]."""
        return len(self.encode(ASSISTANT_TEMPLATE.format(_check(text)))) - ROLE_PREFIX_LEN - ASSISTANT_SUFFIX_LEN

    # --- vocabulary ------------------------------------------------------------------------------------
    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary or added token (e.g. "<tts_pad>"), or None."""
        return self._backend.token_to_id(token)

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """All tokens, added ones included."""
        return self._backend.get_vocab_size(with_added_tokens=True)


def _check(s) -> str:
    if not isinstance(s, str):
        raise TTSError(f"text must be a string, not {type(s).__name__}")
    return s
