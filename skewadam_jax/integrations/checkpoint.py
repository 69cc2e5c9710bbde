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

from typing import Any, Optional

from skewadam_jax.integrations import relayout as _relayout
from skewadam_jax.integrations import sealing as _sealing
from skewadam_jax.integrations import saved_tree as _saved


def checkpoint_mismatches(target: Any, metadata: Any, *,
                          description: Optional[dict[str, Any]] = None,
                          saved_description: Optional[dict[str, Any]] = None) -> list[str]:
  """How a checkpoint's tree differs from the restore target's; empty if they match.

  Args:
    target: the tree this run would restore onto, e.g. `{'params': abstract_params,
      'opt_state': jax.eval_shape(tx.init, abstract_params)}` (arrays or
      `jax.ShapeDtypeStruct`s; `sharded_abstract_state` gives the sharded state).
    metadata: the checkpoint's tree of the same items, with leaves that have `shape`
      and `dtype` (Orbax's `ArrayMetadata`) and `None` for empty nodes; Orbax's
      `StepMetadata` and `TreeMetadata` are unwrapped.
    description: `sj.describe_state(tx, params)` of this optimizer, and
    saved_description: the one saved with the checkpoint (`sj.check_checkpoint`):
      with both, each parameter's codec (bits, block size, mapping, fit, rounding, min
      size), estimator options, tier and shape are compared too, which the tree alone
      cannot tell apart (another codec mapping keeps every shape).

  Returns:
    Lines of plain text, most telling first: the optimizer state each side holds
    (its state fields, and tiers where the tree names them) when they differ, then one
    line per parameter whose state differs (the fields each side keeps, the leaves whose
    shape or dtype differ, its codec's or estimator's options), then leaves of no
    parameter on one side only or of another shape or dtype.

  Example:
    >>> import jax, jax.numpy as jnp, skewadam_jax as sj
    >>> params = {'w': jnp.zeros((4, 16))}
    >>> saved = jax.eval_shape(sj.adampm(1e-3, group_size=8).init, params)
    >>> want = jax.eval_shape(sj.adampm(1e-3, group_size=4).init, params)
    >>> sj.checkpoint_mismatches(want, saved)[0]
    'parameter w: shape differs at 0/nu/w: checkpoint (4, 2), optimizer (4, 4)'
  """
  ours, theirs = _saved.leaves_of(target), _saved.leaves_of(metadata)
  lines: list[str] = []
  sig_ours, sig_theirs = _saved.signature(ours), _saved.signature(theirs)
  if sig_ours != sig_theirs:
    lines.append(f'optimizer state type differs: the checkpoint holds {sig_theirs}; '
                 f'this optimizer builds {sig_ours}')

  state_params = dict.fromkeys(x.param for x in [*ours.values(), *theirs.values()]
                               if x.param is not None)

  def owner(leaf: _saved.Leaf) -> Optional[str]:
    """The parameter a leaf belongs to: its state's, or a params leaf's own path."""
    if leaf.param is not None:
      return leaf.param
    for k in range(len(leaf.path)):
      if '/'.join(leaf.path[k:]) in state_params:
        return '/'.join(leaf.path[k:])
    return None

  per_param: dict[str, list[str]] = {}
  param_shape_differs: set[str] = set()
  others: list[str] = []
  only_theirs = [theirs[p] for p in theirs if p not in ours]
  only_ours = [ours[p] for p in ours if p not in theirs]
  # State leaves on one side only, by parameter: its state moved tier or changed fields.
  for param in dict.fromkeys(x.param for x in only_theirs + only_ours if x.param is not None):
    all_ckpt = [x for x in theirs.values() if x.param == param]
    all_opt = [x for x in ours.values() if x.param == param]
    ckpt_in = _saved.placement(all_ckpt) if all_ckpt else 'no tier'
    opt_in = _saved.placement(all_opt) if all_opt else 'no tier'
    if ckpt_in != opt_in:
      per_param.setdefault(param, []).append(
          f'the checkpoint keeps its state in {ckpt_in}, this optimizer in {opt_in}')
    else:  # the same fields under other paths
      per_param.setdefault(param, []).extend(
          [f'only in the checkpoint: {x.name}' for x in only_theirs if x.param == param]
          + [f'only in the optimizer state: {x.name}' for x in only_ours if x.param == param])
  for side, leaves in (('the checkpoint', only_theirs), ('the optimizer state', only_ours)):
    for x in leaves:
      if x.param is None:
        param = owner(x)
        (per_param.setdefault(param, []) if param else others).append(
            f'only in {side}: {x.name}')

  codes_differ: set[str] = set()
  for path, leaf in ours.items():
    saved = theirs.get(path)
    if saved is None:
      continue
    if leaf.shape != saved.shape:
      what = f'shape differs at {leaf.name}: checkpoint {saved.shape}, optimizer {leaf.shape}'
    elif leaf.dtype != saved.dtype:
      what = f'dtype differs at {leaf.name}: checkpoint {saved.dtype}, optimizer {leaf.dtype}'
    else:
      continue
    param = owner(leaf)
    if param is None:
      others.append(what)
      continue
    per_param.setdefault(param, []).append(what)
    if leaf.shape != saved.shape:
      if leaf.coded:
        codes_differ.add(param)
      # The codes keep the parameter's shape but along the packed (last) axis, and a
      # params leaf or an uncoded state leaf is the parameter's shape or follows it.
      if (not leaf.coded or leaf.path[-1] == 'codes') and leaf.shape and saved.shape and (
          len(leaf.shape) != len(saved.shape) or leaf.shape[:-1] != saved.shape[:-1]):
        param_shape_differs.add(param)
      if leaf.param is None:
        param_shape_differs.add(param)

  tree_differs = bool(lines or per_param or others)
  described = (_sealing.description_mismatches(description, saved_description)
               if description is not None and saved_description is not None else None)
  if described is not None:
    for param, what in described.items():
      per_param.setdefault(param, []).extend(what)
  else:  # a hint from the shapes alone: which of the two changed
    for param in codes_differ:
      per_param[param][-1] += (" (the parameter's shape differs)"
                               if param in param_shape_differs else
                               " (the momentum's codec differs: its bits or block size)")
  lines += _saved.listed([f'parameter {param}: ' + '; '.join(what)
                          for param, what in per_param.items()])
  lines += _saved.listed(others)
  if tree_differs and _relayout.same_in_another_layout(target, metadata):
    lines.insert(0, 'the checkpoint holds this state in another layout (the tiers under '
                 '`optax.partition`, or in one state): restore it onto '
                 '`sj.saved_layout_target(target, metadata)` and convert it with '
                 '`sj.relayout_state(restored, target)`')
  return lines


def check_checkpoint_matches(target: Any, metadata: Any, *, source: str = 'the checkpoint',
                             description: Optional[dict[str, Any]] = None,
                             saved_description: Optional[dict[str, Any]] = None) -> None:
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
    description: `sj.describe_state(tx, params)` of this optimizer, and
    saved_description: the checkpoint's (`sj.check_checkpoint(path)` returns it):
      with both, the codecs and estimators are compared too (see
      `checkpoint_mismatches`).

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
  lines = checkpoint_mismatches(target, metadata, description=description,
                                saved_description=saved_description)
  if lines:
    raise ValueError(
        f'{source} does not hold the state this optimizer builds, so it cannot be '
        'restored with it (a partial restore would train from a state it never built); '
        'resume with the optimizer, tier policy, labels and group size that wrote it, '
        'or start a new run in another directory. Differences:\n  - '
        + '\n  - '.join(lines))
