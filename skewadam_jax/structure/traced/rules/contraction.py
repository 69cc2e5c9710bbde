"""Contraction rules: `dot_general`, `ragged_dot`, convolutions.

An expert bank's axis of length E meets an expert-indexed axis here: a `dot_general`
batch dimension shared with tokens dispatched by a decision, a batch or contracting
dimension shared with an axis that indexes experts (the router's logits, a one-hot or
scattered combine weights), or the group axis of a `ragged_dot`.
"""

from __future__ import annotations

from typing import Any, Optional

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import info as _info

Info = _info.Info


def dot_general(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> list[Info]:
  """Output axes: batch (both operands' tokens), then lhs free, then rhs free."""
  lhs, rhs = ins[0], ins[1]
  (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
  for a, b in zip(lb, rb):
    why = 'batch dim of a dot_general with dispatched tokens'
    an.meet(lhs.axes[a], rhs.axes[b], True, why)
    an.meet(rhs.axes[b], lhs.axes[a], True, why)
  for a, b in zip(lc, rc):
    why = 'contracted with expert-indexed weights'
    an.meet(lhs.axes[a], rhs.axes[b], False, why)
    an.meet(rhs.axes[b], lhs.axes[a], False, why)
  for a, b in (*zip(lb, rb), *zip(lc, rc)):
    an.near_routed(lhs.axes[a], rhs)
    an.near_routed(rhs.axes[b], lhs)
  # A parameter (its own values, not activations its axes reached) contracted with
  # activations: a layer's matrix, whose output is the last layer's until another.
  last = set()
  for mine, other, dims in ((lhs, rhs, lc), (rhs, lhs, rc)):
    if other.data and not mine.data:
      for d in dims:
        an.used(mine.axes[d], 'contracted', eqn)
        last |= {leaf for leaf, _ in _info.params_of(mine.axes[d])}
  axes = [lhs.axes[a] | rhs.axes[b] for a, b in zip(lb, rb)]
  axes += [t for i, t in enumerate(lhs.axes) if i not in lc and i not in lb]
  axes += [t for i, t in enumerate(rhs.axes) if i not in rc and i not in rb]
  data, routed = _info.common(ins)
  return [Info(tuple(axes), data, routed, last=frozenset(last) if last else None)]


def ragged_dot_general(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> list[Info]:
  """`ragged_dot`: the rhs group axis, sized by routed group sizes, is a bank's."""
  lhs, rhs, sizes = ins[0], ins[1], ins[2]
  numbers = eqn.params['ragged_dot_dimension_numbers']
  (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
  groups = tuple(numbers.rhs_group_dimensions)
  for g in groups:
    n = _info.shape_of(eqn.invars[1])[g]
    dec = an.latest(sizes.routed, n)
    for t in _info.params_of(rhs.axes[g]):
      if an.shapes[t[0]][t[1]] == n:
        an.bank(t, dec, 'group axis of a ragged_dot')
  axes = [lhs.axes[a] | rhs.axes[b] for a, b in zip(lb, rb)]
  axes += [t for i, t in enumerate(lhs.axes) if i not in lc and i not in lb]
  axes += [t for i, t in enumerate(rhs.axes) if i not in rc and i not in rb
           and i not in groups]
  data, routed = _info.common(ins)
  if len(axes) != len(_info.shape_of(eqn.outvars[0])):
    axes = list(_info.blank(len(_info.shape_of(eqn.outvars[0]))).axes)
  return [Info(tuple(axes), data, routed, last=_contracted(an, eqn, lhs, rhs, rc))]


def _contracted(an: _analysis.Analysis, eqn: Any, lhs: Info, rhs: Info, dims: Any
                ) -> Optional[frozenset]:
  """A parameter's own values (`rhs`) contracted with activations (`lhs`) over `dims`:
  recorded, and its leaves are the last layer's (None if not such a contraction)."""
  if not lhs.data or rhs.data:
    return None
  for d in dims:
    an.used(rhs.axes[d], 'contracted', eqn)
  last = frozenset(leaf for d in dims for leaf, _ in _info.params_of(rhs.axes[d]))
  return last or None


def conv_general_dilated(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> list[Info]:
  """A convolution: batch from the input, output features from the kernel."""
  lhs, rhs = ins[0], ins[1]
  lspec, rspec, ospec = eqn.params['dimension_numbers']
  axes = [_info.EMPTY] * len(_info.shape_of(eqn.outvars[0]))
  axes[ospec[0]] = lhs.axes[lspec[0]]
  axes[ospec[1]] = rhs.axes[rspec[0]]
  data, routed = _info.common(ins)
  return [Info(tuple(axes), data, routed, last=_contracted(an, eqn, lhs, rhs, rspec[1:]))]
