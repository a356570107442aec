"""A synthesis request as the engine sees it, after validation (`TTSEngine._make_request`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tts_engine.model.prompt import Prompt
from tts_engine.model.sampling import SamplingParams


@dataclass
class Request:
    prompt: Prompt
    params: SamplingParams
    first_chunk_frames: int | tuple[int, ...] = 2
    max_chunk_frames: int = 12
    ref_codes: torch.Tensor | None = None      # ICL: primes the codec decoder, not part of the output
    reproducible: bool = False   # chunks on its own schedule, each decoded alone (`TTSEngine.stream`)
    codes: list[torch.Tensor] = field(default_factory=list)   # generated frames [16] each (CPU, int64)

    def chunk_sizes(self):
        """Frames per emitted chunk (see `chunk_schedule`)."""
        return chunk_schedule(self.first_chunk_frames, self.max_chunk_frames)


def chunk_schedule(first_chunk_frames: int | tuple[int, ...], max_chunk_frames: int):
    """Frames per emitted chunk, endless: `first_chunk_frames` (an int: the first chunk; a tuple: the first
    chunks, e.g. (1, 1): two one-frame chunks), then doubling from the last of them up to `max_chunk_frames`."""
    lead = tuple(first_chunk_frames) if isinstance(first_chunk_frames, (tuple, list)) else (first_chunk_frames,)
    n = 1
    for k in lead:
        n = max(1, int(k))
        yield n
    while True:
        n = min(max(n * 2, 1), max(max_chunk_frames, 1))
        yield n
