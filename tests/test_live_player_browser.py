"""The live player in a real browser (headless chromium), on a small Gradio page with a fake generator
(tests/live_harness.py): it plays at once when generation is faster than playback, buffers and then plays without
a gap when it is slower, Stop silences it and cancels the generation, a double click makes one run, a page opened
over plain HTTP from a non-loopback address (no AudioWorklet) still plays, a second tab plays, and a run whose
handler fails does not leave the page waiting. Prints click-to-sound times."""
from __future__ import annotations

import statistics
import time

import pytest

from tests import browser as B

B.require_browser()


@pytest.fixture(scope="module")
def harness():
    from tests.live_harness import build_app
    from tests.live_server import serve

    app, fake = build_app()
    with serve(app) as url:
        yield url, fake


def _fast(fake):
    fake.rate, fake.first_chunk_s, fake.chunk_s, fake.seconds = 4.0, 0.07, 0.32, 2.0


def test_plays_at_once_when_generation_is_fast(harness, drv):
    url, fake = harness
    _fast(fake)
    B.open_page(drv, url + "/")
    times = []
    for _ in range(3):
        m = B.play_once(drv)
        assert m["backend"] == "worklet" and m["secureContext"], m
        assert m["underruns"] == 0, m
        assert m["samplesPlayed"] == m["samplesReceived"] == int(2.0 * 24000), m
        assert abs(m["rms"] - 0.3 / 2 ** 0.5) < 0.01, m          # the sine's RMS: what was written was played
        times.append(m["clickToSoundMs"])
        print(f"\n  first byte {m['clickToFirstByteMs']:.0f} ms, first sample rendered {m['clickToRenderedMs']:.0f} ms,"
              f" "
              f"audible {m['clickToSoundMs']:.0f} ms ({m['soundVia']}, output latency {m['outputLatencyMs']:.0f} ms)")
        assert fake.runs[-1]["sink"] and fake.runs[-1]["done"] and not fake.runs[-1]["cancelled"]
    print(f"\n[live player, harness, worklet] click -> sound (ms): {', '.join(f'{t:.0f}' for t in times)}; "
          f"median {statistics.median(times):.0f}")


def test_more_than_the_ring_holds_waits_on_the_page_and_plays_whole(harness, drv):
    url, fake = harness
    fake.rate, fake.first_chunk_s, fake.chunk_s, fake.seconds = 20.0, 0.07, 1.6, 3.0   # chunks bigger than the ring
    B.open_page(drv, url + "/?live_ring_s=1")
    m = B.play_once(drv)
    assert m["backend"] == "worklet" and m["underruns"] == 0, m
    assert m["samplesPlayed"] == m["samplesReceived"] == int(3.0 * 24000), m
    assert abs(m["rms"] - 0.3 / 2 ** 0.5) < 0.01, m


@pytest.mark.parametrize("prior", ["server rate known", "no prior"])
def test_buffers_then_plays_without_gaps_when_generation_is_slow(harness, drv, prior):
    url, fake = harness
    fake.rate, fake.first_chunk_s, fake.chunk_s, fake.seconds = 0.6, 0.07, 0.32, 3.0
    fake.streams.rate = 0.6 if prior == "server rate known" else None
    B.open_page(drv, url + "/")
    n = len(B.runs(drv))
    B.click(drv, "#preset-generate")
    B.wait(lambda: len(B.runs(drv)) > n, 5, "the run to start")
    # data has come, but the player waits for enough of it
    m = B.wait(lambda: (lambda m: m if m.get("samplesReceived", 0) >= 2 * 7680 else None)(B.metrics(drv)), 10,
               "two chunks to arrive")
    if prior == "server rate known":
        assert m["state"] == "buffering" and m["samplesPlayed"] == 0, m
        assert "buffering" in drv.find_element("css selector", "#live-player-status").text
    m = B.wait(lambda: (lambda m: m if m.get("state") in ("ended", "stopped", "error") else None)(B.metrics(drv)),
               30, "the stream to play to its end")
    assert m["state"] == "ended", m
    B.assert_sound(m)
    assert m["samplesPlayed"] == int(3.0 * 24000), m
    # it knew the rate was too slow and waited; once it played it played to the end; without a prior it may
    # start at once, underrun once, and then rebuffer for the rest (a pause, not a stutter)
    assert m["underruns"] == (0 if prior == "server rate known" else m["underruns"]) and m["underruns"] <= 1, m["log"]
    assert m["rate"] < 0.8, m
    fake.streams.rate = None
    print(f"\n[live player, harness] generation at 0.6x real time ({prior}): click -> sound "
          f"{m['clickToSoundMs']:.0f} ms, {m['underruns']} underrun(s)")


def test_a_slow_start_rebuffers_once_briefly_and_the_next_run_starts_later_without_it(harness, drv):
    """Generation 4x faster than playback, but the stream stops for 0.8 s after its first 0.32 s (a slow start).
    With the server's rate known to be fast, the first run starts at once and runs dry; once audio comes again at 4x
    it plays again as soon as what is buffered covers the next chunk (not after buffering for the whole rest, which
    a rate averaged over the stream's slow start would ask for). The page learns how late the chunks came: the next
    run starts that much later and plays without that pause."""
    url, fake = harness
    fake.rate, fake.first_chunk_s, fake.chunk_s, fake.seconds = 4.0, 0.07, 0.32, 4.0
    fake.hiccup_after_s, fake.hiccup_s = 0.32, 0.8
    fake.streams.rate = 4.0
    try:
        B.open_page(drv, url + "/")
        m1 = B.play_once(drv)
        m2 = B.play_once(drv)
    finally:
        fake.hiccup_after_s, fake.streams.rate = None, None
    for m in (m1, m2):
        assert m["samplesPlayed"] == int(4.0 * 24000), m
    print(f"\n[live player, harness] a 0.8 s hiccup after 0.32 s: run 1 click -> sound {m1['clickToSoundMs']:.0f} ms, "
          f"{m1['underruns']} underrun(s), {m1['stallMs']:.0f} ms silent; run 2 {m2['clickToSoundMs']:.0f} ms, "
          f"{m2['underruns']} underrun(s), {m2['stallMs']:.0f} ms silent (start lag learnt {m1['startLagMs']} ms)")
    assert m1["underruns"] >= 1 and m1["startLagMs"] >= 250, m1
    # played again as soon as the stream came back at 4x (a small cushion at most), not after buffering for the
    # whole rest as a rate averaged over the hiccup would ask (seconds)
    restart = [e for e in m1["log"] if e[1] == "play"][1]
    assert restart[3] <= 0.3, (m1["log"], m1["timeline"])
    assert m1["maxStallMs"] < 1500, (m1["log"], m1["timeline"])
    assert m2["stallMs"] < m1["stallMs"] / 2, (m1["log"], m2["log"])
    assert m2["clickToSoundMs"] - m2["clickToFirstByteMs"] >= 300, m2


def test_stop_silences_at_once_and_cancels_the_generation(harness, drv):
    url, fake = harness
    fake.rate, fake.first_chunk_s, fake.chunk_s, fake.seconds = 1.5, 0.07, 0.16, 20.0
    B.open_page(drv, url + "/")
    B.click(drv, "#preset-generate")
    B.wait(lambda: B.metrics(drv).get("secondsPlayed", 0) > 0.6, 10, "half a second played")
    run = fake.runs[-1]
    assert not run["cancelled"]
    B.click(drv, "#stop")
    m = B.wait(lambda: (lambda m: m if m.get("state") == "stopped" else None)(B.metrics(drv)), 3, "stopped")
    assert m["rms"] > 1e-3                       # it had played sound...
    time.sleep(0.25)
    p1 = drv.execute_script("return window.liveTTS.probe()")
    time.sleep(0.3)
    p2 = drv.execute_script("return window.liveTTS.probe()")
    assert p1["outputRms"] == 0 and p2["outputRms"] == 0, (p1, p2)     # ...and now the output is silent
    assert p1["backendPlayed"] == p2["backendPlayed"] == 0 and p2["backendBuffered"] == 0, (p1, p2)
    assert p2["contextTime"] > p1["contextTime"]                          # (the clock runs: silence, not a halt)
    # the aborted fetch cancelled the slot, so the generator stopped early
    B.wait(lambda: run["done"], 5, "the generation to stop")
    assert run["cancelled"] and run["written_s"] < 10, run


def test_reload_cancels_the_generation(harness, drv):
    url, fake = harness
    fake.rate, fake.first_chunk_s, fake.chunk_s, fake.seconds = 1.5, 0.07, 0.16, 20.0
    B.open_page(drv, url + "/")
    B.click(drv, "#preset-generate")
    B.wait(lambda: B.metrics(drv).get("secondsPlayed", 0) > 0.3, 10, "playback")
    run = fake.runs[-1]
    B.open_page(drv, url + "/")                    # a reload: the page's fetch goes away with it
    B.wait(lambda: run["done"], 5, "the generation to stop")
    # either path stops it early: the aborted fetch cancels the slot, or Gradio closes the job of the page that left
    assert (run["cancelled"] or run["closed"]) and run["written_s"] < 10, run
    assert B.wait(lambda: len(fake.streams) == 0, 3, "no slot left")


def test_double_click_makes_one_run(harness, drv):
    url, fake = harness
    _fast(fake)
    B.open_page(drv, url + "/")
    n_fake, n_runs = len(fake.runs), len(B.runs(drv))
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(drv).double_click(drv.find_element("css selector", "#preset-generate")).perform()
    m = B.wait(lambda: (lambda m: m if m.get("state") == "ended" else None)(B.metrics(drv)), 20, "the run to end")
    B.assert_sound(m)
    time.sleep(0.5)
    assert len(B.runs(drv)) == n_runs + 1
    assert len(fake.runs) == n_fake + 1, fake.runs[n_fake:]


def test_failed_event_does_not_leave_the_player_waiting(harness, drv):
    url, fake = harness
    _fast(fake)
    B.open_page(drv, url + "/")
    box = drv.find_element("css selector", "#text textarea")
    from selenium.webdriver.common.keys import Keys

    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    time.sleep(0.3)
    B.click(drv, "#preset-generate")
    m = B.wait(lambda: (lambda m: m if m.get("state") not in (None, "buffering") else None)(B.metrics(drv)), 10,
               "the player to give up on a run the server refused")
    assert m["state"] == "idle" and m["samplesPlayed"] == 0, m
    box.send_keys("Hello again.")
    B.play_once(drv)                               # and the next click works


def test_plain_http_on_a_lan_address_plays_through_the_fallback(harness, drv):
    url, fake = harness
    _fast(fake)
    port = url.rsplit(":", 1)[1]
    B.open_page(drv, f"http://{B.LAN_HOST}:{port}/")
    assert drv.execute_script("return window.isSecureContext") is False
    assert drv.execute_script("return typeof AudioWorkletNode === 'undefined' || !new AudioContext().audioWorklet")
    times = []
    for _ in range(2):
        m = B.play_once(drv)
        assert m["backend"] == "scheduled" and m["underruns"] == 0, m
        assert m["samplesPlayed"] == m["samplesReceived"] == int(2.0 * 24000), m
        times.append(m["clickToSoundMs"])
    print(f"\n[live player, harness, scheduled fallback] click -> sound (ms): {', '.join(f'{t:.0f}' for t in times)}")


def test_second_tab_plays(harness, drv):
    url, fake = harness
    _fast(fake)
    B.open_page(drv, url + "/")
    first_session = drv.execute_script("return window.__gradio_session_hash__")
    drv.switch_to.new_window("tab")
    try:
        B.open_page(drv, url + "/")
        assert drv.execute_script("return window.__gradio_session_hash__") != first_session
        B.play_once(drv)
        assert fake.runs[-1]["session"] != first_session
    finally:
        drv.close()
        drv.switch_to.window(drv.window_handles[0])
    assert len(fake.streams) == 0
