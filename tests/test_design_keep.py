"""Keep a designed voice (/keep_design): a Voice design take cloned from its own audio with the Base model (design,
then clone), kept in the session and as a voice file; the same voice embedding on every later use. Tiny random
checkpoints."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from serving.limits import Limits
from tts_engine import TTSError
from tests.live_server import tiny_checkpoint


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from ui.app import TTSApp
    from ui.config import AppConfig

    d = tmp_path_factory.mktemp("design_keep")
    ck = {"voice_design": str(tiny_checkpoint(d / "vd", kind="voice_design", size="1b7", seed=0)),
          "base": str(tiny_checkpoint(d / "base", kind="base", size="0b6", seed=0))}
    a = TTSApp(AppConfig(checkpoints=ck, device="cpu", cache_dir=d / "cache", live_audio=True,
                         limits=Limits(max_text_chars=800, max_new_tokens=30, max_queue=16)))
    a.demo = a.build()
    yield a
    a.close()


def _req(name="s"):
    return SimpleNamespace(session_hash=name)


def test_the_page_offers_keep_text_settings_and_preview(app):
    names = {getattr(fn, "api_name", None) for fn in app.demo.fns.values()}
    assert {"keep_design", "text_settings", "preview", "design"} <= names
    assert app.c.keep_btn is not None and app.c.lexicon is not None and app.c.preview is not None


def test_keep_needs_a_design_take_first(app):
    with pytest.raises(TTSError, match="design a voice first"):
        app.keep_design("Narrator", "safetensors", {}, request=_req("nothing"))


def test_a_kept_design_gives_the_same_voice_embedding_every_time(app, monkeypatch):
    c = app.c
    outs = list(app.design("Welcome to the story.", "A warm, low voice", "english", seed=9, randomize=False,
                           request=_req()))
    take = outs[-1][c.final][1]
    assert len(take) > 0 and outs[-1][c.seed] == 9
    kept = app.keep_design("Narrator", "safetensors", {}, request=_req())
    session = kept[c.session]
    voice = session["Narrator"]
    assert voice.kind == "icl" and voice.meta["designed_from"] == "A warm, low voice" and voice.meta["design_seed"] == 9
    assert voice.ref_text == "Welcome to the story."         # the words the model read, as the clip's transcript
    assert "Kept “Narrator”" in kept[c.status] and "in-context" in kept[c.status]
    # kept again from the same take: the same embedding; loaded back from its file: the same embedding
    again = app.keep_design("Narrator 2", "json", session, request=_req())[c.session]["Narrator 2"]
    assert torch.equal(again.embedding, voice.embedding)
    loaded = app.voices.load_file(kept[c.keep_file])
    assert torch.allclose(loaded.embedding.float(), voice.embedding.float(), atol=1e-6)
    # used again and again (every tab resolves my:<name>): the Base model receives the same speaker embedding
    base = app.engine("base")
    seen = []
    real = base.model.prompts.build

    def spy(*a, **kw):
        seen.append(kw["speaker"].detach().float().cpu().clone())
        return real(*a, **kw)
    monkeypatch.setattr(base.model.prompts, "build", spy)
    for text, seed in (("First later text.", 1), ("A second, different text.", 2)):
        outs = list(app.preset(text, "my:Narrator", "english", "", session, seed=seed, randomize=False,
                               request=_req()))
        assert outs[-1][c.final] is not None
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert torch.allclose(seen[0], voice.embedding.float().to(seen[0].dtype), atol=1e-6)


def test_a_stretched_design_take_is_kept_from_its_timbre_only(app):
    list(app.design("Another take.", "A bright voice", "english", seed=3, randomize=False, speed=1.5,
                    request=_req("fast")))
    kept = app.keep_design("Bright", "safetensors", {}, request=_req("fast"))
    assert kept[app.c.session]["Bright"].kind == "xvector" and "x-vector only" in kept[app.c.status]
