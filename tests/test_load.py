"""Load and memory behaviour of the HTTP API on the tiny checkpoint (loopback only, bounded counts and time).

- 32 concurrent clients send 200 requests in total: each completes with its full audio or fails fast with the
  busy error (503), and nothing hangs.
- Memory after 500 requests stays within a stated bound of memory after 50.
Numbers are printed (pytest -s) and recorded in docs/reliability.md.
"""
from __future__ import annotations

import gc
import io
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import soundfile as sf

from serving.limits import Limits
from tests.live_server import tiny_api

FRAMES = 6



@pytest.fixture(scope="module")
def api(tmp_path_factory):
    limits = Limits(max_new_tokens=FRAMES + 1, max_per_client=64)
    with tiny_api(tmp_path_factory.mktemp("load"), ["custom_voice"], limits,
                  engine_kw=dict(max_batch=4, max_waiting=8)) as (url, registry, _):
        yield url, registry


def _request(url: str, i: int, client: httpx.Client):
    t0 = time.perf_counter()
    r = client.post(url + "/v1/audio/speech", json={
        "model": "tts", "voice": ["ryan", "vivian", "serena"][i % 3], "input": f"Request number {i}.",
        "response_format": "wav", "seed": i, "max_new_tokens": FRAMES + 1}, timeout=120)
    return r, time.perf_counter() - t0


def _ignore_eos(registry):
    # a fixed output length: every completed request must carry exactly FRAMES frames
    eng = registry.get("custom_voice")
    real = eng._sampling
    eng._sampling = lambda s, g, m: (lambda p: (setattr(p, "ignore_eos", True), p)[1])(real(s, g, m))


def test_32_clients_200_requests_complete_or_fail_fast(api):
    url, registry = api
    _ignore_eos(registry)
    results = []
    lock = threading.Lock()

    def client_loop(cid: int, n: int):
        with httpx.Client() as c:
            for k in range(n):
                r, dt = _request(url, cid * 100 + k, c)
                with lock:
                    results.append((r.status_code, dt, r.content if r.status_code == 200 else r.json()))

    t0 = time.perf_counter()
    counts = [7] * 8 + [6] * 24               # 32 clients, 200 requests
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(client_loop, i, n) for i, n in enumerate(counts)]
        for f in futures:
            f.result(timeout=600)
    wall = time.perf_counter() - t0
    assert len(results) == 200
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) + len(busy) == 200, {r[0] for r in results}
    for _, _, body in ok:
        wav, sr = sf.read(io.BytesIO(body))
        assert sr == 24000 and len(wav) == FRAMES * 1920
    for _, dt, body in busy:
        assert dt < 2.0 and body["error"]["code"] == "server_busy"
    assert ok, "no request completed"
    print(f"\nload: 200 requests from 32 clients in {wall:.1f} s: {len(ok)} completed, {len(busy)} busy "
          f"(max busy latency {max((b[1] for b in busy), default=0) * 1000:.0f} ms)")
    eng = registry.get("custom_voice")
    assert not eng.scheduler.running and len(eng.scheduler.free_rows) == eng.max_batch


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_memory_after_500_requests_within_bound_of_after_50(api):
    url, registry = api
    MEM_BOUND_MB = 64
    with httpx.Client() as c:
        def run(n, start):
            with ThreadPoolExecutor(4) as pool:
                rs = list(pool.map(lambda i: _request(url, i, c)[0].status_code, range(start, start + n)))
            assert all(s == 200 for s in rs), set(rs)

        run(50, 0)
        gc.collect()
        after_50 = _rss_mb()
        run(450, 50)
        gc.collect()
        after_500 = _rss_mb()
    print(f"\nmemory: RSS {after_50:.0f} MB after 50 requests, {after_500:.0f} MB after 500 "
          f"(growth {after_500 - after_50:+.1f} MB, bound {MEM_BOUND_MB} MB)")
    assert after_500 - after_50 < MEM_BOUND_MB
