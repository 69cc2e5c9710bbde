"""AdamPM: Adam with a second moment pooled over groups of neighbouring elements.

The second moment of each leaf is shared by runs of `group_size` consecutive elements
along one axis. Pooling happens *before* the moving average, so only the pooled
estimate (`ceil(n / group_size)` entries along the axis) is ever stored.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax import _checks
from skewadam_jax import _tree


def num_groups(n: int, group_size: int) -> int:
  """Number of groups along an axis of length `n`: ceil(n / group_size)."""
  return -(-n // group_size)


def resolve_axis(ndim: int, axis: int, path: str = 'leaf', name: str = 'axis'
                 ) -> Optional[int]:
  """The non-negative grouping axis of a leaf, or None for 0-d leaves.

  1-D leaves (norm scales, biases) are always grouped along their only axis; for
  leaves with two or more dimensions `axis` must be in range.
  """
  if ndim == 0:
    return None
  if ndim == 1:
    return 0
  if not -ndim <= axis < ndim:
    raise ValueError(
        f'`{name}`={axis} is out of range for parameter {path} with {ndim} dimensions; '
        f'allowed values are {-ndim}..{ndim - 1}.')
  return axis % ndim


def grouped_shape(shape: tuple[int, ...], group_size: int, axis: Optional[int]
                  ) -> tuple[int, ...]:
  """Shape of the pooled statistic of a leaf of `shape`."""
  if axis is None:
    return tuple(shape)
  shape = list(shape)
  shape[axis] = num_groups(shape[axis], group_size)
  return tuple(shape)


def axis_shards(x: Any, axis: Optional[int]) -> tuple[Any, int]:
  """The Explicit-mesh axes that shard `x` along `axis`, and the number of shards.

  Reads the sharding in `x`'s type (`jax.typeof(x).sharding`), which names mesh axes
  only under an Explicit mesh; under an Auto mesh, `pmap`, inside `shard_map` (local
  shards) or without a mesh it gives `(None, 1)`.
  """
  if axis is None:
    return None, 1
  sharding = getattr(jax.typeof(x), 'sharding', None)
  spec = getattr(sharding, 'spec', None)
  if spec is None or axis >= len(spec) or not isinstance(spec[axis], (str, tuple)):
    return None, 1
  entry = spec[axis]
  names = entry if isinstance(entry, tuple) else (entry,)
  count = 1
  for name in names:
    count *= sharding.mesh.shape[name]
  return entry, count


def check_whole_groups(x: Any, group_size: int, axis: Optional[int], path: str = 'leaf'
                       ) -> int:
  """Number of shards of `x` along `axis`; raises if a group would straddle two shards.

  Pooling along a sharded axis needs no communication when every shard holds whole
  groups, i.e. when `group_size` divides the shard length.
  """
  entry, shards = axis_shards(x, axis)
  if shards > 1 and group_size > 1:
    n = x.shape[axis]
    shard_len = n // shards
    if n % shards or shard_len % group_size:
      raise ValueError(
          f'Cannot pool parameter {path} in groups of group_size={group_size} along axis '
          f'{axis}: that axis (length {n}) is sharded over mesh axis {entry!r} into '
          f'{shards} shards of shard length {shard_len}, and a group would straddle two '
          f'shards. Use a group size that divides {shard_len}, pool along an unsharded '
          'axis (`axis=` / `group_axis=`), or shard this axis differently.')
  return shards


def _sharded_spec(x: Any) -> Any:
  """`x`'s PartitionSpec under an Explicit mesh, one entry per dimension."""
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def _expand_groups_sharded(nu: jax.Array, group_size: int, axis: int) -> jax.Array:
  """`expand_groups` along an Explicit-sharded axis: broadcast + shard-local reshape."""
  spec = _sharded_spec(nu)
  wide = nu.shape[:axis + 1] + (group_size,) + nu.shape[axis + 1:]
  full = jnp.broadcast_to(jnp.expand_dims(nu, axis + 1), wide)
  shape = nu.shape[:axis] + (nu.shape[axis] * group_size,) + nu.shape[axis + 1:]
  return jax.lax.reshape(full, shape, out_sharding=jax.P(*spec))


# Group sizes up to this are pooled with one unrolled sum of `group_size` slices, which
# XLA:CPU fuses into a single loop over the pooled output; a reduction over a minor axis
# of a few elements is several times slower there (it goes through a generic reduce).
_UNROLLED_MAX_GROUP = 32


def groupmean(x: jax.Array, group_size: int, axis: Optional[int]) -> jax.Array:
  """Mean over consecutive runs of `group_size` elements along `axis`.

  A short last group is averaged over its real elements only, which equals padding
  it with its own mean.

  The sum runs over `group_size` interleaved slices (element `i` of every group, for
  each `i`), so the pooled array is produced by one fused loop that reads `x` once and
  allocates nothing of `x`'s size. When the axis divides evenly the slices are taken
  from a reshape `[..., n / s, s, ...]`, which keeps the sharding of `axis` on the
  group axis.

  Args:
    x: array to pool.
    group_size: elements per group (static).
    axis: non-negative axis to pool along, or None for no pooling (0-d leaves).

  Returns:
    An array with `axis` shortened to ceil(n / group_size).
  """
  if axis is None or group_size == 1:
    return x
  # On an Explicit-sharded axis the reshape below stays shard-local (no out_sharding
  # needed) as long as every shard holds whole groups; otherwise raise a clear error.
  check_whole_groups(x, group_size, axis)
  n = x.shape[axis]
  k = num_groups(n, group_size)
  if group_size > _UNROLLED_MAX_GROUP:
    return _groupmean_by_reduce(x, group_size, axis)
  if n % group_size == 0:
    grouped = x.reshape(x.shape[:axis] + (k, group_size) + x.shape[axis + 1:])
    parts = [jax.lax.index_in_dim(grouped, i, axis + 1, keepdims=False)
             for i in range(group_size)]
  else:
    parts = []
    for i in range(min(group_size, n)):
      part = jax.lax.slice_in_dim(x, i, n, stride=group_size, axis=axis)
      if part.shape[axis] < k:  # element i of the short last group does not exist
        padding = [(0, 0, 0)] * x.ndim
        padding[axis] = (0, k - part.shape[axis], 0)
        part = jax.lax.pad(part, jnp.zeros((), x.dtype), padding)
      parts.append(part)
  total = parts[0]
  for part in parts[1:]:
    total = total + part
  if n % group_size == 0:
    return total / group_size
  counts = np.minimum(n - group_size * np.arange(k), group_size).astype(np.float32)
  counts = counts.reshape((k,) + (1,) * (x.ndim - axis - 1))
  return total / jnp.asarray(counts, total.dtype)


def _groupmean_by_reduce(x: jax.Array, group_size: int, axis: int) -> jax.Array:
  """`groupmean` as a reshape and mean (for large groups): full groups, then the tail."""
  n = x.shape[axis]
  full = (n // group_size) * group_size
  pieces = []
  if full:
    main = jax.lax.slice_in_dim(x, 0, full, axis=axis) if full < n else x
    split = x.shape[:axis] + (full // group_size, group_size) + x.shape[axis + 1:]
    pieces.append(jnp.mean(main.reshape(split), axis=axis + 1))
  if full < n:
    tail = jax.lax.slice_in_dim(x, full, n, axis=axis)
    pieces.append(jnp.mean(tail, axis=axis, keepdims=True))
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def zero_grouped(p: jax.Array, group_size: int, axis: Optional[int], dtype: Any
                 ) -> jax.Array:
  """A zero pooled statistic for parameter `p`, with `p`'s sharding on the grouped axis.

  Pooled from `zeros_like(p)` so that it inherits `p`'s sharding; jitted so that XLA
  folds the full-size zeros away instead of allocating them in eager `init`.
  """
  return groupmean(jnp.zeros_like(p, dtype=dtype), group_size, axis)


def expand_groups(nu: jax.Array, group_size: int, axis: Optional[int], n: int
                  ) -> jax.Array:
  """Repeats each group value `group_size` times along `axis` and crops to `n`."""
  if axis is None or group_size == 1:
    return nu
  if axis_shards(nu, axis)[1] > 1:
    return _expand_groups_sharded(nu, group_size, axis)
  # A gather with iota indices fuses into the consumer's loop in XLA, unlike
  # repeat + slice, so the full-size expanded array is never materialised.
  index = jnp.arange(n, dtype=jnp.int32) // group_size
  return jnp.take(nu, index, axis=axis, mode='clip')


class GroupedSecondMomentState(NamedTuple):
  """State of `scale_by_grouped_second_moment`."""
  count: jax.Array  # shape=(), int32: number of updates applied so far.
  mu: optax.Updates  # like params, dtype mu_dtype (params' dtype by default).
  nu: optax.Updates  # like params with `axis` shortened to ceil(n / group_size).


def scale_by_grouped_second_moment(
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = 1e-8,
    *,
    group_size: int = 8,
    axis: int = -1,
    mu_dtype: Optional[Any] = None,
    nu_dtype: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by Adam with a second moment pooled over groups (AdamPM).

  With `groupmean_s` the mean over runs of `s` neighbouring elements along `axis`
  and `expand_s` its inverse (repeat each group value `s` times, crop)::

    m  <- b1 * m + (1 - b1) * g
    nu <- b2 * nu + (1 - b2) * groupmean_s(g^2)
    u  =  (m / (1 - b1^t)) / (sqrt(expand_s(nu / (1 - b2^t))) + eps)

  Pooling and the moving average are both linear, so `nu` equals
  `groupmean_s` of Adam's second moment exactly; with `group_size=1` this is Adam.
  0-d leaves keep an exact second moment; 1-D leaves are pooled along their only axis.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the pooled second moment.
    eps: term added to the denominator, as in Adam.
    group_size: elements per group (static positive int).
    axis: axis along which neighbours are pooled (static; negative allowed). The
      default pools along rows (the last axis).
    mu_dtype: dtype the first moment is stored in; default the parameters' dtype.
    nu_dtype: dtype the pooled second moment is stored in; default the parameters'.

  Returns:
    An `optax.GradientTransformationExtraArgs` (extra `update` keywords are ignored).

  Example:
    >>> import jax.numpy as jnp, optax, skewadam_jax as sj
    >>> tx = optax.chain(sj.scale_by_grouped_second_moment(group_size=8),
    ...                  optax.scale(-1e-3))
    >>> state = tx.init({'w': jnp.zeros((4, 16))})

  References:
    AdamPM: Adam with a pooled second moment (Beihang University preprint).
    Kingma & Ba, Adam: A Method for Stochastic Optimization, 2015.
  """
  _checks.check_beta('b1', b1)
  _checks.check_beta('b2', b2)
  _checks.check_non_negative('eps', eps)
  group_size = _checks.check_positive_int('group_size', group_size)
  axis = _checks.check_axis(axis)
  mu_dtype = _checks.check_float_dtype('mu_dtype', mu_dtype)
  nu_dtype = _checks.check_float_dtype('nu_dtype', nu_dtype)

  def leaf_axis(path: str, p: Any) -> Optional[int]:
    return resolve_axis(len(p.shape), axis, path)

  def init_fn(params):
    leaves, treedef = _tree.flatten_with_paths(params)
    mus, nus = [], []
    for path, p in leaves:
      _checks.check_float_leaf(path, p.dtype, 'scale_by_grouped_second_moment')
      ax = leaf_axis(path, p)
      check_whole_groups(p, group_size, ax, path)
      mus.append(jnp.zeros_like(p, dtype=mu_dtype or p.dtype))
      nus.append(zero_grouped(p, group_size, ax, jnp.dtype(nu_dtype or p.dtype)))
    return GroupedSecondMomentState(
        count=jnp.zeros([], jnp.int32),
        mu=treedef.unflatten(mus),
        nu=treedef.unflatten(nus))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args  # unused; accepted so that the transform chains like optax's
    leaves, treedef = _tree.flatten_with_paths(updates)
    mus = treedef.flatten_up_to(state.mu)
    nus = treedef.flatten_up_to(state.nu)
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    bc1 = 1.0 - jnp.asarray(b1, jnp.float32) ** t
    bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** t
    new_u, new_mu, new_nu = [], [], []
    for (path, g), mu, nu in zip(leaves, mus, nus):
      ax = leaf_axis(path, g)
      g32 = g.astype(jnp.float32)
      # The update reads the stored (cast) moments, so that the final fused pass
      # consumes the new state instead of recomputing it from the old one (which would
      # make XLA keep a copy of the old state, and re-pool g^2 per element). With
      # float32 state (the default for float32 parameters) the casts are no-ops.
      mu = (b1 * mu.astype(jnp.float32) + (1.0 - b1) * g32).astype(mu.dtype)
      nu32 = (b2 * nu.astype(jnp.float32) + (1.0 - b2) * groupmean(g32 * g32, group_size, ax)
              ).astype(nu.dtype).astype(jnp.float32)
      n = g.shape[ax] if ax is not None else 1
      denom = jnp.sqrt(expand_groups(nu32 / bc2, group_size, ax, n)) + eps
      u = (mu.astype(jnp.float32) / bc1) / denom
      new_u.append(u.astype(g.dtype))
      new_mu.append(mu)
      new_nu.append(nu32.astype(nu.dtype))
    return treedef.unflatten(new_u), GroupedSecondMomentState(
        count=count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = [
    'GroupedSecondMomentState',
    'expand_groups',
    'groupmean',
    'grouped_shape',
    'num_groups',
    'scale_by_grouped_second_moment',
]
