"""The prompt-prefix cache (`tts_engine/engine/prefix_cache.py`, `ModelRunner._prefill_talker`): a request whose
voice part of the prompt was prefilled before copies those keys/values instead of computing them, with the same
codes and audio as when the cache holds nothing; entries are keyed by the prefix itself and bounded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine
from tts_engine.engine.prefix_cache import PrefixCache
from tts_engine.model import quant

REQUESTS = [("Hello there, this is the first request.", "ryan", "auto"),
            ("A second text, for another voice.", "vivian", "auto"),
            ("And a third one, back to the first voice.", "ryan", "auto"),
            ("The same voice in another language.", "ryan", "english"),
            ("Short.", "vivian", "auto")]


@pytest.fixture(scope="module")
def folder(tiny_cv_folder):
    return tiny_cv_folder


def _engine(folder, dtype, quantize=None, mb=8):
    e = TTSEngine.from_pretrained(str(folder), device="cpu", dtype=dtype, quantize=quantize, max_batch=2,
                                  prefix_cache_mb=mb)
    e.drive_in_caller()
    return e


def _run(engine, clear_before_each: bool):
    out = []
    for i, (text, voice, lang) in enumerate(REQUESTS):
        if clear_before_each:
            engine.runner.prefix_cache.clear()
        s = engine.stream(text, voice=voice, language=lang, seed=10 + i, max_new_tokens=8, first_chunk_frames=1)
        audio = np.concatenate(list(s))
        out.append((s.codes, audio))
    return out


MODES = [("fp32", None), ("bf16", None), ("bf16", "w8a8"), ("bf16", "int8")]


@pytest.mark.parametrize("dtype,quantize", MODES)
def test_a_hit_gives_the_same_codes_and_audio_as_a_miss(folder, dtype, quantize):
    if quantize is not None and quantize not in quant.available_modes():
        pytest.skip(f"{quantize} does not run here")
    e = _engine(folder, dtype, quantize)
    pc = e.runner.prefix_cache
    a = _run(e, clear_before_each=True)            # every request computes its prefix (and leaves it kept)
    assert (pc.hits, pc.misses) == (0, len(REQUESTS))
    for text, voice, lang in REQUESTS:             # keep every request's prefix (one prefill each, on the idle engine)
        req, _ = e._make_request(text, voice, lang, None, 0, {}, False, 8, None, 1, 12)
        e.runner.prefill(0, req.prompt, req.params)
        e.runner.release(0)
    hits = pc.hits
    b = _run(e, clear_before_each=False)           # every request copies it
    assert pc.hits - hits == len(REQUESTS)
    for (ca, wa), (cb, wb) in zip(a, b):
        assert len(ca) > 0
        assert torch.equal(ca, cb)
        np.testing.assert_array_equal(wa, wb)
    e.close()


def test_entries_are_per_voice_and_language_not_per_text(folder):
    e = _engine(folder, "bf16")
    pc = e.runner.prefix_cache
    _run(e, clear_before_each=False)
    # prefixes: (ryan, auto), (vivian, auto), (ryan, english): 3 entries; requests 3 and 5 reuse one
    assert (len(pc), pc.hits, pc.misses) == (3, 2, 3)
    req, _ = e._make_request("Whatever the text is.", "ryan", "auto", None, 0, {}, False, 8, None, 1, 12)
    other, _ = e._make_request("Whatever the text is.", "vivian", "auto", None, 0, {}, False, 8, None, 1, 12)
    p, q = req.prompt, other.prompt
    assert p.prefix_len == q.prefix_len == 8 and p.prefill.shape[0] > p.prefix_len   # role 3 + control 5
    assert PrefixCache.key(p.prefill[:p.prefix_len]) != PrefixCache.key(q.prefill[:q.prefix_len])
    assert not torch.equal(p.prefill[:8], q.prefill[:8]) and torch.equal(p.prefill[:3], q.prefill[:3])
    e.close()


def test_the_cache_is_bounded_least_recently_used_first():
    kv = torch.zeros(2, 2, 8, 16, dtype=torch.bfloat16)    # 1 KiB for k, 1 KiB for v: 2 KiB an entry
    pc = PrefixCache(max_bytes=4096)
    pc.put("a", kv, kv)
    pc.put("b", kv + 1, kv + 1)
    assert pc.get("a") is not None                          # a is now the most recent
    pc.put("c", kv + 2, kv + 2)                             # over 4 KiB: b goes
    assert pc.get("b") is None and pc.get("a") is not None and float(pc.get("c")[0][0, 0, 0, 0]) == 2
    assert len(pc) == 2 and pc.nbytes == 4096
    big = torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16)   # 8 KiB alone: never kept
    pc.put("big", big, big)
    assert pc.get("big") is None and len(pc) == 2
    src = kv.clone()
    pc.put("d", src, src)
    src += 5                                                # the cache keeps its own copy
    assert float(pc.get("d")[0].max()) == 0


def test_key_is_the_prefix_content():
    x = torch.randn(8, 16).bfloat16()
    assert PrefixCache.key(x) == PrefixCache.key(x.clone())
    y = x.clone()
    y[3, 5] = y[3, 5] + 1
    assert PrefixCache.key(y) != PrefixCache.key(x)
    assert PrefixCache.key(x.float()) != PrefixCache.key(x)          # dtype is part of it
    assert PrefixCache.key(x[:4]) != PrefixCache.key(x)


def test_on_by_default_except_fp32(folder):
    fp32 = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="fp32", max_batch=1)
    bf16 = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", max_batch=1)
    off = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", max_batch=1, prefix_cache_mb=0)
    assert fp32.runner.prefix_cache is None and off.runner.prefix_cache is None   # one whole prefill, as before
    assert bf16.runner.prefix_cache is not None and bf16.runner.prefix_cache.max_bytes == 64 << 20
    for e in (fp32, bf16, off):
        e.close()


def test_bench_ab_variant_switches_the_cache_off_and_back(folder):
    from bench.ab import _switch

    e = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", max_batch=1)
    pc = e.runner.prefix_cache
    _switch(e, {"prefix_cache": False})
    assert e.runner.prefix_cache is None
    _switch(e, {})
    assert e.runner.prefix_cache is pc
    e.close()
