#!/usr/bin/env bash
# The GPU measurements of benchmarks/RESULTS.md in one run, on a machine with an NVIDIA
# GPU (H200 for the published comparison) and this repo installed with JAX's CUDA
# plugin: python -m pip install -e ".[examples]" "jax[cuda12]==<the installed jax>".
#
#   bash benchmarks/run_gpu.sh [OUT]        # OUT defaults to benchmarks/results/gpu
#
# 1. step_time.py: update + apply of every optimizer on the 128.7M MoE tree, float32
#    and bf16, interleaved rounds, ratio to optax.adamw (timed on the device).
# 2. peak_memory.py: on a GPU both configurations run, the published 6.78B included;
#    beside XLA's prediction it reports the allocator's peak_bytes_in_use.
# 3. gpu_compile.py for the same GPU model: the compile-only figures that were recorded
#    without a device, to check them against 1 and 2.
# Every script writes its tables, JSON and plots under OUT and prints its table.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
mkdir -p "$OUT"
python -c 'import jax; d = jax.devices()[0]; print(d.platform, d.device_kind)
assert d.platform == "gpu", "no GPU visible to jax"'
python benchmarks/step_time.py --rounds 25 --out "$OUT"
python benchmarks/step_time.py --rounds 25 --dtype bfloat16 --out "$OUT"
python benchmarks/peak_memory.py --out "$OUT"
python benchmarks/gpu_compile.py --out "$OUT"
