"""MoE-shaped parameter trees and deterministic gradients shared by the tests."""

from __future__ import annotations

from typing import Any

import numpy as np

# name -> (shape, gradient scale): stacked experts, odd lengths, 1-D norms, a scalar,
# and gradient scales from 1e-6 to 1 so that the eps floor and the RMS clip engage.
MOE_LEAVES: dict[str, tuple[tuple[int, ...], float]] = {
    'embed/embedding': ((37, 24), 1e-2),
    'blocks/0/attn/q_proj/kernel': ((24, 24), 1.0),
    'blocks/0/attn/k_proj/kernel': ((24, 8), 1e-6),
    'blocks/0/ln1/scale': ((24,), 1e-3),
    'blocks/0/ln1/bias': ((24,), 1e-6),
    'blocks/1/moe/router/kernel': ((24, 5), 1e-1),
    'blocks/1/moe/experts/w1': ((5, 24, 40), 1e-4),
    'blocks/1/moe/experts/w3': ((5, 40, 24), 1.0),
    'blocks/1/moe/experts/odd': ((5, 13, 11), 1e-5),
    'final_norm/scale': ((24,), 1.0),
    'logit_scale': ((), 3e-1),
}


def nest(flat: dict) -> dict:
  """'a/b/c' -> {'a': {'b': {'c': ...}}}."""
  out: dict = {}
  for key, value in flat.items():
    node = out
    parts = key.split('/')
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = value
  return out


def flatten(tree: dict, prefix: str = '') -> dict:
  """Inverse of `nest`."""
  out = {}
  for key, value in tree.items():
    name = f'{prefix}/{key}' if prefix else str(key)
    if isinstance(value, dict):
      out.update(flatten(value, name))
    else:
      out[name] = value
  return out


def init_params(seed: int = 0, leaves=None) -> dict:
  """Flat dict of float64 initial parameters."""
  leaves = leaves or MOE_LEAVES
  rng = np.random.default_rng(seed)
  return {k: 0.1 * rng.standard_normal(shape) for k, (shape, _) in leaves.items()}


def make_grads_fn(seed: int = 1, leaves=None):
  """(step, params) -> flat dict of gradients: a pull towards 0 plus heterogeneous noise.

  Rows and columns get log-uniform scale factors spanning two decades, so factored
  estimates are inexact and the RMS clip has something to clip.
  """
  leaves = leaves or MOE_LEAVES
  base = np.random.default_rng(seed)
  row_col = {}
  for k, (shape, _) in leaves.items():
    f = np.ones(shape)
    if len(shape) >= 1:
      f = f * 10 ** base.uniform(-1, 1, size=shape[-1])
    if len(shape) >= 2:
      f = f * (10 ** base.uniform(-1, 1, size=shape[-2]))[:, None]
    row_col[k] = f

  def grads_fn(step: int, params: dict) -> dict:
    rng = np.random.default_rng(1000 + step)
    out = {}
    for k, (shape, scale) in leaves.items():
      noise = rng.standard_normal(shape)
      out[k] = scale * row_col[k] * (noise + 2.0 * np.asarray(params[k], np.float64))
    return out

  return grads_fn


def run_optax(tx, params: dict, grads_fn, steps: int, *, jit: bool = True,
              dtype=np.float32):
  """Runs `steps` of an optax optimizer on nested params; returns final flat params.

  Gradients come from `grads_fn` evaluated on the current parameters (as float64), so
  the JAX run and a NumPy reference run follow the same trajectory.
  """
  import jax
  import jax.numpy as jnp
  import optax

  p = nest({k: jnp.asarray(v, dtype) for k, v in params.items()})
  state = tx.init(p)

  def step(p, state, g):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  step = jax.jit(step) if jit else step
  for i in range(steps):
    flat = {k: np.asarray(v, np.float64) for k, v in flatten(p).items()}
    g = nest({k: jnp.asarray(v, dtype) for k, v in grads_fn(i, flat).items()})
    p, state = step(p, state, g)
  return {k: np.asarray(v, np.float64) for k, v in flatten(p).items()}, state


def abstract_tree(paths: dict[str, tuple[int, ...]], dtype: Any = None) -> dict[str, Any]:
  """Nested dicts of `jax.ShapeDtypeStruct`s (float32 by default) from '/'-joined paths."""
  import jax
  import jax.numpy as jnp

  tree: dict[str, Any] = {}
  for path, shape in paths.items():
    *parents, name = path.split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = jax.ShapeDtypeStruct(shape, jnp.float32 if dtype is None else dtype)
  return tree
