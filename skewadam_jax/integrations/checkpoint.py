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

The same state can also sit in another layout (the tiers in one state, or under
`optax.partition`): `relayout` converts it.
"""

from __future__ import annotations

from typing import Any


from skewadam_jax.integrations import relayout as _relayout
from skewadam_jax.integrations import saved_tree as _saved


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
  ours, theirs = _saved.leaves_of(target), _saved.leaves_of(metadata)
  lines: list[str] = []
  sig_ours, sig_theirs = _saved.signature(ours), _saved.signature(theirs)
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
        f'{_saved.placement(all_ckpt) if all_ckpt else "no tier"}, this optimizer in '
        f'{_saved.placement(all_opt) if all_opt else "no tier"}')
  lines += _saved.listed(placements)
  other_theirs = [x.name for x in only_theirs if x.param is None]
  other_ours = [x.name for x in only_ours if x.param is None]
  lines += _saved.listed([f'only in the checkpoint: {name}' for name in other_theirs])
  lines += _saved.listed([f'only in the optimizer state: {name}' for name in other_ours])

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
  lines += _saved.listed(differs)
  if lines and _relayout.same_in_another_layout(target, metadata):
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
  than Orbax's tree-structure error and its `partial_restore=True` hint, or, where a
  state slot is `None` on one side and an array on the other (a tier that keeps other
  slots), rather than Orbax's silent restore (the checkpoint's array dropped, or `None`
  where the optimizer wants an array).

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
