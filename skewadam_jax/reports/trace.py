"""One abstract trace of an optimizer's `init`: its state, and what made each leaf.

The reports (`label_table`, `memory_report`, `state_shardings`) read the optimizer that
was built, not a description of it repeated by hand: `trace_init` runs
`jax.eval_shape(tx.init, params)` once (nothing is allocated), whatever wraps the
optimizer (`optax.chain`, `inject_hyperparams`, `MultiSteps`, `apply_if_finite`,
`masked`), and collects, while `init` runs,

* from every second-moment estimator, which state leaves are the momentum or the
  statistics of which parameter, and how to derive their shardings
  (`estimators.base.record_leaf`);
* from every `skewadam`, what it gives each parameter: its tier, its estimator, its
  batch axes and the labeler's note (`transforms.recording.record_tiers`).

Both recorders do nothing outside a trace. Leaves no estimator recorded (other optax
transforms' state) are matched to their parameter by the state walk (`reports.walk`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax
import optax

from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import paths as _paths
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.transforms import recording as _recording
from skewadam_jax.reports import walk as _walk


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
  # parameter path -> what a skewadam gave it (tiers=True)
  tiers: Mapping[str, _recording.TierRecord]
  # Whether `tx` holds a skewadam (tiers=True), also one that got no parameter.
  has_skewadam: bool = False


def trace_init(tx: optax.GradientTransformation, params: Any, *, tiers: bool = False
               ) -> Trace:
  """`jax.eval_shape(tx.init, params)`, with what made each state leaf (see module doc);
  with `tiers`, also what `skewadam` gives each parameter (`Trace.tiers`; only the label
  table reads it, and it labels the params once more for the notes)."""
  recorded: list[Any] = []
  found = _recording.TierTable()

  def init(p: Any) -> Any:
    table = _recording.TierTable()
    with _second_moment.recording_specs() as entries, (
        _recording.recording_tiers() if tiers else contextlib.nullcontext(table)) as table:
      state = tx.init(p)
    for leaf in jax.tree.leaves(state):
      entry = entries.get(id(leaf))
      recorded.append(entry[1:] if entry is not None and entry[0] is leaf else None)
    found.update(table)
    found.seen = found.seen or getattr(table, 'seen', False)
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
  return Trace(state, tuple(leaves), paths, found, found.seen)
