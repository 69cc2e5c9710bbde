"""One abstract trace of an optimizer's `init`: its state, and what made each leaf.

The reports (`label_table`, `memory_report`, `state_shardings`) read the optimizer that
was built, not a description of it repeated by hand: `trace_init` runs
`jax.eval_shape(tx.init, params)` once (nothing is allocated), whatever wraps the
optimizer (`optax.chain`, `inject_hyperparams`, `MultiSteps`, `apply_if_finite`,
`masked`), and collects, while `init` runs,

* from every second-moment estimator, which state leaves are the momentum or the
  statistics of which parameter, and how to derive their shardings
  (`_second_moment.record_leaf`);
* from every `skewadam`, what it gives each parameter: its tier, its estimator, its
  batch axes and the labeler's note (`record_tiers`).

Both recorders do nothing outside a trace. Leaves no estimator recorded (other optax
transforms' state) are matched to their parameter by the state walk (`_walk`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import optax

from skewadam_jax.structure import axes as _axes
from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import paths as _paths
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.transforms import tiers as _tiered
from skewadam_jax.core import tree as _tree
from skewadam_jax.reports import walk as _walk


@dataclasses.dataclass(frozen=True)
class TierRecord:
  """What a `skewadam` gives one parameter, as recorded while its `init` was traced."""
  tier: str  # the tier's name
  estimator: _second_moment.SecondMoment  # the leaf's estimator (after `for_leaf`)
  batch_axes: tuple[int, ...]  # sorted, non-negative
  note: str  # the labeler's note: how structure decided the tier, or why it is a guess


@dataclasses.dataclass(frozen=True)
class StateLeaf:
  """One leaf of the traced state."""
  leaf: jax.ShapeDtypeStruct
  param: Optional[int]  # index of the parameter leaf it belongs to; None: bookkeeping
  # (index in its statistic's pytree, spec function) if an estimator recorded it.
  recorded: Optional[tuple[int, Callable[..., Any]]]


@dataclasses.dataclass(frozen=True)
class Trace:
  """The abstract state of `tx.init(params)` and what made each of its leaves."""
  state: Any  # the abstract state (`jax.ShapeDtypeStruct` leaves, Flax boxes kept)
  leaves: tuple[StateLeaf, ...]  # one per leaf of `state`, in `jax.tree.leaves` order
  paths: tuple[str, ...]  # the parameters' normalised paths, in flattening order
  tiers: Mapping[str, TierRecord]  # parameter path -> what a skewadam gave it (tiers=True)


_TIERS: contextvars.ContextVar[Optional[dict[str, TierRecord]]] = contextvars.ContextVar(
    'skewadam_jax_recorded_tiers', default=None)


@contextlib.contextmanager
def _recording_tiers() -> Iterator[dict[str, TierRecord]]:
  table: dict[str, TierRecord] = {}
  token = _TIERS.set(table)
  try:
    yield table
  finally:
    _TIERS.reset(token)


def record_tiers(params: Any, tiers: Mapping[str, _tiered.Tier], param_labels: Any,
                 labels: Any, batch_axes: Any) -> None:
  """Notes what `skewadam` gives each parameter, while `trace_init` runs (else nothing).

  Args:
    params: the params `skewadam`'s `init` labels (tracers, boxed or not).
    tiers: its tiers.
    param_labels: its `param_labels` argument (the labeler whose notes to keep).
    labels: the full label tree it uses.
    batch_axes: the batch-axes tree it uses.
  """
  table = _TIERS.get()
  if table is None:
    return
  leaves, treedef = _paths.flatten_with_paths(params)
  axes, _ = _axes.batch_axes_and_notes(params, labels, batch_axes)
  with warnings.catch_warnings():  # the labeler warned once already, in `init`
    warnings.simplefilter('ignore', _labels.UnsureLabelWarning)
    _, notes = _labels.labels_and_notes(params, param_labels)
  for (path, p), label, ax, note in zip(leaves, treedef.flatten_up_to(labels), axes, notes):
    shape = tuple(_tree.abstract_leaf(p).shape)
    estimator = _tiered.leaf_estimator(shape, tiers[label], ax, path)
    table.setdefault(path, TierRecord(label, estimator, tuple(ax), note))


def trace_init(tx: optax.GradientTransformation, params: Any, *, tiers: bool = False
               ) -> Trace:
  """`jax.eval_shape(tx.init, params)`, with what made each state leaf (see module doc);
  with `tiers`, also what `skewadam` gives each parameter (`Trace.tiers`; only the label
  table reads it, and it labels the params once more for the notes)."""
  recorded: list[Any] = []
  found: dict[str, TierRecord] = {}

  def init(p: Any) -> Any:
    table: dict[str, TierRecord] = {}
    with _second_moment.recording_specs() as entries, (
        _recording_tiers() if tiers else contextlib.nullcontext(table)) as table:
      state = tx.init(p)
    for leaf in jax.tree.leaves(state):
      entry = entries.get(id(leaf))
      recorded.append(entry[1:] if entry is not None and entry[0] is leaf else None)
    found.update(table)
    return state

  state = jax.eval_shape(init, params)
  paths = tuple(path for path, _ in _paths.flatten_with_paths(params)[0])
  index = {path: i for i, path in enumerate(paths)}
  walked = _walk.param_of_leaves(_flax.unbox(state), _flax.unbox(params))
  leaves = []
  for leaf, entry, param in zip(jax.tree.leaves(state), recorded, walked):
    if entry is not None and entry[0] in index:  # the estimator knows its parameter
      leaves.append(StateLeaf(leaf, index[entry[0]], (entry[1], entry[2])))
    else:
      leaves.append(StateLeaf(leaf, param, None))
  return Trace(state, tuple(leaves), paths, found)
