"""Selection and reduction rules: where routing decisions are made.

A **routing decision** is a `top_k`, `approx_max_k`, `argmax`/`argmin` or a `sort`
(argsort) whose operand has an expert axis: one a parameter's axis reaches and no input's
axis does. Token choice selects along it (the indices are expert ids); expert choice
selects along the token axis and the expert axis is another (the indices are token
positions). The parameters whose axes reach the expert axis are its routers.

A selection within a part of an expert axis split by a reshape (the groups of a
group-limited router, `[T, G, E/G]`) is no decision of its own: the decision is the
selection over the whole axis, after the reshape back. Any other selection among values
computed from parameters that makes no decision is recorded (`Analysis.blind`): the
leaves it depends on are reported undecided, with a warning.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import primitives as _p

Info = _info.Info
Result = _f.Result
EMPTY = _info.EMPTY

# The reductions that select (an index along one axis): they may make a decision.
_ARG = frozenset(_p.find(_p.LAX, 'argmax_p', 'argmin_p'))


def decide_along(an: _analysis.Analysis, eqn: Any, prim: str, operand: Info, axis: int,
                 shape: Sequence[int]) -> tuple[Optional[int], bool, list[_f.Finding]]:
  """The routing decision selecting along `axis` of `operand` makes, if any.

  Returns the decision, whether its indices are expert ids, and the findings (the
  decision, the axes it is made per slice of, or a selection that decides nothing).
  The expert axis is the one a router's parameter produces (its kernel's output axis)
  and no input's axis reaches. Token choice selects along it. Expert choice selects
  along the token axis (an input's axis, or no parameter's) while another axis is the
  expert axis: its indices are token positions, grouped by that axis.
  """
  if operand.eid is not None:  # sorting expert ids (dispatch), not choosing them
    return None, False, []

  def clean(a: int) -> bool:
    return bool(_info.params_of(operand.axes[a])) and _info.INPUT_AXIS not in operand.axes[a]

  if _info.of_kind(operand.axes[axis], _info.Split) and not clean(axis):
    return None, False, []  # within the groups of a split expert axis: no decision of its own
  # Axes along which decisions are made per slice (found at an earlier decision, or
  # aligned with one) are no candidate expert axes.
  others = [a for a in range(len(shape)) if a != axis and clean(a) and shape[a] > 1
            and not an.is_mapped(operand.axes[a])]
  unclear, found = '', []
  batched = [a for a in others if _info.BATCHED in operand.axes[a]]
  if not clean(axis) and len(others) - len(batched) == 1:
    # Expert choice with more parameter axes: the expert axis is the one the router's
    # kernel alone produces; an axis its input runs along too (a batch dimension of the
    # contraction making the scores) is one of decisions made per slice.
    found += [_f.MapAxes(operand.axes[a], shape[a]) for a in batched]
    others = [a for a in others if a not in batched]
  if clean(axis) and others:
    # Logits with more parameter axes besides the one selected along (`[L, T, E]`:
    # routers stacked and applied at once, a `vmap` over layers lowered into the jaxpr):
    # one decision per slice of those axes. They are batch axes, of every parameter
    # whose axis runs along them (`Analysis.map_axes`, spread by `Analysis.depend`).
    found += [_f.MapAxes(operand.axes[a], shape[a]) for a in others]
    expert, ids = axis, True
  elif clean(axis):
    expert, ids = axis, True
  elif len(others) == 1:
    expert, ids = others[0], False
  elif others:
    expert, ids = None, False
    unclear = (f'axes {_info.axis_list(others)} of its operand all come from parameters '
               'and none from the inputs: which one indexes the experts cannot be told')
  elif _info.params_of(operand.axes[axis]):  # the logits also take input data (noise)
    expert, ids = axis, True
  else:
    blind = operand.deps and not operand.routed
    return None, False, [_f.Blind(prim, eqn, operand.deps)] if blind else []
  routers = tuple(t for a in ([expert] if expert is not None else others)
                  for t in _info.params_of(operand.axes[a]))
  found.append(_f.Decided(eqn, prim, shape[expert] if expert is not None else -1, ids,
                          unclear, routers, operand.deps))
  return (*an.decision_of(eqn, ids), found)


def reduce(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """Reductions drop their axes; an `argmax`/`argmin` over one axis may decide."""
  x = ins[0]
  drop = set(eqn.params['axes'])
  axes = tuple(a for i, a in enumerate(x.axes) if i not in drop)
  if eqn.primitive in _ARG and len(drop) == 1:
    (axis,) = drop
    dec, ids, found = decide_along(an, eqn, eqn.primitive.name, x, axis,
                                   _info.shape_of(eqn.invars[0]))
    if dec is not None:
      return Result([Info(axes, x.data, x.routed | {dec}, dec if ids else None)], found)
    return Result([Info(axes, x.data, x.routed)], found)
  return Result([Info(axes, x.data, x.routed)])


def _select(an: _analysis.Analysis, eqn: Any, ins: list[Info], axis: int) -> Result:
  """top_k-like: values and indices of the best `k` along `axis`."""
  x = ins[0]
  axes = tuple(EMPTY if i == axis else a for i, a in enumerate(x.axes))
  dec, ids, found = decide_along(an, eqn, eqn.primitive.name, x, axis,
                                 _info.shape_of(eqn.invars[0]))
  if dec is None:
    return Result([Info(axes, x.data, x.routed) for _ in eqn.outvars], found)
  routed = x.routed | {dec}
  return Result([Info(axes, x.data, routed), Info(axes, x.data, routed, dec if ids else None)],
                found)


def top_k(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  ndim = len(_info.shape_of(eqn.invars[0]))
  return _select(an, eqn, ins, eqn.params.get('axis', -1) % ndim)


def approx_top_k(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  ndim = len(_info.shape_of(eqn.invars[0]))
  return _select(an, eqn, ins, eqn.params.get('reduction_dimension', -1) % ndim)


def sort(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`sort` of keys and their companions: an argsort of logits decides; sorting by
  expert ids (or values computed from them) dispatches along the sorted axis."""
  dim, nkeys = eqn.params['dimension'], eqn.params.get('num_keys', 1)
  data, routed = _info.common(ins)
  axes = [frozenset().union(*(x.axes[ax] for x in ins)) if ax != dim else EMPTY
          for ax in range(len(ins[0].axes))]
  keys = ins[:nkeys]
  dec, ids, found = None, False, []
  for k in keys:
    dec, ids, here = decide_along(an, eqn, 'sort', k, dim, _info.shape_of(eqn.invars[0]))
    found += here
    if dec is not None:
      break
  if dec is not None:  # argsort of the logits: the permutation holds expert ids
    routed = routed | {dec}
    return Result([Info(tuple(axes), data, routed, dec if ids and x.iota == dim else None)
                   for x in ins], found)
  keyed = frozenset().union(*(k.routed for k in keys))
  if keyed:  # sorting by routed keys (expert ids) dispatches along `dim`
    axes[dim] = frozenset(_info.Dispatched(d) for d in keyed)
  return Result([Info(tuple(axes), data, routed, x.eid if i < nkeys else None)
                 for i, x in enumerate(ins)], found)


def cumulative(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`cumsum` and its kin (capacity positions): every axis keeps its tokens."""
  del an, eqn
  x = ins[0]
  return Result([Info(x.axes, x.data, x.routed)])
