"""Command line: `python -m tts_engine synth ...` and `python -m tts_engine make-tiny DIR --kind K`."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tts_engine.model.quant import QUANT_MODES


def _synth(a) -> int:
    import soundfile as sf

    from tts_engine.engine.engine import TTSEngine
    from tts_engine.voices.voice import Voice

    t0 = time.perf_counter()
    engine = TTSEngine.from_pretrained(a.model, device=a.device, dtype=a.dtype, quantize=a.quantize,
                                       use_cuda_graphs=False if a.eager else None)
    if engine.lossy:
        print(f"lossy mode: {engine.precision} (an approximation of the checkpoint's weights)", file=sys.stderr)
    voice = None
    if a.speaker:
        voice = a.speaker
    elif a.ref_audio:
        voice = engine.clone_voice(a.ref_audio, ref_text=a.ref_text, x_vector_only=a.x_vector_only)
    elif a.voice_file:
        voice = Voice.load(a.voice_file)
    t1 = time.perf_counter()
    stream = engine.stream(a.text, voice=voice, language=a.language, instruct=a.instruct, seed=a.seed,
                           greedy=a.greedy, max_new_tokens=a.max_new_tokens)
    chunks, first = [], None
    for c in stream:
        if first is None:
            first = time.perf_counter() - t1
        chunks.append(c)
    wav = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    sf.write(a.out, wav, engine.sample_rate, subtype="PCM_16" if a.out.endswith(".wav") else None)
    if a.codes_out:
        np.save(a.codes_out, stream.codes.numpy().astype(np.int64))
    dur = len(wav) / engine.sample_rate
    wall = time.perf_counter() - t1
    print(f"wrote {a.out}: {dur:.2f} s of audio, {stream.codes.shape[0]} frames, seed {stream.seed}; "
          f"load {t1 - t0:.1f} s, first audio {1000 * (first or 0):.0f} ms, "
          f"{dur / wall if wall > 0 else 0:.2f}x real time; precision {engine.precision}"
          + (" (lossy)" if engine.lossy else ""), file=sys.stderr)
    return 0


def _make_tiny(a) -> int:
    from tts_engine.tiny import make_tiny

    path = make_tiny(a.dir, kind=a.kind, size=a.size, seed=a.seed)
    print(f"wrote a tiny random {a.kind} checkpoint to {path}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tts_engine", description="Qwen3-TTS (12 Hz) engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="synthesize a WAV file")
    s.add_argument("--model", required=True, help="Hugging Face repo id or local checkpoint folder")
    s.add_argument("--text", required=True)
    s.add_argument("--language", default="auto")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--speaker", help="preset speaker (CustomVoice checkpoints)")
    g.add_argument("--ref-audio", help="reference clip to clone (Base checkpoints)")
    g.add_argument("--voice-file", help="a saved voice (.safetensors or .json)")
    s.add_argument("--ref-text", help="transcript of --ref-audio (in-context cloning)")
    s.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding alone")
    s.add_argument("--instruct", help="style instruction (1.7B CustomVoice, VoiceDesign)")
    s.add_argument("--seed", type=int)
    s.add_argument("--greedy", action="store_true", help="no sampling in the talker or the code predictor")
    s.add_argument("--max-new-tokens", type=int)
    s.add_argument("--device")
    s.add_argument("--dtype", help="fp32, bf16 or fp16 (default: bf16 on GPU; on a CPU bf16 where it has AVX-512 BF16 or AMX, else fp32)")
    s.add_argument("--eager", action="store_true", help="no CUDA graphs on a GPU (the eager per-frame step)")
    s.add_argument("--quantize", choices=[*QUANT_MODES, "auto"],
                   help="quantised talker and code predictor (CPU; lossy, faster): int8 / int4 weights, w8a8 / w4a8 int8 "
                        "or int4 weights x int8 activations (w4a8: our own kernels, AVX2 or AVX-512 VNNI); auto: the fastest acceptable mode measured on this CPU")
    s.add_argument("--out", required=True)
    s.add_argument("--codes-out", help="also save the generated codes, int64 (frames, 16), as .npy")
    s.set_defaults(fn=_synth)
    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint in the official layout")
    t.add_argument("dir")
    t.add_argument("--kind", choices=["base", "custom_voice", "voice_design"], default="custom_voice")
    t.add_argument("--size", choices=["0b6", "1b7"], default="0b6",
                   help="1b7 gives the predictor its own width (with the projection), as the 1.7B models")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=_make_tiny)
    a = p.parse_args(argv)
    from tts_engine.errors import TTSError

    try:
        return a.fn(a)
    except TTSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
