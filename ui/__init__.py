"""The Gradio app of Qwen3-TTS Live, room by room (app.py at the repository root is only the entry point):

    config.py    AppConfig and the defaults (checkpoints per role, labels, pauses, sampling)
    roles.py     which checkpoint serves which role; tiny/offline fallback; the random-weights banner
    text.py      sentences, sentence groups, float -> int16 (pure functions)
    session.py   a session's voices (gr.State) and the files offered for download
    status.py    the status line (first audio, RTF, audio length, queue position, seed, part k/n)
    speak.py     the one generation loop: text -> engine.stream -> chunks -> WAV + status (gapless groups)
    handlers.py  the function behind each api_name (/preset, /clone, /blend, ... /stop)
    dialogue_script.py, dialogue.py, dialogue_tab.py   the Dialogue tab: script format, /dialogue, its layout
    transcribe.py  the Clone tab's Transcribe button (/transcribe; the model: tts_engine/asr.py)
    history.py   the session's takes (replay, download, restore, A/B with assets/history.js)
    layout.py    the gr.Blocks page and its event wiring
    server.py    one FastAPI server: the page at / and the OpenAI-compatible speech API at /v1
    zerogpu.py   ZeroGPU mode (Hugging Face Spaces): @spaces.GPU generation, start-up loading, demo.launch()
    app.py       TTSApp, which ties them together
"""
from ui import zerogpu  # noqa: F401  first: imports `spaces` (when installed) before anything imports torch
from ui.app import TTSApp
from ui.config import AppConfig

__all__ = ["TTSApp", "AppConfig"]
