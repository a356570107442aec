"""Oracle: a small *official* speaker encoder (ECAPA-TDNN) with random weights, and what the official code makes
of a few reference clips: loaded and averaged to mono by `Qwen3TTSModel._normalize_audio_inputs`, resampled to
24 kHz with the exact call of `create_voice_clone_prompt`, turned into mels and x-vectors by
`Qwen3TTSForConditionalGeneration.extract_speaker_embedding` (fp32 and bf16).

usage: speaker_encoder_ref.py OUT_DIR
Writes OUT_DIR/config.json (the speaker_encoder_config), OUT_DIR/speaker_encoder.safetensors (state dict,
official names without the `speaker_encoder.` prefix), OUT_DIR/stereo.wav (a file input) and
OUT_DIR/ref.safetensors (inputs and official outputs; JSON list of cases in its metadata).
Runs in the oracle venv only.
"""
import copy
import json
import sys
import types
from pathlib import Path

import librosa
import numpy as np
import soundfile as sf
import torch
from safetensors.torch import save_file

import tests.oracle.official as off  # noqa: F401  (stand-ins first)
from qwen_tts import Qwen3TTSModel
from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder, mel_spectrogram

CONFIG = dict(mel_dim=128, enc_dim=48, enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
              enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16, enc_res2net_scale=4, enc_se_channels=16,
              sample_rate=24000)


def clip(rng: np.random.Generator, n: int, sr: int, f0: float) -> np.ndarray:
    t = np.arange(n) / sr
    x = 0.3 * np.sin(2 * np.pi * f0 * t) + 0.15 * np.sin(2 * np.pi * 3.1 * f0 * t + 0.4) + 0.05 * rng.standard_normal(n)
    return (x * (0.6 + 0.4 * np.sin(2 * np.pi * 1.7 * t))).astype(np.float32)


def official_mel(wav24: np.ndarray) -> torch.Tensor:
    """The mel exactly as extract_speaker_embedding computes it: [1, T, 128]."""
    return mel_spectrogram(torch.from_numpy(wav24).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000,
                           hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    enc = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**CONFIG)).eval()
    enc_bf16 = copy.deepcopy(enc).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in enc.state_dict().items()}
    save_file(state, str(out / "speaker_encoder.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))

    rng = np.random.default_rng(1)
    stereo = np.stack([clip(rng, 30011, 22050, 140.0), clip(rng, 30011, 22050, 210.0)], axis=1)
    sf.write(out / "stereo.wav", stereo, 22050, subtype="PCM_16")
    inputs = {  # name -> (array, sr) given as a tuple, or a file path
        "a24_1s": (clip(rng, 24000, 24000, 120.0), 24000),
        "a24_odd": (clip(rng, 8893, 24000, 230.0), 24000),
        "a24_long": (clip(rng, 4 * 24000 + 77, 24000, 95.0), 24000),
        "a24_min": (clip(rng, 1280, 24000, 300.0), 24000),       # 5 mel frames: the shortest 'same' reflect allows
        "a16k": (clip(rng, 20800, 16000, 180.0), 16000),          # resampled to 24 kHz
        "stereo_array": (stereo.copy(), 22050),                   # (N, 2) array: mean over the last axis
        "stereo_file": str(out / "stereo.wav"),                   # librosa.load(sr=None, mono=True)
    }

    wrapper = Qwen3TTSModel.__new__(Qwen3TTSModel)   # only its input-normalising helpers are used
    names = list(inputs)
    normalized = []
    for n in names:
        if n == "stereo_array":
            # official bug: _normalize_audio_inputs assigns into the (array, sr) tuple for multi-channel arrays
            # and raises TypeError; this is what that line means to do
            a, sr = inputs[n]
            normalized.append((np.mean(a.astype(np.float32), axis=-1).astype(np.float32), int(sr)))
        else:
            normalized += wrapper._normalize_audio_inputs([inputs[n]])
    fake32 = types.SimpleNamespace(speaker_encoder=enc, device=torch.device("cpu"), dtype=torch.float32)
    fake16 = types.SimpleNamespace(speaker_encoder=enc_bf16, device=torch.device("cpu"), dtype=torch.bfloat16)
    se_sr = CONFIG["sample_rate"]

    tensors, cases = {}, []
    for name, (wav, sr) in zip(names, normalized):
        src = inputs[name]
        # create_voice_clone_prompt, verbatim
        wav_resample = wav
        if sr != se_sr:
            wav_resample = librosa.resample(y=wav_resample.astype(np.float32), orig_sr=int(sr), target_sr=se_sr)
        emb = Qwen3TTSForConditionalGeneration.extract_speaker_embedding(fake32, audio=wav_resample, sr=se_sr)
        emb16 = Qwen3TTSForConditionalGeneration.extract_speaker_embedding(fake16, audio=wav_resample, sr=se_sr)
        if isinstance(src, tuple):
            tensors[f"{name}.input"] = torch.from_numpy(np.array(src[0], copy=True))
            cases.append(dict(name=name, kind="array", sr=int(src[1])))
        else:
            cases.append(dict(name=name, kind="file", path=Path(src).name, sr=int(sr)))
        tensors[f"{name}.wav_native"] = torch.from_numpy(np.array(wav, copy=True))
        tensors[f"{name}.wav24"] = torch.from_numpy(np.array(wav_resample, copy=True))
        tensors[f"{name}.mel"] = official_mel(wav_resample).contiguous()
        tensors[f"{name}.emb"] = emb.detach().clone()
        tensors[f"{name}.emb_bf16"] = emb16.detach().clone()

    # a batch of two equal-length clips through the official mel and encoder
    batch = np.stack([inputs["a24_1s"][0], clip(rng, 24000, 24000, 260.0)])
    with torch.inference_mode():
        mels = mel_spectrogram(torch.from_numpy(batch), n_fft=1024, num_mels=128, sampling_rate=24000,
                               hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
        tensors["batch.input"] = torch.from_numpy(batch)
        tensors["batch.mel"] = mels.contiguous()
        tensors["batch.emb"] = enc(mels).clone()
    save_file(tensors, str(out / "ref.safetensors"), metadata={"cases": json.dumps(cases)})


if __name__ == "__main__":
    main()
