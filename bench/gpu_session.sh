#!/usr/bin/env bash
# The GPU figures of one lent device session, in one call (issues 27 and 28): run from the repository root on the
# device machine, e.g. through the device tool:
#   BUDGET_S=420 bash bench/gpu_session.sh   (results under $OUT, default ./gpu-out; BUDGET_S: seconds for all steps)
#   DRY=1 bash bench/gpu_session.sh          (here, on a CPU: the tiny architecture through Triton's interpreter, every
#                                             step once, to check the script before device time is spent on it)
# Steps run in order of importance, each time-boxed (and boxed by what is left of BUDGET_S); the script goes on when
# one fails, so one broken step never costs the others' figures. Every step's output lands in $OUT/results/ and the
# folder is packed into $OUT/results.tar.gz after each step (the device tool brings back at most 8 files).
# Peers (faster-qwen3-tts, the official qwen-tts) run only where their wheels and ../shared/bench/gpu_anchors/
# anchor_bench.py were carried in .whl/ (that README says which wheels; ../shared does not travel); skipped otherwise.
set -u
OUT=${OUT:-gpu-out}
RES="$OUT/results"
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-0}     # 0: no overall limit
STEPS=${STEPS:-all}         # a comma list of step names to run (default: all)
log="$OUT/session.log"
step() {   # step NAME SECONDS COMMAND...: one time-boxed step, its output in $RES/NAME.txt and the log
  local name=$1 secs=$2; shift 2
  if [ "$STEPS" != all ] && [[ ",$STEPS," != *",$name,"* ]]; then return; fi
  if [ "$BUDGET_S" -gt 0 ]; then
    local left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt 25 ]; then echo "=== $name: skipped (${left}s of the budget left)" | tee -a "$log"; return; fi
    [ "$secs" -gt "$left" ] && secs=$left
  fi
  echo "=== $name ($(date -u +%T), at most ${secs}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$RES/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$RES/$name.txt" | tee -a "$log"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$log"
  tar czf "$OUT/results.tar.gz" -C "$OUT" results
}

if [ "${DRY:-0}" = 1 ]; then
  ARCH=tiny; BIG=tiny; FRAMES=8; GF_FRAMES=2; BATCHES=1,4; CONC=1,4; INTERP=--interpret; DEV=(--device cpu)
  ZG_FRAMES=8; ZG_EAGER=4; CHECK_FRAMES=8; PREFILL=2,4; CODEC_ROWS=1,4; BURST=4; BURST_FRAMES=8
  SERVING_ROUNDS=(--prefill-rounds 3 --codec-rounds 4)
else
  ARCH=0.6b; BIG=1.7b; FRAMES=250; GF_FRAMES=32; BATCHES=1,4,64; CONC=1,4,16,64,128; INTERP=; DEV=()
  ZG_FRAMES=100; ZG_EAGER=16; CHECK_FRAMES=64; PREFILL=16,64; CODEC_ROWS=1,16,64; BURST=16,64; BURST_FRAMES=50
  SERVING_ROUNDS=()
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$log"
fi
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" \
  | tee -a "$log"

# In order of importance (a step the budget cannot reach is skipped, the ones before it have their figures).
# 1. the fused frame against the eager frame: codes, ms per frame eager / fused / both as CUDA graphs, launches
step gpu_frame 120 $PY -m bench gpu_frame --arch "$ARCH" --batches "$BATCHES" --frames "$GF_FRAMES" --graphs $INTERP \
  --json "$RES/gpu_frame.json"
# 1b. serving (issue 28): batched prefill eager against its CUDA graphs per bucket (ms p50/p99, same first ids) at
#     16 and 64 prompts at once; the codec graph over a pool of streams, one copy of the state each way against two
step gpu_serving 100 env TTS_GPU_FRAME=0 $PY -m bench gpu_frame --arch "$ARCH" --batches 1 --frames 0 \
  --prefill "$PREFILL" --codec-rows "$CODEC_ROWS" "${SERVING_ROUNDS[@]}" $INTERP --json "$RES/gpu_serving.json"
# 2. the kernel census: the CPU count of the GPU's frame beside the CUDA kernels of one captured replay
step census 60 $PY -m bench census --arch "$ARCH" --batches "$BATCHES" --path both --gpu --json "$RES/census.json"
# 3. one stream, 0.6B: x real time, first audio, ms per frame (the engine as the app runs it), quality vs fp32
step speed_one 90 $PY -m bench speed --arch "$ARCH" --concurrency 1 --frames "$FRAMES" --no-official "${DEV[@]}" \
  --out "$RES/speed.md"
# 4. ZeroGPU mode: one click as a GPU worker serves it (eager, first click with warm_gpu, second click)
step zerogpu 90 $PY -m bench zerogpu --arch "$ARCH" --frames "$ZG_FRAMES" --eager-frames "$ZG_EAGER" "${DEV[@]}" \
  --json "$RES/zerogpu.json"
# 5. many streams (issue 28): audio-s/s, per-stream x real time, first audio p50/p99
step speed_many 150 $PY -m bench speed --arch "$ARCH" --concurrency "$CONC" --frames "$FRAMES" --no-official \
  --quality-frames 0 "${DEV[@]}" --out "$RES/speed.md"
# 5b. bursts (issue 28): first audio p50/p99 with 16 and 64 arriving at once, prefill through its CUDA graphs (the
#     default) and eager (TTS_PREFILL_GRAPHS=0); each burst twice: the first captures and measures a bucket's graph
#     on first use, the second is what a warm server serves
step speed_burst 90 $PY -m bench speed --arch "$ARCH" --concurrency "$BURST,$BURST" --frames "$BURST_FRAMES" \
  --no-official --quality-frames 0 "${DEV[@]}" --out "$RES/speed.md"
step speed_burst_eager_prefill 90 env TTS_PREFILL_GRAPHS=0 $PY -m bench speed --arch "$ARCH" \
  --concurrency "$BURST,$BURST" --frames "$BURST_FRAMES" --no-official --quality-frames 0 "${DEV[@]}" \
  --out "$RES/speed.md"
# 6. the engine's own check: CUDA graphs against eager buckets, greedy codes at batch 1 and 4 (prefill graphs too)
step check 90 $PY -m bench check --arch "$ARCH" --frames "$CHECK_FRAMES" "${DEV[@]}"
# 7. one stream, 1.7B
step speed_one_big 90 $PY -m bench speed --arch "$BIG" --concurrency 1 --frames "$FRAMES" --no-official \
  --quality-frames 0 "${DEV[@]}" --out "$RES/speed.md"
# 8. every Triton kernel against its eager reference on the GPU (CI runs them through the interpreter)
[ "${DRY:-0}" = 1 ] || TTS_GPU_TEST_DEVICE=cuda step kernels 90 $PY -m pytest -q -p no:cacheprovider \
  tests/test_gpu_kernels.py
# 9. peers on the same GPU, where their wheels travelled with the tree
wanted() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }
if [ "${DRY:-0}" = 1 ]; then
  echo "=== peers: skipped in a dry run (anchor_bench.py needs CUDA; peers_gpu below has a dry run)" | tee -a "$log"
elif ! wanted peers; then
  :
elif [ -d .whl/faster ] && [ -d .whl/official ] && [ -f .whl/anchor_bench.py ]; then
  P="$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target"
  $P /tmp/site-official .whl/official/*.whl .whl/common/*.whl && $P /tmp/site-faster .whl/faster/*.whl .whl/common/*.whl
  step peers 240 $PY .whl/anchor_bench.py --site-official /tmp/site-official \
    --site-faster /tmp/site-faster --frames 128 --budget-s 200 --out "$RES/anchor.json"
else
  echo "=== peers: skipped (no .whl/faster, .whl/official and .whl/anchor_bench.py carried)" | tee -a "$log"
fi
# 10. qwen3-tts-triton (one stream, generate_batch) and faster-qwen3-tts-batch at 1-64 streams, same random weights
#     (bench/peers_gpu.py installs .whl/ itself; bench/gpu_wheels.sh fills it; skipped where it did not travel)
if [ -d .whl/triton ] && [ -d .whl/batch ] && [ -d .whl/faster4 ] && [ -f .whl/anchor_bench.py ]; then
  PG_S=210   # the driver's own budget: it ends its workers itself, inside the step's time box
  if [ "$BUDGET_S" -gt 0 ] && [ $((BUDGET_S - SECONDS - 40)) -lt "$PG_S" ]; then PG_S=$((BUDGET_S - SECONDS - 40)); fi
  if [ "${DRY:-0}" = 1 ]; then PG=(--dry-run --engines batch); else PG=(--models 0.6B --batches 1,4,16,64 --frames 128); fi
  step peers_gpu 260 $PY -m bench peers_gpu "${PG[@]}" --budget-s "$PG_S" --out "$RES/peers_gpu.json"
else
  echo "=== peers_gpu: skipped (no .whl/triton, .whl/batch, .whl/faster4 and .whl/anchor_bench.py carried)" | tee -a "$log"
fi
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv,noheader 2>/dev/null | tee -a "$log"
echo "=== done $(date -u +%T) after $SECONDS s" | tee -a "$log"
cp "$log" "$RES/" && tar czf "$OUT/results.tar.gz" -C "$OUT" results
