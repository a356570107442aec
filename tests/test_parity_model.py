"""End-to-end parity with the official implementation on tiny random checkpoints of every kind.

The oracle (tests/oracle/full_model_ref.py, run in the oracle venv) builds each checkpoint with the
*official* classes, saves it in the official layout, loads it back with the official
`Qwen3TTSModel.from_pretrained`, and records greedy generations. tts_engine then loads the same folder and
must reproduce: prompt embeddings, greedy codes (identical), speaker embeddings, reference codes and
waveforms (fp32 tolerance); in bf16 at the looser tolerances stated below.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_engine import TTSEngine
from tts_engine.voices.voice import Voice

MAX_NEW = 14  # as in the oracle script


def _voice_for(engine, case, tensors, ref_audio):
    if "speaker" in case:
        return case["speaker"]
    if "x_vector_only" in case:
        return engine.clone_voice((ref_audio, 16000), ref_text=case["ref_text"],
                                  x_vector_only=case["x_vector_only"])
    return None


def _run_cases(kind, size, official, dtype):
    ckpt, cases, ref = official(kind, size)
    engine = TTSEngine.from_pretrained(str(ckpt), device="cpu", dtype=dtype)
    ref_audio = ref["ref_audio_16k"].numpy() if "ref_audio_16k" in ref else None
    results = []
    for case in cases:
        voice = _voice_for(engine, case, ref, ref_audio)
        s = engine.stream(case["text"], voice=voice, language=case["language"], instruct=case.get("instruct"),
                          greedy=True, max_new_tokens=MAX_NEW, non_streaming_mode=case["non_streaming"], seed=0)
        chunks = list(s)
        wav = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        results.append((case, s, wav, voice))
    return engine, results, ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("kind,size", [("custom_voice", "0b6"), ("custom_voice", "1b7"), ("voice_design", "1b7"),
                                       ("base", "0b6"), ("base", "1b7")])
def test_fp32_matches_official(official, kind, size):
    engine, results, ref = _run_cases(kind, size, official, torch.float32)
    assert results, "the oracle recorded no cases"
    for case, s, wav, voice in results:
        name = case["name"]
        torch.testing.assert_close(s.request.prompt.prefill.float(), ref[f"{name}.prefill"], atol=1e-5, rtol=1e-5,
                                   msg=f"{name}: prompt embeddings differ")
        want = ref[f"{name}.codes"]
        assert want.shape[0] >= 1, f"{name}: oracle produced no frames"
        assert torch.equal(s.codes, want), f"{name}: greedy codes differ\nours {s.codes[:, 0]}\nofficial {want[:, 0]}"
        ref_wav = ref[f"{name}.wav"].numpy()
        n = min(len(wav), len(ref_wav))
        assert abs(len(wav) - len(ref_wav)) <= 1, f"{name}: length {len(wav)} vs {len(ref_wav)}"
        # the official ICL cut may keep one extra leading sample; align on the end
        a, b = wav[len(wav) - n:], ref_wav[len(ref_wav) - n:]
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
        assert rel < 1e-4, f"{name}: waveform relative error {rel:.2e}"
        if isinstance(voice, Voice):
            xv = int(case["x_vector_only"])
            torch.testing.assert_close(voice.embedding, ref[f"xvec{xv}.spk"], atol=1e-4, rtol=1e-4)
            if not case["x_vector_only"]:
                assert torch.equal(voice.ref_codes, ref["ref_code"]), "reference codes differ"


@pytest.mark.parametrize("kind,size", [("custom_voice", "1b7"), ("voice_design", "1b7"), ("base", "0b6")])
def test_bf16_close_to_official(official, kind, size):
    """bf16 weights, against the official fp32 run. Stated tolerances: prompt embeddings within 3 % (relative
    L2); the first frame's codebook-0 id identical and (presets, design) >= 8 of its 16 ids (later greedy frames of a random tiny model legitimately
    diverge once one near-tie flips); the official codes decoded by our bf16 codec within
    of the official fp32 waveform: 50 % relative L2, because the random oracle codec has a large gain (its
    fp32 output already sits at the +-1 clamp) and amplifies bf16 rounding; unrelated audio gives ~140 %."""
    engine, results, ref = _run_cases(kind, size, official, torch.bfloat16)
    for case, s, wav, voice in results:
        name = case["name"]
        want, got = ref[f"{name}.codes"], s.codes
        if isinstance(voice, Voice):  # the prompt depends on our bf16 x-vector: check the clone inputs
            xv = int(case["x_vector_only"])
            assert _rel(voice.embedding, ref[f"xvec{xv}.spk"]) < 5e-2, f"{name}: bf16 speaker embedding"
            if not xv:
                assert (voice.ref_codes == ref["ref_code"]).float().mean() >= 0.5, f"{name}: bf16 reference codes"
        else:
            assert _rel(s.request.prompt.prefill, ref[f"{name}.prefill"]) < 3e-2, name
            assert got.shape[0] >= 1 and got[0, 0] == want[0, 0], name
            assert (got[0] == want[0]).float().mean() >= 0.5, name
        if isinstance(voice, Voice) and not case["x_vector_only"]:
            continue  # the ICL waveform is decoded after the reference codes; covered in fp32
        decoded = engine.model.speech_tokenizer.decode(want)
        rel = np.linalg.norm(decoded - ref[f"{name}.wav"].numpy()) / np.linalg.norm(ref[f"{name}.wav"].numpy())
        assert rel < 0.5, f"{name}: bf16 decode relative error {rel:.3f}"
        assert np.isfinite(wav).all()
