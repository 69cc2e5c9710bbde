#!/usr/bin/env bash
# The GPU measurements of benchmarks/RESULTS.md in one run, for a machine with an NVIDIA
# GPU (an H200 for the published comparison) whose Python has jax with its CUDA plugin,
# optax, flax, tqdm and matplotlib (nothing is installed: the repo is put on PYTHONPATH).
#
#   bash benchmarks/run_gpu.sh [DEST]      # DEST defaults to benchmarks/results/gpu
#
# 1. step_time.py: update + apply of every optimizer on the 128.7M MoE tree, float32,
#    and bf16 with float32 AdamW/AdamPM state, interleaved rounds, ratio to optax.adamw.
# 2. peak_memory.py: on a GPU both configurations run, the published 6.78B included;
#    beside XLA's prediction it reports the allocator's peak_bytes_in_use.
# 3. step_time.py on the published model at its own size (6.78B, bf16 weights, float32
#    state), SkewAdam and AdamPM each beside AdamW (FULL_WIDTH=1024 for a smaller one).
# 4. gpu_compile.py for the same GPU model: the compile-only figures recorded without
#    a device, to check them against 1 to 3.
# Each script writes its tables, JSON and plots under DEST and prints its table. Where
# the variable OUT names a folder (a remote runner's output folder), DEST is also packed into
# $OUT/gpu_results.tgz with the log, since only a few files come back from there.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-benchmarks/results/gpu}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ROUNDS=${ROUNDS:-15}
# ALLOW_CPU=1 runs the same steps on the CPU: a dry run of this script's plumbing.
# Each step runs whether or not the one before it failed (a lease can end part-way), in
# order of what is worth most: float32 step time, the 6.78B step's memory, bf16 step
# time, the step time at the published size, then the compile-only plans, which the CPU
# machines can also make.
status=0
step() { "$@" || { echo "FAILED ($?): $*"; status=1; }; }
{
  $PY -c 'import os, jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind)
assert d.platform == "gpu" or os.environ.get("ALLOW_CPU"), "no GPU visible to jax"' || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  step $PY benchmarks/step_time.py --rounds "$ROUNDS" --out "$DEST"
  step $PY benchmarks/peak_memory.py --out "$DEST"
  step $PY benchmarks/step_time.py --rounds "$ROUNDS" --dtype bfloat16 --state-dtype float32 \
      --out "$DEST"
  # The published model at its own size (6.78B, bf16, float32 state): one optimizer
  # beside AdamW per process, since each keeps its own copy of the weights and state.
  for opt in skewadam adampm; do
    step env XLA_PYTHON_CLIENT_MEM_FRACTION="${FULL_MEM_FRACTION:-0.95}" \
      $PY benchmarks/step_time.py --rounds "$ROUNDS" --dtype bfloat16 \
        --state-dtype float32 --width "${FULL_WIDTH:-4096}" --only "$opt" --no-by-tier \
        --out "$DEST/full_$opt"
  done
  $PY benchmarks/gpu_compile.py --out "$DEST" || echo "gpu_compile.py failed (optional)"
  exit "$status"
} 2>&1 | tee "$DEST/run_gpu.log"
status=${PIPESTATUS[0]}
# Pack whatever was written, also after a failure.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar czf "$OUT/gpu_results.tgz" -C "$DEST" .
fi
exit "$status"
