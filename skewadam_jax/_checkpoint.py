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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from skewadam_jax import _paths

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
    return '/'.join(self.path) or '<root>'

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
  def param(self) -> Optional[str]:
    """The parameter a state leaf belongs to (the path after its field), if any."""
    field = self.field
    if field is None or field[0] + 1 >= len(self.path):
      return None
    return '/'.join(self.path[field[0] + 1:])


def _is_array_like(x: Any) -> bool:
  return hasattr(x, 'shape') and hasattr(x, 'dtype')


def _dtype(x: Any) -> Optional[np.dtype]:
  try:
    return np.dtype(x)
  except TypeError:
    return None


def _leaves(tree: Any) -> dict[tuple[str, ...], _Leaf]:
  """`{path segments: _Leaf}` of every array-like leaf (None and empty nodes dropped)."""
  # Orbax wraps the tree: StepMetadata.item_metadata -> TreeMetadata.tree -> the tree.
  for attr in ('item_metadata', 'tree'):
    if not isinstance(tree, (dict, list, tuple)) and hasattr(tree, attr):
      tree = getattr(tree, attr)
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_array_like)
  out = {}
  for path, leaf in flat:
    segments = _paths.path_segments(path)
    if _is_array_like(leaf):
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
    by_tier.setdefault(leaf.tier, []).append(leaf.field[1])
  parts = []
  for tier, fields in sorted(by_tier.items(), key=lambda kv: str(kv[0])):
    fields = sorted(set(fields), key=STATE_FIELDS.index)
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
    if leaf.shape != saved.shape:
      differs.append(f'shape differs at {leaf.name}: checkpoint {saved.shape}, optimizer '
                     f'{leaf.shape}')
    elif leaf.dtype != saved.dtype:
      differs.append(f'dtype differs at {leaf.name}: checkpoint {saved.dtype}, optimizer '
                     f'{leaf.dtype}')
  lines += _listed(differs)
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
