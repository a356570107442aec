"""Every stream's codec decoder state in one batched `CodecDecoderState`, one row (slot) per stream.

The engine decodes the chunks that go out at one frame as one batch (`engine/codec_thread.decode_group`). With a
state per stream that batch is joined (`CodecDecoderState.concat`) and split again (`select`) around every decode:
a copy of every history tensor per row, host work that grows with the batch (~22 tensors x rows per decode). Here
the states live as rows of one pool on the decoder's device: a decode gathers its rows with one `index_select` per
history tensor and writes them back with one `index_copy_` each, however many rows it holds, and a stream's join
(`alloc`) and leave (`free`) are a row write and a free-list entry, with no host synchronisation.

A stream holds a `PoolRow` (its pool and slot) as its `decoder_state`. The worker thread allocates and the codec
thread may decode and free at the same time: the free list, the growth of the pool (doubling its rows when full) and
the gathers / write-backs are under one lock; the decode itself runs outside it (different streams' slots never
overlap). A pool is made for one decoder dtype and device (`matches`); a decoder switched to another dtype gets a new
pool for the streams that start after (the old streams keep theirs).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tts_engine.codec.decoder import CodecDecoderState


@dataclass(eq=False)
class PoolRow:
    """One stream's decoder state: row `slot` of `pool` (until `free`)."""
    pool: "CodecStatePool"
    slot: int

    def clone(self) -> CodecDecoderState:
        """This row's state as a standalone one-row `CodecDecoderState` (a copy)."""
        return self.pool.read([self.slot])

    def free(self) -> None:
        self.pool.free(self.slot)


class CodecStatePool:
    def __init__(self, template: CodecDecoderState, rows: int = 8):
        """template: a one-row state of the decoder (`CodecDecoder.init_state(1)`): the pool's shapes, dtype and
        device; rows: the slots made at first (doubled when they run out)."""
        self._empty = template.select([0]).clone()
        for t in self._fields(self._empty):
            t.zero_()
        self.state = CodecDecoderState.concat([self._empty] * max(1, rows))
        self._free = list(range(max(1, rows)))[::-1]
        self._lock = threading.Lock()
        self.live = 0

    @staticmethod
    def _fields(st: CodecDecoderState) -> list[torch.Tensor]:
        return [*st.convs, st.k, st.v, st.pos]

    @staticmethod
    def _dims(st: CodecDecoderState) -> list[int]:
        return [0] * len(st.convs) + [1, 1, 0]

    def matches(self, template: CodecDecoderState) -> bool:
        """The pool holds states of `template`'s shapes, dtype and device."""
        a, b = self._fields(self._empty), self._fields(template)
        return len(a) == len(b) and all(x.dtype == y.dtype and x.device == y.device and
                                        x.shape[:d] + x.shape[d + 1:] == y.shape[:d] + y.shape[d + 1:]
                                        for x, y, d in zip(a, b, self._dims(template)))

    @property
    def rows(self) -> int:
        return self.state.batch_size

    def alloc(self, init: CodecDecoderState | None = None) -> PoolRow:
        """A free slot holding `init` (a one-row state, copied) or the empty state -> its PoolRow."""
        with self._lock:
            if not self._free:
                n = self.rows
                self.state = CodecDecoderState.concat([self.state] + [self._empty] * n)
                self._free = list(range(2 * n - 1, n - 1, -1))
            slot = self._free.pop()
            self._write([slot], init if init is not None else self._empty)
            self.live += 1
        return PoolRow(self, slot)

    def free(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)
                self.live -= 1

    def _index(self, slots: list[int]):
        """A slice where `slots` are consecutive and ascending (views, no gather), else an index tensor."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return torch.tensor(slots, dtype=torch.long).to(self.state.pos.device, non_blocking=True)

    def read(self, slots: list[int]) -> CodecDecoderState:
        """The states of `slots`, in order, as one batched state (a copy)."""
        with self._lock:
            idx = self._index(slots)
            if isinstance(idx, slice):
                f = [t[idx].clone() if d == 0 else t[:, idx].clone()
                     for t, d in zip(self._fields(self.state), self._dims(self.state))]
            else:
                f = [t.index_select(d, idx) for t, d in zip(self._fields(self.state), self._dims(self.state))]
        return CodecDecoderState(f[:-3], f[-3], f[-2], f[-1])

    def read_into(self, slots: list[int], dst: CodecDecoderState) -> None:
        """The states of `slots`, in order, copied into `dst` (a batched state of as many rows, e.g. a CUDA graph's
        static inputs): one copy per history tensor, no state made between."""
        with self._lock:
            idx = self._index(slots)
            for t, o, d in zip(self._fields(self.state), self._fields(dst), self._dims(self.state)):
                if isinstance(idx, slice):
                    o.copy_(t[idx] if d == 0 else t[:, idx])
                else:
                    torch.index_select(t, d, idx, out=o)

    def _write(self, slots: list[int], st: CodecDecoderState) -> None:
        idx = self._index(slots)
        for t, s, d in zip(self._fields(self.state), self._fields(st), self._dims(self.state)):
            if isinstance(idx, slice):
                (t[idx] if d == 0 else t[:, idx]).copy_(s)
            else:
                t.index_copy_(d, idx, s)

    def write(self, slots: list[int], st: CodecDecoderState) -> None:
        """Put the batched state `st` (rows in the order of `slots`) back into `slots`."""
        with self._lock:
            self._write(slots, st)

    def decode(self, codec, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """`codec.decode_step(codes [G, 16, n], the states of slots)` with the advanced states written back (only
        when the decode succeeded) -> waveform [G, n * samples per frame]. A fast step that reads and writes the rows
        itself (`decode_pooled`: a CUDA graph's static state) serves where it can."""
        pooled = getattr(getattr(codec, "fast_step", None), "decode_pooled", None)
        wav = pooled(codes, self, slots) if pooled is not None else None
        if wav is not None:
            return wav
        st = self.read(slots)
        wav = codec.decode_step(codes, st)
        self.write(slots, st)
        return wav
