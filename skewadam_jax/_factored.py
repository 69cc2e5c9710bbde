"""The factored second moment: Adafactor's row and column statistics, per matrix.

For a leaf of shape `[..., R, C]` the axes before the last two are batch axes (for
example the expert axis of a stacked expert bank), so every statistic is per matrix.
With `bc2 = 1 - b2^t`::

  r <- b2 r + (1 - b2) mean(g^2, -1)            # [..., R]
  c <- b2 c + (1 - b2) mean(g^2, -2)            # [..., C]
  D  = sqrt(max(r / max(mean(r), 1e-15), eps))[..., :, None] * sqrt(max(c, eps))[..., None, :]
  u  = x num_scale / D                                        eps_mode 'floor'
  u  = x num_scale / (sqrt(r / mean(r)) sqrt(c / bc2) + eps)  eps_mode 'adam'

Leaves with fewer than two dimensions get the exact estimator. With the floor, `u` is
separable (`x_ij a_i b_j`), so the RMS clip needs only one weighted pass over `x` and
the final pass multiplies by a row and a column factor: no full-size temporary.

References:
  Shazeer & Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost, 2018.
  Where Should Optimizer State Live? Tiered State Allocation for Memory-Efficient
  Mixture-of-Experts Training, arXiv 2607.19058.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from skewadam_jax import _exact
from skewadam_jax import _second_moment
from skewadam_jax import _xla
from skewadam_jax._second_moment import Spec
from skewadam_jax._second_moment import Stats
from skewadam_jax._second_moment import Step

# Guard of the row normalisation `r / mean(r)`, as in the reference implementation.
ROW_MEAN_FLOOR = 1e-15


def row_col_means(g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Means of `g^2` (in float32) over the last axis ([..., R]) and the second-to-last
  ([..., C]).

  XLA:CPU materialises a full-size `g * g` (or, for bf16 `g`, its float32 cast) when one
  elementwise producer feeds two reductions or a reduction and the final elementwise
  pass; on the CPU an optimisation barrier gives each reduction its own copy of the
  (already materialised) gradient to square inside its own fused loop, so no full-size
  temporary exists.
  """
  g_row, g_col = _xla.cpu_barrier((g, g))
  g_row = g_row.astype(jnp.float32)
  g_col = g_col.astype(jnp.float32)
  return jnp.mean(g_row * g_row, axis=-1), jnp.mean(g_col * g_col, axis=-2)


def scaled_row_sumsq(x: jax.Array, col_scale: jax.Array) -> jax.Array:
  """`sum_j (x_ij * col_scale_j)^2` over the last axis, in float32 ([..., R]).

  The RMS of a separable update `x_ij * a_i * col_scale_j` is `sum_i a_i^2` times this,
  so clipping it costs one more read of `x` and no full-size temporary (the barrier
  keeps XLA from sharing this pass's products with the final elementwise pass).
  """
  xb, cb = _xla.cpu_barrier((x, col_scale))
  sumsq = jnp.sum(jnp.square(xb.astype(jnp.float32) * cb[..., None, :]), axis=-1)
  return _xla.cpu_fusion_boundary(sumsq)


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


@dataclasses.dataclass(frozen=True)
class Factored(_second_moment.SecondMoment):
  """Row/column statistics per matrix over the last two axes (exact for ndim < 2)."""

  name = 'factored'

  def for_leaf(self, shape: tuple[int, ...]) -> _second_moment.SecondMoment:
    return self if is_factored(shape) else _exact.EXACT

  def init(self, param: Any, path: str) -> Stats:
    del path
    v_row, v_col = zero_row_col(param)
    return {'v_row': v_row, 'v_col': v_col}

  def update(self, g: jax.Array, stats: Stats, x: jax.Array, step: Step
             ) -> tuple[jax.Array, Stats]:
    row_mean, col_mean = row_col_means(g)
    v_row = step.b2 * stats['v_row'] + (1.0 - step.b2) * row_mean
    v_col = step.b2 * stats['v_col'] + (1.0 - step.b2) * col_mean
    rows = normalised_rows(v_row)
    new = {'v_row': v_row, 'v_col': v_col}
    if step.floor:
      return _separable_update(x, rows, v_col, step), new

    def u_of(x_, row_d, col_d, scale, eps_):
      return x_.astype(jnp.float32) * scale / (row_d * col_d + eps_)

    operands = (x, jnp.sqrt(rows)[..., :, None], jnp.sqrt(v_col / step.bc2)[..., None, :],
                step.num_scale, jnp.asarray(step.eps, jnp.float32))
    return _second_moment.clipped(u_of, operands, g.ndim, step.clip), new

  def specs(self, spec: Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Mapping[str, Any]:
    del shape, mesh, path
    return {'v_row': PartitionSpec(*spec[:-1]),
            'v_col': PartitionSpec(*spec[:-2], *spec[-1:])}


def _separable_update(x: jax.Array, rows: jax.Array, v_col: jax.Array, step: Step
                      ) -> jax.Array:
  """`u = x num_scale a_i b_j` with the floored factors, RMS-clipped per matrix.

  The clip needs only `sum_j (x_ij b_j)^2` per row, and the final pass multiplies by
  per-row and per-column factors.
  """
  col_inv = jax.lax.rsqrt(jnp.maximum(v_col, step.eps))
  row_scale = step.num_scale * jax.lax.rsqrt(jnp.maximum(rows, step.eps))
  if step.clip is not None:
    sumsq = scaled_row_sumsq(x, col_inv)
    ms = (jnp.sum(sumsq * jnp.square(row_scale), axis=-1, keepdims=True)
          / (x.shape[-2] * x.shape[-1]))
    row_scale = row_scale / jnp.maximum(1.0, jnp.sqrt(ms) / step.clip)
  return x.astype(jnp.float32) * row_scale[..., :, None] * col_inv[..., None, :]


FACTORED = Factored()
