"""The functions behind each `api_name` of the page: /preset, /clone, /load_voice, /blend, /blend_sweep,
/blend_export, /design, /stop.

Each reads top to bottom: validate the input, resolve the voice, stream from the engine (through
`speak.Speaker`), report. Their signatures (argument names, order, defaults) and the outputs they fill are the
Gradio API that `gradio_client` users call; their docstrings are the "Use via API" page. Generation handlers
are generators of {component: value} updates; the components live in `self.c` (filled by `layout.build`).
Every failure becomes a readable message in the page (`guard`), never a traceback."""
from __future__ import annotations

import functools
import inspect
import logging
import random
import time
from pathlib import Path

import gradio as gr
import numpy as np

from serving import text_prep
from serving.limits import Limits
from serving.reference import prepare_reference
from serving.registry import check_name
from serving.speed import SPEED_MAX, SPEED_MIN, change_speed
from serving.take_guard import MAX_BEST_OF, MAX_RETRIES, TakeGuard
from tts_engine import EngineBusyError, TTSError
from tts_engine.voices import blend as blendlib

from ui.config import DEFAULT_SAMPLING, ROLE_LABEL, SR
from ui.live_player import LiveStreams, expected_seconds
from ui.roles import Models
from ui.session import Files, Voices, remember
from ui.speak import ActiveStreams, Speaker, SpeechJob, first_chunks_s, session_key
from ui.status import status_line
from ui.text import chunk_text, to_int16

log = logging.getLogger("qwen3_tts_live")


# --- input checks ------------------------------------------------------------------------------------------

def check_seed(seed, randomize) -> int:
    """The seed to use: a new random one when asked for (or none given), else the given whole number."""
    if randomize or seed is None or (isinstance(seed, str) and not seed.strip()):
        return random.randrange(2**31)
    try:
        s = int(float(seed))
    except (TypeError, ValueError):
        raise TTSError("the seed must be a whole number") from None
    if s < 0 or s >= 2**63:
        raise TTSError("the seed must be a non-negative whole number")
    return s


def check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens, limits: Limits) -> tuple[dict, int]:
    """-> (sampling dict for engine.stream, max frames per sentence group, capped by the server's limit)."""
    def num(v, default, cast=float):
        return default if v is None or v == "" else cast(v)
    sampling = {"temperature": num(temperature, DEFAULT_SAMPLING["temperature"]),
                "top_k": num(top_k, DEFAULT_SAMPLING["top_k"], lambda x: int(float(x))),
                "top_p": num(top_p, DEFAULT_SAMPLING["top_p"]),
                "repetition_penalty": num(repetition_penalty, DEFAULT_SAMPLING["repetition_penalty"])}
    max_new = num(max_new_tokens, limits.max_new_tokens, lambda x: int(float(x)))
    if max_new < 1:
        raise TTSError("the maximum length must be at least 1 frame")
    return sampling, min(max_new, limits.max_new_tokens)


def check_speed(speed) -> float:
    """Playback speed of the answer (pitch kept): 0.25-4.0, refused outside (never capped)."""
    try:
        v = 1.0 if speed is None or speed == "" else float(speed)
    except (TypeError, ValueError):
        raise TTSError("the speed must be a number between 0.25 and 4.0") from None
    if not SPEED_MIN <= v <= SPEED_MAX:
        raise TTSError(f"the speed must be between {SPEED_MIN} and {SPEED_MAX}, got {v:g}")
    return v


def check_text(text, limits: Limits) -> str:
    text = (text or "").strip() if isinstance(text, str) else ""
    if not text:
        raise TTSError("enter some text to speak")
    if len(text) > limits.max_text_chars:
        raise TTSError(f"the text is too long: {len(text)} characters; the limit is "
                       f"{limits.max_text_chars}. Split it or shorten it.")
    return text


def guard(fn):
    """Turn every failure of a handler into a message in the page (gr.Error), never a traceback."""
    def convert(e: BaseException):
        if isinstance(e, gr.Error):
            return e
        if isinstance(e, EngineBusyError):
            return gr.Error(f"The server is busy: {e}")
        if isinstance(e, TTSError):
            return gr.Error(str(e)[:1].upper() + str(e)[1:])
        log.exception("handler %s failed", fn.__name__)
        return gr.Error(f"Something went wrong on the server ({type(e).__name__}). The app keeps running; "
                        "please try again.")

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except Exception as e:
                raise convert(e) from None
        return gen

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise convert(e) from None
    return call


# what the generating handlers' shared arguments mean, for the "Use via API" page (a handler's docstring describes
# only its own; one that says more about a shared one, e.g. a seed used for every line, keeps its own line)
SHARED_PARAMS = {
    "seed": "random seed (used when randomize is false)",
    "randomize": "draw a new seed for this request (the seed used is returned)",
    "temperature": "sampling temperature of the talker",
    "top_k": "top-k of the talker (0 = off)",
    "top_p": "top-p of the talker",
    "repetition_penalty": "repetition penalty on the first codebook",
    "max_new_tokens": "maximum frames (80 ms each) per sentence group",
    "speed": "playback speed, 0.25-4.0 (1 = as generated; the pitch is kept)",
    "live_token": "leave empty (the page's own player sets it to receive the audio as raw PCM)",
}


def api_doc(fn) -> str:
    """The handler's docstring (description, parameters one a line, returns) for the "Use via API" page, with a
    line from SHARED_PARAMS for each shared argument that the docstring does not describe, in argument order."""
    doc = inspect.getdoc(fn) or ""
    head, sep, rest = doc.partition("Parameters:\n")
    if not sep:
        return doc
    params, sep, returns = rest.partition("Returns:")
    own = {ln.split(":", 1)[0].strip(): ln.strip() for ln in params.splitlines() if ln.strip()}
    lines = [own.pop(a, None) or (f"{a}: {SHARED_PARAMS[a]}" if a in SHARED_PARAMS else None)
             for a in inspect.signature(fn).parameters]
    lines = [ln for ln in lines if ln] + list(own.values())
    return head + "Parameters:\n" + "".join(f"    {ln}\n" for ln in lines) + sep + returns


def _slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3, voice_4, file_4,
           weight_4):
    return [(voice_1, file_1, weight_1), (voice_2, file_2, weight_2), (voice_3, file_3, weight_3),
            (voice_4, file_4, weight_4)]


# --- the handlers ------------------------------------------------------------------------------------------

class Handlers:
    def __init__(self, models: Models, voices: Voices, files: Files, active: ActiveStreams, speaker: Speaker,
                 limits: Limits, c, live: LiveStreams | None = None):
        self.models, self.voices, self.files, self.active = models, voices, files, active
        self.speaker, self.limits, self.c = speaker, limits, c
        self.live = live or LiveStreams()    # the page's own player: one PCM stream per click (live_player.py)
        # every take checked (serving/take_guard.py); a session's /text_settings derive from it. Replace it to change
        # the default or give it a transcriber: `app.take_guard = TakeGuard(transcriber=...)`
        self.take_guard = TakeGuard.from_env()
        self.text_takes: dict[str, tuple] = {}   # session -> (lexicon, read_out, TakeGuard) from /text_settings
        self.design_takes: dict[str, tuple] = {}  # session -> the last Voice design take (for /keep_design)

    def status(self, stage: str, role: str | None = None, **kw) -> str:
        return status_line(stage, random_weights=self.models.is_random(role), lossy=self.models.lossy_label(role), **kw)

    def _dropdowns(self, session: dict) -> dict:
        """Updates that offer the session's voices in every voice dropdown."""
        out = {}
        if hasattr(self.c, "p_voice"):
            out[self.c.p_voice] = gr.update(choices=self.voices.choices(session))
        for dd in getattr(self.c, "slot_voice", []):
            out[dd] = gr.update(choices=self.voices.choices(session, blend=True))
        return out

    def _speak(self, role, engine, text, voice, language, instruct, seed, sampling, max_new, request,
               note: str = "", extra_final: dict | None = None, sink=None, live_token: str = "", speed: float = 1.0,
               on_done=None):
        """Stream one job through the shared generation loop (speak.Speaker.speak). The audio also goes, as it is
        generated, to `sink` (speak.Sink) or else to the page player's stream of `live_token` (made by the page for
        this click; empty: no live stream)."""
        lexicon, read_out, take_guard = self.text_options(request)
        job = SpeechJob(text=text, voice=voice, language=language, instruct=instruct, seed=seed,
                        sampling=sampling, max_new_tokens=max_new, speed=check_speed(speed), lexicon=lexicon,
                        read_out=read_out, guard=take_guard)
        if sink is None:
            sink = self.live.open(live_token, session_key(request), expected_seconds(text) / job.speed,
                                  chunks_s=first_chunks_s() if job.speed == 1.0 else None)
        yield from self.speaker.speak(role, engine, job, request, note=note, extra_final=extra_final, sink=sink,
                                      on_done=on_done)

    def preset(self, text: str, voice: str, language: str = "auto", instruct: str = "", session: dict | None = None,
               seed: float | None = None, randomize: bool = True, temperature: float = 0.9, top_k: int = 50,
               top_p: float = 1.0, repetition_penalty: float = 1.05, max_new_tokens: int | None = None,
               speed: float = 1.0, live_token: str = "", request: gr.Request = None):
        """Speak text with a preset voice: a CustomVoice speaker, one of our preset clips (Base model) or a voice
        you cloned or loaded in this session. Streams the audio while it is generated.

        Parameters:
            text: what to say (long text is spoken sentence group by sentence group, same voice and seed)
            voice: a CustomVoice speaker name (e.g. "ryan", "vivian"), "preset:<id>" for our Base preset clips (e.g. "preset:emma"), or "my:<name>" for a voice of this session
            language: "auto" or a language name the model knows (e.g. "english", "chinese")
            instruct: speaking-style instruction (only for checkpoints that follow instructions, e.g. 1.7B CustomVoice; otherwise ignored)
        Returns:
            live audio chunks (only where the server has ffmpeg; for live audio use /v1/audio/speech, stream=true), the full lossless WAV, the status line (time to first audio, real-time factor, audio length), the seed used
        """
        seed = check_seed(seed, randomize)
        text = check_text(text, self.limits)
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens, self.limits)
        role, v = self.voices.resolve(voice, session)
        yield self.speaker.start(role, seed)
        engine = self.models.engine(role)
        note = ""
        inst = (instruct or "").strip() or None
        if inst and not self.models.roles[role].supports_instruct:
            inst, note = None, "instruction ignored: this checkpoint does not follow instructions"
        yield from self._speak(role, engine, text, v, language, inst, seed, sampling, max_new, request, note=note,
                               live_token=live_token, speed=speed)

    def clone(self, ref_audio, ref_text: str = "", x_vector_only: bool = False, voice_name: str = "My voice",
              file_format: str = "safetensors", text: str = "", language: str = "auto",
              session: dict | None = None, seed: float | None = None, randomize: bool = True,
              temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0, repetition_penalty: float = 1.05,
              max_new_tokens: int | None = None, speed: float = 1.0, live_token: str = "",
              request: gr.Request = None):
        """Clone a voice from a short reference clip (Base model), keep it in this session under a name, offer
        it as a voice file, and speak the text with it (streamed).

        Parameters:
            ref_audio: the reference clip (3-10 s of clean speech; wav, flac, mp3, ogg...)
            ref_text: exact transcript of the clip (in-context cloning, best similarity); leave empty for x-vector-only cloning
            x_vector_only: use only the speaker embedding (no transcript needed; needed for blending)
            voice_name: name to keep the voice under in this session (letters, digits, spaces, . - _ ( ))
            file_format: "safetensors" or "json" for the voice file
            text: what to say with the cloned voice
            language: "auto" or a language name
        Returns:
            live audio chunks (only where the server has ffmpeg; for live audio use /v1/audio/speech, stream=true), full lossless WAV, status line, seed used, the voice file
        """
        seed = check_seed(seed, randomize)
        text = check_text(text, self.limits)
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens, self.limits)
        name = check_name(voice_name or "My voice")
        if not ref_audio:
            raise TTSError("upload or record a reference clip first")
        yield self.speaker.start("base", seed)
        engine = self.models.engine("base")
        wav, sr, notes = self._reference_clip(ref_audio)
        xvec = bool(x_vector_only) or not (ref_text or "").strip()
        if xvec and not x_vector_only:
            notes.append("no transcript: x-vector-only clone")
        yield {self.c.status: self.status("Cloning the voice…", seed=seed, role="base")}
        voice = engine.clone_voice((wav, sr), ref_text=None if xvec else ref_text, x_vector_only=xvec, name=name)
        voice.meta.update({"checkpoint": self.models.roles["base"].checkpoint})
        session = remember(session, name, voice)
        path = self.files.save_voice(voice, name, file_format)
        extra = {self.c.voice_file: path, self.c.session: session, **self._dropdowns(session)}
        notes.append(f"saved as “{name}”")
        # the voice is kept (and its file offered) even if the speech that follows is stopped
        yield {**extra, self.c.status: self.status(f"Cloned “{name}”", seed=seed, role="base")}
        yield from self._speak("base", engine, text, voice, language, None, seed, sampling, max_new, request,
                               note=" · ".join(notes), extra_final=extra, live_token=live_token, speed=speed)

    def _reference_clip(self, ref_audio) -> tuple[np.ndarray, int, list[str]]:
        """The uploaded clip as float32 mono, checked (long enough, not silent) and trimmed to the limit, as the
        API checks its clips (serving/reference.py)."""
        (wav, sr), notes = prepare_reference(ref_audio, self.limits)
        return wav, sr, notes

    def load_voice(self, voice_file, voice_name: str = "", session: dict | None = None):
        """Load a voice file (.safetensors or .json, made by this app or the engine) into this session, so the
        other tabs can use it.

        Parameters:
            voice_file: the voice file
            voice_name: name to keep it under (default: the name stored in the file, or the file name)
        Returns:
            status line
        """
        voice = self.voices.load_file(voice_file)
        name = check_name(voice_name or voice.name or Path(str(voice_file)).stem)
        session = remember(session, name, voice)
        role = self.models.role_of(voice)
        msg = (f"**Loaded “{name}”** · {ROLE_LABEL[role]} voice ({voice.kind}) · "
               f"choose it as “my:{name}” in any tab")
        return {self.c.session: session, self.c.status: msg, **self._dropdowns(session)}

    def _blend_inputs(self, n_voices, slots, a_to_b, session):
        """-> role, vectors, weights, labels for the used slots."""
        try:
            n = int(float(n_voices))
        except (TypeError, ValueError):
            raise TTSError("the number of voices must be 2, 3 or 4") from None
        if n not in (2, 3, 4):
            raise TTSError("the number of voices must be 2, 3 or 4")
        used = slots[:n]
        roles, vecs, labels = [], [], []
        for i, (key, file, _w) in enumerate(used):
            letter = "ABCD"[i]
            try:
                role, vec, label = self.voices.embedding_of(key, session, file)
            except TTSError as e:
                raise TTSError(f"voice {letter}: {e}") from None
            roles.append(role)
            vecs.append(vec)
            labels.append(label)
        if len(set(roles)) > 1:
            desc = ", ".join(f"{'ABCD'[i]} = {labels[i]} ({ROLE_LABEL[r]})" for i, r in enumerate(roles))
            raise TTSError("voices from different checkpoints cannot be mixed: " + desc + ". CustomVoice speakers "
                           "blend with CustomVoice speakers, cloned (Base) voices with cloned voices.")
        if n == 2:
            t = float(a_to_b if a_to_b is not None else 50) / 100.0
            if not 0 <= t <= 1:
                raise TTSError("the A-to-B position must lie between 0 and 100 %")
            weights = [1 - t, t]
        else:
            weights = [float(w if w is not None else 0) for _k, _f, w in used]
        return roles[0], vecs, weights, labels

    def _blend_voice(self, n_voices, slots, a_to_b, session, name="Blend"):
        role, vecs, weights, labels = self._blend_inputs(n_voices, slots, a_to_b, session)
        vec = blendlib.blend(vecs, weights)
        shares = blendlib.shares_percent(weights)
        recipe = [{"voice": lab, "share": s} for lab, s in zip(labels, shares)]
        method = "slerp" if len(vecs) == 2 else "nlerp"
        engine = self.models.engine(role)
        voice = engine.voice_from_embedding(vec, name=name, meta={"blend": recipe, "method": method,
                                                                  "checkpoint": self.models.roles[role].checkpoint})
        desc = " + ".join(f"{s} % {lab}" for lab, s in zip(labels, shares) if s > 0)
        return role, engine, voice, desc

    def blend(self, text: str, n_voices: int = 2, voice_1: str = "", file_1=None, weight_1: float = 50,
              voice_2: str = "", file_2=None, weight_2: float = 50, voice_3: str = "", file_3=None,
              weight_3: float = 50, voice_4: str = "", file_4=None, weight_4: float = 50, a_to_b: float = 50,
              language: str = "auto", session: dict | None = None, seed: float | None = None,
              randomize: bool = True, temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0,
              repetition_penalty: float = 1.05, max_new_tokens: int | None = None, speed: float = 1.0,
              live_token: str = "", request: gr.Request = None):
        """Blend 2-4 voices of one checkpoint and speak with the blend (streamed). Two voices: spherical
        interpolation at the A-to-B position; 3-4 voices: normalised-direction interpolation with norm restore,
        weighted by the sliders (shares are normalised to 100 %). Blends use speaker embeddings (x-vector mode).

        Parameters:
            text: what to say
            n_voices: how many voice slots are used (2, 3 or 4)
            voice_1: voice A: a CustomVoice speaker name, "preset:<id>", "my:<name>", or "file" to use file_1
            file_1: voice file for slot A when voice_1 is "file"
            weight_1: weight of voice A (3-4 voices)
            voice_2: voice B (same forms as voice_1)
            file_2: voice file for slot B
            weight_2: weight of voice B (3-4 voices)
            voice_3: voice C (3-4 voices)
            file_3: voice file for slot C
            weight_3: weight of voice C
            voice_4: voice D (4 voices)
            file_4: voice file for slot D
            weight_4: weight of voice D
            a_to_b: with two voices, the position from A (0) to B (100), in percent
            language: "auto" or a language name
        Returns:
            live audio chunks (only where the server has ffmpeg; for live audio use /v1/audio/speech, stream=true), full lossless WAV, status line, seed used
        """
        seed = check_seed(seed, randomize)
        text = check_text(text, self.limits)
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens, self.limits)
        slots = _slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3,
                            voice_4, file_4, weight_4)
        role, engine, voice, desc = self._blend_voice(n_voices, slots, a_to_b, session)
        yield self.speaker.start(role, seed)
        yield from self._speak(role, engine, text, voice, language, None, seed, sampling, max_new, request,
                               note=f"blend: {desc}", live_token=live_token, speed=speed)

    def blend_sweep(self, text: str, n_voices: int = 2, voice_1: str = "", file_1=None, weight_1: float = 50,
                    voice_2: str = "", file_2=None, weight_2: float = 50, voice_3: str = "", file_3=None,
                    weight_3: float = 50, voice_4: str = "", file_4=None, weight_4: float = 50,
                    a_to_b: float = 50, language: str = "auto", session: dict | None = None,
                    seed: float | None = None, randomize: bool = True, temperature: float = 0.9, top_k: int = 50,
                    top_p: float = 1.0, repetition_penalty: float = 1.05, max_new_tokens: int | None = None,
                    speed: float = 1.0, request: gr.Request = None):
        """Render the same sentence with the same seed at 0, 25, 50, 75 and 100 % from voice A to voice B
        (spherical interpolation), for A/B listening. Uses the first sentence group of the text and voices A and B.

        Parameters:
            text: the sentence (only its first sentence group is used)
            n_voices: must be 2
            voice_1: voice A (see /blend)
            file_1: voice file for slot A
            weight_1: unused
            voice_2: voice B
            file_2: voice file for slot B
            weight_2: unused
            voice_3: unused
            file_3: unused
            weight_3: unused
            voice_4: unused
            file_4: unused
            weight_4: unused
            a_to_b: unused
            language: "auto" or a language name
            seed: random seed (used when randomize is false); the same seed renders all five points
            randomize: draw one new seed for the sweep
            max_new_tokens: maximum frames (80 ms each)
            speed: playback speed of the five WAVs, 0.25-4.0 (the pitch is kept)
        Returns:
            five WAVs (0, 25, 50, 75, 100 %), the status line, the seed used
        """
        c = self.c
        seed = check_seed(seed, randomize)
        lexicon, read_out, _g = self.text_options(request)     # the first sentence group, as the model reads it
        text = chunk_text(text_prep.prepare(check_text(text, self.limits), language, lexicon, read_out)
                          .segments[0].spoken)[0]
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens, self.limits)
        try:
            n = int(float(n_voices))
        except (TypeError, ValueError):
            n = 0
        if n != 2:
            raise TTSError("the sweep goes from voice A to voice B: set the number of voices to 2")
        slots = _slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3,
                            voice_4, file_4, weight_4)
        role, vecs, _w, labels = self._blend_inputs(2, slots, 50, session)
        out = {p: None for p in c.sweep}
        out.update(self.speaker.start(role, seed))
        yield out
        engine = self.models.engine(role)
        points = blendlib.sweep(vecs[0], vecs[1])
        jobs = [SpeechJob(text=text, voice=engine.voice_from_embedding(vec, name=f"{int(t * 100)} %"),
                          language=language, instruct=None, seed=seed, sampling=sampling, max_new_tokens=max_new)
                for t, vec in zip(blendlib.SWEEP, points)]
        t0 = time.perf_counter()
        done = {}
        speed = check_speed(speed)
        for i, audio in enumerate(self.speaker.render_all(engine, jobs, request)):
            if audio is not None and speed != 1.0:
                audio = to_int16(change_speed(audio.astype(np.float32) / 32767.0, SR, speed))
            done[c.sweep[i]] = (SR, audio) if audio is not None else None
            yield {c.sweep[i]: done[c.sweep[i]],
                   c.status: self.status(f"Sweep {i + 1}/5 rendered", seed=seed, role=role,
                                         note=f"{labels[0]} → {labels[1]}")}
        yield {**done, c.seed: seed,
               c.status: self.status(f"Sweep done in {time.perf_counter() - t0:.1f} s", seed=seed, role=role,
                                      note=f"0 % = {labels[0]}, 100 % = {labels[1]}, same seed and sentence")}

    def blend_export(self, n_voices: int = 2, voice_1: str = "", file_1=None, weight_1: float = 50,
                     voice_2: str = "", file_2=None, weight_2: float = 50, voice_3: str = "", file_3=None,
                     weight_3: float = 50, voice_4: str = "", file_4=None, weight_4: float = 50,
                     a_to_b: float = 50, blend_name: str = "My blend", file_format: str = "safetensors",
                     session: dict | None = None):
        """Export the current blend as a voice file (and keep it in this session under its name).

        Parameters:
            n_voices: how many voice slots are used (2, 3 or 4)
            voice_1: voice A (see /blend)
            file_1: voice file for slot A
            weight_1: weight of voice A
            voice_2: voice B
            file_2: voice file for slot B
            weight_2: weight of voice B
            voice_3: voice C
            file_3: voice file for slot C
            weight_3: weight of voice C
            voice_4: voice D
            file_4: voice file for slot D
            weight_4: weight of voice D
            a_to_b: with two voices, the position from A (0) to B (100), in percent
            blend_name: name of the blended voice
            file_format: "safetensors" or "json"
        Returns:
            the voice file, status line
        """
        name = check_name(blend_name or "My blend")
        slots = _slots(voice_1, file_1, weight_1, voice_2, file_2, weight_2, voice_3, file_3, weight_3,
                            voice_4, file_4, weight_4)
        role, _engine, voice, desc = self._blend_voice(n_voices, slots, a_to_b, session, name=name)
        session = remember(session, name, voice)
        path = self.files.save_voice(voice, name, file_format)
        return {self.c.export_file: path, self.c.session: session,
                self.c.status: (f"**Exported “{name}”** · {desc} · {ROLE_LABEL[role]} model · "
                                f"usable as “my:{name}”"),
                **self._dropdowns(session)}

    def design(self, text: str, description: str, language: str = "auto", seed: float | None = None,
               randomize: bool = True, temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0,
               repetition_penalty: float = 1.05, max_new_tokens: int | None = None, speed: float = 1.0,
               live_token: str = "", request: gr.Request = None):
        """Design a voice from a description (VoiceDesign model) and speak the text with it (streamed).

        Parameters:
            text: what to say
            description: the voice, in words (e.g. "A warm, low male voice, speaking slowly")
            language: "auto" or a language name
        Returns:
            live audio chunks (only where the server has ffmpeg; for live audio use /v1/audio/speech, stream=true), full lossless WAV, status line, seed used
        """
        seed = check_seed(seed, randomize)
        text = check_text(text, self.limits)
        desc = (description or "").strip()
        if not desc:
            raise TTSError("describe the voice you want (e.g. “a warm, low male voice, speaking slowly”)")
        sampling, max_new = check_sampling(temperature, top_k, top_p, repetition_penalty, max_new_tokens, self.limits)
        yield self.speaker.start("voice_design", seed)
        engine = self.models.engine("voice_design")
        lexicon, read_out, _g = self.text_options(request)
        spoken = text_prep.prepare(text, language, lexicon, read_out).spoken
        key = session_key(request)

        def keep_take(lines):     # the take /keep_design clones (the pauses between lines are not in it)
            audio = np.concatenate([a for _line, a in lines]) if lines else np.zeros(0, np.int16)
            self.design_takes.pop(key, None)
            self.design_takes[key] = (audio, spoken, desc, seed, language, check_speed(speed))
            while len(self.design_takes) > 1000:
                self.design_takes.pop(next(iter(self.design_takes)))
            return {}
        yield from self._speak("voice_design", engine, text, None, language, desc, seed, sampling, max_new, request,
                               live_token=live_token, speed=speed, on_done=keep_take)

    # --- text and takes (serving/text_prep.py, serving/take_guard.py; docs/text-and-takes.md) --------------------
    def text_options(self, request=None) -> tuple:
        """(dictionary, read numbers out, take guard) of this session: /text_settings' choices, else the defaults."""
        got = self.text_takes.get(session_key(request))
        return got if got is not None else (text_prep.server_lexicon(), True, self.take_guard)

    def text_settings(self, lexicon=None, read_out: bool = True, take_mode: str = "redo", takes: float = 2,
                      request: gr.Request = None):
        """Set how this session's text is read and its takes checked (every tab, until changed).

        Parameters:
            lexicon: the pronunciation dictionary: rows [word or phrase, say it as], a {word: respelling} object, or lines `word = respelling`; a word with a capital letter matches only that spelling, an all-lowercase one any case
            read_out: read numbers, dates, times, currencies and common abbreviations as words (languages num2words supports)
            take_mode: "off" (no checks), "redo" (a failed take is redone with another seed) or "best" (render N takes, keep the best)
            takes: "redo": how many times a failed take is redone (0-5); "best": N (1-5)
        Returns:
            the settings in one line
        """
        mode = (take_mode or "redo").strip().lower()
        if mode not in ("off", "redo", "best"):
            raise TTSError("the take mode must be off, redo or best")
        try:
            n = int(float(takes if takes not in (None, "") else 2))
        except (TypeError, ValueError):
            raise TTSError("the number of takes must be a whole number") from None
        skipped = 0
        if isinstance(lexicon, (list, tuple)):     # the page's table: a row still being typed is left out
            rows = [[str(x or "").strip() for x in (list(r) + ["", ""])[:2]] for r in lexicon]
            lexicon = [r for r in rows if all(r)]
            skipped = sum(1 for r in rows if any(r) and not all(r))
        lx = text_prep.Lexicon.merged(text_prep.server_lexicon(),
                                      text_prep.parse_lexicon(lexicon, "pronunciation dictionary"))
        guard = self.take_guard.with_options(retries=n if mode == "redo" else 0,
                                             best_of=max(1, n) if mode == "best" else 1, enabled=mode != "off")
        key = session_key(request)
        self.text_takes.pop(key, None)
        self.text_takes[key] = (lx, bool(read_out), guard)
        while len(self.text_takes) > 1000:
            self.text_takes.pop(next(iter(self.text_takes)))
        how = {"off": "takes not checked", "redo": f"failed takes redone up to {n}×",
               "best": f"best of {max(1, n)} takes"}[mode]
        return (f"{len(lx)} dictionary entries · numbers {'read out' if read_out else 'left as written'} · {how}"
                + (f" · {skipped} incomplete row(s) left out" if skipped else ""))

    def preview(self, text: str = "", language: str = "auto", request: gr.Request = None):
        """The text as the model will read it: pause tags, this session's dictionary, numbers read out.

        Parameters:
            text: the text
            language: "auto" or a language name
        Returns:
            the text the model reads
        """
        if not (text or "").strip():
            return ""
        lexicon, read_out, _g = self.text_options(request)
        try:
            return text_prep.prepare(text, language, lexicon, read_out).preview
        except TTSError as e:
            return f"⚠️ {e}"

    def keep_design(self, voice_name: str = "My designed voice", file_format: str = "safetensors",
                    session: dict | None = None, request: gr.Request = None):
        """Keep the last Voice design take of this session as a reusable voice: cloned from its own audio with the
        Base model (design, then clone), kept in this session as “my:<name>” and offered as a voice file, so the
        same voice speaks every later text.

        Parameters:
            voice_name: name to keep the voice under
            file_format: "safetensors" or "json"
        Returns:
            the voice file, status line
        """
        name = check_name(voice_name or "My designed voice")
        take = self.design_takes.get(session_key(request))
        if take is None or not len(take[0]):
            raise TTSError("design a voice first (▶ Design and speak), then keep it")
        if not self.models.has("base"):
            raise TTSError("keeping a designed voice needs the Base model (it clones the take)")
        audio, spoken, desc, seed, language, speed = take
        engine = self.models.engine("base")
        (wav, sr), notes = prepare_reference((audio.astype(np.float32) / 32767.0, SR), self.limits)
        # in-context with the words the model read, when the whole take is the clip (and not stretched)
        xvec = bool(notes) or speed != 1.0
        voice = engine.clone_voice((wav, sr), ref_text=None if xvec else spoken, x_vector_only=xvec, name=name)
        voice.meta.update({"checkpoint": self.models.roles["base"].checkpoint, "designed_from": desc,
                           "design_seed": seed})
        session = remember(session, name, voice)
        path = self.files.save_voice(voice, name, file_format)
        mode = "x-vector only: " + (notes[0] if notes else "the take was played at another speed") if xvec \
            else "in-context"
        return {self.c.keep_file: path, self.c.session: session,
                self.c.status: (f"**Kept “{name}”** · designed from “{desc}” (seed {seed}), cloned with the Base "
                                f"model ({mode}) · usable as “my:{name}” in every tab"),
                **self._dropdowns(session)}

    def stop(self, request: gr.Request = None):
        """Stop this session's generation and free its place in the engine.

        Returns:
            status line
        """
        n = self.active.cancel(session_key(request))
        return "**Stopped**" + (f" · {n} request(s) cancelled" if n else "")
