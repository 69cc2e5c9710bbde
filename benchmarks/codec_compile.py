"""Compile cost of coded momentum: what a policy's codes add to XLA's compile.

The leaves of the example MoE model that `MUON_CODED_TIERS` stores as low-bit codes
(those its tiers give a `Blockwise` codec) are taken as abstract arrays, and one jit per
variant holds their momentum update and nothing else:

* `float32`: each leaf's moving average `b1 m + (1 - b1) g` on a float32 momentum;
* `coded`: each leaf's update as its tier runs it (decode, moving average, encode:
  `tier_leaf.coded_momentum`);
* `coded, one leaf per shape`: the same with one leaf of each distinct shape and codec.

Each variant is lowered and compiled in a fresh Python process (no tracing or
compilation cache), the rounds interleaved; the table gives the median compile CPU time
(`time.process_time`, every thread) and what it says: the codes' cost over the float32
average, per distinct coded shape (XLA:CPU compiles kernels per distinct shape: leaves
of one shape share them) and per further leaf of a shape.

  python benchmarks/codec_compile.py --rounds 7

Writes results/codec_compile.{json,md,png} under benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import _common
import compile_time
import skewadam_jax as sj
from skewadam_jax.transforms import tier_leaf

VARIANTS = ('float32', 'coded', 'coded, one leaf per shape')


def coded_leaves(preset: str = 'small') -> list[tuple[tuple[int, ...], Any, float]]:
  """`(shape, codec, b1)` of each leaf of the example model that `MUON_CODED_TIERS`
  codes, in the order of its parameters."""
  params = compile_time.model_parts(preset)[1]
  tiers = sj.MUON_CODED_TIERS
  table = sj.label_table(sj.skewadam(1e-3, tiers=tiers), params)
  out = []
  for row in table.rows:
    tier = tiers[row.tier]
    if not tier.momentum:
      continue
    codec = tier_leaf.leaf_codec(row.shape, tier, row.batch_axes, row.path)
    if codec is not None:
      out.append((tuple(row.shape), codec, 0.9 if tier.b1 is None else tier.b1))
  return out


def compile_sample(variant: str, preset: str = 'small') -> dict[str, float]:
  """Lowers the momentum updates of `variant` (one of `VARIANTS`) and times their
  compile in this process."""
  jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile()  # backend start-up, untimed
  leaves = coded_leaves(preset)
  if variant == VARIANTS[2]:
    seen: dict[Any, Any] = {}
    leaves = [seen.setdefault((shape, codec), (shape, codec, b1))
              for shape, codec, b1 in leaves if (shape, codec) not in seen]
  grads = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape, _, _ in leaves]
  if variant == VARIANTS[0]:
    state = grads

    def update(gs, ms, t):
      del t
      return [b1 * m + (1.0 - b1) * g for (_, _, b1), g, m in zip(leaves, gs, ms)]
  else:
    state = [jax.eval_shape(lambda c=codec, s=shape: c.init(jnp.zeros(s), 'leaf'))
             for shape, codec, _ in leaves]

    def update(gs, stored, t):
      return [tier_leaf.coded_momentum(codec, b1, s, g, t)
              for (_, codec, b1), g, s in zip(leaves, gs, stored)]

  lowered = jax.jit(update).lower(grads, state, jax.ShapeDtypeStruct((), jnp.float32))
  c0 = time.process_time()
  compiled = lowered.compile()
  return {'compile_cpu_s': time.process_time() - c0, 'leaves': len(leaves),
          'shapes': len({(shape, codec) for shape, codec, _ in leaves}),
          'hlo_instructions': compiled.as_text().count('\n  ')}


def _fresh(variant: str, preset: str) -> dict[str, float]:
  out = subprocess.run([sys.executable, __file__, '--one', variant, '--preset', preset],
                       check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument('--rounds', type=int, default=5, help='interleaved rounds')
  ap.add_argument('--preset', default='small', help='example model preset')
  ap.add_argument('--out', default=str(_common.RESULTS / 'codec_compile'),
                  help='output path without suffix')
  ap.add_argument('--one', choices=VARIANTS, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.one:  # a sample, in its own process
    print(json.dumps(compile_sample(args.one, args.preset)))
    return
  runs = compile_time.interleaved(list(VARIANTS), ['codec'], args.rounds, args.preset,
                                  lambda v, _, preset: _fresh(v, preset), 'compiling')['codec']
  med = {v: float(np.median([s['compile_cpu_s'] for s in runs[v]])) for v in VARIANTS}
  iqr = {v: [float(q) for q in np.percentile([s['compile_cpu_s'] for s in runs[v]],
                                             [25, 75])] for v in VARIANTS}
  coded, one = runs[VARIANTS[1]][0], runs[VARIANTS[2]][0]
  cost = med[VARIANTS[1]] - med[VARIANTS[0]]  # the codes, on the same leaves
  further = coded['leaves'] - one['leaves']
  per_leaf = (med[VARIANTS[1]] - med[VARIANTS[2]]) / max(1, further)
  per_shape = (cost - per_leaf * further) / one['shapes']
  rows = [[v, runs[v][0]['leaves'], runs[v][0]['shapes'], runs[v][0]['hlo_instructions'],
           f'{med[v]:.3f} [{iqr[v][0]:.3f}-{iqr[v][1]:.3f}]',
           '-' if v == VARIANTS[0] else f'{med[v] - med[VARIANTS[0]]:+.3f}']
          for v in VARIANTS]
  header = ['variant', 'leaves', 'distinct shapes', 'HLO instructions',
            'compile, CPU (s) [quartiles]', 'over float32 (s)']
  m = _common.machine()
  text = (f'{_common.markdown_table(header, rows)}\n\nThe codes cost {cost:.3f} s of '
          f'compile CPU over the float32 average of the same leaves: {1000 * per_leaf:.1f} '
          'ms per further leaf of a shape (coded against one leaf per shape) and '
          f'{1000 * per_shape:.0f} ms per distinct coded shape (the rest). Median of '
          f'{args.rounds} interleaved rounds, a fresh process per sample; '
          f'{_common.machine_line(m)}\n\n`{_common.command()}`\n')
  print(text)
  out = _common.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  _common.write_json(out.with_suffix('.json'), {
      'command': _common.command(), 'machine': m, 'median_compile_cpu_s': med,
      'quartiles': iqr, 'codes_s': cost, 'per_shape_s': per_shape, 'per_leaf_s': per_leaf,
      'rounds': runs})
  out.with_suffix('.md').write_text(text)
  _plot(med, iqr, runs, out.with_suffix('.png'))


def _plot(med: dict[str, float], iqr: dict[str, list[float]],
          runs: dict[str, list[dict[str, float]]], path: Any) -> None:
  """Each variant's median compile CPU time with the quartiles of its rounds."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4))
  x = np.arange(len(VARIANTS))
  y = np.array([med[v] for v in VARIANTS])
  err = np.array([[med[v] - iqr[v][0], iqr[v][1] - med[v]] for v in VARIANTS]).T
  ax.bar(x, y, color=['tab:gray', 'tab:red', 'tab:orange'], yerr=err, capsize=4)
  for i, v in enumerate(VARIANTS):
    s = runs[v][0]
    ax.text(i, y[i] / 2, f"{y[i]:.2f} s\n{s['leaves']} leaves\n{s['shapes']} shapes",
            ha='center', va='center', color='white', fontsize=9)
  ax.set_xticks(x, VARIANTS)
  ax.set_ylabel('compile, CPU time (s; median, quartiles)')
  ax.set_title("MUON_CODED_TIERS' coded leaves of the example: momentum update only",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == '__main__':
  main()
