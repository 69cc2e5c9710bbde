"""The exact second moment: Adam's elementwise moving average of `g^2`.

Per leaf, with `bc2 = 1 - b2^t`::

  v <- b2 v + (1 - b2) g^2
  D  = sqrt(max(v, eps))                 eps_mode 'floor' (u = x num_scale / D)
  u  = x num_scale / (sqrt(v / bc2) + eps)    eps_mode 'adam'

The statistic has the parameter's shape (and sharding). It is the published router
tier's estimator, and the one that factored and grouped tiers fall back to for leaves
they cannot reduce (1-D leaves, scalars, and leaves whose non-batch part is 1-D, such
as a per-expert bias [E, F] or a scanned norm scale [d, L]). Batch axes matter only to
the RMS clip, which is per batch slice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from skewadam_jax.core import xla as _xla
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.estimators.base import Spec
from skewadam_jax.estimators.base import Stats
from skewadam_jax.estimators.base import Step


@dataclasses.dataclass(frozen=True)
class Exact(_second_moment.SecondMoment):
  """Adam's full second moment `v` (float32, the parameter's shape).

  References:
    Kingma & Ba, Adam: A Method for Stochastic Optimization, 2015.
  """

  batch_axes: Optional[tuple[int, ...]] = None  # None: all but the last two axes
  name = 'exact'
  per_shape = True  # the path only names the leaf in errors
  stacks = True  # item by item: leaves of one shape share one vmapped call

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> _second_moment.SecondMoment:
    batch_axes = _second_moment.Layout.of(len(shape), batch_axes).batch
    return self if batch_axes == self.batch_axes else Exact(batch_axes)

  def init(self, param: Any, path: str) -> Stats:
    del path
    return {'v': jnp.zeros_like(param, dtype=jnp.float32)}

  def update(self, g: jax.Array, stats: Stats, x: jax.Array, step: Step
             ) -> tuple[jax.Array, Stats]:
    g32 = g.astype(jnp.float32)
    v = step.b2 * stats['v'] + (1.0 - step.b2) * g32 * g32
    floor = step.floor

    def u_of(x_, v_, scale, eps_, bc2_):
      if floor:
        return x_.astype(jnp.float32) * scale * _xla.rsqrt(jnp.maximum(v_, eps_))
      return x_.astype(jnp.float32) * scale / (_xla.sqrt(v_ / bc2_) + eps_)

    operands = (x, v, step.num_scale, jnp.asarray(step.eps, jnp.float32), step.bc2)
    layout = _second_moment.Layout.of(g.ndim, self.batch_axes)
    return _second_moment.clipped(u_of, operands, layout, step.clip), {'v': v}

  def specs(self, spec: Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Mapping[str, Any]:
    del shape, mesh, path
    return {'v': PartitionSpec(*spec)}


EXACT = Exact()
