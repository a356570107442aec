"""How far each lossy codec decoder mode (bf16, int8 convolutions) is from the fp32 decoder, on the same codes:
`python -m bench codec_quality [--arch 0.6b,tiny] [--frames 120]`.

The measurement and its thresholds are the engine's own (`tts_engine.cpu.codec_quality`: waveform SNR, log-spectral
distance; what the measured codec choice accepts at load); this prints them per random-weight checkpoint and mode.
Nothing is written.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from bench.common import random_checkpoint
from tts_engine.cpu.codec_quality import FRAMES, MAX_LSD_DB, MIN_SNR_DB, acceptable, measure

MODES = [("bf16 packed", torch.bfloat16, "packed"), ("bf16 int8", torch.bfloat16, "int8"),
         ("fp32 int8", torch.float32, "int8")]


def main(argv=None) -> int:
    from tts_engine.codec.speech_tokenizer import SpeechTokenizer

    p = argparse.ArgumentParser(prog="python -m bench codec_quality", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="0.6b,tiny", help="comma list of random-weight checkpoints")
    p.add_argument("--frames", type=int, default=FRAMES)
    a = p.parse_args(argv)
    print(f"Codec decoder against fp32, {a.frames} frames of the same random codes, decoded in a stream's chunks. "
          f"Acceptable for the automatic choice: SNR >= {MIN_SNR_DB} dB and LSD <= {MAX_LSD_DB} dB.\n")
    print("| checkpoint | mode | waveform SNR (dB) | log-spectral distance (dB) | acceptable |\n|---|---|---|---|---|")
    os.environ.setdefault("TTS_CODEC_DTYPE", "model")   # the decoder as the checkpoint stores it: fp32, aten convs
    os.environ.setdefault("TTS_CODEC_CONV", "aten")
    for arch in a.arch.split(","):
        dec = SpeechTokenizer(random_checkpoint(arch) / "speech_tokenizer", torch.device("cpu"),
                              torch.float32).decoder
        for label, q in measure(dec, MODES, a.frames).items():
            print(f"| {arch} random | {label} | {q['snr_db']:.1f} | {q['lsd_db']:.3f} | {acceptable(q)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
