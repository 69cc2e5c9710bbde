"""AdamPM's pooling: `groupmean` over runs of `s` neighbours, `expand_groups` back.

`groupmean_s` averages consecutive runs of `s = group_size` elements along one axis (a
short last group over its real elements, which equals padding it with its own mean);
`expand_s` repeats each group value `s` times and crops to `n`. Also the checks that
groups fit a leaf and its shards (a group never straddles two shards), and the axis
arguments (`axis`, `group_axis`) the estimator and AdamPM take.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


# Stands for "not given" where None is a value that must raise (e.g. `axis=None`).
UNSET: Any = object()


def pooled_axis(axis: Any, group_axis: Any, where: str) -> tuple[Any, str]:
  """AdamPM's pooled axis from `axis=` (its documented keyword, default the last axis)
  or `group_axis=` (the same, as `Tier` and `Grouped` spell it), and the name of the
  argument it came from (for error messages). Both, differing, are an error."""
  if group_axis is None:
    return axis, 'axis'
  # Compared only as Python ints: under `optax.inject_hyperparams` either may be a
  # tracer, which `_checks.check_axis` then reports by its name.
  if (isinstance(axis, int) and isinstance(group_axis, int) and axis != -1
      and axis != group_axis):
    raise TypeError(f'`{where}` got `axis={axis!r}` and `group_axis={group_axis!r}`: they '
                    'name the same option (the axis pooled along); pass one of them.')
  return group_axis, 'group_axis'


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


def array_axis(axis: int, ndim: int) -> int:
  """`axis` of an array with `ndim` dimensions as a non-negative int (checked)."""
  if not -ndim <= axis < ndim:
    raise ValueError(f'`axis`={axis} is out of range for an array with {ndim} dimensions; '
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


# Shardings in types (Explicit meshes) came with `jax.typeof` (jax 0.6); before it no
# array's type names mesh axes, so nothing is Explicit-sharded.
_TYPEOF = getattr(jax, 'typeof', None)


def axis_shards(x: Any, axis: Optional[int]) -> tuple[Any, int]:
  """The Explicit-mesh axes that shard `x` along `axis`, and the number of shards.

  Reads the sharding in `x`'s type (`jax.typeof(x).sharding`), which names mesh axes
  only under an Explicit mesh; under an Auto mesh, `pmap`, inside `shard_map` (local
  shards) or without a mesh it gives `(None, 1)`.
  """
  if axis is None or _TYPEOF is None:
    return None, 1
  sharding = getattr(_TYPEOF(x), 'sharding', None)
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
  if axis is not None:
    check_groups_fit(path, x.shape[axis], group_size, axis, entry, shards)
  return shards


def check_groups_fit(path: str, n: int, group_size: int, axis: int, entry: Any, shards: int
                     ) -> None:
  """Raises if groups of `group_size` along an axis of length `n` straddle its shards."""
  if shards > 1 and group_size > 1 and (n % shards or (n // shards) % group_size):
    shard_len = n // shards
    raise ValueError(
        f'Cannot pool parameter {path} in groups of group_size={group_size} along axis '
        f'{axis}: that axis (length {n}) is sharded over mesh axis {entry!r} into '
        f'{shards} shards of shard length {shard_len}, and a group would straddle two '
        f'shards. Use a group size that divides {shard_len}, pool along an unsharded '
        'axis (`group_axis=`), or shard this axis differently.')


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
    axis: axis to pool along (negative counts from the end), or None for no pooling
      (0-d leaves).

  Returns:
    An array with `axis` shortened to ceil(n / group_size).
  """
  if axis is None or group_size == 1:
    return x
  axis = array_axis(axis, x.ndim)
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
  """Repeats each group value `group_size` times along `axis` (negative counts from the
  end) and crops to `n`."""
  if axis is None or group_size == 1:
    return nu
  axis = array_axis(axis, nu.ndim)
  if axis_shards(nu, axis)[0] is not None:  # named in an Explicit spec, even if 1 shard
    out = _expand_groups_sharded(nu, group_size, axis)
    # A short last group only on one shard (a mesh axis of size 1): whole groups otherwise.
    return out if out.shape[axis] == n else jax.lax.slice_in_dim(out, 0, n, axis=axis)
  # A gather with iota indices fuses into the consumer's loop in XLA, unlike
  # repeat + slice, so the full-size expanded array is never materialised.
  index = jnp.arange(n, dtype=jnp.int32) // group_size
  return jnp.take(nu, index, axis=axis, mode='clip')
