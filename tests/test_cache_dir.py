"""The app's --cache-dir (and TTS_CACHE_DIR) reaches every cache: the kernel table, the codec dtype choice, the
compiled predictor's inductor cache, the quality checks of --quantize auto, preset and uploaded voices, tiny
checkpoints; without it they all live under ~/.cache/qwen3-tts-live (XDG_CACHE_HOME)."""
from __future__ import annotations

from pathlib import Path

import pytest

import app as app_mod
from tts_engine import TTSError, cache_paths


def _paths() -> dict:
    from serving.registry import EngineRegistry
    from serving.voice_store import default_folder
    from tts_engine.cpu import codec_dtype as dtype_choice
    from tts_engine.cpu import auto_precision
    from tts_engine.cpu import compiled_predictor
    from tts_engine.cpu import kernels
    from tts_engine.voices.presets import default_cache_dir
    from ui.config import AppConfig
    from ui.roles import cache_root

    return {"kernels": kernels.table_path(kernels.machine_key()), "codec dtype": dtype_choice.cache_file(),
            "inductor": compiled_predictor.cache_dir(), "presets": default_cache_dir(),
            "uploaded voices": default_folder(), "app": cache_root(AppConfig()),
            "registry tiny": EngineRegistry({}).cache_dir, "quality": auto_precision.quality_path(Path("ck"))}


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv(cache_paths.ENV, "")          # (restored after the test, whatever the app sets)
    monkeypatch.delenv("TTS_VOICES_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path


def test_default_is_the_xdg_cache(clean_env):
    for what, p in _paths().items():
        assert p.is_relative_to(clean_env / "xdg" / "qwen3-tts-live"), (what, p)


def test_the_apps_cache_dir_reaches_every_cache(clean_env, monkeypatch):
    seen = {}

    def fake_app(cfg):                               # what TTSApp (and the engines it loads) would see; then stop
        seen.update(_paths(), cfg=cfg.cache_dir)
        raise TTSError("stop here")

    monkeypatch.setattr(app_mod, "TTSApp", fake_app)
    folder = clean_env / "mine"
    with pytest.raises(SystemExit, match="stop here"):
        app_mod.main(["--tiny", "--cache-dir", str(folder)])
    assert seen.pop("cfg") == folder
    for what, p in seen.items():
        assert p.is_relative_to(folder), (what, p)
    assert seen["kernels"].parent == folder / "kernels" and seen["inductor"] == folder / "inductor"
    assert seen["codec dtype"] == folder / "choices" / "codec_dtype.json"


def test_tts_cache_dir_alone(clean_env, monkeypatch):
    monkeypatch.setenv(cache_paths.ENV, str(clean_env / "env"))
    assert app_mod.parse_args([]).cache_dir == str(clean_env / "env")
    for what, p in _paths().items():
        assert p.is_relative_to(clean_env / "env"), (what, p)
