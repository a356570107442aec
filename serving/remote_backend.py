"""A remote OpenAI-compatible speech server (vLLM-Omni, or another instance of this app) used in place of the
local engine: `python app.py --backend URL`.

`RemoteSpeech.stream(...)` returns an iterator of float32 chunks at 24 kHz, like `TTSEngine.stream`, reading
the server's streamed 16-bit PCM as it arrives. Server errors become `TTSError` with the server's message.
"""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import soundfile as sf

from tts_engine import EngineBusyError, TTSError

SAMPLE_RATE = 24000


class RemoteStream:
    def __init__(self, client: httpx.Client, url: str, body: dict):
        self._cm = client.stream("POST", url, json=body)
        self._resp = self._cm.__enter__()
        if self._resp.status_code != 200:
            self._resp.read()
            msg = _error_message(self._resp)
            self.close()
            raise (EngineBusyError if self._resp.status_code in (429, 503) else TTSError)(msg)
        self.seed = int(self._resp.headers.get("x-seed", "-1"))
        self.notice = self._resp.headers.get("x-notice")
        self._bytes = self._resp.iter_bytes()
        self._carry = b""
        self.position = None

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        while True:
            try:
                data = self._carry + next(self._bytes)
            except StopIteration:
                self.close()
                raise
            except httpx.HTTPError as e:
                self.close()
                raise TTSError(f"the speech server connection failed: {e}") from None
            n = len(data) - len(data) % 2
            self._carry = data[n:]
            if n:
                return np.frombuffer(data[:n], dtype="<i2").astype(np.float32) / 32767.0   # as the server scales

    def cancel(self) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._cm.__exit__(None, None, None)
        except Exception:
            pass


def _error_message(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except Exception:
        return f"the speech server answered HTTP {resp.status_code}"


class RemoteSpeech:
    """The subset of the engine API the UI uses, over HTTP."""

    def __init__(self, base_url: str, model: str = "tts", api_key: str | None = None, timeout: float = 300):
        self.base = base_url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.model = model
        self.sample_rate = SAMPLE_RATE

    def voices(self) -> list[str]:
        try:
            r = self.client.get(self.base + "/audio/voices")
            r.raise_for_status()
            return list(r.json().get("voices", []))
        except httpx.HTTPError as e:
            raise TTSError(f"the speech server at {self.base} cannot be reached: {e}") from None

    def stream(self, text: str, *, voice: str | None = None, language: str = "auto", instructions: str | None = None,
               task_type: str | None = None, ref_audio: bytes | None = None, ref_text: str | None = None,
               x_vector_only: bool | None = None, speaker_embedding=None, seed: int | None = None,
               max_new_tokens: int | None = None) -> RemoteStream:
        body = {"model": self.model, "input": text, "voice": voice, "response_format": "pcm", "stream": True,
                "language": language, "instructions": instructions, "task_type": task_type, "ref_text": ref_text,
                "x_vector_only_mode": x_vector_only, "seed": seed, "max_new_tokens": max_new_tokens}
        if ref_audio is not None:
            body["ref_audio"] = "data:audio/wav;base64," + base64.b64encode(ref_audio).decode()
        if speaker_embedding is not None:
            body["speaker_embedding"] = [float(x) for x in speaker_embedding]
        body = {k: v for k, v in body.items() if v is not None}
        try:
            return RemoteStream(self.client, self.base + "/audio/speech", body)
        except httpx.HTTPError as e:
            raise TTSError(f"the speech server at {self.base} cannot be reached: {e}") from None

    def synthesize(self, text: str, **kw) -> np.ndarray:
        parts = list(self.stream(text, **kw))
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def close(self) -> None:
        self.client.close()


def wav_bytes(wav: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wav, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


# --- the engine-shaped adapter the app (and the API) use in remote mode ---------------------------------
LANGUAGES = ["auto", "chinese", "english", "french", "german", "italian", "japanese", "korean", "portuguese",
             "russian", "spanish"]
TASK = {"custom_voice": "CustomVoice", "base": "Base", "voice_design": "VoiceDesign"}


class RemoteEngine:
    """One model role on a remote speech server, with the part of `TTSEngine`'s API the UI uses.

    Voices travel as the API carries them: a preset by name, a clone as its reference clip (+ transcript), an
    embedding voice as `speaker_embedding`. Cloning happens on the server at each request, so a clone made here
    is a `reference` voice (the clip itself), which cannot be blended: blends need embedding voice files."""

    def __init__(self, speech: RemoteSpeech, role: str, speakers: list[str]):
        self.speech, self.kind, self.speakers = speech, role, speakers
        self.languages = LANGUAGES
        self.supports_instruct = role != "base"
        self.hidden_size = None
        self.sample_rate = SAMPLE_RATE

    def stream(self, text: str, *, voice=None, language: str = "auto", instruct: str | None = None,
               seed: int | None = None, max_new_tokens: int | None = None, **_ignored) -> RemoteStream:
        from tts_engine.voices.voice import Voice

        kw: dict = {}
        if isinstance(voice, str):
            kw["voice"] = voice
        elif isinstance(voice, Voice):
            if voice.kind == "preset":
                kw["voice"] = voice.speaker
            elif voice.kind == "reference":
                wav, sr = voice.clip()
                kw.update(ref_audio=wav_bytes(wav, sr), ref_text=voice.ref_text,
                          x_vector_only=bool(voice.meta.get("x_vector_only", not voice.ref_text)))
            else:  # xvector / embedding / icl: the speaker embedding (an ICL clone loses its reference here)
                kw["speaker_embedding"] = voice.embedding.tolist()
        return self.speech.stream(text, language=language, instructions=instruct, task_type=TASK[self.kind],
                                  seed=seed, max_new_tokens=max_new_tokens, **kw)

    def synthesize(self, text: str, **kw) -> np.ndarray:
        parts = list(self.stream(text, **kw))
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def clone_voice(self, ref_audio, ref_text: str | None = None, x_vector_only: bool = False, name: str = ""):
        from tts_engine.audio import load_audio
        from tts_engine.voices.voice import Voice

        wav, sr = load_audio(ref_audio)
        return Voice.from_clip(wav, sr, ref_text, x_vector_only, name=name)

    def voice_from_embedding(self, vector, name: str = "", meta: dict | None = None):
        from tts_engine.voices.voice import Voice, check_embedding

        return Voice(kind="embedding", name=name, embedding=check_embedding(vector), model_type="base",
                     meta=meta or {})

    def paths(self) -> dict:
        """{}: what serves a frame is the remote server's to say (its answers' X-TTS-Paths header)."""
        return {}

    def preset_embedding(self, speaker: str):
        raise TTSError("a remote server does not share its preset speakers' embeddings, so presets cannot be "
                       "blended in remote mode; blend voice files instead")

    def close(self) -> None:
        pass


class RemoteRegistry:
    """EngineRegistry's surface over a remote server: every role is 'loaded' and served remotely."""

    def __init__(self, base_url: str):
        from serving.registry import VoiceLibrary

        self.speech = RemoteSpeech(base_url)
        r = self.speech.client.get(self.speech.base + "/audio/voices")
        if r.status_code != 200:
            raise TTSError(f"the speech server at {self.speech.base} answered HTTP {r.status_code}")
        data = r.json().get("data") or [{"id": v, "task_type": "CustomVoice"} for v in r.json().get("voices", [])]
        presets = [d["id"] for d in data if str(d.get("task_type", "CustomVoice")).lower() == "customvoice"]
        self.engines = {"base": RemoteEngine(self.speech, "base", []),
                        "voice_design": RemoteEngine(self.speech, "voice_design", [])}
        if presets:
            self.engines["custom_voice"] = RemoteEngine(self.speech, "custom_voice", sorted(presets))
        self.checkpoints = {role: f"{self.speech.base} ({TASK[role]})" for role in self.engines}
        self.random_weights: set[str] = set()
        self.voices = VoiceLibrary()

    def configured(self, role: str) -> bool:
        return role in self.engines

    def loaded(self, role: str) -> bool:
        return True

    def get(self, role: str) -> RemoteEngine:
        if role not in self.engines:
            raise TTSError(f"the remote server offers no {role.replace('_', ' ')} voices")
        return self.engines[role]

    def close(self) -> None:
        self.speech.close()
