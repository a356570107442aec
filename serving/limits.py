"""Every serving limit in one place (overridable by environment variables of the same name, upper case)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields


@dataclass
class Limits:
    max_text_chars: int = 2000          # characters of input text per request
    max_instructions_chars: int = 500   # characters of `instructions` (vLLM-Omni's limit)
    max_upload_bytes: int = 20 * 2**20  # reference audio / voice file uploads
    max_reference_seconds: float = 30.0  # longer reference clips are trimmed (with a notice)
    min_reference_seconds: float = 0.5
    max_queue: int = 32                 # requests waiting in the engine beyond the running batch
    max_per_client: int = 2             # concurrent requests per client (IP) on the HTTP API
    file_ttl_seconds: int = 3600        # generated / uploaded files are deleted after this
    max_new_tokens: int = 2048          # frames cap per request (80 ms each)
    # "realtime": a request joins the running batch only while every running stream keeps real time (else it waits
    # in the queue; tts_engine/engine/scheduler.py); "rows": whenever a cache row is free
    admission: str = "realtime"

    def __post_init__(self):
        if self.admission not in ("realtime", "rows"):
            raise ValueError(f"TTS_ADMISSION must be 'realtime' or 'rows', not {self.admission!r}")

    @classmethod
    def from_env(cls) -> "Limits":
        kw = {}
        for f in fields(cls):
            v = os.environ.get(f"TTS_{f.name.upper()}")
            if v is not None:
                kw[f.name] = type(f.default)(v)
        return cls(**kw)
