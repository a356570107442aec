"""A lossy mode is labelled wherever it is in use: the app's footer and status line, the speech API's
/v1/audio/voices and its X-TTS-Precision header; `--quantize` / `--eager` reach the engines; the CPU default
(`quantize="auto"`) is int8 only where bf16 is native and the engine chose the dtype."""
from __future__ import annotations

import httpx
import pytest
import torch

import app as app_mod
from server.limits import Limits
from tests.serving import tiny_api
from tts_engine.model import qwen3_tts
from tts_engine.model.qwen3_tts import expected_precision
from tts_engine.tiny import make_tiny
from ui.app import TTSApp
from ui.config import AppConfig


@pytest.fixture(scope="module")
def cv(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("prec") / "cv", kind="custom_voice", size="0b6", seed=0))


def test_the_cpu_default_follows_native_bf16(monkeypatch):
    monkeypatch.setenv("TTS_CPU_DTYPE", "auto")
    monkeypatch.setattr(qwen3_tts, "cpu_has_fast_bf16", lambda: True)
    assert expected_precision("cpu", None, "auto") == "int8 weights (bf16 activations)"
    assert expected_precision("cpu", "fp32", "auto") == "fp32"          # an explicit dtype: exact weights
    assert expected_precision("cpu", None, None) == "bf16"
    monkeypatch.setattr(qwen3_tts, "cpu_has_fast_bf16", lambda: False)
    assert expected_precision("cpu", None, "auto") == "fp32"


def test_flags_reach_the_engines(monkeypatch):
    a = app_mod.parse_args([])
    assert a.quantize == "auto" and a.eager is False
    monkeypatch.setenv("TTS_QUANTIZE", "int4")
    monkeypatch.setenv("TTS_EAGER", "1")
    cfg = app_mod.config_from_args(app_mod.parse_args([]))
    assert cfg.engine_kw()["quantize"] == "int4" and cfg.engine_kw()["use_cuda_graphs"] is False
    monkeypatch.delenv("TTS_EAGER")
    cfg = app_mod.config_from_args(app_mod.parse_args(["--quantize", "none"]))
    assert cfg.engine_kw()["quantize"] == "none" and "use_cuda_graphs" not in cfg.engine_kw()


def test_the_page_labels_a_quantised_engine(cv, tmp_path):
    cfg = AppConfig(checkpoints={"custom_voice": cv, "base": "", "voice_design": ""}, device="cpu",
                    cache_dir=tmp_path, limits=Limits(max_new_tokens=12), quantize="int8")
    a = TTSApp(cfg)
    try:
        demo = a.build()
        footer = next(b for b in demo.blocks.values() if "precision:" in str(getattr(b, "value", "")))
        assert "int8 weights" in footer.value and "lossy" in footer.value
        outs = list(a.preset("Hello there.", "ryan", "english", "", {}, seed=1, randomize=False))
        status = str(outs[-1][a.c.status])
        assert status.startswith("**Done**") and "int8 weights" in status and "lossy" in status
        assert a.models.registry.get("custom_voice").lossy
    finally:
        a.close()


def test_the_page_says_nothing_lossy_for_exact_weights(cv, tmp_path):
    cfg = AppConfig(checkpoints={"custom_voice": cv, "base": "", "voice_design": ""}, device="cpu", dtype="fp32",
                    cache_dir=tmp_path, limits=Limits(max_new_tokens=12), quantize="auto")
    a = TTSApp(cfg)
    try:
        a.build()
        outs = list(a.preset("Hello there.", "ryan", "english", "", {}, seed=1, randomize=False))
        assert "lossy" not in str(outs[-1][a.c.status])
        assert a.models.registry.get("custom_voice").precision == "fp32"
    finally:
        a.close()


def test_the_api_labels_precision(tmp_path):
    with tiny_api(tmp_path, ["custom_voice"], Limits(max_new_tokens=8), engine_kw={"quantize": "int8"}) as (url, _, _):
        voices = httpx.get(f"{url}/v1/audio/voices").json()["data"]
        assert voices and all(v["precision"].startswith("int8 weights") and v["lossy"] for v in voices)
        r = httpx.post(f"{url}/v1/audio/speech", json={"model": "tts", "voice": "ryan", "input": "Hi there."},
                       timeout=120)
        assert r.status_code == 200 and r.headers["x-tts-precision"] == voices[0]["precision"] + " (lossy)"
