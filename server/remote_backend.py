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
