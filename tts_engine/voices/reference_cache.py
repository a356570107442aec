"""A bounded LRU of cloned voices, keyed by what they were computed from.

Cloning runs the speaker encoder (x-vector) and, in in-context (ICL) mode, the codec encoder (reference codes)
over the reference clip. Both depend only on the clip's samples, its transcript and the mode, so an engine keeps
the result: the second clone request with the same clip costs a hash instead of two encoder passes.

    cache = ReferenceCache(max_entries=128)
    key = reference_key(wav, sr, ref_text, x_vector_only)
    voice = cache.get(key) or cache.put(key, compute())
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict

import numpy as np

from .voice import Voice


def reference_key(wav: np.ndarray, sr: int, ref_text: str | None, x_vector_only: bool) -> str:
    """blake2b of the float32 samples, the sample rate, the mode and (ICL only) the stripped transcript."""
    h = hashlib.blake2b(digest_size=20)
    h.update(b"xvec" if x_vector_only else b"icl")
    h.update(int(sr).to_bytes(4, "little"))
    h.update(np.ascontiguousarray(wav, dtype=np.float32).tobytes())
    if not x_vector_only:
        h.update(b"\0" + (ref_text or "").strip().encode("utf-8"))
    return h.hexdigest()


def _nbytes(v: Voice) -> int:
    return sum(t.numel() * t.element_size() for t in (v.embedding, v.ref_codes) if t is not None)


class ReferenceCache:
    """Thread-safe LRU {key: Voice}, bounded by entries and by the bytes of the tensors it holds.
    `max_entries=0` turns it off. `hits` / `misses` count lookups."""

    def __init__(self, max_entries: int = 128, max_bytes: int = 64 * 2**20):
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._items: OrderedDict[str, Voice] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key: str, name: str = "") -> Voice | None:
        """A copy of the cached voice (named `name`), or None."""
        with self._lock:
            v = self._items.get(key)
            if v is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
        return dataclasses.replace(v, name=name, meta=dict(v.meta))

    def put(self, key: str, voice: Voice) -> Voice:
        size = _nbytes(voice)
        if self.max_entries <= 0 or size > self.max_bytes:
            return voice
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= _nbytes(old)
            self._items[key] = voice
            self._bytes += size
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= _nbytes(dropped)
        return voice

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
