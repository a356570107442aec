"""ZeroGPU mode (ui/zerogpu.py) under the real `spaces` package, without a GPU.

The app runs in a subprocess (tests/zerogpu_launch.py) with SPACES_ZERO_GPU=true and SPACES_ZERO_DEVICE_API_URL
at a local stand-in for ZeroGPU's scheduling service (tests/zerogpu_service.py); the package's own code packs the
models at launch, asks the service for a GPU per call, forks its worker and relays the yields; only the worker's
two device steps (`init`, `move`) are replaced, so the worker's "cuda" is the package's stand-in on the CPU (about
1-3 s per frame of the tiny model here: requests are kept to a few frames).

Checked: every generation runs inside the @spaces.GPU call, in the forked worker (its pid, as the package reports
it to the service, is not the server's); audio streams to gradio_client and to the page's live player route;
three requests in a row work; a refused request (quota) gives a clear message and the app keeps serving; Stop ends
the GPU call; /v1 answers 503 with the reason. Plus the pure parts: the GPU time asked for, the messages.
"""
from __future__ import annotations

import base64
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import soundfile as sf

spaces = pytest.importorskip("spaces")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import free_port  # noqa: E402
from zerogpu_service import ZeroGPUService  # noqa: E402

# a visitor's token as the Space's proxy adds it (a JWT: the package reads its payload)
VISITOR = "x." + base64.urlsafe_b64encode(json.dumps({"user": "visitor"}).encode()).decode().rstrip("=") + ".y"
SHORT = "Hello there."
FRAMES = 5


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    from tests.live_server import tiny_checkpoint

    d = tmp_path_factory.mktemp("zerogpu")
    ck = tiny_checkpoint(d / "cv", kind="custom_voice", size="0b6", seed=0)
    svc = ZeroGPUService()
    with svc.running() as service_url:
        port = free_port()
        env = dict(os.environ, SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=service_url,
                   ZEROGPU_OFFLOAD_DIR=str(d / "offload"), ZEROGPU_MMAP_AUTOPRUNE_PATTERN=str(d / "no-such" / "*"),
                   TTS_MAX_NEW_TOKENS="48", PYTHONUNBUFFERED="1")
        log_path = d / "app.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "tests/zerogpu_launch.py", "--custom-voice-model", str(ck),
                                     "--base-model", "", "--voice-design-model", "", "--dtype", "fp32",
                                     "--host", "127.0.0.1", "--port", str(port), "--cache-dir", str(d / "cache")],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, "the app exited:\n" + log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "the app did not start:\n" + log_path.read_text()[-4000:]
                try:
                    if httpx.get(url + "/", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            from gradio_client import Client

            client = Client(url + "/", verbose=False, headers={"X-IP-Token": VISITOR})
            yield type("Space", (), dict(url=url, svc=svc, proc=proc, log=log_path, client=client))
        finally:
            # Gradio closes on SIGINT; under the package's stand-in device the process can linger past that (a
            # plain `python app.py` exits in ~1 s), so SIGTERM, then SIGKILL; the forked workers are ended below
            for sig, wait in ((signal.SIGINT, 5), (signal.SIGTERM, 5), (signal.SIGKILL, 10)):
                proc.send_signal(sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            for q in svc.of("/allow"):               # the forked workers, by the pids the package reported
                _kill(int(q["pid"]))


def _preset(client, text=SHORT, frames=FRAMES, live_token="", timeout=240):
    """Run /preset; -> (status lines seen while it ran, final outputs)."""
    job = client.submit(text=text, voice="ryan", max_new_tokens=frames, live_token=live_token, api_name="/preset")
    seen, t0 = [], time.monotonic()
    for out in job:
        seen.append(str(out[2]))
        assert time.monotonic() - t0 < timeout
    return seen, job.result(timeout=timeout)


def _worker_pids(space) -> list[int]:
    return [int(m) for m in re.findall(r"ZeroGPU call: .* in worker process (\d+)", space.log.read_text())]


def test_startup_packs_the_models_and_reports(space):
    assert space.svc.of("/startup-report"), "the package's start-up (in demo.launch) did not run"
    log = space.log.read_text()
    assert "custom_voice loaded" in log and "(cuda, fp32)" in log    # loaded at start-up, on the "cuda" device
    assert "ZeroGPU tensors packing" in log


def test_three_requests_in_a_row_run_in_the_gpu_worker_and_stream(space):
    n0, calls0 = len(space.svc.of("/schedule")), len(_worker_pids(space))
    for _ in range(3):
        seen, final = _preset(space.client)
        assert any(s.startswith("**Asking ZeroGPU for a GPU") for s in seen), seen
        assert any(s.startswith("**Streaming**") for s in seen), seen       # progress while audio is made
        assert final[2].startswith("**Done**"), final[2]
        wav, sr = sf.read(final[1])
        assert sr == 24000 and len(wav) > 0
    schedules = space.svc.of("/schedule")[n0:]
    assert len(schedules) == 3                                           # one GPU call per request
    for q in schedules:   # the GPU time asked for is computed from the request, not the package's fixed 60 s
        assert q.get("token") == VISITOR and 10 <= int(q["durationSeconds"]) < 60, q
    deadline = time.monotonic() + 30
    while len(_worker_pids(space)) < calls0 + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _worker_pids(space)[calls0:]
    allowed = {int(q["pid"]) for q in space.svc.of("/allow")}
    assert len(pids) == 3
    for pid in pids:    # generated in the package's forked worker, the process that asked the service for the GPU
        assert pid != space.proc.pid and pid in allowed
    assert all(q["fail"] == "false" for q in space.svc.of("/release")[-3:])


def test_the_page_player_route_gets_the_audio(space):
    token = secrets.token_urlsafe(16)
    got, status = bytearray(), {}

    def read():
        with httpx.stream("GET", f"{space.url}/live/{token}", params={"session": space.client.session_hash},
                          timeout=240) as r:
            status["code"] = r.status_code
            for b in r.iter_bytes():
                got.extend(b)

    t = threading.Thread(target=read)
    t.start()
    _, final = _preset(space.client, live_token=token)
    t.join(60)
    wav, _ = sf.read(final[1], dtype="int16")
    assert status["code"] == 200 and len(got) == 2 * len(wav) > 0       # the live stream carried the whole WAV
    assert bytes(got) == wav.astype("<i2").tobytes()


def test_a_refused_request_gives_a_clear_message_and_the_app_keeps_serving(space):
    from gradio_client.exceptions import AppError

    space.svc.refuse = 1
    with pytest.raises(AppError) as e:
        space.client.predict(text=SHORT, voice="ryan", max_new_tokens=FRAMES, api_name="/preset")
    msg = str(e.value)
    assert "quota" in msg and "Try again in 0:10:00" in msg and "try a shorter text" in msg, msg
    assert "Traceback" not in msg
    _, final = _preset(space.client)
    assert final[2].startswith("**Done**")


def test_stop_ends_the_gpu_call(space):
    releases = len(space.svc.of("/release"))
    text = " ".join(["This is a sentence that goes on for a while."] * 8)
    job = space.client.submit(text=text, voice="ryan", max_new_tokens=40, api_name="/preset")
    t0 = time.monotonic()
    while not any(str(o[2]).startswith("**Streaming**") for o in job.outputs()):
        assert time.monotonic() - t0 < 240 and not job.done(), job.outputs()
        time.sleep(0.1)
    assert len(space.svc.of("/release")) == releases                    # the call is still running
    space.client.predict(api_name="/stop")
    final = job.result(timeout=120)
    assert "stopped by the listener" in final[2], final[2]
    assert len(space.svc.of("/release")) == releases + 1                # the GPU was handed back
    assert time.monotonic() - t0 < 120
    _, final = _preset(space.client)                                     # the worker's engine is free again
    assert final[2].startswith("**Done**")


def test_a_blend_uses_the_start_up_embeddings_and_runs_on_the_gpu(space):
    calls0 = len(_worker_pids(space))
    out = space.client.predict(text=SHORT, n_voices=2, voice_1="ryan", voice_2="vivian", a_to_b=50,
                               max_new_tokens=FRAMES, api_name="/blend")
    assert out[2].startswith("**Done**") and "blend: 50 % Ryan" in out[2], out[2]
    assert sf.read(out[1])[0].size > 0
    deadline = time.monotonic() + 30
    while len(_worker_pids(space)) == calls0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_worker_pids(space)) == calls0 + 1    # the blended voice (an embedding) was sent to the worker


def test_the_v1_api_answers_503_with_the_reason(space):
    r = httpx.post(f"{space.url}/v1/audio/speech", json={"input": "Hi", "voice": "ryan"}, timeout=30)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "unavailable_on_zerogpu" and "ZeroGPU" in err["message"]
    assert httpx.get(f"{space.url}/live/player.js", timeout=30).status_code == 200
    assert "live/player.js" in httpx.get(space.url + "/", timeout=30).text


# --- the pure parts ---------------------------------------------------------------------------------------------

def test_gpu_time_follows_the_request():
    from ui.zerogpu import MAX_DURATION_S, MIN_DURATION_S, gpu_seconds

    short, long = ["Hi."], ["This is a much longer sentence, with a few clauses, that takes a while to say."] * 4
    assert gpu_seconds(short, 2048, 0.05) == MIN_DURATION_S
    assert MIN_DURATION_S < gpu_seconds(long, 2048, 0.05) < gpu_seconds(long, 2048, 0.1) <= MAX_DURATION_S
    assert gpu_seconds(long, 20, 0.1) < gpu_seconds(long, 2048, 0.1)     # capped by the maximum frames
    assert gpu_seconds(long * 50, 2048, 1.0) == MAX_DURATION_S


def test_zerogpu_refusals_are_explained():
    import gradio as gr

    from ui.zerogpu import explain

    q = explain(gr.Error("You have exceeded your free ZeroGPU quota (12s requested vs. 0s left). Try again in "
                         "0:10:00. ", title="ZeroGPU quota exceeded"))
    assert "Try again in 0:10:00" in q.message and "shorter text" in q.message
    assert "try again in a moment" in explain(gr.Error("No GPU was available", title="ZeroGPU client error")).message
    assert "ran out of its GPU time" in explain(gr.Error("GPU task aborted", title="ZeroGPU worker error")).message


def test_off_zerogpu_the_package_changes_nothing():
    import inspect

    from ui import zerogpu

    assert os.environ.get("SPACES_ZERO_GPU") is None and not zerogpu.enabled()
    assert inspect.isgeneratorfunction(zerogpu.gpu_generate)            # spaces.GPU returned it unchanged
    assert not hasattr(zerogpu.gpu_generate, "zerogpu")


# --- the glue, off ZeroGPU (spaces.GPU returns the functions unchanged): one call, its parts, stop, errors ---------

@pytest.fixture(scope="module")
def driven_engine(tmp_path_factory):
    from tts_engine import TTSEngine
    from tests.live_server import tiny_checkpoint
    from ui import zerogpu

    ck = tiny_checkpoint(tmp_path_factory.mktemp("glue") / "cv", kind="custom_voice", size="0b6", seed=0)
    eng = TTSEngine.from_pretrained(str(ck), device="cpu", dtype="fp32", max_batch=2)
    eng.drive_in_caller()
    zerogpu._ENGINES["custom_voice"] = eng
    yield eng
    zerogpu._ENGINES.pop("custom_voice", None)
    eng.close()


def test_one_gpu_call_speaks_every_part_in_order(driven_engine):
    import numpy as np

    from ui.zerogpu import GPUCall

    texts = ["First sentence here.", "Second one.", "And the third."]
    kw = dict(voice="ryan", seed=5, max_new_tokens=6, first_chunk_frames=1)
    call = GPUCall("custom_voice", texts)
    streams = [call.stream(t, **kw) for t in texts]
    parts = [np.concatenate(list(s)) for s in streams]
    for t, p in zip(texts, parts):          # each part is what the engine makes for that text alone
        np.testing.assert_allclose(p, driven_engine.synthesize(t, **kw), atol=1e-4)
    assert driven_engine.scheduler.idle()
    with pytest.raises(RuntimeError):
        call.stream("out of order", **kw)


def test_stopping_a_gpu_call_frees_the_engine_and_errors_are_readable(driven_engine):
    from tts_engine import TTSError
    from ui.zerogpu import GPUCall

    texts = ["One sentence that is long enough to take a while.", "Two."]
    call = GPUCall("custom_voice", texts)
    s = call.stream(texts[0], voice="ryan", seed=1, max_new_tokens=40, first_chunk_frames=1)
    next(s)
    s.cancel()                               # Stop: the worker's generator is closed, its requests leave
    assert driven_engine.scheduler.idle() and list(s) == []
    bad = GPUCall("custom_voice", ["Hello."]).stream("Hello.", voice="nobody", seed=1, max_new_tokens=4)
    with pytest.raises(TTSError, match="unknown speaker"):
        next(bad)


def test_a_clone_is_its_own_gpu_call_and_returns_a_cpu_voice(tmp_path):
    from tts_engine import TTSEngine, TTSError
    from tests.live_server import tiny_checkpoint
    from ui import zerogpu

    ck = tiny_checkpoint(tmp_path / "base", kind="base", size="0b6", seed=0)
    eng = TTSEngine.from_pretrained(str(ck), device="cpu", dtype="fp32")
    eng.drive_in_caller()
    zerogpu._ENGINES["base"] = eng
    try:
        main_side = zerogpu.MainProcessEngine("base", eng, {})
        clip = ROOT / "presets" / "oliver.flac"
        v = main_side.clone_voice(str(clip), ref_text="Good morning.", name="Me")
        assert v.kind == "icl" and v.embedding.device.type == "cpu" and v.ref_codes.device.type == "cpu"
        x = main_side.clone_voice(str(clip), x_vector_only=True)
        assert x.kind == "xvector" and x.ref_codes is None
        with pytest.raises(TTSError, match="transcript"):
            main_side.clone_voice(str(clip))
    finally:
        zerogpu._ENGINES.pop("base", None)
        eng.close()


def test_each_worker_process_takes_the_gpu_paths_once_per_role(driven_engine, monkeypatch):
    """A worker's first call asks the engine for its GPU paths (`TTSEngine.warm_gpu`), later calls in the same process
    do not; another process (a fresh worker) asks again. Off a real GPU `warm_gpu` changes nothing."""
    import os

    from ui import zerogpu

    before = driven_engine.paths()
    asked = []
    real = driven_engine.warm_gpu
    monkeypatch.setattr(driven_engine, "warm_gpu", lambda: (asked.append(os.getpid()), real())[1])
    monkeypatch.setattr(zerogpu, "_WARM", {})
    kw = dict(voice="ryan", seed=2, max_new_tokens=4, first_chunk_frames=1)
    for _ in range(2):
        list(zerogpu.GPUCall("custom_voice", ["Hello."]).stream("Hello.", **kw))
    assert asked == [os.getpid()]
    monkeypatch.setitem(zerogpu._WARM, "custom_voice", -1)            # as if another worker had taken them
    list(zerogpu.GPUCall("custom_voice", ["Hello."]).stream("Hello.", **kw))
    assert asked == [os.getpid(), os.getpid()]
    assert driven_engine.runner.graphs is None and driven_engine.paths()["frame"] == before["frame"]


def test_zerogpu_loads_engines_without_fast_paths():
    """The main process has only the package's stand-in device: no backend attach and no graphs at load."""
    from ui.config import AppConfig
    from ui import zerogpu

    cfg = AppConfig()
    zerogpu.configure(cfg)
    kw = cfg.engine_kw()
    assert kw["fast_paths"] is False and kw["use_cuda_graphs"] is False and kw["max_batch"] == 2
