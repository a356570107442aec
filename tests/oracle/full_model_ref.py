"""Oracle: build a tiny *official* Qwen3-TTS checkpoint with random weights, save it in the official layout,
load it back through the official `Qwen3TTSModel.from_pretrained`, and record what the official code does.

usage: full_model_ref.py CKPT_DIR OUT_FILE KIND SIZE SEED
Writes CKPT_DIR (a checkpoint tts_engine must load) and OUT_FILE (safetensors of reference tensors, with a
JSON list of cases in its metadata). Runs in the oracle venv only.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import tests.oracle.official as off  # noqa: F401  (stand-ins first)
from qwen_tts import Qwen3TTSModel
from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

from tts_engine.tiny import FEATURE_EXTRACTOR, GENERATION_CONFIG, tiny_config, tiny_speech_tokenizer_config
from tts_engine.tiny_tokenizer import write_tiny_tokenizer

TEXTS = ["Hello world, this is a test.", "你好，世界！今天天气不错。"]
REF_TEXT = "The quick brown fox."
MAX_NEW = 14


def randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights with enough spread that greedy codes are not degenerate."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embedding" in name and "codebook" not in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = int(torch.tensor(p.shape[1:]).prod()) if p.ndim > 1 else p.shape[0]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / max(1, fan_in) ** 0.5))


def build_codec(folder: Path, gen: torch.Generator) -> None:
    st = tiny_speech_tokenizer_config()
    model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**{k: v for k, v in st.items()
                                                                   if k not in ("architectures", "model_type")}))
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("cluster_usage"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            elif name.endswith(("embedding_sum", "embed_sum")):
                t.copy_(torch.randn(t.shape, generator=gen))
            elif name.endswith(("alpha", "beta")):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            elif name.endswith(".scale"):
                t.copy_(0.1 + 0.02 * torch.randn(t.shape, generator=gen))
            elif t.is_floating_point() and ("weight" in name or "bias" in name) and "norm" not in name:
                t.copy_(torch.randn(t.shape, generator=gen) * (1.0 / max(1, t.shape[-1] * (t.shape[1] if t.ndim == 3 else 1)) ** 0.5))
    (folder / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"})
    (folder / "speech_tokenizer" / "config.json").write_text(json.dumps(st, indent=2))
    (folder / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(FEATURE_EXTRACTOR))


def main():
    folder, out_file, kind, size, seed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    ids = write_tiny_tokenizer(folder, seed=0)
    cfg = tiny_config(kind, size, ids)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**{k: v for k, v in cfg.items()
                                                               if k not in ("architectures", "model_type")}))
    randomize(model.talker, gen)
    if model.speaker_encoder is not None:
        randomize(model.speaker_encoder, gen)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    build_codec(folder, torch.Generator().manual_seed(1234))

    tts = Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32, device_map="cpu")
    m = tts.model

    captured = {"prefill": [], "codes": []}

    def talker_hook(module, args, kwargs):  # the prefill call is the one with more than one position
        e = kwargs.get("inputs_embeds")
        if e is not None and e.shape[1] > 1:
            captured["prefill"].append(e[0].detach().clone())

    m.talker.register_forward_pre_hook(talker_hook, with_kwargs=True)
    orig_generate = m.generate

    def generate(*a, **kw):
        codes, hid = orig_generate(*a, **kw)
        captured["codes"].append(codes[0].detach().clone())
        return codes, hid

    m.generate = generate

    tensors, cases = {}, []
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=MAX_NEW)

    def record(name, info, wav):
        cases.append(dict(name=name, **info))
        tensors[f"{name}.prefill"] = captured["prefill"][-1]
        tensors[f"{name}.codes"] = captured["codes"][-1].long()
        tensors[f"{name}.wav"] = torch.from_numpy(np.asarray(wav, dtype=np.float32))

    if kind == "custom_voice":
        for i, text in enumerate(TEXTS):
            for nsm in (True, False):
                spk, lang = (["Ryan", "english"], ["Dylan", "auto"])[i]
                kw = dict(text=text, speaker=spk, language=lang, non_streaming_mode=nsm, **greedy)
                instr = "Speak slowly and calmly." if size == "1b7" and i == 0 else None
                wavs, _ = tts.generate_custom_voice(instruct=instr, **kw)
                record(f"cv{i}_{int(nsm)}", dict(text=text, speaker=spk, language=lang, non_streaming=nsm,
                                                 instruct=instr), wavs[0])
    elif kind == "voice_design":
        for i, text in enumerate(TEXTS):
            for nsm in (True, False):
                instr = ["A warm, deep male voice.", "年轻女性，语速较快。"][i]
                wavs, _ = tts.generate_voice_design(text=text, instruct=instr, language="auto",
                                                    non_streaming_mode=nsm, **greedy)
                record(f"vd{i}_{int(nsm)}", dict(text=text, instruct=instr, language="auto", non_streaming=nsm),
                       wavs[0])
    else:
        rng = np.random.default_rng(seed)
        t = np.arange(int(16000 * 1.3)) / 16000
        ref16k = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
        tensors["ref_audio_16k"] = torch.from_numpy(ref16k)
        for xvec in (True, False):
            items = tts.create_voice_clone_prompt(ref_audio=(ref16k, 16000), ref_text=REF_TEXT,
                                                  x_vector_only_mode=xvec)
            tensors[f"xvec{int(xvec)}.spk"] = items[0].ref_spk_embedding.float()
            if not xvec:
                tensors["ref_code"] = items[0].ref_code.long()
            for i, text in enumerate(TEXTS):
                for nsm in (False, True):
                    wavs, _ = tts.generate_voice_clone(text=text, language=["english", "chinese"][i],
                                                       voice_clone_prompt=items, non_streaming_mode=nsm, **greedy)
                    record(f"clone{int(xvec)}_{i}_{int(nsm)}",
                           dict(text=text, x_vector_only=xvec, language=["english", "chinese"][i],
                                non_streaming=nsm, ref_text=REF_TEXT), wavs[0])
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_file, metadata={"cases": json.dumps(cases)})


if __name__ == "__main__":
    main()
