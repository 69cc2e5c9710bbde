"""The interpreter: a forward dataflow over a jaxpr, one rule per primitive.

`Analysis.run` walks a jaxpr's equations in order; each equation's primitive keys its
rule in the table the analysis is given (`Table`, `rules.TABLE`, like jax's
`batching.primitive_batchers`). A rule is pure: it maps the operands' facts
(`info.Info`) to the outputs' and returns what it found (`findings.Result`: routing
decisions, expert banks, scanned and stacked axes, blind spots), which `Analysis.eqn`
applies to what the analysis records (`findings.record`). The value facts (which
leaves, decisions and masks a value depends on) then flow from every operand to every
output (`Analysis.depend`), except for the primitives whose rules enter a body and
follow it instead (`Table.follows_bodies`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

from skewadam_jax.core.lazy import jex_core
import numpy as np

from skewadam_jax.structure.traced import dependence as _dependence
from skewadam_jax.structure.traced import findings as _findings
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import masks as _masks
from skewadam_jax.structure.traced import units as _units

Info = _info.Info
# A rule: (analysis, equation, operands' facts) -> outputs' facts and findings. It reads
# the analysis (decisions, shapes, the user's line) and never changes it; a rule that
# enters bodies runs them through the driver (`Analysis.run`), which applies the
# findings of their equations.
Rule = Callable[['Analysis', Any, list[Info]], _findings.Result]


class Table(NamedTuple):
  """The rule table and its property tables, keyed by primitive (`rules.TABLE`)."""
  rules: dict[Any, Rule]
  # The rule of a primitive not in `rules`: it enters a call's body, else settles its
  # outputs' value facts itself (as a rule in `follows_bodies` does).
  no_rule: Rule
  # Primitives whose rules enter their equation's bodies: the value facts follow them
  # (`Analysis.run`) or the rule settles them (`Analysis.depend`), so `Analysis.eqn`
  # does not join every operand into every output.
  follows_bodies: frozenset
  # Primitives whose outputs keep each position of an operand axis they carry where it
  # was (elementwise ops, broadcasts, transposes, contractions' batch and free
  # dimensions): joined units (`info.Units`) stay known through them. Any other may move
  # them (a slice, a sort, a cumulative sum): `Analysis.eqn` marks them lost.
  keeps_positions: frozenset


@dataclasses.dataclass
class Decision:
  """A routing decision: a selection over an expert axis."""
  primitive: str
  num_experts: int  # -1 when the expert axis cannot be told
  ids: bool = True  # its indices are expert ids (token choice), not token positions
  routers: set[tuple[int, int]] = dataclasses.field(default_factory=set)
  deps: frozenset = _info.EMPTY  # leaves the selected values (the logits) depend on
  unclear: str = ''  # why the expert axis cannot be told


class Analysis:
  """Forward dataflow over a jaxpr, recording decisions, banks, scans and blind spots.

  Args:
    shapes: the parameter leaves' shapes.
    table: the rules and their properties, by primitive.
  """

  def __init__(self, shapes: list[tuple[int, ...]], table: Table):
    self.shapes = shapes
    self.table = table
    self.decisions: dict[int, Decision] = {}  # id(eqn) -> decision
    self.order: list[int] = []  # decision keys in discovery order
    self.router_tokens: dict[_info.Param, set[int]] = {}  # set for the second pass
    self.banks: dict[tuple[int, int], dict[str, set[int]]] = {}  # (leaf, axis) -> why -> decs
    self.scans: dict[tuple[int, int], int] = {}  # (leaf, axis) -> scan length
    # (leaf, axis) -> length: axes a decision is made per slice of (a `vmap` over stacked
    # layers), and the parameter axes aligned with them
    self.mapped: dict[tuple[int, int], int] = {}
    self.opaque: dict[int, set[str]] = {}  # leaf -> what it reached unseen
    # (primitive, source line) -> leaves crossing a primitive with no rule, and those
    # feeding a selection that made no decision
    self.unknown: dict[tuple[str, str], set[int]] = {}
    self.blind: dict[tuple[str, str], set[int]] = {}
    # (leaf, axis) -> the single pieces taken out of it and dropped (None: at a counter)
    self.pieces: dict[tuple[int, int], set[Optional[int]]] = {}
    self.cut: set[tuple[int, int]] = set()  # router axes of dispatching decisions (pass 3)
    self.out_deps: frozenset = _info.EMPTY  # leaves the outputs depend on (pass 3)
    self.out_free: frozenset = _info.EMPTY  # ... other than through the logits (pass 3)
    self.out_open: frozenset = _info.EMPTY  # ... other than through expert-id masks
    self.out_last: frozenset = _info.EMPTY  # leaves whose contraction made them last
    self.masked: _masks.Masked = {}  # leaf -> dec -> mask ids
    # leaf -> dec -> positions: separate leaves joined along an axis that meets the
    # experts of a decision (`stack([unit(x) for unit in modules])` against a one-hot)
    self.joined: _masks.Masked = {}
    self.joins = False  # some values joined units along an axis (`info.Units` tokens)
    self.unclear: dict[int, str] = {}  # leaf -> meets tokens of an unclear decision
    # (leaf, axis) -> decisions over as many experts as the axis is long whose routed
    # values it meets (a contraction or elementwise alignment), bank or not
    self.near: dict[tuple[int, int], set[int]] = {}
    # (leaf, use) -> the user's line of the first equation that used it so: 'contracted'
    # with activations, rows 'gathered', 'aligned' elementwise (the leaves' roles)
    self.uses: dict[tuple[int, str], str] = {}
    self.callers: list[Any] = []  # the equations whose bodies are being run, outermost first
    self.memo: dict[Any, Any] = {}  # what a rule works out once per equation (an expansion)

  # -- decisions

  def add_decision(self, eqn: Any, prim: str, num_experts: int, ids: bool, unclear: str,
                   routers: Sequence[tuple[int, int]], deps: frozenset) -> None:
    """Registers (or updates, on a later pass or loop iteration: a loop's later passes
    add axes) the decision `eqn` makes; its number and ids as first read stay."""
    key = id(eqn)
    if key not in self.decisions:
      self.decisions[key] = Decision(prim, num_experts, ids, unclear=unclear)
      self.order.append(key)
    d = self.decisions[key]
    d.routers.update(routers)
    d.deps = d.deps | deps

  def decision_of(self, eqn: Any, ids: bool) -> tuple[int, bool]:
    """The number of the decision `eqn` makes (given or to be given by `add_decision`),
    and whether its indices are expert ids as first read: what a rule returning a
    `Decided` reads."""
    key = id(eqn)
    if key in self.decisions:
      return self.order.index(key), self.decisions[key].ids
    return len(self.order), ids

  def decision(self, dec: int) -> Decision:
    return self.decisions[self.order[dec]]

  def latest(self, decs: Any, num_experts: int) -> Optional[int]:
    """The last of `decs` over `num_experts` experts (None if none).

    A value's `routed` set holds every decision upstream of it, those of earlier layers
    included; tokens dispatched to a bank were dispatched by the last of them.
    """
    matching = [d for d in decs if self.decision(d).num_experts == num_experts]
    return max(matching) if matching else None

  def confirmed(self) -> set[int]:
    """The decisions that dispatch tokens to a bank or to a masked unit."""
    found = {d for why in self.banks.values() for decs in why.values() for d in decs
             if d is not None}
    found |= {d for decs in self.joined.values() for d in decs}
    return found | {d for decs in self.gated().values() for d in decs
                    if self.decision(d).num_experts > 0}

  def gated(self) -> dict[int, dict[int, set[Optional[int]]]]:
    """Leaf -> decision -> ids: leaves whose every way to the outputs is masked by ids.

    Such a leaf only acts on the tokens a decision sends to the unit of that id: one
    unit of an unstacked bank (`for e in range(E): y += where(ids == e, f(x @ w[e]),
    0)`, a Python list of matrices).
    """
    return {leaf: decs for leaf, decs in self.masked.items()
            if leaf in self.out_deps and leaf not in self.out_open
            and not any(t.leaf == leaf for t in self.router_tokens)}

  # -- banks and other findings: how `findings.record` applies a rule's findings

  def bank(self, leaf_axis: tuple[int, int], dec: Optional[int], why: str) -> None:
    """Records a parameter axis as the expert axis of a bank of decision `dec`."""
    self.banks.setdefault(leaf_axis, {}).setdefault(why, set()).add(dec)

  def experts_of(self, tokens: frozenset, dispatched: bool) -> set[int]:
    """Decisions whose experts this axis indexes (with `dispatched`: or whose tokens)."""
    decs = _info.decisions_of(tokens, _info.Experts)
    if dispatched:
      decs |= _info.decisions_of(tokens, _info.Dispatched)
    for t in tokens:
      decs |= self.router_tokens.get(t, set())
    return decs

  def meet(self, mine: frozenset, other: frozenset, dispatched: bool, why: str) -> None:
    """Parameter axes in `mine` of length E meet an axis indexing E experts: banks."""
    if _info.of_kind(mine, _info.Units, _info.MovedUnits):
      _units.meet(self, mine, other, dispatched)
    if not _info.params_of(mine):
      return
    decs = self.experts_of(other, dispatched)
    # An axis derived from a bank's expert axis indexes its experts (the output of a
    # batched contraction with tokens dispatched by computed indices, `[E, C, f]`): a
    # per-expert bias added to it is the bank's.
    for key in _info.params_of(other):
      for found in self.banks.get(key, {}).values():
        decs = decs | {d for d in found if d is not None}
    for leaf, axis in _info.params_of(mine):
      if (leaf, axis) in self.router_tokens:
        continue
      dec = self.latest(decs, self.shapes[leaf][axis])
      if dec is not None:
        self.bank((leaf, axis), dec, why)
      for d in decs:  # tokens dispatched by a decision whose expert axis is unknown
        if self.decision(d).unclear:
          self.unclear.setdefault(leaf, f'meets the tokens {self.decision(d).primitive} '
                                  f'dispatches, whose {self.decision(d).unclear}')

  def near_routed(self, mine: frozenset, other: Info) -> None:
    """Parameter axes in `mine` meet an axis of values routed by decisions over as many
    experts as they are long: recorded, so that a bank whose expert axis the analysis
    lost (the decision then dispatches nothing it can see) is reported, not silent."""
    for leaf, axis in _info.params_of(mine):
      for d in other.routed:
        if self.decision(d).num_experts == self.shapes[leaf][axis]:
          self.near.setdefault((leaf, axis), set()).add(d)

  def used(self, tokens: frozenset, use: str, eqn: Any) -> None:
    """The parameters of these axes are used so (`'contracted'`, `'gathered'`, ...)."""
    for leaf, _ in _info.params_of(tokens):
      if (leaf, use) not in self.uses:
        self.uses[(leaf, use)] = self.line(eqn)

  def taken_apart(self, tokens: frozenset) -> None:
    """A width-1 piece of these axes is dropped: record which one."""
    for t in _info.of_kind(tokens, _info.Piece):
      if self.shapes[t.leaf][t.axis] > 1:
        self.pieces.setdefault(t.param, set()).add(t.start)

  def map_axes(self, tokens: frozenset, n: int) -> None:
    """The `n`-long parameter axes of `tokens` run along the batch axis of a decision
    made per slice (one routing decision per layer of a `vmap`): batch axes."""
    for t in _info.params_of(tokens):
      if self.shapes[t.leaf][t.axis] == n:
        self.mapped[t] = n

  def is_mapped(self, tokens: frozenset) -> bool:
    return any(t in self.mapped for t in _info.params_of(tokens))

  def unseen(self, what: str, ins: Sequence[Info]) -> None:
    """The parameter axes of `ins` reach `what`, which the analysis does not see into."""
    for x in ins:
      for tokens in x.axes:
        for leaf, _ in _info.params_of(tokens):
          self.opaque.setdefault(leaf, set()).add(what)

  def line(self, eqn: Any) -> str:
    """The user's source line of `eqn`, or of the innermost call around it that has one
    (the body of a cached `jit`, such as `jnp.fft.fft`'s, has none of its own)."""
    for e in (eqn, *reversed(self.callers)):
      line = _info.source_line(e)
      if line:
        return line
    return 'an unknown line'

  def outputs(self, outs: Sequence[Info]) -> None:
    """Records which leaves the outputs depend on, and how."""
    self.out_deps = frozenset().union(*(o.deps for o in outs))
    self.out_free = frozenset().union(*(o.free for o in outs))
    self.out_open = frozenset().union(*(o.open for o in outs))
    self.out_last = frozenset().union(*(o.last or _info.EMPTY for o in outs))

  # -- interpretation

  def run(self, jaxpr: Any, infos: Sequence[Info], consts: Sequence[Any] = ()) -> list[Info]:
    """Infos of `jaxpr`'s outputs given those of its inputs."""
    env: dict[Any, Info] = {}
    for var in jaxpr.constvars:
      env[var] = _info.blank(len(_info.shape_of(var)))
    for var, info in zip(jaxpr.invars, infos):
      env[var] = info

    def read(v: Any) -> Info:
      if isinstance(v, jex_core.Literal):
        return _info.blank(len(np.shape(v.val)))
      return env.get(v) or _info.blank(len(_info.shape_of(v)))

    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      for var, info in zip(eqn.outvars, self.eqn(eqn, ins)):
        env[var] = info
    return [read(v) for v in jaxpr.outvars]

  def eqn(self, eqn: Any, ins: list[Info]) -> list[Info]:
    """The outputs' facts of one equation, by its primitive's rule; the rule's findings
    applied (while `eqn` is the innermost caller, for the user's line)."""
    prim = eqn.primitive
    rule = self.table.rules.get(prim)
    self.callers.append(eqn)
    try:
      outs, found = rule(self, eqn, ins) if rule else self.table.no_rule(self, eqn, ins)
      _findings.record(self, found)
    finally:
      self.callers.pop()
    if rule is None or prim in self.table.follows_bodies:
      return outs
    if self.joins:
      outs = _units.moved(prim in self.table.keeps_positions, ins, outs)
    return self.depend(eqn, ins, outs)

  def depend(self, eqn: Any, ins: list[Info], outs: list[Info]) -> list[Info]:
    """Value dependences: every output depends on every input (`dependence.depend`)."""
    return _dependence.depend(self, eqn, ins, outs)
