"""The engine worker: the one thread that owns the device.

Each iteration is one frame boundary:
  1. drop cancelled sequences (their rows are free again within one frame),
  2. admit waiting sequences into free rows and prefill them (newcomers join the running batch),
  3. decode one frame for every running sequence in one batched call,
  4. the frame's codes and end flags reach the host in one copy (`ModelRunner.read_back`) and join every row's
     pending frames in one numpy write (a buffer by cache row); for sequences whose chunk is complete or ended: a
     codec decode batched across them (their decoder states rows of one `codec.state_pool.CodecStatePool`), and their
     audio goes to their output queues.
A step's host work does no Python per running row: the running rows are kept between steps while none joins or
leaves, cancelled rows are looked for only after a cancel, and only the rows whose chunk goes out meet Python.
Newcomers admitted together are prefilled in one batch (`ModelRunner.prefill_batch`), at most
`prefill_tokens_per_step` prompt positions per step while other streams run. On a GPU the host runs one frame
behind the device (`pipelined`): step 3 launches the next frame before step 4 handles the previous one.
An exception while serving one sequence fails that sequence only.

With `overlap_codec` on (`codec_thread.CodecThread`), step 4 hands the codes of every chunk but a sequence's first
to the codec thread and goes on with the next frame; a sequence's first chunk is still decoded here (nothing to
overlap it with yet, and its first audio must not wait), and a sequence's end goes through the codec thread so it
comes after its last audio. With `overlap_codec("streams")` chunks go to the codec thread only while two or more
sequences run (one stream decodes here, as with it off): the codec's share of a several-stream frame then runs on a
second core beside the next frame's generation. With `overlap_codec("auto")` a `codec_choice.CodecChoice` decides at
each emission, per batch size, by the measured cost of a frame each way (the codec thread, or here with all the
process's threads), and the last chunks of a batch that leaves nothing else to generate decode here with all threads.

Chunks on a shared frame clock (`align_chunks`, on): a sequence's chunks after its first follow its schedule (doubling
up to `max_chunk_frames`), but a chunk is cut earlier, at the frame where the current chunk of another running
sequence with the same scheduled size ends, when that frame comes within it. Streams that started a few frames apart
then cut their chunks on the same frames from their second or third chunk on, and those decode as one batch (one
codec call for all, instead of e.g. 1 + 3 rows a frame apart). A first chunk is never cut (first audio as soon as
possible), no chunk is made longer, a lone stream keeps its schedule, and a batch decodes each row as it would alone
(`codec_thread.decode_group`). A `reproducible` request (`TTSEngine.stream`) is never cut early and decodes in a
group of its own: its samples do not depend on which streams ran beside it (chunk boundaries change the codec's
rounding; its codes never depend on them).
"""
from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
import traceback
from collections import defaultdict

import numpy as np
import torch

from tts_engine.errors import TTSError
from tts_engine.cpu import deferred_trials
from tts_engine.cpu.codec_choice import HERE, THREAD, CodecChoice
from tts_engine.codec.state_pool import CodecStatePool
from tts_engine.engine.codec_thread import ChunkGroup, CodecThread, decode_group, drop_state
from tts_engine.engine.model_runner import ModelRunner
from tts_engine.engine.scheduler import Scheduler, Sequence, Status
from tts_engine.cpu.threads import MATMUL, PREDICTOR, TALKER, ThreadGovernor, situation

log = logging.getLogger("tts_engine")
# a step's prefill batch while streams run: about one frame's time at batch 64 on a GPU for the 0.6B model (a batch's
# prompts are ~100-300 positions each); on a CPU a frame holds far fewer, but there requests rarely arrive together
PREFILL_TOKENS_PER_STEP = 2048
_ROW = operator.attrgetter("row")


class EngineWorker:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, speech_tokenizer, primed=None):
        """`primed`: a voices.reference_cache.DecoderPrimeCache (decoder states after ICL reference codes, reused
        by the next request with the same reference), or None to prime every request afresh."""
        self.runner, self.scheduler, self.speech_tokenizer = runner, scheduler, speech_tokenizer
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.primed = primed
        self._start_lock = threading.Lock()
        self.steps = 0
        self.driven = False   # the callers step this engine themselves (`drive_in_caller`): no thread
        self.codec: CodecThread | None = None   # set by `overlap_codec`: later chunks decode on their own thread
        self.codec_min_rows = 1   # chunks go to the codec thread only while at least this many sequences run
        self.codec_choice: CodecChoice | None = None   # overlap_codec("auto"): where chunks decode, measured
        self.governor: ThreadGovernor | None = None   # CPU: the frames' OpenMP threads, chosen by measuring them
        self.matmul_threads = None    # threads.MatmulThreads of the runner's model (the governor's "matmul" option)
        self._default_threads = torch.get_num_threads()
        self._governing = None   # (governor, rows) while a governed split frame runs: its talker half is chosen apart
        self._split_frames: bool | None = None   # None: `split_frames` decides by the device
        self.frame = 0              # frames run so far (the shared clock that chunks are cut on)
        self.align_chunks = True    # later chunks cut on frames shared with other streams (the module's doc)
        # poll(no_row_held) -> done, called in this engine's thread at each frame boundary until it says done
        # (cpu_build.attach_later: the CPU fast paths, once our library's background build has loaded it)
        self.between_frames = None
        self.codec_pool: CodecStatePool | None = None   # every running stream's codec decoder state, one row each
        self._pipelined: bool | None = None   # None: `pipelined` decides by the device
        self._unprefilled: list[Sequence] = []   # admitted, prompt not run yet (the next steps' prefill batches)
        # prompt positions prefilled per step while other streams run (the rest wait a frame); all when none runs
        self.prefill_tokens_per_step = PREFILL_TOKENS_PER_STEP
        self._inflight = None   # pipelined: (sequences, ModelRunner.read_back handle, ...) of the frame still running
        # every running row's frames of its current chunk, by cache row (moved with the row, `_end`): frame k of row r
        # is _pend[r, k] (16 codes, then the end flag), _npend[r] of them so far, the chunk goes out at _target[r]
        # frames; a frame's rows join them in one numpy write (`_take`), and only the rows whose chunk is then full
        # (or ended) meet Python
        self._pend = np.zeros((runner.rows, 16, 17), dtype=np.int64)
        self._npend = np.zeros(runner.rows, dtype=np.int64)
        self._target = np.zeros(runner.rows, dtype=np.int64)
        self._rows_key = None   # (scheduler.version, unprefilled) of `_rows_cache`
        self._rows_cache = None   # (running sequences by row, their rows, the same as an array): `_running_rows`
        self._looked = None   # (scheduler.cancels, codec thread's failed decodes) at the last look for ended rows
        self._row_errors = True   # a deferred decode (split frames) failed here since the last look

    def overlap_codec(self, on: bool | str, threads: int | None = 1, nice: int = 0) -> None:
        """Decode chunks after each sequence's first on a codec thread with `threads` intra-op threads (None: the
        process default), overlapped with generation; "streams": only while two or more sequences run (a lone
        stream's chunks decode here unless its earlier ones are still on the codec thread); "auto": where
        `CodecChoice` measures it cheaper for the batch size at hand (see the module's doc); off: in this thread,
        between frames. Takes effect between frames (call it while no request runs); not with a caller-driven
        engine (no threads there). nice: the codec thread's priority lowered by that much (`CodecThread`)."""
        if on not in (True, False, "streams", "auto"):
            raise ValueError(f"overlap_codec: True, False, 'streams' or 'auto', not {on!r}")
        old, self.codec = self.codec, None
        if old is not None:
            old.close()
        self.codec_min_rows = 2 if on == "streams" else 1
        if on == "auto":   # what an earlier "auto" measured stays (a switch back and forth, e.g. python -m bench ab)
            self._kept_choice = self.codec_choice = getattr(self, "_kept_choice", None) or CodecChoice()
        else:
            self.codec_choice = None
        if on and not self.driven:
            self.codec = CodecThread(lambda: self.speech_tokenizer.decoder, threads,
                                     on_error=lambda seq, e: _user_error(type(e), e), nice=nice)
            self.codec.wake = self.wake

    # --- lifecycle ---------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        if self.driven:   # the caller runs the steps (`run_until_output`)
            return
        with self._start_lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="tts-engine-worker", daemon=True)
                self.thread.start()
        self.wake.set()

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        if self.codec is not None:
            self.codec.close()   # the chunks and endings handed over so far, then the thread stops
        for seq in self.scheduler.drain_waiting() + list(self.scheduler.running):
            seq.finish(TTSError("the engine was shut down"))

    def _loop(self) -> None:
        while not self.stopping.is_set():
            if self.scheduler.idle():
                self._between_frames()
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            self.step()

    def step(self) -> None:
        """One frame boundary for every sequence: the body of the worker thread's loop, and what a caller that
        drives the engine itself runs (`run_until_output`, `settle`)."""
        self._between_frames()
        try:
            with torch.inference_mode():
                self._step()
        except Exception:  # a bug in the loop itself: fail everyone running, keep serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            for seq in list(self.scheduler.running):
                self._fail(seq, RuntimeError("internal engine error"))

    def _between_frames(self) -> None:
        if self.between_frames is not None and self.between_frames(not self.scheduler.running):
            self.between_frames = None

    # --- driven by the caller, in the caller's thread (no worker thread) -------------------------------------
    def drive_in_caller(self) -> None:
        """From now on the callers step this engine themselves, in their own thread, and no worker thread is ever
        started (ZeroGPU: the GPU exists only in the calling thread of a `@spaces.GPU` function, and no thread may
        be started for GPU work). A reader calls `run_until_output(seq)` before each read of `seq.out`, and
        `settle(seq)` after cancelling it."""
        with self._start_lock:
            if self.thread is not None and self.thread.is_alive():
                raise TTSError("this engine already runs its worker thread")
            self.driven = True
            self.overlap_codec(False)

    def run_until_output(self, seq: Sequence) -> None:
        """Run frame steps (for every running sequence, `seq` among them) until `seq` has something to read."""
        while seq.out.empty() and not self.scheduler.idle():
            self.step()

    def settle(self, seq: Sequence) -> None:
        """Run frame steps until a cancelled `seq` has left the engine (its row is free again)."""
        while seq.status is not Status.FINISHED and not self.scheduler.idle():
            self.step()

    # --- one frame boundary ----------------------------------------------------------------------------
    def govern_threads(self, governor: ThreadGovernor | None, matmul_threads=None) -> None:
        """Run every frame step with the OpenMP threads `governor` chooses by measuring frames (None: the process's
        threads, as before); `matmul_threads`: the switch of `threads.serial_between_matmuls` on the runner's model,
        for the governor's "matmul" option."""
        self.governor, self.matmul_threads = governor, matmul_threads

    def _use_threads(self, option) -> None:
        serial = option == MATMUL
        n = 1 if serial else int(option)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        if self.matmul_threads is not None:
            self.matmul_threads.set(serial)

    def _step(self) -> None:
        g = self.governor
        if g is None:
            return self._step_with(None, None)
        n_rows = min(len(self.scheduler.running) + len(self.scheduler.waiting), self.runner.rows)
        # a split frame: this choice is its predictor half's; the talker half's is made between the halves
        split = self.split_frames
        key = situation(n_rows, self.codec is not None and self.codec.busy, PREDICTOR if split else None)
        option = g.choose(key)
        self._use_threads(option)
        self._governing = (g, n_rows) if split else None
        try:
            self._step_with(g, (key, option))
        finally:
            self._governing = None
            self._use_threads(self._default_threads)
            if self.matmul_threads is not None:
                self.matmul_threads.set(False)

    def _step_with(self, g: ThreadGovernor | None, choice) -> None:
        seen = (self.scheduler.cancels, self.codec.failed if self.codec is not None else 0)
        # the running rows are looked at only after a cancel or a failed decode
        if seen != self._looked or self._row_errors or not self.scheduler.cancels_counted:
            self._looked, self._row_errors = seen, False
            for seq in list(self.scheduler.running):
                if seq.cancelled.is_set() or seq.codec_error is not None:
                    self._end(seq, seq.codec_error if self.codec is None else None)
        self._unprefilled += self.scheduler.admit()
        if self._unprefilled:
            self._prefill_some()
        active, rows, rows_np = self._running_rows()
        if self.pipelined:
            return self._step_pipelined(active, rows, rows_np)
        if not active:
            return
        deferred_trials.mark_busy()   # (trials deferred from the start wait for a quiet moment)
        n_active = len(active)
        busy = self.codec is not None and self.codec.busy
        t0 = time.perf_counter()
        box: dict = {}
        between = self._decode(active, box, rows, rows_np)   # whole frames, or (CPU) halves with the chunks between
        t1 = time.perf_counter()
        spent = t1 - t0 - between
        if self.codec_choice is not None:
            self.codec_choice.record_frame(n_active, busy, spent)
        ready = box.get("ready")   # (whole frames: rows whose chunk is full or whose frame was their last)
        if ready:
            self._emit(ready)
        if g is not None:
            self._record_threads(g, n_active, choice, box, t0, t1, spent)
        self.steps += 1

    @staticmethod
    def _record_threads(g: ThreadGovernor, n_active: int, choice, box: dict, t0: float, t1: float,
                        spent: float) -> None:
        """The frame's time to the governor: a split frame's halves each under its own situation and option (the
        predictor half from the frame's start to the hand-over, the talker half from the end of the hand-over to
        the talker step's return, not a last chunk's decode after it), else the whole frame's; only where the batch
        is the one the choice was keyed by."""
        key, option = choice
        if len(key) == 3 and "talker" not in box:   # (not split after all: the frame's rows changed, a failure)
            return
        if key == situation(n_active, key[1], key[2] if len(key) == 3 else None):
            g.record(key, option, box["t_in"] - t0 if len(key) == 3 else spent)
        if "talker" in box:
            tkey, topt = box["talker"]
            if tkey == situation(n_active, tkey[1], TALKER):
                g.record(tkey, topt, box.get("t_end", t1) - box["t_out"])

    @property
    def split_frames(self) -> bool:
        """CPU eager: each frame's codes go to `ModelRunner.on_frame_codes` between its two halves (the code
        predictor, the talker step) and the chunks it completes are decoded there, so a chunk's audio does not wait for the talker step after its last frame
        (first audio one talker step sooner). Settable; False: whole frames, then the chunks (as on a GPU)."""
        if self._split_frames is not None:
            return self._split_frames
        return self.runner.device.type == "cpu" and self.runner.graphs is None

    @split_frames.setter
    def split_frames(self, on: bool | None) -> None:
        self._split_frames = on

    def _between_halves(self, active: list[Sequence], codes: torch.Tensor, box: dict) -> None:
        """`ModelRunner.on_frame_codes` of a split frame: this frame's codes join each row's pending frames (its end
        flag is known after the talker step) and the chunks now complete are decoded. No row may end here (the
        talker step of these rows follows): a decode that raises marks its rows' `codec_error`."""
        t0 = box["t_in"] = time.perf_counter()
        box["codes"] = codes
        step = self.runner.read_back(codes).wait()   # [B, 17]: the codes, and 0 (the end flags come later)
        box["step"] = step
        rows_np = box["rows_np"]
        full = np.flatnonzero(self._take(rows_np, step) >= self._target[rows_np])
        if full.size:   # earlier frames' flags are all False here (a row ends at the frame its flag is set)
            self._emit([active[i] for i in full.tolist()], defer_failures=True)
        if self._governing is not None:   # the talker half's threads, for the situation it starts in
            g, n_rows = self._governing
            key = situation(n_rows, self.codec is not None and self.codec.busy, TALKER)
            option = g.choose(key)
            self._use_threads(option)
            box["talker"] = (key, option)
        box["t_out"] = time.perf_counter()
        box["s"] = box["t_out"] - t0

    def _after_halves(self, active: list[Sequence], done: torch.Tensor) -> None:
        """After a split frame's talker step: a row whose frame was its last ends now (its pending frames emitted,
        cut there); a row whose chunk decode failed ends with that error."""
        last, ends = [], []
        flags = done.cpu().numpy()   # (the one read of the frame; its codes came between the halves)
        look = np.flatnonzero(flags).tolist()   # only the rows that ended, and those whose decode failed
        if self._row_errors or (self.codec is not None and (self._looked is None or
                                                             self.codec.failed != self._looked[1])):
            look = range(len(active))
        for i in look:
            s = active[i]
            if s.status is not Status.RUNNING:
                continue
            if s.codec_error is not None:
                ends.append(s)
            elif flags[i]:
                n = self._npend[s.row]
                if n:
                    self._pend[s.row, n - 1, 16] = 1   # (this frame's: the row's last pending frame)
                    last.append(s)
                else:            # its last chunk went out between the halves
                    ends.append(s)
        for s in ends:
            if s.codec_error is not None and not isinstance(s.codec_error, TTSError):
                self._fail(s, s.codec_error)
            else:
                self._end(s, s.codec_error)
        if last:
            self._emit(last)     # cut at the flag, and ended

    def _prefill_some(self) -> None:
        """Prefill the admitted sequences waiting for it, together (`ModelRunner.prefill_batch`): all of them when no
        other stream runs, else as many as fit `prefill_tokens_per_step` prompt positions (at least one), so that
        running streams wait about one frame for it; the rest go in the next steps' batches."""
        waiting = [s for s in self._unprefilled if s.status is Status.RUNNING]
        others = len(self.scheduler.running) > len(waiting)
        batch, used = [], 0
        for s in waiting:
            n = s.request.prompt.prefill.shape[0]
            if batch and others and used + n > self.prefill_tokens_per_step:
                break
            batch.append(s)
            used += n
        self._unprefilled = waiting[len(batch):]
        if len(batch) == 1:
            try:
                self._prefill(batch[0])
            except Exception as e:
                self._fail(batch[0], e)
            return
        ready = []
        for s in batch:
            try:
                self.runner.check_prompt(s.request.prompt)
                self._prepare(s)
                ready.append(s)
            except Exception as e:
                self._fail(s, e)
        if not ready:
            return
        try:
            self.runner.prefill_batch([s.row for s in ready], [s.request.prompt for s in ready],
                                      [s.request.params for s in ready])
        except Exception as e:   # one at a time, so that a bad request fails alone
            log.warning("batched prefill of %d requests failed (%s); one at a time", len(ready), e)
            for s in list(ready):
                try:
                    self.runner.prefill(s.row, s.request.prompt, s.request.params)
                except Exception as e1:
                    ready.remove(s)
                    self._fail(s, e1)
        for s in ready:
            self._started(s)

    def _prefill(self, seq: Sequence) -> None:
        req = seq.request
        self._prepare(seq)
        self.runner.prefill(seq.row, req.prompt, req.params)
        self._started(seq)

    def _prepare(self, seq: Sequence) -> None:
        """A new stream's codec decoder state (primed with an ICL reference's codes)."""
        req = seq.request
        codec = self.speech_tokenizer.decoder
        if req.ref_codes is not None:  # ICL: prime the decoder with the reference audio's codes
            seq.decoder_state = self._pool_row(codec, self._primed_state(req.ref_codes, codec))
        else:
            seq.decoder_state = self._pool_row(codec)

    def _started(self, seq: Sequence) -> None:
        """A prefilled stream's chunk schedule; a request for at most one codebook-0 id ends here."""
        req = seq.request
        seq.chunk_sizes = req.chunk_sizes()
        seq.target = next(seq.chunk_sizes)
        self._npend[seq.row] = 0
        self._set_targets([seq])
        if req.params.max_new_tokens <= 1:  # the first drawn id is never completed into a frame
            self._end(seq)

    def _pool_row(self, codec, init=None):
        """A row of the codec state pool for a new stream, holding `init` (a one-row state) or the empty state."""
        template = init if init is not None else self._codec_template(codec)
        pool = self.codec_pool
        if pool is None or not pool.matches(template):
            if pool is not None and pool.live:   # (the decoder changed dtype mid-run: a pool for the new streams)
                log.info("codec decoder state: a new pool for %s", template.k.dtype)
            pool = self.codec_pool = CodecStatePool(template, rows=max(2, self.runner.rows))
        return pool.alloc(init)

    def _codec_template(self, codec):
        key = (id(codec), codec.pre_conv.conv.weight.dtype, codec.pre_conv.conv.weight.device)
        cached = getattr(self, "_template", None)
        if cached is None or cached[0] != key:
            cached = self._template = (key, codec.init_state(1, self.runner.device))
        return cached[1]

    def _primed_state(self, ref_codes: torch.Tensor, codec):
        """The decoder state after `ref_codes` [T, 16]: a copy of the cached one when these codes were seen."""
        key = self.primed.key(ref_codes) if self.primed is not None and self.primed.max_entries > 0 else None
        if key is not None and (cached := self.primed.get(key)) is not None:
            return cached.clone()
        state = codec.init_state(1, self.runner.device)
        codec.decode_step(ref_codes.to(self.runner.device).T[None], state)
        if key is not None:
            self.primed.put(key, state.clone())
        return state

    def _decode(self, active: list[Sequence], box: dict | None = None, rows: list[int] | None = None,
                rows_np: np.ndarray | None = None) -> float:
        """One frame for every sequence in `active` (in row order; `rows`, `rows_np`: their rows, as `_running_rows`
        gives them); -> seconds spent between the halves (decoding chunks) of a split frame, else 0. box: filled by
        a split frame's hand-over (`_between_halves`); box["ready"]: the sequences whose chunk goes out now (whole
        frames)."""
        if rows is None:
            active.sort(key=_ROW)
            rows = [s.row for s in active]
            rows_np = np.array(rows, dtype=np.int64)
        box = {} if box is None else box
        box["rows_np"] = rows_np
        self.frame += 1
        if self.split_frames:
            self.runner.on_frame_codes = lambda codes: self._between_halves(active, codes, box)
        try:
            codes, done = self.runner.decode(rows)
        except Exception:
            if "codes" in box:   # the talker step failed after the code predictor: retry it row by row
                self._advance_alone(active, box["codes"], _exc()[1])
                return box.get("s", 0.0)
            if len(active) == 1:
                self._fail(active[0], _exc()[1])   # logged there (not a TTSError), then made readable
                return 0.0
            # isolate the failing request: run each row alone (rows' state only advances on success)
            self.runner.on_frame_codes = None
            ready = []
            for s in active:
                try:
                    c, d = self.runner.decode([s.row])
                    step = self.runner.read_back(c, d).wait()
                except Exception as e:
                    self._fail(s, e)
                    continue
                row = np.array([s.row])
                if self._take(row, step)[0] >= s.target or step[0, 16]:
                    ready.append(s)
            box["ready"] = ready
            return 0.0
        finally:
            self.runner.on_frame_codes = None
        box["t_end"] = time.perf_counter()   # (the talker half's end: before a last chunk's decode below)
        if "codes" in box:
            self._after_halves(active, done)
            return box.get("s", 0.0)
        step = self.runner.read_back(codes, done).wait()   # the frame's one device-to-host copy
        box["ready"] = self._ready(active, rows_np, step)
        return 0.0

    # --- the frames of every row's current chunk: numpy over the rows, Python only for the rows that go out ---------
    def _running_rows(self) -> tuple[list[Sequence], list[int], np.ndarray]:
        """The running sequences that take part in a frame (prefilled), in row order, their rows, and the same as an
        array: kept between steps while the scheduler's running set and the unprefilled ones stay the same."""
        key = (self.scheduler.version, len(self._unprefilled))
        if key != self._rows_key:
            active = [s for s in self.scheduler.running if s.status is Status.RUNNING]
            if self._unprefilled:
                active = [s for s in active if s not in self._unprefilled]
            active.sort(key=_ROW)
            rows = [s.row for s in active]
            self._rows_key, self._rows_cache = key, (active, rows, np.array(rows, dtype=np.int64))
        return self._rows_cache

    def _take(self, rows: np.ndarray, step: np.ndarray) -> np.ndarray:
        """A frame's block `step` [B, 17] joins rows `rows`' pending frames -> their pending counts now [B]."""
        k = self._npend[rows]
        self._pend[rows, k] = step
        k += 1
        self._npend[rows] = k
        return k

    def _ready(self, seqs: list[Sequence], rows: np.ndarray, step: np.ndarray) -> list[Sequence]:
        """The frame `step` [B, 17] of `seqs` (at `rows`) taken -> those whose chunk is now full or ended."""
        go = self._take(rows, step) >= self._target[rows]
        go |= step[:, 16] != 0
        idx = np.flatnonzero(go)
        return [seqs[i] for i in idx.tolist()] if idx.size else []

    def _set_targets(self, seqs: list[Sequence]) -> None:
        """Each of `seqs`' chunk length (`Sequence.target`) into the row buffer (grown where a chunk is longer)."""
        for s in seqs:
            if s.target > self._pend.shape[1]:
                grown = np.zeros((self._pend.shape[0], max(s.target, 2 * self._pend.shape[1]), 17), dtype=np.int64)
                grown[:, :self._pend.shape[1]] = self._pend
                self._pend = grown
            self._target[s.row] = s.target

    # --- pipelined: the host one frame behind the device ---------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        """Whole frames with the host one frame behind the device (default on a GPU): each step launches the next
        frame of every running row, then reads the previous frame's codes and end flags (one pinned, event-gated
        copy, `ModelRunner.read_back`) and does its host work (chunks, the codec, endings) while the device runs the
        new frame. A row whose end flag is read has run one frame past its end (that frame is dropped). Settable;
        off: each frame's results are read right after it (on a CPU nothing runs ahead, so waiting costs nothing
        and a chunk goes out one frame sooner)."""
        if self._pipelined is not None:
            return self._pipelined
        return self.runner.device.type == "cuda" and not self.split_frames

    @pipelined.setter
    def pipelined(self, on: bool | None) -> None:
        self._pipelined = on

    def _step_pipelined(self, active: list[Sequence], rows: list[int] | None = None,
                        rows_np: np.ndarray | None = None) -> None:
        launched = self._launch(active, rows, rows_np) if active else None
        prev, self._inflight = self._inflight, launched
        if prev is not None:
            self._land(*prev)
        if active:
            self.steps += 1

    def _launch(self, active: list[Sequence], rows: list[int] | None = None, rows_np: np.ndarray | None = None):
        """Start one frame for every sequence in `active` (in row order, at `rows` / `rows_np` where given) -> (the
        sequences, its read-back, their rows then, the scheduler's version then), not waited for."""
        if rows is None:
            active.sort(key=_ROW)
            rows = [s.row for s in active]
            rows_np = np.array(rows, dtype=np.int64)
        if active:
            deferred_trials.mark_busy()
        self.frame += 1
        try:
            codes, done = self.runner.decode(rows)
        except Exception:
            if len(active) == 1:
                self._fail(active[0], _exc()[1])
                return None
            ok, cs, ds = [], [], []
            for s in active:   # isolate the failing request: each row alone (a row's state advances on success)
                try:
                    c, d = self.runner.decode([s.row])
                except Exception as e:
                    self._fail(s, e)
                    continue
                ok.append(s)
                cs.append(c)
                ds.append(d)
            if not ok:
                return None
            active, codes, done = ok, torch.cat(cs), torch.cat(ds)
            rows_np = None   # (the rows changed: `_land` reads them)
        return active, self.runner.read_back(codes, done), rows_np, self.scheduler.version

    def _land(self, seqs: list[Sequence], handle, rows_np: np.ndarray | None, version: int) -> None:
        """The host's part of a frame launched earlier: its codes and flags join the rows' pending frames, and the
        chunks now complete (or ended) go out. Where no row joined, left or moved since the launch, the launch's rows
        serve; otherwise each sequence's row now (a sequence that ended since drops its frame)."""
        step = handle.wait()
        if rows_np is None or version != self.scheduler.version:
            keep = [i for i, s in enumerate(seqs) if s.status is Status.RUNNING and s.row is not None]
            seqs, step = [seqs[i] for i in keep], step[keep]
            rows_np = np.array([s.row for s in seqs], dtype=np.int64)
        ready = self._ready(seqs, rows_np, step) if seqs else []
        if ready:
            self._emit(ready)

    def _advance_alone(self, active: list[Sequence], codes: torch.Tensor, exc: BaseException) -> None:
        """The talker step of a split frame raised for the batch: run it row by row; a row that fails again ends
        with its error."""
        if len(active) == 1:
            self._fail(active[0], exc)
            return
        done = torch.zeros(len(active), dtype=torch.bool)
        for i, s in enumerate(active):
            if s.status is not Status.RUNNING:
                continue
            try:
                done[i] = self.runner.advance([s.row], codes[i:i + 1])[0]
            except Exception as e:
                s.codec_error = s.codec_error or e   # ended (with this error) by _after_halves
        self._after_halves(active, done)

    def _emit(self, ready: list[Sequence], defer_failures: bool = False) -> None:
        """Decode (or hand to the codec thread) the pending frames of `ready` as chunks, cut at an end flag.
        defer_failures: a decode that raises marks its sequences' `codec_error` (the caller ends them later)
        instead of ending them now."""
        ready = self.scheduler.by_deadline(ready)   # the listeners holding the least audio decode first
        # the ready rows' pending frames [G, k, 17] (codes, end flag) are read from the row buffer in numpy: each row's
        # chunk is its frames up to its first end flag
        rows = np.array([s.row for s in ready], dtype=np.int64)
        ks = self._npend[rows]
        self._npend[rows] = 0
        flags = self._pend[rows, :max(1, int(ks.max())), 16] != 0
        flags &= np.arange(flags.shape[1]) < ks[:, None]
        ends_at = np.where(flags.any(1), flags.argmax(1) + 1, 0)
        ns = np.where(ends_at > 0, ends_at, ks).tolist()
        cut = list(zip(ready, ns, (ends_at > 0).tolist()))   # (seq, its chunk's frames, ends with it)
        # too few streams to overlap with, and nothing of theirs still on the codec thread: every chunk decodes here
        local = self.codec is not None and len(self.scheduler.running) < self.codec_min_rows and not self.codec.busy
        rows_n, choice, where = len(self.scheduler.running), self.codec_choice, None
        if choice is not None and self.codec is not None:
            where = choice.choose(rows_n, self.codec.busy)
            if self._nothing_after(cut) and not self.codec.busy:
                where = "last"   # nothing left to overlap with: here, with all threads (not a measured choice)
            local = where != THREAD
        groups: dict[tuple, list[int]] = defaultdict(list)   # (frames, here, alone) -> indices into `cut`
        for i, (s, n, ends) in enumerate(cut):
            here = self.codec is None or not s.request.codes or local      # a first chunk: decoded here
            s.finishing = ends
            # a reproducible request's chunks are decoded alone: its audio does not depend on its batch-mates
            groups[n, here, s.id if getattr(s.request, "reproducible", False) else None].append(i)
        codec = self.speech_tokenizer.decoder
        for (n, here, _alone), idx in groups.items():
            # the group's chunks as one host block [G, n, 16] (one numpy gather), each request's its own row of it
            block = self._pend[rows[idx], :n, :16]
            frames = torch.from_numpy(block)
            items = ChunkGroup(frames=frames)
            for j, i in enumerate(idx):
                s, f = cut[i][0], block[j]
                s.request.codes.add(f)
                items.append((s, f))
            if not here:
                done = None if where is None else \
                    (lambda sec, k=n * len(items): choice.record_decode(rows_n, THREAD, sec, k))
                self.codec.decode(items, on_done=done)
                continue
            try:
                if where in (HERE, "last") and all(len(s.request.codes) > n for s, _ in items):   # not first chunks
                    t0 = time.perf_counter()
                    with self._all_threads():
                        decode_group(codec, items)
                    if where == HERE:
                        choice.record_decode(rows_n, HERE, time.perf_counter() - t0, n * len(items))
                else:
                    decode_group(codec, items)
            except Exception as e:
                if defer_failures:
                    self._row_errors = True
                for s, _ in items:
                    if defer_failures:
                        log.error("codec decode failed for request %s: %s", s.id, e)
                        s.codec_error = _user_error(type(e), e)
                    else:
                        self._fail(s, e)
                continue
        going_on = []
        for s in ready:
            if s.status is Status.RUNNING:
                if s.finishing:
                    self._end(s)
                else:
                    going_on.append(s)
        self._next_chunks(going_on)
        self._set_targets(going_on)

    def _next_chunks(self, seqs: list[Sequence]) -> None:
        """The next chunk of each of `seqs` (whose chunk just went out): the schedule's next size, cut at the last
        frame within it where the current chunk of another running sequence of that scheduled size ends
        (`align_chunks`, the module's doc)."""
        for s in seqs:
            s.chunk_frames = s.target = next(s.chunk_sizes)
            s.chunk_end = self.frame + s.target   # (the frame its chunk ends at: one pending frame per frame)
        if not self.align_chunks or not seqs:
            return
        ends: dict[int, set] = defaultdict(set)   # scheduled size -> frames where such chunks of the others end
        going = set(map(id, seqs))
        for o in self.scheduler.running:
            if o.chunk_frames and o.status is Status.RUNNING and id(o) not in going:
                ends[o.chunk_frames].add(o.chunk_end)
        for s in seqs:
            shared = [e for e in ends.get(s.chunk_frames, ()) if self.frame < e < self.frame + s.target]
            if shared and not getattr(s.request, "reproducible", False):   # a reproducible request: its own schedule
                s.target = max(shared) - self.frame
            s.chunk_end = self.frame + s.target

    def _nothing_after(self, cut: list) -> bool:
        """Every running sequence ends with the chunks `cut` ((seq, frames, ..., ends with it)) and none waits: nothing is
        left to generate beside their decode."""
        if self.scheduler.waiting or len(cut) != len(self.scheduler.running):
            return False
        return all(c[-1] for c in cut)

    @contextlib.contextmanager
    def _all_threads(self):
        """The process's intra-op threads for a decode in this thread (the frame's option may be fewer), and the
        frame's own back after."""
        n, serial = torch.get_num_threads(), self.matmul_threads is not None and self.matmul_threads.serial
        if n == self._default_threads:
            yield
            return
        torch.set_num_threads(self._default_threads)
        try:
            yield
        finally:
            torch.set_num_threads(n)
            if serial:
                self.matmul_threads.set(True)

    # --- endings -------------------------------------------------------------------------------------
    def _end(self, seq: Sequence, item=None) -> None:
        if seq.row is not None:
            self.runner.release(seq.row)
            self._npend[seq.row] = 0
        self.scheduler.release(seq)
        while (move := self.scheduler.compact()) is not None:   # keep running rows dense (0..B-1)
            _, src, dst = move
            self.runner.move_row(src, dst)
            n = self._npend[dst] = self._npend[src]   # (the row's pending frames move with it)
            self._pend[dst, :n] = self._pend[src, :n]
            self._target[dst] = self._target[src]
            self._npend[src] = 0
        if self.codec is not None:   # after the chunks still being decoded
            seq.status = Status.FINISHED
            self.codec.finish(seq, item)
            return
        drop_state(seq)
        seq.finish() if item is None else seq.finish(item)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        if not isinstance(exc, TTSError):
            log.error("request %s failed: %s", seq.id, exc)
            if isinstance(exc, torch.cuda.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._end(seq, _user_error(type(exc), exc))

    # --- for tools and benchmarks: documented, stable -------------------------------------------------------------
    def next_chunks(self, seqs: list[Sequence]) -> None:
        """Cut the next chunk of each of `seqs` (whose chunk just went out) by the worker's rule: the schedule's next
        size, aligned with the other running sequences' chunks where `align_chunks` (the module's doc)."""
        self._next_chunks(seqs)

    @property
    def measured_codec_choice(self) -> CodecChoice | None:
        """What `overlap_codec("auto")` measured so far (kept while another setting serves), or None."""
        return getattr(self, "_kept_choice", None)


def _exc():
    import sys
    t, v, _ = sys.exc_info()
    return t, v


def _user_error(t, v) -> Exception:
    if isinstance(v, TTSError):
        return v
    if isinstance(v, torch.cuda.OutOfMemoryError):
        return TTSError("the GPU ran out of memory for this request; try a shorter text")
    return TTSError(f"synthesis failed ({t.__name__ if t else 'error'}); please try again")
