#!/usr/bin/env bash
# The GPU measurements of benchmarks/RESULTS.md in one run, for a machine with an NVIDIA
# GPU (an H200 for the published comparison) whose Python has jax with its CUDA plugin,
# optax, flax, tqdm and matplotlib (nothing is installed: the repo is put on PYTHONPATH).
#
#   bash benchmarks/run_gpu.sh [DEST]      # DEST defaults to benchmarks/results/gpu
#
# First what is worth most, in this order (a lease can end part-way):
# 1. step_time.py on the 128.7M MoE tree, float32 then bf16 with float32 AdamW state:
#    MUON_CODED_TIERS as shipped (its Newton-Schulz 'auto': bfloat16 on a GPU), the same
#    with the float32 iteration named (the iteration before), and optax.contrib.muon,
#    each beside optax.adamw (-> DEST/muon).
# 2. peak_memory.py: the published 6.78B training step's peak under MUON_CODED_TIERS
#    (-> DEST/peak_muon_coded).
# 3. step_time.py on the published model at its own size (6.78B, bf16 weights, float32
#    state): every policy, one per process beside AdamW (FULL_WIDTH=1024 for a smaller
#    one; -> DEST/full_<optimizer>).
# Then the full tables:
# 4. step_time.py: update + apply of every optimizer on the 128.7M MoE tree, float32,
#    and bf16 with float32 AdamW/AdamPM state, interleaved rounds, ratio to optax.adamw.
# 5. peak_memory.py: on a GPU both configurations run, the published 6.78B included;
#    beside XLA's prediction it reports the allocator's peak_bytes_in_use.
# 6. gpu_compile.py for the same GPU model: the compile-only figures recorded without
#    a device, to check them against 1 to 5.
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
# Each step runs whether or not the one before it failed, in the order above; the
# compile-only plans come last, since the CPU machines can also make them.
MUON=(skewadam-muon-coded skewadam-muon-coded-ns-float32 muon)
# Every policy of step_time.py at 6.78B, the Muon ones first.
FULL=(skewadam-muon-coded skewadam-muon-coded-ns-float32 muon skewadam-muon
      skewadam-muon-expert-momentum skewadam adampm adafactor)
status=0
step() { "$@" || { echo "FAILED ($?): $*"; status=1; }; }
{
  $PY -c 'import os, jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind)
assert d.platform == "gpu" or os.environ.get("ALLOW_CPU"), "no GPU visible to jax"' || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  step $PY benchmarks/step_time.py --rounds "$ROUNDS" --only "${MUON[@]}" --no-by-tier \
      --out "$DEST/muon"
  step $PY benchmarks/step_time.py --rounds "$ROUNDS" --dtype bfloat16 --state-dtype float32 \
      --only "${MUON[@]}" --no-by-tier --out "$DEST/muon"
  step $PY benchmarks/peak_memory.py --configs paper-6.78b --optimizers skewadam-muon-coded \
      --out "$DEST/peak_muon_coded"
  # The published model at its own size (6.78B, bf16, float32 state): one optimizer
  # beside AdamW per process, since each keeps its own copy of the weights and state.
  for opt in "${FULL[@]}"; do
    step env XLA_PYTHON_CLIENT_MEM_FRACTION="${FULL_MEM_FRACTION:-0.95}" \
      $PY benchmarks/step_time.py --rounds "$ROUNDS" --dtype bfloat16 \
        --state-dtype float32 --width "${FULL_WIDTH:-4096}" --only "$opt" --no-by-tier \
        --out "$DEST/full_$opt"
  done
  step $PY benchmarks/step_time.py --rounds "$ROUNDS" --out "$DEST"
  step $PY benchmarks/peak_memory.py --out "$DEST"
  step $PY benchmarks/step_time.py --rounds "$ROUNDS" --dtype bfloat16 --state-dtype float32 \
      --out "$DEST"
  $PY benchmarks/gpu_compile.py --out "$DEST" || echo "gpu_compile.py failed (optional)"
  exit "$status"
} 2>&1 | tee "$DEST/run_gpu.log"
status=${PIPESTATUS[0]}
# Pack whatever was written, also after a failure.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar czf "$OUT/gpu_results.tgz" -C "$DEST" .
fi
exit "$status"
