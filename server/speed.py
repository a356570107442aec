"""`speed` for the speech API: a pitch-preserving time stretch of finished audio (Rubber Band, through Spotify's
`pedalboard`, whose wheels bundle the library: no system package).

    python -m server.speed        # measure it on the preset clips: length ratio, pitch kept (pYIN), time taken

Speed 2.0 halves the length and keeps the pitch; 0.5 doubles it. The stretch runs on a whole response (Rubber
Band's offline mode sees the whole clip, so nothing is cut at chunk seams); streamed responses are not stretched.
"""
from __future__ import annotations

import numpy as np

SPEED_MIN, SPEED_MAX = 0.25, 4.0


def change_speed(wav: np.ndarray, sr: int, speed: float) -> np.ndarray:
    """Float32 mono PCM played `speed` times as fast, same pitch and formants. Length: round(len / speed)."""
    if not SPEED_MIN <= speed <= SPEED_MAX:
        raise ValueError(f"speed must be between {SPEED_MIN} and {SPEED_MAX}, got {speed}")
    wav = np.asarray(wav, dtype=np.float32)
    if abs(speed - 1.0) < 1e-6 or wav.size == 0:
        return wav
    import pedalboard

    # "mixed" transients: crisp consonant onsets without the phasiness "crisp" adds to sustained vowels
    out = pedalboard.time_stretch(wav[None, :], float(sr), stretch_factor=float(speed), high_quality=True,
                                  transient_mode="mixed")[0]
    return np.clip(out, -1.0, 1.0).astype(np.float32, copy=False)


def _median_f0(wav: np.ndarray, sr: int) -> float:
    import librosa

    f0, voiced, _ = librosa.pyin(wav, fmin=60, fmax=500, sr=sr, frame_length=1024)
    return float(np.nanmedian(f0[voiced])) if voiced.any() else float("nan")


def measure(paths, speeds=(0.25, 0.5, 1.5, 2.0, 4.0)) -> list[dict]:
    """For each clip and speed: length ratio (wanted 1/speed), pitch change in cents (pYIN median f0), time."""
    import time

    import soundfile as sf

    rows = []
    for p in paths:
        wav, sr = sf.read(str(p), dtype="float32", always_2d=True)
        wav = wav.mean(axis=1)
        f0 = _median_f0(wav, sr)
        for s in speeds:
            t = time.perf_counter()
            out = change_speed(wav, sr, s)
            dt = time.perf_counter() - t
            g = _median_f0(out, sr)
            rows.append({"clip": p.name, "speed": s, "length_ratio": len(out) / len(wav), "wanted": 1 / s,
                         "f0_hz": f0, "cents": 1200 * np.log2(g / f0), "ms": dt * 1000,
                         "audio_s": len(wav) / sr})
    return rows


if __name__ == "__main__":
    import platform
    from pathlib import Path

    rows = measure(sorted((Path(__file__).resolve().parent.parent / "presets").glob("*.flac")))
    print(f"time stretch (pedalboard / Rubber Band, high quality, mixed transients) on {platform.processor() or platform.machine()}")
    print("| clip | speed | length ratio (wanted) | median f0 | pitch change | time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clip']} | {r['speed']:g} | {r['length_ratio']:.3f} ({r['wanted']:.3f}) | {r['f0_hz']:.0f} Hz | "
              f"{r['cents']:+.0f} cents | {r['ms']:.0f} ms for {r['audio_s']:.1f} s |")
