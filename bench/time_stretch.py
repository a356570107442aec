"""`speed`'s time stretch (serving/speed.py) on the preset clips: `python -m bench time_stretch`.

For each clip (`presets/*.flac`), speed (0.25, 0.5, 1.5, 2, 4) and mode (the whole response through
`change_speed`, or streamed through `StreamStretcher` in the engine's chunk sizes): the length ratio against the
wanted 1/speed, the pitch change in cents (median f0 by librosa's pYIN) and the time the stretch took. Results and
what they mean: docs/speed.md.
"""
from __future__ import annotations

import numpy as np

from serving.speed import StreamStretcher, change_speed


def _median_f0(wav: np.ndarray, sr: int) -> float:
    import librosa

    f0, voiced, _ = librosa.pyin(wav, fmin=60, fmax=500, sr=sr, frame_length=1024)
    return float(np.nanmedian(f0[voiced])) if voiced.any() else float("nan")


def _streamed(wav: np.ndarray, sr: int, speed: float) -> np.ndarray:
    """`wav` through a StreamStretcher in the chunk sizes the engine streams (1, 2, 4, 8, then 12 frames)."""
    st, out, i, k = StreamStretcher(sr, speed), [], 0, 0
    while i < len(wav):
        n = (1, 2, 4, 8, 12)[min(k, 4)] * sr * 2 // 25          # frames of 80 ms
        out.append(st.push(wav[i:i + n]))
        i, k = i + n, k + 1
    out.append(st.finish())
    return np.concatenate(out)


def measure(paths, speeds=(0.25, 0.5, 1.5, 2.0, 4.0)) -> list[dict]:
    """For each clip, speed and mode (whole response / stream): length ratio (wanted 1/speed), pitch change in
    cents (pYIN median f0) and the time the stretch took."""
    import time

    import soundfile as sf

    rows = []
    for p in paths:
        wav, sr = sf.read(str(p), dtype="float32", always_2d=True)
        wav = wav.mean(axis=1)
        f0 = _median_f0(wav, sr)
        for s in speeds:
            for mode, fn in (("whole", change_speed), ("stream", _streamed)):
                t = time.perf_counter()
                out = fn(wav, sr, s)
                dt = time.perf_counter() - t
                g = _median_f0(out, sr)
                rows.append({"clip": p.name, "speed": s, "mode": mode, "length_ratio": len(out) / len(wav),
                             "wanted": 1 / s, "f0_hz": f0, "cents": 1200 * np.log2(g / f0), "ms": dt * 1000,
                             "audio_s": len(wav) / sr})
    return rows


def main(argv=None) -> int:
    import argparse
    from pathlib import Path

    import torch

    from bench.common import ROOT, device_name, load_average

    ap = argparse.ArgumentParser(prog="python -m bench time_stretch", description=__doc__.splitlines()[0])
    ap.add_argument("--speeds", default="0.25,0.5,1.5,2,4", help="comma-separated speeds (0.25-4)")
    ap.add_argument("--clips", nargs="*", help="audio files (default: presets/*.flac)")
    a = ap.parse_args(argv)
    presets = ROOT / "presets"
    clips = [Path(c) for c in a.clips] if a.clips else sorted(presets.glob("*.flac"))
    rows = measure(clips, tuple(float(x) for x in a.speeds.split(",")))
    print(f"time stretch (Rubber Band through pylibrb: whole = offline, stream = real-time) on "
          f"{device_name(torch.device('cpu'))}, {load_average()}")
    print("| clip | speed | mode | length ratio (wanted) | median f0 | pitch change | time |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clip']} | {r['speed']:g} | {r['mode']} | {r['length_ratio']:.3f} ({r['wanted']:.3f}) | "
              f"{r['f0_hz']:.0f} Hz | {r['cents']:+.0f} cents | {r['ms']:.0f} ms for {r['audio_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
