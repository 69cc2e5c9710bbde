"""Memory accounting from abstract shapes: nothing is allocated.

Every report reads the optimizer that was built, from one abstract trace of its
`init` (`reports.trace.trace_init`): `memory_report` attributes every state leaf that follows
the params to its parameter's tier, and `label_table` shows what a `skewadam` gives
each parameter and what its state costs.

Every array leaf of the state counts, whatever its dtype (quantized statistics, uint8
codes, int8 moments); only step counters (0-d integer or boolean leaves: optax's
`count`, `MultiSteps`' `mini_step`) are set apart, in `MemoryReport.counter_bytes`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax.core import checks as _checks
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import warning as _warning
from skewadam_jax.reports import trace as _trace
from skewadam_jax.core import tree as _tree

GIB = 1024**3


def leaf_bytes(x: Any, floating_only: bool = False) -> int:
  """Bytes of one array-like leaf (array or `jax.ShapeDtypeStruct`) or Python number (a
  0-d array, as optax treats it); 0 otherwise (and for non-float leaves if
  `floating_only`)."""
  x = _tree.abstract_leaf(x)
  if not _tree.is_array_like(x):
    return 0
  dtype = jnp.dtype(x.dtype)
  if floating_only and not jnp.issubdtype(dtype, jnp.inexact):
    return 0
  return int(np.prod(x.shape, dtype=np.int64)) * dtype.itemsize


def is_counter(x: Any) -> bool:
  """Whether a state leaf is a step counter: a 0-d integer or boolean array."""
  x = _tree.abstract_leaf(x)
  if not _tree.is_array_like(x) or tuple(x.shape):
    return False
  dtype = jnp.dtype(x.dtype)
  return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_))


def tree_bytes(tree: Any, floating_only: bool = False) -> int:
  """Total bytes of a pytree of arrays or `jax.ShapeDtypeStruct`s.

  Args:
    tree: any pytree (optimizer state, params, abstract or concrete).
    floating_only: count only floating-point leaves.

  Returns:
    The number of bytes, as a Python int.
  """
  return sum(leaf_bytes(x, floating_only) for x in jax.tree_util.tree_leaves(tree))


def state_bytes(state: Any, floating_only: bool = False, *, counters: bool = False) -> int:
  """Bytes of an optimizer state or abstract state: every array leaf, whatever its dtype.

  Args:
    state: the state (arrays or `jax.ShapeDtypeStruct`s).
    floating_only: count only floating-point leaves (leaving out quantized statistics).
    counters: also count step counters (0-d integer or boolean leaves).

  Returns:
    The number of bytes, as a Python int.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> state = sj.skewadam(1e-3).init({'w': jnp.zeros((3, 4))})
    >>> sj.state_bytes(state)  # momentum [3, 4], rows [3] and columns [4], float32
    76
  """
  return sum(leaf_bytes(x, floating_only) for x in jax.tree_util.tree_leaves(state)
             if counters or not is_counter(x))


def abstract_state(tx: optax.GradientTransformation, params: Any) -> Any:
  """The optimizer state as `jax.ShapeDtypeStruct`s, via `jax.eval_shape`."""
  return jax.eval_shape(tx.init, params)


def optimizer_state_bytes(tx: optax.GradientTransformation, params: Any) -> int:
  """State bytes of `tx` for `params` (abstract or concrete), step counters apart.

  Every array leaf counts, whatever its dtype (`state_bytes`).
  """
  _checks.check_transform_first(tx, params, 'sj.optimizer_state_bytes(tx, params)')
  return state_bytes(abstract_state(tx, params))


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
  """Per-tier parameters and optimizer-state bytes, and the totals.

  `total_state_bytes` counts every array leaf of the state but the step counters,
  whose bytes are `counter_bytes`.
  """
  tiers: tuple[TierMemory, ...]
  total_params: int
  total_param_bytes: int
  total_state_bytes: int
  counter_bytes: int = 0

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


@_warning.reported_once  # labels for the rows and the skewadam's: one warning
def memory_report(tx: Any, params: Any, *, param_labels: Any = None) -> MemoryReport:
  """Per-tier parameter and optimizer-state bytes of `tx` on `params` (eval_shape only).

  Works for any optax optimizer (AdamW, Adafactor, Lion, AdamPM, SkewAdam, ...): each
  state leaf that follows the params is attributed to its parameter's tier as given
  by `param_labels` (default `moe_param_labels`, the same for every optimizer, so that
  reports of two optimizers compare tier by tier); the other leaves (hyperparameters)
  go under `(other)`, step counters apart. What a `skewadam` gives each parameter,
  tier by its own labels, is `label_table(tx, params)`.

  Args:
    tx: the optimizer.
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s.
    param_labels: a label tree or labeler function, to group by other tiers.

  Returns:
    A `MemoryReport`; `.format()` renders it as a markdown table.

  Raises:
    TypeError: if `tx` is not an optimizer (it says so where `tx` and `params` are
      swapped).

  Example:
    >>> import jax, jax.numpy as jnp, skewadam_jax as sj
    >>> params = {'embed': jax.ShapeDtypeStruct((64, 8), jnp.float32)}
    >>> sj.memory_report(sj.skewadam(3e-4), params).total_state_bytes  # mu, rows, cols
    2336
  """
  _checks.check_transform_first(tx, params, 'sj.memory_report(tx, params)')
  trace = _trace.trace_init(tx, params)
  labels = jax.tree_util.tree_structure(params).flatten_up_to(
      _labels.resolve_labels(params, param_labels))
  by_label: dict[Any, int] = {}
  counters = 0
  for s in trace.leaves:
    if is_counter(s.leaf):
      counters += leaf_bytes(s.leaf)
      continue
    label = '(other)' if s.param is None else labels[s.param]
    by_label[label] = by_label.get(label, 0) + leaf_bytes(s.leaf)
  leaves = [_tree.abstract_leaf(p) for p in jax.tree_util.tree_leaves(params)]
  rows = []
  for name in dict.fromkeys(list(labels) + [k for k in by_label if k != '(other)']):
    mine = [p for p, lab in zip(leaves, labels) if lab == name]
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
      total_state_bytes=sum(r.state_bytes for r in rows),
      counter_bytes=counters)


@dataclasses.dataclass(frozen=True)
class LabelTable(collections.abc.Sequence):
  """What a `skewadam` gives every parameter, and what its state costs: `label_table`.

  A sequence of `LeafReport` rows, one per parameter leaf in tree order (iterate, index
  or `len` it as a list); `.format()` renders it as text.
  """
  rows: tuple[_labels.LeafReport, ...]

  def __getitem__(self, index: Any) -> Any:
    return self.rows[index]

  def __len__(self) -> int:
    return len(self.rows)

  def __iter__(self) -> Iterator[_labels.LeafReport]:
    return iter(self.rows)

  @property
  def total_state_bytes(self) -> int:
    """The state bytes of every row."""
    return sum(r.state_bytes for r in self.rows)

  def format(self, title: str = '') -> str:
    """An aligned, readable text table (notes in the last column) and a summary line."""
    header = ('path', 'shape', 'dtype', 'tier', 'batch axes', 'second moment',
              'state bytes', 'note')
    body = [(r.path, 'x'.join(map(str, r.shape)) or '()', r.dtype, r.tier,
             ','.join(map(str, r.batch_axes)) or '-', r.second_moment, f'{r.state_bytes:,}',
             r.note) for r in self.rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = '  '.join(f'{{:{">" if i == 6 else "<"}{w}}}' for i, w in enumerate(widths))
    out = [f'### {title}'] if title else []
    out += [fmt.format(*header).rstrip(), fmt.format(*('-' * w for w in widths))]
    out += [fmt.format(*row).rstrip() for row in body]
    total = self.total_state_bytes
    unsure = sum(r.note.startswith('UNSURE') for r in self.rows)
    out.append(f'{len(self.rows)} leaves, {total:,} B of optimizer state '
               f'({total / GIB:.3f} GiB)'
               + (f'; {unsure} unsure labels (see note)' if unsure else ''))
    return '\n'.join(out)


@_warning.reported_once
def label_table(tx: Any, params: Any) -> LabelTable:
  """Every leaf with its path, shape, tier, batch axes, estimator, state bytes and a note,
  as the `skewadam` in `tx` gives them.

  Read from one abstract trace of `tx.init` (nothing is allocated), so the table shows
  the optimizer that was built: its tiers, labels and batch axes, wherever the
  `skewadam` sits (`optax.chain`, `inject_hyperparams`, `MultiSteps`,
  `apply_if_finite`, `masked`). The note says how structure or axis names decided a
  leaf's tier, or why its label is a guess (what the labeler also warns about). The
  batch axes are the axes its statistics and clip are separate along (the expert axis,
  a scanned layer axis); the other axes form its matrix. A leaf's state bytes are every
  state leaf of `tx` that belongs to it. Leaves a `masked` skewadam does not update have
  tier `-`.

  Args:
    tx: the optimizer; it must contain an `sj.skewadam`.
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s (Flax states too).

  Returns:
    A `LabelTable`: a sequence of `LeafReport`, one per leaf in tree order;
    `.format()` renders it.

  Raises:
    TypeError: if `tx` is not an optimizer (it says so where `tx` and `params` are
      swapped); the tiers, labels and batch axes are `sj.skewadam`'s arguments.
    ValueError: if `tx` contains no `skewadam`.

  Example:
    >>> import jax, jax.numpy as jnp, skewadam_jax as sj
    >>> params = {'moe': {'router': jax.ShapeDtypeStruct((8, 4), jnp.float32),
    ...           'experts': {'w1': jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)}}}
    >>> table = sj.label_table(sj.skewadam(3e-4), params)
    >>> [(r.path, r.tier, r.second_moment, r.state_bytes) for r in table]
    [('moe/experts/w1', 'experts', 'factored', 384), ('moe/router', 'router', 'exact', 128)]
  """
  _checks.check_transform_first(tx, params, 'sj.label_table(tx, params)')
  trace = _trace.trace_init(tx, params, explain=True)
  if not trace.tiers and not trace.has_tiers:
    raise ValueError('`tx` contains no sj.skewadam: `sj.label_table(tx, params)` shows '
                     'what a skewadam gives each parameter. For any optimizer\'s state '
                     'per tier, call `sj.memory_report(tx, params)`.')
  state = [0] * len(trace.paths)
  for s in trace.leaves:
    if s.param is not None and not is_counter(s.leaf):
      state[s.param] += leaf_bytes(s.leaf)
  rows = []
  for i, (path, p) in enumerate(zip(trace.paths, jax.tree.leaves(params))):
    p = _tree.abstract_leaf(p)  # Python scalars: 0-d arrays, as in optax
    got = trace.tiers.get(path)
    rows.append(_labels.LeafReport(
        path=path, shape=tuple(p.shape), dtype=str(jnp.dtype(p.dtype)),
        tier=got.tier if got else '-',
        second_moment=got.estimator.name if got and got.estimator else '-',
        param_bytes=leaf_bytes(p), state_bytes=state[i],
        note=got.reason if got else 'not updated by the skewadam in `tx`',
        batch_axes=got.batch_axes if got else ()))
  return LabelTable(tuple(rows))
