"""What XLA:GPU makes of our steps on an H200, from a compile-only (deviceless) target.

No GPU is needed: JAX's CUDA plugin can compile for a GPU described by a target config
(`gpu_specs/h200.txtpb`) without a device or driver. The compiled executable cannot
run, but its buffer assignment and its optimised HLO are exactly what XLA:GPU would
execute on that GPU, so two of the step's figures can be read off it:

* **Peak memory of a whole training step** (`peak_memory.py`'s step: forward, backward,
  optimizer, params and state donated; bf16 weights, micro-batch 8 x 128) for the
  published 6.78B configuration and its w8 scale-down: `argument + output + temp -
  alias` from `memory_analysis()`. This is XLA's own plan, not a measurement on a device:
  a real run adds the CUDA context, the allocator's fragmentation and library
  workspaces that XLA does not assign.
* **The optimizer step's memory traffic** (`step_time.py`'s update + apply, donated, on
  its 128.7M-parameter MoE tree in float32 and in bf16, and on the published 6.78B
  model with its bf16 weights; AdamW's and AdamPM's state float32 as published, with
  `step_time.py --state-dtype float32`): the bytes every kernel of the optimised
  module reads and writes, per parameter (`_common.hlo_kernel_bytes`; on the CPU it
  agrees with XLA's `cost_analysis()`, which a compile-only GPU executable does not
  provide), the number of kernels and XLA's temp. A memory-bound step's time follows
  its bytes only if every kernel streams at the same bandwidth, so the ratio to AdamW's
  bytes is what the step would take at equal bandwidth, not a timing.

Setup (once; a separate environment keeps the CPU one free of CUDA wheels):

  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  python -m pip install -e ".[examples]" && python -m pip install "jax[cuda12]==$(
      python -c 'import jax; print(jax.__version__)')"       # the plugin of that jax
  python benchmarks/gpu_compile.py          # H200, both parts: ~3 min on 2 cores

Writes results/gpu_compile_<target>.{json,md,png} under benchmarks/.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# Before jax loads the CUDA plugin: there is no driver whose versions it could check.
os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')

import _common  # noqa: E402
from _common import GIB, RESULTS  # noqa: E402

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import peak_memory  # noqa: E402
import step_time  # noqa: E402
from examples import _cli  # noqa: E402
from examples.moe_lm.model import abstract_params, get_config  # noqa: E402

TARGETS = sorted(p.stem for p in _common.GPU_SPECS.glob('*.txtpb'))
STEP_NAMES = ('copy', 'adamw', 'adafactor', 'skewadam', 'adampm')


def peak_rows(device: Any, configs: list[str], optimizers: list[str]) -> list[dict[str, Any]]:
  """Compiles each training step for `device`; XLA's memory figures per step."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  rows = []
  for config in configs:
    for opt in tqdm(optimizers, desc=f'training step, {config}', leave=False):
      rows.append(peak_memory.compile_step(config, opt, sharding)[1])
  return rows


def _compile_update(name: str, params: Any, sharding: Any, tier: str | None = None) -> Any:
  put = lambda t: jax.tree.map(  # noqa: E731
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), t)
  if name == 'copy':  # the same streaming reference as step_time.py
    fn = jax.jit(lambda p: jax.tree.map(jax.numpy.negative, p), donate_argnums=0)
    return fn.lower(put(params)).compile()
  tx = step_time.optimizer(name, tier)

  def step(p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  # AdamW's and AdamPM's state in float32 whatever the parameters' dtype, as
  # `step_time.py --state-dtype float32` (the published AdamW keeps float32 m and v).
  state = jax.eval_shape(step_time.init_fn(name, tx, f32_state=True), params)
  return jax.jit(step, donate_argnums=(0, 2)).lower(
      put(params), put(params), put(state)).compile()


def update_rows(device: Any, names: list[str], tree_name: str, dtype: str
                ) -> list[dict[str, Any]]:
  """Compiles the optimizer update + apply on one parameter tree (and per tier).

  `tree_name` 'w8' is step_time.py's 128.7M tree in `dtype`; 'paper-6.78b' is the
  published model as peak_memory.py builds it (bf16 weights, float32 norms and router).
  """
  sharding = jax.sharding.SingleDeviceSharding(device)
  cfg = (get_config('paper-6.78b') if tree_name == 'paper-6.78b'
         else step_time.moe_config(dtype))
  tree = nnx.to_pure_dict(abstract_params(cfg))
  trees = {'all': tree, 'experts': step_time.subtree(tree, 'experts'),
           'backbone': step_time.subtree(tree, 'backbone')}
  jobs = [('all', n) for n in names]
  jobs += [(leaves, n) for leaves in ('experts', 'backbone') for n in ('adamw', 'skewadam')
           if n in names]
  rows = []
  for leaves, name in tqdm(jobs, desc='optimizer update', leave=False):
    params = trees[leaves]
    compiled = _compile_update(name, params, sharding,
                               None if leaves == 'all' else leaves)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kernel_bytes, kernels = _common.hlo_kernel_bytes(compiled.as_text())
    temp = compiled.memory_analysis().temp_size_in_bytes
    rows.append({'tree': tree_name, 'dtype': dtype, 'leaves': leaves, 'step': name,
                 'params': n_params,
                 'kernel_bytes': kernel_bytes, 'bytes_per_param': kernel_bytes / n_params,
                 'kernels': kernels, 'temp_bytes': temp,
                 'temp_fraction_of_params': temp / param_bytes})
  for row in rows:
    base = [r for r in rows if r['leaves'] == row['leaves'] and r['step'] == 'adamw']
    if base:
      row['bytes_vs_adamw'] = row['kernel_bytes'] / base[0]['kernel_bytes']
  return rows


def markdown(target: str, peak: list[dict[str, Any]], update: list[dict[str, Any]]) -> str:
  parts = []
  for config in dict.fromkeys(r['config'] for r in peak):
    mine = [r for r in peak if r['config'] == config]
    parts += [f"### Peak memory of one training step, {config} ({mine[0]['params']:,} "
              f"parameters, bf16 weights, micro-batch {peak_memory.BATCH} x "
              f"{peak_memory.SEQ}), XLA:GPU for {target}", '']
    header = ['optimizer', 'state', 'argument', 'output', 'alias', 'temp',
              'predicted peak (arg+out+temp-alias)', 'weights+grads+state']
    published = config == 'paper-6.78b'
    if published:
      header.append('published peak (H200)')
    table = []
    for r in mine:
      row = [peak_memory.LABELS[r['optimizer']]] + [
          peak_memory.gib(r[k]) for k in ('state_bytes', 'argument_bytes', 'output_bytes',
                                         'alias_bytes', 'temp_bytes', 'predicted_bytes',
                                         'floor_bytes')]
      if published:
        pub = peak_memory.PUBLISHED_PEAK_GIB.get(r['optimizer'])
        row.append(f'{pub}' if pub else '-')
      table.append(row)
    parts += [_common.markdown_table(header, table), '',
              'GiB (2^30 B). Compile times: ' +
              ', '.join(f"{r['optimizer']} {r['compile_s']:.0f} s" for r in mine) + '.', '']
  for tree, dtype in dict.fromkeys((r['tree'], r['dtype']) for r in update):
    mine = [r for r in update if (r['tree'], r['dtype']) == (tree, dtype)]
    parts += [f"### Optimizer update + apply, {tree} ({mine[0]['params']:,} parameters), "
              f'{dtype} params and gradients, float32 AdamW/AdamPM state, donated; '
              f'XLA:GPU for {target}',
              '']
    header = ['leaves', 'step', 'kernel bytes / param', 'x adamw bytes', 'kernels',
              'XLA temp', 'temp % of params']
    table = [[r['leaves'], step_time.LABELS.get(r['step'], r['step']),
              f"{r['bytes_per_param']:.1f}",
              f"{r['bytes_vs_adamw']:.2f}" if 'bytes_vs_adamw' in r else '-',
              r['kernels'], f"{r['temp_bytes'] / 2**20:.2f} MiB",
              f"{100 * r['temp_fraction_of_params']:.3f}%"] for r in mine]
    parts += [_common.markdown_table(header, table, align='ll' + 'r' * 5), '']
  return '\n'.join(parts)


def plot(target: str, peak: list[dict[str, Any]], update: list[dict[str, Any]],
         path: Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
  mine = [r for r in peak if r['config'] == 'paper-6.78b']
  if mine:
    x = np.arange(len(mine))
    w = 0.27
    ax0.bar(x, [r['predicted_bytes'] / GIB for r in mine], w,
            label=f'XLA:GPU plan ({target}, compile only)')
    ax0.bar(x + w, [r['floor_bytes'] / GIB for r in mine], w,
            label='weights + grads + state')
    ax0.bar(x + 2 * w, [peak_memory.PUBLISHED_PEAK_GIB.get(r['optimizer'], 0) for r in mine],
            w, label='published (H200)')
    ax0.set_xticks(x + w, [r['optimizer'] for r in mine])
    ax0.set_ylabel('GiB')
    ax0.set_title('paper-6.78b: peak memory of one training step', fontsize=9)
    ax0.legend(fontsize=7)
  groups = list(dict.fromkeys((r['tree'], r['dtype']) for r in update))
  for j, (tree, dtype) in enumerate(groups):
    rows = [r for r in update if r['leaves'] == 'all' and (r['tree'], r['dtype']) == (tree, dtype)]
    x = np.arange(len(rows))
    w = 0.8 / len(groups)
    ax1.bar(x + j * w, [r.get('bytes_vs_adamw', 0) for r in rows], w, label=f'{tree}, {dtype}')
    ax1.set_xticks(x + 0.4 - w / 2, [r['step'] for r in rows])
  if update:
    ax1.axhline(1.0, color='gray', lw=0.8)
    ax1.set_ylim(0, 1.5)
    ax1.legend(fontsize=7)
    ax1.set_ylabel("kernel bytes / optax.adamw's")
    ax1.set_title(f'optimizer update + apply: memory traffic (XLA:GPU plan, {target})',
                  fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  """The command line."""
  ap = _cli.parser(__doc__.split('\n\n')[0])
  _cli.option(ap, '--target', default='h200', choices=TARGETS,
              help='GPU whose spec (gpu_specs/<target>.txtpb) XLA compiles for')
  _cli.option(ap, '--configs', nargs='*', default=list(peak_memory.CONFIGS),
              choices=list(peak_memory.CONFIGS), help='models of the peak-memory rows')
  _cli.option(ap, '--optimizers', nargs='*', default=list(peak_memory.OPTIMIZERS),
              choices=peak_memory.OPTIMIZERS, help='optimizers of the peak-memory rows')
  _cli.option(ap, '--steps', nargs='*', default=list(STEP_NAMES), choices=STEP_NAMES,
              help='optimizer steps whose update traffic is compiled')
  _cli.option(ap, '--dtypes', nargs='*', default=['float32', 'bfloat16'],
              choices=['float32', 'bfloat16'],
              help="parameter and gradient dtypes of the update's tree")
  _cli.option(ap, '--out', default=str(RESULTS), help='directory for the JSON, markdown, PNG')
  return ap


def main() -> None:
  args = build_parser().parse_args()

  device = _common.compile_only_device(args.target)
  peak = peak_rows(device, args.configs, args.optimizers)
  update = [row for dtype in args.dtypes
            for row in update_rows(device, args.steps, 'w8', dtype)]
  if 'paper-6.78b' in args.configs:
    update += update_rows(device, args.steps, 'paper-6.78b',
                          'bfloat16 (norms and router float32)')
  payload = {'command': _common.command(), 'machine': _common.machine(),
             'target': args.target, 'device': str(device),
             'target_config': (_common.GPU_SPECS / f'{args.target}.txtpb').read_text(),
             'peak': peak, 'update': update}
  out = Path(args.out)
  stem = f'gpu_compile_{args.target}'
  _common.write_json(out / f'{stem}.json', payload)
  md = '\n'.join([f'## XLA:GPU compile-only figures for {args.target} (no device)', '',
                  f"`{payload['command']}`", '', _common.machine_line(payload['machine'])
                  + f"; compiled for {device.device_kind} (`gpu_specs/{args.target}.txtpb`)",
                  '', markdown(args.target, peak, update)])
  (out / f'{stem}.md').write_text(md)
  plot(args.target, peak, update, out / f'{stem}.png')
  print(md)


if __name__ == '__main__':
  main()
