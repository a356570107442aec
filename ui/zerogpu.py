"""ZeroGPU mode: the app on Hugging Face's shared GPUs (package `spaces`), chosen by the package's own detection
(`SPACES_ZERO_GPU`). Same page, same endpoints, same behaviour; what differs underneath:

- The GPU exists only inside `@spaces.GPU` functions, each call run in a forked worker process. `gpu_generate`
  runs one request (every sentence group of one click) to its end there and yields its audio chunks as they are
  made; the engine is driven by the caller (`TTSEngine.drive_in_caller`: the worker thread's own frame step, in
  the calling thread, no thread started). `GPUCall` is the main process's end: `Speaker` reads it like an engine.
- The models are loaded at start-up, in the main process, on "cuda" (the package packs those tensors at launch and
  restores them in each worker); at load no fast paths and no CUDA graphs (the main process has no real GPU); each
  worker process takes them on its first call (`TTSEngine.warm_gpu`: the fused Triton frame, CUDA graphs captured
  on first use of each bucket) and keeps them while it lives; two cache rows (one request and its next group). The
  fused frame's checks run in the first worker only: their verdict is remembered on disk (`tts_engine/gpu/backend.py`),
  so a later worker, or a restart, installs it at once.
- Each call asks for GPU time (`duration`) computed from the request: the frames its text may take (capped by the
  maximum frames) times the measured time per frame, with a margin, plus the worker's start (`gpu_seconds`).
- After launch the main process touches no model tensor: the CustomVoice speaker embeddings (blending) and the
  Base preset clips are made at start-up; cloning a clip is its own GPU call (`gpu_clone`).
- ZeroGPU's refusals (quota used up, no GPU free, a call that ran out of time) reach the page as a message that
  says what happened and what to do (`explain`); the app keeps serving.
- The OpenAI-style `/v1` API answers 503 with the reason (ZeroGPU grants GPU time to visitors of the page; a call
  from elsewhere carries no visitor and would be charged to the Space's owner).
- The page is served by `demo.launch()` (the package's start-up runs there), with the live player's routes.

Without the `spaces` package, or with it on a machine that is not ZeroGPU (where `spaces.GPU` returns the function
unchanged), none of this is used. This module imports `spaces` first thing, and is imported by `ui/__init__.py`
before anything imports torch, so the package patches torch before anything could initialise CUDA.
"""
from __future__ import annotations

try:
    import spaces   # before torch: on ZeroGPU it installs its CUDA stand-in for the main process
except ImportError:   # not on a Space: the app runs as usual
    spaces = None

import dataclasses
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import gradio as gr

from ui.speak import Speaker, sentence_parts

log = logging.getLogger("qwen3_tts_live.zerogpu")

FRAME_HZ = 12.5            # frames per second of audio (80 ms each)
WORKER_START_S = 6.0       # a worker's fork and the restore of the packed weights onto the GPU
MARGIN = 1.5               # on the measured time per frame
MIN_DURATION_S = 10
MAX_DURATION_S = int(os.environ.get("TTS_ZEROGPU_MAX_DURATION", 300))
API_UNAVAILABLE = ("The /v1 speech API is not available on this ZeroGPU Space: ZeroGPU grants GPU time to the "
                   "visitors of the page (each visitor's own daily quota), and a call from outside the page carries "
                   "no visitor, so it would be charged to the Space's owner. Use the page, or gradio_client with "
                   "the page's endpoints (/preset, /clone, /blend, /design), or run the app on dedicated GPU or CPU "
                   "hardware, where /v1/audio/speech is served.")


def enabled() -> bool:
    """True on ZeroGPU, as the `spaces` package itself decides (SPACES_ZERO_GPU)."""
    if spaces is None:
        return False
    from spaces.config import Config

    return bool(Config.zero_gpu)


def _gpu(duration):
    """`spaces.GPU(duration=...)`; the function unchanged without the package (and, by the package, off ZeroGPU)."""
    if spaces is None:
        return lambda fn: fn
    return spaces.GPU(duration=duration)


# --- GPU time asked for ---------------------------------------------------------------------------------------

@dataclass
class FrameTime:
    """Seconds of GPU time per generated frame, measured by the calls so far (quick to believe a slower figure,
    slow to believe a faster one); before the first call, a guess for a 0.6B model's eager frame."""
    seconds: float = float(os.environ.get("TTS_ZEROGPU_FRAME_S", 0.05))
    measured: bool = False

    def update(self, frames: int, seconds: float) -> None:
        if frames < 8 or seconds <= 0:
            return
        per = seconds / frames
        if not self.measured or per > self.seconds:
            self.seconds = per
        else:
            self.seconds = 0.8 * self.seconds + 0.2 * per
        self.measured = True


FRAME_TIME = FrameTime()


def frame_budget(texts: list[str], max_new_tokens: int) -> int:
    """The frames a request may take: twice the expected length of each text (plus 2 s), at most its maximum."""
    from ui.live_player import expected_seconds

    return sum(min(int(max_new_tokens), int(expected_seconds(t) * FRAME_HZ * 2) + 25) for t in texts)


def gpu_seconds(texts: list[str], max_new_tokens: int, per_frame_s: float | None = None) -> int:
    """The `duration` of one call: the worker's start + the frame budget at the measured time per frame, with a
    margin; within [MIN_DURATION_S, MAX_DURATION_S]. Short requests ask for little of the visitor's quota."""
    per = FRAME_TIME.seconds if per_frame_s is None else per_frame_s
    s = WORKER_START_S + frame_budget(texts, max_new_tokens) * per * MARGIN
    return int(min(MAX_DURATION_S, max(MIN_DURATION_S, math.ceil(s))))


# --- what runs in the ZeroGPU worker (forked: it sees the engines loaded at start-up) -------------------------

_ENGINES: dict = {}        # role -> TTSEngine (driven by its caller), filled by `prepare` before launch
_WARM: dict = {}           # role -> pid of the worker process whose engine took its GPU paths (`TTSEngine.warm_gpu`)


def _warm(role: str, engine) -> None:
    """Once per worker process and role: the engine's GPU paths (the fused Triton frame, CUDA graphs captured on
    first use of each bucket), which exist only where the real GPU is, kept while the worker lives."""
    if _WARM.get(role) == os.getpid():
        return
    _WARM[role] = os.getpid()
    t0 = time.perf_counter()
    try:
        paths = engine.warm_gpu()
        log.info("ZeroGPU worker %d: %s frames in %.0f ms: %s", os.getpid(), role, 1000 * (time.perf_counter() - t0),
                 "; ".join(f"{k}: {v['path']} ({v['how']})" for k, v in paths.items() if k in ("frame", "gpu frame")))
    except Exception as e:   # never a failed call for it: the eager frame serves
        log.warning("ZeroGPU worker %d: GPU paths not taken, eager frames: %s: %s", os.getpid(), type(e).__name__, e)


def _generate_duration(role, texts, voices, options) -> int:
    return gpu_seconds(texts, options.get("max_new_tokens") or 2048)


@_gpu(duration=_generate_duration)
def gpu_generate(role: str, texts: list[str], voices: list, options: dict):
    """One request, in a ZeroGPU worker: speak `texts` in order (voice `voices[k]` for text k; `options`: language,
    instruct, seed, sampling, max_new_tokens, first_chunk_frames), the next text submitted as soon as the current
    one has its first chunk (gapless, as `Speaker` does). Yields picklable items: ("audio", k, float32 chunk),
    ("end", k, None), and last ("stats", (frames, seconds, pid), None), or ("error", message, None)."""
    from tts_engine import TTSError

    engine = _ENGINES[role]
    _warm(role, engine)
    t0 = time.perf_counter()
    frames, opened = 0, []

    def open_(k):
        s = engine.stream(texts[k], voice=voices[k], **options)
        opened.append(s)
        return s

    try:
        ahead = open_(0)
        for k in range(len(texts)):
            stream, ahead = ahead, None
            for chunk in stream:
                if ahead is None and k + 1 < len(texts):
                    ahead = open_(k + 1)
                yield ("audio", k, chunk)
            frames += len(stream.request.codes)
            yield ("end", k, None)
            if ahead is None and k + 1 < len(texts):
                ahead = open_(k + 1)
    except TTSError as e:
        yield ("error", str(e), None)
        return
    except Exception as e:   # never a traceback for the visitor; the worker's log has it
        log.exception("generation failed in the ZeroGPU worker")
        yield ("error", f"synthesis failed ({type(e).__name__}); please try again", None)
        return
    finally:
        for s in opened:       # a stopped request leaves the engine (its rows free for the next call)
            s.cancel()
    yield ("stats", (frames, time.perf_counter() - t0, os.getpid()), None)


def _clone_duration(wav, sr, ref_text, x_vector_only, name) -> int:
    return int(min(MAX_DURATION_S, MIN_DURATION_S + math.ceil(len(wav) / max(sr, 1))))


@_gpu(duration=_clone_duration)
def gpu_clone(wav, sr: int, ref_text, x_vector_only: bool, name: str):
    """Clone a voice from a clip (float32 mono `wav` at `sr`) in a ZeroGPU worker -> ("ok", Voice on the CPU) or
    ("error", message)."""
    from tts_engine import TTSError

    try:
        v = _ENGINES["base"].clone_voice((wav, sr), ref_text=ref_text, x_vector_only=x_vector_only, name=name)
    except TTSError as e:
        return ("error", str(e))
    except Exception as e:
        log.exception("cloning failed in the ZeroGPU worker")
        return ("error", f"cloning failed ({type(e).__name__}); please try again")
    v.embedding = v.embedding.cpu()
    if v.ref_codes is not None:
        v.ref_codes = v.ref_codes.cpu()
    return ("ok", v)


# --- the main process's end ----------------------------------------------------------------------------------

def explain(e: gr.Error) -> gr.Error:
    """ZeroGPU's own refusals, as a message that says what happened and what to do."""
    msg = str(getattr(e, "message", e)).strip()
    title = str(getattr(e, "title", "") or "")
    low = f"{title} {msg}".lower()
    if "quota" in low or "limit" in low or "credits" in low:
        text = (f"ZeroGPU did not grant GPU time for this request: {msg} Nothing is wrong with your input and the "
                "app keeps working: try again later, try a shorter text (it asks for less GPU time), or log in to "
                "Hugging Face for a larger quota.")
    elif "no gpu was available" in low:
        text = f"No ZeroGPU GPU was free for this request ({msg}). Please try again in a moment."
    elif "aborted" in low or "worker error" in low:
        text = ("The GPU task ended before the speech was finished (it ran out of its GPU time, or the GPU worker "
                "failed). Please try again; a shorter text needs less GPU time.")
    elif "duration" in low:
        text = f"ZeroGPU refused the GPU time asked for: {msg} Try a shorter text or a lower maximum length."
    else:
        text = f"ZeroGPU: {msg}"
    return gr.Error(text, title=title or "ZeroGPU", print_exception=False)


class GPUCall:
    """The main process's end of one `gpu_generate` call: a whole request (the sentence groups of one click, or the
    blend sweep's five jobs), handed to `Speaker` as its engine. `stream(text, ...)` gives the stream of the next
    part, in order, like `TTSEngine.stream`; the GPU call starts when the first part is read. `stop()` (any thread)
    ends the call: the worker's generator is closed at its next chunk and its requests leave the engine."""

    def __init__(self, role: str, texts: list[str], voices: list | None = None):
        self.role, self.texts, self.voices = role, list(texts), voices
        self.options: dict | None = None
        self.parts = 0
        self._gen = None
        self._lock = threading.Lock()      # one reader at a time (the handler's thread of the moment)
        self._stop = False
        self._done = False

    def stream(self, text: str, *, voice=None, language: str = "auto", instruct=None, seed=None, sampling=None,
               max_new_tokens=None, first_chunk_frames: int = 2) -> "PartStream":
        k = self.parts
        if k >= len(self.texts) or text != self.texts[k]:
            raise RuntimeError("GPUCall: parts must be streamed in the order they were given")
        self.parts += 1
        if k == 0:
            self.options = dict(language=language, instruct=instruct, seed=seed, sampling=sampling,
                                max_new_tokens=max_new_tokens, first_chunk_frames=first_chunk_frames)
            if self.voices is None:
                self.voices = [voice] * len(self.texts)
        return PartStream(self, k, seed)

    def next_item(self) -> tuple:
        """The call's next item (see `gpu_generate`); StopIteration once it is over or stopped."""
        with self._lock:
            if self._stop:
                self._close_locked()
            if self._done:
                raise StopIteration
            if self._gen is None:
                self._gen = gpu_generate(self.role, self.texts, self.voices, self.options)
            try:
                item = next(self._gen)
            except StopIteration:
                self._done = True
                raise
            except gr.Error as e:        # ZeroGPU's own refusals and failures
                self._done = True
                raise explain(e) from None
            if item[0] == "stats":
                frames, seconds, pid = item[1]
                FRAME_TIME.update(frames, seconds)
                log.info("ZeroGPU call: %d frames in %.2f s (%.1f ms per frame) in worker process %d", frames,
                         seconds, 1000 * seconds / max(frames, 1), pid)
            return item

    def stop(self) -> None:
        self._stop = True
        if self._lock.acquire(blocking=False):   # else the reader closes it after the chunk it waits for
            try:
                self._close_locked()
            finally:
                self._lock.release()

    def _close_locked(self) -> None:
        if self._gen is not None and not self._done:
            self._gen.close()    # the package tells the worker to stop at its next yield, and waits for it
        self._done = True


class PartStream:
    """One part of a `GPUCall`, read like a `TTSStream`: float32 chunks, then the end (or a TTSError)."""

    position = None              # ZeroGPU queues the call itself; there is no engine queue to report

    def __init__(self, call: GPUCall, k: int, seed):
        self.call, self.k, self.seed = call, k, seed
        self._ended = False

    def __iter__(self):
        return self

    def __next__(self):
        from tts_engine import TTSError

        while not self._ended:
            try:
                kind, a, b = self.call.next_item()
            except StopIteration:
                self._ended = True
                break
            if kind == "audio" and a == self.k:
                return b
            if kind == "end" and a == self.k:
                self._ended = True
                if self.k == len(self.call.texts) - 1:
                    self._drain()
                break
            if kind == "error":
                self._ended = True
                raise TTSError(a)
        raise StopIteration

    def _drain(self) -> None:
        """After the last part: read the call to its end (its stats; the package releases the GPU)."""
        try:
            while True:
                self.call.next_item()
        except StopIteration:
            pass

    def cancel(self) -> None:
        if not self._ended:
            self._ended = True
            self.call.stop()

    close = cancel


class MainProcessEngine:
    """What the main process holds for a role on ZeroGPU: the engine's description (speakers, languages, sizes,
    precision) served here, its GPU work sent to the `@spaces.GPU` functions."""

    def __init__(self, role: str, engine, speaker_embeddings: dict):
        self.role = role
        self._engine = engine
        self._embeddings = speaker_embeddings

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def preset_embedding(self, speaker: str):
        self._engine.speaker_id(speaker)    # an unknown name: the engine's own message (config only)
        return self._embeddings[str(speaker).strip().lower()].clone()

    def clone_voice(self, ref_audio, ref_text: str | None = None, x_vector_only: bool = False, name: str = ""):
        from tts_engine import TTSError
        from tts_engine.audio import load_audio

        if not self._engine.supports_clone:
            raise TTSError("voice cloning needs a Base checkpoint (Qwen3-TTS-12Hz-*-Base)")
        if not x_vector_only and not (ref_text or "").strip():
            raise TTSError("in-context cloning needs the transcript of the reference clip "
                           "(or turn on x-vector-only mode)")
        wav, sr = load_audio(ref_audio)
        try:
            status, value = gpu_clone(wav, sr, ref_text, bool(x_vector_only), name)
        except gr.Error as e:
            raise explain(e) from None
        if status == "error":
            raise TTSError(value)
        return value

    def stream(self, text: str, **kw) -> PartStream:
        return GPUCall(self.role, [text]).stream(text, **kw)

    def synthesize(self, text: str, **kw):
        import numpy as np

        parts = list(self.stream(text, **kw))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


# --- start-up and serving ------------------------------------------------------------------------------------

def configure(cfg) -> None:
    """The engine settings ZeroGPU needs (AppConfig, before the models are made): no fast paths and no CUDA graphs at
    load (the main process holds only the package's stand-in device; each worker takes them on its first call,
    `_warm`), no torch.compile, two cache rows (one request at a time per call, and its next sentence group)."""
    cfg.eager = True
    cfg.engine_options = {**cfg.engine_options, "fast_paths": False, "max_batch": 2,
                          "max_seq_len": min(4096, cfg.limits.max_new_tokens + 1024)}
    cfg.concurrency = cfg.concurrency or 4   # visitors served at once (each with its own GPU call)


def prepare(app) -> None:
    """Start-up on ZeroGPU, in the main thread before launch: load every role's model onto "cuda" (what the package
    packs at launch and restores in each worker), switch the engines to caller-driven, make what the main process
    needs later without the GPU (speaker embeddings, the Base preset clips), and serve the roles through
    `MainProcessEngine`."""
    registry = app.models.registry
    for role in app.models.roles:
        t = time.perf_counter()
        engine = registry.get(role)
        engine.drive_in_caller()
        _ENGINES[role] = engine
        emb = {s: engine.preset_embedding(s) for s in engine.speakers} if engine.kind == "custom_voice" else {}
        registry.put(role, MainProcessEngine(role, engine, emb))
        log.info("ZeroGPU: %s loaded in %.1f s (%s, %s)", role, time.perf_counter() - t, engine.device,
                 engine.precision)
    if "base" in _ENGINES:
        from tts_engine import TTSError

        for p in app.voices.presets:     # cloned now (or read from the disk cache), on this thread's "cuda"
            try:
                app.voices.presets.voice(_ENGINES["base"], p.id)
            except TTSError as e:
                log.warning("preset clip %s not prepared: %s", p.id, e)


def routes(app) -> list:
    """The routes served next to the page: the live player's PCM stream and scripts, and `/v1/...` -> 503."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    from ui import live_player

    router = APIRouter()
    live_player.install(router, app.live)

    def unavailable(path: str):
        return JSONResponse({"error": {"message": API_UNAVAILABLE, "type": "server_error", "param": None,
                                       "code": "unavailable_on_zerogpu"}}, status_code=503,
                            headers={"Cache-Control": "no-store"})

    router.add_api_route("/v1/{path:path}", unavailable, methods=["GET", "POST"], include_in_schema=False)
    return router.routes


def serve(app, host: str, port: int, ssl_certfile=None, ssl_keyfile=None) -> None:
    """Load, build and serve through `demo.launch()` (where the package packs the models and reports start-up)."""
    from ui import live_player, server

    prepare(app)
    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=app.limits.max_queue)
    log.info("ZeroGPU: serving the page through demo.launch() on %s:%d (the /v1 API answers 503)", host, port)
    demo.launch(server_name=host, server_port=port, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                ssl_verify=not ssl_certfile, app_kwargs={"routes": routes(app)}, head=live_player.HEAD,
                **server.launch_kwargs(app))


class ZeroGPUSpeaker(Speaker):
    """`speak.Speaker` on ZeroGPU: each request (a click's sentence groups, the sweep's five jobs) is one `GPUCall`."""

    def start(self, role: str, seed: int) -> dict:
        """First update: the call asks ZeroGPU for a GPU before anything is generated."""
        out = super().start(role, seed)
        out[self.c.status] = self.status("Asking ZeroGPU for a GPU…", seed=seed, role=role)
        return out

    def speak(self, role, engine, job, request=None, **kw):
        job = dataclasses.replace(job, guard=None)   # one GPU call renders the click's parts: no takes redone
        texts = [p.text for p in sentence_parts(None, job)]     # as the model reads them (serving/text_prep.py)
        yield from super().speak(role, GPUCall(role, texts), job, request, **kw)

    def render_all(self, engine, jobs, request=None):
        call = GPUCall(engine.role, [j.text for j in jobs], [j.voice for j in jobs])
        yield from super().render_all(call, jobs, request)
