#!/usr/bin/env bash
# The GPU figures of one lent device session, in one call (issues 27 and 28): run from the repository root on the
# device machine, e.g. through the device tool:
#   bash bench/gpu_session.sh            (about 8-9 minutes on an H100 / H200; results under $OUT, default ./gpu-out)
#   DRY=1 bash bench/gpu_session.sh      (here, on a CPU: the tiny architecture through Triton's interpreter, every
#                                         step once, to check the script before device time is spent on it)
# Each step is time-boxed and the script goes on when one fails, so one broken step never costs the others' figures.
# Peers (faster-qwen3-tts, the official qwen-tts) run only where their wheels and ../shared/bench/gpu_anchors/
# anchor_bench.py were carried in .whl/ (that README says which wheels; ../shared does not travel); skipped otherwise.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
PY=${PY:-python3}
log="$OUT/session.log"
step() {   # step NAME SECONDS COMMAND...: one time-boxed step, its output in $OUT/NAME.txt and the log
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date -u +%T), at most ${secs}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.txt" | tee -a "$log"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$log"
}

if [ "${DRY:-0}" = 1 ]; then
  ARCH=tiny; BIG=tiny; FRAMES=8; GF_FRAMES=2; BATCHES=1,4; CONC=1,4; INTERP=--interpret; DEV=(--device cpu)
else
  ARCH=0.6b; BIG=1.7b; FRAMES=250; GF_FRAMES=32; BATCHES=1,4,64; CONC=1,4,16,64,128; INTERP=; DEV=()
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$log"
fi
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" \
  | tee -a "$log"

# 1. the fused frame against the eager frame: codes, ms per frame eager / fused / both as CUDA graphs, launches
step gpu_frame 150 $PY -m bench gpu_frame --arch "$ARCH" --batches "$BATCHES" --frames "$GF_FRAMES" --graphs $INTERP \
  --json "$OUT/gpu_frame.json"
# 2. the kernel census: the CPU count of the GPU's frame beside the CUDA kernels of one captured replay
step census 90 $PY -m bench census --arch "$ARCH" --batches "$BATCHES" --path both --gpu --json "$OUT/census.json"
# 3. the engine's own check: CUDA graphs against eager buckets, greedy codes at batch 1 and 4
[ "${DRY:-0}" = 1 ] || step check 120 $PY -m bench check --arch "$ARCH"
# 4. one stream, 0.6B and 1.7B: x real time, first audio, ms per frame (the engine as the app runs it)
step speed_one 120 $PY -m bench speed --arch "$ARCH" --concurrency 1 --frames "$FRAMES" --no-official "${DEV[@]}" \
  --out "$OUT/speed.md"
[ "${DRY:-0}" = 1 ] || step speed_one_big 120 $PY -m bench speed --arch "$BIG" --concurrency 1 --frames "$FRAMES" \
  --no-official --out "$OUT/speed.md"
# 5. many streams (issue 28): audio-s/s, per-stream x real time, first audio p50/p99
step speed_many 150 $PY -m bench speed --arch "$ARCH" --concurrency "$CONC" --frames "$FRAMES" --no-official \
  "${DEV[@]}" --out "$OUT/speed.md"
# 6. peers on the same GPU, where their wheels travelled with the tree
if [ -d .whl/faster ] && [ -d .whl/official ] && [ -f .whl/anchor_bench.py ]; then
  P="$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target"
  $P /tmp/site-official .whl/official/*.whl .whl/common/*.whl && $P /tmp/site-faster .whl/faster/*.whl .whl/common/*.whl
  step peers 240 $PY .whl/anchor_bench.py --site-official /tmp/site-official \
    --site-faster /tmp/site-faster --frames 128 --budget-s 200 --out "$OUT/anchor.json"
else
  echo "=== peers: skipped (no .whl/faster, .whl/official and .whl/anchor_bench.py carried)" | tee -a "$log"
fi
echo "=== done $(date -u +%T)" | tee -a "$log"
