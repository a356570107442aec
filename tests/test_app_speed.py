"""The page's speed slider (issue 16): the handlers stretch what the listener hears and the lossless WAV alike,
through one gapless stretcher across sentence groups and the pauses between them."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from serving.limits import Limits
from tests.live_server import tiny_checkpoint
from ui.app import TTSApp
from ui.config import AppConfig


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed_app")
    ck = {"custom_voice": str(tiny_checkpoint(d / "custom_voice", kind="custom_voice", size="0b6", seed=0)),
          "base": None, "voice_design": None}
    cfg = AppConfig(checkpoints=ck, device="cpu", cache_dir=d / "cache", offline_fallback=False,
                    limits=Limits(max_text_chars=400, max_new_tokens=10), live_audio=True)
    a = TTSApp(cfg)
    a.demo_blocks = a.build()
    yield a
    a.close()


def _run(app, speed):
    outs = list(app.preset("Hello there. How are you today?", "ryan", "english", "", {}, seed=5, randomize=False,
                           max_new_tokens=6, speed=speed, request=SimpleNamespace(session_hash=f"s{speed}")))
    final = outs[-1][app.c.final]
    live = [d[app.c.live][1] for d in outs if app.c.live in d]
    return final[1], np.concatenate(live)


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_slider_stretches_what_is_heard_and_saved(app, speed):
    plain, _ = _run(app, 1.0)
    final, heard = _run(app, speed)
    assert len(final) == round(len(plain) / speed)          # both sentence groups and the pause between them
    assert np.array_equal(final, heard)                      # the lossless WAV is what the listener heard


def test_speed_out_of_range_is_a_message(app):
    with pytest.raises(Exception, match="between 0.25 and 4.0"):
        list(app.preset("Hi.", "ryan", "english", "", {}, seed=1, randomize=False, max_new_tokens=4, speed=9,
                        request=SimpleNamespace(session_hash="bad")))


def test_the_page_has_a_speed_slider_wired_to_every_generation(app):
    c = app.c
    assert (c.speed.minimum, c.speed.maximum, c.speed.value) == (0.25, 4.0, 1.0)
    wired = set()
    for f in app.demo_blocks.fns.values():
        if f.api_name in ("preset", "clone", "blend", "blend_sweep", "design"):
            ids = [x._id for x in f.inputs]
            assert c.speed._id in ids, f.api_name
            params = list(inspect.signature(f.fn).parameters)
            assert params[ids.index(c.speed._id)] == "speed", f.api_name     # the slider lands on `speed`
            wired.add(f.api_name)
    assert {"preset", "blend", "blend_sweep"} <= wired
