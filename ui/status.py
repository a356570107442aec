"""The status line under the player: stage, queue position, time to first audio, real-time factor, audio
length, sentence group k/n, seed, notes, and the random-weights warning. Markdown, one line."""
from __future__ import annotations


def status_line(stage: str, *, ttfa: float | None = None, compute: float = 0.0, audio_s: float = 0.0,
                seed: int | None = None, piece: int | None = None, pieces: int | None = None,
                queue: int | None = None, note: str = "", random_weights: bool = False, lossy: str = "") -> str:
    """`queue`: requests ahead of ours (0 = next in line); `compute`: seconds spent generating `audio_s`;
    `lossy`: the precision label of a quantised engine (shown so nobody mistakes it for the checkpoint's own)."""
    parts = [f"**{stage}**"]
    if queue is not None:
        parts.append(f"position in queue: {queue + 1} ({queue} ahead)")
    if ttfa is not None:
        parts.append(f"first audio {ttfa:.2f} s")
    if audio_s > 0 and compute > 0:
        parts.append(f"RTF {compute / audio_s:.2f}")
    if audio_s > 0:
        parts.append(f"{audio_s:.1f} s of audio")
    if pieces and pieces > 1:
        parts.append(f"part {piece}/{pieces}")
    if seed is not None:
        parts.append(f"seed {seed}")
    if note:
        parts.append(note)
    if lossy:
        parts.append(f"{lossy}: lossy")
    if random_weights:
        parts.append("⚠️ random weights: noise")
    return " · ".join(parts)
