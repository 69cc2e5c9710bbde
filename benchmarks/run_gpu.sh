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
# 3. gpu_compile.py for the same GPU model: the compile-only figures recorded without
#    a device, to check them against 1 and 2.
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
{
  $PY -c 'import os, jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind)
assert d.platform == "gpu" or os.environ.get("ALLOW_CPU"), "no GPU visible to jax"' &&
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; } &&
  $PY benchmarks/step_time.py --rounds "$ROUNDS" --out "$DEST" &&
  $PY benchmarks/step_time.py --rounds "$ROUNDS" --dtype bfloat16 --state-dtype float32 \
      --out "$DEST" &&
  $PY benchmarks/peak_memory.py --out "$DEST" &&
  { $PY benchmarks/gpu_compile.py --out "$DEST" || echo "gpu_compile.py failed (optional)"; }
} 2>&1 | tee "$DEST/run_gpu.log"
status=${PIPESTATUS[0]}
# Pack whatever was written, also after a failure.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar czf "$OUT/gpu_results.tgz" -C "$DEST" .
fi
exit "$status"
