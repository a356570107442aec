"""`speed` for the speech API and the page: a pitch-preserving time stretch (the Rubber Band library, bundled in
the `pylibrb` wheel: no system package). `python -m bench.time_stretch` measures it on the preset clips.

Speed 2.0 halves the length and keeps the pitch; 0.5 doubles it. Whole responses are stretched by Rubber Band's
offline mode, which studies the whole clip first (`change_speed`: the options of `pedalboard.time_stretch` with
high quality and "mixed" transients, which it replaced; same samples up to float rounding). Streams go through
Rubber Band's real-time mode (`StreamStretcher`): one stretcher for the whole stream, fed chunk by chunk as they
are generated, so there are no seams to hear; the first stretched audio leaves after 1-3 generated frames.
"""
from __future__ import annotations

import numpy as np

SPEED_MIN, SPEED_MAX = 0.25, 4.0
STUDY_BLOCK = 2048          # samples per study() call of the offline stretch


def change_speed(wav: np.ndarray, sr: int, speed: float) -> np.ndarray:
    """Float32 mono PCM played `speed` times as fast, same pitch and formants. Length: round(len / speed)."""
    if not SPEED_MIN <= speed <= SPEED_MAX:
        raise ValueError(f"speed must be between {SPEED_MIN} and {SPEED_MAX}, got {speed}")
    wav = np.asarray(wav, dtype=np.float32)
    if abs(speed - 1.0) < 1e-6 or wav.size == 0:
        return wav
    import pylibrb
    from pylibrb import Option

    pylibrb.set_default_logging_level(0)
    # "mixed" transients: crisp consonant onsets without the phasiness "crisp" adds to sustained vowels
    rb = pylibrb.RubberBandStretcher(
        sample_rate=int(sr), channels=1, initial_time_ratio=1.0 / float(speed),
        options=Option.PROCESS_OFFLINE | Option.THREADING_NEVER | Option.CHANNELS_TOGETHER | Option.PitchHighQuality
        | Option.ENGINE_FINER | Option.TRANSIENTS_MIXED | Option.DETECTOR_COMPOUND | Option.FORMANT_PRESERVED)
    x, n = wav[None, :], wav.size
    rb.set_expected_input_duration(n)
    for i in range(0, n, STUDY_BLOCK):                      # offline: Rubber Band sees the whole clip first
        rb.study(np.ascontiguousarray(x[:, i:i + STUDY_BLOCK]), final=i + STUDY_BLOCK >= n)
    block = min(n, rb.get_process_size_limit())              # Rubber Band takes at most 2^19 samples per call
    rb.set_max_process_size(block)
    out, i = [], 0
    while i < n or rb.available() > 0:
        if i < n:
            rb.process(np.ascontiguousarray(x[:, i:i + block]), final=i + block >= n)
            i += block
        if rb.available() > 0:
            out.append(rb.retrieve(rb.available())[0])
        elif i >= n:
            break
    y = np.concatenate(out) if out else np.zeros(0, np.float32)
    return np.clip(y, -1.0, 1.0).astype(np.float32, copy=False)


class StreamStretcher:
    """A pitch-preserving time stretch of a stream: `push` each float32 chunk as it comes and get what is ready,
    `finish` once for the rest. The output has round(samples in / speed) samples in all (gapless: one Rubber Band
    real-time stretcher runs across every chunk)."""

    BLOCK = 4096          # samples handed to Rubber Band per call (its process size; bigger chunks are split)

    def __init__(self, sr: int, speed: float):
        if not SPEED_MIN <= speed <= SPEED_MAX:
            raise ValueError(f"speed must be between {SPEED_MIN} and {SPEED_MAX}, got {speed}")
        import pylibrb
        from pylibrb import Option

        pylibrb.set_default_logging_level(0)                 # no "forced to increase buffer" chatter on stderr
        self.speed = float(speed)
        self.rb = pylibrb.RubberBandStretcher(
            sample_rate=int(sr), channels=1, initial_time_ratio=1.0 / self.speed,
            options=Option.PROCESS_REALTIME | Option.ENGINE_FINER | Option.TRANSIENTS_MIXED)
        self.rb.set_max_process_size(self.BLOCK)
        self.to_skip = self.rb.get_start_delay()             # the stretcher's own delay: dropped from the output
        self.n_in = self.n_out = 0
        self.done = False
        pad = self.rb.get_preferred_start_pad()
        if pad:
            self._feed(np.zeros(pad, np.float32), final=False)

    def _feed(self, x: np.ndarray, final: bool) -> list[np.ndarray]:
        out = []
        n = len(x)
        for i in range(0, max(n, 1), self.BLOCK):
            block = x[i:i + self.BLOCK]
            self.rb.process(np.ascontiguousarray(block[None, :], dtype=np.float32), final=final and i + self.BLOCK >= n)
            out.extend(self._drain())
        return out

    def _drain(self) -> list[np.ndarray]:
        out = []
        while (a := self.rb.available()) > 0:
            y = self.rb.retrieve(a)[0]
            if self.to_skip:
                k = min(self.to_skip, len(y))
                y, self.to_skip = y[k:], self.to_skip - k
            if len(y):
                out.append(y)
        return out

    def _take(self, parts: list[np.ndarray], limit: int | None = None) -> np.ndarray:
        y = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if limit is not None:
            y = y[: max(0, limit - self.n_out)]
        self.n_out += len(y)
        return np.clip(y, -1.0, 1.0).astype(np.float32, copy=False)

    def push(self, chunk: np.ndarray) -> np.ndarray:
        chunk = np.asarray(chunk, dtype=np.float32)
        if self.done:
            raise RuntimeError("the stream was finished")
        self.n_in += len(chunk)
        return self._take(self._feed(chunk, final=False)) if len(chunk) else np.zeros(0, np.float32)

    def finish(self) -> np.ndarray:
        """The rest of the stretched stream, trimmed or padded so the whole is round(samples in / speed) long."""
        if self.done:
            return np.zeros(0, np.float32)
        self.done = True
        total = int(round(self.n_in / self.speed))
        y = self._take(self._feed(np.zeros(0, np.float32), final=True), limit=total)
        if self.n_out < total:                                 # Rubber Band gave a few samples less: pad
            y = np.concatenate([y, np.zeros(total - self.n_out, np.float32)])
            self.n_out = total
        return y
