"""Row/column (factored) second-moment statistics shared by the tiers.

For a leaf of shape `[..., R, C]` the axes before the last two are batch axes (for
example the expert axis of a stacked expert bank), so every statistic is per matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Guard of the row normalisation `r / mean(r)`, as in the reference implementation.
ROW_MEAN_FLOOR = 1e-15


def row_col_means(g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Means of `g^2` (in float32) over the last axis ([..., R]) and the second-to-last
  ([..., C]).

  XLA:CPU materialises a full-size `g * g` when one elementwise producer feeds two
  reductions; the optimisation barrier on the (already materialised) gradient makes
  each reduction square it inside its own fused loop, so no full-size temporary exists.
  """
  g32 = g.astype(jnp.float32)
  row = jnp.mean(g32 * g32, axis=-1)
  gb = jax.lax.optimization_barrier(g).astype(jnp.float32)
  col = jnp.mean(gb * gb, axis=-2)
  return row, col


def normalised_rows(v_row: jax.Array) -> jax.Array:
  """`v_row / max(mean(v_row over R), 1e-15)`: rows scaled to unit mean per matrix."""
  mean = jnp.mean(v_row, axis=-1, keepdims=True)
  return v_row / jnp.maximum(mean, ROW_MEAN_FLOOR)


def factored_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shapes of the row and column statistics of a leaf with `ndim >= 2`."""
  return tuple(shape[:-1]), tuple(shape[:-2]) + (shape[-1],)


def is_factored(shape: tuple[int, ...]) -> bool:
  """Whether a leaf of `shape` gets a factored second moment (ndim >= 2)."""
  return len(shape) >= 2
