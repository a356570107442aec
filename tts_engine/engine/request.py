"""A synthesis request as the engine sees it, after validation (`TTSEngine._make_request`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tts_engine.model.prompt import Prompt
from tts_engine.model.sampling import SamplingParams


class FrameLog:
    """A request's generated frames, kept as the chunks they went out in ([n, 16] int64 host arrays or tensors):
    adding a chunk is one list append however many frames it holds (no tensor per frame). `len` is the number of
    frames; iterating or indexing gives the frames [16] one by one; `stack()` gives them all as [frames, 16]."""
    __slots__ = ("chunks", "frames")

    def __init__(self):
        self.chunks: list = []
        self.frames = 0

    def add(self, chunk) -> None:
        """Append a chunk's frames [n, 16]."""
        self.chunks.append(chunk)
        self.frames += chunk.shape[0]

    def __len__(self) -> int:
        return self.frames

    def __bool__(self) -> bool:
        return self.frames > 0

    def __iter__(self):
        for c in self.chunks:
            yield from torch.as_tensor(c).unbind(0)

    def __getitem__(self, i):
        return self.stack()[i]

    def stack(self) -> torch.Tensor:
        """Every frame so far -> [frames, 16] int64 (a new tensor)."""
        if not self.chunks:
            return torch.zeros(0, 16, dtype=torch.long)
        return torch.cat([torch.as_tensor(c) for c in self.chunks])


@dataclass
class Request:
    prompt: Prompt
    params: SamplingParams
    first_chunk_frames: int | tuple[int, ...] = 2
    max_chunk_frames: int = 12
    ref_codes: torch.Tensor | None = None      # ICL: primes the codec decoder, not part of the output
    reproducible: bool = False   # chunks on its own schedule, each decoded alone (`TTSEngine.stream`)
    codes: FrameLog = field(default_factory=FrameLog)   # the generated frames (CPU, int64)

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
