"""The load-time trials alone, two checkouts interleaved: how long each takes on an empty cache folder.

    python -m bench trials --base /work/wt/startup-base --rounds 2

Per round and checkout (in that checkout's code, a fresh process, a fresh cache folder whose `cpu_ext/` holds
the C++ libraries already built, so that only the trials are timed): the kernel table of the random 0.6B
architecture's per-frame shapes in bf16, int8 and W8A8 (what `--quantize auto` times; one row), and the codec
decoder's int8 threshold trial (`cpu/codec_int8_threshold.measure`, on the 0.6B codec decoder in bf16). Prints the
seconds of each (median over rounds) and the choices they made, with the load average. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import load_average

CHILD = r'''
import json, sys, time
from pathlib import Path
import torch
out = {}
try:
    from tts_engine.cpu import auto_precision, kernels
    from tts_engine.cpu import codec_int8_threshold as int8_threshold
except ImportError:   # (a checkout from before the CPU paths moved to tts_engine/cpu/)
    from tts_engine.model import auto_precision, kernels
    from tts_engine.codec import int8_threshold
tab = kernels.KernelTable(path=Path(sys.argv[1]) / "kernels.json")
cfg = auto_precision.default_talker_config()
for fmt in ("bf16", "int8", "w8a8"):
    t = time.perf_counter()
    tab.ensure(fmt, [(N, K) for N, K, _ in auto_precision.frame_shapes(cfg, fmt != "bf16")], buckets=(1,))
    out[f"kernels {fmt}"] = time.perf_counter() - t
out["winners"] = sorted({v["winner"] for v in tab.entries.values()})
from tts_engine.checkpoint import SafetensorsFile, load_module, read_json
from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
folder = Path(sys.argv[2]) / "speech_tokenizer"
cfg = CodecDecoderConfig.from_dict(read_json(folder / "config.json").get("decoder_config") or {})
dec = load_module(CodecDecoder(cfg), SafetensorsFile(folder / "model.safetensors"), "decoder.", torch.device("cpu"),
                  torch.bfloat16)
t = time.perf_counter()
ms = int8_threshold.measure(dec)
out["int8 threshold"] = time.perf_counter() - t
out["threshold ms"] = ms
out["threshold pick"] = int8_threshold.pick(ms)
print("@@" + json.dumps(out))
'''


def run(checkout: Path, libs: Path, checkpoint: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="trials-"))
    try:
        shutil.copytree(libs, cache / "cpu_ext")
        env = dict(os.environ, PYTHONPATH=str(checkout), TTS_CACHE_DIR=str(cache))
        env.pop("TTS_KERNEL_TUNE", None)
        r = subprocess.run([sys.executable, "-c", CHILD, str(cache), str(checkpoint)], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("@@")), None)
        if line is None:
            raise RuntimeError(f"{checkout}: {r.stderr[-2000:]}")
        return json.loads(line[2:])
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench trials", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other checkout (A); this one is B")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    from bench.common import random_checkpoint
    from tts_engine.cpu import cpu_ext

    checkpoint = random_checkpoint("0.6b").resolve()
    libs = cpu_ext.build().parent   # the library once, into this user's cache folder: copied into each fresh one
    here = Path(__file__).resolve().parent.parent
    got: dict = {"A": [], "B": []}
    loads = [load_average()]
    for r in range(a.rounds):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            res = run(Path(a.base).resolve() if name == "A" else here, libs, checkpoint)
            got[name].append(res)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in res.items()
                                                       if isinstance(v, float))
                  + f"; threshold {res['threshold pick']} {res['threshold ms']}; {load_average()}", flush=True)
    loads.append(load_average())
    print(f"\nmedian seconds over {a.rounds} round(s), A = {a.base}, B = {here}; {loads[0]}; {loads[-1]}")
    print("| trial | A, s | B, s |\n|---|---|---|")
    for k in ("kernels bf16", "kernels int8", "kernels w8a8", "int8 threshold"):
        print(f"| {k} | {statistics.median(x[k] for x in got['A']):.1f} | "
              f"{statistics.median(x[k] for x in got['B']):.1f} |")


if __name__ == "__main__":
    main()
