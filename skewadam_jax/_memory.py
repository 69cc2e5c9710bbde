"""Memory accounting from abstract shapes: nothing is allocated.

State bytes come from `jax.eval_shape(tx.init, abstract_params)`; per-tier figures
attribute every state leaf that follows the params' tree to its parameter's tier.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax import _axes
from skewadam_jax import _checks
from skewadam_jax import _flax
from skewadam_jax import _hidden
from skewadam_jax import _labels
from skewadam_jax import _paths
from skewadam_jax import _tiered
from skewadam_jax import _tree

GIB = 1024**3


def leaf_bytes(x: Any, floating_only: bool = True) -> int:
  """Bytes of one array-like leaf (array or `jax.ShapeDtypeStruct`) or Python number (a
  0-d array, as optax treats it); 0 otherwise."""
  x = _tree.abstract_leaf(x)
  if not (hasattr(x, 'shape') and hasattr(x, 'dtype')):
    return 0
  dtype = jnp.dtype(x.dtype)
  if floating_only and not jnp.issubdtype(dtype, jnp.inexact):
    return 0
  return int(np.prod(x.shape, dtype=np.int64)) * dtype.itemsize


def tree_bytes(tree: Any, floating_only: bool = True) -> int:
  """Total bytes of a pytree of arrays or `jax.ShapeDtypeStruct`s.

  Args:
    tree: any pytree (optimizer state, params, abstract or concrete).
    floating_only: count only floating-point leaves (skips int step counters).

  Returns:
    The number of bytes, as a Python int.
  """
  return sum(leaf_bytes(x, floating_only) for x in jax.tree_util.tree_leaves(tree))


def state_bytes(state: Any, floating_only: bool = True) -> int:
  """Bytes of an optimizer state or abstract state (floating-point leaves only)."""
  return tree_bytes(state, floating_only)


def abstract_state(tx: optax.GradientTransformation, params: Any) -> Any:
  """The optimizer state as `jax.ShapeDtypeStruct`s, via `jax.eval_shape`."""
  return jax.eval_shape(tx.init, params)


def optimizer_state_bytes(tx: optax.GradientTransformation, params: Any) -> int:
  """Floating-point state bytes of `tx` for `params` (abstract or concrete)."""
  _checks.check_transform(tx, params, 'sj.optimizer_state_bytes(tx, params)')
  return state_bytes(abstract_state(tx, params))


def _children(node: Any) -> list[Any]:
  """The immediate pytree children of `node` (empty for a leaf)."""
  children, _ = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
  return [] if len(children) == 1 and children[0] is node else children


def _attribute(node: Any, params_def: Any, labels: list[str], totals: dict[str, int]
               ) -> None:
  """Adds the bytes of `node`'s leaves to `totals`, per tier where they follow params."""
  try:
    subtrees = params_def.flatten_up_to(node)
  except (ValueError, TypeError):
    subtrees = None
  if subtrees is not None:
    for label, sub in zip(labels, subtrees):
      totals[label] = totals.get(label, 0) + tree_bytes(sub)
    return
  children = _children(node)
  if not children:
    totals['(other)'] = totals.get('(other)', 0) + tree_bytes(node)
    return
  for child in children:
    _attribute(child, params_def, labels, totals)


def state_bytes_by_label(state: Any, params: Any, labels: Any) -> dict[str, int]:
  """Floating state bytes per label, for every state subtree that follows `params`.

  State leaves outside params-shaped subtrees (step counts, injected hyperparameters)
  go under `'(other)'`.
  """
  params_def = jax.tree_util.tree_structure(params)
  flat_labels = params_def.flatten_up_to(labels)
  # Boxes of reduced statistics name other axes than their parameter's (their metadata
  # is part of the treedef), so both are compared unboxed.
  params_def = jax.tree_util.tree_structure(_flax.unbox(params))
  totals: dict[str, int] = {}
  _attribute(_flax.unbox(state), params_def, flat_labels, totals)
  return totals


@dataclasses.dataclass(frozen=True)
class TierMemory:
  """Parameters and optimizer state of one tier."""
  tier: str
  leaves: int
  params: int
  param_bytes: int
  state_bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per-tier parameters and optimizer-state bytes, and the totals."""
  tiers: tuple[TierMemory, ...]
  total_params: int
  total_param_bytes: int
  total_state_bytes: int

  def format(self, title: str = '') -> str:
    """A markdown table of the report."""
    lines = [f'### {title}'] if title else []
    lines += ['| tier | leaves | params | param bytes | state bytes | state GiB |',
              '|---|---:|---:|---:|---:|---:|']
    for t in self.tiers:
      lines.append(f'| {t.tier} | {t.leaves} | {t.params:,} | {t.param_bytes:,} | '
                   f'{t.state_bytes:,} | {t.state_bytes / GIB:.3f} |')
    lines.append(f'| **total** | {sum(t.leaves for t in self.tiers)} | '
                 f'{self.total_params:,} | {self.total_param_bytes:,} | '
                 f'{self.total_state_bytes:,} | {self.total_state_bytes / GIB:.3f} |')
    return '\n'.join(lines)


def memory_report(params: Any, tx: optax.GradientTransformation, *,
                  param_labels: Any = None) -> MemoryReport:
  """Per-tier parameter and optimizer-state bytes of `tx` on `params` (eval_shape only).

  Works for any optax optimizer whose state follows the params' tree (AdamW,
  Adafactor, Lion, AdamPM, SkewAdam, ...): each state leaf is attributed to its
  parameter's tier as given by `param_labels` (default `moe_param_labels`).

  Args:
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s.
    tx: the optimizer.
    param_labels: a label tree or labeler function; default `moe_param_labels`.

  Returns:
    A `MemoryReport`; `.format()` renders it as a markdown table.
  """
  _checks.check_transform(tx, params, 'sj.memory_report(params, tx)')
  labels = _labels.resolve_labels(params, param_labels)
  flat_labels = jax.tree_util.tree_structure(params).flatten_up_to(labels)
  by_label = state_bytes_by_label(abstract_state(tx, params), params, labels)
  leaves = [_tree.abstract_leaf(p) for p in jax.tree_util.tree_leaves(params)]
  rows = []
  for name in dict.fromkeys(list(flat_labels) + [k for k in by_label if k != '(other)']):
    mine = [p for p, lab in zip(leaves, flat_labels) if lab == name]
    rows.append(TierMemory(
        tier=name, leaves=len(mine),
        params=sum(int(np.prod(p.shape, dtype=np.int64)) for p in mine),
        param_bytes=sum(leaf_bytes(p) for p in mine),
        state_bytes=by_label.get(name, 0)))
  if by_label.get('(other)', 0):
    rows.append(TierMemory('(other)', 0, 0, 0, by_label['(other)']))
  return MemoryReport(
      tiers=tuple(rows),
      total_params=sum(r.params for r in rows),
      total_param_bytes=sum(r.param_bytes for r in rows),
      total_state_bytes=sum(r.state_bytes for r in rows))


def label_table(params: Any, tiers: Optional[Mapping[str, _tiered.Tier]] = None,
                param_labels: Any = None, batch_axes: Any = None
                ) -> list[_labels.LeafReport]:
  """Every leaf with its path, shape, tier, batch axes, estimator, state bytes and a note.

  The note says how structure or axis names decided a leaf's tier, or why its label is
  a guess (what the labeler also warns about), so unsure leaves show up in the table.
  The batch axes are the axes its statistics and clip are separate along (the expert
  axis, a scanned layer axis); the other axes form its matrix.

  Args:
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s (Flax states too).
    tiers: tier name -> `Tier`; default `PUBLISHED_TIERS`.
    param_labels: a label tree or labeler function; default `moe_param_labels`
      (`hidden_param_labels` when `tiers` has a `'hidden'` tier, as in `skewadam`).
    batch_axes: a tree of int tuples or a function returning one, as in `skewadam`;
      default `moe_batch_axes`.

  Returns:
    A list of `LeafReport`, one per leaf, in tree order.
  """
  tiers = _tiered.check_tiers(tiers)
  labels, notes = _labels.labels_and_notes(params, param_labels)
  if param_labels is None and _hidden.HIDDEN_TIER in tiers:
    labels = _hidden.hidden_param_labels(params, labels)
  labels = _labels.expand_labels(params, labels, tiers)
  leaves, treedef = _paths.flatten_with_paths(params)
  axes, _ = _axes.batch_axes_and_notes(params, labels, batch_axes)
  rows = []
  for (path, p), label, note, ax in zip(leaves, treedef.flatten_up_to(labels), notes, axes):
    tier = tiers[label]
    abstract = p = _tree.abstract_leaf(p)  # Python scalars: 0-d arrays, as in optax
    state = jax.eval_shape(
        lambda a, tier=tier, path=path, ax=ax: _tiered.init_leaf(tier, path, a, ax), abstract)
    rows.append(_labels.LeafReport(
        path=path, shape=tuple(p.shape), dtype=str(jnp.dtype(p.dtype)), tier=label,
        second_moment=_tiered.leaf_estimator(tuple(p.shape), tier, ax, path).name,
        param_bytes=leaf_bytes(p), state_bytes=state_bytes(state), note=note,
        batch_axes=tuple(ax)))
  return rows


def format_label_table(rows: list[_labels.LeafReport]) -> str:
  """`label_table` rows as an aligned, readable text table (notes in the last column)."""
  header = ('path', 'shape', 'dtype', 'tier', 'batch axes', 'second moment', 'state bytes',
            'note')
  body = [(r.path, 'x'.join(map(str, r.shape)) or '()', r.dtype, r.tier,
           ','.join(map(str, r.batch_axes)) or '-', r.second_moment, f'{r.state_bytes:,}',
           r.note) for r in rows]
  widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
  fmt = '  '.join(f'{{:{">" if i == 6 else "<"}{w}}}' for i, w in enumerate(widths))
  out = [fmt.format(*header).rstrip(), fmt.format(*('-' * w for w in widths))]
  out += [fmt.format(*row).rstrip() for row in body]
  total = sum(r.state_bytes for r in rows)
  unsure = sum(r.note.startswith('UNSURE') for r in rows)
  out.append(f'{len(rows)} leaves, {total:,} B of optimizer state ({total / GIB:.3f} GiB)'
             + (f'; {unsure} unsure labels (see note)' if unsure else ''))
  return '\n'.join(out)
