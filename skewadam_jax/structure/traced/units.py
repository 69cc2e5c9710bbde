"""Units joined along an axis: one module per expert, each applied, outputs stacked.

A bank stored as separate leaves (a Python list of expert modules) whose outputs are
stacked (`stack([unit(x) for unit in modules])`, or width-1 pieces concatenated) joins
its units along the new axis: position `p` is computed from leaves no other position is
(a `info.Units` token on that axis, `units[p]` those leaves). Where that axis meets an
axis indexing the experts of a decision over as many experts (contracted with a one-hot
of the ids or scattered combine weights, multiplied with them, gathered at the ids), the
leaves of position `p` are unit `p` of that decision: experts, one matrix each.

The positions stay known only through the rules that keep every position of an axis
where it was (`analysis.Table.keeps_positions`: elementwise ops, broadcasts, transposes,
contractions' batch and free dimensions, reductions over other axes) and while the
units' leaves reach an equation through one operand only. Any other equation (a slice,
a `rev`, a sort, a cumulative sum, a reshape merging the axis) marks them lost
(`info.MovedUnits`): meeting the experts then, the leaves are undecided, and loud.
"""

from __future__ import annotations

from typing import Any, Optional

from skewadam_jax.structure.traced import info as _info

Info = _info.Info


def joined(ins: list[Info]) -> Optional[tuple[frozenset, ...]]:
  """Per operand of a stack, the leaves its values depend on and no other operand's do
  (None if none has any): the units joined at each position."""
  if len(ins) < 2:
    return None
  units = tuple(x.deps - frozenset().union(*(y.deps for j, y in enumerate(ins) if j != i))
                for i, x in enumerate(ins))
  return units if any(units) else None


def meet(an: Any, mine: frozenset, other: frozenset, dispatched: bool) -> None:
  """Units joined along axis `mine`, of E positions, meet an axis (`other`) indexing E
  experts: the leaves of position `p` are unit `p` of that decision. Where the positions
  may have moved, which unit cannot be told: the leaves are undecided.

  `an` is the `analysis.Analysis` (which imports this module): its decisions, and where
  the units and the undecided leaves are recorded.
  """
  decs = an.experts_of(other, dispatched)
  for token in _info.of_kind(mine, _info.Units, _info.MovedUnits):
    dec = an.latest(decs, len(token.units))
    if dec is None:
      continue
    for p, leaves in enumerate(token.units):
      for leaf in leaves:
        if isinstance(token, _info.Units):
          an.joined.setdefault(leaf, {}).setdefault(dec, set()).add(p)
        else:
          an.unclear.setdefault(leaf, (
              f'is one of the units joined along an axis that meets the experts of '
              f'{an.decision(dec).primitive}, after an operation that may have moved the '
              'positions: which unit it is cannot be told'))


def moved(keeps: bool, ins: list[Info], outs: list[Info]) -> list[Info]:
  """The outputs with the operands' joined units marked lost where the equation may move
  their positions: all of them unless its primitive keeps positions (`keeps`), and those
  whose leaves reach it through more than one operand (their values then meet at other
  positions)."""
  known = {t for x in ins for tokens in x.axes for t in _info.of_kind(tokens, _info.Units)}
  if not known:
    return outs
  lost = {t for t in known if not keeps or sum(
      bool(x.deps & frozenset().union(*t.units)) for x in ins) > 1}
  if not lost:
    return outs
  return [o._replace(axes=tuple(
      frozenset(_info.MovedUnits(t.units) if t in lost else t for t in tokens)
      for tokens in o.axes)) for o in outs]
