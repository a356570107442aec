"""Transcribing the reference clip (tts_engine/asr.py) with a tiny random Whisper made here (tests/tiny_whisper.py):
loaded only when first needed, the words are those the Whisper classes give for the clip at 16 kHz, the Clone tab's
/transcribe fills the transcript box, a clone with a typed transcript never loads the model, no model gives a clear
message (and cloning still works), and the speech API transcribes `ref_audio` when asked (`transcribe_ref_audio`)."""
from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import httpx
import numpy as np
import pytest
import soundfile as sf

from tts_engine import TTSError, asr

ROOT = Path(__file__).resolve().parent.parent
OLIVER, EMMA = ROOT / "presets" / "oliver.flac", ROOT / "presets" / "emma.flac"


def _clip(path):
    wav, sr = sf.read(str(path), dtype="float32")
    return (wav.mean(1) if wav.ndim > 1 else wav), sr


def _reference_words(folder, wav, sr, language=None, max_new_tokens=24) -> str:
    """What the Whisper classes themselves give for the clip resampled to 16 kHz (librosa). The app's transcriber
    writes as many tokens as the tiny decoder has room for: 32 positions - 5 for the prompt = 27."""
    import librosa
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    proc = WhisperProcessor.from_pretrained(str(folder))
    model = WhisperForConditionalGeneration.from_pretrained(str(folder)).eval()
    x = librosa.resample(wav, orig_sr=sr, target_sr=16000)
    feats = proc(x, sampling_rate=16000, return_tensors="pt").input_features
    kw = {"language": language} if language else {}
    with torch.inference_mode():
        ids = model.generate(feats, task="transcribe", max_new_tokens=max_new_tokens, **kw)
    return proc.batch_decode(ids, skip_special_tokens=True)[0].strip()


def test_transcriber_loads_on_first_use_and_gives_the_whisper_words(whisper_dir):
    t = asr.Transcriber(str(whisper_dir), device="cpu", max_new_tokens=24)
    assert not t.loaded                                  # making it loads nothing
    wav, sr = _clip(OLIVER)                              # 24 kHz: resampled to Whisper's 16 kHz
    got = t.transcribe(wav, sr)
    assert t.loaded and got.model == str(whisper_dir) and got.seconds > 0
    assert got.text and got.text == _reference_words(whisper_dir, wav, sr)
    # another clip, another text (the random model does listen); a language hint is passed on
    ewav, esr = _clip(EMMA)
    assert t.transcribe(ewav, esr).text != got.text
    assert t.transcribe(wav, sr, "german").text == _reference_words(whisper_dir, wav, sr, "german")
    assert t.transcribe(wav, sr, "auto").text == got.text
    assert asr.whisper_language("Chinese") == "chinese" and asr.whisper_language("auto") is None
    assert asr.whisper_language("klingon") is None


def test_no_model_is_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = asr.Transcriber(str(tmp_path / "no-such-whisper"), device="cpu")
    wav, sr = _clip(OLIVER)
    with pytest.raises(TTSError, match="not available here .* Type the transcript yourself"):
        t.transcribe(wav, sr)
    with pytest.raises(TTSError, match="not available here"):       # remembered: no second slow attempt
        t.transcribe(wav, sr)
    assert not t.loaded


# --- the Clone tab -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from serving.limits import Limits
    from tests.live_server import tiny_checkpoint
    from ui.app import TTSApp
    from ui.config import AppConfig

    d = tmp_path_factory.mktemp("asr_app")
    ck = {"base": str(tiny_checkpoint(d / "base", kind="base", size="0b6", seed=0)), "custom_voice": "",
          "voice_design": ""}
    a = TTSApp(AppConfig(checkpoints=ck, device="cpu", cache_dir=d / "cache", limits=Limits(max_new_tokens=8)))
    a.build()
    yield a
    a.close()


def _drain(gen):
    return list(gen)


def test_clone_tab_transcribes_only_when_asked(app, asr_env, whisper_dir):
    c = app.c
    # a user who types the transcript: cloning never makes (let alone loads) the recogniser
    outs = _drain(app.clone(str(OLIVER), "Good morning.", False, "Typed", text="Hi.", seed=1, randomize=False,
                            request=SimpleNamespace(session_hash="a")))
    assert outs[-1][c.session]["Typed"].kind == "icl"
    assert not any(t.loaded for t in asr._shared.values())
    # the button: the transcript box gets the words, x-vector-only mode is switched off
    out = app.transcribe(str(OLIVER), "auto")
    wav, sr = _clip(OLIVER)
    assert out[c.ref_text] == _reference_words(whisper_dir, wav, sr, max_new_tokens=27) and out[c.xvec] is False
    assert "Transcribed" in out[c.status] and "loaded for this first use" in out[c.status]
    assert "loaded" not in app.transcribe(str(OLIVER), "english")[c.status]     # loaded once
    with pytest.raises(TTSError, match="reference clip first"):
        app.transcribe(None)


def test_clone_tab_without_the_model_says_so_and_cloning_still_works(app, tmp_path, monkeypatch):
    from ui.handlers import guard

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TTS_ASR_MODEL", str(tmp_path / "not-downloaded"))
    monkeypatch.setattr(asr, "_shared", {})
    with pytest.raises(gr.Error, match="not available here .* Type the transcript yourself"):
        guard(app.transcribe)(str(OLIVER), "auto")
    outs = _drain(app.clone(str(OLIVER), "", False, "NoWords", text="Hi.", seed=1, randomize=False,
                            request=SimpleNamespace(session_hash="b")))
    assert outs[-1][app.c.session]["NoWords"].kind == "xvector"


# --- the speech API -------------------------------------------------------------------------------------------

def test_api_transcribes_ref_audio_when_asked(tmp_path, asr_env, whisper_dir, monkeypatch):
    from serving.limits import Limits
    from tests.live_server import tiny_api

    b64 = base64.b64encode(OLIVER.read_bytes()).decode()
    wav, sr = _clip(OLIVER)
    words = _reference_words(whisper_dir, wav, sr, max_new_tokens=27)
    with tiny_api(tmp_path, ("base",), Limits(max_new_tokens=8)) as (url, registry, _):
        eng = registry.get("base")
        seen = []
        orig = eng.clone_voice

        def clone_voice(ref, ref_text=None, x_vector_only=False, name=""):
            seen.append((ref_text, x_vector_only))
            return orig(ref, ref_text=ref_text, x_vector_only=x_vector_only, name=name)
        monkeypatch.setattr(eng, "clone_voice", clone_voice)
        body = {"input": "Hi.", "ref_audio": b64, "response_format": "wav", "seed": 1}
        r = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
        assert r.status_code == 200 and seen[-1] == (None, True)          # not asked: x-vector only, as before
        assert not any(t.loaded for t in asr._shared.values())
        r = httpx.post(url + "/v1/audio/speech", json={**body, "transcribe_ref_audio": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert seen[-1] == (words, False) and "transcribed" in r.headers["X-Notice"]
        # without the model: a notice, and the clone falls back to x-vector only
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("TTS_ASR_MODEL", str(tmp_path / "missing"))
        r = httpx.post(url + "/v1/audio/speech", json={**body, "transcribe_ref_audio": True}, timeout=120)
        assert r.status_code == 200 and seen[-1] == (None, True)
        assert "not available" in r.headers["X-Notice"]
        assert np.frombuffer(r.content[44:], np.int16).size > 0
