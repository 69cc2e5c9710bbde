"""What `skewadam` gives each parameter, noted while a report traces its `init`.

`skewadam`'s `init` calls `record_tiers`; outside `recording_tiers` (which the reports'
`trace_init` opens) it does nothing. Kept in the transforms layer because `skewadam`
calls it: the reports read the table, they do not reach back into the optimizer.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Mapping, Optional

from skewadam_jax.core import tree as _tree
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.estimators import codec as _codec
from skewadam_jax.structure import axes as _axes
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import warning as _warning
from skewadam_jax.structure import paths as _paths
from skewadam_jax.transforms import per_leaf as _per_leaf
from skewadam_jax.transforms import tier as _tier
from skewadam_jax.transforms import tier_leaf as _tier_leaf


@dataclasses.dataclass(frozen=True)
class TierRecord:
  """What a `skewadam` gives one parameter, as recorded while its `init` was traced."""
  tier: str  # the tier's name
  # The leaf's estimator (after `for_leaf`); None for an integer or boolean leaf, which
  # keeps no state (`per_leaf.trains`).
  estimator: Optional[_second_moment.SecondMoment]
  batch_axes: tuple[int, ...]  # sorted, non-negative
  note: str  # the labeler's note: how structure decided the tier, or why it is a guess
  # The codec its momentum is stored with (bound to the leaf), None for an array.
  codec: Optional[_codec.StateCodec] = None


class TierTable(dict):
  """`{parameter path: TierRecord}`, and whether any `skewadam`'s `init` ran (`seen`):
  a skewadam of an empty params tree records no parameter, yet it is there."""
  seen: bool = False


_TIERS: contextvars.ContextVar[Optional[TierTable]] = contextvars.ContextVar(
    'skewadam_jax_recorded_tiers', default=None)


@contextlib.contextmanager
def recording_tiers() -> Iterator[TierTable]:
  table = TierTable()
  token = _TIERS.set(table)
  try:
    yield table
  finally:
    _TIERS.reset(token)


def record_tiers(params: Any, tiers: Mapping[str, _tier.Tier], param_labels: Any,
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
  table.seen = True
  leaves, treedef = _paths.flatten_with_paths(params)
  axes, _ = _axes.batch_axes_and_notes(params, labels, batch_axes)
  with _warning.silenced():  # the labeler reported once already, in `init`
    _, notes = _labels.labels_and_notes(params, param_labels)
  for (path, p), label, ax, note in zip(leaves, treedef.flatten_up_to(labels), axes, notes):
    p = _tree.abstract_leaf(p)
    if _per_leaf.trains(p):
      estimator = _tier_leaf.leaf_estimator(tuple(p.shape), tiers[label], ax, path)
      codec = _tier_leaf.leaf_codec(tuple(p.shape), tiers[label], ax, path)
    else:
      estimator, codec, note = None, None, (
          f'{p.dtype} leaf: no state, update 0 before weight decay '
          '(as optax.adamw\'s for a zero gradient)')
    table.setdefault(path, TierRecord(label, estimator, tuple(ax), note, codec))
