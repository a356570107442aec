"""Uploaded-voice endpoints, as vLLM-Omni serves them (docs/serving/speech_api.md, "Voices Endpoint"):

  POST   /v1/audio/voices          multipart: audio_sample (file; `audio` also accepted), name, consent,
                                   ref_text (`transcript`), speaker_description (`description`),
                                   x_vector_only_mode, transcribe_ref_audio (no ref_text: Whisper writes it;
                                   `ref_text_asr` and `notices` in the answer)
                                   -> {"success": true, "voice": {...,"owner_token"}} plus
                                   OpenAI's voice object fields (id = name, object, created_at, type)
  DELETE /v1/audio/voices/{name}   -> {"success": true, "message": "Voice 'x' deleted successfully"} plus
                                   OpenAI's {id, deleted, object}
  GET    /v1/audio/voices          (server/openai_api.py) lists them too: `uploaded_voices`, and their names in
                                   `voices` and `data` (see `listing`)

An uploaded voice is a Base-checkpoint clone (see serving/voice_store.py for storage and ownership); `voice:
"<name>"` in /v1/audio/speech uses it (`find`, `voice_for`).
"""
from __future__ import annotations

import mimetypes

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse

from tts_engine import TTSError

from serving.limits import Limits
from serving.reference import prepare_reference, transcribe_reference
from serving.registry import EngineRegistry
from serving.voice_store import VoiceStore, VoiceStoreError, keep_clip, store_of

OWNER_HEADER = "x-voice-owner-token"


def listing(registry, precision: dict | None = None) -> tuple[list[dict], list[dict]]:
    """(entries for `data`, entries for `uploaded_voices`) of GET /v1/audio/voices."""
    store = store_of(registry)
    if store is None:
        return [], []
    uploaded = store.list()
    data = [{"id": u["name"], "name": u["name"], "model": registry.checkpoints.get("base"), "task_type": "Base",
             "uploaded": True, **(precision or {})} for u in uploaded]
    return data, uploaded


def _admin(request: Request, store: VoiceStore) -> bool:
    key = request.headers.get("x-admin-key")
    auth = request.headers.get("authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return store.is_admin(key)


def _error(e: VoiceStoreError) -> JSONResponse:
    return JSONResponse({"success": False, "error": {"message": str(e), "type": "invalid_request_error",
                                                     "param": e.param, "code": e.code}}, status_code=e.status)


def install(app: FastAPI, registry: EngineRegistry, limits: Limits) -> VoiceStore:
    """Add the upload and delete routes; the registry's `uploaded` store is made from the environment when it has
    none (TTS_VOICES_DIR, TTS_ADMIN_KEY, TTS_MAX_UPLOADED_VOICES, TTS_MAX_VOICE_CLIP_BYTES)."""
    if store_of(registry) is None:
        registry.uploaded = VoiceStore()
    store = registry.uploaded

    @app.exception_handler(VoiceStoreError)
    async def _store_error(_: Request, e: VoiceStoreError):
        return _error(e)

    def preset_names() -> set[str]:
        names = {n.lower() for n in registry.voices.names()}
        if registry.configured("custom_voice"):
            try:
                names |= {s.lower() for s in registry.get("custom_voice").speakers}
            except TTSError:
                pass
        return names

    @app.post("/v1/audio/voices")
    def upload_voice(request: Request, name: str = Form(""), audio_sample: UploadFile | None = File(None),
                     audio: UploadFile | None = File(None), consent: str = Form(""), ref_text: str = Form(""),
                     transcript: str = Form(""), speaker_description: str = Form(""), description: str = Form(""),
                     x_vector_only_mode: bool = Form(False), transcribe_ref_audio: bool = Form(False)):
        upload = audio_sample or audio
        if upload is None:
            raise VoiceStoreError(400, "send the voice's clip as the multipart file `audio_sample`",
                                  param="audio_sample")
        token = request.headers.get(OWNER_HEADER) or None
        admin = _admin(request, store)
        name = store.check_may_write(name, token, admin)          # 400 bad name, 403 someone else's
        if name.lower() in preset_names():
            raise VoiceStoreError(409, f"{name!r} is the name of a preset voice of this server; choose another",
                                  param="name", code="voice_name_taken")
        text = (ref_text or transcript or "").strip()
        desc = (speaker_description or description or "").strip()
        lim = store.limits
        for field, value, most in (("ref_text", text, lim.max_ref_text_chars),
                                   ("speaker_description", desc, lim.max_description_chars),
                                   ("consent", consent, lim.max_consent_chars)):
            if len(value) > most:
                raise VoiceStoreError(400, f"{field} is too long: {len(value)} characters, the limit is {most}",
                                      param=field)
        data = upload.file.read(lim.max_clip_bytes + 1)
        if len(data) > lim.max_clip_bytes:
            raise VoiceStoreError(413, f"the audio sample is larger than {lim.max_clip_bytes / 2**20:g} MiB",
                                  param="audio_sample", code="file_too_large")
        if not data:
            raise VoiceStoreError(400, "the audio sample is empty", param="audio_sample")
        if not registry.configured("base"):
            raise VoiceStoreError(400, "uploaded voices are clones: this server has no Base checkpoint",
                                  param="name", code="base_model_missing")
        try:
            engine = registry.get("base")
            (wav, sr), notices = prepare_reference(data, limits)
            asr_text = None
            if transcribe_ref_audio and not x_vector_only_mode and not text:   # only then is Whisper loaded
                asr_text, asr_notices = transcribe_reference((wav, sr), getattr(registry, "device", None))
                notices += asr_notices
                text = asr_text = (asr_text or "")[: lim.max_ref_text_chars]
            xvec = bool(x_vector_only_mode) or not text
            voice = engine.clone_voice((wav, sr), ref_text=None if xvec else text, x_vector_only=xvec, name=name)
        except TTSError as e:
            raise VoiceStoreError(400, str(e), param="audio_sample") from None
        keep_clip(voice, wav, sr)   # to clone it again for another Base checkpoint
        mime = upload.content_type or mimetypes.guess_type(upload.filename or "")[0] or "application/octet-stream"
        meta = {"consent": consent, "file_size": len(data), "mime_type": mime, "ref_text": None if xvec else text,
                "speaker_description": desc or None, "mode": "x_vector" if xvec else "icl",
                "model": registry.checkpoints.get("base")}
        if asr_text and not xvec:
            meta["ref_text_source"] = "asr"
        info, token = store.add(name, voice, meta, token, admin)
        # vLLM-Omni's answer ({"success", "voice"}) and, beside it, OpenAI's voice object (the `openai` client's
        # `client.audio.voices.create` returns it): the id is the name
        body = {"success": True, "voice": dict(info, owner_token=token), "id": info["name"],
                "object": "audio.voice", "name": info["name"], "created_at": info["created_at"],
                "type": "audio_sample", "owner_token": token}
        if transcribe_ref_audio:
            body["ref_text_asr"] = asr_text if not xvec else None     # the transcript Whisper wrote, if used
        if notices:
            body["notices"] = notices
        return JSONResponse(body, headers={"X-Voice-Owner-Token": token})

    @app.delete("/v1/audio/voices/{name}")
    def delete_voice(name: str, request: Request):
        gone = store.delete(name, request.headers.get(OWNER_HEADER) or None, _admin(request, store))
        return {"success": True, "message": f"Voice '{gone}' deleted successfully",   # vLLM-Omni
                "id": gone, "deleted": True, "object": "audio.voice.deleted"}             # OpenAI

    return store
