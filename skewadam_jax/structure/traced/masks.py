"""Expert-id masks: values that are zero unless a token's expert id is one constant.

`ids == 2` (a decision's expert ids against a constant) or column 2 of a one-hot of
them is zero wherever a token's unit is not unit 2; `ids != 2` is its negation. A leaf
whose every way to the outputs goes through such a mask acts on unit 2's tokens only:
one unit of a bank stored apart (`for e in range(E): y += where(ids == e, x @ w[e], 0)`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from skewadam_jax.core.lazy import jex_core
import numpy as np

from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import primitives as _p

# Primitives whose output is zero wherever their first operand is (layout, dtype, sums):
# an expert-id mask stays one through them.
MASK_KEEPING = frozenset({
    *_p.find(_p.LAX, 'broadcast_in_dim_p', 'reshape_p', 'transpose_p', 'squeeze_p',
             'expand_dims_p', 'rev_p', 'convert_element_type_p', 'copy_p', 'reduce_sum_p',
             'reduce_max_p', 'reduce_precision_p'),
    *_p.find(_p.SLICING, 'slice_p', 'dynamic_slice_p', 'gather_p'),
    *_p.find(_p.CORE, 'pvary_p'), *_p.find(_p.PARALLEL, 'pvary_p'),
    *_p.find(_p.CHECKPOINT, 'name_p'), *_p.find(_p.AD_UTIL, 'stop_gradient_p')})
_EQ, _NE, _NOT, _SELECT_N = (_p.find(_p.LAX, f'{n}_p') for n in ('eq', 'ne', 'not', 'select_n'))
_SLICE = _p.find(_p.SLICING, 'slice_p')
DOT = _p.find(_p.LAX, 'dot_general_p')
# Products: a mask of one operand masks the others' leaves.
_PRODUCTS = frozenset({*_p.find(_p.LAX, 'mul_p', 'and_p'), *DOT})

# leaf -> decision -> the ids of the masks its every way to the outputs goes through
Masked = dict[int, dict[int, set[Optional[int]]]]


def masks(eqn: Any, ins: Sequence[_info.Info], masked: Masked
          ) -> tuple[frozenset, frozenset, frozenset]:
  """The expert-id masks of an equation's output, and the leaves reaching it not through one.

  A product with a mask (`mul`, `dot_general`), the case a `select_n` by one takes for
  unit 2, or case 2 of a `select_n` by the ids themselves lets the other operands'
  leaves reach the output only for those tokens: they are recorded in `masked` as
  masked by (decision, 2) and leave `open`.

  Args:
    eqn: the equation.
    ins: its operands' facts.
    masked: leaf -> decision -> mask ids, updated in place.

  Returns:
    (mask, negated mask, open) of the output.
  """
  prim = eqn.primitive
  open_ = frozenset().union(*(x.open for x in ins))
  mask = unmask = _info.EMPTY
  if prim in (*_EQ, *_NE) and len(ins) == 2:
    pairs = list(zip(ins, eqn.invars))
    for (a, _), (b, var) in (pairs, pairs[::-1]):
      if a.eid is not None and b.eid is None and b.iota is None and not (
          b.data or b.routed or b.deps or any(b.axes)):
        value = var.val if isinstance(var, jex_core.Literal) else None
        found = frozenset({(a.eid, int(value) if value is not None and np.ndim(value) == 0
                            else None)})
        mask, unmask = (found, _info.EMPTY) if prim in _EQ else (_info.EMPTY, found)
  elif prim in _NOT:
    mask, unmask = ins[0].unmask, ins[0].mask
  elif prim in _SLICE:  # a column of a one-hot of the ids
    src, dst = _info.shape_of(eqn.invars[0]), _info.shape_of(eqn.outvars[0])
    mask = ins[0].mask | frozenset(
        (dec, start) for tokens, n, m, start in zip(ins[0].axes, src, dst,
                                                    eqn.params['start_indices'])
        if n > 1 and m == 1 for dec in _info.decisions_of(tokens, _info.Experts))
    unmask = ins[0].unmask
  elif prim in MASK_KEEPING:
    mask, unmask = ins[0].mask, ins[0].unmask
  elif prim in _SELECT_N and len(ins) == 3 and (ins[0].mask or ins[0].unmask):
    # select_n(pred, on_false, on_true): the case taken for unit 2 is masked by it.
    unit = 2 if ins[0].mask else 1
    other = ins[3 - unit]
    if not (other.deps or other.data):  # zero (a constant) for the other units
      mask = (ins[0].mask or ins[0].unmask) | ins[unit].mask
    open_ = ins[0].open | other.open
    _mask_leaves(masked, ins[0].mask or ins[0].unmask, [ins[unit]])
  elif prim in _SELECT_N and ins[0].eid is not None:  # `select_n(ids, *per_unit)`
    open_ = ins[0].open
    for unit, x in enumerate(ins[1:]):
      _mask_leaves(masked, frozenset({(ins[0].eid, unit)}), [x])
  elif prim in _PRODUCTS:
    mask = frozenset().union(*(x.mask for x in ins))
    gates = [i for i, x in enumerate(ins) if x.mask]
    if gates:
      open_ = frozenset().union(*(ins[i].open for i in gates))
      _mask_leaves(masked, frozenset().union(*(ins[i].mask for i in gates)),
                   [x for i, x in enumerate(ins) if i not in gates])
  return mask, unmask, open_


def _mask_leaves(masked: Masked, found: frozenset, gated: Sequence[_info.Info]) -> None:
  """The leaves reaching `gated` not through a mask now reach on through `found`."""
  for dec, value in found:
    for x in gated:
      for leaf in x.open:
        masked.setdefault(leaf, {}).setdefault(dec, set()).add(value)


def aligned(eqn: Any, x: _info.Info, var: Any, hot: list[bool], cut: set) -> bool:
  """Whether operand `var` supplies a non-trivial output axis flagged in `hot`.

  `cut` holds the router axes of dispatching decisions: an operand carrying one of them
  is aligned with the logits whatever its layout.
  """
  if any(cut.intersection(t) for t in x.axes):
    return True
  shape = _info.shape_of(var)
  if eqn.primitive not in DOT:
    return any(h and n > 1 for h, n in zip(hot, shape)) if len(shape) == len(hot) else False
  (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
  lhs = var is eqn.invars[0]
  batch, contract = (lb, lc) if lhs else (rb, rc)
  nl = len(_info.shape_of(eqn.invars[0]))
  free_l = [i for i in range(nl) if i not in lc and i not in lb]
  start = len(lb) + (0 if lhs else len(free_l))
  free_dims = [i for i in range(len(shape)) if i not in contract and i not in batch]
  positions = list(range(len(lb))) + [start + j for j in range(len(free_dims))]
  return any(hot[p] for p in positions if p < len(hot))
