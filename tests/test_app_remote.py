"""`python app.py --backend URL`: the same UI against a second local instance of our own speech server."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from app import AppConfig, TTSApp, parse_args
from serving.limits import Limits
from tests.live_server import tiny_api
from tts_engine.voices.voice import Voice


def drain(gen):
    return list(gen)


@pytest.fixture(scope="module")
def remote_app(tmp_path_factory):
    d = tmp_path_factory.mktemp("remote_app")
    with tiny_api(d, ("custom_voice", "base", "voice_design"), Limits(max_new_tokens=8, max_per_client=8)) as (url, registry, _):
        # the page asks for at most what the server allows (a server refuses more with a 400, it does not cap)
        app = TTSApp(AppConfig(backend=url, cache_dir=d / "cache", live_audio=True, limits=Limits(max_new_tokens=8)))
        app.build()
        yield app, registry, d
        app.close()


def _final(app, outs):
    finals = [o for o in outs if app.c.final in o and o[app.c.final] is not None]
    assert len(finals) == 1
    sr, wav = finals[0][app.c.final]
    return sr, wav


def test_remote_preset_design_and_clone(remote_app):
    app, registry, d = remote_app
    assert "ryan" in app.roles["custom_voice"].speakers and not app.random_roles
    outs = drain(app.preset("Hello from far away.", "ryan", "english", "", {}, seed=3, randomize=False,
                            max_new_tokens=6))
    live = [o[app.c.live] for o in outs if app.c.live in o]
    sr, wav = _final(app, outs)
    assert live and sr == 24000 and wav.size > 0
    outs = drain(app.design("Designed remotely.", "A calm, low voice.", "auto", seed=1, randomize=False,
                            max_new_tokens=6))
    assert _final(app, outs)[1].size > 0
    clip = d / "ref.wav"
    t = np.arange(24000 * 2) / 24000
    sf.write(clip, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24000)
    outs = drain(app.clone(str(clip), "A tone.", False, "Remote me", "safetensors", "Cloned remotely."))
    assert _final(app, outs)[1].size > 0
    # the base server really cloned: its speaker encoder and codec encoder were used
    assert registry.get("base").model.speaker_encoder_loaded
    assert registry.get("base").model.speech_tokenizer.encoder_loaded


def test_remote_footer_points_to_the_servers_paths(remote_app):
    """The page's Details fold says the remote server generates the audio (its X-TTS-Paths header says how)."""
    app, _, _ = remote_app
    footer = next(str(b.value) for b in app.build().blocks.values() if "Details:" in str(getattr(b, "value", "")))
    assert app.cfg.backend in footer.split("<details", 1)[1] and "X-TTS-Paths" in footer


def test_remote_blend_of_voice_files(remote_app):
    app, _, d = remote_app
    files = []
    for i in range(2):
        p = d / f"v{i}.safetensors"
        Voice(kind="embedding", embedding=torch.randn(64, generator=torch.Generator().manual_seed(i)),
              model_type="base").save(p)
        files.append(str(p))
    outs = drain(app.blend("Blended remotely.", 2, "file", files[0], 50, "file", files[1], 50, a_to_b=50,
                           seed=2, randomize=False, max_new_tokens=6))
    assert _final(app, outs)[1].size > 0


def test_backend_flag_and_environment(monkeypatch):
    assert parse_args(["--backend", "http://h:1"]).backend == "http://h:1"
    monkeypatch.setenv("TTS_BACKEND", "http://other:2")
    assert parse_args([]).backend == "http://other:2"
