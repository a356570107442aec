"""/dialogue: a conversation between the session's voices, spoken through the one generation loop.

Every line of the script becomes the parts of `speak.Speaker.speak_parts` (its sentence groups), with the line's
voice, engine (a CustomVoice speaker and a cloned Base voice may talk to each other: each line goes to its own
engine) and instruction, and the chosen pause before it. The loop submits each part while the one before plays,
so the conversation streams gaplessly to the page's player; it ends with the whole WAV and one WAV per line."""
from __future__ import annotations

import gradio as gr

from tts_engine import TTSError

from ui.config import ROLE_LABEL
from ui.handlers import check_sampling, check_seed, check_speed
from ui.dialogue_script import MAX_SPEAKERS, check_lines, check_pause, parse_script, speakers
from ui.live_player import expected_seconds
from ui.speak import SpeechJob, session_key, sentence_parts


class DialogueHandler:
    """Mixed into the app's handlers (it uses their models, voices, files, speaker, live streams and checks)."""

    def _cast(self, names: list[str], slots: list[tuple[str, str]], session) -> dict[str, tuple[str, object, str]]:
        """Each speaker's (role, engine voice, voice label). A slot that names a speaker of the script is that
        speaker's; the other slots (empty name, or a name not in the script) go, in order, to the speakers that
        no slot names."""
        wanted = {n.lower() for n in names}
        named = {str(n or "").strip().lower(): v for n, v in slots if str(n or "").strip().lower() in wanted}
        unnamed = [v for n, v in slots if str(n or "").strip().lower() not in wanted]
        cast = {}
        for name in names:
            key = named.get(name.lower())
            if key is None:
                key = unnamed.pop(0) if unnamed else None
            if not str(key or "").strip():
                raise TTSError(f"choose a voice for {name}")
            try:
                role, voice = self.voices.resolve(key, session)
            except TTSError as e:
                raise TTSError(f"the voice of {name}: {e}") from None
            cast[name.lower()] = (role, voice, str(key))
        return cast

    def dialogue(self, script: str, speaker_1: str = "", voice_1: str = "", speaker_2: str = "", voice_2: str = "",
                 speaker_3: str = "", voice_3: str = "", speaker_4: str = "", voice_4: str = "",
                 pause: float = 0.3, language: str = "auto", session: dict | None = None,
                 seed: float | None = None, randomize: bool = True, temperature: float = 0.9, top_k: int = 50,
                 top_p: float = 1.0, repetition_penalty: float = 1.05, max_new_tokens: int | None = None,
                 speed: float = 1.0, live_token: str = "", request: gr.Request = None):
        """Speak a dialogue between up to 4 voices, line by line, streamed without gaps (each next line is
        generated while the one before plays), with a pause between turns. Ends with the whole WAV and one WAV
        per line.

        Parameters:
            script: one turn per line, "Name: text" or "Name [instruction]: text" (at most 40 lines, 4 speakers)
            speaker_1: the name (as in the script) that voice_1 speaks; empty (or a name not in the script): the first speaker that no slot names
            voice_1: a CustomVoice speaker name (e.g. "ryan"), "preset:<id>" (Base preset clip) or "my:<name>" (a voice of this session)
            speaker_2: the name that voice_2 speaks (empty: the next speaker not named elsewhere)
            voice_2: voice of speaker_2 (same forms as voice_1)
            speaker_3: the name that voice_3 speaks
            voice_3: voice of speaker_3
            speaker_4: the name that voice_4 speaks
            voice_4: voice of speaker_4
            pause: silence between turns, in seconds (0-3)
            language: "auto" or a language name
            seed: random seed (used when randomize is false), the same for every line
        Returns:
            live audio chunks (only where the server has ffmpeg), the whole dialogue as a lossless WAV, status line, seed used, one WAV per line (in order)
        """
        seed = check_seed(seed, randomize)
        lines = parse_script(script)
        names = check_lines(lines, self.limits.max_text_chars)
        pause_s = check_pause(pause)
        speed = check_speed(speed)
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens, self.limits)
        slots = [(speaker_1, voice_1), (speaker_2, voice_2), (speaker_3, voice_3), (speaker_4, voice_4)][:MAX_SPEAKERS]
        cast = self._cast(names, slots, session)
        parts, ignored = [], set()
        for i, line in enumerate(lines):
            role, voice, _key = cast[line.speaker.lower()]
            inst = line.instruct or None
            if inst and not self.models.roles[role].supports_instruct:
                inst = None
                ignored.add(line.speaker)
            lexicon, read_out, take_guard = self.text_options(request)    # the session's (docs/text-and-takes.md)
            job = SpeechJob(text=line.text, voice=voice, language=language, instruct=inst, seed=seed,
                            sampling=sampling, max_new_tokens=max_new, speed=speed, lexicon=lexicon,
                            read_out=read_out, guard=take_guard)
            parts += sentence_parts(self.models.engine(role), job, line=i, pause_s=pause_s if i else 0.0)
        first_role = cast[lines[0].speaker.lower()][0]
        notes = [f"{len(lines)} lines", " · ".join(f"{n} = {cast[n.lower()][2]} ({ROLE_LABEL[cast[n.lower()][0]]})"
                                                   for n in speakers(lines))]
        if ignored:
            notes.append("instruction ignored for " + ", ".join(sorted(ignored)) + " (the checkpoint does not "
                         "follow instructions)")
        c = self.c
        yield {**self.speaker.start(first_role, seed), c.dlg_files: None}
        expected = sum(expected_seconds(x.text) for x in lines) + pause_s * (len(lines) - 1)
        sink = self.live.open(live_token, session_key(request), expected / speed)

        def line_files(audio):
            files = [self.files.save_wav(pcm, f"{i + 1:02d}_{lines[i].speaker}") for i, pcm in audio if len(pcm)]
            return {c.dlg_files: files or None}

        yield from self.speaker.speak_parts(first_role, parts, request, note=" · ".join(notes), sink=sink,
                                            on_done=line_files)
