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

  XLA:CPU materialises a full-size `g * g` (or, for bf16 `g`, its float32 cast) when one
  elementwise producer feeds two reductions or a reduction and the final elementwise
  pass; the optimisation barrier gives each reduction its own copy of the (already
  materialised) gradient to square inside its own fused loop, so no full-size
  temporary exists.
  """
  g_row, g_col = jax.lax.optimization_barrier((g, g))
  g_row = g_row.astype(jnp.float32)
  g_col = g_col.astype(jnp.float32)
  return jnp.mean(g_row * g_row, axis=-1), jnp.mean(g_col * g_col, axis=-2)


def scaled_row_sumsq(x: jax.Array, col_scale: jax.Array) -> jax.Array:
  """`sum_j (x_ij * col_scale_j)^2` over the last axis, in float32 ([..., R]).

  The RMS of a separable update `x_ij * a_i * col_scale_j` is `sum_i a_i^2` times this,
  so clipping it costs one more read of `x` and no full-size temporary (the barrier
  keeps XLA from sharing this pass's products with the final elementwise pass).
  """
  xb, cb = jax.lax.optimization_barrier((x, col_scale))
  sumsq = jnp.sum(jnp.square(xb.astype(jnp.float32) * cb[..., None, :]), axis=-1)
  return fusion_boundary(sumsq)


def fusion_boundary(x: jax.Array) -> jax.Array:
  """`x` unchanged (float32), but computed by its own kernel.

  XLA:CPU fuses a reduction of `x` into the reduction that produced it, and the fused
  YNNPACK kernel runs 1.5-10x slower than the two separate reductions (measured on
  [128, 512, 512] and [50304, 512]). An optimisation barrier does not stop that fusion;
  `reduce_precision` to float32's own exponent and mantissa widths is an exact identity
  that the fused kernel cannot contain, so it does.
  """
  return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23)


@jax.jit
def zero_row_col(p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Zero float32 row ([..., R]) and column ([..., C]) statistics for a parameter `p`.

  Reduced from `zeros_like(p)` so that they inherit `p`'s sharding minus the reduced
  axis (slicing a sharded axis to length 1 is an error under an Explicit mesh); jitted
  so that XLA folds the full-size zeros away instead of allocating them in eager `init`.
  """
  zeros = jnp.zeros_like(p, dtype=jnp.float32)
  return zeros.sum(axis=-1), zeros.sum(axis=-2)


def normalised_rows(v_row: jax.Array) -> jax.Array:
  """`v_row / max(mean(v_row over R), 1e-15)`: rows scaled to unit mean per matrix."""
  mean = jnp.mean(v_row, axis=-1, keepdims=True)
  return v_row / jnp.maximum(mean, ROW_MEAN_FLOOR)


def is_factored(shape: tuple[int, ...]) -> bool:
  """Whether a leaf of `shape` gets a factored second moment (ndim >= 2)."""
  return len(shape) >= 2
