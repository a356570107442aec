"""Compile every fused kernel for a GPU target without a GPU: `python -m tts_engine.gpu.aot [--arch 0.6b] [--dtype
bf16] [--sm 90]`.

Triton's interpreter (the CPU tests) accepts programs a GPU compiler would refuse (shapes, types, layouts), so this
lowers each kernel as the fused frame launches it (the architecture's real widths, heads and vocabularies; every
variant the frame uses: both stacks, attention with and without key splits, the samplers of both codebook kinds with
their epilogues) through Triton's whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the wheel's own ptxas)
for the target, e.g. sm_90 (H100/H200). Needs triton and its bundled ptxas, not a GPU; prints one line per kernel
variant and exits 1 if any fails. Must run without TRITON_INTERPRET (it compiles the real @triton.jit kernels).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _dtype_name(t) -> str:
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
             torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}
    return names[t.dtype]


def signature(kernel, args, kwargs):
    """(signature, constexprs, options) of one recorded launch, as Triton's launcher would specialise it (without
    its divisibility hints)."""
    import torch

    names = kernel.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    sig, consts = {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if kernel.params[i].is_constexpr:
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _dtype_name(v)
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} is a {type(v).__name__}")
    return sig, consts, options


def record_frame_launches(arch: str, dtype_name: str) -> list:
    """The launches of every op of the fused frame at `arch`'s shapes (CPU tensors, recorded, not run)."""
    import torch

    from tts_engine.config import ModelConfig
    from tts_engine.model.sampling import C0Processor, RowParams, SamplingParams
    from tts_engine.tiny import tiny_config
    from tts_engine.gpu import ops

    ids = {"text_vocab_size": 1000, "im_start_token_id": 1, "im_end_token_id": 2, "tts_pad_token_id": 3,
           "tts_bos_token_id": 4, "tts_eos_token_id": 5}
    tc = ModelConfig.from_dict(tiny_config("custom_voice", "1b7" if arch == "1.7b" else "0b6", ids, arch)).talker
    cc = tc.code_predictor
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    B, R, L = 2, 4, 64
    rows = torch.arange(B)
    e = lambda *s, d=dt: torch.zeros(*s, dtype=d)   # noqa: E731
    rp = RowParams.stack([SamplingParams(seed=1), SamplingParams(do_sample=False)], "cpu")
    general = {"any_sample": True, "k_max": 64, "any_top_p": True}
    rp.host = {"c0": general, "sub": general}
    with ops.recording() as rec:
        for cfg, T, read_len in ((tc, 1, 600), (cc, 2, 2), (cc, 1, 17)):
            D, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            ops.add_rmsnorm(e(B, T, D), e(B, T, D), e(D), 1e-6)
            ops.add_rmsnorm(e(B, T, D), None, e(D), 1e-6)
            pos = torch.zeros(B, T, dtype=torch.long)
            kc, vc = e(R, Hkv, L, hd), e(R, Hkv, L, hd)
            q = ops.qk_norm_rope_write(e(B, T, (H + 2 * Hkv) * hd), e(hd), e(hd), 1e-6, pos, rows, kc, vc, H, Hkv,
                                       cfg.rope_theta)
            ops.decode_attention(q, kc, vc, rows, pos, read_len, splits=1)
            if read_len > 256:
                ops.decode_attention(q, kc, vc, rows, pos, read_len)   # key splits + the combine kernel
            ops.silu_mul(e(B, T, 2 * cfg.intermediate_size))
            # the gemv variant's projections (frame.py `run_gemv`): 1 row, the predictor's first step, the most rows
            for Bg in (1, ops.GEMV_MAX_ROWS // T):
                rg, pg = torch.arange(Bg), torch.zeros(Bg, T, dtype=torch.long)
                x, I = e(Bg, T, D), cfg.intermediate_size
                for res in (None, e(Bg, T, D)):
                    ops.norm_qkv_rope_write(x, res, e(D), 1e-6, e((H + 2 * Hkv) * hd, D), e(hd), e(hd), pg,
                                            rg, kc, vc, H, Hkv, cfg.rope_theta)
                ops.norm_linear(e(Bg, T, H * hd), e(D, H * hd))
                ops.norm_gate_up_silu(x, e(Bg, T, D), e(D), 1e-6, e(2 * I, D))
                ops.norm_linear(e(Bg, T, I), e(D, I))
                ops.norm_linear(x[:, -1], e(cfg.vocab_size, D), e(D), e(Bg, T, D)[:, -1], 1e-6, want_normed=True)
        D = tc.hidden_size
        table = e(tc.vocab_size + 15 * cc.vocab_size, D)
        step = torch.ones(R, dtype=torch.long)
        ops.frame_embed(torch.zeros(B, 16, dtype=torch.long), table, torch.zeros(16, dtype=torch.long),
                        e(R, 8, D), torch.zeros(R, dtype=torch.long), e(D), step, rows)
        codes = torch.zeros(B, 16, dtype=torch.long)
        ops.sample_residual(e(B, cc.vocab_size), rows, step, rp, 3, ids=codes[:, 3], emb=(table, 3072, e(B, D)))
        ops.sample_residual(e(B, cc.vocab_size), rows, step, rp, 15, ids=codes[:, 15])
        proc = C0Processor(tc.vocab_size, tc.codec_eos_token_id, 2, "cpu")
        state = dict(h=e(B, D), hidden=e(R, D), c0=torch.zeros(R, dtype=torch.long),
                     max_new=torch.ones(R, dtype=torch.long), pos=torch.zeros(R, dtype=torch.long), max_pos=L - 1,
                     done=torch.zeros(B, dtype=torch.bool))
        ops.sample_c0(e(B, tc.vocab_size), rows, rp, proc, torch.zeros(R, tc.vocab_size, dtype=torch.bool), step,
                      state=state)
        rp.host = {"c0": {"any_sample": False, "k_max": 0, "any_top_p": False}, "sub": rp.host["sub"]}
        ops.sample_c0(e(B, tc.vocab_size), rows, rp, proc, torch.zeros(R, tc.vocab_size, dtype=torch.bool), step,
                      state=state)   # a greedy batch: the search compiled out
    return rec


def compile_all(arch: str, dtype_name: str, sm: int, verbose: bool = True) -> list[tuple[str, bool, str]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    seen, out = set(), []
    for kernel, grid, args, kwargs in record_frame_launches(arch, dtype_name):
        sig, consts, options = signature(kernel, args, kwargs)
        key = (kernel.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())))
        if key in seen:
            continue
        seen.add(key)
        label = f"{kernel.__name__}({', '.join(f'{k}={v}' for k, v in consts.items())})"
        t0 = time.perf_counter()
        try:
            ck = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                target=GPUTarget("cuda", sm, 32), options=options)
            ok, note = True, f"{len(ck.asm['cubin'])} bytes of cubin, {ck.metadata.shared} B shared, " \
                             f"{time.perf_counter() - t0:.1f} s"
        except Exception as e:   # a kernel the GPU compiler refuses
            ok, note = False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
        out.append((label, ok, note))
        if verbose:
            print(f"{'ok  ' if ok else 'FAIL'} sm_{sm} {label}: {note}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tts_engine.gpu.aot", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    ap.add_argument("--sm", type=int, default=90, help="compute capability x10: 90 H100/H200, 89 L4, 80 A100")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled", file=sys.stderr)
        return 2
    res = compile_all(args.arch, args.dtype, args.sm)
    bad = [r for r in res if not r[1]]
    print(f"{len(res) - len(bad)}/{len(res)} kernel variants compile for sm_{args.sm} ({args.arch}, {args.dtype})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
