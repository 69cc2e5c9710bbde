"""Structure from the computation: tiers and batch axes read from the traced program.

Names are only the fast path (`moe_param_labels`, `moe_batch_axes`); what makes a
parameter a router, an expert bank or a stack of scanned layers is what the model does
with it. `trace_structure` traces the forward (or loss) function to a jaxpr (nothing runs
on data) and follows every parameter through it:

* a **routing decision** is a `top_k`, `approx_max_k`, `argmax`/`argmin` or a `sort`
  (argsort) whose operand has an expert axis: one a parameter's axis reaches and no
  input's axis does. Token choice selects along it (the indices are expert ids); expert
  choice selects along the token axis and the expert axis is another (the indices are
  token positions). The parameters whose axes reach the expert axis (the kernel whose
  contraction produces it, any bias or scale added to the logits) are the **router**,
  and its length is the expert count `E`; so is a parameter that the logits depend on
  and that reaches the outputs only through them (a scale of the router's input);
* an **expert bank** is a parameter whose axis of length `E` meets an expert-indexed
  axis: a `dot_general` batch dimension shared with tokens dispatched by the decision
  (gathered, scattered or sorted by routing indices; tokens an expert choice gathers
  keep its expert axis), a batch or contracting dimension (or an elementwise
  alignment) shared with an axis that indexes experts (the router's logits, a one-hot
  of the expert ids), the group axis of a `ragged_dot`, an axis
  gathered (or dynamically sliced) by expert ids (a decision's indices, or an E-long
  iota read at positions computed from them: `jnp.repeat(arange(E), sizes)`), or an
  E-long axis of an operand of a call the analysis cannot enter (a Pallas grouped
  matmul) whose integer operands derive from the decision; that axis is a batch axis;
* a **unit stored apart** is a parameter whose every way to the outputs goes through a
  mask of a decision's expert ids against a constant (`where(ids == 2, y, 0)`, a
  product with `ids == 2` or with column 2 of a one-hot of the ids): experts, one matrix
  (a Python list of expert matrices); a stacked parameter applied unit by unit under
  such masks is a bank along the axis taken apart;
* **scanned layers** are parameters consumed (whatever the transposes, reshapes,
  broadcasts and slices on the way) as the `xs` of a `scan` that reads no input data;
  the scanned axis, mapped back to the parameter's own axis, is a batch axis, one per
  nesting level;
* **stacked matrices**: a parameter axis whose every element is taken out as a single
  piece and dropped (`unstack`, width-1 `split`s or slices then `squeeze`, a
  `dynamic_slice` at a loop counter) is a batch axis; an axis merged by a reshape is
  remembered and given back when a later reshape splits the same sizes apart;
* everything else (dense paths, shared experts, a decision that dispatches nothing)
  is backbone, with no batch axes: its other axes form one matrix.

Every variable of the jaxpr carries, per axis, the set of parameter axes it derives from
and whether an input's axis reaches it (through `transpose`, `reshape` where the axis
survives as its own dimension, `broadcast_in_dim`, slicing, elementwise ops,
`dot_general` free and batch dimensions, `gather` offset dimensions, reductions over the
other axes), plus whether it depends on the inputs, on which routing decisions, whether
its values are expert ids or are zero unless the ids equal a constant (a mask), and
which leaves its values depend on (all of them, those not only through a router's
logits, those not only through a mask). Calls are entered (`jit`, `remat`,
`custom_jvp`/`custom_vjp`, `shard_map`), `scan`/`while` carries are iterated to a fixed
point and `cond` branches are joined. The analysis runs up to three times: the first
pass finds the decisions and their routers, the second marks the logits' axes as
expert-indexed, the third (when a decision dispatches a bank) stops the value
dependences at the logits. A parameter that reaches a primitive the analysis does not
know is reported as undecided, as is one the function never reads, one producing or
meeting the tokens of a decision whose expert axis cannot be told (several operand axes
come from parameters, none from the inputs), and one masked by several ids with no
unit axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np

from skewadam_jax.structure import paths as _paths
from skewadam_jax.core import tree as _tree


class _JexCore:
  """`jax.extend.core`, imported at first use rather than with the library: `jax.extend`
  imports all of its submodules, Pallas among them (about half of what `import
  skewadam_jax` added to `import jax, optax`)."""

  def __getattr__(self, name: str) -> Any:
    from jax.extend import core
    return getattr(core, name)


jex_core = _JexCore()

BACKBONE, EXPERTS, ROUTER = 'backbone', 'experts', 'router'

_EMPTY: frozenset = frozenset()
# Elementwise primitives whose output still holds expert ids when one operand does and
# the others are constants (index normalisation `where(i < 0, i + E, i)`, clipping).
_ID_PRESERVING = frozenset({
    'add', 'sub', 'max', 'min', 'clamp', 'select_n', 'convert_element_type', 'copy',
    'copy_p', 'rem', 'stop_gradient', 'reduce_precision', 'pvary', 'optimization_barrier',
    'name'})
_COMPARISONS = frozenset({'eq', 'ne', 'lt', 'le', 'gt', 'ge'})
_REDUCTIONS = frozenset({'reduce_sum', 'reduce_max', 'reduce_min', 'reduce_prod',
                         'reduce_and', 'reduce_or', 'reduce_xor', 'argmax', 'argmin'})
# Primitives whose output is zero wherever their first operand is (layout, dtype, sums):
# an expert-id mask stays one through them.
_MASK_KEEPING = frozenset({
    'broadcast_in_dim', 'reshape', 'transpose', 'squeeze', 'expand_dims', 'slice',
    'dynamic_slice', 'gather', 'rev', 'convert_element_type', 'copy', 'copy_p',
    'reduce_sum', 'reduce_max', 'reduce_precision', 'pvary', 'name', 'stop_gradient'})
# Marks an axis that derives from an axis of the function's inputs (a token, batch or
# sequence axis), as opposed to one a parameter's axis produces.
_INPUT_AXIS = ('x', 0)
_SCATTERS = frozenset({'scatter', 'scatter-add', 'scatter_add', 'scatter-mul',
                       'scatter_mul', 'scatter-min', 'scatter_min', 'scatter-max',
                       'scatter_max', 'scatter_apply', 'scatter-sub', 'scatter_sub'})


# ---------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class LeafStructure:
  """What the computation says about one parameter leaf."""
  path: str
  shape: tuple[int, ...]
  tier: str  # 'backbone' | 'experts' | 'router'
  batch_axes: tuple[int, ...]  # expert axis and scanned-layer axes, sorted
  evidence: str  # why, in words
  expert_axis: Optional[int] = None
  layer_axes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RoutingDecision:
  """One routing decision found in the program."""
  primitive: str  # 'top_k', 'argmax', 'sort', ...
  num_experts: int  # E, the length of the axis selected over
  routers: tuple[str, ...]  # paths of the router parameters
  experts: tuple[str, ...]  # paths of the expert banks dispatched by it


@dataclasses.dataclass(frozen=True)
class Structure:
  """Tiers and batch axes of every parameter leaf, read from the traced computation.

  Attributes:
    labels: a pytree like the params of tier names (`'backbone'`, `'experts'`,
      `'router'`; None at leaves that are not arrays), for `sj.skewadam(...,
      param_labels=...)`, `sj.label_table` and `sj.memory_report`.
    batch_axes: a pytree like the params of sorted int tuples, for `sj.skewadam(...,
      batch_axes=...)` and `sj.label_table`.
    leaves: one `LeafStructure` per array leaf, in flattening order.
    decisions: the routing decisions that dispatch tokens to an expert bank.
    undecided: path -> reason, for leaves the analysis could not decide (they are
      labelled backbone, the lossless tier, with no batch axes beyond scanned layers).
  """
  labels: Any
  batch_axes: Any
  leaves: tuple[LeafStructure, ...]
  decisions: tuple[RoutingDecision, ...]
  undecided: dict[str, str]

  @property
  def by_path(self) -> dict[str, LeafStructure]:
    """The leaves keyed by their normalised path."""
    return {leaf.path: leaf for leaf in self.leaves}

  def format(self) -> str:
    """An aligned text table: path, shape, tier, batch axes and evidence per leaf."""
    header = ('path', 'shape', 'tier', 'batch axes', 'evidence')
    body = [(x.path, 'x'.join(map(str, x.shape)) or '()', x.tier,
             ','.join(map(str, x.batch_axes)) or '-', x.evidence) for x in self.leaves]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(4)]
    fmt = '  '.join(f'{{:<{w}}}' for w in widths) + '  {}'
    lines = [fmt.format(*header), fmt.format(*('-' * w for w in widths), '-' * 8)]
    lines += [fmt.format(*row).rstrip() for row in body]
    counts = {t: sum(x.tier == t for x in self.leaves) for t in (BACKBONE, EXPERTS, ROUTER)}
    lines.append(f'{len(self.leaves)} leaves: ' + ', '.join(f'{n} {t}' for t, n in
                                                            counts.items()))
    for d in self.decisions:
      lines.append(f'routing: {d.primitive} over E={d.num_experts} experts; router '
                   f'{", ".join(d.routers)}; experts {", ".join(d.experts)}')
    for path, why in self.undecided.items():
      lines.append(f'UNDECIDED {path}: {why}')
    return '\n'.join(lines)


# ---------------------------------------------------------------------------- dataflow


class _Info(NamedTuple):
  """What the analysis knows about one jaxpr variable."""
  # per axis: (leaf, axis) | ('d', dec) dispatched | ('e', dec) | _INPUT_AXIS | ...
  axes: tuple[frozenset, ...]
  data: bool = False  # depends on the function's inputs (not only on parameters)
  routed: frozenset = _EMPTY  # routing decisions it depends on
  eid: Optional[int] = None  # its values are expert ids of this decision
  iota: Optional[int] = None  # its values are the index along this axis
  deps: frozenset = _EMPTY  # leaves its values depend on
  free: frozenset = _EMPTY  # leaves reaching it other than through a router's logits
  # (decision, id or None) pairs: its values are zero wherever that decision's expert id
  # differs from the id (`i == 2`, a one-hot's column 2; None: an id not known here)
  mask: frozenset = _EMPTY
  unmask: frozenset = _EMPTY  # ... (decision, id) pairs: false only where the id is it
  open: frozenset = _EMPTY  # leaves reaching it other than through such a mask


def _blank(ndim: int) -> _Info:
  return _Info((_EMPTY,) * ndim)


def _shape(var: Any) -> tuple[int, ...]:
  return tuple(int(d) if isinstance(d, (int, np.integer)) else -1
               for d in getattr(var.aval, 'shape', ()))


def _params_of(tokens: frozenset) -> list[tuple[int, int]]:
  return [t for t in tokens if isinstance(t[0], int)]


def _flags(tokens: frozenset, kind: str) -> set[int]:
  return {t[1] for t in tokens if t[0] == kind}


def _join(a: _Info, b: _Info) -> _Info:
  """The least upper bound of two facts about the same variable."""
  axes = a.axes if len(a.axes) != len(b.axes) else tuple(x | y for x, y in zip(a.axes, b.axes))
  return _Info(axes, a.data or b.data, a.routed | b.routed,
               a.eid if a.eid == b.eid else None, a.iota if a.iota == b.iota else None,
               a.deps | b.deps, a.free | b.free, a.mask & b.mask,
               a.unmask & b.unmask, a.open | b.open)


def _reshape_groups(src: Sequence[int], dst: Sequence[int]
                    ) -> list[tuple[list[int], list[int]]]:
  """Groups of source and destination dims with equal products (size-1 dims alone)."""
  if 0 in src or 0 in dst or -1 in src or -1 in dst:
    return []
  groups, i, j = [], 0, 0
  while i < len(src) or j < len(dst):
    if i < len(src) and src[i] == 1:
      groups.append(([i], []))
      i += 1
      continue
    if j < len(dst) and dst[j] == 1:
      groups.append(([], [j]))
      j += 1
      continue
    if i >= len(src) or j >= len(dst):
      return []
    gi, gj, pa, pb = [i], [j], src[i], dst[j]
    i, j = i + 1, j + 1
    while pa != pb:
      if pa < pb and i < len(src):
        gi.append(i)
        pa *= src[i]
        i += 1
      elif pb < pa and j < len(dst):
        gj.append(j)
        pb *= dst[j]
        j += 1
      else:
        return []
    groups.append((gi, gj))
  return groups


def _sub_jaxpr(eqn: Any) -> Optional[tuple[Any, list[Any]]]:
  """(jaxpr, consts) of a call-like equation whose body maps its operands one to one."""
  for name in ('jaxpr', 'call_jaxpr'):
    sub = eqn.params.get(name)
    if isinstance(sub, jex_core.ClosedJaxpr):
      sub, consts = sub.jaxpr, list(sub.consts)
    elif isinstance(sub, jex_core.Jaxpr):
      consts = []
    else:
      continue
    if len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
      return sub, consts
  return None


def _closed(sub: Any) -> tuple[Any, list[Any]]:
  if isinstance(sub, jex_core.ClosedJaxpr):
    return sub.jaxpr, list(sub.consts)
  return sub, []


def _scan_groups(eqn: Any) -> tuple[int, int]:
  """How many of a `scan`'s operands are consts and carries (then come the xs).

  jax < 0.12 gives the counts (`num_consts`, `num_carry`); later versions give `ft_in`,
  the flattened (consts, carry, xs) groups.
  """
  p = eqn.params
  if 'num_consts' in p:
    return p['num_consts'], p['num_carry']
  consts, carry, _ = p['ft_in'].update(list(range(len(eqn.invars)))).unpack()
  return len(list(consts)), len(list(carry))


@dataclasses.dataclass
class _Decision:
  primitive: str
  num_experts: int  # -1 when the expert axis cannot be told
  ids: bool = True  # its indices are expert ids (token choice), not token positions
  routers: set[tuple[int, int]] = dataclasses.field(default_factory=set)
  deps: frozenset = _EMPTY  # leaves the selected values (the logits) depend on
  unclear: str = ''  # why the expert axis cannot be told


class _Analysis:
  """Forward dataflow over a jaxpr, recording decisions, banks, scans and blind spots."""

  def __init__(self, shapes: list[tuple[int, ...]]):
    self.shapes = shapes  # of the parameter leaves
    self.decisions: dict[int, _Decision] = {}  # id(eqn) -> decision
    self.order: list[int] = []  # decision keys in discovery order
    self.router_tokens: dict[tuple[int, int], set[int]] = {}  # set for the second pass
    self.banks: dict[tuple[int, int], dict[str, set[int]]] = {}  # (leaf, axis) -> why -> decs
    self.scans: dict[tuple[int, int], int] = {}  # (leaf, axis) -> scan length
    self.opaque: dict[int, set[str]] = {}  # leaf -> primitives it reached unseen
    # (leaf, axis) -> the single pieces taken out of it and dropped (None: at a counter)
    self.pieces: dict[tuple[int, int], set[Optional[int]]] = {}
    self.cut: set[tuple[int, int]] = set()  # router axes of dispatching decisions (pass 3)
    self.out_deps: frozenset = _EMPTY  # leaves the outputs depend on (pass 3)
    self.out_free: frozenset = _EMPTY  # ... other than through the logits (pass 3)
    self.out_open: frozenset = _EMPTY  # ... other than through expert-id masks
    self.masked: dict[int, dict[int, set[Optional[int]]]] = {}  # leaf -> dec -> mask ids
    self.unclear: dict[int, str] = {}  # leaf -> meets tokens of an unclear decision

  # -- records

  def _decision(self, eqn: Any, prim: str, operand: _Info, axis: int,
                shape: Sequence[int]) -> tuple[Optional[int], bool]:
    """Registers a routing decision selecting along `axis` of `operand`, if any.

    Returns the decision and whether its indices are expert ids. The expert axis is the
    one a router's parameter produces (its kernel's output axis) and no input's axis
    reaches. Token choice selects along it. Expert choice selects along the token axis
    (an input's axis, or no parameter's) while another axis is the expert axis: its
    indices are token positions, grouped by that axis.
    """
    if operand.eid is not None:
      return None, False

    def clean(a: int) -> bool:
      return bool(_params_of(operand.axes[a])) and _INPUT_AXIS not in operand.axes[a]

    others = [a for a in range(len(shape)) if a != axis and clean(a) and shape[a] > 1]
    unclear = ''
    if clean(axis):
      expert, ids = axis, True
    elif len(others) == 1:
      expert, ids = others[0], False
    elif others:
      expert, ids = None, False
      unclear = (f'axes {_axis_list(others)} of its operand all come from parameters and '
                 'none from the inputs: which one indexes the experts cannot be told')
    elif _params_of(operand.axes[axis]):  # the logits also take input data (noise)
      expert, ids = axis, True
    else:
      return None, False
    key = id(eqn)
    if key not in self.decisions:
      self.decisions[key] = _Decision(prim, shape[expert] if expert is not None else -1,
                                      ids, unclear=unclear)
      self.order.append(key)
    d = self.decisions[key]
    for a in ([expert] if expert is not None else others):
      d.routers.update(_params_of(operand.axes[a]))
    d.deps = d.deps | operand.deps
    return self.order.index(key), d.ids  # as first read (a loop's later passes add axes)

  def _experts_of(self, tokens: frozenset, dispatched: bool) -> set[int]:
    """Decisions whose experts this axis indexes (with `dispatched`: or whose tokens)."""
    decs = _flags(tokens, 'e')
    if dispatched:
      decs |= _flags(tokens, 'd')
    for t in tokens:
      decs |= self.router_tokens.get(t, set())
    return decs

  def _bank(self, leaf_axis: tuple[int, int], dec: Optional[int], why: str) -> None:
    self.banks.setdefault(leaf_axis, {}).setdefault(why, set()).add(dec)

  def _meet(self, mine: frozenset, other: frozenset, dispatched: bool, why: str) -> None:
    """Parameter axes in `mine` of length E meet an axis indexing E experts: banks."""
    if not any(isinstance(t[0], int) for t in mine):
      return
    decs = self._experts_of(other, dispatched)
    for leaf, axis in _params_of(mine):
      if (leaf, axis) in self.router_tokens:
        continue
      dec = self.latest(decs, self.shapes[leaf][axis])
      if dec is not None:
        self._bank((leaf, axis), dec, why)
      for d in decs:  # tokens dispatched by a decision whose expert axis is unknown
        if self.decision(d).unclear:
          self.unclear.setdefault(leaf, f'meets the tokens {self.decision(d).primitive} '
                                  f'dispatches, whose {self.decision(d).unclear}')

  def latest(self, decs: Any, num_experts: int) -> Optional[int]:
    """The last of `decs` over `num_experts` experts (None if none).

    A value's `routed` set holds every decision upstream of it, those of earlier layers
    included; tokens dispatched to a bank were dispatched by the last of them.
    """
    matching = [d for d in decs if self.decision(d).num_experts == num_experts]
    return max(matching) if matching else None

  def decision(self, dec: int) -> _Decision:
    return self.decisions[self.order[dec]]

  def outputs(self, outs: Sequence[_Info]) -> None:
    """Records which leaves the outputs depend on, and how."""
    self.out_deps = frozenset().union(*(o.deps for o in outs))
    self.out_free = frozenset().union(*(o.free for o in outs))
    self.out_open = frozenset().union(*(o.open for o in outs))

  def gated(self) -> dict[int, dict[int, set[Optional[int]]]]:
    """Leaf -> decision -> ids: leaves whose every way to the outputs is masked by ids.

    Such a leaf only acts on the tokens a decision sends to the unit of that id: one
    unit of an unstacked bank (`for e in range(E): y += where(ids == e, f(x @ w[e]),
    0)`, a Python list of matrices).
    """
    return {leaf: decs for leaf, decs in self.masked.items()
            if leaf in self.out_deps and leaf not in self.out_open
            and not any(t[0] == leaf for t in self.router_tokens)}

  def confirmed(self) -> set[int]:
    """The decisions that dispatch tokens to a bank or to a masked unit."""
    found = {d for why in self.banks.values() for decs in why.values() for d in decs
             if d is not None}
    return found | {d for decs in self.gated().values() for d in decs
                    if self.decision(d).num_experts > 0}

  def _opaque(self, prim: str, infos: Sequence[_Info]) -> None:
    for info in infos:
      for tokens in info.axes:
        for leaf, _ in _params_of(tokens):
          self.opaque.setdefault(leaf, set()).add(prim)

  # -- interpretation

  def run(self, jaxpr: Any, infos: Sequence[_Info], consts: Sequence[Any] = ()
          ) -> list[_Info]:
    """Infos of `jaxpr`'s outputs given those of its inputs."""
    env: dict[Any, _Info] = {}
    for var in jaxpr.constvars:
      env[var] = _blank(len(_shape(var)))
    for var, info in zip(jaxpr.invars, infos):
      env[var] = info

    def read(v: Any) -> _Info:
      if isinstance(v, jex_core.Literal):
        return _blank(len(np.shape(v.val)))
      return env.get(v) or _blank(len(_shape(v)))

    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      outs = self.eqn(eqn, ins)
      for var, info in zip(eqn.outvars, outs):
        env[var] = info
    return [read(v) for v in jaxpr.outvars]

  def eqn(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    prim = eqn.primitive.name
    if prim in ('scan', 'while', 'cond'):  # value dependences follow the bodies
      return getattr(self, '_' + prim)(eqn, ins)
    handler = getattr(self, '_' + prim.replace('-', '_'), None)
    if handler is None and prim not in _REDUCTIONS and prim not in _SCATTERS:
      sub = _sub_jaxpr(eqn)
      if sub is not None:
        return self.run(sub[0], ins, sub[1])
    if handler is not None:
      outs = handler(eqn, ins)
    elif prim in _REDUCTIONS:
      outs = self._reduce(eqn, ins)
    elif prim in _SCATTERS:
      outs = self._scatter_any(eqn, ins)
    elif self._elementwise_shapes(eqn):
      outs = self._elementwise(eqn, ins)
    else:
      outs = self._opaque_call(eqn, ins)
    return self._depend(eqn, ins, outs)

  def _depend(self, eqn: Any, ins: list[_Info], outs: list[_Info]) -> list[_Info]:
    """Value dependences: every output depends on every input.

    `free` leaves the logits of a dispatching decision behind: where a contraction or
    an elementwise op makes values carrying a router's expert axis (`self.cut`), the
    operands none of whose axes line up with that axis (the hidden states and their
    scales, contracted into the logits) stop there.
    """
    deps = frozenset().union(*(x.deps for x in ins))
    free = frozenset().union(*(x.free for x in ins))
    prim = eqn.primitive.name
    if self.cut and (prim == 'dot_general' or (
        len(outs) == 1 and self._elementwise_shapes(eqn))):
      out_axes = outs[0].axes
      hot = [bool(self.cut.intersection(t)) for t in out_axes]
      if any(hot):
        free = frozenset().union(*(x.free for x, v in zip(ins, eqn.invars)
                                   if self._aligned(eqn, x, v, hot)))
    mask, unmask, open_ = self._masked(eqn, ins)
    return [o._replace(deps=deps, free=free, mask=mask, unmask=unmask, open=open_)
            for o in outs]

  def _masked(self, eqn: Any, ins: list[_Info]) -> tuple[frozenset, frozenset, frozenset]:
    """The expert-id masks of the output and the leaves reaching it not through one.

    `ids == 2` (a decision's expert ids against a constant) or column 2 of a one-hot of
    them is zero wherever a token's unit is not unit 2; `ids != 2` is its negation. A
    product with a mask (`mul`, `dot_general`), the case a `select_n` by one takes for
    unit 2, or case 2 of a `select_n` by the ids themselves lets the other operands'
    leaves reach the output only for those tokens: they are recorded as masked by
    (decision, 2) and leave `open`. Returns (mask, negated mask, open).
    """
    prim = eqn.primitive.name
    open_ = frozenset().union(*(x.open for x in ins))
    mask = unmask = _EMPTY
    if prim in ('eq', 'ne') and len(ins) == 2:
      pairs = list(zip(ins, eqn.invars))
      for (a, _), (b, var) in (pairs, pairs[::-1]):
        if a.eid is not None and b.eid is None and b.iota is None and not (
            b.data or b.routed or b.deps or any(b.axes)):
          value = var.val if isinstance(var, jex_core.Literal) else None
          found = frozenset({(a.eid, int(value) if value is not None and np.ndim(value) == 0
                              else None)})
          mask, unmask = (found, _EMPTY) if prim == 'eq' else (_EMPTY, found)
    elif prim == 'not':
      mask, unmask = ins[0].unmask, ins[0].mask
    elif prim == 'slice':  # a column of a one-hot of the ids
      src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
      mask = ins[0].mask | frozenset(
          (dec, start) for tokens, n, m, start in zip(ins[0].axes, src, dst,
                                                      eqn.params['start_indices'])
          if n > 1 and m == 1 for dec in _flags(tokens, 'e'))
      unmask = ins[0].unmask
    elif prim in _MASK_KEEPING:
      mask, unmask = ins[0].mask, ins[0].unmask
    elif prim == 'select_n' and len(ins) == 3 and (ins[0].mask or ins[0].unmask):
      # select_n(pred, on_false, on_true): the case taken for unit 2 is masked by it.
      unit = 2 if ins[0].mask else 1
      other = ins[3 - unit]
      if not (other.deps or other.data):  # zero (a constant) for the other units
        mask = (ins[0].mask or ins[0].unmask) | ins[unit].mask
      open_ = ins[0].open | other.open
      self._mask_leaves(ins[0].mask or ins[0].unmask, [ins[unit]])
    elif prim == 'select_n' and ins[0].eid is not None:  # `select_n(ids, *per_unit)`
      open_ = ins[0].open
      for unit, x in enumerate(ins[1:]):
        self._mask_leaves(frozenset({(ins[0].eid, unit)}), [x])
    elif prim in ('mul', 'and', 'dot_general'):
      mask = frozenset().union(*(x.mask for x in ins))
      gates = [i for i, x in enumerate(ins) if x.mask]
      if gates:
        open_ = frozenset().union(*(ins[i].open for i in gates))
        self._mask_leaves(frozenset().union(*(ins[i].mask for i in gates)),
                          [x for i, x in enumerate(ins) if i not in gates])
    return mask, unmask, open_

  def _mask_leaves(self, masks: frozenset, gated: Sequence[_Info]) -> None:
    """The leaves reaching `gated` not through a mask now reach on through `masks`."""
    for dec, value in masks:
      for x in gated:
        for leaf in x.open:
          self.masked.setdefault(leaf, {}).setdefault(dec, set()).add(value)

  def _aligned(self, eqn: Any, x: _Info, var: Any, hot: list[bool]) -> bool:
    """Whether operand `var` supplies a non-trivial output axis flagged in `hot`."""
    if any(self.cut.intersection(t) for t in x.axes):
      return True
    shape = _shape(var)
    if eqn.primitive.name != 'dot_general':
      return any(h and n > 1 for h, n in zip(hot, shape)) if len(shape) == len(hot) else False
    (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
    lhs = var is eqn.invars[0]
    batch, contract = (lb, lc) if lhs else (rb, rc)
    nl = len(_shape(eqn.invars[0]))
    free_l = [i for i in range(nl) if i not in lc and i not in lb]
    start = len(lb) + (0 if lhs else len(free_l))
    free_dims = [i for i in range(len(shape)) if i not in contract and i not in batch]
    positions = list(range(len(lb))) + [start + j for j in range(len(free_dims))]
    return any(hot[p] for p in positions if p < len(hot))

  def _opaque_call(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    """A call the analysis cannot enter (a Pallas kernel, a callback).

    When its integer operands carry a routing decision over E experts (group sizes or
    offsets computed from the expert ids), it is read as a grouped matmul: a parameter
    operand's axis of length E is that decision's expert axis.
    """
    prim = eqn.primitive.name
    routed = frozenset().union(*(x.routed for x, v in zip(ins, eqn.invars)
                                 if np.issubdtype(getattr(v.aval, 'dtype', np.float32),
                                                  np.integer)))
    found = False
    for x in ins:
      for tokens in x.axes:
        for leaf, axis in _params_of(tokens):
          dec = self.latest(routed, self.shapes[leaf][axis])
          if dec is not None:
            self._bank((leaf, axis), dec, f'an E-long operand axis of {prim}, whose '
                       'integer operands are routed (read as a grouped matmul)')
            found = True
    if not found:
      self._opaque(prim, ins)
    data, routed = self._common(ins)
    return [_Info(_blank(len(_shape(v))).axes, data, routed) for v in eqn.outvars]

  @staticmethod
  def _elementwise_shapes(eqn: Any) -> bool:
    out = {_shape(v) for v in eqn.outvars}
    if len(out) != 1:
      return False
    shape = out.pop()
    for v in eqn.invars:
      s = _shape(v)
      if s and (len(s) != len(shape) or any(a not in (b, 1) for a, b in zip(s, shape))):
        return False
    return True

  @staticmethod
  def _common(ins: Sequence[_Info]) -> tuple[bool, frozenset]:
    return any(x.data for x in ins), frozenset().union(*(x.routed for x in ins))

  def _elementwise(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    prim = eqn.primitive.name
    shape = _shape(eqn.outvars[0])
    shapes = [_shape(v) for v in eqn.invars]
    axes = []
    for ax, n in enumerate(shape):
      here = [x.axes[ax] for x, s in zip(ins, shapes) if len(s) == len(shape) and s[ax] == n
              and len(x.axes) == len(shape)]
      axes.append(frozenset().union(*here))
      if len(here) > 1 and n > 1:
        for i, mine in enumerate(here):
          for j, other in enumerate(here):
            if i != j:
              self._meet(mine, other, False, f'{prim} with an expert-indexed axis')
    data, routed = self._common(ins)
    eid = iota = None
    if prim in _ID_PRESERVING:
      values = ins[1:] if prim == 'select_n' else ins
      ids = {x.eid for x in values if x.eid is not None}
      others_const = all(x.eid is not None or (not x.data and not x.routed and not any(
          x.axes)) for x in values)
      if len(ids) == 1 and others_const:
        eid = ids.pop()
      if len(ins) == 1:
        iota = ins[0].iota
    if prim in _COMPARISONS and len(ins) == 2:
      for a, b in ((ins[0], ins[1]), (ins[1], ins[0])):
        if a.eid is not None and b.iota is not None:
          e = self.decision(a.eid).num_experts
          if shape[b.iota] == e:  # a one-hot of the expert ids along the iota's axis
            axes[b.iota] = axes[b.iota] | {('e', a.eid)}
    return [_Info(tuple(axes), data, routed, eid, iota) for _ in eqn.outvars]

  # layout

  def _broadcast_in_dim(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x, src = ins[0], _shape(eqn.invars[0])
    shape = _shape(eqn.outvars[0])
    axes = [_EMPTY] * len(shape)
    dims = eqn.params['broadcast_dimensions']
    for i, d in enumerate(dims):
      if src[i] == shape[d]:
        axes[d] = x.axes[i]
    iota = dims[x.iota] if x.iota is not None else None
    return [x._replace(axes=tuple(axes), iota=iota)]

  def _reshape(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x = ins[0]
    src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    axes = [_EMPTY] * len(dst)
    iota = None
    for gi, gj in _reshape_groups(src, dst):
      if len(gi) == 1 and len(gj) == 1:
        axes[gj[0]] = x.axes[gi[0]]
        iota = gj[0] if x.iota == gi[0] else iota
      elif gi and gj:
        # A merged or split axis is no parameter axis, but stays dispatched: the major
        # part of a split dispatched axis ([E * C] -> [E, C]) indexes the experts.
        flags = frozenset(t for i in gi for t in x.axes[i] if not isinstance(t[0], int))
        if len(gj) == 1:
          # The merged axes are remembered, to be given back if split apart again.
          parts = tuple((src[i], frozenset(_params_of(x.axes[i]))) for i in gi)
          merged = {('m', parts)} if any(p for _, p in parts) else set()
          axes[gj[0]] = flags | merged
          continue
        axes[next(j for j in gj if dst[j] > 1)] = flags
        if len(gi) == 1:
          for t in x.axes[gi[0]]:
            if t[0] == 'm' and tuple(n for n, _ in t[1]) == tuple(dst[j] for j in gj):
              for j, (_, tokens) in zip(gj, t[1]):
                axes[j] = axes[j] | tokens
      elif gi:  # a size-1 axis dropped
        self._taken_apart(x.axes[gi[0]])
    return [x._replace(axes=tuple(axes), iota=iota)]

  def _taken_apart(self, tokens: frozenset) -> None:
    """A width-1 piece of these axes is dropped: record which one."""
    for t in tokens:
      if t[0] == '1' and self.shapes[t[1][0]][t[1][1]] > 1:
        self.pieces.setdefault(t[1][:2], set()).add(t[1][2])

  @staticmethod
  def _width_one(tokens: frozenset, before: int, after: int, start: Optional[int]
                 ) -> frozenset:
    """Marks the parameter axes of an axis cut from `before` to the one element at
    `start` (None: at a loop counter)."""
    if after != 1 or before <= 1:
      return tokens
    return tokens | {('1', (*t, start)) for t in _params_of(tokens)}

  def _transpose(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x, perm = ins[0], eqn.params['permutation']
    iota = perm.index(x.iota) if x.iota is not None else None
    return [x._replace(axes=tuple(x.axes[p] for p in perm), iota=iota)]

  def _squeeze(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x = ins[0]
    ndim = len(x.axes)
    drop = {d % ndim for d in eqn.params['dimensions']}
    keep = [i for i in range(ndim) if i not in drop]
    for d in drop:
      self._taken_apart(x.axes[d])
    return [x._replace(axes=tuple(x.axes[i] for i in keep),
                       iota=keep.index(x.iota) if x.iota in keep else None)]

  def _same_rank(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    return [ins[0]._replace(iota=None)]

  _pad = _rev = _same_rank

  def _slice(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x, src, dst = ins[0], _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    starts = eqn.params['start_indices']
    return [x._replace(axes=tuple(self._width_one(*z) for z in
                                  zip(x.axes, src, dst, starts)), iota=None)]

  def _split(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    """`jnp.split`: each piece keeps the operand's axes, as a slice does."""
    x, src, axis = ins[0], _shape(eqn.invars[0]), eqn.params['axis'] % len(ins[0].axes)
    starts = np.cumsum([0, *eqn.params['sizes']])
    return [x._replace(axes=tuple(
        self._width_one(t, src[a], _shape(v)[a], int(start)) if a == axis else t
        for a, t in enumerate(x.axes)), iota=None) for v, start in zip(eqn.outvars, starts)]

  def _unstack(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    """`jnp.unstack`: the axis is taken apart into its single pieces."""
    x, axis = ins[0], eqn.params['axis'] % len(ins[0].axes)
    for i in range(len(eqn.outvars)):
      self._taken_apart(self._width_one(x.axes[axis], 2, 1, i))
    axes = tuple(t for a, t in enumerate(x.axes) if a != axis)
    return [x._replace(axes=axes, iota=None) for _ in eqn.outvars]

  def _conv_general_dilated(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    """A convolution: batch from the input, output features from the kernel."""
    lhs, rhs = ins[0], ins[1]
    lspec, rspec, ospec = eqn.params['dimension_numbers']
    axes = [_EMPTY] * len(_shape(eqn.outvars[0]))
    axes[ospec[0]] = lhs.axes[lspec[0]]
    axes[ospec[1]] = rhs.axes[rspec[0]]
    data, routed = self._common(ins)
    return [_Info(tuple(axes), data, routed)]

  def _dynamic_slice(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x, starts = ins[0], ins[1:]
    axes = list(x.axes)
    src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    for axis, s in enumerate(starts):
      if s.eid is not None:
        for t in _params_of(x.axes[axis]):
          if self.shapes[t[0]][t[1]] == self.decision(s.eid).num_experts:
            self._bank(t, s.eid, 'dynamically sliced by expert id')
      elif not s.data and not s.routed:  # a constant or a loop counter, not data
        var = eqn.invars[1 + axis]
        start = int(var.val) if isinstance(var, jex_core.Literal) else None
        axes[axis] = self._width_one(axes[axis], src[axis], dst[axis], start)
    data, routed = self._common(ins)
    return [_Info(tuple(axes), data, routed, x.eid)]

  def _dynamic_update_slice(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x, u = ins[0], ins[1]
    data, routed = self._common(ins)
    return [_Info(tuple(a | b for a, b in zip(x.axes, u.axes)), data, routed)]

  def _concatenate(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    dim = eqn.params['dimension']
    axes = []
    for ax in range(len(_shape(eqn.outvars[0]))):
      tokens = frozenset().union(*(x.axes[ax] for x in ins))
      if ax == dim:  # a concatenated axis is no parameter's own axis
        tokens = frozenset(t for t in tokens if not isinstance(t[0], int))
      axes.append(tokens)
    data, routed = self._common(ins)
    ids = {x.eid for x in ins}
    return [_Info(tuple(axes), data, routed, ids.pop() if len(ids) == 1 else None)]

  def _iota(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    return [_blank(len(_shape(eqn.outvars[0])))._replace(iota=eqn.params['dimension'])]

  def _reduce(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x = ins[0]
    drop = set(eqn.params['axes'])
    axes = tuple(a for i, a in enumerate(x.axes) if i not in drop)
    prim = eqn.primitive.name
    if prim in ('argmax', 'argmin') and len(drop) == 1:
      (axis,) = drop
      dec, ids = self._decision(eqn, prim, x, axis, _shape(eqn.invars[0]))
      if dec is not None:
        return [_Info(axes, x.data, x.routed | {dec}, dec if ids else None)]
    return [_Info(axes, x.data, x.routed)]

  def _select(self, eqn: Any, ins: list[_Info], axis: int) -> list[_Info]:
    """top_k-like: values and indices of the best `k` along `axis`."""
    x = ins[0]
    axes = tuple(_EMPTY if i == axis else a for i, a in enumerate(x.axes))
    dec, ids = self._decision(eqn, eqn.primitive.name, x, axis, _shape(eqn.invars[0]))
    if dec is None:
      return [_Info(axes, x.data, x.routed) for _ in eqn.outvars]
    routed = x.routed | {dec}
    return [_Info(axes, x.data, routed), _Info(axes, x.data, routed, dec if ids else None)]

  def _top_k(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    ndim = len(_shape(eqn.invars[0]))
    return self._select(eqn, ins, eqn.params.get('axis', -1) % ndim)

  def _approx_top_k(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    ndim = len(_shape(eqn.invars[0]))
    return self._select(eqn, ins, eqn.params.get('reduction_dimension', -1) % ndim)

  def _sort(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    dim, nkeys = eqn.params['dimension'], eqn.params.get('num_keys', 1)
    data, routed = self._common(ins)
    axes = [frozenset().union(*(x.axes[ax] for x in ins)) if ax != dim else _EMPTY
            for ax in range(len(ins[0].axes))]
    keys = ins[:nkeys]
    dec, ids = None, False
    for k in keys:
      dec, ids = self._decision(eqn, 'sort', k, dim, _shape(eqn.invars[0]))
      if dec is not None:
        break
    if dec is not None:  # argsort of the logits: the permutation holds expert ids
      routed = routed | {dec}
      return [_Info(tuple(axes), data, routed, dec if ids and x.iota == dim else None)
              for x in ins]
    keyed = frozenset().union(*(k.routed for k in keys))
    if keyed:  # sorting by routed keys (expert ids) dispatches along `dim`
      axes[dim] = frozenset(('d', d) for d in keyed)
    return [_Info(tuple(axes), data, routed, x.eid if i < nkeys else None)
            for i, x in enumerate(ins)]

  # contractions

  def _dot_general(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    lhs, rhs = ins[0], ins[1]
    (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
    for a, b in zip(lb, rb):
      self._meet(lhs.axes[a], rhs.axes[b], True, 'batch dim of a dot_general with '
                 'dispatched tokens')
      self._meet(rhs.axes[b], lhs.axes[a], True, 'batch dim of a dot_general with '
                 'dispatched tokens')
    for a, b in zip(lc, rc):
      self._meet(lhs.axes[a], rhs.axes[b], False, 'contracted with expert-indexed weights')
      self._meet(rhs.axes[b], lhs.axes[a], False, 'contracted with expert-indexed weights')
    axes = [lhs.axes[a] | rhs.axes[b] for a, b in zip(lb, rb)]
    axes += [t for i, t in enumerate(lhs.axes) if i not in lc and i not in lb]
    axes += [t for i, t in enumerate(rhs.axes) if i not in rc and i not in rb]
    data, routed = self._common(ins)
    return [_Info(tuple(axes), data, routed)]

  def _ragged_dot_general(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    lhs, rhs, sizes = ins[0], ins[1], ins[2]
    numbers = eqn.params['ragged_dot_dimension_numbers']
    (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
    groups = tuple(numbers.rhs_group_dimensions)
    for g in groups:
      n = _shape(eqn.invars[1])[g]
      dec = self.latest(sizes.routed, n)
      for t in _params_of(rhs.axes[g]):
        if self.shapes[t[0]][t[1]] == n:
          self._bank(t, dec, 'group axis of a ragged_dot')
    axes = [lhs.axes[a] | rhs.axes[b] for a, b in zip(lb, rb)]
    axes += [t for i, t in enumerate(lhs.axes) if i not in lc and i not in lb]
    axes += [t for i, t in enumerate(rhs.axes) if i not in rc and i not in rb
             and i not in groups]
    data, routed = self._common(ins)
    if len(axes) != len(_shape(eqn.outvars[0])):
      axes = list(_blank(len(_shape(eqn.outvars[0]))).axes)
    return [_Info(tuple(axes), data, routed)]

  def _gather(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x, idx = ins[0], ins[1]
    dn = eqn.params['dimension_numbers']
    sizes = eqn.params['slice_sizes']
    src = _shape(eqn.invars[0])
    if idx.eid is not None:
      e = self.decision(idx.eid).num_experts
      for axis in dn.start_index_map:
        for t in _params_of(x.axes[axis]):
          if self.shapes[t[0]][t[1]] == e:
            self._bank(t, idx.eid, 'gathered by expert id')
    out_shape = _shape(eqn.outvars[0])
    kept = [d for d in range(len(src)) if d not in dn.collapsed_slice_dims
            and d not in dn.operand_batching_dims]
    idx_dims = [d for d in range(len(idx.axes)) if d != len(idx.axes) - 1]
    batch_pos = [p for p in range(len(out_shape)) if p not in dn.offset_dims]
    axes = [_EMPTY] * len(out_shape)
    for p, d in zip(dn.offset_dims, kept):
      if sizes[d] == out_shape[p]:
        axes[p] = x.axes[d]
    flags = frozenset(('d', d) for d in idx.routed)
    pairs = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims))
    for p, d in zip(batch_pos, idx_dims):
      tokens = idx.axes[d] | flags
      if d in pairs:
        tokens = tokens | x.axes[pairs[d]]
      axes[p] = tokens
    data, routed = self._common(ins)
    eid = x.eid
    if eid is None and x.iota is not None and x.iota in dn.start_index_map:
      # `jnp.repeat(arange(E), group_sizes)[i]`: reading the index along an E-long axis
      # at positions computed from a decision's choices yields that decision's ids.
      eid = self.latest(idx.routed, src[x.iota])
    return [_Info(tuple(axes), data, routed, eid)]

  def _scatter_any(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    x, idx, upd = ins[0], ins[1], ins[2]
    dn = eqn.params['dimension_numbers']
    axes = list(x.axes)
    window = [d for d in range(len(axes)) if d not in dn.inserted_window_dims
              and d not in dn.operand_batching_dims]
    for p, d in zip(dn.update_window_dims, window):
      axes[d] = axes[d] | upd.axes[p]
    shape = _shape(eqn.outvars[0])
    for d in dn.scatter_dims_to_operand_dims:
      axes[d] = axes[d] | frozenset(('d', r) for r in idx.routed)
      if idx.eid is not None and len(dn.scatter_dims_to_operand_dims) == 1 and (
          shape[d] == self.decision(idx.eid).num_experts):
        axes[d] = axes[d] | {('e', idx.eid)}
    data, routed = self._common(ins)
    return [_Info(tuple(axes), data, routed)]

  # control flow

  def _fixpoint(self, body: Callable[[list[_Info]], list[_Info]], carry: list[_Info]
                ) -> list[_Info]:
    """Joins a loop's carried facts with the body's until nothing changes."""
    for _ in range(16):
      out = body(carry)
      new = [_join(c, o) for c, o in zip(carry, out)]
      if new == carry:
        return new
      carry = new
    return carry

  def _scan(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    p = eqn.params
    jaxpr, consts = _closed(p['jaxpr'])
    nc, nk = _scan_groups(eqn)
    length = p['length']
    xs = ins[nc + nk:]
    for x in xs:
      if not x.data and x.axes:  # a stack of parameters: the scanned axis is a layer axis
        for t in _params_of(x.axes[0]):
          self.scans[t] = length
    sliced = [x._replace(axes=x.axes[1:], iota=None) for x in xs]
    last: list[list[_Info]] = []

    def body(carry: list[_Info]) -> list[_Info]:
      last[:] = [self.run(jaxpr, ins[:nc] + carry + sliced, consts)]
      return last[0][:nk]

    carry = self._fixpoint(body, list(ins[nc:nc + nk]))
    ys = last[0][nk:]
    return carry + [y._replace(axes=(_EMPTY,) + y.axes, iota=None) for y in ys]

  def _while(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    p = eqn.params
    cn, bn = p['cond_nconsts'], p['body_nconsts']
    cond, cond_consts = _closed(p['cond_jaxpr'])
    body_jaxpr, body_consts = _closed(p['body_jaxpr'])
    cconsts, bconsts = ins[:cn], ins[cn:cn + bn]

    def body(carry: list[_Info]) -> list[_Info]:
      self.run(cond, cconsts + carry, cond_consts)
      return self.run(body_jaxpr, bconsts + carry, body_consts)

    return self._fixpoint(body, list(ins[cn + bn:]))

  def _cond(self, eqn: Any, ins: list[_Info]) -> list[_Info]:
    index, ops = ins[0], ins[1:]
    outs = None
    for branch in eqn.params['branches']:
      jaxpr, consts = _closed(branch)
      got = self.run(jaxpr, ops, consts)
      outs = got if outs is None else [_join(a, b) for a, b in zip(outs, got)]
    return [o._replace(data=o.data or index.data, routed=o.routed | index.routed,
                       deps=o.deps | index.deps, free=o.free | index.free,
                       open=o.open | index.open)
            for o in outs or []]


# ---------------------------------------------------------------------------- the API


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _axis_list(axes: Sequence[int]) -> str:
  return ','.join(map(str, sorted(axes)))


def trace_structure(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any
                    ) -> Structure:
  """Each parameter's tier and batch axes, from what `fn` computes with it.

  Traces `fn(params, *args, **kwargs)` to a jaxpr with abstract values (nothing runs
  on data) and follows every parameter leaf through the program, whatever it is
  called and however it is stored (see the module docstring for the rules): the
  parameters that produce the logits of a routing decision (`top_k`, `argmax`,
  `approx_max_k`, an argsort) are the router, those whose axis of length E is batched,
  contracted or gathered per expert are expert banks (that axis a batch axis), the
  axes scanned over by a `scan` of parameters are layer axes (batch axes too), and
  the rest is backbone. A routing decision that dispatches nothing (an `argmax` for an
  accuracy metric) makes no router.

  Args:
    fn: the model's forward or loss function, called as `fn(params, *args, **kwargs)`.
      For Flax NNX, split the model and merge inside: `graphdef, params, rest =
      nnx.split(model, nnx.Param, ...)`, `fn = lambda p, x: nnx.merge(graphdef, p,
      rest)(x)`; for Equinox, pass the model and `lambda m, x: m(x)`.
    params: a pytree whose array leaves (arrays or `jax.ShapeDtypeStruct`s) are the
      parameters; other leaves (an Equinox module's functions) are passed unchanged
      and get no label.
    *args: example inputs (arrays or `jax.ShapeDtypeStruct`s; other leaves static).
    **kwargs: more example inputs, as `args`.

  Returns:
    A `Structure`: `.labels` and `.batch_axes` (trees like `params`) for
    `sj.skewadam(lr, param_labels=..., batch_axes=...)`, `sj.label_table` and
    `sj.memory_report`; `.format()` shows every leaf with its evidence, and
    `.undecided` the leaves the analysis could not decide (labelled backbone).

  Raises:
    TypeError: if `fn` is not callable or `params` has no array leaf.

  Example:
    >>> import jax, jax.numpy as jnp, skewadam_jax as sj
    >>> def forward(p, x):
    ...   probs = jax.nn.softmax(x @ p['w_a'])               # [T, E]
    ...   top, idx = jax.lax.top_k(probs, 1)
    ...   hid = jnp.einsum('td,edf->tef', x, p['w_b'])        # every expert
    ...   mask = jax.nn.one_hot(idx[:, 0], 4) * top
    ...   return jnp.einsum('tef,te->tf', hid, mask) @ p['w_c']
    >>> p = {'w_a': jnp.zeros((8, 4)), 'w_b': jnp.zeros((4, 8, 16)),
    ...      'w_c': jnp.zeros((16, 8))}
    >>> s = sj.trace_structure(forward, p, jax.ShapeDtypeStruct((6, 8), jnp.float32))
    >>> s.labels
    {'w_a': 'router', 'w_b': 'experts', 'w_c': 'backbone'}
    >>> s.batch_axes['w_b']
    (0,)
  """
  if not callable(fn):
    raise TypeError(f'`fn` must be the model\'s forward or loss function, got '
                    f'{type(fn).__name__}.')
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  is_param = [_tree.is_array_like(x) for _, x in flat]
  if not any(is_param):
    raise TypeError('`params` must be a pytree with array (or jax.ShapeDtypeStruct) '
                    f'leaves, got {type(params).__name__} with none.')
  leaves = [x for _, x in flat]
  pidx = [i for i, ok in enumerate(is_param) if ok]
  paths = [_paths.path_str(flat[i][0]) for i in pidx]
  shapes = [tuple(int(d) for d in np.shape(leaves[i])) for i in pidx]
  arg_flat, arg_def = jax.tree_util.tree_flatten((args, kwargs))
  aidx = [i for i, x in enumerate(arg_flat) if _tree.is_array_like(x)]

  def traced(*arrays: Any) -> Any:
    merged = list(leaves)
    for i, a in zip(pidx, arrays[:len(pidx)]):
      merged[i] = a
    inputs = list(arg_flat)
    for i, a in zip(aidx, arrays[len(pidx):]):
      inputs[i] = a
    call_args, call_kwargs = jax.tree_util.tree_unflatten(arg_def, inputs)
    return fn(jax.tree_util.tree_unflatten(treedef, merged), *call_args, **call_kwargs)

  closed = jax.make_jaxpr(traced)(*[_abstract(leaves[i]) for i in pidx],
                                  *[_abstract(arg_flat[i]) for i in aidx])
  jaxpr = closed.jaxpr
  one = [frozenset({k}) for k in range(len(pidx))]
  infos = [_Info(tuple(frozenset({(k, a)}) for a in range(len(shapes[k]))),
                 deps=one[k], free=one[k], open=one[k]) for k in range(len(pidx))]
  infos += [_Info(tuple(frozenset({_INPUT_AXIS}) for _ in _shape(v)), data=True)
            for v in jaxpr.invars[len(pidx):]]

  analysis = _Analysis(shapes)
  analysis.run(jaxpr, infos, closed.consts)  # first pass: the decisions and routers
  for dec, key in enumerate(analysis.order):
    for token in analysis.decisions[key].routers:
      analysis.router_tokens.setdefault(token, set()).add(dec)
  analysis.banks.clear()
  outs = analysis.run(jaxpr, infos, closed.consts)  # second pass: the logits index experts
  analysis.outputs(outs)
  confirmed = analysis.confirmed()
  analysis.cut = {t for t, decs in analysis.router_tokens.items() if decs & confirmed}
  if analysis.cut:  # third pass: which leaves reach the outputs other than via the logits
    analysis.banks.clear()
    outs = analysis.run(jaxpr, infos, closed.consts)
    analysis.outputs(outs)

  read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jex_core.Literal)}
  read |= {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  return _decide(analysis, paths, shapes, [v in read for v in jaxpr.invars[:len(pidx)]],
                 treedef, pidx, len(leaves))


def _decide(analysis: _Analysis, paths: list[str], shapes: list[tuple[int, ...]],
            used: list[bool], treedef: Any, pidx: list[int], n_leaves: int) -> Structure:
  """Turns the analysis' findings into a tier and batch axes per leaf."""
  confirmed = sorted(analysis.confirmed())
  gated = analysis.gated()
  routers: dict[int, set[int]] = {}  # leaf -> confirmed decisions it routes
  candidates: dict[int, set[int]] = {}
  for dec, key in enumerate(analysis.order):
    for leaf, _ in analysis.decisions[key].routers:
      (routers if dec in confirmed else candidates).setdefault(leaf, set()).add(dec)
  # A leaf feeding the logits whose every way to the outputs goes through them (a scale
  # of the router's input) acts on the routing only: router, whatever its axes.
  banked = {leaf for leaf, _ in analysis.banks}
  inputs: dict[int, set[int]] = {}  # leaf -> confirmed decisions it only routes
  for dec in confirmed:
    for leaf in analysis.decision(dec).deps:
      if (leaf in analysis.out_deps and leaf not in analysis.out_free
          and leaf not in routers and leaf not in banked):
        inputs.setdefault(leaf, set()).add(dec)
  rows, undecided = [], {}
  for k, (path, shape) in enumerate(zip(paths, shapes)):
    layers = tuple(sorted(a for (leaf, a) in analysis.scans if leaf == k))
    found = {a: why for (leaf, a), why in analysis.banks.items() if leaf == k}
    notes = []
    if layers:
      notes.append(f'scanned over axis {_axis_list(layers)} (length '
                   f'{", ".join(str(analysis.scans[(k, a)]) for a in layers)})')
    expert_axis = None
    # An axis all of whose pieces are taken (or taken at a loop counter) stacks
    # separate matrices; one row read out of a table does not.
    pieces = sorted(a for (leaf, a), got in analysis.pieces.items() if leaf == k and (
        None in got or got >= set(range(shape[a]))))
    units = {v for decs in gated.get(k, {}).values() for v in decs}
    masker = analysis.decision(min(gated[k])) if units else None
    per_unit = [a for a in pieces if masker and shape[a] == masker.num_experts]
    if k in routers:
      tier = ROUTER
      decs = sorted(routers[k])
      d = analysis.decision(decs[0])
      notes.insert(0, f'produces the logits of {d.primitive} over E={d.num_experts} experts')
    elif k in inputs:
      tier = ROUTER
      d = analysis.decision(min(inputs[k]))
      notes.insert(0, f'reaches the outputs only through the logits of {d.primitive} over '
                   f'E={d.num_experts} experts')
    elif found:
      tier = EXPERTS
      expert_axis = max(sorted(found), key=lambda a: sum(len(v) for v in found[a].values()))
      reasons = sorted(found[expert_axis])
      notes.insert(0, f'axis {expert_axis} (E={shape[expert_axis]}) ' + '; '.join(reasons))
      if len(found) > 1:
        undecided[path] = (f'axes {_axis_list(found)} all index experts; chose axis '
                           f'{expert_axis}')
    elif masker and (len(units) > 1 or None in units) and len(per_unit) == 1:
      # A stacked bank applied unit by unit in a loop (`w[e]` masked by `ids == e`).
      tier, expert_axis = EXPERTS, per_unit[0]
      notes.insert(0, f'axis {expert_axis} (E={masker.num_experts}) taken apart into '
                   f'units, reaching the outputs only through masks of {masker.primitive}\'s '
                   'expert ids')
    elif len(units) == 1 and None not in units:
      # One unit of a bank stored as separate leaves: experts, one matrix (no expert axis).
      tier = EXPERTS
      d = analysis.decision(min(gated[k]))
      notes.insert(0, f'reaches the outputs only for tokens whose {d.primitive} id is '
                   f'{units.pop()} (one unit of E={d.num_experts})')
    else:
      tier = BACKBONE
      notes.insert(0, 'dense')
      if not used[k]:
        undecided[path] = 'fn never reads it'
      elif k in candidates:
        d = analysis.decision(min(candidates[k]))
        if d.unclear:
          undecided[path] = f'produces the scores of {d.primitive}, whose {d.unclear}'
        else:
          undecided[path] = (f'produces the logits of {d.primitive} over {d.num_experts} '
                             'that dispatches no parameter: not a router?')
      elif k in analysis.opaque:
        undecided[path] = ('reaches ' + ', '.join(sorted(analysis.opaque[k])) +
                           ', which the analysis does not see into')
      elif units:
        d = analysis.decision(min(gated[k]))
        ids = ', '.join(sorted('?' if v is None else str(v) for v in units))
        undecided[path] = (f'reaches the outputs only through masks of {d.primitive}\'s '
                           f'expert ids (ids {ids}): which unit it is cannot be told')
      elif k in analysis.unclear:
        undecided[path] = analysis.unclear[k]
    if pieces:
      notes.append(f'axis {_axis_list(pieces)} taken apart into single pieces (separate '
                   'matrices)')
    axes = set(layers) | set(pieces) | ({expert_axis} if expert_axis is not None else set())
    rows.append(LeafStructure(path=path, shape=shape, tier=tier,
                              batch_axes=tuple(sorted(axes)), evidence='; '.join(notes),
                              expert_axis=expert_axis, layer_axes=layers))
  labels: list[Any] = [None] * n_leaves
  batch_axes: list[Any] = [None] * n_leaves
  for i, row in zip(pidx, rows):
    labels[i], batch_axes[i] = row.tier, row.batch_axes
  decisions = []
  for dec in confirmed:
    d = analysis.decision(dec)
    decisions.append(RoutingDecision(
        primitive=d.primitive, num_experts=d.num_experts,
        routers=tuple(paths[k] for k in sorted(set(routers) | set(inputs))
                      if dec in routers.get(k, inputs.get(k, ()))),
        experts=tuple(sorted({paths[leaf] for (leaf, _), why in analysis.banks.items()
                              if any(dec in v for v in why.values())
                              and rows[leaf].tier == EXPERTS} |
                             {paths[leaf] for leaf, decs in gated.items()
                              if dec in decs and rows[leaf].tier == EXPERTS}))))
  return Structure(labels=jax.tree_util.tree_unflatten(treedef, labels),
                   batch_axes=jax.tree_util.tree_unflatten(treedef, batch_axes),
                   leaves=tuple(rows), decisions=tuple(decisions), undecided=undecided)

