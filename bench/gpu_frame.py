"""The fused GPU frame on a GPU, in one prepared call: `python -m bench gpu_frame [--arch 0.6b] [--dtype bf16]`.

On CUDA: a talker of the chosen architecture with random weights (the config of `tts_engine.tiny`, seed 0), a
ModelRunner in the chosen dtype, `backend.attach` (its kernel checks and frame trial, run even where a verdict is
remembered: TTS_GPU_FRAME=check unless set; the status is printed), then for each batch B of --batches, from the same
state (B rows whose caches hold --prompt random positions, greedy):
  - --frames frames eagerly and fused: the codes compared (fp32: must be equal; 16-bit: the fraction equal), with
    where each row's codes first part (frame.codebook) and, for B > 1, row 0 run alone from the same state against
    row 0 in the batch, fused and eager (a batch-1-only difference shows here: on a CPU in fp32 they are equal);
  - ms per frame of each, and with --graphs of each captured as a CUDA graph (cuda_graphs.GraphedFrames) and replayed;
  - the launches of one fused frame: Triton kernels + the other non-view aten ops (a dispatch counter; allocations
    not counted), beside the same count of the eager frame.
With --prefill 16,64 (issue 28): for each B, B ragged prompts (random embeddings) prefilled together
(`ModelRunner.prefill_batch`) eagerly and through the prefill's CUDA graphs per bucket (`gpu.prefill_graph`, forced on:
captured and checked on the first call, timed apart), --prefill-rounds times each: ms per call p50/p99, the first
codebook-0 ids equal, the hidden's relative error. With --codec-rows 1,16,64: the codec decoder of --arch (random
weights) as a CUDA graph per shape over a `CodecStatePool` of that many streams, --codec-frames frames a decode: ms per
decode with the pool's rows copied straight into and out of the graph (`decode_pooled`, one copy each way) against the
state gathered, copied in, cloned out and written back (two copies each way), and eager; the audio compared.
One JSON object on stdout (and in --json FILE). Kernel tests on the GPU: TTS_GPU_TEST_DEVICE=cuda pytest
tests/test_gpu_kernels.py.

Without CUDA: --interpret runs it all on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 is set before
the kernels are imported; use --arch tiny: a dry run of this script, its timings mean nothing); otherwise it prints
attach's status and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m bench gpu_frame", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="0.6b", choices=["tiny", "small", "0.6b", "1.7b"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=100, help="positions already in each row's talker cache")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays of both frames")
    ap.add_argument("--interpret", action="store_true", help="no GPU: Triton's interpreter on CPU tensors")
    ap.add_argument("--prefill", default="", help="batch sizes of the batched prefill: eager against CUDA graphs")
    ap.add_argument("--prefill-rounds", type=int, default=10)
    ap.add_argument("--codec-rows", default="", help="streams of the codec decode: one copy against two, eager")
    ap.add_argument("--codec-frames", type=int, default=4)
    ap.add_argument("--codec-rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def build_runner(arch: str, dtype, device, rows: int, max_len: int):
    import torch

    from tts_engine.config import ModelConfig
    from tts_engine.engine.model_runner import ModelRunner
    from tts_engine.model.talker import Talker
    from tts_engine.tiny import tiny_config

    ids = {"text_vocab_size": 1000, "im_start_token_id": 1, "im_end_token_id": 2, "tts_pad_token_id": 3,
           "tts_bos_token_id": 4, "tts_eos_token_id": 5}
    cfg = ModelConfig.from_dict(tiny_config("custom_voice", "1b7" if arch == "1.7b" else "0b6", ids, arch)).talker
    torch.manual_seed(0)
    with torch.device(device):
        talker = Talker(cfg)
    talker = talker.to(dtype).eval().requires_grad_(False)
    talker.build_frame_table()
    tts_pad = torch.randn(cfg.hidden_size, device=device)
    return ModelRunner(talker, tts_pad, rows=rows, max_len=max_len, eos_id=cfg.codec_eos_token_id)


STATE = ("pos", "step", "seen", "hidden", "c0", "max_new", "trailing_len")


def prepare(run, B: int, prompt: int):
    import torch

    from tts_engine.model.sampling import SamplingParams

    g = torch.Generator(device="cpu").manual_seed(B)
    for i in range(B):
        run.set_params(i, SamplingParams(do_sample=False, subtalker_dosample=False))
        L = prompt + 3 * i
        for c in (run.cache.k, run.cache.v):
            c[:, i, :, :L] = torch.randn(c[:, i, :, :L].shape, generator=g).to(c.device, c.dtype)
        run.pos[i], run.host_len[i], run.step[i], run.max_new[i] = L, L, 1, 1 << 20
        run.hidden[i] = (torch.randn(run.hidden.shape[1], generator=g) * 2).to(run.hidden.device, run.dtype)
        run.c0[i] = int(torch.randint(0, 2048, (1,), generator=g))
        run.seen[i] = False
        run.trailing_len[i] = 0


def snapshot(run):
    return {"k": run.cache.k.clone(), "v": run.cache.v.clone(), "host_len": list(run.host_len),
            **{k: getattr(run, k).clone() for k in STATE}}


def restore(run, s):
    run.cache.k.copy_(s["k"])
    run.cache.v.copy_(s["v"])
    run.host_len[:] = s["host_len"]
    for k in STATE:
        getattr(run, k).copy_(s[k])


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_frames(run, B: int, n: int):
    import torch

    rows = list(range(B))
    _sync(run.device)
    t0 = time.perf_counter()
    codes = [run.decode(rows)[0] for _ in range(n)]
    _sync(run.device)
    return torch.stack(codes, 1), (time.perf_counter() - t0) * 1000 / n


def first_difference(a, b) -> list[str]:
    """Per row of codes [B, frames, 16]: where a and b first part ("frame.codebook"), or "-" where they never do."""
    out = []
    for i in range(a.shape[0]):
        diff = (a[i] != b[i]).nonzero()
        out.append("-" if diff.numel() == 0 else f"{int(diff[0, 0])}.{int(diff[0, 1])}")
    return out


def alone_vs_batch(run, s, B: int, n: int, codes_batch) -> str:
    """Row 0 run alone (batch 1) from the state `s` of B rows, its codes against row 0's in the batch -> "k/N"."""
    restore(run, s)
    codes = run_frames(run, 1, n)[0]
    restore(run, s)
    return f"{int((codes[0] == codes_batch[0]).sum())}/{codes[0].numel()}"


def count_launches(run, B: int) -> dict:
    """Launches of one frame (state restored after): Triton kernels through `ops`, and the other non-view aten ops
    (allocations and Triton's interpreter's own tensor work left out)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tts_engine.gpu import ops

    skip = {"empty", "empty_strided", "empty_like", "view", "_unsafe_view", "as_strided", "alias", "detach",
            "lift_fresh", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select", "slice",
            "split", "split_with_sizes", "chunk", "unbind", "unflatten", "_reshape_alias", "reshape",
            "set_", "resolve_conj", "resolve_neg"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not ops.LaunchCount.active and func.overloadpacket.__name__ not in skip:
                self.n += 1
            return func(*args, **(kwargs or {}))

    s = snapshot(run)
    k0 = ops.K.LAUNCHES.total() if ops.K is not None else 0
    with Count() as c:
        run.decode(list(range(B)))
    restore(run, s)
    n = (ops.K.LAUNCHES.total() if ops.K is not None else 0) - k0
    return {"triton": n, "aten": c.n, "total": n + c.n}


def graph_ms(run, B: int, n: int):
    """Capture `run.frame` for (B, its length bucket), replay n times -> (codes of the first replay, ms per replay)."""
    import torch

    from tts_engine.engine.cuda_graphs import GraphedFrames

    gf = GraphedFrames(run)
    read_len = max(run.host_len[i] for i in range(B)) + 1
    s = snapshot(run)
    codes = gf.run(B, read_len)[0]      # captures (warm-up on a side stream, then the capture), replays once
    restore(run, s)
    codes = gf.run(B, read_len)[0]
    _sync(run.device)
    t0 = time.perf_counter()
    for _ in range(n):
        gf.run(B, read_len)
    _sync(run.device)
    ms = (time.perf_counter() - t0) * 1000 / n
    restore(run, s)
    del gf
    torch.cuda.empty_cache()
    return codes, ms


def _pcts(ms: list[float]) -> dict:
    import numpy as np

    return {"p50": round(float(np.percentile(ms, 50)), 3), "p99": round(float(np.percentile(ms, 99)), 3)}


def prefill_section(run, B: int, rounds: int) -> dict:
    """B ragged prompts prefilled together into rows 0..B-1, eagerly and through the prefill graphs (module doc)."""
    import torch

    from tts_engine.gpu.prefill_graph import GRAPH, PrefillGraphs
    from tts_engine.model.prompt import Prompt
    from tts_engine.model.sampling import SamplingParams

    g = torch.Generator(device="cpu").manual_seed(100 + B)
    D = run.hidden.shape[1]
    lens = [24 + (7 * i) % 48 for i in range(B)]   # 24..71 positions: prompts of a sentence, ragged
    prompts = [Prompt((torch.randn(L, D, generator=g) * 0.5).to(run.device, run.dtype),
                      torch.zeros(0, D, device=run.device, dtype=run.dtype)) for L in lens]
    params = [SamplingParams(do_sample=False, subtalker_dosample=False)] * B
    rows = list(range(B))

    def once():
        for i in range(run.rows):
            run.release(i)
        _sync(run.device)
        t0 = time.perf_counter()
        run.prefill_batch(rows, prompts, params)
        _sync(run.device)
        return (time.perf_counter() - t0) * 1000

    res: dict = {"prompt positions": f"{min(lens)}..{max(lens)}"}
    run.prefill_graphs = None
    res["eager ms"] = _pcts([once() for _ in range(rounds)])
    c0_e, h_e = run.c0[:B].clone(), run.hidden[:B].float().clone()
    pg = run.prefill_graphs = PrefillGraphs(run, capture=run.device.type == "cuda", mode="on",
                                            follow_frame_graphs=False)
    res["graph first call ms (capture + check)"] = round(once(), 1)
    res["graph ms"] = _pcts([once() for _ in range(rounds)])
    res["served by a graph"] = f"{pg.calls[GRAPH]} of {pg.calls[GRAPH] + pg.calls['eager']} stack calls"
    res["buckets"] = pg.entry()["why"]
    c0_g, h_g = run.c0[:B], run.hidden[:B].float()
    res["first ids equal"] = f"{int((c0_e == c0_g).sum())}/{B}"
    res["hidden rel. error"] = float(f"{float((h_g - h_e).norm() / h_e.norm().clamp_min(1e-12)):.2e}")
    res["speed-up p50"] = round(res["eager ms"]["p50"] / max(res["graph ms"]["p50"], 1e-9), 2)
    run.prefill_graphs = None
    for i in range(run.rows):
        run.release(i)
    return res


def codec_section(arch: str, dtype, device, rows_list: list[int], frames: int, rounds: int, frame=None) -> dict:
    """The codec decode per shape as a CUDA graph over a pool of streams: one copy of the state each way against two
    (module doc); with `frame` (queues one frame replay), the codec's own CUDA stream against the frames' stream
    (`gpu.codec_stream`: measured, remembered for the engines this machine starts next)."""
    import torch

    from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
    from tts_engine.codec.state_pool import CodecStatePool
    from tts_engine.gpu import codec_graph
    from tts_engine.tiny import tiny_speech_tokenizer_config

    os.environ[codec_graph.ENV] = "1"   # each shape captured and checked, no timing trial: timed here
    torch.manual_seed(0)
    cfg = CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config("tiny" if arch in ("tiny", "small") else arch)
                                       ["decoder_config"])
    dec = CodecDecoder(cfg).to(device, dtype).eval()
    dec.fast_step = graphs = codec_graph.CodecGraphs(dec, capture=device.type == "cuda")
    out: dict = {"device work": "graph" if device.type == "cuda" else "eager on the static buffers (no CUDA)"}
    g = torch.Generator(device="cpu").manual_seed(7)
    with torch.inference_mode():
        for R in rows_list:
            pool = CodecStatePool(dec.init_state(1), rows=R)
            slots = [pool.alloc().slot for _ in range(R)][::-1]   # (a gather out of order, as streams come and go)
            codes = torch.randint(0, cfg.codebook_size, (R, 16, frames), generator=g).to(device)
            saved = pool.read(slots)

            def one_copy():
                return pool.decode(dec, slots, codes)

            def two_copies():
                st = pool.read(slots)
                wav = dec.decode_step(codes, st)
                pool.write(slots, st)
                return wav

            def eager():
                st = pool.read(slots)
                wav = dec.decode_step_eager(codes, st)
                pool.write(slots, st)
                return wav

            res: dict = {}
            wavs = {}
            for name, fn in (("one copy", one_copy), ("two copies", two_copies), ("eager", eager)):
                pool.write(slots, saved)
                wavs[name] = fn().float()   # (the first call of a shape captures it)
                ms = []
                for _ in range(rounds):
                    pool.write(slots, saved)
                    _sync(device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    ms.append((time.perf_counter() - t0) * 1000)
                res[f"{name} ms"] = _pcts(ms)
            for name in ("two copies", "eager"):
                d = float((wavs["one copy"] - wavs[name]).abs().max())
                res[f"audio max diff vs {name}"] = float(f"{d:.2e}")
            res["one copy saves ms p50"] = round(res["two copies ms"]["p50"] - res["one copy ms"]["p50"], 3)
            out[f"{R} streams x {frames} frames"] = res
        if frame is not None:
            from tts_engine.cpu.measured import describe
            from tts_engine.gpu import codec_stream

            def on_codec_thread():   # (inference mode is per thread)
                with torch.inference_mode():
                    pool.decode(dec, slots, codes).float().cpu()

            cs = codec_stream.CodecStream()
            ms = cs.measure(device, frame, on_codec_thread, frames=4, rounds=max(3, rounds // 4))
            out["codec stream"] = {f"ms, a {R}-stream decode beside 4 frames": ms, "chosen": describe(cs.entry())}
    out["codec graphs"] = graphs.record()["why"]
    return out


def main(argv=None) -> int:
    args = _parse(argv if argv is not None else sys.argv[1:])
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"   # before tts_engine.gpu.kernels is imported
    os.environ.setdefault("TTS_GPU_FRAME", "check")   # the checks and the trial are what this reports
    import torch

    from tts_engine.gpu import backend

    out: dict = {"arch": args.arch, "dtype": args.dtype}
    cuda = torch.cuda.is_available()
    if not cuda and not args.interpret:
        out["gpu frame"] = "eager (no CUDA: the fused frame's Triton kernels run on a GPU; --interpret for a dry run)"
        print(json.dumps(out, indent=1))
        return 0
    dev = torch.device("cuda" if cuda else "cpu")
    out["device"] = torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter)"
    batches = [int(b) for b in args.batches.split(",")]
    prefill = [int(b) for b in args.prefill.split(",") if b]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    run = build_runner(args.arch, dtype, dev, max(batches + prefill), args.max_len)
    with torch.inference_mode():
        status = backend.attach(run, force_interpreter=args.interpret and not cuda)
        out.update(status)
        frame = getattr(run, "gpu_frame", None)
        out["batches"] = {}
        for B in batches if args.frames > 0 else []:   # (--frames 0: the prefill and codec sections only)
            res: dict = {}
            prepare(run, B, args.prompt)
            s = snapshot(run)
            backend.uninstall(run)
            res["eager launches"] = count_launches(run, B)
            codes_e, res["eager ms/frame"] = run_frames(run, B, args.frames)
            restore(run, s)
            if B > 1:
                res["row 0 alone vs in the batch (eager)"] = alone_vs_batch(run, s, B, args.frames, codes_e)
            if frame is not None:
                backend.install(run, frame, interp=args.interpret and not cuda)
                res["fused launches"] = count_launches(run, B)
                codes_f, res["fused ms/frame"] = run_frames(run, B, args.frames)
                restore(run, s)
                res["codes equal"] = f"{int((codes_e == codes_f).sum())}/{codes_e.numel()}"
                res["first difference per row (frame.codebook)"] = " ".join(first_difference(codes_e, codes_f))
                if B > 1:
                    res["row 0 alone vs in the batch (fused)"] = alone_vs_batch(run, s, B, args.frames, codes_f)
                res["speed-up"] = round(res["eager ms/frame"] / res["fused ms/frame"], 2)
            if args.graphs and cuda:
                backend.uninstall(run)
                g_e, res["eager graph ms/frame"] = graph_ms(run, B, args.frames)
                if frame is not None:
                    backend.install(run, frame)
                    g_f, res["fused graph ms/frame"] = graph_ms(run, B, args.frames)
                    res["graph codes equal (first frame)"] = f"{int((g_e == g_f).sum())}/{g_e.numel()}"
                    res["real time (fused graph, 12.5 frames/s)"] = round(1000 / 12.5 / res["fused graph ms/frame"], 1)
            out["batches"][B] = res
        if prefill:
            backend.uninstall(run)   # (the prefill is the stack's own call: the fused frame plays no part)
            out["prefill"] = {}
            for B in prefill:
                out["prefill"][B] = prefill_section(run, B, args.prefill_rounds)
                print(f"prefill {B}: {out['prefill'][B]}", file=sys.stderr, flush=True)
    if args.codec_rows:
        replay = None
        if cuda:   # the frames the codec's own stream would run beside: a CUDA graph of 16 rows
            from tts_engine.engine.cuda_graphs import GraphedFrames

            Bf = min(16, run.rows)
            gf, read_len = GraphedFrames(run), args.prompt + 3 * Bf + 1
            with torch.inference_mode():
                prepare(run, Bf, args.prompt)
                gf.run(Bf, read_len)

            def replay():
                gf.run(Bf, read_len)
        out["codec"] = codec_section(args.arch, dtype, dev, [int(r) for r in args.codec_rows.split(",")],
                                     args.codec_frames, args.codec_rounds, replay)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
