"""First audio with and without the prompt-prefix cache, interleaved in one engine:
`python -m bench prefill --quantize w8a8 --rounds 15`.

One engine (random-weight checkpoint), the first audio of one stream part by part as the worker runs it (prefill,
the first frame's code predictor, a one-frame codec decode), alternating call by call between the prefix cache
holding this voice's prefix (a hit), the cache emptied before the call (a miss: the prefix and the rest as two
calls), and no cache (one whole-prompt call, as before the cache). Each in wall time and in the calling thread's CPU
time (steadier on a shared machine); medians over the rounds. Prints markdown; nothing is written.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.common import TEXT, Laps, command, device_name, load1, random_checkpoint


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench prefill", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    p.add_argument("--quantize", default="w8a8")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    p.add_argument("--text", default=TEXT)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from tts_engine.engine.engine import TTSEngine
    from tts_engine.engine.prefix_cache import PrefixCache

    q = None if a.quantize == "none" else a.quantize
    engine = TTSEngine.from_pretrained(str(random_checkpoint(a.arch)), device="cpu", quantize=q,
                                       max_batch=1, max_seq_len=400, govern_threads=False)
    r, codec = engine.runner, engine.model.speech_tokenizer.decoder
    cache = r.prefix_cache or PrefixCache()
    req, _ = engine.make_request(a.text, voice=engine.speakers[0], seed=0, sampling={"ignore_eos": True},
                                 max_new_tokens=30, first_chunk_frames=1)
    L, P = req.prompt.prefill.shape[0], req.prompt.prefix_len
    res: dict = {}

    def once(kind: str) -> None:
        r.prefix_cache = None if kind == "no cache" else cache
        if kind == "miss":
            cache.clear()
        laps = Laps()
        state = codec.init_state(1, r.device)
        r.prefill(0, req.prompt, req.params)
        laps.mark("prefill")
        codes = r.complete([0])
        laps.mark("code predictor")
        codec.decode_step(codes[None].transpose(1, 2), state)[0].float().cpu().numpy()
        laps.mark("codec")
        r.release(0)
        st = dict(laps.ms)
        st["first audio"] = tuple(sum(x[i] for x in st.values()) for i in (0, 1))
        res.setdefault(kind, []).append(st)

    kinds = ["hit", "miss", "no cache"]
    with torch.inference_mode():
        for k in kinds:   # warm-up
            once(k)
        res.clear()
        load0 = load1()
        for i in range(a.rounds):
            for k in kinds[i % 3:] + kinds[:i % 3]:
                once(k)
    out = [f"Device: **{device_name(torch.device('cpu'))}**, {torch.get_num_threads()} threads (no thread governor). "
           f"{a.arch} random weights, {engine.precision}; prompt {L} positions, prefix {P}; {a.rounds} interleaved "
           f"rounds, median. Load average {load0:.2f} at the start, {load1():.2f} at the end.", "",
           f"Command: `{command('prefill', argv)}`", "",
           "| prefix cache | prefill ms (CPU ms) | first frame's code predictor | one-frame codec decode | "
           "**first audio** |", "|---|---|---|---|---|"]
    for k in kinds:
        cells = []
        for part in ("prefill", "code predictor", "codec", "first audio"):
            w = statistics.median(x[part][0] for x in res[k])
            c = statistics.median(x[part][1] for x in res[k])
            cells.append(f"{w:.0f} ({c:.0f})")
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    print("\n".join(out))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
