#!/usr/bin/env bash
# Fetch, on a machine with network, every wheel the peer runs need on the GPU machine (which has none), into the
# git-ignored .whl/ folder that the device tool carries (`carry: [".whl"]`):
#   bash bench/gpu_wheels.sh            (from the repository root; PY=python3 by default; WHL=.whl)
# Layout (one folder per install target; bench/gpu_session.sh installs each into its own --target folder):
#   .whl/official  qwen-tts 0.1.1 on transformers 4.57.3 (the official engine)
#   .whl/faster    faster-qwen3-tts 0.5.4 on qwen-tts-hf 0.1.1.post1 and transformers 5.17.0
#   .whl/common    librosa, soundfile & co. (imported by qwen_tts at import time), einops, psutil
#   .whl/triton    qwen3-tts-triton 0.3.0 (one stream on top of .whl/faster; generate_batch on .whl/faster4)
#   .whl/batch     faster-qwen3-tts-batch 0.2.0 (on top of .whl/faster4)
#   .whl/faster4   faster-qwen3-tts 0.3.2, the last on transformers 4.x: the batch engines build their CUDA graphs
#                  with transformers 4.x calls that 5.x removed, so they run on it over .whl/official
#   .whl/anchor_bench.py   copied from ../shared/bench/gpu_anchors/ (../shared does not travel)
# The sets for official/faster/common are those of ../shared/bench/gpu_anchors/README.md. qwen3-tts-triton's other
# Requires-Dist need nothing carried: numpy, triton, accelerate, transformers and scipy (imported by its TurboQuant
# module) are in the GPU image; streamlit, plotly and pynvml are never imported by the wheel's modules (its UI is
# not shipped in it); soundfile comes with .whl/common. The wheels are for CPython 3.12 on x86-64 Linux (the GPU
# image's Python); the total must stay well under the tool's 64 MiB carry limit.
set -euo pipefail
WHL=${WHL:-.whl}
PY=${PY:-python3}
ANCHORS=${ANCHORS:-../shared/bench/gpu_anchors}
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)   # tokenizers and cffi are tagged 2_17/2014 only
D=("$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}")
mkdir -p "$WHL"/{official,faster,common,triton,batch,faster4}
"${D[@]}" -d "$WHL/official" transformers==4.57.3 tokenizers==0.22.2 huggingface_hub==0.36.2 accelerate==1.12.0 \
  qwen-tts==0.1.1 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.2 idna==3.20 certifi==2026.10.18
"${D[@]}" -d "$WHL/faster" faster-qwen3-tts==0.5.4 qwen-tts-hf==0.1.1.post1 \
  transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 accelerate==1.15.0
"${D[@]}" -d "$WHL/common" librosa==0.11.0 soundfile==0.14.0 cffi==2.1.1 soxr==1.1.0 audioread==3.1.0 pooch==1.9.0 \
  joblib==1.6.0 decorator==5.3.1 platformdirs==4.14.7 threadpoolctl==3.8.0 einops==0.8.2 psutil==7.2.2
"${D[@]}" -d "$WHL/triton" qwen3-tts-triton==0.3.0
"${D[@]}" -d "$WHL/batch" faster-qwen3-tts-batch==0.2.0
"${D[@]}" -d "$WHL/faster4" faster-qwen3-tts==0.3.2
if [ -f "$ANCHORS/anchor_bench.py" ]; then
  cp "$ANCHORS/anchor_bench.py" "$WHL/anchor_bench.py"
else
  echo "warning: $ANCHORS/anchor_bench.py not found: the official/faster peers step will be skipped" >&2
fi
# keep the folder out of git in every worktree (.gitignore already names it; the exclude covers older checkouts)
EXCLUDE="$(git rev-parse --git-common-dir 2>/dev/null || echo .git)/info/exclude"
if [ -d "$(dirname "$EXCLUDE")" ] && ! grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null; then echo '/.whl/' >>"$EXCLUDE"; fi
for d in official faster common triton batch faster4; do
  printf '%-9s %3d wheels %6s\n' "$d" "$(ls "$WHL/$d" | wc -l)" "$(du -sh "$WHL/$d" | cut -f1)"
done
total=$(du -sb "$WHL" | cut -f1)
echo "total $WHL: $((total / 1048576)) MiB ($total bytes); carry it with the device tool: carry [\"$WHL\"]"
if [ "$total" -gt $((56 * 1048576)) ]; then
  echo "error: $WHL is over 56 MiB: with the repository it would not fit the 64 MiB carry limit" >&2
  exit 1
fi
