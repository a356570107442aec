"""The checkpoint's Qwen2 BPE text tokenizer and the three prompt templates of the official wrapper.

Each template is tokenized on its own, with no chat template and no BOS; the prompt builder slices the
ids by position ([:3] role, [3:-5] text, [3:-2] reference text)."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from .errors import TTSError


class TextTokenizer:
    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self._lock = threading.Lock()  # HF fast tokenizers are not documented as thread-safe

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "TextTokenizer":
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:
            raise TTSError(f"could not load the text tokenizer from {folder}: {e}") from e
        return cls(tok)

    def _ids(self, s: str) -> torch.Tensor:
        with self._lock:
            ids = self._tok(s, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def assistant_ids(self, text: str) -> torch.Tensor:
        return self._ids(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def ref_ids(self, ref_text: str) -> torch.Tensor:
        return self._ids(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")

    def instruct_ids(self, instruct: str) -> torch.Tensor:
        return self._ids(f"<|im_start|>user\n{instruct}<|im_end|>\n")

    def count_tokens(self, text: str) -> int:
        return int(self._ids(text).numel())
