"""The continuity benchmark (`python -m bench continuity`): its player model, and one run against our API."""
import pytest

from bench import continuity
from bench.continuity import Player
from serving.limits import Limits
from tests.live_server import tiny_api


def test_a_player_fed_faster_than_real_time_never_waits():
    p = Player(t_first=0.0)
    for k in range(10):
        p.arrive(0.0 + 0.05 * k, 0.1 if k else 0.08)   # 100 ms of audio every 50 ms
    assert p.gaps == [] and p.stalled == 0


def test_a_player_that_runs_dry_counts_each_gap_once_and_resumes_where_it_was():
    p = Player(t_first=10.0)
    p.arrive(10.0, 0.5)        # plays 10.0 .. 10.5
    p.arrive(10.8, 0.5)        # dry from 10.5 to 10.8: one gap of 0.3 s, then plays 10.8 .. 11.3
    p.arrive(11.0, 0.5)        # in time
    p.arrive(12.0, 0.2)        # dry from 11.8 to 12.0: 0.2 s
    assert p.gaps == pytest.approx([0.3, 0.2])
    assert p.stalled == pytest.approx(0.5)
    assert p.have == pytest.approx(1.7)


def test_a_tiny_wait_is_not_an_underrun():
    p = Player(t_first=0.0)
    p.arrive(0.0, 0.1)
    p.arrive(0.105, 0.1)
    assert p.gaps == [] and p.stalled == pytest.approx(0.005)


def test_a_run_against_our_api_reports_every_stream(tmp_path):
    with tiny_api(tmp_path, ["custom_voice"], Limits()) as (url, _registry, _ck):
        r = continuity.run(url, clients=2, arrival="burst", frames=6, voice="ryan", model=None)
    assert r["ok"] == 2 and r["refused_or_failed"] == []
    assert r["first_audio_p50_ms"] > 0 and r["audio_s_per_s"] > 0
    assert 0 <= r["underrun_rate"] <= 1
