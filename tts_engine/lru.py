"""A thread-safe least-recently-used map bounded by the bytes of its values (and optionally by their count): the
engine's caches of cloned voices, codec-decoder states and prompt-prefix keys/values (`voices.reference_cache`,
`engine.prefix_cache`) are each one of these with their own key and size."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable


def tensor_bytes(*tensors) -> int:
    """Bytes of the given tensors' elements (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class BoundedLRU:
    """{key: value}, at most `max_entries` values (None: no count bound) whose `size(value)` bytes sum to at most
    `max_bytes`; past either bound the least recently used go. A value larger than `max_bytes` alone is never kept.
    `max_entries=0` or `max_bytes=0` turns it off (`enabled`). `hits` / `misses` count lookups (`get`)."""

    def __init__(self, max_entries: int | None, max_bytes: int, size: Callable[[object], int]):
        self.max_entries = None if max_entries is None else int(max_entries)
        self.max_bytes, self._size = int(max_bytes), size
        self._items: OrderedDict[str, object] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and (self.max_entries is None or self.max_entries > 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        """The kept values' bytes (by `size`)."""
        return self._bytes

    def get(self, key: str):
        """The value kept for `key` (now the most recently used), or None."""
        with self._lock:
            v = self._items.get(key)
            if v is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return v

    def put(self, key: str, value):
        """Keep `value` for `key` (replacing what was there) unless off or too large alone -> `value`."""
        size = self._size(value)
        if not self.enabled or size > self.max_bytes:
            return value
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= self._size(old)
            self._items[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes or (self.max_entries is not None
                                                   and len(self._items) > self.max_entries):
                _, dropped = self._items.popitem(last=False)
                self._bytes -= self._size(dropped)
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def items(self) -> list[tuple[str, object]]:
        """The kept (key, value) pairs, least recently used first (a copy: `put` them back to restore a state)."""
        with self._lock:
            return list(self._items.items())
