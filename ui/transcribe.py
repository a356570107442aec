"""Transcribe the reference clip on the Clone tab (/transcribe): a speech-recognition model (tts_engine/asr.py)
writes what the clip says into the transcript box, where the user can still correct it. Only on request (the
button): whoever types the transcript never loads the model. Without the model (offline, not cached) the page says
so and cloning works as before."""
from __future__ import annotations

import gradio as gr

from tts_engine import TTSError
from tts_engine import asr


class TranscribeHandler:
    """Mixed into the app's handlers (it uses `cfg`, `limits`, `c` and `_reference_clip`)."""

    def transcriber(self) -> asr.Transcriber:
        return asr.shared(device=self.cfg.device)

    def transcribe(self, ref_audio, language: str = "auto"):
        """Transcribe the reference clip with the speech-recognition model (loaded on first use) so that the clip
        can be cloned in-context without typing its words.

        Parameters:
            ref_audio: the reference clip (3-10 s of clean speech; wav, flac, mp3, ogg...)
            language: "auto" (detected) or the clip's language name (e.g. "english", "chinese")
        Returns:
            the transcript (edit it if a word is wrong), x-vector-only mode (False: the transcript is used), status line
        """
        if not ref_audio:
            raise TTSError("upload or record a reference clip first")
        wav, sr, _notes = self._reference_clip(ref_audio)
        t = self.transcriber()
        first = not t.loaded
        result = t.transcribe(wav, sr, language)
        if not result.text:
            raise TTSError("no words were recognised in the clip; type the transcript, or clone x-vector only")
        loading = " (the model was loaded for this first use)" if first else ""
        msg = (f"**Transcribed** in {result.seconds:.1f} s with `{result.model}`{loading} · check the words in the "
               "transcript box (they must match the clip), then clone")
        return {self.c.ref_text: result.text, self.c.xvec: False, self.c.status: msg}


def add_button(c) -> None:
    """The button under the transcript box (inside the Clone tab's layout)."""
    c.transcribe_btn = gr.Button("📝 Transcribe the clip", size="sm", elem_id="transcribe-btn")


def wire(app, c, on) -> None:
    on(c.transcribe_btn, app.transcribe, [c.ref_audio, c.c_lang], [c.ref_text, c.xvec, c.status], "transcribe",
       concurrency_id="asr", concurrency_limit=1, show_progress="minimal")
