"""The history of takes without a browser: at most 20 per session, newest first, the WAV of a take that falls off
(and of every take when the session ends) deleted, a result reported twice kept once, Restore puts the values back."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import numpy as np
import soundfile as sf

from ui import history as H
from ui.session import Files


def _app(tmp_path):
    return SimpleNamespace(files=Files(3600))


def _values(text, seed):
    # preset: text, voice, language, instruct, then seed, temperature, top_k, top_p, rep, max_new
    return [text, "ryan", "english", "", seed, 0.7, 30, 0.9, 1.1, 50]


def test_last_twenty_takes_newest_first_and_their_files(tmp_path):
    app = _app(tmp_path)
    hist = []
    for k in range(23):
        audio = np.full(2400 + k, 1000 + k, np.int16)
        hist = H.record(app, "preset", hist, (24000, audio), 100 + k, *_values(f"take {k}", 0))
    assert len(hist) == H.MAX_TAKES and [t["n"] for t in hist] == list(range(23, 3, -1))
    t = hist[0]
    assert t["seed"] == 122 and t["text"] == "take 22" and t["voice"] == "ryan" and t["seconds"] == 0.1
    wav, sr = sf.read(t["path"], dtype="int16")
    assert sr == 24000 and len(wav) == 2422 and wav[0] == 1022
    files = sorted(Path(app.files.dir).rglob("*.wav"))
    assert len(files) == H.MAX_TAKES                      # the three oldest takes' files are gone
    assert not any("take_01_" in f.name or "take_03_" in f.name for f in files)
    # the same result again (the player reports it twice): one take
    again = H.record(app, "preset", hist, (24000, np.full(2422, 1022, np.int16)), 122, *_values("take 22", 0))
    assert again == hist
    # nothing recorded without audio
    assert H.record(app, "preset", hist, None, 1, *_values("x", 0)) == hist
    H.forget(hist)
    assert not list(Path(app.files.dir).rglob("*.wav"))
    app.files.close()


def test_restore_puts_the_values_back(tmp_path):
    app = _app(tmp_path)
    comps = {n: object() for n in H.FIELDS["preset"] + H.SETTINGS}
    c = SimpleNamespace(**comps, randomize=object(), tabs=object(), status=object())
    take = H.record(app, "preset", [], (24000, np.ones(4800, np.int16)), 77, *_values("Hello.", 5))[0]
    out = H.restore(c, take)
    assert out[c.p_text] == "Hello." and out[c.p_voice] == "ryan" and out[c.seed] == 77
    assert out[c.temperature] == 0.7 and out[c.max_new] == 50 and out[c.randomize] is False
    assert isinstance(out[c.tabs], gr.Tabs) and "Restored take #1" in out[c.status]
    html = H.take_html({**take, "text": "<script>x</script>"})
    assert "<script>x" not in html and 'id="take-audio-1"' in html and "gradio_api/file=" in html
    app.files.close()
