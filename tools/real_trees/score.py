"""Score the default labeler against the recorded real trees; print a markdown table.

For every `tests/data/real_trees/*.json`: the number of leaves, how many get a tier
other than the hand-judged one, how many get other batch axes than the hand-judged ones
(with `moe_batch_axes`, and with the old rule "every axis before the last two"),
whether the labeler warned, and the optimizer-state bytes of SkewAdam and AdamW from
`memory_report` on the tree cast to float32 (so both hold float32 state). Runs on
abstract shapes only (seconds, no accelerator):

    python tools/real_trees/score.py            # the table
    python tools/real_trees/score.py --wrong    # also list every wrong leaf
    python tools/real_trees/score.py --slices   # also: scale one layer's / expert's
        # gradient slice by 1000 (random arrays, 2 steps) and count the leaves whose
        # other slices' updates move, with the old axes and with moe_batch_axes
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
import numpy as np  # noqa: E402
import optax  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import skewadam_jax as sj  # noqa: E402
from skewadam_jax.structure import paths as _paths  # noqa: E402

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


def hand_axes(path: str) -> dict[str, tuple[int, ...]]:
  with open(path) as f:
    return {leaf['path']: tuple(leaf['batch_axes']) for leaf in json.load(f)['leaves']}


def _by_path(tree: Any) -> dict[str, Any]:
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
  return {_paths.path_str(p): v for p, v in flat}


OLD_AXES = lambda params: jax.tree.map(  # noqa: E731 -- every axis before the last two
    lambda x: tuple(range(max(len(x.shape) - 2, 0))), params)


def moved_slices(tree: Any, axes: dict[str, tuple[int, ...]], batch_axes: Any) -> list[str]:
  """Leaves where scaling slice 0 (of each hand-judged batch axis) by 1000 moves others."""
  rng = np.random.default_rng(0)
  arrays = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.02,
                                              jnp.float32), tree)
  grads = [jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.02,
                                              jnp.float32), tree) for _ in range(2)]
  paths = [p for p, _ in _paths.flatten_with_paths(arrays)[0]]
  treedef = jax.tree_util.tree_structure(arrays)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    tx = sj.skewadam(1e-3, weight_decay=0.1, batch_axes=batch_axes)
    step = jax.jit(lambda g, st: tx.update(g, st, arrays))

    def run(gs):
      st, outs = tx.init(arrays), []
      for g in gs:
        u, st = step(g, st)
        outs.append(treedef.flatten_up_to(u))
      return outs

    base = run(grads)
    moved = set()
    for pick in (0, -1):
      axis_of = [axes[p][pick] if axes[p] else None for p in paths]
      scaled = [treedef.unflatten([
          x if a is None else x.at[(slice(None),) * a + (0,)].multiply(1000.0)
          for x, a in zip(treedef.flatten_up_to(g), axis_of)]) for g in grads]
      for u0s, u1s in zip(base, run(scaled)):
        for path, a, u0, u1 in zip(paths, axis_of, u0s, u1s):
          rest = (slice(None),) * (a or 0) + (slice(1, None),)
          if a is not None and not np.array_equal(np.asarray(u0[rest]), np.asarray(u1[rest])):
            moved.add(path)
  return sorted(moved)


def score(path: str, slices: bool = False) -> dict[str, Any]:
  """Leaves, wrong tiers and axes, warning count and state bytes of one recorded tree."""
  name, tree, expected = load(path)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    labels = sj.make_labeler()(tree)
    axes = _by_path(sj.moe_batch_axes(tree))
  got = {_paths.path_str(p): lab for p, lab in jax.tree_util.tree_flatten_with_path(labels)[0]}
  wrong = sorted(p for p in expected if got.get(p) != expected[p])
  hand = hand_axes(path)
  old = _by_path(OLD_AXES(tree))
  f32 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), tree)
  row = dict(
      name=name, leaves=len(expected), wrong=[(p, got.get(p), expected[p]) for p in wrong],
      wrong_axes=[(p, axes.get(p), hand[p]) for p in hand if axes.get(p) != hand[p]],
      old_wrong_axes=[p for p in hand if old[p] != hand[p]],
      warnings=len(caught),
      skewadam=sj.memory_report(sj.skewadam(1e-3), f32).total_state_bytes,
      skewadam_old=sj.memory_report(sj.skewadam(1e-3, batch_axes=OLD_AXES), f32
                                    ).total_state_bytes,
      adamw=sj.memory_report(optax.adamw(1e-3), f32).total_state_bytes)
  if slices:
    row['moved_old'] = moved_slices(tree, hand, OLD_AXES)
    row['moved'] = moved_slices(tree, hand, None)
  return row


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--wrong', action='store_true', help='list every wrong leaf')
  parser.add_argument('--slices', action='store_true',
                      help='also run the scale-one-slice-by-1000 check (about a minute)')
  args = parser.parse_args()
  rows = [score(p, args.slices) for p in sorted(glob.glob(os.path.join(DATA, '*.json')))]
  extra = ' leaves mixing slices (old axes / now) |' if args.slices else ''
  print('| model | leaves | wrong tiers | wrong axes (old axes) | warnings |' + extra +
        ' SkewAdam state B (old axes) | AdamW state B | SkewAdam / AdamW |')
  print('|---|---:|---:|---:|---:|' + ('---:|' if args.slices else '') + '---:|---:|---:|')
  for r in rows:
    moved = (f" {len(r['moved_old'])} / {len(r['moved'])} |" if args.slices else '')
    print(f"| {r['name']} | {r['leaves']} | {len(r['wrong'])} | {len(r['wrong_axes'])} "
          f"({len(r['old_wrong_axes'])}) | {r['warnings']} |{moved} {r['skewadam']:,} "
          f"({r['skewadam_old']:,}) | {r['adamw']:,} | {r['skewadam'] / r['adamw']:.3f} |")
  moved = (f" {sum(len(r['moved_old']) for r in rows)} / {sum(len(r['moved']) for r in rows)}"
           ' |' if args.slices else '')
  print(f"| **total** | {sum(r['leaves'] for r in rows)} | "
        f"{sum(len(r['wrong']) for r in rows)} | {sum(len(r['wrong_axes']) for r in rows)} "
        f"({sum(len(r['old_wrong_axes']) for r in rows)}) | "
        f"{sum(r['warnings'] for r in rows)} |{moved} {sum(r['skewadam'] for r in rows):,} "
        f"({sum(r['skewadam_old'] for r in rows):,}) | {sum(r['adamw'] for r in rows):,} | |")
  if args.slices:
    print(f"models where a slice moves others: old axes "
          f"{sum(bool(r['moved_old']) for r in rows)}, now {sum(bool(r['moved']) for r in rows)}")
  if args.wrong:
    for r in rows:
      for path, got, want in r['wrong']:
        print(f"{r['name']}: {path}: {got} (hand-judged {want})")
      for path, got, want in r['wrong_axes']:
        print(f"{r['name']}: {path}: batch axes {got} (hand-judged {want})")
  bad = any(r['wrong'] or r['wrong_axes'] or r.get('moved') for r in rows)
  return 1 if bad else 0


if __name__ == '__main__':
  sys.exit(main())
