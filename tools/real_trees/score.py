"""Score the default labeler against the recorded real trees; print a markdown table.

For every `tests/data/real_trees/*.json`: the number of leaves, how many get a tier
other than the hand-judged one, whether the labeler warned, and the optimizer-state
bytes of SkewAdam and AdamW from `memory_report` on the tree cast to float32 (so both
hold float32 state). Runs on abstract shapes only (seconds, no accelerator):

    python tools/real_trees/score.py            # the table
    python tools/real_trees/score.py --wrong    # also list every wrongly labelled leaf
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import warnings
from typing import Any

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import skewadam_jax as sj  # noqa: E402
from skewadam_jax import _tree  # noqa: E402

DATA = os.path.join(REPO, 'tests', 'data', 'real_trees')


def load(path: str) -> tuple[str, dict[str, Any], dict[str, str]]:
  """(model name, nested dict of `jax.ShapeDtypeStruct`s, path -> hand-judged tier)."""
  with open(path) as f:
    record = json.load(f)
  tree: dict[str, Any] = {}
  for leaf in record['leaves']:
    *parents, name = leaf['path'].split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = jax.ShapeDtypeStruct(tuple(leaf['shape']), jnp.dtype(leaf['dtype']))
  expected = {leaf['path']: leaf['tier'] for leaf in record['leaves']}
  return f"{record['library']}_{record['model']}", tree, expected


def score(path: str) -> dict[str, Any]:
  """Leaves, wrongly labelled paths, warning count and state bytes of one recorded tree."""
  name, tree, expected = load(path)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    labels = sj.make_labeler()(tree)
  got = {_tree.path_str(p): lab for p, lab in jax.tree_util.tree_flatten_with_path(labels)[0]}
  wrong = sorted(p for p in expected if got.get(p) != expected[p])
  f32 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), tree)
  return dict(
      name=name, leaves=len(expected), wrong=[(p, got.get(p), expected[p]) for p in wrong],
      warnings=len(caught),
      skewadam=sj.memory_report(f32, sj.skewadam(1e-3)).total_state_bytes,
      adamw=sj.memory_report(f32, optax.adamw(1e-3)).total_state_bytes)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--wrong', action='store_true', help='list every wrong leaf')
  args = parser.parse_args()
  rows = [score(p) for p in sorted(glob.glob(os.path.join(DATA, '*.json')))]
  print('| model | leaves | wrong tiers | warnings | SkewAdam state B | AdamW state B '
        '| SkewAdam / AdamW |')
  print('|---|---:|---:|---:|---:|---:|---:|')
  for r in rows:
    print(f"| {r['name']} | {r['leaves']} | {len(r['wrong'])} | {r['warnings']} | "
          f"{r['skewadam']:,} | {r['adamw']:,} | {r['skewadam'] / r['adamw']:.3f} |")
  print(f"| **total** | {sum(r['leaves'] for r in rows)} | "
        f"{sum(len(r['wrong']) for r in rows)} | {sum(r['warnings'] for r in rows)} | "
        f"{sum(r['skewadam'] for r in rows):,} | {sum(r['adamw'] for r in rows):,} | |")
  if args.wrong:
    for r in rows:
      for path, got, want in r['wrong']:
        print(f"{r['name']}: {path}: {got} (hand-judged {want})")
  return 0 if not any(r['wrong'] for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
