"""Times the official implementation on a checkpoint (oracle venv only), for `python -m bench speed`.

usage: bench_official.py CKPT FRAMES DEVICE DTYPE
Prints one JSON line: {"wall_s": ..., "frames": ...}. The official code cannot force an output length, so
end-of-speech is made impossible: `eos_token_id` is set to an id that is always suppressed (3071), which makes
it run exactly FRAMES frames (max_new_tokens = FRAMES + 1; the last drawn id is never completed).
"""
import json
import sys
import time

import torch

import tests.oracle.official  # noqa: F401
from qwen_tts import Qwen3TTSModel

ckpt, frames, device, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
tts = Qwen3TTSModel.from_pretrained(ckpt, dtype=dt, device_map=device)
kw = dict(text="Ladies and gentlemen, please remain calm.", speaker="ryan", language="english",
          max_new_tokens=frames + 1, eos_token_id=3071)


def once():
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tts.generate_custom_voice(**kw)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


kw_warm = dict(kw, max_new_tokens=3)
tts.generate_custom_voice(**kw_warm)
walls = [once() for _ in range(2)]
print(json.dumps({"wall_s": min(walls), "frames": frames}))
