"""A batch of streams decodes each row as it would alone (`CodecDecoder.decode_step` on a joined state): the engine
batches concurrent streams' chunks (`engine/worker.py`, chunks on shared frames), which must not change any stream's
samples, in every conv path (aten, packed, int8: the int8 path quantises each row on its own and convolves the rows
one by one or, `batched`, in one call with each row's scale: tests/test_codec_int8_batch.py): the same
bits in bf16 (the CPU engine's dtype), the same up to fp32 rounding in fp32 (the pre-transformer's matrix products
may sum in another order for another batch size; a row quantised with its batch-mates would differ by ~1e-3)."""
from __future__ import annotations

import pytest
import torch

from tts_engine.codec import decoder
from tts_engine.cpu import int8_conv
from tts_engine.cpu import packed_conv
from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig, CodecDecoderState
from tts_engine.tiny import tiny_speech_tokenizer_config


def _dec(dtype):
    torch.manual_seed(0)
    return CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).to(dtype).eval()


def _paths():
    out = [("aten", torch.float32, "rows")]
    if packed_conv.available():
        out.append(("packed", torch.float32, "rows"))
        if decoder._MKLDNN_BF16:
            out.append(("packed", torch.bfloat16, "rows"))
        if int8_conv.available():
            ways = ["rows"] + (["batched"] if int8_conv.batched_available() else [])
            out += [("int8", dt, w) for dt in [torch.float32] + ([torch.bfloat16] if decoder._MKLDNN_BF16 else [])
                    for w in ways]
    return out


@pytest.mark.parametrize("mode, dtype, way", _paths())
@pytest.mark.parametrize("n", [2])
def test_a_batch_decodes_each_row_as_alone(mode, dtype, way, n, monkeypatch):
    monkeypatch.setattr(int8_conv, "MIN_POSITIONS", 0)     # (the tiny decoder's calls are small: int8 for all)
    monkeypatch.setenv(int8_conv.BATCH_ENV, way)            # int8: a batch's rows in one call each, or all in one
    dec = _dec(dtype)
    dec.set_conv_mode(mode)
    g = torch.Generator().manual_seed(1)
    book = dec.cfg.codebook_size
    states = []
    with torch.inference_mode():
        for i, before in enumerate((1, 4, 9)):              # streams at different places, with different loudness
            st = dec.init_state(1)
            dec.decode_step(torch.randint(0, book // (1 + 3 * i), (1, 16, before), generator=g), st)
            states.append(st)
        codes = torch.stack([torch.randint(0, book // (1 + 3 * i), (16, n), generator=g) for i in range(3)])
        solo = [s.clone() for s in states]
        alone = [dec.decode_step(codes[i:i + 1], solo[i]) for i in range(3)]
        joined = CodecDecoderState.concat([s.clone() for s in states])
        batch = dec.decode_step(codes, joined)
        nxt = torch.randint(0, book, (3, 16, 2), generator=g)
        for i in range(3):   # the samples, then the next chunk from the advanced states (each row's state as alone)
            _same(batch[i:i + 1], alone[i], dtype)
            _same(dec.decode_step(nxt[i:i + 1], joined.select(torch.tensor([i]))),
                  dec.decode_step(nxt[i:i + 1], solo[i]), dtype)


def _same(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    if dtype == torch.bfloat16:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
