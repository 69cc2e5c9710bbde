"""What a rule finds in one equation, as records the driver applies to the analysis.

A rule is pure: from the operands' facts it returns the outputs' and what it found
(`Result`), and `Analysis.eqn` applies the findings, in order, to what the analysis
records (`record`). A finding says what the equation shows (these axes met an
expert-indexed axis, this parameter was contracted with activations, this selection
makes a decision); the driver says what follows from it with what earlier equations
found (which decision's bank an axis is, whether a use is the first). Findings are
applied in the order the rule lists them: a later one sees what an earlier one recorded
(the second `Meet` of a contraction sees the bank the first found).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import units as _units

Info = _info.Info
_finding = dataclasses.dataclass(frozen=True)


@_finding
class Meet:
  """Parameter axes in `mine` line up with axis `other` (`Analysis.meet`): banks of the
  decisions whose experts (with `dispatched`: or tokens) `other` indexes."""
  mine: frozenset
  other: frozenset
  dispatched: bool
  why: str


@_finding
class MeetUnits:
  """Units joined along `mine` meet axis `other` (`units.meet`), parameter axes aside."""
  mine: frozenset
  other: frozenset
  dispatched: bool


@_finding
class NearRouted:
  """Parameter axes in `mine` meet values `other` routed by decisions
  (`Analysis.near_routed`)."""
  mine: frozenset
  other: Info


@_finding
class Bank:
  """Parameter axis `param` is the expert axis of a bank of decision `dec`."""
  param: _info.Param
  dec: Optional[int]
  why: str


@_finding
class Used:
  """The parameters of axis `tokens` are used so by `eqn` (`'contracted'`, ...)."""
  tokens: frozenset
  use: str
  eqn: Any


@_finding
class TakenApart:
  """A width-1 piece of axis `tokens` is dropped (`Analysis.taken_apart`)."""
  tokens: frozenset


@_finding
class MapAxes:
  """The `n`-long parameter axes of `tokens` run along decisions made per slice."""
  tokens: frozenset
  n: int


@_finding
class Decided:
  """`eqn` makes a routing decision (`Analysis.add_decision`; the rule read its number
  with `Analysis.decision_of`)."""
  eqn: Any
  primitive: str
  num_experts: int
  ids: bool
  unclear: str
  routers: tuple[_info.Param, ...]
  deps: frozenset


@_finding
class Blind:
  """`eqn` (a `primitive`) selects among values of `leaves` and decides nothing."""
  primitive: str
  eqn: Any
  leaves: frozenset


@_finding
class Scanned:
  """Parameter axis `param` is scanned over, `length` steps."""
  param: _info.Param
  length: int


@_finding
class Unseen:
  """The parameter axes of `ins` reach `what`, which the analysis does not see into."""
  what: str
  ins: tuple[Info, ...]


@_finding
class Unreadable:
  """`eqn` cannot be read (`why`; '': no rule): the `leaves` crossing it are undecided."""
  eqn: Any
  leaves: frozenset
  why: str


@_finding
class Joins:
  """Some values joined units along an axis (`info.Units`): positions are now tracked."""


@_finding
class Memo:
  """What a rule worked out once for an equation (an expansion), for its next visit."""
  key: Any
  value: Any


Finding = Union[Meet, MeetUnits, NearRouted, Bank, Used, TakenApart, MapAxes, Decided,
                Blind, Scanned, Unseen, Unreadable, Joins, Memo]


class Result(NamedTuple):
  """What a rule returns: its outputs' facts and what it found, in order."""
  outs: list[Info]
  found: Sequence[Finding] = ()


def _unreadable(an: Any, f: Unreadable) -> None:
  prim, line = f.eqn.primitive.name, an.line(f.eqn)
  if f.why:
    prim = f'{prim} ({f.why})'
  an.unknown.setdefault((prim, line), set()).update(f.leaves)
  for leaf in f.leaves:
    an.opaque.setdefault(leaf, set()).add(f'{prim} (at {line}; no rule)' if not f.why
                                          else f'{prim} (at {line})')


def _blind(an: Any, f: Blind) -> None:
  an.blind.setdefault((f.primitive, an.line(f.eqn)), set()).update(f.leaves)


def _scanned(an: Any, f: Scanned) -> None:
  an.scans[f.param] = f.length


def _joins(an: Any, f: Joins) -> None:
  del f
  an.joins = True


def _memo(an: Any, f: Memo) -> None:
  an.memo[f.key] = f.value


# Finding kind -> how the driver applies it to the analysis (`analysis.Analysis`, which
# imports this module; its methods say what each records).
_APPLY: dict[type, Callable[[Any, Any], Any]] = {
    Meet: lambda an, f: an.meet(f.mine, f.other, f.dispatched, f.why),
    MeetUnits: lambda an, f: _units.meet(an, f.mine, f.other, f.dispatched),
    NearRouted: lambda an, f: an.near_routed(f.mine, f.other),
    Bank: lambda an, f: an.bank(f.param, f.dec, f.why),
    Used: lambda an, f: an.used(f.tokens, f.use, f.eqn),
    TakenApart: lambda an, f: an.taken_apart(f.tokens),
    MapAxes: lambda an, f: an.map_axes(f.tokens, f.n),
    Decided: lambda an, f: an.add_decision(f.eqn, f.primitive, f.num_experts, f.ids,
                                           f.unclear, f.routers, f.deps),
    Blind: _blind,
    Scanned: _scanned,
    Unseen: lambda an, f: an.unseen(f.what, f.ins),
    Unreadable: _unreadable,
    Joins: _joins,
    Memo: _memo,
}


def record(an: Any, found: Sequence[Finding]) -> None:
  """Applies a rule's findings to analysis `an`, in order."""
  for f in found:
    _APPLY[type(f)](an, f)
