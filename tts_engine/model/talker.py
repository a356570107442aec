"""The talker (a 28-layer Qwen3 decoder over codec frames) and its code predictor (the "sub-talker").

Module and parameter names mirror the official checkpoint below the `talker.` prefix:
  model.{layers.N.*, norm, codec_embedding, text_embedding}, text_projection.linear_fc{1,2},
  codec_head, code_predictor.{model.{layers.N.*, norm, codec_embedding.{0..14}}, lm_head.{0..14},
  small_to_mtp_projection (1.7B only)}.

Per audio frame: the talker consumes the frame's summed 16 code embeddings (+ a text-track vector)
and predicts codebook 0 of the next frame; the code predictor then produces codebooks 1..15 from
[talker hidden, C(c0)] in 15 sequential steps with its own small KV cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tts_engine.config import CodePredictorConfig, TalkerConfig
from tts_engine.model.layers import DecoderStack, KVCache


class TextProjection(nn.Module):
    """text_embedding width -> talker width: linear_fc2(silu(linear_fc1(x))), both with bias."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(d_in, d_in, bias=True)
        self.linear_fc2 = nn.Linear(d_in, d_out, bias=True)

    def forward(self, x):
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(DecoderStack):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class CodePredictorModel(DecoderStack):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int):
        super().__init__(cfg)
        # one embedding per codebook 1..15, in *talker* width (projected on the way in)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(cfg.num_code_groups - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.model = CodePredictorModel(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1))
        if cfg.hidden_size != talker_hidden:
            self.small_to_mtp_projection = nn.Linear(talker_hidden, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        self._pos_cache: dict = {}   # (B, start, T, device, dtype) -> DecoderStack.positions(...)
        # fast-path hooks, set only by a device backend when it attaches (engine/backends.py; None: plain PyTorch):
        self.compiled = None         # serves `step`'s one-row passes (CPU: cpu/compiled_predictor.py, optional)
        self.frame = None            # serves a frame's 15 passes for the runner (CPU: cpu/predictor_frame.py)

    def new_cache(self, rows: int, device, dtype) -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, rows, c.num_key_value_heads, c.num_code_groups + 1, c.head_dim,
                       device, dtype)

    def step(self, x: torch.Tensor, cache: KVCache, rows: torch.Tensor, start: int, head: int) -> torch.Tensor:
        """x [B, T, talker D] inputs at positions start..start+T-1 (same for every row, since every row
        runs the same 15 steps each frame) -> logits of codebook head+1 for the last position [B, V] (fp32)."""
        B, T = x.shape[0], x.shape[1]
        if self.compiled is not None and self.compiled.ok and rows is None and B == 1 and T == 1:
            try:
                return self.lm_head[head](self.compiled.run(x, cache, start)[:, -1]).float()
            except Exception as e:   # one log line, then the eager path for good
                self.compiled.disable(e)
        positions = self._positions(B, start, T, x.device, x.dtype)
        h = self.model.run(self.small_to_mtp_projection(x), cache, slice(0, B) if rows is None else rows,
                           positions[0][:, 0], start + T, positions=positions,
                           write_start=start if rows is None else None)
        return self.lm_head[head](h[:, -1]).float()

    def _positions(self, B: int, start: int, T: int, device, dtype):
        """The (pos, cos, sin, mask) of one predictor step: the same 15 sets every frame, so they are built
        once per (batch, step) and kept (not while a CUDA graph is being captured: there they are recorded)."""
        key = (B, start, T, device, dtype)
        got = self._pos_cache.get(key)
        if got is None:
            got = self.model.positions(torch.full((B,), start, dtype=torch.long, device=device), T, start + T, dtype)
            if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                self._pos_cache[key] = got
        return got


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.hidden_size)
        self._frame_table: torch.Tensor | None = None
        self._frame_offsets: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """q/k/v and gate/up of every talker and code-predictor layer as one matmul each (see
        `Attention.fuse_projections`): fewer calls per frame. `quantize_talker` does this before quantising, and the
        CPU backend when it attaches to a 16-bit model; fp32 keeps the checkpoint's separate projections (bit-for-bit
        parity)."""
        self.model.fuse_projections()
        self.code_predictor.model.fuse_projections()

    # --- embeddings ------------------------------------------------------------------------------
    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """T(id): text ids [...] -> projected text-track vectors [..., D]."""
        emb = self.model.text_embedding(ids.to(self.model.text_embedding.weight.device))
        w = self.model.norm.weight   # device and activation dtype (codec_head may be quantised)
        return self.text_projection(emb.to(w.device, w.dtype))

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """C(id): codec-track vectors of talker vocab ids [...] -> [..., D]."""
        return self.model.codec_embedding(ids)

    def build_frame_table(self) -> None:
        """Stack the talker codec embedding (codebook 0 + specials) and the 15 predictor embeddings into one
        table, and make the modules' weights views of it, so a frame's 16 codes embed with one gather and
        no extra memory. Call after the weights are loaded."""
        embs = [self.model.codec_embedding] + list(self.code_predictor.model.codec_embedding)
        table = torch.cat([e.weight.detach() for e in embs], dim=0)
        offsets, o = [], 0
        for e in embs:
            n = e.weight.shape[0]
            e.weight = nn.Parameter(table[o:o + n], requires_grad=False)
            offsets.append(o)
            o += n
        self._frame_table = table
        self._frame_offsets = torch.tensor(offsets, device=table.device)

    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """E(frame): codes [..., 16] -> sum of the 16 code embeddings [..., D] (one gather)."""
        if self._frame_table is None:
            self.build_frame_table()
        return self._frame_table[codes + self._frame_offsets].sum(-2)

    # --- stack calls ------------------------------------------------------------------------------
    def new_cache(self, rows: int, max_len: int, device, dtype) -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, rows, c.num_key_value_heads, max_len, c.head_dim, device, dtype)

    def forward_embeds(self, x: torch.Tensor, cache: KVCache, rows: torch.Tensor, start: torch.Tensor,
                       read_len: int, write_start: int | None = None):
        """x [B, T, D] -> (hidden of last position [B, D], codebook-0 logits [B, V] fp32). write_start: every
        row's start as a host int (a prompt prefill: the new keys go in with slice copies)."""
        h = self.model.run(x, cache, rows, start, read_len, write_start=write_start)[:, -1]
        return h, self.codec_head(h).float()
