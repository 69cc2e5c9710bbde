"""Elementwise rules: every output axis derives from the operands' axes at its position.

Where two operands' axes line up (`x * w`, `h + b`), a parameter axis of length E
meeting an expert-indexed axis is an expert bank's axis (`Analysis.meet`). Expert ids
survive index arithmetic with constants (`where(i < 0, i + E, i)`), and comparing them
with an iota along an E-long axis makes a one-hot whose axis indexes the experts.
"""

from __future__ import annotations

from typing import Any

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import primitives as _p
from skewadam_jax.structure.traced.rules import calls as _calls

Info = _info.Info
Result = _f.Result

# What jax batches as an elementwise op but that reads no values here (conversions of
# extended dtypes, staging plumbing: left to NO_RULE, see `rules.WITHOUT_RULE`).
_NOT_ELEMENTWISE = _p.find(_p.LAX, 'from_edtype_p', 'to_edtype_p', 'stage_p', 'tie_p')
# Elementwise here though jax batches them otherwise (or some jax version does): n-ary
# and converting ops, and identities on values (names, sharding annotations, per-device
# collectives whose output has the operand's shape: `psum` inside a `shard_map`).
_ALSO = (
    *_p.find(_p.LAX, 'clamp_p', 'convert_element_type_p', 'copy_p', 'select_n_p',
             'optimization_barrier_p', 'log2_p', 'one_minus_square_p'),
    *_p.find(_p.SPECIAL, 'random_gamma_grad_p'),
    *_p.find('jax._src.random', 'random_gamma_grad_p'),
    *_p.find(_p.AD_UTIL, 'stop_gradient_p'),
    *_p.find(_p.CHECKPOINT, 'name_p'),
    *_p.find(_p.CORE, 'pvary_p'),
    *_p.find(_p.PARALLEL, 'pvary_p', 'pbroadcast_p', 'pmax_p', 'pmin_p', 'ppermute_p',
             'psum_p'),
    *_p.find(_p.PJIT, 'sharding_constraint_p', 'mesh_cast_p', 'reshard_p'),
    *_p.find('jax._src.dispatch', 'device_put_p'))


def primitives() -> frozenset:
  """The elementwise primitives (operands broadcast to one shape), whatever their maths:
  those of `lax` and `lax.special` that jax batches as elementwise ops, and `_ALSO`."""
  derived = _p.batched_elementwise(_p.LAX, _p.SPECIAL) - frozenset(_NOT_ELEMENTWISE)
  return derived | frozenset(_ALSO)


# Elementwise primitives whose output still holds expert ids when one operand does and
# the others are constants (index normalisation `where(i < 0, i + E, i)`, clipping).
ID_PRESERVING = frozenset({
    *_p.find(_p.LAX, 'add_p', 'sub_p', 'max_p', 'min_p', 'clamp_p', 'select_n_p',
             'convert_element_type_p', 'copy_p', 'rem_p', 'reduce_precision_p',
             'optimization_barrier_p'),
    *_p.find(_p.AD_UTIL, 'stop_gradient_p'), *_p.find(_p.CORE, 'pvary_p'),
    *_p.find(_p.PARALLEL, 'pvary_p'), *_p.find(_p.CHECKPOINT, 'name_p')})
# (`eq_to`, `lt_to`, `le_to`: total-order comparisons, as in searchsorted)
COMPARISONS = frozenset(_p.find(_p.LAX, 'eq_p', 'ne_p', 'lt_p', 'le_p', 'gt_p', 'ge_p',
                                'eq_to_p', 'lt_to_p', 'le_to_p'))
_SELECT_N = _p.find(_p.LAX, 'select_n_p')


def elementwise(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """Each output axis joins the operands' axes of the same length at its position."""
  if not _info.elementwise_shapes(eqn):  # a bitcast to another width: no rule reads it
    return _calls.unreadable(an, eqn, ins)
  prim = eqn.primitive
  shape = _info.shape_of(eqn.outvars[0])
  shapes = [_info.shape_of(v) for v in eqn.invars]
  axes, found = [], []
  for ax, n in enumerate(shape):
    here = [(x, x.axes[ax]) for x, s in zip(ins, shapes) if len(s) == len(shape)
            and s[ax] == n and len(x.axes) == len(shape)]
    axes.append(frozenset().union(*(t for _, t in here)))
    if len(here) > 1 and n > 1:
      for i, (_, mine) in enumerate(here):
        for j, (x, other) in enumerate(here):
          if i != j:
            found += [_f.Meet(mine, other, False, f'{prim.name} with an expert-indexed axis'),
                      _f.NearRouted(mine, x)]
  data, routed = _info.common(ins)
  if data:  # a parameter's own values (any broadcast) added to or scaling activations
    for y in ins:
      if not y.data:
        found += [_f.Used(tokens, 'aligned', eqn) for tokens in y.axes]
  eid = iota = None
  columns: tuple = ()
  if prim in ID_PRESERVING:
    values = ins[1:] if prim in _SELECT_N else ins
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
  return Result([Info(tuple(axes), data, routed, eid, iota, columns=columns)
                 for _ in eqn.outvars], found)


def iota(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`iota`: the index along one axis (compared with expert ids, a one-hot)."""
  del an, ins
  return Result([_info.blank(len(_info.shape_of(eqn.outvars[0])))._replace(
      iota=eqn.params['dimension'])])
