"""The HTTP API: FastAPI routes, request parsing and response encoding (openai_api.py: /v1/audio/speech and
/v1/audio/voices; speech_ws.py: the WebSocket stream; voices_api.py: uploaded voices; speech_request.py, body_limit.py,
audio_formats.py, text_stream.py). What it shares with the page lives in `serving/`; the model in `tts_engine`."""
