"""Unit tests: sampling rules, the streaming codec decoder, lazy loading and sharing, bad input, voice files,
and the command line."""
from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

from tts_engine import TTSEngine, TTSError
from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig, CodecDecoderState
from tts_engine.model.sampling import (C0Processor, RowParams, SamplingParams, apply_repetition_penalty, choose,
                                       uniforms, warp)
from tts_engine.tiny import tiny_speech_tokenizer_config
from tts_engine.voices.voice import Voice


# --- sampling -------------------------------------------------------------------------------------------
def test_repetition_penalty_matches_hf_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive / p, negative * p, unseen untouched


def test_c0_processor_blocks_eos_then_allows_it_and_suppresses_specials():
    V, eos = 3072, 2150
    proc = C0Processor(V, eos, min_new_tokens=2, device="cpu")
    logits = torch.full((1, V), -5.0)
    logits[0, eos] = 10.0
    logits[0, 2500] = 20.0          # a special id: must never be chosen
    logits[0, 7] = 1.0
    rp = RowParams.stack([SamplingParams(do_sample=False, repetition_penalty=1.0)], "cpu")
    seen = torch.zeros(1, V, dtype=torch.bool)
    assert proc(logits, seen, torch.tensor([0]), rp).item() == 7       # EOS blocked at step 0
    assert proc(logits, seen, torch.tensor([1]), rp).item() == 7       # and step 1
    assert proc(logits, seen, torch.tensor([2]), rp).item() == eos     # allowed from step 2


def test_top_k_keeps_ties_and_top_p_keeps_at_least_one():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    w = warp(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(w).tolist() == [[True, True, True, False, False]]
    w = warp(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(w).sum() == 1 and torch.isfinite(w[0, 0])


def test_uniforms_are_seeded_and_batch_invariant():
    a = uniforms(torch.tensor([5, 9]), torch.tensor([3, 3]), 1, 2048)
    b = uniforms(torch.tensor([9]), torch.tensor([3]), 1, 2048)
    assert torch.equal(a[1], b[0])                    # a row's draws ignore the other rows
    assert not torch.equal(a[0], a[1])
    assert (a > 0).all() and (a < 1).all()
    assert abs(float(a.mean()) - 0.5) < 0.02


def test_candidate_draw_equals_full_vocabulary_draw_and_follows_the_distribution():
    torch.manual_seed(0)
    B, V = 6, 300
    logits = torch.randn(B, V) * 2
    temp = torch.tensor([0.9, 0.5, 1.3, 0.9, 0.7, 1.0])
    k = torch.tensor([50, 5, 0, 300, 20, 1])
    p = torch.tensor([1.0, 1.0, 0.8, 0.5, 0.95, 1.0])
    host = {"any_sample": True, "k_max": 0, "any_top_p": True}
    for frame in range(20):
        fr = torch.full((B,), frame)
        seed = torch.arange(B) + 100
        got = choose(logits, torch.ones(B, dtype=torch.bool), temp, k, p, seed, fr, 3, host)
        full = (warp(logits, temp, k, p).double() - torch.log(-torch.log(uniforms(seed, fr, 3, V)))).argmax(-1)
        assert torch.equal(got, full)
    # empirical frequencies over many seeds match the warped softmax (row 1: top-5 at temperature 0.5)
    n = 4000
    draws = choose(logits[1:2].expand(n, V), torch.ones(n, dtype=torch.bool), temp[1].expand(n), k[1].expand(n),
                   p[1].expand(n), torch.arange(n), torch.zeros(n, dtype=torch.long), 1,
                   {"any_sample": True, "k_max": 5, "any_top_p": False})
    probs = warp(logits[1:2], temp[1:2], k[1:2], p[1:2]).softmax(-1)[0]
    freq = torch.bincount(draws, minlength=V).float() / n
    assert (freq - probs).abs().max() < 0.03 and set(draws.unique().tolist()) <= set(probs.nonzero()[:, 0].tolist())


# --- codec decoder ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    return CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).eval()


@pytest.mark.parametrize("splits", [[1, 1, 2, 3, 7, 86], [100], [40, 40, 20], [71, 1, 1, 27]])
def test_streaming_decode_equals_one_shot(decoder, splits):
    codes = torch.randint(0, 2048, (1, 16, sum(splits)))
    with torch.inference_mode():
        full = decoder(codes)
        st, parts, o = decoder.init_state(1), [], 0
        for n in splits:
            parts.append(decoder.decode_step(codes[..., o:o + n], st))
            o += n
        streamed = torch.cat(parts, -1)
    assert full.shape == (1, 100 * 1920)
    rel = (streamed - full).norm() / full.norm()
    assert rel < 1e-4


def test_streaming_state_rows_are_independent(decoder):
    a, b = torch.randint(0, 2048, (1, 16, 30)), torch.randint(0, 2048, (1, 16, 30))
    with torch.inference_mode():
        sa, sb = decoder.init_state(1), decoder.init_state(1)
        decoder.decode_step(a[..., :20], sa)           # row a is 20 frames ahead of row b
        joint = CodecDecoderState.concat([sa, sb])
        out = decoder.decode_step(torch.cat([a[..., 20:25], b[..., :5]]), joint)
        ref_a = decoder(a[..., :25])[..., 20 * 1920:]
        ref_b = decoder(b[..., :5])
        assert (out[0] - ref_a[0]).abs().max() < 1e-4
        assert (out[1] - ref_b[0]).abs().max() < 1e-4
        only_b = joint.select(torch.tensor([1]))
        nxt = decoder.decode_step(b[..., 5:8], only_b)
        assert (nxt[0] - decoder(b[..., :8])[0, 5 * 1920:]).abs().max() < 1e-4


# --- a loaded engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cv(official):
    ckpt, _, _ = official("custom_voice", "0b6")
    return ckpt


def test_lazy_loading_and_shared_codec(cv, tmp_path):
    cv = _private_copy(cv, tmp_path)
    eng = TTSEngine.from_pretrained(str(cv), device="cpu")
    st = eng.model.speech_tokenizer
    assert not st.decoder_loaded and not st.encoder_loaded and st.file.tensors_read == 0
    eng.synthesize("Hi there.", voice="vivian", max_new_tokens=4, seed=1)
    assert st.decoder_loaded and not st.encoder_loaded
    assert st.file.tensors_read == len(st.decoder.state_dict())           # only decoder tensors were read
    assert not eng.model.weights.has_prefix("speaker_encoder.")
    # a second checkpoint with the same speech tokenizer (a copy elsewhere) shares the codec instance
    other = tmp_path / "copy"
    shutil.copytree(cv, other)
    eng2 = TTSEngine.from_pretrained(str(other), device="cpu")
    assert eng2.model.speech_tokenizer is st


def test_seed_reproducible_and_sampling_differs_by_seed(cv):
    eng = TTSEngine.from_pretrained(str(cv), device="cpu")
    a = eng.stream("Hello there, world.", voice="ryan", seed=3, max_new_tokens=8)
    wa = np.concatenate(list(a))
    b = eng.stream("Hello there, world.", voice="ryan", seed=3, max_new_tokens=8)
    wb = np.concatenate(list(b))
    c = eng.stream("Hello there, world.", voice="ryan", seed=4, max_new_tokens=8)
    list(c)
    assert torch.equal(a.codes, b.codes) and np.array_equal(wa, wb)
    assert not torch.equal(a.codes, c.codes)


def test_stream_chunks_first_after_two_frames(cv):
    eng = TTSEngine.from_pretrained(str(cv), device="cpu")
    s = eng.stream("A somewhat longer sentence to speak.", voice="serena", seed=0, max_new_tokens=12,
                   greedy=True)
    sizes = [len(c) // 1920 for c in s]
    assert sizes[0] == min(2, s.codes.shape[0])
    assert sum(sizes) == s.codes.shape[0]
    assert all(a <= b for a, b in zip(sizes[:-1], sizes[1:-1]))   # later chunks are not smaller (but the last)


def test_first_chunk_sizes_given_as_a_list(cv):
    """first_chunk_frames=(1, 1): two one-frame chunks, then doubling; the same codes and audio as one schedule."""
    from tts_engine.engine.request import chunk_schedule

    sizes = chunk_schedule((1, 1), 12)
    assert [next(sizes) for _ in range(7)] == [1, 1, 2, 4, 8, 12, 12]
    sizes = chunk_schedule(3, 12)
    assert [next(sizes) for _ in range(4)] == [3, 6, 12, 12]
    eng = TTSEngine.from_pretrained(str(cv), device="cpu")
    kw = dict(voice="serena", seed=4, max_new_tokens=20)
    a = eng.stream("A somewhat longer sentence to speak.", first_chunk_frames=(1, 1), **kw)
    chunks = list(a)
    b = eng.stream("A somewhat longer sentence to speak.", first_chunk_frames=2, **kw)
    whole = np.concatenate(list(b))
    n = a.codes.shape[0]
    expect, left = [], n
    for k in [1, 1, 2, 4, 8, 12]:
        if left <= 0:
            break
        expect.append(min(k, left))
        left -= k
    assert [len(c) // 1920 for c in chunks] == expect
    assert torch.equal(a.codes, b.codes)
    got = np.concatenate(chunks)
    assert got.shape == whole.shape
    assert np.linalg.norm(got - whole) / np.linalg.norm(whole) < 1e-4   # (the decode's float order differs)
    with pytest.raises(TTSError, match="first_chunk_frames"):
        eng.stream("Hello.", voice="ryan", first_chunk_frames=(1, 0))
    with pytest.raises(TTSError, match="first_chunk_frames"):
        eng.stream("Hello.", voice="ryan", first_chunk_frames=())


@pytest.mark.parametrize("kw,msg", [
    (dict(text="   "), "empty"),
    (dict(text="x" * 6000), "too long"),
    (dict(voice="nobody"), "unknown speaker"),
    (dict(language="klingon"), "unsupported language"),
    (dict(instruct="whisper"), "instructions"),
    (dict(seed=-1), "seed"),
    (dict(sampling={"temperature": 0}), "temperature"),
    (dict(sampling={"bogus": 1}), "unknown sampling"),
    (dict(voice=None), "choose a speaker"),
])
def test_bad_input_raises_clear_tts_error(cv, kw, msg):
    eng = TTSEngine.from_pretrained(str(cv), device="cpu")
    args = dict(text="Hello.", voice="ryan")
    args.update(kw)
    with pytest.raises(TTSError, match=msg):
        eng.synthesize(args.pop("text"), **args)
    with pytest.raises(TTSError, match="Base checkpoint"):
        eng.clone_voice((np.zeros(24000, np.float32), 24000), x_vector_only=True)


def test_embedding_voice_and_preset_row(cv):
    eng = TTSEngine.from_pretrained(str(cv), device="cpu")
    row = eng.preset_embedding("Ryan")
    v = eng.voice_from_embedding(row)
    a = eng.stream("Hi.", voice=v, greedy=True, max_new_tokens=6)
    b = eng.stream("Hi.", voice="ryan", greedy=True, max_new_tokens=6, language="english")
    list(a), list(b)
    # the same vector in the speaker slot gives the same codes (ryan has no dialect; same language)
    c = eng.stream("Hi.", voice=v, greedy=True, max_new_tokens=6, language="english")
    list(c)
    assert torch.equal(b.codes, c.codes)
    with pytest.raises(TTSError, match="needs"):
        eng.voice_from_embedding(row[:10])


# --- voice files ------------------------------------------------------------------------------------------
def test_voice_file_round_trips_and_rejects_bad_files(tmp_path):
    v = Voice(kind="icl", name="me", embedding=torch.randn(64), ref_codes=torch.randint(0, 2048, (9, 16)),
              ref_text="hello", model_type="base", meta={"source": "test"})
    for ext in (".safetensors", ".json"):
        w = Voice.load(v.save(tmp_path / f"v{ext}"))
        assert w.kind == "icl" and w.ref_text == "hello" and w.meta == {"source": "test"}
        assert torch.allclose(w.embedding, v.embedding) and torch.equal(w.ref_codes, v.ref_codes)
    bad = tmp_path / "evil.pt"
    bad.write_bytes(pickle.dumps({"items": [1, 2, 3]}))
    with pytest.raises(TTSError, match="not a voice file"):
        Voice.load(bad)
    d = v.to_dict()
    d["embedding"][3] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(d))
    with pytest.raises(TTSError, match="NaN"):
        Voice.load(tmp_path / "nan.json")
    d = v.to_dict()
    d["embedding"] = [[1.0, 2.0]]
    (tmp_path / "dim.json").write_text(json.dumps(d))
    with pytest.raises(TTSError, match="1-D"):
        Voice.load(tmp_path / "dim.json")


# --- command line ------------------------------------------------------------------------------------------
def test_cli_synth_writes_wav_and_codes(cv, tmp_path):
    out, codes = tmp_path / "o.wav", tmp_path / "c.npy"
    r = subprocess.run([sys.executable, "-m", "tts_engine", "synth", "--model", str(cv), "--text", "Hello!",
                        "--speaker", "Ryan", "--greedy", "--max-new-tokens", "6", "--out", str(out),
                        "--codes-out", str(codes)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    wav, sr = sf.read(out)
    c = np.load(codes)
    assert sr == 24000 and c.dtype == np.int64 and c.shape[1] == 16 and len(wav) == c.shape[0] * 1920
    r = subprocess.run([sys.executable, "-m", "tts_engine", "synth", "--model", str(cv), "--text", "Hi",
                        "--speaker", "nobody", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown speaker" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("kind,size", [("custom_voice", "0b6"), ("voice_design", "1b7"), ("base", "0b6")])
def test_make_tiny_checkpoint_loads_and_speaks(tmp_path, kind, size):
    from tts_engine.tiny import make_tiny

    folder = make_tiny(tmp_path / kind, kind=kind, size=size, seed=0)
    for f in ("config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt",
              "tokenizer_config.json", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors"):
        assert (folder / f).exists(), f
    eng = TTSEngine.from_pretrained(str(folder), device="cpu")
    voice = "vivian" if kind == "custom_voice" else None
    if kind == "base":
        t = np.arange(24000 * 2) / 24000
        voice = eng.clone_voice((0.3 * np.sin(2 * np.pi * 180 * t).astype(np.float32), 24000), ref_text="Hello.")
        assert voice.kind == "icl" and voice.ref_codes.shape == (25, 16) and voice.embedding.shape == (64,)
    wav = eng.synthesize("Testing one two three.", voice=voice, instruct="Calm." if kind == "voice_design" else None,
                         max_new_tokens=10, seed=0)
    assert wav.dtype == np.float32 and np.isfinite(wav).all() and len(wav) % 1920 == 0 and np.abs(wav).max() > 0


def _private_copy(ckpt, tmp_path):
    """A copy of a checkpoint whose codec config differs by a nonce key, so no other test's shared codec
    instance (with halves already loaded) is reused."""
    mine = tmp_path / "mine"
    shutil.copytree(ckpt, mine)
    stc = mine / "speech_tokenizer" / "config.json"
    stc.write_text(json.dumps({**json.loads(stc.read_text()), "_test_nonce": str(tmp_path)}))
    return mine


def test_base_loads_speaker_encoder_and_codec_encoder_only_when_needed(official, tmp_path):
    ckpt = _private_copy(official("base", "0b6")[0], tmp_path)
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu")
    st, weights = eng.model.speech_tokenizer, eng.model.weights
    assert not eng.model.speaker_encoder_loaded and not st.encoder_loaded
    read_before = weights.tensors_read
    t = np.arange(24000) / 24000
    clip = (0.3 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)
    v = eng.clone_voice((clip, 24000), x_vector_only=True)          # x-vector only: no codec encoder
    assert eng.model.speaker_encoder_loaded and not st.encoder_loaded
    assert weights.tensors_read - read_before == len(eng.model.speaker_encoder.state_dict())
    eng.synthesize("Hi.", voice=v, max_new_tokens=3, seed=0)
    assert st.decoder_loaded and not st.encoder_loaded
    eng.clone_voice((clip, 24000), ref_text="Hello.")                # ICL: now the encoder is read
    assert st.encoder_loaded


@pytest.mark.parametrize("bad,msg", [
    ("missing.wav", "not found"),
    (b"", "not a readable audio"),
    (b"definitely not audio", "not a readable audio"),
    ((np.zeros(0, np.float32), 24000), "empty"),
    ((np.full(100, np.nan, np.float32), 24000), "invalid"),
    ((np.zeros(100, np.float32), 10), "sample rate"),
])
def test_load_audio_rejects_bad_input(bad, msg, tmp_path):
    from tts_engine.audio import load_audio

    with pytest.raises(TTSError, match=msg):
        load_audio(str(tmp_path / bad) if isinstance(bad, str) else bad)


def test_load_audio_formats(tmp_path):
    from tts_engine.audio import get_resampler, load_audio, resample

    st = np.stack([np.full(800, 0.5, np.float32), np.full(800, -0.1, np.float32)], axis=1)
    p = tmp_path / "s.wav"
    sf.write(p, st, 16000)
    wav, sr = load_audio(str(p))
    assert sr == 16000 and wav.shape == (800,) and abs(float(wav.mean()) - 0.2) < 1e-3
    wav, sr = load_audio((8000, (st * 32767).astype(np.int16)))      # Gradio's (sr, int16 array)
    assert sr == 8000 and abs(float(wav.mean()) - 0.2) < 1e-3
    wav, sr = load_audio(p.read_bytes())
    assert sr == 16000
    assert resample(wav, 16000, 24000).shape == (1200,)
    assert get_resampler(16000, 24000) is get_resampler(16000, 24000) and get_resampler.cache_info().maxsize == 16


def test_hot_buffers_are_built_once(cv):
    from tts_engine.voices.mel import mel_basis_and_window

    dev = torch.device("cpu")
    assert mel_basis_and_window(dev) is mel_basis_and_window(dev)
    eng = TTSEngine.from_pretrained(str(cv), device="cpu")
    talker = eng.model.talker
    table = talker._frame_table
    lo, hi = table.data_ptr(), table.data_ptr() + table.numel() * table.element_size()
    embs = [talker.model.codec_embedding] + list(talker.code_predictor.model.codec_embedding)
    assert all(lo <= e.weight.data_ptr() < hi for e in embs)         # views of one table, no copies
    codes = torch.randint(0, 2048, (3, 16))
    want = talker.model.codec_embedding(codes[:, 0]) + sum(
        talker.code_predictor.model.codec_embedding[i](codes[:, i + 1]) for i in range(15))
    assert torch.allclose(talker.frame_embed(codes), want, atol=1e-5)
    pb = eng.model.prompts
    assert pb.tts_pad is eng.model.prompts.tts_pad and pb.tts_pad.shape == (talker.cfg.hidden_size,)


def test_unreachable_hub_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TTSError, match="Hugging Face Hub"):
        TTSEngine.from_pretrained("Qwen/Not-A-Real-Checkpoint-For-Tests")
    with pytest.raises(TTSError, match="neither a checkpoint folder"):
        TTSEngine.from_pretrained("/no/such/folder")


def test_cli_clone_with_reference_audio(official, tmp_path):
    ckpt, _, _ = official("base", "0b6")
    ref = tmp_path / "ref.wav"
    t = np.arange(16000) / 16000
    sf.write(ref, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 16000)
    out, codes = tmp_path / "o.wav", tmp_path / "c.npy"
    r = subprocess.run([sys.executable, "-m", "tts_engine", "synth", "--model", str(ckpt), "--text", "Hello!",
                        "--ref-audio", str(ref), "--ref-text", "A reference.", "--greedy", "--max-new-tokens", "5",
                        "--out", str(out), "--codes-out", str(codes)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    c = np.load(codes)
    assert c.shape == (4, 16) and len(sf.read(out)[0]) == 4 * 1920   # generated frames only, not the reference


def test_reference_voice_is_cloned_when_used(official, tmp_path):
    """A `reference` voice (the clip itself) speaks like the clone made from the same clip."""
    ckpt = official("base", "0b6")[0]
    eng = TTSEngine.from_pretrained(str(ckpt), device="cpu")
    t = np.arange(24000) / 24000
    clip = (0.3 * np.sin(2 * np.pi * 170 * t)).astype(np.float32)
    ref = Voice.from_clip(clip, 24000, "A tone.", x_vector_only=False)
    ref = Voice.load(ref.save(tmp_path / "ref.safetensors"))
    icl = eng.clone_voice((ref.clip()[0], 24000), ref_text="A tone.")
    a = eng.stream("Same voice?", voice=ref, greedy=True, max_new_tokens=6)
    b = eng.stream("Same voice?", voice=icl, greedy=True, max_new_tokens=6)
    list(a), list(b)
    assert torch.equal(a.codes, b.codes)


def test_frame_sampling_settings_are_built_once_per_batch_and_follow_a_new_request(tiny_cv_folder):
    """The runner keeps rows 0..b-1's RowParams between frames (no rebuild per frame) and forgets them when a row's
    settings change: a greedy request after a sampling one in the same row gets greedy host facts."""
    from tts_engine.model.sampling import SamplingParams

    eng = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", max_batch=2)
    try:
        r = eng.runner
        r._write_params(0, SamplingParams(do_sample=True, subtalker_dosample=True))
        first = r.rows_view([0])[2]
        assert r.rows_view([0])[2] is first and first.host["c0"]["any_sample"] is True
        r.release(0)
        r._write_params(0, SamplingParams(do_sample=False, subtalker_dosample=False))
        again = r.rows_view([0])[2]
        assert again is not first and again.host["c0"]["any_sample"] is False
        assert bool(again.do_sample[0]) is False
        r._write_params(1, SamplingParams(do_sample=True, top_k=70))
        two = r.rows_view([0, 1])[2]
        assert two.host["c0"]["any_sample"] is True and two.host["c0"]["k_max"] == 70
        r.move_row(1, 0)
        assert r.rows_view([0])[2].host["c0"]["k_max"] == 70
        # whole synthesis still the same with the kept views: two requests in turn, different settings
        a = eng.synthesize("Hello there.", voice="ryan", seed=3, max_new_tokens=6)
        b = eng.synthesize("Hello there.", voice="ryan", seed=3, max_new_tokens=6, sampling={"do_sample": False})
        a2 = eng.synthesize("Hello there.", voice="ryan", seed=3, max_new_tokens=6)
        assert a.size and b.size and (a == a2).all()
    finally:
        eng.close()
