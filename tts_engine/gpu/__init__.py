"""Fused GPU kernels (Triton) for the per-frame step, and the fused frame built from them.

- `kernels`: the Triton kernels (imported only where triton is importable).
- `ops`: one dispatcher per kernel: the Triton kernel on CUDA tensors (or on CPU tensors under Triton's interpreter,
  `TRITON_INTERPRET=1`, when forced), else the eager PyTorch reference built from `model/layers.py` and
  `model/sampling.py`.
- `frame`: `FusedFrame`, the talker step + the 15 code-predictor steps + sampling from these kernels.
- `backend`: `attach(runner)`, which checks the kernels and the fused frame against eager on the runner's own
  shapes and installs the fused frame, or leaves eager serving with one log line. Not yet called by the engine:
  `TTSEngine` would call it right after building its ModelRunner, before `start_graphs`.
- `prefill_graph`: `PrefillGraphs`, the batched prefill's talker call as a CUDA graph per (batch, token, read) bucket
  (`ModelRunner.prefill_graphs`, attached by `backend.attach` on CUDA).
- `codec_graph`, `codec_stream`: the codec decoder's step as CUDA graphs per shape (one copy of a pooled state each
  way), and its decodes on a CUDA stream of their own where measured faster.
- `aot`: `python -m tts_engine.gpu.aot`: every kernel variant of the frame compiled for a GPU target without a GPU.
- `check`: `python -m bench gpu_frame`: the prepared run on a GPU (codes, ms per frame, graphs, launch counts).

The counterpart of the CPU kernels in `tts_engine/model/` (cpu_ext, fused_step, predictor_frame, talker_step).
"""
