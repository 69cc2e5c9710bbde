"""Unbiased stochastic rounding, for applying updates to low-precision weights."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def stochastic_round(x: jax.Array, key: jax.Array, dtype: Any = jnp.bfloat16) -> jax.Array:
  r"""Rounds float32 `x` to bfloat16 up or down at random, unbiased: E[round(x)] = x.

  Adds uniform random bits below bfloat16's mantissa to the float32 bit pattern and
  truncates them, so `x` rounds up with probability equal to its distance from the
  lower neighbour (in units of the gap between the two).

  Args:
    x: a float32 array.
    key: a JAX PRNG key; the same key gives the same rounding.
    dtype: target dtype; only bfloat16 (float32 with the low 16 bits cut) is
      rounded stochastically, any other dtype is a plain cast.

  Returns:
    `x` rounded to `dtype`.
  """
  dtype = jnp.dtype(dtype)
  x = jnp.asarray(x, jnp.float32)
  if dtype != jnp.dtype(jnp.bfloat16):
    return x.astype(dtype)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  # Inf and NaN must not be carried into the exponent field.
  rounded = jnp.where(jnp.isfinite(x), rounded, bits)
  return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(dtype)


def apply_updates_stochastic(params: optax.Params, updates: optax.Updates,
                             key: jax.Array) -> optax.Params:
  """`optax.apply_updates`, rounding bfloat16 leaves stochastically (unbiased).

  The sum `p + u` is formed in float32; bfloat16 parameters are then rounded with
  `stochastic_round` (one independent key per leaf), other dtypes are cast as
  `optax.apply_updates` does. This keeps small updates to bf16 weights from
  vanishing in round-to-nearest, as in the published SkewAdam runs.

  Args:
    params: the parameters.
    updates: updates of the same structure (as returned by an optax `update`).
    key: a JAX PRNG key.

  Returns:
    The updated parameters, each in its original dtype.
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)
  ups = treedef.flatten_up_to(updates)
  keys = jax.random.split(key, max(len(leaves), 1))
  out = []
  for p, u, k in zip(leaves, ups, keys):
    if u is None:
      out.append(p)
      continue
    total = p.astype(jnp.float32) + u.astype(jnp.float32)
    if jnp.dtype(p.dtype) == jnp.dtype(jnp.bfloat16):
      out.append(stochastic_round(total, k, p.dtype))
    else:
      out.append(total.astype(p.dtype))
  return treedef.unflatten(out)
