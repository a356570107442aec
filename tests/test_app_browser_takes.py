"""The history of takes and a dialogue in a real browser (headless chromium) on the real app (tiny random checkpoints):
three takes are generated and listed; the first plays again (and A/B switches to the third at the same position),
its WAV downloads, and Restore puts its text and seed back into the form. Then a three-line dialogue between two
voices plays through the page's live player with no silence inside it longer than the chosen pause + 80 ms, joins
included: the player's own metrics (`longestGapMs`: the longest silence the listener heard, whether a silence in the
samples it received together with any rebuffering at its edges, or a rebuffering on its own). The tiny engine makes
audio several times faster than it plays, so a silence longer than that comes from the player's start rule or the
order in which the lines are submitted, not from the engine's speed. Where that premise failed (other programs
starved the machine so that the server sent no audio for STARVED_MS or more), a silence over the bound skips the
test with the stream's timeline instead of failing it."""
from __future__ import annotations

import os

import pytest

from tests import browser as B

B.require_browser()

TEXTS = ["The first take, to be heard again.", "A second take.", "And a third take for the comparison."]
DIALOGUE = ("Ryan: Good morning, did you sleep well?\n"
            "Vivian: Not at all, the neighbours were singing.\n"
            "Ryan: Then let us buy them a piano.")
PAUSE_S = 0.3
SR = 24000
STARVED_MS = 800    # no audio from the server for this long: the machine, not the engine, set the pace


def longest_wait(timeline) -> float:
    """The longest time between two chunks of the stream, ms (the player's timeline: [ms after the click, samples]
    per chunk). The tiny engine makes a chunk of up to 12 frames (0.96 s) at several times real time, so a healthy
    server sends one at least every ~0.5 s."""
    return max((b[0] - a[0] for a, b in zip(timeline, timeline[1:])), default=0.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with B.tiny_app(tmp_path_factory.mktemp("browser_takes"), max_new_tokens=40) as (url, app):
        yield url, app


def _js(drv, script, *args):
    return drv.execute_script(script, *args)


def test_three_takes_replay_restore_and_a_gapless_dialogue(served, drv):
    url, app = served
    B.open_page(drv, url + "/")
    seeds = []
    for k, text in enumerate(TEXTS, 1):
        B.set_text(drv, "#preset-text textarea", text)
        B.play_once(drv)
        B.wait(lambda: B.status(drv).startswith("Done"), 30, "the status line to say Done")
        B.wait(lambda: drv.find_elements("css selector", f"#take-{k}"), 15, f"take #{k} in the list")
        seeds.append(int(drv.find_element("css selector", "#seed input").get_attribute("value")))
    labels = [e.text for e in drv.find_elements("css selector", ".take .take-label")]
    assert [lab.split(" · ")[0] for lab in labels] == ["#3", "#2", "#1"]                  # newest first
    assert f"seed {seeds[0]}" in labels[2] and "ryan" in labels[2]
    assert TEXTS[0] in drv.find_element("css selector", "#take-1 .take-text").text

    # replay the first take (A), then switch to the third (B): it continues at the same position
    _js(drv, "document.querySelector('#take-1 .take-ab[data-slot=A]').scrollIntoView()")
    B.click(drv, "#take-1 .take-ab[data-slot='A']")
    B.click(drv, "#take-3 .take-ab[data-slot='B']")
    assert "take #1" in drv.find_element("css selector", "#takes-play-a").text
    B.click(drv, "#takes-play-a")
    a = B.wait(lambda: (lambda s: s if s and s["take"] == 1 and s["at"] > 0.3 else None)(
        _js(drv, "window.takesAB.refresh(); return window.takesAB.state")), 15, "take #1 to play again")
    assert a["playing"] == "A"
    dur = _js(drv, "return document.getElementById('take-audio-1').duration")
    assert dur > 0.5, dur                                     # the take's WAV was served and decoded
    B.click(drv, "#takes-play-b")
    b = B.wait(lambda: (lambda s: s if s and s["take"] == 3 and s["at"] > 0 else None)(
        _js(drv, "window.takesAB.refresh(); return window.takesAB.state")), 5, "take #3 to play")
    assert b["playing"] == "B" and b["at"] >= a["at"] - 0.05
    assert _js(drv, "return document.getElementById('take-audio-1').paused") is True
    B.click(drv, "#takes-play-b")                              # the playing one again: pause
    B.wait(lambda: _js(drv, "return document.getElementById('take-audio-3').paused"), 5, "B to pause")
    # download: the link gives the take's WAV
    head = drv.execute_async_script("const done = arguments[arguments.length - 1];"
                                    "fetch(document.querySelector('#take-1 a.take-dl').href)"
                                    ".then(r => r.arrayBuffer()).then(b => done(Array.from(new Uint8Array(b))"
                                    ".slice(0, 4).concat([b.byteLength]))).catch(e => done(String(e)));")
    assert head[:4] == list(b"RIFF") and head[4] > 44 + 0.5 * 48000, head

    # restore the first take's settings, from another tab: text, seed (randomise off), the Preset tab shown
    B.tab(drv, "Dialogue")
    B.set_text(drv, "#preset-text textarea", "something else")
    B.click(drv, "#take-1-restore")
    B.wait(lambda: _js(drv, "return document.querySelector('#preset-text textarea').value") == TEXTS[0], 10,
           "the first take's text back in the form")
    assert int(drv.find_element("css selector", "#seed input").get_attribute("value")) == seeds[0]
    assert "Restored take #1" in B.status(drv)
    assert drv.find_element("css selector", "#preset-text textarea").is_displayed()
    randomize = _js(drv, "for (const l of document.querySelectorAll('label')) if (l.innerText.includes("
                         "'Randomise seed')) { const i = l.querySelector('input') || document.getElementById("
                         "l.htmlFor); if (i) return i.checked; } return null;")
    assert randomize is False

    # a three-line dialogue between two voices: no silence inside longer than the pause + 80 ms
    B.tab(drv, "Dialogue")
    B.set_text(drv, "#dialogue-script textarea", DIALOGUE)
    pause = float(drv.find_element("css selector", "#dialogue-pause input[type='number']").get_attribute("value"))
    assert pause == PAUSE_S
    m = B.play_once(drv, "#dialogue-generate", timeout=120, step=0.25)   # (polling the page costs CPU too)
    B.wait(lambda: B.status(drv).startswith("Done"), 30, "the dialogue's status line to say Done")
    gap_ms = m["longestJoinGapMs"]
    print(f"\n[browser] dialogue: {m['secondsPlayed']:.2f} s played, longest silence heard at a join {gap_ms:.0f} ms "
          f"(in the stream {m['maxSilenceMs']:.0f} ms; anywhere {m['longestGapMs']:.0f} ms; {m['stallMs']:.0f} ms "
          f"rebuffering in {m['underruns']} underruns); "
          f"click -> sound {m['clickToSoundMs']:.0f} ms; server: {B.status(drv).splitlines()[0][:160]}")
    assert m["maxSilenceMs"] >= PAUSE_S * 1000 - 1, m                        # the pauses are there
    wait = longest_wait(m["timeline"])
    print(f"[browser] the longest wait between two chunks of the stream: {wait:.0f} ms")
    if wait >= STARVED_MS and max(gap_ms, m["longestGapMs"]) > PAUSE_S * 1000 + 80:
        # the check's premise (the tiny engine makes audio several times faster than it plays) did not hold: on a
        # machine loaded by other programs the server sent nothing for a long while, which no start rule can
        # foresee, so a silence then says nothing of the player or of the order of the lines
        pytest.skip(f"the machine starved the server (load {os.getloadavg()[0]:.1f}): no audio for {wait:.0f} ms; "
                    f"longest silence {m['longestGapMs']:.0f} ms; timeline {m['timeline']}")
    assert gap_ms <= PAUSE_S * 1000 + 80, (m["log"], m)
    assert m["longestGapMs"] <= PAUSE_S * 1000 + 80, (m["log"], m["timeline"], m)
    assert "3 lines" in B.status(drv) and "Ryan = ryan" in B.status(drv) and "Vivian = vivian" in B.status(drv)
    files = drv.find_elements("css selector", "#dialogue-files a")
    assert len({f.get_attribute("href") for f in files if f.get_attribute("href")}) == 3
    B.wait(lambda: drv.find_elements("css selector", "#take-4"), 15, "the dialogue as take #4")
    labels = [e.text for e in drv.find_elements("css selector", ".take .take-label")]
    assert "Dialogue" in drv.find_element("css selector", "#take-4 .take-label").text, labels
