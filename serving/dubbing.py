"""SRT in -> one timed track (dubbing): each cue's speech placed at its start time, sped up to fit its slot where it
is too long (the Rubber Band offline stretch of serving/speed.py, pitch kept, within 0.5x-2x).

A cue's slot is its own time on screen (start to end). Its speech, with the silence at its ends trimmed, starts
exactly at the cue's time. Speech longer than the slot is played faster, up to
`MAX_SPEED`; speech that would need more is played at `MAX_SPEED` and reported (`fits: False`, `needed_speed`): it
runs past its end (mixed over whatever follows) rather than being cut. Speech is never slowed down to fill a slot
(below 1x it would drag); `MIN_SPEED` bounds the stretch for callers that ask for a fixed speed."""
from __future__ import annotations

import numpy as np

from serving.longform import trim_silence
from serving.speed import change_speed
from serving.subtitles import Cue

MIN_SPEED, MAX_SPEED = 0.5, 2.0
MAX_SRT_BYTES = 512 * 1024


def fit_speed(seconds: float, slot: float) -> tuple[float, bool, float]:
    """(speed to play `seconds` of speech at so that it fits `slot`, whether it fits, the speed it would need)."""
    if slot <= 0:
        return MAX_SPEED, False, float("inf")
    need = seconds / slot
    if need <= 1.0:
        return 1.0, True, need
    return min(need, MAX_SPEED), need <= MAX_SPEED + 1e-9, need


def build_track(cues: list[Cue], speech: list[np.ndarray], sr: int) -> tuple[np.ndarray, list[dict]]:
    """The track (float32 mono) and one report per cue: {cue, start, slot, speech, speed, needed_speed, fits}."""
    placed, report, end = [], [], 0
    for i, (q, x) in enumerate(zip(cues, speech)):
        x = trim_silence(np.asarray(x, np.float32))
        slot = q.end - q.start
        speed, fits, need = fit_speed(len(x) / sr, slot)
        y = change_speed(x, sr, speed) if speed != 1.0 and len(x) else x
        a = int(round(q.start * sr))
        placed.append((a, y))
        end = max(end, a + len(y))
        report.append({"cue": i + 1, "start": round(q.start, 3), "slot": round(slot, 3),
                       "speech": round(len(x) / sr, 3), "speed": round(speed, 3), "needed_speed": round(need, 3),
                       "fits": fits, "text": q.text})
    end = max(end, int(round(cues[-1].end * sr)) if cues else 0)
    track = np.zeros(end, np.float32)
    for a, y in placed:
        track[a:a + len(y)] += y
    return np.clip(track, -1.0, 1.0), report
