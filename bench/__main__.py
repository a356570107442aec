"""`python -m bench`: the index of the benchmarks, one line each; `python -m bench NAME [ARGS...]` runs one
(`python -m bench NAME -h`: its options). Every benchmark prints the device and the load average beside its figures;
none is asserted by a test (tests check that they run and what their tables contain, not how fast)."""
from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures); the module's `main(argv)` runs it
BENCHMARKS = {
    "speed": ("bench.speed", "the streaming benchmark: first audio, x real time, audio s per s per concurrency, the "
              "frame's parts, memory"),
    "peers": ("bench.peers.run", "our engine and the independent CPU engines side by side in one interleaved run "
              "(also `speed --peers`)"),
    "check": ("bench.check", "does the fast path work here? CUDA graphs (CPU: the bucketed step) against eager, "
              "same codes"),
    "host": ("bench.host", "the engine's host work per frame (scheduler, bookkeeping, chunks, codec hand-off, "
             "emission) with a stand-in model and codec, at each batch size"),
    "census": ("bench.census", "kernel launches per frame of the GPU's path (counted on a CPU, or a CUDA replay "
               "profiled)"),
    "gpu_frame": ("bench.gpu_frame", "the fused GPU frame against the eager frame: codes, ms per frame with and "
                  "without CUDA graphs, launches (--interpret: a dry run on a CPU)"),
    "peers_gpu": ("bench.peers_gpu", "qwen3-tts-triton (one stream, generate_batch) and faster-qwen3-tts-batch at "
                  "1-64 streams on our random weights, on a GPU (wheels carried in .whl/; --dry-run on a CPU)"),
    "zerogpu": ("bench.zerogpu", "one click in ZeroGPU mode as a GPU worker serves it: eager, the worker's first "
                "click (warm_gpu), a second click; first audio after the grant, x real time"),
    "step": ("bench.step", "the per-frame step of two checkouts' model runners, interleaved (A/B)"),
    "talker_step": ("bench.talker_step", "the talker's step at one row: C++ step vs Python path, split into parts, "
                    "against the plain read"),
    "predictor_frame": ("bench.predictor_frame", "the code predictor's frame in one call: the C++ call, its stages, "
                        "the runner's call"),
    "engine_step": ("bench.engine_step", "the talker step inside the engine (served, codec thread, governor) vs "
                    "the same step alone"),
    "fused_profile": ("bench.fused_profile", "the fused decode step's stages and its matmuls alone, per team mode"),
    "matmuls": ("bench.matmuls", "one frame's matmuls per mode; the kernels alone in GB/s, per CPU level, per share "
                "mode"),
    "codec": ("bench.codec", "the codec decoder's ms per frame per dtype and conv path; codec overlap A/B"),
    "codec_quality": ("bench.codec_quality", "each lossy codec decoder mode against fp32 on the same codes (SNR, "
                      "log-spectral distance)"),
    "chunk_align": ("bench.chunk_align", "the codec's work for concurrent streams with chunks cut on shared frames "
                    "or on their own schedules"),
    "prefill": ("bench.prefill", "first audio with the prompt-prefix cache hit, missed, and off"),
    "breakdown": ("bench.breakdown", "where a stream's wall time goes in the worker; the first audio part by part"),
    "stream_split": ("bench.stream_split", "a stream's wall time per frame split into parts as the engine's threads "
                     "serve it"),
    "threads": ("bench.threads", "the OpenMP stall: small ops at 1 and N threads; frames under the thread "
                "governor's options"),
    "trials": ("bench.trials", "the load-time trials alone (kernel table, codec int8 threshold), two checkouts "
               "interleaved"),
    "startup": ("bench.startup", "cold start of the app on an empty cache: page served, first audio, every "
                "load-time trial"),
    "ab": ("bench.ab", "engine A/B of two checkouts (and variants of B), streaming, interleaved"),
    "continuity": ("bench.continuity", "N clients playing the server's PCM streams in real time: first audio, "
                   "underruns"),
    "clone": ("bench.clone", "first audio of a repeated clone request with and without the reference cache (HTTP "
              "API)"),
    "time_stretch": ("bench.time_stretch", "the speech-speed time stretch on the preset clips: length, pitch change, "
                     "time"),
    "longform": ("bench.longform", "a long-form job (a book of --minutes) through /audiobook on the CPU: wall time, "
                 "peak memory, disk use"),
    "text_prep": ("bench.text_prep", "what the model reads: a 10,000-entry pronunciation dictionary and the numbers read "
                  "out, applied to 2,000 characters (ms)"),
    "plain_read": ("bench.plain_read", "the plain large memory read (the floor every CPU figure is compared with) "
                   "over time"),
}


def index() -> str:
    width = max(map(len, BENCHMARKS))
    return "\n".join(["python -m bench NAME [ARGS...]   (NAME -h: its options)", ""]
                     + [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items()])


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "list"):
        print(index())
        return 0
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{index()}", file=sys.stderr)
        return 2
    rc = importlib.import_module(BENCHMARKS[name][0]).main(rest)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
