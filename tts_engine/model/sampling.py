"""Token selection, batched, on the device, with per-row parameters.

Codebook 0 (talker) follows the official HF processor order exactly:
  repetition penalty over the row's previously generated c0 ids -> EOS masked for the first
  `min_new_tokens` (2) steps -> suppress ids [V-1024, V) except EOS -> (if sampling) temperature ->
  top-k -> top-p -> draw.
Codebooks 1..15 (code predictor) use only temperature -> top-k -> top-p with the sub-talker parameters.
Greedy rows take the argmax of the processed logits.

Random draws use a counter-based generator: the uniform for (seed, frame, codebook, token) is a hash of
those four integers, and a categorical draw is the Gumbel-max over the masked logits. A row's tokens thus
depend only on its own seed and logits, never on which other requests share the batch, and the whole
procedure is plain tensor arithmetic (CUDA-graph capturable, no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class SamplingParams:
    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    max_new_tokens: int = 2048
    seed: int = 0
    ignore_eos: bool = False   # benchmarks: force a fixed output length

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        """generation_config.json (unknown keys ignored); missing keys keep the official wrapper's fallbacks."""
        names = set(cls.__dataclass_fields__) - {"seed", "ignore_eos"}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})


@dataclass
class RowParams:
    """SamplingParams of B rows as device tensors ([B] each), plus host-side facts about the batch (known
    without asking the device) that let the sampler skip work no row needs."""

    do_sample: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    temperature: torch.Tensor
    penalty: torch.Tensor
    sub_do_sample: torch.Tensor
    sub_top_k: torch.Tensor
    sub_top_p: torch.Tensor
    sub_temperature: torch.Tensor
    seed: torch.Tensor
    ignore_eos: torch.Tensor
    host: dict

    @classmethod
    def stack(cls, params: list[SamplingParams], device) -> "RowParams":
        def t(vals, dtype):
            return torch.tensor(vals, dtype=dtype, device=device)

        host = host_facts(params)
        return cls(
            do_sample=t([p.do_sample for p in params], torch.bool),
            top_k=t([p.top_k for p in params], torch.long),
            top_p=t([p.top_p for p in params], torch.float32),
            temperature=t([p.temperature for p in params], torch.float32),
            penalty=t([p.repetition_penalty for p in params], torch.float32),
            sub_do_sample=t([p.subtalker_dosample for p in params], torch.bool),
            sub_top_k=t([p.subtalker_top_k for p in params], torch.long),
            sub_top_p=t([p.subtalker_top_p for p in params], torch.float32),
            sub_temperature=t([p.subtalker_temperature for p in params], torch.float32),
            seed=t([p.seed & 0x7FFFFFFFFFFFFFFF for p in params], torch.long),
            ignore_eos=t([p.ignore_eos for p in params], torch.bool),
            host=host,
        )

    def select(self, rows, host: dict) -> "RowParams":
        """The RowParams of some rows: every tensor indexed by `rows` (a slice gives views, an index tensor
        copies) and `host` the host facts of those rows (`host_facts` of their SamplingParams)."""
        return RowParams(**{k: (v[rows] if k != "host" else host) for k, v in self.__dict__.items()})


def host_facts(params: list[SamplingParams]) -> dict:
    """What the sampler may skip for a batch, known on the host: whether any row samples, the largest top-k
    (0 = some row uses the whole vocabulary), whether any row uses top-p; for codebook 0 and the predictor."""
    ps = params or [SamplingParams(do_sample=False, subtalker_dosample=False)]

    def facts(sample, k, p):
        return {"any_sample": any(sample), "k_max": 0 if any(x <= 0 for x in k) else max(k),
                "any_top_p": any(x < 1.0 for x in p)}
    return {"c0": facts([p.do_sample for p in ps], [p.top_k for p in ps], [p.top_p for p in ps]),
            "sub": facts([p.subtalker_dosample for p in ps], [p.subtalker_top_k for p in ps],
                         [p.subtalker_top_p for p in ps])}


# --- counter-based uniforms ---------------------------------------------------------------------
_M1 = -4658895280553007687   # 0xBF58476D1CE4E5B9 as signed int64
_M2 = -7723592293110705685   # 0x94D049BB133111EB
_G = -7046029254386353131    # 0x9E3779B97F4A7C15


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping arithmetic; logical shifts emulated with masks)."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * _M1
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * _M2
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def uniforms(seed: torch.Tensor, frame: torch.Tensor, book: int, vocab: int | torch.Tensor) -> torch.Tensor:
    """U(0,1) (float64) determined by (seed [B], frame [B], codebook, token id): [B, vocab] for every id, or
    [B, k] for the ids given as a [B, k] tensor."""
    tok = (torch.arange(vocab, device=seed.device, dtype=torch.long)[None] if isinstance(vocab, int) else vocab)
    key = _mix(seed * _G + frame * 1000003 + book)
    x = _mix(key[:, None] + tok * _G)
    mant = (x >> 11) & ((1 << 53) - 1)
    return (mant.double() + 0.5) / float(1 << 53)


# --- processors -----------------------------------------------------------------------------------
def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor over the ids marked in `seen` [B, V] bool; penalty [B]."""
    p = penalty[:, None]
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Temperature -> top-k -> top-p over the full vocabulary, per row, as the HF warpers (ties at the k-th
    value kept). The reference for `choose`, which does the same on the top-k candidates only."""
    logits = logits / temperature[:, None]
    V = logits.shape[-1]
    sorted_desc, _ = torch.sort(logits, dim=-1, descending=True)
    kth = sorted_desc.gather(-1, (top_k.clamp(1, V) - 1)[:, None])
    logits = torch.where((top_k > 0)[:, None] & (logits < kth), torch.full_like(logits, NEG_INF), logits)
    return _top_p(logits, top_p)


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF TopPLogitsWarper: drop the tail whose cumulative mass <= 1 - top_p, always keeping the most likely
    token; rows with top_p >= 1 are untouched (HF does not add the warper)."""
    sorted_asc, idx_asc = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)[:, None]
    remove_sorted[:, -1].fill_(False)    # (a fill, not a copy of a host scalar: CUDA-graph capturable)
    remove = torch.zeros_like(remove_sorted).scatter(-1, idx_asc, remove_sorted)
    return logits.masked_fill(remove & (top_p < 1.0)[:, None], NEG_INF)


def choose(logits: torch.Tensor, do_sample, temperature, top_k, top_p, seed, frame, book: int,
           host: dict) -> torch.Tensor:
    """Greedy argmax for rows with do_sample False, else a Gumbel-max draw from the warped distribution.

    Only the k_max best candidates are scored (top-k by value, then each row's own k, temperature and
    top-p among them), so the per-draw cost is O(k) after one top-k, not a sort of the vocabulary."""
    greedy = logits.argmax(dim=-1)
    if not host["any_sample"]:
        return greedy
    V = logits.shape[-1]
    k_max = host["k_max"] or V
    vals, idx = torch.topk(logits, min(k_max, V), dim=-1)                       # [B, k] descending
    rank = torch.arange(vals.shape[1], device=logits.device)[None]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    vals = (vals / temperature[:, None]).masked_fill(~keep, NEG_INF)
    if host["any_top_p"]:
        vals = _top_p(vals, top_p)
    u = uniforms(seed, frame, book, idx)
    pick = (vals.double() - torch.log(-torch.log(u))).argmax(dim=-1)
    drawn = idx.gather(-1, pick[:, None])[:, 0]
    return torch.where(do_sample, drawn, greedy)


class C0Processor:
    """Codebook-0 logits processing with the official constants of one model."""

    def __init__(self, vocab_size: int, eos_id: int, min_new_tokens: int, device):
        self.eos_id = eos_id
        self.min_new_tokens = min_new_tokens
        suppress = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        suppress[vocab_size - 1024:] = True
        suppress[eos_id] = False
        self.suppress = suppress

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor, step: torch.Tensor, rp: RowParams) -> torch.Tensor:
        """logits [B, V] fp32, seen [B, V] bool, step [B] number of c0 ids generated so far -> chosen ids [B]."""
        logits = apply_repetition_penalty(logits, seen, rp.penalty)
        block_eos = ((step < self.min_new_tokens) | rp.ignore_eos)[:, None] & (
            torch.arange(logits.shape[-1], device=logits.device) == self.eos_id)[None]
        logits = logits.masked_fill(block_eos | self.suppress[None], NEG_INF)
        return choose(logits, rp.do_sample, rp.temperature, rp.top_k, rp.top_p, rp.seed, step, 0, rp.host["c0"])


def choose_residual(logits: torch.Tensor, frame: torch.Tensor, book: int, rp: RowParams) -> torch.Tensor:
    """Codebook `book` (1..15) from the code predictor's logits [B, 2048] -> ids [B]."""
    return choose(logits, rp.sub_do_sample, rp.sub_temperature, rp.sub_top_k, rp.sub_top_p, rp.seed, frame, book,
                  rp.host["sub"])
