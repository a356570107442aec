"""A synthesis request as the engine sees it, after validation (`TTSEngine._make_request`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.prompt import Prompt
from ..model.sampling import SamplingParams


@dataclass
class Request:
    prompt: Prompt
    params: SamplingParams
    first_chunk_frames: int = 2
    max_chunk_frames: int = 12
    ref_codes: torch.Tensor | None = None      # ICL: primes the codec decoder, not part of the output
    codes: list[torch.Tensor] = field(default_factory=list)   # generated frames [16] each (CPU, int64)

    def chunk_sizes(self):
        """Frames per emitted chunk: first_chunk_frames, then doubling up to max_chunk_frames."""
        n = max(1, self.first_chunk_frames)
        while True:
            yield n
            n = min(max(n * 2, 1), max(self.max_chunk_frames, 1))
