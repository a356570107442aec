"""Our engine in the side-by-side CPU benchmark: one loaded `TTSEngine` per precision, timed through the public
streaming API exactly as `python -m bench speed` times it (one stream, end-of-speech disabled, first chunk
after one frame), plus the bench's per-part profile and the weight bytes each frame reads.

Precisions: the checkpoint's weights in the dtype the engine picks on this CPU (bf16 where native, else fp32),
then every `--quantize` mode the engine offers here (`tts_engine.model.quant.available_modes()`, so a mode added to
QUANT_MODES is benchmarked without a change here).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from tts_engine.engine.engine import TTSEngine
from tts_engine.model.quant import available_modes
from bench.peers.table import OURS, Run

TEXT = "Ladies and gentlemen, please remain calm."   # the text of python -m bench speed


def modes() -> list[str | None]:
    """None (the checkpoint's weights) and each quantize mode of the engine that runs on this machine."""
    return [None, *available_modes()]


def module_bytes(m: nn.Module) -> int:
    """Bytes of the parameters and buffers of m (each storage once), i.e. what one pass over it reads."""
    seen, total = set(), 0
    for t in list(m.parameters()) + list(m.buffers()):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def weight_bytes(engine: TTSEngine) -> tuple[int, int]:
    """(talker, code predictor) weight bytes read per frame at one stream: the talker's decoder stack and codec
    head once; the predictor's stack and input projection once per pass (15 passes), each of its heads once.
    Embedding tables are gathers (a frame reads a few rows) and are left out."""
    talker = engine.model.talker
    cp = talker.code_predictor
    passes = len(cp.lm_head)
    t = module_bytes(talker.model.layers) + module_bytes(talker.codec_head)
    c = passes * (module_bytes(cp.model.layers) + module_bytes(cp.small_to_mtp_projection)) + module_bytes(cp.lm_head)
    return t, c


def weight_counts(engine: TTSEngine) -> dict:
    """Weights (matrix elements) of the per-frame linears, for estimating a peer's bytes in its own format."""
    talker = engine.model.talker
    cp = talker.code_predictor

    def n(m):
        return sum(p.numel() for p in m.parameters() if p.dim() == 2)

    return {"talker_layers": n(talker.model.layers), "codec_head": n(talker.codec_head),
            "cp_layers": n(cp.model.layers) + n(cp.small_to_mtp_projection), "cp_heads": n(cp.lm_head),
            "cp_passes": len(cp.lm_head)}


class OurEngine:
    """One precision of our engine, loaded once and kept for the whole interleaved run."""

    name = OURS

    def __init__(self, ckpt: Path, quantize: str | None, max_frames: int):
        t0 = time.perf_counter()
        self.engine = TTSEngine.from_pretrained(str(ckpt), device="cpu", quantize=quantize, max_batch=1,
                                                max_seq_len=max_frames + 128)
        self.load_s = time.perf_counter() - t0
        self.engine.speakers_for_bench = ["ryan"] if "ryan" in self.engine.speakers else self.engine.speakers
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.engine.model.dtype]
        self.precision = quantize or dtype
        self.precisions = (self.precision,)
        self.label = self.engine.precision
        self.run(self.precision, 4, rep=-1)                    # warm-up

    def run(self, precision: str, frames: int, rep: int) -> Run:
        from bench.common import run_concurrency

        try:
            r = run_concurrency(self.engine, 1, frames, first_chunk=1)
        except Exception as e:  # a failed run is a row, not the end of the benchmark
            return Run(OURS, self.precision, frames, rep=rep, error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        return Run(OURS, self.precision, frames, frames=r["audio_s"] / 0.08, wall_s=r["wall_s"],
                   first_audio_s=r["ttfa_p50_ms"] / 1000, rep=rep)

    def profile(self, frames: int, floor=None) -> dict:
        """The bench's per-part split (talker, code predictor, codec, ms per frame) at one stream. floor: a
        `common.PlainRead` sampled after each frame's parts; its spread over this profile goes in "plain_read"."""
        from bench.speed import profile_frame

        if floor is None:
            return profile_frame(self.engine, frames)
        mark = floor.mark()
        out = profile_frame(self.engine, frames, between=floor.sample)
        out["plain_read"] = floor.spread(mark)
        return out

    def close(self) -> None:
        self.engine.close()
