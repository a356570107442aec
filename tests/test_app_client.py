"""The launched app driven by gradio_client on loopback: preset, clone and blend stream their audio (chunks arrive
before the final result), the final result is a lossless WAV, and bad input comes back as a readable error."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import soundfile as sf

from live_server import tiny_gradio_app

ROOT = Path(__file__).resolve().parent.parent
OLIVER = ROOT / "presets" / "oliver.flac"
OLIVER_TEXT = "Good morning. I hope you slept well, because today we have a great deal of work to do."

# Gradio's streaming gr.Audio (the `live` output) needs ffmpeg; without it the endpoints still stream their
# status updates and end with the WAV, and `live` stays empty. Both ways are checked (whichever this machine has).
FFMPEG = shutil.which("ffmpeg") is not None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_gradio_app(tmp_path_factory.mktemp("client_ckpts"), max_text_chars=500) as served:
        yield served


def _run(client, api_name: str, timeout: float = 120, **kwargs):
    """Submit, iterate the streamed updates with a deadline; -> (updates with arrival times, final result)."""
    kwargs.setdefault("max_new_tokens", 24)
    t0 = time.monotonic()
    job = client.submit(api_name=api_name, **kwargs)
    updates = []
    for out in job:
        updates.append((time.monotonic() - t0, out))
        assert time.monotonic() - t0 < timeout, f"{api_name} took too long"
    final = job.result(timeout=timeout)
    return updates, final, time.monotonic() - t0


def _is_file(v, suffix):
    return isinstance(v, str) and v.endswith(suffix)


def _streaming(out) -> bool:
    """An update sent while audio is being generated: a live chunk (with ffmpeg) or a "Streaming" status."""
    return _is_file(out[0], ".m3u8") if FFMPEG else str(out[2]).startswith("**Streaming**")


def _check_streamed(updates, final, t_end):
    """Progress comes before the output that carries the WAV: live chunks (HLS playlists of Gradio's streaming
    player) where ffmpeg is installed, else "Streaming" status updates while `live` stays empty."""
    wav = [i for i, (_, out) in enumerate(updates) if _is_file(out[1], ".wav")]
    if not FFMPEG:
        streaming = [i for i, (_, out) in enumerate(updates) if _streaming(out)]
        assert len(streaming) >= 2, "status updates should arrive while the audio is generated"
        assert wav and streaming[0] < wav[0], "progress must arrive before the final result"
        # no ffmpeg: `live` is never sent audio (gradio_client sees None or an empty update, never a file)
        assert not any(isinstance(out[0], str) for _, out in updates) and not isinstance(final[0], str)
        info = sf.info(final[1])
        assert info.samplerate == 24000 and info.subtype == "PCM_16" and info.frames > 0   # lossless 16-bit WAV
        assert "Done" in final[2] and "first audio" in final[2] and "RTF" in final[2]
        return info
    live = [i for i, (_, out) in enumerate(updates) if _is_file(out[0], ".m3u8")]
    assert live, "no streamed audio chunk was received"
    assert len(live) >= 2, "the audio should arrive in several chunks"
    assert wav and live[0] < wav[0], "streamed chunks must arrive before the final result"
    assert updates[live[0]][0] < t_end
    assert _is_file(final[1], ".wav")
    info = sf.info(final[1])
    assert info.samplerate == 24000 and info.subtype == "PCM_16" and info.frames > 0   # lossless 16-bit WAV
    assert "Done" in final[2] and "first audio" in final[2] and "RTF" in final[2]
    # no gaps at chunk joins: the streamed HLS segments add up to the WAV's length (Gradio < 6.27 added ~68 ms
    # of AAC priming silence per chunk)
    playlist = Path(updates[live[-1]][1][0]).read_text()
    streamed = sum(float(line.split(":")[1].rstrip(",")) for line in playlist.splitlines()
                   if line.startswith("#EXTINF:"))
    wav_s = info.frames / info.samplerate
    assert streamed <= wav_s + 0.2, f"streamed {streamed:.2f} s for {wav_s:.2f} s of audio: gaps at chunk joins"
    if "#EXT-X-ENDLIST" in playlist:
        assert streamed >= wav_s - 0.2
    return info


def test_preset_streams_over_the_api(served):
    app, client = served
    updates, final, t = _run(client, "/preset", text="Hello from the API. Second sentence.", voice="ryan",
                             language="english", seed=11, randomize=False)
    _check_streamed(updates, final, t)
    assert final[3] == 11 and "seed 11" in final[2]
    # the API lists documented endpoints
    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/preset", "/clone", "/blend", "/blend_sweep", "/blend_export", "/load_voice", "/stop"} <= set(api)
    assert "voice" in [p["parameter_name"] for p in api["/preset"]["parameters"]]


def test_clone_then_blend_with_the_clone_over_the_api(served):
    pytest.importorskip("tts_engine.voices.speaker_encoder", reason="speaker encoder not written yet")
    pytest.importorskip("tts_engine.codec.encoder", reason="codec encoder not written yet")
    from gradio_client import handle_file

    from tts_engine.voices.voice import Voice

    app, client = served
    updates, final, t = _run(client, "/clone", ref_audio=handle_file(str(OLIVER)), ref_text=OLIVER_TEXT,
                             x_vector_only=False, voice_name="Ollie", file_format="safetensors",
                             text="This is my cloned voice.", language="english", seed=3, randomize=False)
    _check_streamed(updates, final, t)
    vfile = final[4]
    assert _is_file(vfile, ".safetensors") and Voice.load(vfile).kind == "icl"
    # blend: the session clone ("my:Ollie", same client session) with a preset clip of the same Base model
    updates, final, t = _run(client, "/blend", text="Half me, half Emma.", n_voices=2, voice_1="my:Ollie",
                             voice_2="preset:emma", a_to_b=50, seed=5, randomize=False)
    _check_streamed(updates, final, t)
    assert "blend: 50 % Ollie + 50 % Emma" in final[2]
    # blend of two CustomVoice speakers plus an uploaded voice file (exported from a blend)
    export = client.predict(n_voices=2, voice_1="ryan", voice_2="vivian", a_to_b=25, blend_name="RyVi",
                            file_format="json", api_name="/blend_export")
    assert _is_file(export[0], ".json")
    updates, final, t = _run(client, "/blend", text="Three voices.", n_voices=3, voice_1="ryan", weight_1=1,
                             voice_2="file", file_2=handle_file(export[0]), weight_2=1, voice_3="aiden", weight_3=2,
                             seed=5, randomize=False)
    _check_streamed(updates, final, t)
    assert "25 % Ryan" in final[2] and "50 % Aiden" in final[2]


def test_sweep_over_the_api(served):
    app, client = served
    res = client.predict(text="One sentence for all five.", n_voices=2, voice_1="ryan", voice_2="aiden",
                         seed=2, randomize=False, max_new_tokens=24, api_name="/blend_sweep")
    wavs = res[:5]
    assert all(_is_file(w, ".wav") for w in wavs)
    assert "Sweep done" in res[6] and res[7] == 2


def test_bad_input_is_a_readable_error_and_the_app_keeps_serving(served):
    from gradio_client.exceptions import AppError

    app, client = served
    with pytest.raises(AppError, match="Enter some text"):
        client.predict(text="  ", voice="ryan", api_name="/preset")
    with pytest.raises(AppError, match="different checkpoints"):
        client.predict(text="Hi.", n_voices=2, voice_1="ryan", voice_2="preset:emma", api_name="/blend")
    with pytest.raises(AppError, match="Unknown voice"):
        client.predict(text="Hi.", voice="nobody", api_name="/preset")
    updates, final, t = _run(client, "/preset", text="Still serving.", voice="vivian")
    _check_streamed(updates, final, t)


def test_stop_cancels_and_frees_the_engine_slot(served, monkeypatch):
    from serving.take_guard import TakeGuard

    app, client = served
    eng = app.engine("custom_voice")
    # long takes: no take guard, whose runaway bound would end these short texts' random-weight takes in seconds
    monkeypatch.setattr(app, "take_guard", TakeGuard(enabled=False))

    def wait_idle():
        deadline = time.monotonic() + 20
        while not eng.scheduler.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        return eng.scheduler.idle()

    # 1) the page's Stop handler: cancels this session's engine request; the generation ends early
    job = client.submit(text="A long one.", voice="ryan", max_new_tokens=600, api_name="/preset")
    t0 = time.monotonic()
    while sum(1 for o in job.outputs() if _streaming(o)) < 2:
        assert time.monotonic() - t0 < 60, "no audio streamed"
        time.sleep(0.05)
    assert eng.scheduler.running, "the request runs in the engine"
    assert "1 request(s) cancelled" in client.predict(api_name="/stop")
    final = job.result(timeout=60)
    assert wait_idle(), "the engine slot is free again"
    assert sf.info(final[1]).frames < 599 * 1920, "generation stopped early"
    # 2) cancelling the event itself (what `cancels=` does in the page) also releases the engine request
    job = client.submit(text="Another long one.", voice="ryan", max_new_tokens=600, api_name="/preset")
    t0 = time.monotonic()
    while sum(1 for o in job.outputs() if _streaming(o)) < 2:
        assert time.monotonic() - t0 < 60, "no audio streamed"
        time.sleep(0.05)
    job.cancel()
    assert wait_idle(), "the engine slot is free again after cancelling the event"
    assert not app.active.by_session
