"""Long-form jobs expire (serving/longform.py `Retention`, `cleanup`, `Sweeper`): finished jobs after their days,
unfinished ones later, the oldest first over the disk limit, never a job being rendered; judged by a fake clock."""
from __future__ import annotations

import time

import pytest

from serving import longform as L

DAY = 86400.0


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(L, "now", c)
    return c


def _job(root, title: str, state: str, clock: Clock, at: float, audio_bytes: int = 0) -> L.Job:
    clock.t = at
    job = L.Job.create(root, title, [L.Chapter(title, ["Some words here."])], ["ryan"], 1, L.Settings(),
                       split=lambda t: [t])
    if audio_bytes:
        (job.folder / "segments" / "c001_s0001.wav").write_bytes(b"\0" * audio_bytes)
    job.state = state
    job.save()
    return job


def _ids(root) -> set[str]:
    return {j.id for j in L.list_jobs(root)}


def test_finished_jobs_expire_after_their_days_unfinished_later(tmp_path, clock):
    t0 = clock.t
    r = L.Retention(keep_days=7, keep_unfinished_days=30, max_bytes=0)
    done_old = _job(tmp_path, "done old", "done", clock, t0)
    done_new = _job(tmp_path, "done new", "done", clock, t0 + 5 * DAY)
    stopped = _job(tmp_path, "stopped", "stopped", clock, t0)
    crashed = _job(tmp_path, "crashed", "rendering", clock, t0)      # a process died while rendering it
    assert r.expires(done_old) == pytest.approx(t0 + 7 * DAY) and r.expires(stopped) == pytest.approx(t0 + 30 * DAY)
    assert L.cleanup(tmp_path, r, at=t0 + 6.9 * DAY) == []
    gone = L.cleanup(tmp_path, r, at=t0 + 7.1 * DAY)
    assert [g[0] for g in gone] == [done_old.id] and "finished" in gone[0][1]
    assert _ids(tmp_path) == {done_new.id, stopped.id, crashed.id}
    assert not done_old.folder.exists() and not any(p.name.startswith(".removed-") for p in tmp_path.iterdir())
    gone = {g[0] for g in L.cleanup(tmp_path, r, at=t0 + 30.1 * DAY)}
    assert gone == {done_new.id, stopped.id, crashed.id}
    assert _ids(tmp_path) == set()


def test_a_running_or_recent_job_is_never_removed(tmp_path, clock):
    t0 = clock.t
    r = L.Retention(keep_days=1, keep_unfinished_days=1, max_bytes=1)      # everything is over every limit
    busy = _job(tmp_path, "busy", "stopped", clock, t0)
    recent = _job(tmp_path, "recent", "done", clock, t0 + 10 * DAY - 600)  # changed 10 minutes ago
    old = _job(tmp_path, "old", "done", clock, t0)
    gone = {g[0] for g in L.cleanup(tmp_path, r, running={busy.id}, at=t0 + 10 * DAY)}
    assert gone == {old.id} and _ids(tmp_path) == {busy.id, recent.id}


def test_over_the_disk_limit_finished_jobs_go_oldest_first(tmp_path, clock):
    t0 = clock.t
    mb = 2**20
    a = _job(tmp_path, "a", "done", clock, t0, audio_bytes=mb)
    b = _job(tmp_path, "b", "done", clock, t0 + 1 * DAY, audio_bytes=mb)
    c = _job(tmp_path, "c", "done", clock, t0 + 2 * DAY, audio_bytes=mb)
    paused = _job(tmp_path, "paused", "stopped", clock, t0 - DAY, audio_bytes=mb)   # the oldest, but unfinished
    r = L.Retention(keep_days=0, keep_unfinished_days=0, max_bytes=int(2.5 * mb))    # no age limit
    gone = L.cleanup(tmp_path, r, at=t0 + 3 * DAY)
    assert [g[0] for g in gone] == [a.id, b.id] and all("disk limit" in g[1] for g in gone)
    assert _ids(tmp_path) == {c.id, paused.id}
    # still over: then unfinished jobs idle for a day or more, oldest first
    r = L.Retention(keep_days=0, keep_unfinished_days=0, max_bytes=int(1.5 * mb))
    assert [g[0] for g in L.cleanup(tmp_path, r, at=t0 + 3 * DAY)] == [c.id]
    r = L.Retention(keep_days=0, keep_unfinished_days=0, max_bytes=mb // 2)
    assert [g[0] for g in L.cleanup(tmp_path, r, at=t0 + 3 * DAY)] == [paused.id]


def test_listing_shows_state_and_expiry(tmp_path, clock):
    r = L.Retention(keep_days=7, keep_unfinished_days=30)
    job = _job(tmp_path, "Listed", "done", clock, clock.t)
    text = job.describe(r)
    assert "done" in text and "kept until " + time.strftime("%Y-%m-%d", time.localtime(clock.t + 7 * DAY)) in text
    crashed = _job(tmp_path, "Crashed", "rendering", clock, clock.t)
    assert " stopped " in crashed.describe(r) and " rendering " in crashed.describe(r, running=True)
    assert "kept until" not in crashed.describe(r, running=True)
    assert "kept until" not in job.describe(L.Retention(keep_days=0))


def test_retention_from_the_environment():
    r = L.Retention.from_env({"TTS_LONGFORM_KEEP_DAYS": "2", "TTS_LONGFORM_KEEP_UNFINISHED_DAYS": "0",
                              "TTS_LONGFORM_MAX_GB": "0.5"})
    assert (r.keep_days, r.keep_unfinished_days, r.max_bytes) == (2, 0, 2**29)
    assert "unfinished forever" in r.describe()
    assert L.Retention.from_env({"TTS_LONGFORM_KEEP_DAYS": "a week"}) == L.Retention()     # logged, default kept
    assert L.Retention.from_env({}) == L.Retention()


def test_sweeper_cleans_at_start_and_periodically(tmp_path, clock):
    t0 = clock.t
    r = L.Retention(keep_days=7, keep_unfinished_days=30, max_bytes=0)
    first = _job(tmp_path, "first", "done", clock, t0)
    second = _job(tmp_path, "second", "done", clock, t0 + 3 * DAY)
    leftover = tmp_path / ".removed-x"               # a removal cut short by a crash
    leftover.mkdir()
    clock.t = t0 + 8 * DAY
    sw = L.Sweeper.start(tmp_path, r, set, every_s=0.05)
    try:
        assert _ids(tmp_path) == {second.id} and not leftover.exists()     # at start, before returning
        clock.t = t0 + 11 * DAY
        deadline = time.time() + 10
        while _ids(tmp_path) and time.time() < deadline:
            time.sleep(0.02)
        assert _ids(tmp_path) == set()                                      # by the periodic sweep
        assert L.Sweeper.start(tmp_path, r, set) is sw                      # one sweeper per folder
    finally:
        sw.stop.set()
        sw.thread.join(5)
