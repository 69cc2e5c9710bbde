"""Frozen 3-step outputs of every estimator x momentum x eps mode x clip x dtype.

`python tests/support/frozen_cases.py` (re)writes `tests/data/frozen_3_steps.npz` from the
library as it is; `test_frozen.py` requires today's library to reproduce every array
within a few ulp of its own dtype (`tests/support/ulp.py` says why that bound and not bitwise
equality: the arrays were recorded on another CPU). Regenerate only for a deliberate
numerical change, and say so in the commit.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

import skewadam_jax as sj

DATA = Path(__file__).resolve().parents[1] / 'data' / 'frozen_3_steps.npz'
STEPS = 3

# Stacked odd experts, a matrix, a 4-D leaf, a 1-D leaf of odd length, a scalar, and a
# matrix whose gradients sit under the eps floor.
SHAPES: dict[str, tuple[tuple[int, ...], float]] = {
    'experts': ((3, 5, 7), 1.0),
    'matrix': ((8, 12), 0.3),
    'four_d': ((2, 3, 4, 8), 1.0),
    'vector': ((11,), 0.1),
    'scalar': ((), 0.5),
    'tiny': ((6, 4), 1e-6),
}


def params_and_grads(dtype: Any) -> tuple[dict, list[dict]]:
  """Deterministic params and STEPS gradient trees, in `dtype`."""
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(0.1 * rng.standard_normal(s), dtype) for k, (s, _) in SHAPES.items()}
  grads = []
  for _ in range(STEPS):
    grads.append({k: jnp.asarray(scale * rng.standard_normal(s)
                                 * np.exp(rng.uniform(-2, 2, s)), dtype)
                  for k, (s, scale) in SHAPES.items()})
  return params, grads


def cases() -> Iterator[tuple[str, optax.GradientTransformation]]:
  """(name, transform) for every configuration that is frozen."""
  for momentum, second, eps_mode, clip in itertools.product(
      (True, False), ('exact', 'factored', 'grouped'), ('floor', 'adam'), (None, 0.05)):
    name = f'tier-m{int(momentum)}-{second}-{eps_mode}-clip{clip}'
    tier = sj.Tier(momentum=momentum, second_moment=second, eps_mode=eps_mode,
                   clip_threshold=clip, group_size=3)
    yield name, sj.scale_by_tiered_adam(tier=tier)
  # Grouped tiers whose groups divide the axis, and grouping along other axes: the
  # clip takes a different path in each.
  for momentum, axis, clip in itertools.product((True, False), (-1, -2, 0), (None, 0.05)):
    name = f'tier-m{int(momentum)}-grouped4-axis{axis}-clip{clip}'
    tier = sj.Tier(momentum=momentum, second_moment='grouped', group_size=4,
                   group_axis=axis, clip_threshold=clip)
    yield name, sj.scale_by_tiered_adam(tier=tier)
  yield 'tier-bf16-mu', sj.scale_by_tiered_adam(tier=sj.Tier(mu_dtype=jnp.bfloat16))
  for group_size, axis in ((8, -1), (3, -1), (4, -2), (1, -1)):
    yield (f'adampm-s{group_size}-axis{axis}',
           sj.scale_by_grouped_second_moment(group_size=group_size, axis=axis))
  yield 'adampm-bf16-state', sj.scale_by_grouped_second_moment(
      mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)


def run_native(tx: optax.GradientTransformation, dtype: Any) -> dict[str, np.ndarray]:
  """Updates of every step and the final state, named, each in its own dtype."""
  params, grads = params_and_grads(dtype)
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = {}
  for step, g in enumerate(grads):
    u, state = update(g, state, params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(u)[0]:
      out[f'u{step}{jax.tree_util.keystr(path)}'] = np.asarray(leaf)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    out[f'state{jax.tree_util.keystr(path)}'] = np.asarray(leaf)
  return out


def run(tx: optax.GradientTransformation, dtype: Any) -> dict[str, np.ndarray]:
  """`run_native`, every array cast to float32 (exact: the way they are stored)."""
  return {k: v.astype(np.float32) for k, v in run_native(tx, dtype).items()}


def all_outputs() -> dict[str, np.ndarray]:
  """Every frozen array, keyed `<case>/<dtype>/<array>`."""
  out = {}
  for dtype in ('float32', 'bfloat16'):
    for name, tx in cases():
      for key, value in run(tx, jnp.dtype(dtype)).items():
        out[f'{name}/{dtype}/{key}'] = value
  return out


if __name__ == '__main__':
  DATA.parent.mkdir(exist_ok=True)
  arrays = all_outputs()
  np.savez_compressed(DATA, **arrays)
  print(f'wrote {len(arrays)} arrays to {DATA}')
