"""A lossy mode is labelled wherever it is in use: the app's footer and status line, the speech API's
/v1/audio/voices and its X-TTS-Precision header; `--quantize` / `--eager` reach the engines; the CPU default
(`quantize="auto"`) is the fastest acceptable mode measured on the CPU, only where the engine chose the dtype, and
the footer says which and why."""
from __future__ import annotations

import contextlib
import html

import httpx
import pytest
import torch

import app as app_mod
from serving.limits import Limits
from tests.live_server import tiny_api
from tts_engine import expected_precision, make_tiny
from tts_engine import loader as qwen3_tts
from ui.app import TTSApp
from ui.config import AppConfig


@pytest.fixture(scope="module")
def cv(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("prec") / "cv", kind="custom_voice", size="0b6", seed=0))


@contextlib.contextmanager
def built_app(cv, tmp_path, **cfg):
    """The app on the tiny CustomVoice checkpoint alone (12 frames at most), its page built -> (app, the page's
    precision footer, None where it has none); closed afterwards."""
    a = TTSApp(AppConfig(checkpoints={"custom_voice": cv, "base": "", "voice_design": ""}, device="cpu",
                         cache_dir=tmp_path, limits=Limits(max_new_tokens=12), **cfg))
    try:
        demo = a.build()
        yield a, next((b for b in demo.blocks.values() if "precision:" in str(getattr(b, "value", ""))), None)
    finally:
        a.close()


def test_the_cpu_default_follows_native_bf16_and_the_measured_pick(monkeypatch):
    """auto: the mode `auto_precision.pick` measured fastest among the acceptable ones, on the dtype the engine
    chose; an explicit dtype (argument or TTS_CPU_DTYPE) keeps the checkpoint's weights without measuring."""
    from tts_engine.cpu import auto_precision

    asked = []
    monkeypatch.setattr(auto_precision, "pick", lambda dense, cfg=None, folder=None, table=None:
                        asked.append(dense) or ("w8a8", "fastest measured here"))
    monkeypatch.setenv("TTS_CPU_DTYPE", "auto")
    monkeypatch.setattr(qwen3_tts, "cpu_has_fast_bf16", lambda: True)
    assert expected_precision("cpu", None, "auto") == "int8 weights x int8 activations"
    assert qwen3_tts.expected_choice("cpu", None, "auto") == ("int8 weights x int8 activations",
                                                              "fastest measured here")
    assert asked == [torch.bfloat16, torch.bfloat16]
    assert expected_precision("cpu", "fp32", "auto") == "fp32"          # an explicit dtype: exact weights
    assert expected_precision("cpu", None, None) == "bf16"
    monkeypatch.setattr(qwen3_tts, "cpu_has_fast_bf16", lambda: False)
    assert expected_precision("cpu", None, "auto") == "int8 weights x int8 activations (fp32 elsewhere)"
    assert asked[-1] == torch.float32                                   # fp32 dense is what it is compared with
    monkeypatch.setattr(auto_precision, "pick", lambda *a, **k: (None, "fp32 fastest here"))
    assert expected_precision("cpu", None, "auto") == "fp32"
    monkeypatch.setenv("TTS_CPU_DTYPE", "bf16")
    monkeypatch.setattr(auto_precision, "pick", lambda *a, **k: pytest.fail("a forced dtype measures nothing"))
    assert qwen3_tts.expected_choice("cpu", None, "auto")[0] == "bf16"


def test_the_footer_says_which_mode_auto_chose_and_why(cv, tmp_path, monkeypatch):
    from tts_engine.cpu import auto_precision

    monkeypatch.setenv("TTS_CPU_DTYPE", "auto")
    monkeypatch.setattr(qwen3_tts, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(auto_precision, "pick", lambda *a, **k: ("w8a8", "fastest measured here (w8a8 9 ms)"))
    with built_app(cv, tmp_path, quantize="auto") as (_, footer):
        assert "int8 weights x int8 activations" in footer.value and "lossy" in footer.value
        assert "chosen by `--quantize auto`: fastest measured here (w8a8 9 ms)" in footer.value


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
    with built_app(cv, tmp_path, quantize="int8") as (a, footer):
        assert "int8 weights" in footer.value and "lossy" in footer.value
        outs = list(a.preset("Hello there.", "ryan", "english", "", {}, seed=1, randomize=False))
        status = str(outs[-1][a.c.status])
        assert status.startswith("**Done**") and "int8 weights" in status and "lossy" in status
        assert a.models.registry.get("custom_voice").lossy


def test_the_page_says_nothing_lossy_for_exact_weights(cv, tmp_path):
    with built_app(cv, tmp_path, dtype="fp32", quantize="auto") as (a, _):
        outs = list(a.preset("Hello there.", "ryan", "english", "", {}, seed=1, randomize=False))
        assert "lossy" not in str(outs[-1][a.c.status])
        assert a.models.registry.get("custom_voice").precision == "fp32"


def test_the_api_labels_precision(tmp_path):
    with tiny_api(tmp_path, ["custom_voice"], Limits(max_new_tokens=8), engine_kw={"quantize": "int8"}) as (url, _, _):
        voices = httpx.get(f"{url}/v1/audio/voices").json()["data"]
        assert voices and all(v["precision"].startswith("int8 weights") and v["lossy"] for v in voices)
        r = httpx.post(f"{url}/v1/audio/speech", json={"model": "tts", "voice": "ryan", "input": "Hi there."},
                       timeout=120)
        assert r.status_code == 200 and r.headers["x-tts-precision"] == voices[0]["precision"] + " (lossy)"


def test_the_api_says_what_served_each_part_of_a_frame(tmp_path):
    """X-TTS-Paths: `engine.paths()` as "part=path; ...", on whole and streamed answers alike."""
    with tiny_api(tmp_path, ["custom_voice"], Limits(max_new_tokens=8)) as (url, registry, _):
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/audio/speech", json={"model": "tts", "voice": "ryan", "input": "Hi there.",
                                                           "stream": stream}, timeout=120)
            assert r.status_code == 200
            got = dict(kv.split("=", 1) for kv in r.headers["x-tts-paths"].split("; "))
            paths = registry.get("custom_voice").paths()
            assert got == {part: e["path"] for part, e in paths.items()} and "frame" in got
        assert "X-TTS-Paths" in httpx.get(f"{url}/openapi.json").text      # on the API docs page


def test_the_footer_measures_nothing_while_the_loader_does(cv, tmp_path, monkeypatch):
    """With --quantize auto and the models loading in the background, building the page (served at once) times no
    kernels of its own: the footer says the choice is being measured, and a page load after the engine loaded
    says what it runs."""
    from tts_engine.cpu import auto_precision
    from ui import roles
    from ui.model_loader import ModelLoader

    monkeypatch.setenv("TTS_CPU_DTYPE", "auto")
    monkeypatch.setattr(qwen3_tts, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(ModelLoader, "busy", lambda self, role: True)
    monkeypatch.setattr(auto_precision, "pick", lambda *a, **k: pytest.fail("the page's thread measured"))
    with built_app(cv, tmp_path, quantize="auto") as (a, _):
        demo = a.build()
        footer = next(b for b in demo.blocks.values() if roles.MEASURING in str(getattr(b, "value", "")))
        assert "lossy" not in footer.value
        monkeypatch.setattr(auto_precision, "pick", lambda *a, **k: ("int8", "fastest measured here (int8 9 ms)"))
        eng = a.models.registry.get("custom_voice")                 # the loader's work, done here
        assert eng.lossy and a.models.expected_choice() == (eng.precision, "fastest measured here (int8 9 ms)")
        on_load = next(f.fn for f in demo.fns.values() if f.api_name == "ui_footer")
        text = on_load()                                            # a page load after the engine loaded
        assert f"precision: **{eng.precision}**" in text and "fastest measured here (int8 9 ms)" in text


def test_the_footer_keeps_the_kernel_choices_in_a_closed_fold(cv, tmp_path):
    """Visitors read the models and the precision (lossy or not); what serves each part of a frame
    (`engine.paths()`) and why sits in a <details> fold, closed, listing every part."""
    with built_app(cv, tmp_path, dtype="fp32", quantize="none") as (a, footer):
        line, fold = footer.value.split("<details", 1)
        assert "precision: **fp32** (not lossy" in line and "`" + cv + "`" in line
        assert " open" not in fold.split(">", 1)[0] and "Shown once a model has loaded" in fold
        eng = a.models.registry.get("custom_voice")
        text = next(f.fn for f in a.build().fns.values() if f.api_name == "ui_footer")()
        line, fold = text.split("<details", 1)
        assert "lossy" in line and "frame" not in line
        for part, e in eng.paths().items():
            assert f"<li>{html.escape(part)}: <b>{html.escape(e['path'])}</b> ({html.escape(e['how'])}" in fold
