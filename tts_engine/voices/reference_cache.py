"""A bounded LRU of cloned voices, keyed by what they were computed from.

Cloning runs the speaker encoder (x-vector) and, in in-context (ICL) mode, the codec encoder (reference codes)
over the reference clip. Both depend only on the clip's samples, its transcript and the mode, so an engine keeps
the result: the second clone request with the same clip costs a hash instead of two encoder passes
(`ReferenceCache`). Every request of an ICL voice then primes the codec decoder with the reference codes (the
generated audio continues the reference's); that state depends only on the codes, so the engine worker keeps it
too (`DecoderPrimeCache`), and a repeated ICL request starts like an x-vector one.

    cache = ReferenceCache(max_entries=128)
    key = reference_key(wav, sr, ref_text, x_vector_only)
    voice = cache.get(key) or cache.put(key, compute())
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from tts_engine.lru import BoundedLRU, tensor_bytes
from tts_engine.voices.voice import Voice


def reference_key(wav: np.ndarray, sr: int, ref_text: str | None, x_vector_only: bool) -> str:
    """blake2b of the float32 samples, the sample rate, the mode and (ICL only) the stripped transcript."""
    h = hashlib.blake2b(digest_size=20)
    h.update(b"xvec" if x_vector_only else b"icl")
    h.update(int(sr).to_bytes(4, "little"))
    h.update(np.ascontiguousarray(wav, dtype=np.float32).tobytes())
    if not x_vector_only:
        h.update(b"\0" + (ref_text or "").strip().encode("utf-8"))
    return h.hexdigest()


class ReferenceCache(BoundedLRU):
    """Cloned voices by `reference_key`: the speaker embedding and (ICL) the reference codes of a clip."""

    def __init__(self, max_entries: int = 128, max_bytes: int = 64 * 2**20):
        super().__init__(max_entries, max_bytes, lambda v: tensor_bytes(v.embedding, v.ref_codes))

    def get(self, key: str, name: str = "") -> Voice | None:
        """A copy of the cached voice (named `name`), or None."""
        v = super().get(key)
        return None if v is None else dataclasses.replace(v, name=name, meta=dict(v.meta))


class DecoderPrimeCache(BoundedLRU):
    """Codec-decoder states after an ICL voice's reference codes (what every request of that voice starts from),
    by a hash of the codes. The engine worker hands out copies: decoding advances a state in place."""

    def __init__(self, max_entries: int = 32, max_bytes: int = 256 * 2**20):
        super().__init__(max_entries, max_bytes, lambda st: tensor_bytes(*st.convs, st.k, st.v, st.pos))

    @staticmethod
    def key(ref_codes) -> str:
        return hashlib.blake2b(ref_codes.detach().cpu().long().numpy().tobytes()
                               + bytes(str(tuple(ref_codes.shape)), "ascii"), digest_size=20).hexdigest()
