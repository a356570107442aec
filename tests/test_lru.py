"""tts_engine/lru.py: the byte-bounded LRU behind the reference, decoder-prime and prefix caches."""
from __future__ import annotations

import threading

import torch

from tts_engine.lru import BoundedLRU, tensor_bytes


def _lru(max_entries, max_bytes):
    return BoundedLRU(max_entries, max_bytes, len)   # a value's size: its length (bytes objects)


def test_least_recently_used_go_first_past_the_byte_bound():
    c = _lru(None, 10)
    c.put("a", b"1234")
    c.put("b", b"5678")
    assert c.get("a") == b"1234"             # a is now the most recent
    c.put("c", b"90ab")                      # 12 bytes > 10: b goes
    assert c.get("b") is None and c.get("a") == b"1234" and c.get("c") == b"90ab"
    assert len(c) == 2 and c.nbytes == 8
    assert (c.hits, c.misses) == (3, 1)


def test_the_count_bound_and_replacing_a_key():
    c = _lru(2, 1000)
    for k in "abc":
        c.put(k, k.encode() * 3)
    assert c.get("a") is None and len(c) == 2
    c.put("b", b"x")                         # replaced: its bytes counted once
    assert c.nbytes == 3 + 1 and c.get("b") == b"x"


def test_too_large_alone_is_never_kept_and_off_keeps_nothing():
    c = _lru(None, 4)
    c.put("a", b"12")
    assert c.put("big", b"12345") == b"12345"   # handed back, not kept, nothing evicted for it
    assert c.get("big") is None and c.get("a") == b"12"
    for off in (_lru(0, 100), _lru(None, 0)):
        assert not off.enabled
        off.put("a", b"1")
        assert off.get("a") is None and len(off) == 0
    c.clear()
    assert len(c) == 0 and c.nbytes == 0 and c.enabled


def test_tensor_bytes():
    assert tensor_bytes(torch.zeros(3, 4), None, torch.zeros(2, dtype=torch.bfloat16)) == 48 + 4


def test_concurrent_puts_keep_the_byte_count_exact():
    c = _lru(None, 64)

    def writer(i):
        for j in range(300):
            c.put(f"{i}-{j % 20}", bytes(j % 7 + 1))
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.nbytes == sum(len(v) for v in c._items.values()) <= 64
