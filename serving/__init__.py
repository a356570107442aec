"""What the page (`ui/`) and the HTTP API (`server/`) share, below both of them and above the engine:

  registry.py        which engine serves a role (CustomVoice / Base / VoiceDesign), loaded on first use; named voices
  limits.py          the request limits (text length, frames, uploads, queue), from the environment
  speed.py           speaking rate 0.25-4x with the pitch kept (whole clips and streams)
  voice_store.py     voices uploaded through the API, kept on disk, with their owners; the registry's lookups
  reference.py       reference clips from users: checked, trimmed, transcribed on request
  remote_backend.py  every role served by another OpenAI-compatible speech server (`--backend URL`)

It uses `tts_engine`'s public API only and imports neither `ui/` nor `server/` (tests/test_app_layers.py)."""
