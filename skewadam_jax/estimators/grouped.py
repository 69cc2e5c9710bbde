"""The grouped second moment (AdamPM): `g^2` pooled over groups of neighbours.

The second moment of each leaf is shared by runs of `s = group_size` consecutive
elements along one axis. Pooling happens *before* the moving average, so only the
pooled estimate (`ceil(n / s)` entries along the axis) is ever stored::

  nu <- b2 nu + (1 - b2) groupmean_s(g^2)
  D   = sqrt(max(expand_s(nu), eps))                  eps_mode 'floor' (u = x num_scale / D)
  u   = x num_scale / (expand_s(sqrt(nu / bc2)) + eps)     eps_mode 'adam'

`groupmean_s` averages consecutive runs of `s` elements (a short last group over its
real elements, which equals padding it with its own mean) and `expand_s` repeats each
group value `s` times and crops. Pooling and the moving average are both linear, so
`nu` equals `groupmean_s` of Adam's `v` exactly, and `s = 1` is Adam.

One implementation serves both users: `Grouped` is the estimator of a `'grouped'`
SkewAdam tier, and AdamPM's `scale_by_grouped_second_moment` (in `transforms.adampm`) is
momentum plus the same estimator. The pooling itself (`groupmean`,
`expand_groups`) and its sharding checks are in `pooling`.

References:
  AdamPM: Adam with a pooled second moment (Beihang University preprint).
  Kingma & Ba, Adam: A Method for Stochastic Optimization, 2015.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from skewadam_jax.core import checks as _checks
from skewadam_jax.estimators import exact as _exact
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.estimators import pooling as _pooling
from skewadam_jax.core import xla as _xla
from skewadam_jax.estimators.base import Layout
from skewadam_jax.estimators.base import Spec
from skewadam_jax.estimators.base import Stats
from skewadam_jax.estimators.base import Step


def _group_counts(n: int, group_size: int, ndim_after: int) -> np.ndarray:
  """Real elements per group along an axis of length `n`, shaped to broadcast."""
  counts = np.minimum(n - group_size * np.arange(_pooling.num_groups(n, group_size)), group_size)
  return counts.astype(np.float32).reshape((-1,) + (1,) * ndim_after)


def _pooled_clip_divisor(pooled_sq: jax.Array, denom: jax.Array, num_scale: Any,
                         shape: tuple[int, ...], axis: int, group_size: int, clip: float,
                         layout: Layout) -> jax.Array:
  """`max(1, rms(u) / clip)` of `u = g * num_scale / expand(denom)` from pooled arrays,
  per matrix of `layout` (the pooled `axis` one of its matrix axes).

  `pooled_sq` is the group mean of `g^2`, so `pooled_sq * count` is the group's sum of
  squares; no pass over the full-size leaf is needed.
  """
  counts = _group_counts(shape[axis], group_size, len(shape) - axis - 1)
  terms = pooled_sq * jnp.asarray(counts) * jnp.square(num_scale / denom)
  rms = _xla.sqrt(jnp.sum(terms, axis=layout.matrix, keepdims=True)
                 / layout.matrix_size(shape))
  return jnp.maximum(1.0, rms / clip)


def _reshaped_clip_divisor(x: jax.Array, denom: jax.Array, num_scale: Any,
                           shape: tuple[int, ...], axis: int, group_size: int, clip: float,
                           layout: Layout) -> jax.Array:
  """`max(1, rms(u) / clip)` of `u = x * num_scale / expand(denom)` per matrix of
  `layout`, when groups divide the pooled `axis` (a matrix axis or a batch axis).

  The expansion is a broadcast over a reshape `[..., n / s, s, ...]`, which XLA keeps
  inside the reduction, so nothing of the leaf's size is materialised.
  """
  x, denom, num_scale = _xla.cpu_barrier((x, denom, num_scale))
  n, s = shape[axis], group_size
  grouped = x.reshape(shape[:axis] + (n // s, s) + shape[axis + 1:]).astype(jnp.float32)
  u = grouped * num_scale / jnp.expand_dims(denom, axis + 1)
  if len(shape) >= 2:
    # The matrix axes in the reshaped array, where `axis` is split in two (both halves
    # summed if it is a matrix axis, both kept and merged back if it is a batch axis).
    split = sorted([a + (a > axis) for a in layout.matrix]
                   + ([axis + 1] if axis in layout.matrix else []))
    kept = tuple(1 if a in layout.matrix else shape[a] for a in range(len(shape)))
    ms = (jnp.sum(u * u, axis=tuple(split), keepdims=True).reshape(kept)
          / layout.matrix_size(shape))
  else:
    ms = jnp.mean(u * u)
  return jnp.maximum(1.0, _xla.sqrt(ms) / clip)


@dataclasses.dataclass(frozen=True)
class Grouped(_second_moment.SecondMoment):
  """AdamPM's pooled second moment: one float32 value per `group_size` neighbours.

  Attributes:
    group_size: elements per group (static positive int).
    group_axis: the axis pooled along (negative allowed); 1-D leaves are pooled along
      their only axis, and 0-d leaves get the exact estimator.
    axis_arg: the argument name that `group_axis` came from, for error messages.
    batch_axes: the leaf's batch axes; `for_leaf` sets them per leaf.
  """

  group_size: int = 8
  group_axis: int = -1
  axis_arg: str = dataclasses.field(default='group_axis', compare=False)
  batch_axes: Optional[tuple[int, ...]] = None  # per leaf (`for_leaf`); None: default
  name = 'grouped'
  per_shape = True  # the path only names the leaf in errors
  stacks = True  # item by item: leaves of one shape share one vmapped call

  def __post_init__(self):
    _checks.check_positive_int('group_size', self.group_size)
    _checks.check_axis(self.group_axis, self.axis_arg)

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> _second_moment.SecondMoment:
    if len(shape) < 1:
      return _exact.EXACT
    batch_axes = Layout.of(len(shape), batch_axes).batch
    return self if batch_axes == self.batch_axes else dataclasses.replace(
        self, batch_axes=batch_axes)

  def leaf_axis(self, shape: tuple[int, ...], path: str) -> Optional[int]:
    """The non-negative axis a leaf of `shape` is pooled along (None for 0-d)."""
    return _pooling.resolve_axis(len(shape), self.group_axis, path, self.axis_arg)

  def init(self, param: Any, path: str, dtype: Any = jnp.float32) -> Stats:
    ax = self.leaf_axis(tuple(param.shape), path)
    _pooling.check_whole_groups(param, self.group_size, ax, path)
    return {'v': _pooling.zero_grouped(param, self.group_size, ax, jnp.dtype(dtype))}

  def accumulate(self, nu: jax.Array, g32: jax.Array, b2: Any, path: str
                 ) -> tuple[jax.Array, jax.Array]:
    """The new pooled moment (as stored in `nu`'s dtype, in float32) and groupmean(g^2)."""
    pooled_sq = _pooling.groupmean(g32 * g32, self.group_size, self.leaf_axis(g32.shape, path))
    nu32 = (b2 * nu.astype(jnp.float32) + (1.0 - b2) * pooled_sq
            ).astype(nu.dtype).astype(jnp.float32)
    return nu32, pooled_sq

  def expand(self, pooled: jax.Array, shape: tuple[int, ...], path: str) -> jax.Array:
    """`expand_s`: a pooled array back to the leaf's `shape`."""
    ax = self.leaf_axis(shape, path)
    return _pooling.expand_groups(pooled, self.group_size, ax, shape[ax] if ax is not None else 1)

  def update(self, g: jax.Array, stats: Stats, x: jax.Array, step: Step
             ) -> tuple[jax.Array, Stats]:
    shape, path = tuple(g.shape), step.path
    v, pooled_sq = self.accumulate(stats['v'], g.astype(jnp.float32), step.b2, path)
    # The denominator at the pooled resolution, expanded inside the final pass.
    denom = (jnp.sqrt(jnp.maximum(v, step.eps)) if step.floor
             else jnp.sqrt(v / step.bc2) + step.eps)
    u = x.astype(jnp.float32) * step.num_scale / self.expand(denom, shape, path)
    if step.clip is not None:
      u = u / self._clip_divisor(x, pooled_sq, denom, shape, step)
    return u, {'v': v}

  def _clip_divisor(self, x: jax.Array, pooled_sq: jax.Array, denom: jax.Array,
                    shape: tuple[int, ...], step: Step) -> jax.Array:
    """`max(1, rms(u) / clip)` per matrix, from pooled arrays where the layout allows."""
    ax, s = self.leaf_axis(shape, step.path), self.group_size
    layout = Layout.of(len(shape), self.batch_axes)
    inside = ax in layout.matrix  # groups lie inside one matrix
    if inside and step.x_is_grad:
      # sum(u^2) = sum over groups of num_scale^2 * (sum of g^2 in the group) / denom^2:
      # the statistic itself gives it, no pass over the leaf is needed.
      return _pooled_clip_divisor(pooled_sq, denom, step.num_scale, shape, ax, s, step.clip,
                                  layout)
    if shape[ax] % s == 0:
      return _reshaped_clip_divisor(x, denom, step.num_scale, shape, ax, s, step.clip,
                                    layout)
    # u recomputed in the reduction (expand is a gather there: a full-size temporary).
    expand = functools.partial(self.expand, shape=shape, path=step.path)
    return _second_moment.clip_divisor(
        lambda x_, d, scale: x_.astype(jnp.float32) * scale / expand(d),
        (x, denom, step.num_scale), layout, step.clip)

  def specs(self, spec: Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Mapping[str, Any]:
    ax = self.leaf_axis(shape, path)
    if ax is not None and mesh is not None:
      entry = spec[ax]
      names = entry if isinstance(entry, tuple) else () if entry is None else (entry,)
      shards = int(np.prod([mesh.shape[name] for name in names], dtype=np.int64))
      _pooling.check_groups_fit(path, shape[ax], self.group_size, ax, entry, shards)
    return {'v': PartitionSpec(*spec)}
