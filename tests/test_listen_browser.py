"""A listening test in a real browser (headless chromium) on the real app (tiny random checkpoints), by clicking: the
Listen tab starts a two-trial ABX test of two voices; A plays, switching to B continues at the same position, a loop
of a region jumps back, X = A is chosen and submitted for each trial; then the results, their plot (a bar with its
interval) and the CSV / JSON downloads are shown, and the server holds exactly the two answers given."""
from __future__ import annotations

import pytest

from tests import browser as B

B.require_browser()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with B.tiny_app(tmp_path_factory.mktemp("browser_listen"), max_new_tokens=40) as (url, app):
        yield url, app


def _js(drv, script, *args):
    return drv.execute_script(script, *args)


def _state(drv) -> dict:
    return _js(drv, "window.listenTest.refresh(); return window.listenTest.state") or {}


def _trial(drv) -> int | None:
    t = _js(drv, "const t = document.getElementById('ls-trial'); return t ? parseInt(t.dataset.trial, 10) : null")
    return t


def test_a_short_abx_test_by_clicking(served, drv):
    url, app = served
    B.open_page(drv, url + "/")
    B.wait(lambda: _js(drv, "return !!window.listenTest"), 10, "the Listen tab's player script")
    B.tab(drv, "Listen")
    B.set_text(drv, "#ls-trials input", "2")
    _js(drv, "document.querySelector('#ls-trials input').dispatchEvent(new Event('change', {bubbles: true}))")
    B.set_text(drv, "#ls-values textarea, #ls-values input", "ryan, vivian")
    B.click(drv, "#ls-start")
    B.wait(lambda: _trial(drv) == 1, 120, "the first trial to be rendered and shown")
    test_id = _js(drv, "return document.getElementById('ls-trial').dataset.test")
    test = app.listen.service.get(test_id)
    assert test.definition.kind == "abx" and test.definition.trials == 2 and test.factor == "voice"
    labels = [b.text for b in drv.find_elements("css selector", ".ls-stim")]
    assert labels == ["▶ A", "▶ B", "▶ X"]                              # labels only: nothing says which voice
    assert "ryan" not in _js(drv, "return document.getElementById('ls-trial').outerHTML").lower()
    B.wait(lambda: _js(drv, "return document.getElementById('ls-audio-B').readyState >= 1"), 15, "B's audio")

    # A plays; B continues at the same position; the playing one again pauses
    B.click(drv, "#ls-play-A")
    a = B.wait(lambda: (lambda s: s if s.get("playing") == "A" and s.get("at", 0) > 0.4 else None)(_state(drv)),
               15, "A to play")
    B.click(drv, "#ls-play-B")
    b = B.wait(lambda: (lambda s: s if s.get("playing") == "B" else None)(_state(drv)), 5, "B to play")
    assert b["at"] >= a["at"] - 0.05, (a, b)
    assert _js(drv, "return document.getElementById('ls-audio-A').paused") is True
    B.click(drv, "#ls-play-B")
    B.wait(lambda: _js(drv, "return document.getElementById('ls-audio-B').paused"), 5, "B to pause")

    # a loop of 0.1-0.5 s: X plays inside it and jumps back
    _js(drv, "document.getElementById('ls-loop-a').value = '0.1'; document.getElementById('ls-loop-b').value = '0.5';"
             "document.getElementById('ls-loop-on').checked = true;")
    B.click(drv, "#ls-play-X")
    s = B.wait(lambda: (lambda s: s if s.get("loops", 0) >= 2 else None)(_state(drv)), 15, "the loop to jump back")
    assert 0.05 <= s["at"] <= 0.65, s
    B.click(drv, "#ls-pause")

    for trial in (1, 2):
        B.wait(lambda: _trial(drv) == trial, 120, f"trial {trial}")
        B.click(drv, "input[name='ls-choice'][value='A']")
        B.click(drv, "#ls-submit")
        if trial == 1:
            B.wait(lambda: _trial(drv) == 2, 120, "the second trial")
    B.wait(lambda: _js(drv, "return !!document.getElementById('ls-done')"), 60, "the end of the test")
    assert len(test.answers) == 2 and all(a.answer == "A" for a in test.answers.values())
    summary = drv.find_element("css selector", "#ls-summary").text
    assert "ABX" in summary and "2/2 trials answered" in summary and "voice ryan vs voice vivian" in summary
    assert "Finished" in drv.find_element("css selector", "#ls-progress").text
    assert len(drv.find_elements("css selector", "#ls-plot svg rect.ls-bar")) == 1
    assert len(drv.find_elements("css selector", "#ls-plot svg path.ls-interval")) == 1
    links = [a.get_attribute("href") or "" for a in drv.find_elements("css selector", "#ls-csv a, #ls-json a")]
    assert any(h.endswith(".csv") for h in links) and any(h.endswith(".json") for h in links), links


def test_a_one_trial_mushra_test_by_clicking(served, drv):
    """MUSHRA in the page: ryan (the reference, played openly as R) against vivian, so three rated labels (vivian,
    the hidden reference, the anchor), each with its slider; the scores set on the sliders are the answer the server
    records."""
    url, app = served
    B.open_page(drv, url + "/")
    B.tab(drv, "Listen")
    for label in drv.find_elements("css selector", "#ls-kind label"):
        if "MUSHRA" in label.text:
            label.click()
    B.wait(lambda: _js(drv, "const i = document.querySelector('#ls-kind input[value=mushra]');"
                            "return i && i.checked"), 5, "MUSHRA to be chosen")
    B.set_text(drv, "#ls-trials input", "1")
    _js(drv, "document.querySelector('#ls-trials input').dispatchEvent(new Event('change', {bubbles: true}))")
    B.click(drv, "#ls-start")
    B.wait(lambda: _js(drv, "const t = document.getElementById('ls-trial'); return t && t.dataset.kind == 'mushra'"),
           120, "the MUSHRA trial")
    test = app.listen.service.get(_js(drv, "return document.getElementById('ls-trial').dataset.test"))
    assert [b.text for b in drv.find_elements("css selector", ".ls-stim")] == ["▶ R", "▶ A", "▶ B", "▶ C"]
    sliders = drv.find_elements("css selector", ".ls-score")
    assert [s.get_attribute("data-label") for s in sliders] == ["A", "B", "C"]
    B.click(drv, "#ls-play-R")
    B.wait(lambda: _state(drv).get("playing") == "R", 10, "the reference to play")
    B.click(drv, "#ls-play-C")
    B.wait(lambda: _state(drv).get("playing") == "C", 10, "C to play")
    scores = {"A": 12, "B": 100, "C": 77}
    for s in sliders:
        _js(drv, "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input', {bubbles: true}))",
            s, scores[s.get_attribute("data-label")])
    assert drv.find_element("css selector", "#ls-score-C-v").text == "77"
    B.click(drv, "#ls-submit")
    B.wait(lambda: _js(drv, "return !!document.getElementById('ls-done')"), 60, "the end of the test")
    assert test.answers[1].answer == {k: float(v) for k, v in scores.items()}
    summary = drv.find_element("css selector", "#ls-summary").text
    assert "MUSHRA" in summary and "hidden reference (voice ryan)" in summary and "anchor" in summary
    assert len(drv.find_elements("css selector", "#ls-plot svg rect.ls-bar")) == 3
