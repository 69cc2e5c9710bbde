"""Does a checkpoint hold the state this optimizer builds? Its tree against the target's.

Orbax restores a checkpoint onto a target (`jax.eval_shape(tx.init, params)` or
`sharded_abstract_state`). When the checkpoint was written by another optimizer, another
tier policy, other labels or another AdamPM group size, the trees differ, and Orbax's
error (a tree-structure mismatch, with a hint to pass `partial_restore=True`) neither
says what differs nor gives the right advice: a partial restore would train from a
state that this optimizer never built.

`checkpoint_mismatches(target, metadata)` compares the two trees leaf by leaf, by
normalised path, shape and dtype, and describes the differences in the optimizer's
terms: the state fields each side holds (SkewAdam's `count, mu, v_row, v_col, v`;
AdamPM's and AdamW's `count, mu, nu`), the fields each parameter's state holds on each
side (and its tier, where the tree names it: a state of tiers composed with
`optax.partition`, as SkewAdam's before it kept one state for every tier), and the
leaves whose shape or dtype differ. `check_checkpoint_matches` raises a ValueError
with that description. Neither reads any array: `metadata` is the checkpoint's
metadata tree (Orbax: `CheckpointManager.item_metadata(step)` or
`StandardCheckpointer().metadata(path)`), whose leaves carry `shape` and `dtype`, and
whose empty nodes (`optax.MaskedNode`, `optax.EmptyState`) are `None`.

The same state can also sit in another layout: the tiers in one state, or under
`optax.partition`. `saved_layout_target` gives the restore target in the checkpoint's
layout (with this run's shardings) and `relayout_state` moves the restored arrays into
the target's, matched by parameter and state field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from skewadam_jax.estimators import codec as _codec
from skewadam_jax.structure import paths as _paths
from skewadam_jax.core import tree as _tree

# Field names of the optimizer states that mark where a parameter's path starts.
STATE_FIELDS = ('count', 'mu', 'nu', 'v', 'v_row', 'v_col')
# How many differences of each kind a message lists before it says "and N more".
MAX_LISTED = 6


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """One array of a tree: its path segments, shape and dtype (None if not an array)."""
  path: tuple[str, ...]
  shape: Optional[tuple[int, ...]]
  dtype: Optional[np.dtype]

  @property
  def name(self) -> str:
    return _paths.join(self.path)

  @property
  def tier(self) -> Optional[str]:
    """The SkewAdam tier (the key under `optax.partition`'s `inner_states`), if any."""
    for i, seg in enumerate(self.path[:-1]):
      if seg == 'inner_states':
        return self.path[i + 1]
    return None

  @property
  def field(self) -> Optional[tuple[int, str]]:
    """`(index, name)` of the last state field in the path (`mu`, `v_row`, ...), if any."""
    for i in range(len(self.path) - 1, -1, -1):
      if self.path[i] in STATE_FIELDS:
        return i, self.path[i]
    return None

  @property
  def coded(self) -> bool:
    """Whether the leaf is an array of a coded momentum (`mu/<param>/codes`, `.../scales`
    of a `Tier(mu_codec=...)`)."""
    field = self.field
    return (field is not None and field[1] == 'mu' and field[0] + 2 < len(self.path)
            and self.path[-1] in _codec.Coded._fields)

  @property
  def field_label(self) -> Optional[str]:
    """The field's name in messages: `mu (coded)` for a coded momentum."""
    field = self.field
    if field is None:
      return None
    return f'{field[1]} (coded)' if self.coded else field[1]

  @property
  def param(self) -> Optional[str]:
    """The parameter a state leaf belongs to (the path after its field, without a coded
    momentum's `codes`/`scales`), if any."""
    field = self.field
    if field is None or field[0] + 1 >= len(self.path):
      return None
    return '/'.join(self.path[field[0] + 1:len(self.path) - int(self.coded)])


def _dtype(x: Any) -> Optional[np.dtype]:
  try:
    return np.dtype(x)
  except TypeError:
    return None


def _unwrap(tree: Any) -> Any:
  """The tree Orbax wraps: StepMetadata.item_metadata -> TreeMetadata.tree -> the tree."""
  for attr in ('item_metadata', 'tree'):
    if not isinstance(tree, (dict, list, tuple)) and hasattr(tree, attr):
      tree = getattr(tree, attr)
  return tree


def _with_segments(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
  """`(path segments, leaf)` of every leaf of the (unwrapped) tree, arrays whole; None
  and empty nodes have no leaves."""
  flat, _ = jax.tree_util.tree_flatten_with_path(_unwrap(tree), is_leaf=_tree.is_array_like)
  return [(_paths.path_segments(path), leaf) for path, leaf in flat]


def _leaves(tree: Any) -> dict[tuple[str, ...], _Leaf]:
  """`{path segments: _Leaf}` of every leaf (None and empty nodes dropped)."""
  out = {}
  for segments, leaf in _with_segments(tree):
    if _tree.is_array_like(leaf):
      out[segments] = _Leaf(segments, tuple(int(n) for n in leaf.shape), _dtype(leaf.dtype))
    else:  # a Python scalar or string saved as is
      out[segments] = _Leaf(segments, None, None)
  return out


def _signature(leaves: dict[tuple[str, ...], _Leaf]) -> str:
  """What kind of optimizer state a tree holds: its tiers and state fields."""
  tiers = sorted({leaf.tier for leaf in leaves.values() if leaf.tier is not None})
  fields = sorted({leaf.field[1] for leaf in leaves.values() if leaf.field is not None},
                  key=STATE_FIELDS.index)
  if not fields:
    return 'no optimizer state fields'
  kind = f'state fields {", ".join(fields)}'
  return f'tiers {", ".join(tiers)}; {kind}' if tiers else kind


def _placement(leaves: list[_Leaf]) -> str:
  """`(v_row, v_col)`, or `tier 'experts' (v_row, v_col)` in a state of tiers composed
  with `optax.partition`: what one parameter's state holds, and where."""
  by_tier: dict[Optional[str], list[str]] = {}
  for leaf in leaves:
    by_tier.setdefault(leaf.tier, []).append(leaf.field_label)
  parts = []
  for tier, fields in sorted(by_tier.items(), key=lambda kv: str(kv[0])):
    fields = sorted(set(fields), key=lambda f: (STATE_FIELDS.index(f.split()[0]), f))
    where = f'tier {tier!r} ' if tier is not None else ''
    parts.append(f'{where}({", ".join(fields)})')
  return ' and '.join(parts)


def _listed(lines: list[str]) -> list[str]:
  """At most MAX_LISTED lines, then a count of the rest."""
  if len(lines) <= MAX_LISTED:
    return lines
  return lines[:MAX_LISTED] + [f'... and {len(lines) - MAX_LISTED} more']


def checkpoint_mismatches(target: Any, metadata: Any) -> list[str]:
  """How a checkpoint's tree differs from the restore target's; empty if they match.

  Args:
    target: the tree this run would restore onto, e.g. `{'params': abstract_params,
      'opt_state': jax.eval_shape(tx.init, abstract_params)}` (arrays or
      `jax.ShapeDtypeStruct`s; `sharded_abstract_state` gives the sharded state).
    metadata: the checkpoint's tree of the same items, with leaves that have `shape`
      and `dtype` (Orbax's `ArrayMetadata`) and `None` for empty nodes; Orbax's
      `StepMetadata` and `TreeMetadata` are unwrapped.

  Returns:
    Lines of plain text, most telling first: the optimizer state each side holds
    (its state fields, and tiers where the tree names them) when they differ, the
    fields of each parameter whose state changed, leaves only on one side, and leaves
    whose shape or dtype differ.

  Example:
    >>> import jax, jax.numpy as jnp, skewadam_jax as sj
    >>> params = {'w': jnp.zeros((4, 16))}
    >>> saved = jax.eval_shape(sj.adampm(1e-3, group_size=8).init, params)
    >>> want = jax.eval_shape(sj.adampm(1e-3, group_size=4).init, params)
    >>> sj.checkpoint_mismatches(want, saved)[0]
    'shape differs at 0/nu/w: checkpoint (4, 2), optimizer (4, 4)'
  """
  ours, theirs = _leaves(target), _leaves(metadata)
  lines: list[str] = []
  sig_ours, sig_theirs = _signature(ours), _signature(theirs)
  if sig_ours != sig_theirs:
    lines.append(f'optimizer state type differs: the checkpoint holds {sig_theirs}; '
                 f'this optimizer builds {sig_ours}')

  only_theirs = [theirs[p] for p in theirs if p not in ours]
  only_ours = [ours[p] for p in ours if p not in theirs]
  # State leaves on one side only, by parameter: its state moved tier or changed fields.
  moved = dict.fromkeys(x.param for x in only_theirs + only_ours if x.param is not None)
  placements = []
  for param in moved:
    all_ckpt = [x for x in theirs.values() if x.param == param]
    all_opt = [x for x in ours.values() if x.param == param]
    placements.append(
        f'parameter {param}: the checkpoint keeps its state in '
        f'{_placement(all_ckpt) if all_ckpt else "no tier"}, this optimizer in '
        f'{_placement(all_opt) if all_opt else "no tier"}')
  lines += _listed(placements)
  other_theirs = [x.name for x in only_theirs if x.param is None]
  other_ours = [x.name for x in only_ours if x.param is None]
  lines += _listed([f'only in the checkpoint: {name}' for name in other_theirs])
  lines += _listed([f'only in the optimizer state: {name}' for name in other_ours])

  differs = []
  for path, leaf in ours.items():
    saved = theirs.get(path)
    if saved is None:
      continue
    # A coded momentum's shapes change with the codec's bits or block size.
    codec = (' (the momentum\'s codec differs: its bits or block size)' if leaf.coded
             else '')
    if leaf.shape != saved.shape:
      differs.append(f'shape differs at {leaf.name}: checkpoint {saved.shape}, optimizer '
                     f'{leaf.shape}{codec}')
    elif leaf.dtype != saved.dtype:
      differs.append(f'dtype differs at {leaf.name}: checkpoint {saved.dtype}, optimizer '
                     f'{leaf.dtype}{codec}')
  lines += _listed(differs)
  if lines and _same_in_another_layout(target, metadata):
    lines.insert(0, 'the checkpoint holds this state in another layout (the tiers under '
                 '`optax.partition`, or in one state): restore it onto '
                 '`sj.saved_layout_target(target, metadata)` and convert it with '
                 '`sj.relayout_state(restored, target)`')
  return lines


def check_checkpoint_matches(target: Any, metadata: Any, *, source: str = 'the checkpoint'
                             ) -> None:
  """Raises a ValueError naming what differs unless `metadata` matches `target`.

  Call it before `restore`: it turns a checkpoint written by another optimizer (or
  tier policy, labels, group size, state dtype) into an error that says which, rather
  than Orbax's tree-structure error and its `partial_restore=True` hint.

  Args:
    target: the restore target (see `checkpoint_mismatches`).
    metadata: the checkpoint's metadata tree (see `checkpoint_mismatches`).
    source: how the message names the checkpoint, e.g. `'checkpoint step 40 in runs/x'`.

  Raises:
    ValueError: listing the state type, tiers, parameter paths, shapes and dtypes that
      differ.

  Example:
    >>> import orbax.checkpoint as ocp  # doctest: +SKIP
    >>> target = {'params': abstract_params,  # doctest: +SKIP
    ...           'opt_state': sj.sharded_abstract_state(tx, abstract_params, shardings)}
    >>> sj.check_checkpoint_matches(target, ocp.StandardCheckpointer().metadata(path))
    ... # doctest: +SKIP
  """
  lines = checkpoint_mismatches(target, metadata)
  if lines:
    raise ValueError(
        f'{source} does not hold the state this optimizer builds, so it cannot be '
        'restored with it (a partial restore would train from a state it never built); '
        'resume with the optimizer, tier policy, labels and group size that wrote it, '
        'or start a new run in another directory. Differences:\n  - '
        + '\n  - '.join(lines))


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
  for segments, leaf in _with_segments(tree):
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
      shape, dtype = tuple(int(n) for n in leaf.shape), _dtype(leaf.dtype)
      if shape != tuple(want.shape) or dtype != _dtype(want.dtype):
        where = '' if segments == mine[0][0] else f' at {_paths.join(segments)}'
        problems.append(f'{name}: the checkpoint has {shape} {dtype}{where}, this '
                        f'optimizer {tuple(want.shape)} {_dtype(want.dtype)}')
  problems += [f'{_paths.join(leaves[0][0])}: only in the checkpoint'
               for key, leaves in theirs.items() if key not in ours]
  if problems:
    raise ValueError(
        f'`{call}`: the checkpoint does not hold this state in another layout (the same '
        'arrays per parameter and state field, with the tiers in one state or under '
        '`optax.partition`), so it cannot be converted:\n  - '
        + '\n  - '.join(_listed(problems)))
  return {key: theirs[key] for key in ours}


def _same_in_another_layout(target: Any, metadata: Any) -> bool:
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

  return jax.tree_util.tree_map_with_path(leaf, _unwrap(metadata), is_leaf=_tree.is_array_like)


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
