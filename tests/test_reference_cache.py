"""The reference cache: a repeated clone of the same clip (same transcript, same mode) skips both encoders."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine
from tts_engine.tiny import make_tiny
from tts_engine.voices.reference_cache import ReferenceCache, reference_key
from tts_engine.voices.voice import Voice
from tests.encoder_calls import count_encoders


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = TTSEngine.from_pretrained(str(make_tiny(tmp_path_factory.mktemp("base"), kind="base")), device="cpu")
    yield eng
    eng.close()


def _clip(freq=200.0, seconds=1.0, sr=24000):
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr


def test_repeated_clone_skips_both_encoders_and_gives_the_same_voice(engine, monkeypatch):
    engine.reference_cache.clear()
    calls = count_encoders(engine, monkeypatch)
    clip = _clip()
    a = engine.clone_voice(clip, ref_text="A tone.", name="first")
    assert calls == {"speaker": 1, "codec": 1}
    b = engine.clone_voice(clip, ref_text="  A tone. ", name="second")     # same transcript once stripped
    assert calls == {"speaker": 1, "codec": 1}
    assert b.name == "second" and a.name == "first" and b.kind == "icl"
    assert torch.equal(a.embedding, b.embedding) and torch.equal(a.ref_codes, b.ref_codes)
    # and the cached voice speaks like the fresh one (same seed -> same codes)
    s1 = engine.stream("Hi.", voice=a, seed=5, max_new_tokens=6, language="english")
    list(s1)
    s2 = engine.stream("Hi.", voice=b, seed=5, max_new_tokens=6, language="english")
    list(s2)
    assert torch.equal(s1.codes, s2.codes)


def test_the_key_separates_clip_transcript_and_mode(engine, monkeypatch):
    engine.reference_cache.clear()
    calls = count_encoders(engine, monkeypatch)
    clip = _clip()
    engine.clone_voice(clip, ref_text="A tone.")
    engine.clone_voice(clip, ref_text="Another transcript.")     # new transcript: codes again
    assert calls == {"speaker": 2, "codec": 2}
    x1 = engine.clone_voice(clip, x_vector_only=True)             # x-vector mode: speaker encoder only
    assert calls == {"speaker": 3, "codec": 2} and x1.kind == "xvector"
    engine.clone_voice(clip, ref_text="ignored in x-vector mode", x_vector_only=True)
    assert calls == {"speaker": 3, "codec": 2}
    engine.clone_voice(_clip(freq=300.0), x_vector_only=True)      # another clip
    assert calls == {"speaker": 4, "codec": 2}


def test_lru_is_bounded_and_can_be_off():
    def voice():
        return Voice(kind="xvector", embedding=torch.randn(64), hidden_size=64)

    cache = ReferenceCache(max_entries=2)
    keys = [reference_key(*_clip(100.0 + i), None, True) for i in range(3)]
    assert len(set(keys)) == 3
    cache.put(keys[0], voice())
    cache.put(keys[1], voice())
    assert cache.get(keys[0]) is not None          # 0 is now the most recent
    cache.put(keys[2], voice())                    # evicts 1
    assert len(cache) == 2 and cache.get(keys[1]) is None and cache.get(keys[0]) is not None
    small = ReferenceCache(max_entries=10, max_bytes=64 * 4 * 2)   # room for two 64-float embeddings
    for k in keys:
        small.put(k, voice())
    assert len(small) == 2
    off = ReferenceCache(max_entries=0)
    off.put(keys[0], voice())
    assert len(off) == 0 and off.get(keys[0]) is None


def test_an_icl_voice_primes_the_codec_decoder_once(engine, monkeypatch):
    voice = engine.clone_voice(_clip(260.0), ref_text="A tone.")
    frames = voice.ref_codes.shape[0]
    codec = engine.model.speech_tokenizer.decoder
    real = codec.decode_step
    primings = []

    def counting(codes, state):
        if codes.shape[-1] == frames:
            primings.append(codes.shape)
        return real(codes, state)

    monkeypatch.setattr(codec, "decode_step", counting)
    engine.worker.primed.clear()
    outs = []
    for _ in range(3):
        outs.append(engine.synthesize("Hello there.", voice=voice, seed=11, max_new_tokens=6, language="english"))
    assert len(primings) == 1                       # the first request primed it; the others started from a copy
    assert len(outs[0]) > 0 and all(np.array_equal(outs[0], o) for o in outs[1:])   # and sound exactly the same
    engine.worker.primed.clear()
    fresh = engine.synthesize("Hello there.", voice=voice, seed=11, max_new_tokens=6, language="english")
    assert len(primings) == 2 and np.array_equal(fresh, outs[0])
    # off: every request primes
    engine.worker.primed.max_entries = 0
    try:
        engine.synthesize("Hello there.", voice=voice, seed=11, max_new_tokens=6, language="english")
        engine.synthesize("Hello there.", voice=voice, seed=11, max_new_tokens=6, language="english")
        assert len(primings) == 4
    finally:
        engine.worker.primed.max_entries = 32
