"""The talker's keys and values of prompt prefixes, kept so that the next request of the same voice skips them.

A prompt starts with positions that do not depend on the text (`Prompt.prefix_len`: the instruct block, the
role block and the control block with the language and the speaker: 8 positions for a preset voice). Every
request of that voice, language and instruction prefills them to the same keys and values, so `ModelRunner.prefill`
keeps those cache rows here after a full prefill and, on the next request with the same prefix, copies them back
and prefills only the rest (first audio is mostly that prefill, which costs ~3 ms per position on a 2-core CPU).

Key: a digest of the prefix's input embeddings themselves (bytes, shape, dtype), so two prefixes share an entry
only when the talker's inputs there are identical; the cache belongs to one `ModelRunner` (one model's weights,
one dtype and kernel set), so a key never meets another model's values. Bounded: least recently used entries go
once the entries' bytes pass `max_bytes` (0: off). Only the engine's worker uses it; a lock keeps it consistent
for anyone else (stats, clearing).
"""
from __future__ import annotations

import hashlib

import torch

from tts_engine.lru import BoundedLRU, tensor_bytes

DEFAULT_MAX_BYTES = 64 << 20   # ~70 preset-voice prefixes of the 0.6B talker (0.9 MB each in bf16)


class PrefixCache(BoundedLRU):
    """Prefixes' (k, v) [layers, Hkv, P, hd] by `key`, up to `max_bytes` in all (module doc)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__(None, max_bytes, lambda kv: tensor_bytes(*kv))

    @staticmethod
    def key(prefix: torch.Tensor) -> str:
        """Digest of the prefix's input embeddings [P, D] (their exact bytes, shape and dtype)."""
        x = prefix.detach().contiguous().cpu()
        raw = x.view(torch.uint8) if x.dtype.itemsize == 1 else x.view(torch.int16 if x.dtype.itemsize == 2
                                                                          else torch.int32)
        h = hashlib.blake2b(raw.numpy().tobytes(), digest_size=20)
        h.update(f"{tuple(x.shape)} {x.dtype}".encode())
        return h.hexdigest()

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) [layers, Hkv, P, hd] of this prefix, or None (counted as a hit or a miss)."""
        return super().get(key)

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep copies of k, v [layers, Hkv, P, hd]; the least recently used entries go past `max_bytes`."""
        if self.enabled and tensor_bytes(k, v) <= self.max_bytes:   # (no copy of what would not be kept)
            super().put(key, (k.clone(), v.clone()))

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._items), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                    "max_bytes": self.max_bytes}
