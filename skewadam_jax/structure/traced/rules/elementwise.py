"""Elementwise rules: every output axis derives from the operands' axes at its position.

Where two operands' axes line up (`x * w`, `h + b`), a parameter axis of length E
meeting an expert-indexed axis is an expert bank's axis (`Analysis.meet`). Expert ids
survive index arithmetic with constants (`where(i < 0, i + E, i)`), and comparing them
with an iota along an E-long axis makes a one-hot whose axis indexes the experts.
"""

from __future__ import annotations

from typing import Any

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced.rules import calls as _calls

Info = _info.Info

# The elementwise primitives (operands broadcast to one shape), whatever their maths.
NAMES = (
    'abs', 'acos', 'acosh', 'add', 'and', 'asin', 'asinh', 'atan', 'atan2', 'atanh',
    'bessel_i0e', 'bessel_i1e', 'cbrt', 'ceil', 'clamp', 'clz', 'complex', 'conj',
    'convert_element_type', 'copy', 'copy_p', 'cos', 'cosh', 'digamma', 'div', 'eq', 'erf',
    'eq_to', 'erf_inv', 'erfc', 'exp', 'exp2', 'expm1', 'floor', 'ge', 'gt', 'igamma',
    'igamma_grad_a', 'igammac', 'imag', 'integer_pow', 'is_finite', 'le', 'le_to', 'lgamma',
    'log', 'log1p', 'log2', 'logistic', 'lt', 'lt_to', 'max', 'min', 'mul', 'mulhi', 'ne',
    'neg', 'nextafter', 'not', 'one_minus_square', 'or',
    'polygamma', 'population_count', 'pow', 'random_gamma_grad', 'real',
    'reduce_precision', 'regularized_incomplete_beta', 'rem', 'round', 'rsqrt',
    'select_n', 'shift_left', 'shift_right_arithmetic', 'shift_right_logical', 'sign',
    'sin', 'sinh', 'sqrt', 'square', 'stop_gradient', 'sub', 'tan', 'tanh', 'xor', 'zeta',
    # identities on values: names, sharding annotations, per-device collectives whose
    # output has the operand's shape (`psum` inside a `shard_map`)
    'name', 'optimization_barrier', 'pbroadcast', 'pmax', 'pmin', 'ppermute', 'psum',
    'pvary', 'sharding_constraint', 'mesh_cast', 'reshard', 'device_put',
    'bitcast_convert_type')

# Elementwise primitives whose output still holds expert ids when one operand does and
# the others are constants (index normalisation `where(i < 0, i + E, i)`, clipping).
ID_PRESERVING = frozenset({
    'add', 'sub', 'max', 'min', 'clamp', 'select_n', 'convert_element_type', 'copy',
    'copy_p', 'rem', 'stop_gradient', 'reduce_precision', 'pvary', 'optimization_barrier',
    'name'})
# (`eq_to`, `lt_to`, `le_to`: jax >= 0.12's total-order comparisons, as in searchsorted)
COMPARISONS = frozenset({'eq', 'ne', 'lt', 'le', 'gt', 'ge', 'eq_to', 'lt_to', 'le_to'})


@_analysis.keeps_positions
def elementwise(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> list[Info]:
  """Each output axis joins the operands' axes of the same length at its position."""
  if not _info.elementwise_shapes(eqn):  # a bitcast to another width: no rule reads it
    return _calls.unreadable(an, eqn, ins)
  prim = eqn.primitive.name
  shape = _info.shape_of(eqn.outvars[0])
  shapes = [_info.shape_of(v) for v in eqn.invars]
  axes = []
  for ax, n in enumerate(shape):
    here = [(x, x.axes[ax]) for x, s in zip(ins, shapes) if len(s) == len(shape)
            and s[ax] == n and len(x.axes) == len(shape)]
    axes.append(frozenset().union(*(t for _, t in here)))
    if len(here) > 1 and n > 1:
      for i, (_, mine) in enumerate(here):
        for j, (x, other) in enumerate(here):
          if i != j:
            an.meet(mine, other, False, f'{prim} with an expert-indexed axis')
            an.near_routed(mine, x)
  data, routed = _info.common(ins)
  if data:  # a parameter's own values (any broadcast) added to or scaling activations
    for y in ins:
      if not y.data:
        for tokens in y.axes:
          an.used(tokens, 'aligned', eqn)
  eid = iota = None
  columns: tuple = ()
  if prim in ID_PRESERVING:
    values = ins[1:] if prim == 'select_n' else ins
    ids = {x.eid for x in values if x.eid is not None}
    others_const = all(x.eid is not None or (not x.data and not x.routed and not any(
        x.axes)) for x in values)
    if len(ids) == 1 and others_const:
      eid = ids.pop()
    if len(ins) == 1:
      iota, columns = ins[0].iota, ins[0].columns
  if prim in COMPARISONS and len(ins) == 2:
    for a, b in ((ins[0], ins[1]), (ins[1], ins[0])):
      if a.eid is not None and b.iota is not None:
        e = an.decision(a.eid).num_experts
        if shape[b.iota] == e:  # a one-hot of the expert ids along the iota's axis
          axes[b.iota] = axes[b.iota] | {_info.Experts(a.eid)}
  return [Info(tuple(axes), data, routed, eid, iota, columns=columns) for _ in eqn.outvars]


def iota(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> list[Info]:
  """`iota`: the index along one axis (compared with expert ids, a one-hot)."""
  del an, ins
  return [_info.blank(len(_info.shape_of(eqn.outvars[0])))._replace(
      iota=eqn.params['dimension'])]
