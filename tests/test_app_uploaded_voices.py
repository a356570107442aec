"""The page offers voices uploaded through POST /v1/audio/voices (the Preset and Blend dropdowns), and the
Clone tab's repeated clone of one clip is served by the engine's reference cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from serving.limits import Limits
from tests.live_server import tiny_checkpoint
from ui.app import TTSApp
from ui.config import AppConfig


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    ck = {role: str(tiny_checkpoint(d / role, kind=role)) for role in ("custom_voice", "base")}
    cfg = AppConfig(checkpoints=ck | {"voice_design": ""}, device="cpu", cache_dir=tmp_path_factory.mktemp("cache"),
                    limits=Limits(max_new_tokens=6))
    a = TTSApp(cfg)
    demo = a.build()
    yield a, demo
    a.close()


@pytest.fixture(scope="module")
def app(built):
    return built[0]


def _clip(freq=180.0):
    t = np.arange(24000) / 24000
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 24000


def test_uploaded_voices_are_in_the_dropdowns_and_speak(app):
    store = app.registry.uploaded
    assert store is not None and store.folder == app.cfg.cache_dir / "voices"
    voice = app.engine("base").clone_voice(_clip(), ref_text="A tone.", name="Guest")
    voice.ref_audio, voice.ref_sr = torch.zeros(10, dtype=torch.int16), 24000
    store.add("Guest", voice, {"consent": "c"}, owner_token="t")
    try:
        values = [v for _, v in app.voices.choices(None)]
        assert "uploaded:Guest" in values
        assert "uploaded:Guest" in [v for _, v in app.voices.choices(None, blend=True)]
        updates = app._dropdowns({})          # what the page-load event sends to every voice dropdown
        assert all("uploaded:Guest" in [v for _, v in u["choices"]] for u in updates.values())
        role, v = app.voices.resolve("uploaded:Guest", {})
        assert role == "base" and v.kind == "icl" and torch.equal(v.embedding, voice.embedding)
        assert app.voices.role_of_key("uploaded:Guest") == "base"
        wav = app.engine("base").synthesize("Hello.", voice=v, max_new_tokens=4)
        assert len(wav) > 0
    finally:
        store.delete("Guest", "t")
    with pytest.raises(Exception, match="no uploaded voice"):
        app.voices.resolve("uploaded:Guest", {})
    assert "uploaded:Guest" not in [v for _, v in app.voices.choices(None)]


def test_clone_tab_repeats_hit_the_reference_cache(app, tmp_path, monkeypatch):
    import soundfile as sf

    eng = app.engine("base")
    eng.reference_cache.clear()
    calls = []
    embed = eng.model.speaker_encoder.embed
    monkeypatch.setattr(eng.model.speaker_encoder, "embed", lambda *a, **k: calls.append(1) or embed(*a, **k))
    path = tmp_path / "ref.wav"
    sf.write(path, _clip(250.0)[0], 24000)
    for _ in range(2):
        out = list(app.clone(str(path), "A tone.", False, "Mine", "safetensors", "Hi.", "english", {},
                             0, False, 0.9, 50, 1.0, 1.05, 4, ""))
        assert any(isinstance(o, dict) and o.get(app.c.voice_file) for o in out)     # cloned and saved each time
    assert len(calls) == 1


def test_the_page_refreshes_its_voice_dropdowns_when_loaded(built):
    app, demo = built
    loads = [f for f in demo.fns.values() if f.api_name == "ui_voices"]
    assert len(loads) == 1 and any(t[1] == "load" for t in loads[0].targets)
    assert {o._id for o in loads[0].outputs} == {app.c.p_voice._id, *(d._id for d in app.c.slot_voice)}
    voice = app.engine("base").clone_voice(_clip(300.0), x_vector_only=True, name="Late")
    app.registry.uploaded.add("Late", voice, {}, owner_token="t")
    try:
        updates = loads[0].fn({})
        assert "uploaded:Late" in [v for _, v in updates[app.c.p_voice]["choices"]]
    finally:
        app.registry.uploaded.delete("Late", "t")
