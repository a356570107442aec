"""TTSEngine: the public API of tts_engine.

    engine = TTSEngine.from_pretrained("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    wav = engine.synthesize("Hello!", voice="ryan")                     # float32 @ 24 kHz
    for chunk in engine.stream("Hello!", voice="ryan"): ...              # float32 chunks while generating
    voice = base_engine.clone_voice("ref.wav", ref_text="...")           # Base checkpoints
    voice.save("me.safetensors"); Voice.load("me.safetensors")

Validation turns every bad input into a `TTSError` before any device work starts.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time


import numpy as np
import torch

from tts_engine.errors import TTSError
from tts_engine.model.prompt import Prompt
from tts_engine.loader import Qwen3TTSModel
from tts_engine.model.sampling import SamplingParams
from tts_engine.voices.reference_cache import DecoderPrimeCache, ReferenceCache, reference_key
from tts_engine.voices.voice import Voice, check_embedding
from tts_engine.engine.model_runner import ModelRunner
from tts_engine.engine.prefix_cache import PrefixCache
from tts_engine.engine.request import Request
from tts_engine.engine.scheduler import END, Scheduler, Sequence
from tts_engine.engine.worker import EngineWorker

SAMPLE_RATE = 24000
MAX_TEXT_CHARS = 5000


class TTSStream:
    """Handle of one submitted request: iterate it for float32 PCM chunks (24 kHz) as they are generated.

    `.cancel()` frees the request's place in the engine within one frame; `.position` is the number of
    requests ahead of it while it waits (None once it runs); after exhaustion `.codes` holds the generated
    codes [frames, 16] (int64) and `.seed` the seed used. A failure raises `TTSError` from the iteration.
    On an engine driven by its caller (`TTSEngine.drive_in_caller`) each `next()` runs the engine's frame steps
    in the calling thread until the next chunk is ready, and `cancel()` steps until the request has left."""

    def __init__(self, seq: Sequence, engine: "TTSEngine", seed: int, driven: bool = False):
        self.seq = seq
        self.request = seq.request
        self._engine = engine
        self._driven = driven
        self.seed = seed
        self.sample_rate = SAMPLE_RATE
        self._finished = False

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self._finished:
            raise StopIteration
        if self._driven:
            self._engine.worker.run_until_output(self.seq)
        item = self.seq.out.get()
        if item is END:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        return item

    def cancel(self) -> None:
        if not self._finished:
            self.seq.cancelled.set()
            self._engine.worker.wake.set()
            if self._driven:   # nobody else steps this engine: free the row now
                self._engine.worker.settle(self.seq)

    close = cancel

    def __del__(self):  # an abandoned stream (client gone) must not keep its slot
        try:
            self.seq.cancelled.set() if self._driven else self.cancel()   # (a driven engine frees it next step)
        except Exception:
            pass

    @property
    def position(self) -> int | None:
        return self._engine.scheduler.position(self.seq)

    @property
    def codes(self) -> torch.Tensor:
        return self.request.codes.stack()


PREFIX_CACHE_MB_DEFAULT = 64          # prompt prefixes kept per engine (CPU, 16-bit and quantised modes)
# overlap_codec's default on a CPU with 2+ threads in 16-bit and quantised modes (False, True, "streams" or "auto"): on,
# because on a quiet machine the codec thread measured +29-30 % x real time at one stream and +30-40 % audio s per wall
# s at four streams against off (w8a8; docs/bench-history.md, "Codec: packed oneDNN convolutions..."). "auto"
# (measured per batch size as the engine runs, cpu/codec_choice.py) is not the default: its A/Bs so far were taken
# under load and came out inside the noise.
OVERLAP_CODEC_CPU_DEFAULT = True


def _chunk_frames(v) -> int | tuple[int, ...]:
    """`first_chunk_frames` checked: a positive int, or a non-empty tuple of them."""
    try:
        out = tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else int(v)
    except (TypeError, ValueError):
        raise TTSError("first_chunk_frames must be a positive integer or a list of them") from None
    if (isinstance(out, tuple) and (not out or min(out) < 1)) or (isinstance(out, int) and out < 1):
        raise TTSError("first_chunk_frames must be a positive integer or a list of them")
    return out


class TTSEngine:
    def __init__(self, model: Qwen3TTSModel, max_batch: int | None = None, max_seq_len: int | None = None,
                 max_waiting: int = 64, use_cuda_graphs: bool | None = None, capture_graphs_at_start: bool = True,
                 reference_cache: int = 128, overlap_codec: bool | None = None, codec_threads: int | None = 1,
                 compile_predictor: bool | None = None, govern_threads: bool | None = None,
                 prefix_cache_mb: float | None = None, fast_paths: bool = True, admission: str = "rows"):
        """max_batch: sequences decoded together (cache rows); max_seq_len: talker positions per row (prompt +
        frames); max_waiting: queued requests beyond which `stream` fails at once with EngineBusyError;
        use_cuda_graphs: replay the per-frame step as CUDA graphs (default: on when the device is CUDA; False is
        the eager path, `--eager` on the command lines); capture_graphs_at_start: capture every (batch, length)
        bucket now, as the engine's warm-up, instead of on first use inside a request; reference_cache: cloned
        voices kept (LRU keyed by clip, transcript and mode) so a repeated clone skips both encoders, and the codec
        decoder's state after an ICL voice's reference codes (32 kept) so its requests skip priming it (0: both
        off). A capture or replay that raises turns graphs off for good with one log line (`paths()["frame"]` says
        why); the engine keeps serving. overlap_codec: decode each request's chunks after its first on a codec
        thread (`codec_threads` intra-op threads) while the next frames are generated (default: on a CPU
        `OVERLAP_CODEC_CPU_DEFAULT` in 16-bit and quantised modes where torch has 2+ threads, off in fp32, on a GPU
        or with one thread; "streams": only while two or more requests run; "auto": the codec thread or the
        worker, whichever is measured cheaper for the batch size at hand, cpu/codec_choice.py; docs/bench-history.md
        has the A/B).
        compile_predictor: one-stream
        code-predictor passes through a compiled graph on a CPU (tts_engine/cpu/compiled_predictor.py; default:
        env TTS_COMPILE_PREDICTOR, off). govern_threads: on a CPU in a 16-bit or quantised mode, run each frame with
        the OpenMP threads (1, all, or all inside the linear layers only) measured fastest at the moment
        (`threads.ThreadGovernor`: a busy core stalls every op that enters the pool; default: on there, env
        TTS_GOVERN_THREADS=0 turns it off; fp32 keeps the process's threads). prefix_cache_mb: keep the talker's
        keys/values of up to this many MB of prompt prefixes (a voice's part of the prompt, `prefix_cache.PrefixCache`)
        so that the next request of a voice prefills only its text (default: 64 on a CPU in a 16-bit or quantised
        mode, env TTS_PREFIX_CACHE_MB overrides; 0 off; fp32 and GPUs keep one whole prefill per request).
        fast_paths: let the device's backend attach its fast paths (engine/backends.py; default on); False serves
        model/'s plain PyTorch path (with CUDA graphs where `use_cuda_graphs`), e.g. to check a fast path against it.
        admission: "rows" (a queued request joins the running batch whenever a cache row is free) or "realtime" (only
        while the measured step for one more row keeps every running stream above real time and their listeners
        hold audio enough for its prefill; otherwise it waits: engine/scheduler.py; the app's and API's default)."""
        self.model = model
        self.config = model.config
        gpu = model.device.type == "cuda"
        self.max_batch = max_batch or (16 if gpu else 4)
        self.max_seq_len = max_seq_len or 4096   # prompt + frames per row (4096 ~ 5 min of audio)
        self._lock = threading.Lock()   # serialises voice cloning (speaker/codec encoders)
        self.reference_cache = ReferenceCache(reference_cache)
        # the device's fast paths are attached here, by its backend (engine/backends.py; CPU: cpu/backend.py)
        self.runner = ModelRunner(model.talker, model.prompts.tts_pad, rows=self.max_batch,
                                  max_len=self.max_seq_len, eos_id=model.config.talker.codec_eos_token_id,
                                  fast_paths=fast_paths,
                                  **({} if gpu else dict(compile_predictor=compile_predictor,
                                                         govern_threads=govern_threads)))
        if prefix_cache_mb is None:   # (a GPU prefill is fast, and the key's digest would cost a host sync there)
            prefix_cache_mb = float(os.environ.get("TTS_PREFIX_CACHE_MB", PREFIX_CACHE_MB_DEFAULT)) \
                if model.dtype != torch.float32 and not gpu else 0
        self.runner.prefix_cache = PrefixCache(int(prefix_cache_mb * (1 << 20))) if prefix_cache_mb > 0 else None
        if use_cuda_graphs is None:
            use_cuda_graphs = gpu
        if use_cuda_graphs:
            if not gpu:
                raise TTSError("CUDA graphs need a CUDA device (use_cuda_graphs=False, or --eager, on a CPU)")
            from tts_engine.engine.cuda_graphs import GraphedFrames

            self.start_graphs(GraphedFrames(self.runner), capture_now=capture_graphs_at_start)
        else:
            self.runner.path_entries["frame"] = {"path": "eager", "how": "default",
                                                 "why": "use_cuda_graphs=False" if gpu else "CUDA graphs need a GPU"}
        self.scheduler = Scheduler(self.max_batch, max_waiting, admission=admission)
        self.worker = EngineWorker(self.runner, self.scheduler, model.speech_tokenizer,
                                   primed=DecoderPrimeCache(32 if reference_cache else 0))
        if overlap_codec is None:
            # (fp32 keeps every decode in this thread, as before: its audio stays bit for bit)
            overlap_codec = OVERLAP_CODEC_CPU_DEFAULT if not gpu and torch.get_num_threads() >= 2 \
                and model.dtype != torch.float32 else False
            self._codec_why = ("default", "fp32, a GPU or one thread: in the worker" if not overlap_codec
                               else "on a CPU with 2+ threads in 16-bit and quantised modes")
        else:
            self._codec_why = ("forced by overlap_codec", f"overlap_codec={overlap_codec!r}")
        self.worker.overlap_codec(overlap_codec, codec_threads)
        backend = self.runner.backend   # (the CPU backend chose the thread governor at attach)
        self.worker.govern_threads(getattr(backend, "governor", None), getattr(backend, "matmul_threads", None))
        # our C++ library still building in the background: its fast paths at a later frame boundary
        self.worker.between_frames = getattr(backend, "between_frames", None)

    def _govern_threads(self, on: bool) -> None:
        """Turn the CPU backend's thread governor on or off (benchmarks' A/B)."""
        b = self.runner.backend
        self.worker.govern_threads(*(b.thread_governor(on) if hasattr(b, "thread_governor") else (None, None)))

    @property
    def thread_choice(self) -> dict:
        """What the thread governor measured: {(rows, codec busy): {option: (average frame ms, frames)}}."""
        g = self.worker.governor
        return g.snapshot() if g is not None else {}

    @classmethod
    def from_pretrained(cls, model, device=None, dtype=None, text_embedding_on_cpu: bool = False,
                        quantize: str | None = None, **engine_kw) -> "TTSEngine":
        """model: hub id or checkpoint folder; device: default CUDA when present, else CPU; dtype: default bf16 on
        GPU, on a CPU bf16 where native (AVX-512 BF16 / AMX) else fp32 (`model.dtype`, `model.dtype_auto`);
        text_embedding_on_cpu: keep the 622 MB text embedding in host memory (it is read only to build prompts);
        quantize: None (the checkpoint's weights), a quantised mode of the talker and code predictor ("int8", "w8a8",
        "int4", "w4a8"; CPU only, lossy: see `precision` and `lossy`), or "auto" (on a CPU the fastest mode on this
        machine whose measured quality against fp32 is acceptable, `qwen3_tts.quantize_choice`; none on a GPU or when
        the dtype is given);
        engine_kw: see `TTSEngine.__init__`."""
        return cls(Qwen3TTSModel.from_pretrained(model, device=device, dtype=dtype,
                                                 text_embedding_on_cpu=text_embedding_on_cpu, quantize=quantize),
                   **engine_kw)

    def start_graphs(self, graphs, capture_now: bool = True) -> None:
        """Serve the per-frame step through `graphs` (a `cuda_graphs.GraphedFrames`), capturing every bucket now
        when `capture_now` (start-up warm-up, before any request). A capture that raises is logged in one line
        and the engine serves eagerly for good."""
        self.runner.graphs = graphs
        if not capture_now:
            self.runner.path_entries["frame"] = {"path": "cuda graphs", "how": "default",
                                                 "why": "buckets captured on first use"}
            return
        t0 = time.perf_counter()
        try:
            graphs.capture_all()
        except Exception as e:
            self.runner.disable_graphs(f"capture failed: {type(e).__name__}: {e}".splitlines()[0][:300])
            return
        self.runner.path_entries["frame"] = {
            "path": "cuda graphs", "how": "default",
            "why": f"{len(graphs.graphs)} graphs captured in {time.perf_counter() - t0:.1f} s"}

    def warm_gpu(self, graphs: bool = True) -> dict[str, dict[str, str]]:
        """Take the GPU's fast paths in the process that serves, where they could not be taken at load: on ZeroGPU the
        engine is loaded in the main process on the `spaces` package's stand-in device and the real GPU exists only
        in the worker process of each `@spaces.GPU` call. On a real CUDA device this attaches the GPU backend
        (`tts_engine.gpu`'s fused frame, where it compiles and agrees with eager: checked in the first process, the
        verdict remembered on disk, so a later worker installs it at once) if no backend is attached yet and, with
        `graphs`, serves frames through CUDA graphs captured on first use of each (batch, length) bucket (a click
        captures only the bucket it runs in) and kept while this process lives (a worker is reused by the next
        call). Elsewhere it changes nothing. Call it between requests, in the thread that drives the engine.
        -> `paths()`."""
        real_cuda = self.model.device.type == "cuda" and torch.backends.cuda.is_built() and torch.cuda.is_available()
        if real_cuda:
            if self.runner.backend is None:
                from tts_engine.engine.backends import attach_backend

                attach_backend(self.runner)
            if graphs and self.runner.graphs is None:
                from tts_engine.engine.cuda_graphs import GraphedFrames

                self.start_graphs(GraphedFrames(self.runner), capture_now=False)
        return self.paths()

    def paths(self) -> dict[str, dict[str, str]]:
        """What serves each part of a frame right now, and why: {part: {"path": what runs, "how": "measured now" |
        "remembered" | "default" | "forced by TTS_..." | "fell back" | "measuring", "why": one line}}.

        Parts: "frame" (CUDA graphs or eager) and whatever the device's backend attached to the model runner
        (`ModelRunner.path_entries`; on a CPU "talker stack", "predictor stack", "predictor frame", "talker step",
        "compiled predictor"), then "threads" and "codec thread" (the worker's, measured as it runs), then the
        machine-wide choices this process made (`cpu.measured.made()`: "kernel table", "quantize auto", "codec",
        "codec int8 threshold", "matmul share", ...). A backend adds its parts by writing entries to
        `runner.path_entries`: an object with `.entry()` (`cpu.measured.MeasuredChoice`, `Record`) or a
        {"path", "how", "why"} dict. The page's footer, the API's headers and the benchmarks print it."""
        from tts_engine.cpu.measured import entry_of, made

        entries = self.runner.path_entries
        out = {part: entry_of(entries[part]) for part in sorted(entries, key=lambda p: p != "frame")}
        g = self.worker.governor   # (the backend's, or one a benchmark put there)
        if g is not None:
            out["threads"] = g.entry()
        out.setdefault("threads", {"path": "the process's threads", "how": "default", "why": "not governed"})
        out["codec thread"] = self._codec_entry()
        for name, e in made().items():
            out.setdefault(name, e)
        return out

    def _codec_entry(self) -> dict[str, str]:
        """Where the worker decodes chunks after a request's first: the "codec thread" part of `paths()`."""
        w = self.worker
        if w.codec_choice is not None:
            return w.codec_choice.entry()
        how, why = self._codec_why
        if w.codec is None:
            return {"path": "in the worker", "how": how, "why": why if not w.driven else "driven by the caller"}
        return {"path": "codec thread" + (" while 2+ streams run" if w.codec_min_rows > 1 else ""), "how": how,
                "why": why}

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.graphs is not None

    def close(self) -> None:
        """Stop the worker thread; queued and running requests fail with a TTSError."""
        self.worker.close()

    # --- what this checkpoint offers ------------------------------------------------------------
    @property
    def precision(self) -> str:
        """Short label of the talker's numerics for UIs and APIs: "fp32", "bf16", "int8 weights (bf16 ...)"."""
        return self.model.precision

    @property
    def lossy(self) -> bool:
        """True in a quantised mode (weights are an approximation of the checkpoint's): label it where shown."""
        return self.model.lossy

    @property
    def kind(self) -> str:
        return self.config.tts_model_type

    @property
    def speakers(self) -> list[str]:
        return self.config.speakers

    @property
    def languages(self) -> list[str]:
        return self.config.languages

    @property
    def supports_instruct(self) -> bool:
        return self.config.supports_instruct

    @property
    def hidden_size(self) -> int:
        return self.config.talker.hidden_size

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def device(self) -> torch.device:
        """Where the model computes ("cpu", "cuda:0")."""
        return self.model.device

    @property
    def supports_clone(self) -> bool:
        """True for a Base checkpoint: `clone_voice` makes voices from reference clips."""
        return self.config.supports_clone

    @property
    def precision_why(self) -> str:
        """Why `precision` is what it is when `quantize="auto"` chose it (what was measured on this CPU);
        "" when the caller named the mode."""
        return self.model.quantize_why

    def load_state(self) -> dict[str, int]:
        """How full the engine is right now: {"running": requests holding a cache row, "waiting": queued requests,
        "max_waiting": the queue's bound (beyond it `stream` raises EngineBusyError), "rows": cache rows,
        "admission": "rows" or "realtime", "step_ms": the measured step at the running batch (None before),
        "realtime_streams": the most streams estimated to keep real time together, "retry_after_s": the seconds a
        refused request would be told to wait (from the queue's measured drain rate)}."""
        return self.scheduler.counts()

    def speaker_id(self, speaker: str) -> int:
        """The codec-embedding row of a CustomVoice preset speaker (case-insensitive name); TTSError naming the
        speakers there are for an unknown one. Reads the config only: a cheap check of a name."""
        return self._speaker_id(speaker)

    def preset_embedding(self, speaker: str) -> torch.Tensor:
        """The codec-embedding row of a CustomVoice speaker [H] (float32, CPU): the basis for blending presets."""
        sid = self._speaker_id(speaker)
        return self.model.talker.model.codec_embedding.weight[sid].detach().float().cpu().clone()

    # --- voices -----------------------------------------------------------------------------------
    def clone_voice(self, ref_audio, ref_text: str | None = None, x_vector_only: bool = False,
                    name: str = "") -> Voice:
        """Make a voice from a reference clip (path, bytes or (array, sr)). ICL mode (the default) needs the
        clip's transcript; x-vector-only mode uses the speaker embedding alone."""
        if not self.config.supports_clone:
            raise TTSError("voice cloning needs a Base checkpoint (Qwen3-TTS-12Hz-*-Base)")
        from tts_engine.audio import load_audio, resample
        if not x_vector_only and not (ref_text or "").strip():
            raise TTSError("in-context cloning needs the transcript of the reference clip "
                           "(or turn on x-vector-only mode)")
        wav, sr = load_audio(ref_audio)
        if wav.shape[0] < sr * 0.1:
            raise TTSError("the reference clip is too short (at least 0.1 s is needed, 3-10 s works best)")
        key = reference_key(wav, sr, ref_text, x_vector_only)
        if (hit := self.reference_cache.get(key, name)) is not None:
            return hit
        with self._lock, torch.inference_mode():
            if (hit := self.reference_cache.get(key, name)) is not None:   # cloned meanwhile by another thread
                return hit
            target = int(self.config.speaker_encoder.get("sample_rate", 24000))
            wav_se = wav if sr == target else resample(wav, sr, target)
            emb = self.model.speaker_encoder.embed(torch.from_numpy(wav_se).float()).float().cpu()
            codes = None if x_vector_only else self.model.speech_tokenizer.encode(wav, sr)
            voice = Voice(kind="xvector" if x_vector_only else "icl", name=name, embedding=emb, ref_codes=codes,
                          ref_text=None if x_vector_only else ref_text.strip(), model_type=self.kind,
                          hidden_size=self.hidden_size)
            self.reference_cache.put(key, dataclasses.replace(voice, name="", meta={}))
        return voice

    def voice_from_embedding(self, vector, name: str = "", meta: dict | None = None) -> Voice:
        return Voice(kind="embedding", name=name, embedding=check_embedding(vector, self.hidden_size),
                     model_type=self.kind, hidden_size=self.hidden_size, meta=meta or {})

    # --- synthesis --------------------------------------------------------------------------------
    def synthesize(self, text: str, **kw) -> np.ndarray:
        """The whole waveform (float32, 24 kHz). Same arguments as `stream`."""
        s = self.stream(text, **kw)
        parts = list(s)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def stream(self, text: str, *, voice: Voice | str | None = None, language: str = "auto",
               instruct: str | None = None, seed: int | None = None, sampling: SamplingParams | dict | None = None,
               greedy: bool = False, max_new_tokens: int | None = None, non_streaming_mode: bool | None = None,
               first_chunk_frames: int | tuple[int, ...] = 2, max_chunk_frames: int = 12,
               reproducible: bool = False) -> TTSStream:
        """Float32 PCM chunks at 24 kHz while generating: the first after `first_chunk_frames` frames
        (80 ms each), later ones doubling up to `max_chunk_frames`. A tuple gives the first chunks' sizes, e.g.
        (1, 1): two one-frame chunks, then 2, 4, 8, ... (the second audio comes one frame after the first).
        reproducible: the audio is the same bits whatever else the engine runs beside it: its chunks are cut on
        its own schedule (not aligned with other streams') and each is decoded alone (docs/long-form.md)."""
        req, seed = self._make_request(text, voice, language, instruct, seed, sampling, greedy, max_new_tokens,
                                       non_streaming_mode, first_chunk_frames, max_chunk_frames)
        req.reproducible = bool(reproducible)
        seq = Sequence(req)
        self.worker.submit(seq)   # EngineBusyError when the waiting queue is full
        return TTSStream(seq, self, seed, driven=self.worker.driven)

    submit = stream

    def drive_in_caller(self) -> None:
        """Serve without the worker thread from now on: every stream's `next()` runs the engine's frame steps in
        the calling thread until its next chunk is ready (streams open at once still batch: stepping one
        advances all), and `cancel()` steps until the request has left. The same frame step as the worker
        thread's (`EngineWorker.step`). For ZeroGPU's `@spaces.GPU` functions, where the GPU exists only in the
        calling thread of a forked process. Raises TTSError once the worker thread has started."""
        self.worker.drive_in_caller()

    @property
    def driven_by_caller(self) -> bool:
        return self.worker.driven

    # --- internals ---------------------------------------------------------------------------------
    def _speaker_id(self, speaker: str) -> int:
        spk = self.config.talker.spk_id
        key = str(speaker).strip().lower()
        if key not in spk:
            if not spk:
                raise TTSError("this checkpoint has no preset speakers")
            raise TTSError(f"unknown speaker {speaker!r}; choose one of: {', '.join(sorted(spk))}")
        return int(spk[key])

    def _make_request(self, text, voice, language, instruct, seed, sampling, greedy, max_new_tokens,
                      non_streaming_mode, first_chunk_frames, max_chunk_frames) -> tuple[Request, int]:
        cfg, tc = self.config, self.config.talker
        if not isinstance(text, str) or not text.strip():
            raise TTSError("the text is empty")
        if len(text) > MAX_TEXT_CHARS:
            raise TTSError(f"the text is too long ({len(text)} characters; the limit is {MAX_TEXT_CHARS})")
        language = (language or "auto").strip().lower()
        if language not in self.languages:
            raise TTSError(f"unsupported language {language!r}; choose one of: {', '.join(self.languages)}")
        if instruct is not None and instruct.strip() == "":
            instruct = None
        if instruct is not None and not cfg.supports_instruct:
            raise TTSError("this checkpoint does not follow instructions (use a 1.7B CustomVoice or a "
                           "VoiceDesign checkpoint)")

        if isinstance(voice, str):
            voice = Voice(kind="preset", speaker=voice)
        speaker_vec, speaker_name, ref_codes, ref_text = None, None, None, None
        if cfg.tts_model_type == "custom_voice":
            if voice is None:
                raise TTSError("choose a speaker: " + ", ".join(self.speakers))
            if voice.kind == "preset":
                speaker_name = voice.speaker.strip().lower()
                speaker_vec = self.model.talker.model.codec_embedding.weight[self._speaker_id(speaker_name)]
            elif voice.kind == "embedding":
                speaker_vec = self._fit_embedding(voice)
            else:
                raise TTSError("CustomVoice checkpoints take a preset speaker or an embedding, not a clone "
                               "(use a Base checkpoint to clone)")
        elif cfg.tts_model_type == "base":
            if voice is None:
                raise TTSError("a Base checkpoint needs a voice: a reference clip, a voice file or an embedding")
            if voice.kind == "preset":
                raise TTSError("Base checkpoints have no preset speakers; clone a voice instead")
            if voice.kind == "reference":   # a clip carried as the voice: clone it now
                wav, sr = voice.clip()
                voice = self.clone_voice((wav, sr), ref_text=voice.ref_text,
                                         x_vector_only=bool(voice.meta.get("x_vector_only", not voice.ref_text)))
            speaker_vec = self._fit_embedding(voice)
            if voice.kind == "icl":
                ref_codes, ref_text = voice.ref_codes, voice.ref_text
        else:  # voice_design
            if voice is not None:
                raise TTSError("VoiceDesign checkpoints take no voice; describe it in the instruction")

        if non_streaming_mode is None:  # the official wrapper's defaults per model kind
            non_streaming_mode = cfg.tts_model_type != "base"

        tok = self.model.tokenizer
        dev = self.model.device
        text_ids = tok.assistant_ids(text).to(dev)
        instruct_ids = tok.instruct_ids(instruct).to(dev) if instruct is not None else None
        ref_ids = tok.ref_ids(ref_text).to(dev) if ref_text is not None else None

        language_id = None if language == "auto" else int(tc.codec_language_id[language])
        if speaker_name is not None and language in ("chinese", "auto"):
            dialect = tc.spk_is_dialect.get(speaker_name, False)
            if dialect:
                language_id = int(tc.codec_language_id[dialect])

        with torch.inference_mode():
            prompt: Prompt = self.model.prompts.build(
                text_ids, language_id=language_id, speaker=speaker_vec, instruct_ids=instruct_ids,
                non_streaming=non_streaming_mode, ref_text_ids=ref_ids, ref_codes=ref_codes)

        params = self._sampling(sampling, greedy, max_new_tokens)
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise TTSError("the seed must be a non-negative integer")
        params.seed = int(seed)
        req = Request(prompt=prompt, params=params, first_chunk_frames=_chunk_frames(first_chunk_frames),
                      max_chunk_frames=int(max_chunk_frames), ref_codes=ref_codes)
        return req, int(seed)

    def _fit_embedding(self, voice: Voice) -> torch.Tensor:
        if voice.kind == "preset":
            raise TTSError("expected a cloned or embedding voice")
        emb = check_embedding(voice.embedding, self.hidden_size)
        return emb.to(self.model.device, self.model.dtype)

    def _sampling(self, sampling, greedy, max_new_tokens) -> SamplingParams:
        params = dataclasses.replace(self.model.generation_defaults)
        if isinstance(sampling, SamplingParams):
            params = SamplingParams(**sampling.__dict__)
        elif isinstance(sampling, dict):
            for k, v in sampling.items():
                if v is None:
                    continue
                if k not in params.__dataclass_fields__ or k == "seed":
                    raise TTSError(f"unknown sampling setting {k!r}")
                setattr(params, k, type(getattr(params, k))(v))
        elif sampling is not None:
            raise TTSError("sampling must be a dict or SamplingParams")
        if greedy:
            params.do_sample = False
            params.subtalker_dosample = False
        if max_new_tokens is not None:
            params.max_new_tokens = int(max_new_tokens)
        for name in ("temperature", "subtalker_temperature"):
            if not (getattr(params, name) > 0):
                raise TTSError(f"{name} must be > 0")
        for name in ("top_p", "subtalker_top_p"):
            if not (0 < getattr(params, name) <= 1):
                raise TTSError(f"{name} must be in (0, 1]")
        if params.top_k < 0 or params.subtalker_top_k < 0:
            raise TTSError("top_k must be >= 0")
        if not (params.repetition_penalty > 0):
            raise TTSError("repetition_penalty must be > 0")
        if params.max_new_tokens < 1:
            raise TTSError("max_new_tokens must be at least 1")
        return params

    # --- for tools and benchmarks: documented, stable -------------------------------------------------------------
    # bench/ uses these, never the private methods above (tests/test_bench_public_api.py checks it); each calls the
    # internals in one line, so a change inside the engine changes only that line.

    def make_request(self, text: str, *, voice: Voice | str | None = None, language: str = "auto",
                     instruct: str | None = None, seed: int | None = None,
                     sampling: SamplingParams | dict | None = None, greedy: bool = False,
                     max_new_tokens: int | None = None, non_streaming_mode: bool | None = None,
                     first_chunk_frames: int | tuple[int, ...] = 2, max_chunk_frames: int = 12) -> tuple[Request, int]:
        """The request that `stream` with the same arguments would submit (checked: TTSError on bad input; its prompt
        built), not submitted -> (request, seed). A benchmark runs it on an idle runner row itself:
        `engine.runner.prefill(row, req.prompt, req.params)`, then `decode` / `complete` + `advance`."""
        return self._make_request(text, voice, language, instruct, seed, sampling, greedy, max_new_tokens,
                                  non_streaming_mode, first_chunk_frames, max_chunk_frames)

    def govern_threads(self, on: bool) -> None:
        """The thread governor on (a fresh `threads.ThreadGovernor`, where the engine runs 2+ threads) or off (every
        frame with the process's threads), between requests: `govern_threads` of `__init__`, switched later."""
        self._govern_threads(on)

    def wrap(self, part: str, wrapper):
        """Route every call of one part of the engine's work through `wrapper(inner) -> callable` (on this engine's
        objects only; e.g. a timer around `inner`) -> a function that puts the part back. Parts: "worker step" (one
        step of the worker: admissions, a frame of the running rows, the chunks that go out), "prefill" (one
        request's prompt), "emit" (chunks going out after a frame), "code predictor" (a frame's predictor half ->
        codes), "talker step" (a frame's talker half -> done flags), "between halves" (a split frame's codes handed
        over: the chunk decoded here or passed to the codec thread), "talker stack" (the talker's decoder stack
        call), "codec thread" (one decode on the codec thread; while there is one)."""
        w, r = self.worker, self.runner
        points = {"worker step": (w, "_step"), "prefill": (w, "_prefill"), "emit": (w, "_emit"),
                  "code predictor": (r, "_predict_residuals"), "talker step": (r, "_advance"),
                  "between halves": (r, "_hand_over"), "talker stack": (self.model.talker.model, "run"),
                  "codec thread": (w.codec, "_decode")}
        obj, name = points.get(part, (None, None))
        if obj is None:
            raise ValueError(f"no part {part!r} to wrap in this engine; parts: "
                             + ", ".join(k for k, (o, _) in points.items() if o is not None))
        had, inner = name in vars(obj), getattr(obj, name)
        setattr(obj, name, wrapper(inner))
        return lambda: setattr(obj, name, inner) if had else delattr(obj, name)
