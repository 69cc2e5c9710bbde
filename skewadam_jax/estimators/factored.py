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

Batch axes can sit anywhere (MaxText stacks scanned layers at axis 1: a norm scale
[d, L], a query kernel [d, L, heads, head_dim]). Given a leaf's batch axes, the other
axes form its matrix: the last of them is the column axis `C`, the others together the
rows `R` (as if the leaf were reshaped to [batch, prod(R), C], reduced in place with no
transpose). A leaf with fewer than two non-batch axes gets the exact estimator.

References:
  Shazeer & Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost, 2018.
  Where Should Optimizer State Live? Tiered State Allocation for Memory-Efficient
  Mixture-of-Experts Training, arXiv 2607.19058.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from skewadam_jax.estimators import exact as _exact
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.core import xla as _xla
from skewadam_jax.estimators.base import Layout
from skewadam_jax.estimators.base import Spec
from skewadam_jax.estimators.base import Stats
from skewadam_jax.estimators.base import Step

# Guard of the row normalisation `r / mean(r)`, as in the reference implementation.
ROW_MEAN_FLOOR = 1e-15


@functools.partial(jax.jit, static_argnums=(1, 2))
def zero_row_col(p: jax.Array, rows: tuple[int, ...], col: int
                 ) -> tuple[jax.Array, jax.Array]:
  """Zero float32 row (`p` without `col`) and column (`p` without `rows`) statistics.

  Reduced from `zeros_like(p)` so that they inherit `p`'s sharding minus the reduced
  axes (slicing a sharded axis to length 1 is an error under an Explicit mesh); jitted
  so that XLA folds the full-size zeros away instead of allocating them in eager `init`.
  """
  zeros = jnp.zeros_like(p, dtype=jnp.float32)
  return zeros.sum(axis=col), zeros.sum(axis=rows)


def is_factored(shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
                ) -> bool:
  """Whether a leaf gets a factored second moment (two or more non-batch axes)."""
  return len(Layout.of(len(shape), batch_axes).matrix) >= 2


def _rows_in_v_row(layout: Layout) -> tuple[int, ...]:
  """The row axes in `v_row` (the leaf without its column axis)."""
  return tuple(a - (a > layout.col) for a in layout.rows)


def _row_factor(layout: Layout, a: jax.Array) -> jax.Array:
  """A `v_row`-shaped array, broadcastable against the leaf."""
  return jnp.expand_dims(a, layout.col)


def _col_factor(layout: Layout, a: jax.Array) -> jax.Array:
  """A `v_col`-shaped array, broadcastable against the leaf."""
  return jnp.expand_dims(a, layout.rows)


def _drop(spec: Spec, axes: tuple[int, ...]) -> PartitionSpec:
  """`spec` without the entries of `axes`."""
  return PartitionSpec(*(e for i, e in enumerate(spec) if i not in axes))


@dataclasses.dataclass(frozen=True)
class Factored(_second_moment.SecondMoment):
  """Row/column statistics per matrix (exact for leaves with < 2 non-batch axes).

  Attributes:
    batch_axes: the leaf's batch axes (sorted, non-negative), or None for the default
      (every axis before the last two); `for_leaf` sets it per leaf.
  """

  batch_axes: Optional[tuple[int, ...]] = None
  name = 'factored'
  per_shape = True  # the path only names the leaf in errors
  stacks = True  # item by item: leaves of one shape share one vmapped call
  reduces_matrices = True

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> _second_moment.SecondMoment:
    batch_axes = Layout.of(len(shape), batch_axes).batch
    if not is_factored(shape, batch_axes):
      return _exact.Exact(batch_axes)
    return self if batch_axes == self.batch_axes else Factored(batch_axes)

  def _layout(self, ndim: int) -> Layout:
    return Layout.of(ndim, self.batch_axes)

  def init(self, param: Any, path: str) -> Stats:
    del path
    layout = self._layout(len(param.shape))
    v_row, v_col = zero_row_col(param, layout.rows, layout.col)
    return {'v_row': v_row, 'v_col': v_col}

  def update(self, g: jax.Array, stats: Stats, x: jax.Array, step: Step
             ) -> tuple[jax.Array, Stats]:
    layout = self._layout(g.ndim)
    # XLA:CPU materialises a full-size `g * g` (or, for bf16 `g`, its float32 cast) when
    # one elementwise producer feeds two reductions; the barrier gives each reduction its
    # own copy of the (already materialised) gradient to square in its own fused loop.
    g_row, g_col = _xla.cpu_barrier((g, g))
    g_row = g_row.astype(jnp.float32)
    g_col = g_col.astype(jnp.float32)
    v_row = step.b2 * stats['v_row'] + (1.0 - step.b2) * jnp.mean(g_row * g_row,
                                                                  axis=layout.col)
    v_col = step.b2 * stats['v_col'] + (1.0 - step.b2) * jnp.mean(g_col * g_col,
                                                                  axis=layout.rows)
    mean = jnp.mean(v_row, axis=_rows_in_v_row(layout), keepdims=True)
    rows = v_row / jnp.maximum(mean, ROW_MEAN_FLOOR)
    new = {'v_row': v_row, 'v_col': v_col}
    if step.floor:
      return _separable_update(layout, x, rows, v_col, step), new

    def u_of(x_, row_d, col_d, scale, eps_):
      return x_.astype(jnp.float32) * scale / (row_d * col_d + eps_)

    operands = (x, _row_factor(layout, _xla.sqrt(rows)),
                _col_factor(layout, _xla.sqrt(v_col / step.bc2)), step.num_scale,
                jnp.asarray(step.eps, jnp.float32))
    return _second_moment.clipped(u_of, operands, layout, step.clip), new

  def specs(self, spec: Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Mapping[str, Any]:
    del mesh, path
    layout = self._layout(len(shape))
    return {'v_row': _drop(spec, (layout.col,)), 'v_col': _drop(spec, layout.rows)}


def _separable_update(layout: Layout, x: jax.Array, rows: jax.Array, v_col: jax.Array,
                      step: Step) -> jax.Array:
  """`u = x num_scale a_i b_j` with the floored factors, RMS-clipped per matrix.

  The clip needs only `sum_j (x_ij b_j)^2` per row, and the final pass multiplies by
  per-row and per-column factors: no full-size temporary.
  """
  col_inv = _xla.rsqrt(jnp.maximum(v_col, step.eps))
  row_scale = step.num_scale * _xla.rsqrt(jnp.maximum(rows, step.eps))
  if step.clip is not None:
    # The barrier keeps XLA from sharing this pass's products with the final pass.
    xb, cb = _xla.cpu_barrier((x, col_inv))
    sumsq = jnp.sum(jnp.square(xb.astype(jnp.float32) * _col_factor(layout, cb)),
                    axis=layout.col)
    sumsq = _xla.cpu_fusion_boundary(sumsq)
    size = layout.matrix_size(x.shape)
    ms = jnp.sum(sumsq * jnp.square(row_scale), axis=_rows_in_v_row(layout),
                 keepdims=True) / size
    row_scale = row_scale / jnp.maximum(1.0, _xla.sqrt(ms) / step.clip)
  return x.astype(jnp.float32) * _row_factor(layout, row_scale) * _col_factor(layout, col_inv)


FACTORED = Factored()
