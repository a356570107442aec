"""Serving layer shared by the Gradio app and the HTTP API: limits, engine registry, audio formats and the
OpenAI-compatible speech API. Model logic stays in tts_engine."""
