"""The same optimizer state in another layout: the tiers in one state or under `optax.partition`.

`saved_layout_target` gives the restore target in the checkpoint's layout (with this
run's shardings) and `relayout_state` moves the restored arrays into the target's,
matched by parameter and state field.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from skewadam_jax.structure import paths as _paths
from skewadam_jax.core import tree as _tree
from skewadam_jax.integrations import saved_tree as _saved


# ------------------------------------------------------------------------ another layout
#
# The same state can sit in two layouts: one `TieredAdamState` for every tier (what
# `skewadam` builds), or one state per tier under `optax.partition` (what SkewAdam built
# before, and what users who compose `scale_by_tiered_adam` per tier build). A parameter's
# arrays are the same in both; only the tier's place in the tree differs
# (`.../inner_states/<tier>/inner_state/mu/<param>` against `.../mu/<param>`), and the
# step count is kept once per tier in a partition (equal in every tier: each counts every
# step) and once in the one state.


def _layout_key(segments: tuple[str, ...]) -> tuple[str, ...]:
  """`segments` without the tier's place in a partition: `inner_states`, the tier and
  `optax.masked`'s `inner_state`."""
  out, i = [], 0
  while i < len(segments):
    if segments[i] == 'inner_states' and i + 1 < len(segments):
      i += 2
      if i < len(segments) and segments[i] == 'inner_state':
        i += 1
      continue
    out.append(segments[i])
    i += 1
  return tuple(out)


def _by_layout_key(tree: Any) -> dict[tuple[str, ...], list[tuple[tuple[str, ...], Any]]]:
  """`{layout key: [(segments, leaf), ...]}` of every array-like leaf of `tree`."""
  out: dict[tuple[str, ...], list[tuple[tuple[str, ...], Any]]] = {}
  for segments, leaf in _saved.with_segments(tree):
    if _tree.is_array_like(leaf):
      out.setdefault(_layout_key(segments), []).append((segments, leaf))
  return out


def _layout_pairs(target: Any, saved: Any, call: str) -> dict[tuple[str, ...], Any]:
  """`{layout key: the saved leaves}` for every array leaf of `target`, checked: each has
  a saved leaf of its shape and dtype, and every saved leaf has a place in `target`."""
  ours, theirs = _by_layout_key(target), _by_layout_key(saved)
  problems = []
  for key, mine in ours.items():
    (_, want), name = mine[0], _paths.join(mine[0][0])
    got = theirs.get(key)
    if got is None:
      problems.append(f'{name}: not in the checkpoint')
      continue
    for segments, leaf in got:
      shape, dtype = tuple(int(n) for n in leaf.shape), _saved.dtype_of(leaf.dtype)
      if shape != tuple(want.shape) or dtype != _saved.dtype_of(want.dtype):
        where = '' if segments == mine[0][0] else f' at {_paths.join(segments)}'
        problems.append(f'{name}: the checkpoint has {shape} {dtype}{where}, this '
                        f'optimizer {tuple(want.shape)} {_saved.dtype_of(want.dtype)}')
  problems += [f'{_paths.join(leaves[0][0])}: only in the checkpoint'
               for key, leaves in theirs.items() if key not in ours]
  if problems:
    raise ValueError(
        f'`{call}`: the checkpoint does not hold this state in another layout (the same '
        'arrays per parameter and state field, with the tiers in one state or under '
        '`optax.partition`), so it cannot be converted:\n  - '
        + '\n  - '.join(_saved.listed(problems)))
  return {key: theirs[key] for key in ours}


def same_in_another_layout(target: Any, metadata: Any) -> bool:
  try:
    _layout_pairs(target, metadata, '')
  except ValueError:
    return False
  return True


def saved_layout_target(target: Any, metadata: Any) -> Any:
  """The restore target in the layout a checkpoint was written in.

  A checkpoint of the same optimizer state in another layout (SkewAdam's tiers under
  `optax.partition`, as it kept them before it kept one state for every tier, or the
  other way round) cannot be restored onto `target` directly. This gives a target with
  the checkpoint's tree, whose leaves have `target`'s shapes, dtypes and shardings, so
  each process restores only its shards; `relayout_state` then moves the restored
  arrays into `target`'s layout. Nothing is read but the metadata.

  Args:
    target: the tree this run restores onto (arrays or `jax.ShapeDtypeStruct`s, with
      shardings where they should land, e.g. from `sharded_abstract_state`).
    metadata: the checkpoint's metadata tree (Orbax's `StepMetadata` and
      `TreeMetadata` are unwrapped).

  Returns:
    The checkpoint's tree with a `jax.ShapeDtypeStruct` (with the sharding of the
    matching leaf of `target`, if it has one) for each array and `None` elsewhere.

  Raises:
    ValueError: naming each leaf that is not the same state in another layout.

  Example:
    >>> import jax, jax.numpy as jnp, optax, skewadam_jax as sj
    >>> params = {'moe': {'router': jnp.zeros((8, 4)), 'experts': jnp.zeros((4, 8, 16))}}
    >>> labels = sj.moe_param_labels(params)
    >>> before = optax.partition({n: sj.scale_by_tiered_adam(tier=t)
    ...                           for n, t in sj.PUBLISHED_TIERS.items()}, labels)
    >>> saved = jax.eval_shape(before.init, params)
    >>> target = jax.eval_shape(sj.scale_by_tiers(sj.PUBLISHED_TIERS, labels).init, params)
    >>> restore_onto = sj.saved_layout_target(target, saved)
    >>> restore_onto.inner_states['experts'].inner_state.v_row['moe']['experts'].shape
    (4, 8)
  """
  pairs = _layout_pairs(target, metadata, 'sj.saved_layout_target(target, metadata)')
  ours = _by_layout_key(target)
  by_segments = {segments: ours[key][0][1] for key, leaves in pairs.items()
                 for segments, _ in leaves}

  def leaf(path: Any, x: Any) -> Any:
    if not _tree.is_array_like(x):
      return None
    want = by_segments[_paths.path_segments(path)]
    return jax.ShapeDtypeStruct(tuple(want.shape), want.dtype,
                                sharding=getattr(want, 'sharding', None))

  return jax.tree_util.tree_map_with_path(leaf, _saved.unwrap(metadata),
                                          is_leaf=_tree.is_array_like)


def relayout_state(restored: Any, target: Any) -> Any:
  """A restored state's arrays in `target`'s tree: the same state in another layout.

  Matches each array of `target` with the restored array of the same parameter and
  state field, wherever the tiers sit (one `TieredAdamState` for every tier, or one
  state per tier under `optax.partition`); the step count, kept once per tier in a
  partition, must be equal in every tier. Arrays are moved, never cast or reshaped:
  a shape or dtype that differs is an error, as is a restored array with no place in
  `target`. Restore the checkpoint as it was written (`ocp.StandardCheckpointer()
  .restore(path)`, or onto `saved_layout_target(target, metadata)` to keep the
  shardings), then call this.

  Args:
    restored: the restored tree (nested dicts and lists as Orbax restores without a
      target, or the state itself).
    target: the tree to fill (arrays or `jax.ShapeDtypeStruct`s); an array lands on
      the sharding of its target leaf where that has one.

  Returns:
    A tree with `target`'s structure holding the restored arrays.

  Raises:
    ValueError: naming each leaf that is not the same state in another layout, or a
      step count that differs between tiers.

  Example:
    >>> import jax, jax.numpy as jnp, optax, skewadam_jax as sj
    >>> w = {'emb': jnp.ones((16, 8)), 'moe': {'router': jnp.ones((8, 4))}}
    >>> labels = {'emb': 'backbone', 'moe': {'router': 'router'}}
    >>> one = sj.scale_by_tiers(sj.PUBLISHED_TIERS, labels)  # one state for every tier
    >>> _, saved = one.update(w, one.init(w), w)
    >>> per_tier = optax.partition({n: sj.scale_by_tiered_adam(tier=sj.PUBLISHED_TIERS[n])
    ...                             for n in ('backbone', 'router')}, labels)
    >>> state = sj.relayout_state(saved, jax.eval_shape(per_tier.init, w))
    >>> {n: int(s.inner_state.count) for n, s in state.inner_states.items()}
    {'backbone': 1, 'router': 1}
  """
  pairs = _layout_pairs(target, restored, 'sj.relayout_state(restored, target)')
  values = {}
  for key, leaves in pairs.items():
    first = np.asarray(jax.device_get(leaves[0][1]))
    for segments, other in leaves[1:]:  # a step count kept once per tier
      if not np.array_equal(first, np.asarray(jax.device_get(other))):
        raise ValueError(
            f'`sj.relayout_state(restored, target)`: {_paths.join(leaves[0][0])} and '
            f'{_paths.join(segments)} are one value of the state (kept once per tier) '
            'but differ, so the checkpoint was not written by one optimizer.')
    values[key] = leaves[0][1]

  def leaf(path: Any, want: Any) -> Any:
    if not _tree.is_array_like(want):
      return want
    x = values[_layout_key(_paths.path_segments(path))]
    sharding = getattr(want, 'sharding', None)
    return jax.device_put(x, sharding) if sharding is not None else jax.device_put(x)

  return jax.tree_util.tree_map_with_path(leaf, target, is_leaf=_tree.is_array_like)
