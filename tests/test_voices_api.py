"""Uploaded voices (POST / GET / DELETE /v1/audio/voices, vLLM-Omni's endpoints) and the reference cache behind
/v1/audio/speech, against a real server on loopback (tiny checkpoints).

Expectations from vLLM-Omni's docs/serving/speech_api.md ("Voices Endpoint"): the upload form fields
(audio_sample, consent, name, ref_text, speaker_description), `{"success": true, "voice": {...}}`, `uploaded_voices`
in the list, `voice: "<name>"` selecting Base, DELETE -> `{"success": true, "message": ...}` and 404 for an unknown
name, 400 past the upload cap. Ours on top: owner tokens (403), 409 for a preset's name, 413 for a large clip."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from serving.limits import Limits
from serving.voice_store import StoreLimits, VoiceStore
from tests.live_server import tiny_api
from tests.encoder_calls import count_encoders

ADMIN = "admin-secret"


def _wav_bytes(freq=200.0, seconds=1.0, sr=24000) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("voices_api")
    limits = Limits(max_text_chars=300, max_new_tokens=8, max_per_client=8)
    voices = {"folder": root / "store", "admin_key": ADMIN,
              "limits": StoreLimits(max_voices=4, max_clip_bytes=200_000)}
    with tiny_api(root, ("custom_voice", "base"), limits, voices=voices) as (url, registry, _):
        yield url, registry, root / "store"


def upload(url, name, *, token=None, admin=None, clip=None, ref_text="A tone.", **fields):
    headers = {}
    if token:
        headers["X-Voice-Owner-Token"] = token
    if admin:
        headers["Authorization"] = f"Bearer {admin}"
    data = {"name": name, "consent": "consent-123", "ref_text": ref_text, **fields}
    files = {"audio_sample": ("clip.wav", clip if clip is not None else _wav_bytes(), "audio/wav")}
    return httpx.post(f"{url}/v1/audio/voices", data=data, files=files, headers=headers, timeout=120)


def delete(url, name, *, token=None, admin=None):
    headers = {}
    if token:
        headers["X-Voice-Owner-Token"] = token
    if admin:
        headers["X-Admin-Key"] = admin
    return httpx.delete(f"{url}/v1/audio/voices/{name}", headers=headers, timeout=30)


def _clean(registry):
    for n in registry.uploaded.names():
        registry.uploaded.delete(n, None, admin=True)


def test_upload_list_speak_delete(server):
    url, registry, _ = server
    _clean(registry)
    r = upload(url, "Narrator One", speaker_description="warm narrator")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True
    v = body["voice"]
    assert v["name"] == "Narrator One" and v["consent"] == "consent-123" and v["ref_text"] == "A tone."
    assert v["speaker_description"] == "warm narrator" and v["mime_type"] == "audio/wav" and v["file_size"] > 0
    assert isinstance(v["created_at"], int) and v["owner_token"]
    assert r.headers["x-voice-owner-token"] == v["owner_token"]

    listed = httpx.get(f"{url}/v1/audio/voices").json()
    assert "Narrator One" in listed["voices"] and "ryan" in listed["voices"]
    up = [u for u in listed["uploaded_voices"] if u["name"] == "Narrator One"]
    assert up and "owner_token" not in up[0] and "owner_sha256" not in up[0]

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    out = client.audio.speech.create(model="tts", voice="narrator one", input="Hello from an uploaded voice.",
                                     response_format="wav")
    wav, sr = sf.read(io.BytesIO(out.content))
    assert sr == 24000 and len(wav) > 0

    r = delete(url, "Narrator One", token=v["owner_token"])
    assert r.status_code == 200
    assert r.json()["success"] is True and r.json()["message"] == "Voice 'Narrator One' deleted successfully"
    assert "Narrator One" not in httpx.get(f"{url}/v1/audio/voices").json()["voices"]
    r = delete(url, "Narrator One", token=v["owner_token"])
    assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts", voice="Narrator One", input="Gone.")


def test_x_vector_upload_without_transcript(server):
    url, registry, _ = server
    _clean(registry)
    r = upload(url, "plain", ref_text="")
    assert r.status_code == 200, r.text
    assert "ref_text" not in r.json()["voice"] and r.json()["voice"]["mode"] == "x_vector"
    assert registry.uploaded.get("plain").kind == "xvector"


def test_one_client_cannot_delete_or_overwrite_anothers_voice(server):
    url, registry, _ = server
    _clean(registry)
    mine = upload(url, "mine", token="alice-token")
    assert mine.status_code == 200 and mine.json()["voice"]["owner_token"] == "alice-token"
    for token in (None, "bob-token"):
        r = delete(url, "mine", token=token)
        assert r.status_code == 403 and r.json()["error"]["code"] == "voice_not_owned"
        r = upload(url, "MINE", token=token, ref_text="Overwritten.")
        assert r.status_code == 403
    assert registry.uploaded.get("mine").ref_text == "A tone."
    r = delete(url, "mine", admin="wrong-key")
    assert r.status_code == 403
    # the owner may replace it; the admin may delete it
    r = upload(url, "mine", token="alice-token", ref_text="Replaced.")
    assert r.status_code == 200 and registry.uploaded.get("mine").ref_text == "Replaced."
    assert delete(url, "mine", admin=ADMIN).status_code == 200
    assert registry.uploaded.get("mine") is None


def test_admin_may_overwrite(server):
    url, registry, _ = server
    _clean(registry)
    assert upload(url, "shared", token="alice-token").status_code == 200
    r = upload(url, "shared", admin=ADMIN, ref_text="By the admin.")
    assert r.status_code == 200 and registry.uploaded.get("shared").ref_text == "By the admin."
    assert delete(url, "shared", token="alice-token").status_code == 403   # ownership moved with the new upload
    assert delete(url, "shared", token=r.json()["voice"]["owner_token"]).status_code == 200


@pytest.mark.parametrize("name,fields,clip,status,text", [
    ("../etc", {}, None, 400, "invalid voice name"),
    ("a/b", {}, None, 400, "invalid voice name"),
    ("x" * 80, {}, None, 400, "invalid voice name"),
    ("", {}, None, 400, "invalid voice name"),
    ("ryan", {}, None, 409, "preset voice"),
    ("big", {}, b"RIFF" + b"\0" * 300_000, 413, "larger than"),
    ("junk", {}, b"not audio at all", 400, "not a readable audio"),
    ("silent", {}, "silence", 400, "silent"),
    ("long text", {"ref_text": "x" * 1200}, None, 400, "ref_text is too long"),
])
def test_bad_uploads_get_clear_4xx(server, name, fields, clip, status, text):
    url, registry, _ = server
    if clip == "silence":
        buf = io.BytesIO()
        sf.write(buf, np.zeros(24000, np.float32), 24000, format="WAV")
        clip = buf.getvalue()
    r = upload(url, name, clip=clip, **fields)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and set(err) >= {"message", "type", "param", "code"}


def test_missing_file_is_a_400(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/audio/voices", data={"name": "nofile", "consent": "c"}, timeout=30)
    assert r.status_code == 400 and "audio_sample" in r.json()["error"]["message"]


def test_number_of_voices_is_capped(server):
    url, registry, _ = server
    _clean(registry)
    for i in range(4):
        assert upload(url, f"v{i}", token="t").status_code == 200
    r = upload(url, "v4", token="t")
    assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]
    assert upload(url, "v0", token="t", ref_text="Replacing is not a new voice.").status_code == 200
    _clean(registry)


def test_voices_survive_a_restart(server, tmp_path):
    url, registry, folder = server
    _clean(registry)
    r = upload(url, "Keeper", token="keeper-token", speaker_description="kept")
    assert r.status_code == 200
    files = list(folder.glob("*.safetensors"))
    assert len(files) == 1 and "Keeper" not in files[0].name       # the name never reaches the file system
    assert files[0].read_bytes()[:1] != b"\x80"                     # not a pickle
    # a new server instance on the same data folder
    limits = Limits(max_text_chars=300, max_new_tokens=8)
    with tiny_api(tmp_path, ("base",), limits, voices={"folder": folder}) as (url2, registry2, _):
        listed = httpx.get(f"{url2}/v1/audio/voices").json()
        assert [u["name"] for u in listed["uploaded_voices"]] == ["Keeper"]
        assert listed["uploaded_voices"][0]["speaker_description"] == "kept"
        r = httpx.post(f"{url2}/v1/audio/speech", json={"input": "Still here.", "voice": "Keeper"}, timeout=120)
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        assert delete(url2, "Keeper", token="wrong").status_code == 403    # ownership survives too
        assert delete(url2, "Keeper", token="keeper-token").status_code == 200
    assert not list(folder.glob("*.safetensors"))
    assert VoiceStore(folder).names() == []


def test_a_store_skips_files_it_cannot_read(tmp_path):
    (tmp_path / "garbage.safetensors").write_bytes(b"\x80\x04not a voice")
    assert VoiceStore(tmp_path).names() == []


def test_repeated_clone_request_hits_the_reference_cache(server, monkeypatch):
    url, registry, _ = server
    engine = registry.get("base")
    engine.reference_cache.clear()
    calls = count_encoders(engine, monkeypatch)
    ref = "data:audio/wav;base64," + base64.b64encode(_wav_bytes(freq=310.0)).decode()
    body = {"input": "Cloned twice.", "task_type": "Base", "ref_audio": ref, "ref_text": "A tone.",
            "language": "english", "seed": 1}
    for _ in range(3):
        r = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=120)
        assert r.status_code == 200, r.text
    assert calls == {"speaker": 1, "codec": 1}
    r = httpx.post(f"{url}/v1/audio/speech", json=dict(body, x_vector_only_mode=True), timeout=120)
    assert r.status_code == 200 and calls == {"speaker": 2, "codec": 1}      # another mode, another entry
    # an uploaded voice is used without any encoder at all
    _clean(registry)
    assert upload(url, "cached", token="t").status_code == 200
    before = dict(calls)
    r = httpx.post(f"{url}/v1/audio/speech", json={"input": "No encoders.", "voice": "cached"}, timeout=120)
    assert r.status_code == 200 and calls == before
    _clean(registry)


def test_the_openai_client_uploads_uses_and_deletes_a_voice(server):
    url, registry, _ = server
    _clean(registry)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    if not hasattr(client.audio, "voices"):
        pytest.skip(f"openai {openai.__version__} has no audio.voices (newer clients do)")
    v = client.audio.voices.create(audio_sample=("me.wav", _wav_bytes(240.0), "audio/wav"), consent="cons_1",
                                   name="From OpenAI", extra_body={"ref_text": "A tone."},
                                   extra_headers={"X-Voice-Owner-Token": "openai-owner"})
    assert v.id == "From OpenAI" and v.object == "audio.voice" and v.type == "audio_sample"
    assert v.owner_token == "openai-owner" and isinstance(v.created_at, int)
    assert registry.uploaded.get("From OpenAI").ref_text == "A tone."
    out = client.audio.speech.create(model="tts", voice=v.id, input="Spoken by an uploaded voice.")
    assert sf.read(io.BytesIO(out.content))[1] == 24000
    with pytest.raises(openai.PermissionDeniedError):
        client.audio.voices.delete(v.id)
    gone = client.audio.voices.delete(v.id, extra_headers={"X-Voice-Owner-Token": "openai-owner"})
    assert gone.deleted is True and gone.id == "From OpenAI"
    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete(v.id, extra_headers={"X-Voice-Owner-Token": "openai-owner"})


def test_a_voice_made_for_another_width_is_cloned_again_from_its_clip(server):
    import torch

    from tts_engine.voices.voice import Voice

    url, registry, _ = server
    _clean(registry)
    wav, _ = sf.read(io.BytesIO(_wav_bytes(150.0)), dtype="float32")
    pcm = torch.from_numpy((wav * 32767).astype(np.int16))
    other = Voice(kind="xvector", embedding=torch.randn(32), hidden_size=32, ref_audio=pcm, ref_sr=24000)
    registry.uploaded.add("wide", other, {"consent": "c"}, owner_token="t")
    bare = Voice(kind="xvector", embedding=torch.randn(32), hidden_size=32)
    registry.uploaded.add("bare", bare, {"consent": "c"}, owner_token="t")
    r = httpx.post(f"{url}/v1/audio/speech", json={"input": "Refitted.", "voice": "wide"}, timeout=120)
    assert r.status_code == 200 and r.content[:4] == b"RIFF"
    r = httpx.post(f"{url}/v1/audio/speech", json={"input": "No clip kept.", "voice": "bare"}, timeout=120)
    assert r.status_code == 400 and "needs 64" in r.json()["error"]["message"]
    _clean(registry)


# --- transcribe_ref_audio: the clip's transcript written by the speech-recognition model ------------------------

# (the `whisper_dir` and `asr_env` fixtures live in tests/conftest.py)


def test_upload_transcribed_by_asr_is_an_icl_voice(server, asr_env):
    url, registry, _ = server
    _clean(registry)
    clip = _wav_bytes(freq=330.0)
    wav, sr = sf.read(io.BytesIO(clip), dtype="float32")
    words = asr_env.shared().transcribe(wav, sr).text           # what the app's transcriber gives for the clip
    asr_env._shared.clear()
    assert words
    r = upload(url, "heard", ref_text="", clip=clip, transcribe_ref_audio="true")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ref_text_asr"] == words and any("transcribed" in n for n in body["notices"])
    v = body["voice"]
    assert v["mode"] == "icl" and v["ref_text"] == words and v["ref_text_source"] == "asr"
    stored = registry.uploaded.get("heard")
    assert stored.kind == "icl" and stored.ref_text == words
    assert any(t.loaded for t in asr_env._shared.values())
    listed = httpx.get(f"{url}/v1/audio/voices", timeout=30).json()["uploaded_voices"]
    assert [u["ref_text_source"] for u in listed if u["name"] == "heard"] == ["asr"]


def test_upload_with_transcript_or_not_asked_never_loads_the_asr(server, asr_env):
    url, registry, _ = server
    _clean(registry)
    r = upload(url, "typed", ref_text="A tone.", transcribe_ref_audio="true")    # a typed transcript wins
    assert r.status_code == 200, r.text
    assert r.json()["voice"]["ref_text"] == "A tone." and "ref_text_source" not in r.json()["voice"]
    assert registry.uploaded.get("typed").kind == "icl"
    r = upload(url, "unasked", ref_text="")                                      # not asked: x-vector, as before
    assert r.status_code == 200 and r.json()["voice"]["mode"] == "x_vector" and "ref_text_asr" not in r.json()
    r = upload(url, "xv", ref_text="", transcribe_ref_audio="true", x_vector_only_mode="true")
    assert r.status_code == 200 and r.json()["voice"]["mode"] == "x_vector"
    assert not asr_env._shared                                  # no transcriber made, let alone loaded


def test_upload_without_the_asr_model_falls_back_to_x_vector_with_a_notice(server, asr_env, tmp_path,
                                                                             monkeypatch):
    url, registry, _ = server
    _clean(registry)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TTS_ASR_MODEL", str(tmp_path / "not-downloaded"))
    r = upload(url, "unheard", ref_text="", transcribe_ref_audio="true")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["voice"]["mode"] == "x_vector" and "ref_text" not in body["voice"] and body["ref_text_asr"] is None
    assert any("not available" in n and "x-vector" in n for n in body["notices"])
    assert registry.uploaded.get("unheard").kind == "xvector"
