"""The fused frame: the code predictor's 15 steps + the talker step + sampling, built from the kernels of `ops`.

`FusedFrame(runner)` has the runner's two halves of a frame: `predict(h, c0, frame_idx, rp)` as
`ModelRunner._predict_residuals` (the codes [B, 16] of the frame being completed; only the predictor's scratch cache
changes) and `advance(r, cache_rows, rp, read_len, codes)` as `ModelRunner._advance` (the talker step: KV cache, pos,
step, seen, hidden, c0, the done flags), with static shapes and no host synchronisation, so a CUDA graph can capture
them (`backend.install` puts them in the runner's place). Per decoder layer:
  add+RMSNorm (fused with the previous residual add) -> qkv GEMM (q/k/v weights concatenated once) -> q/k RMSNorm +
  RoPE + KV write (one kernel) -> decode attention over each row's real length -> o GEMM -> add+RMSNorm -> gate_up
  GEMM (concatenated once) -> SiLU*up -> down GEMM
and per step one head GEMM and one sampler launch, which also writes the code into the frame's codes and gathers
the next step's input embedding (predictor) or does the runner's whole `_after_c0` and position update (talker).
The 15 predictor embeddings are read from the talker's frame table (`Talker.build_frame_table`: all 16 codebooks in
one tensor), the 15 heads from one stacked [15, V, D] tensor.

That is the "gemm" variant. The "gemv" variant (`variant = "gemv"`, chosen by measuring: `variants.py`) runs a stack
pass of <= ops.GEMV_MAX_ROWS rows with our matrix-vector kernels instead of cuBLAS, each with its neighbours inside:
  norm + qkv + q/k norm + RoPE + KV write -> attention -> o -> norm + gate_up + SiLU*up -> down
(5 launches per layer instead of 9; the stack's final norm inside the head's launch).

With every op on its reference (`ops`, a CPU without the interpreter forced) the same structure runs eagerly.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from tts_engine.gpu import ops


def _plain(m, what: str) -> nn.Linear:
    if type(m) is not nn.Linear:
        raise ValueError(f"{what} is a {type(m).__name__}, not a plain nn.Linear (quantised?)")
    return m


def _stacked(parts: list[nn.Linear], what: str, share: bool) -> torch.Tensor:
    """The weights of `parts` stacked along the output rows. share: the modules' weights become views of the stacked
    tensor (no second copy; the same values, each view contiguous), as `Talker.build_frame_table` does."""
    for p in parts:
        _plain(p, what)
        if p.bias is not None:
            raise ValueError(f"{what} has a bias")
    w = torch.cat([p.weight.detach() for p in parts]).contiguous()
    if share:
        o = 0
        for p in parts:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(w[o:o + n], requires_grad=False)
            o += n
    return w


class _Stack:
    """One decoder stack's weights as the fused frame reads them."""

    def __init__(self, stack, share: bool):
        cfg = stack.cfg
        self.H, self.Hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.theta = cfg.rms_norm_eps, cfg.rope_theta
        if self.hd & (self.hd - 1):
            raise ValueError(f"head_dim {self.hd} is not a power of 2")
        self.layers = []
        for i, layer in enumerate(stack.layers):
            at, mlp = layer.self_attn, layer.mlp
            if at.qkv_proj is not None:
                wqkv = _plain(at.qkv_proj, f"layer {i} qkv_proj").weight.detach()
            else:
                wqkv = _stacked([at.q_proj, at.k_proj, at.v_proj], f"layer {i} q/k/v", share)
            if mlp.gate_up_proj is not None:
                wgu = _plain(mlp.gate_up_proj, f"layer {i} gate_up_proj").weight.detach()
            else:
                wgu = _stacked([mlp.gate_proj, mlp.up_proj], f"layer {i} gate/up", share)
            self.layers.append(SimpleNamespace(
                wqkv=wqkv, wgu=wgu, wo=_plain(at.o_proj, f"layer {i} o_proj").weight.detach(),
                wdown=_plain(mlp.down_proj, f"layer {i} down_proj").weight.detach(),
                ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                qn=at.q_norm.weight.detach(), kn=at.k_norm.weight.detach()))
        self.norm = stack.norm.weight.detach()

    def run(self, x: torch.Tensor, cache, rows: torch.Tensor, pos: torch.Tensor, read_len: int) -> torch.Tensor:
        """x [B, T, D] at positions pos [B, T] of cache rows `rows` [B] -> final-normed hidden [B, T, D]."""
        n = len(self.layers)
        res, h = ops.add_rmsnorm(x, None, self.layers[0].ln1, self.eps)
        for i, L in enumerate(self.layers):
            qkv = F.linear(h, L.wqkv)
            q = ops.qk_norm_rope_write(qkv, L.qn, L.kn, self.eps, pos, rows, cache.k[i], cache.v[i], self.H,
                                       self.Hkv, self.theta)
            a = ops.decode_attention(q, cache.k[i], cache.v[i], rows, pos, read_len)
            res, h = ops.add_rmsnorm(F.linear(a, L.wo), res, L.ln2, self.eps)
            m = F.linear(ops.silu_mul(F.linear(h, L.wgu)), L.wdown)
            res, h = ops.add_rmsnorm(m, res, self.layers[i + 1].ln1 if i + 1 < n else self.norm, self.eps)
        return h

    def run_gemv(self, x: torch.Tensor, cache, rows: torch.Tensor, pos: torch.Tensor, read_len: int):
        """The same layers in the gemv variant (x [B, T, D], B * T <= ops.GEMV_MAX_ROWS): each residual add + RMSNorm
        inside the next projection's launch, SiLU*up inside gate_up's, q/k norm + RoPE + KV write inside qkv's ->
        (m, res): the last layer's MLP output and the residual stream before it, both [B, T, D] (the final norm
        happens inside the head's launch: `FusedFrame._stack_head`). 5 launches per layer."""
        m, res = x, None
        for i, L in enumerate(self.layers):
            q, res = ops.norm_qkv_rope_write(m, res, L.ln1, self.eps, L.wqkv, L.qn, L.kn, pos, rows, cache.k[i],
                                             cache.v[i], self.H, self.Hkv, self.theta)
            a = ops.decode_attention(q, cache.k[i], cache.v[i], rows, pos, read_len)
            o = ops.norm_linear(a, L.wo)[0]
            act, res = ops.norm_gate_up_silu(o, res, L.ln2, self.eps, L.wgu)
            m = ops.norm_linear(act, L.wdown)[0]
        return m, res


# the fused frame's variants (`FusedFrame.variant`; the measured choice between them: `variants.py`):
#   "gemm": cuBLAS GEMMs and the separate Triton kernels (9 launches per decoder layer);
#   "gemv": where a stack runs <= ops.GEMV_MAX_ROWS rows, our matrix-vector kernels with their neighbours fused in
#           (5 launches per layer, the final norm inside the head's launch); larger batches as "gemm".
VARIANTS = ("gemm", "gemv")


class FusedFrame:
    """The fused frame of one `ModelRunner` (its talker's weights, caches and state tensors)."""

    def __init__(self, runner, share_weights: bool | None = None):
        t = runner.talker
        self.runner = runner
        if share_weights is None:   # on a GPU, before any graph holds the old weights' addresses: no second copy
            graphs = getattr(runner.graphs, "graphs", None)
            share_weights = runner.device.type == "cuda" and not graphs
        self.talker = _Stack(t.model, share_weights)
        cp = t.code_predictor
        self.cp = _Stack(cp.model, share_weights)
        self.n_books = t.cfg.num_code_groups
        if cp.cfg.vocab_size > 4096 or t.cfg.vocab_size > 4096:
            raise ValueError("the sampler holds a row of at most 4096 logits")
        self.codec_head = _plain(t.codec_head, "codec_head").weight.detach()
        heads = list(cp.lm_head)
        if any(h.bias is not None for h in heads):
            raise ValueError("a code-predictor head has a bias")
        self.heads = _stacked(heads, "code-predictor heads", share_weights).view(len(heads), -1, heads[0].in_features)
        proj = cp.small_to_mtp_projection
        if isinstance(proj, nn.Identity):
            self.proj = None
        else:
            proj = _plain(proj, "small_to_mtp_projection")
            self.proj = (proj.weight.detach(), None if proj.bias is None else proj.bias.detach())
        if t._frame_table is None:
            t.build_frame_table()
        self.table, self.offsets = t._frame_table, t._frame_offsets
        self.offsets_host = [int(o) for o in self.offsets.tolist()]
        self._cp_pos: dict = {}
        self.variant = "gemm"

    def _stack_head(self, st: _Stack, x: torch.Tensor, cache, rows, pos, read_len: int, head: torch.Tensor,
                    want_h: bool):
        """The stack over x [B, T, D], then the head on its last position -> (logits [B, V], h: the normed last
        position [B, D] where want_h (else whatever is at hand, maybe None))."""
        B, T = x.shape[0], x.shape[1]
        if self.variant == "gemv" and ops.gemv_fits(B * T):
            m, res = st.run_gemv(x, cache, rows, pos, read_len)
            logits, _, h = ops.norm_linear(m[:, -1], head, st.norm, res[:, -1], st.eps, want_normed=want_h)
            return logits, h
        h = st.run(x, cache, rows, pos, read_len)[:, -1]
        return F.linear(h, head), h

    # --- the frame's two halves ---------------------------------------------------------------------------------------
    def _positions(self, B: int, j: int, device) -> torch.Tensor:
        """The predictor's positions of step j [B, T]: 0, 1 for step 0, j + 1 after (kept, except while a CUDA graph
        is being captured: there they are recorded)."""
        key = (B, j, device)
        got = self._cp_pos.get(key)
        if got is None:
            if j == 0:
                got = torch.arange(2, device=device).repeat(B, 1)
            else:
                got = torch.full((B, 1), j + 1, dtype=torch.long, device=device)
            if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                self._cp_pos[key] = got
        return got

    def predict(self, h: torch.Tensor, c0: torch.Tensor, frame_idx: torch.Tensor, rp) -> torch.Tensor:
        """Codebooks 1..15 of each row's frame from [h, C(c0)] (talker hidden h [B, D], codebook-0 ids c0 [B], the
        frames' indices [B]: `ModelRunner._predict_residuals`) -> codes [B, 16]."""
        run = self.runner
        B, dev = h.shape[0], run.device
        x = torch.stack([h, self.table[c0]], dim=1)                              # [B, 2, D]
        codes = torch.empty(B, self.n_books, dtype=torch.long, device=dev)
        codes[:, 0] = c0
        rows = run.row_index[:B]          # the predictor's cache rows (as the eager loop: 0..B-1)
        for j in range(self.n_books - 1):
            T = 2 if j == 0 else 1
            start = 0 if j == 0 else j + 1
            xin = x if self.proj is None else F.linear(x, *self.proj)
            logits, _ = self._stack_head(self.cp, xin, run.cp_cache, rows, self._positions(B, j, dev), start + T,
                                         self.heads[j], False)
            last = j + 1 == self.n_books - 1
            x_next = None if last else torch.empty(B, self.table.shape[1], dtype=self.table.dtype, device=dev)
            ops.sample_residual(logits, rows, frame_idx, rp, j + 1, ids=codes[:, j + 1], frame_off=0,
                                emb=None if last else (self.table, self.offsets_host[j + 1], x_next))
            if not last:
                x = x_next[:, None]
        return codes

    def advance(self, r: torch.Tensor, cache_rows, rp, read_len: int, codes: torch.Tensor) -> torch.Tensor:
        """The talker step consuming `codes` [B, 16] and drawing each row's next codebook-0 id (`ModelRunner._advance`;
        cache_rows unused: the row indices r address the caches) -> done [B]."""
        run = self.runner
        B = r.shape[0]
        x = ops.frame_embed(codes, self.table, self.offsets, run.trailing, run.trailing_len, run.tts_pad, run.step, r)
        pos = run.pos[r][:, None]
        logits, h = self._stack_head(self.talker, x[:, None], run.cache, r, pos, read_len, self.codec_head, True)
        state = dict(h=h, hidden=run.hidden, c0=run.c0, max_new=run.max_new, pos=run.pos, max_pos=run.max_len - 1,
                     done=torch.empty(B, dtype=torch.bool, device=run.device))
        _, done = ops.sample_c0(logits, r, rp, run.c0_proc, run.seen, run.step, state=state)
        return done
