"""Contraction rules: `dot_general`, `ragged_dot`, convolutions, linear algebra.

An expert bank's axis of length E meets an expert-indexed axis here: a `dot_general`
batch dimension shared with tokens dispatched by a decision, a batch or contracting
dimension shared with an axis that indexes experts (the router's logits, a one-hot or
scattered combine weights), or the group axis of a `ragged_dot`.

`triangular_solve(a, b)` is read as the product of `a`'s inverse with `b`: batch axes
shared, `a`'s inner axis contracted with `b`'s solved axis. The factorisations
(`cholesky`, `lu`, `qr`, `eigh`, `svd`) keep their operand's batch axes; what they
compute within each matrix mixes both of its axes, which no output axis keeps.
"""

from __future__ import annotations

from typing import Any, Optional

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import primitives as _p

Info = _info.Info
Result = _f.Result

_CONV = _p.find('jax._src.lax.convolution', 'conv_general_dilated_p')


def dot_general(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """Output axes: batch (both operands' tokens), then lhs free, then rhs free."""
  lhs, rhs = ins[0], ins[1]
  (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
  found: list[_f.Finding] = []
  for a, b in zip(lb, rb):
    why = 'batch dim of a dot_general with dispatched tokens'
    found += [_f.Meet(lhs.axes[a], rhs.axes[b], True, why),
              _f.Meet(rhs.axes[b], lhs.axes[a], True, why)]
  for a, b in zip(lc, rc):
    why = 'contracted with expert-indexed weights'
    found += [_f.Meet(lhs.axes[a], rhs.axes[b], False, why),
              _f.Meet(rhs.axes[b], lhs.axes[a], False, why)]
  for a, b in (*zip(lb, rb), *zip(lc, rc)):
    found += [_f.NearRouted(lhs.axes[a], rhs), _f.NearRouted(rhs.axes[b], lhs)]
  # A parameter (its own values, not activations its axes reached) contracted with
  # activations: a layer's matrix, whose output is the last layer's until another.
  last = set()
  for mine, other, dims, batch in ((lhs, rhs, lc, lb), (rhs, lhs, rc, rb)):
    if mine.data:
      continue
    kept = _matrix_axes(mine, dims, batch)
    if other.data:
      for d in dims:
        found.append(_f.Used(kept[d], 'contracted', eqn))
        last |= {leaf for leaf, _ in _info.params_of(kept[d])}
    elif any(_info.params_of(other.axes[d]) for d in (lc if mine is rhs else rc)):
      # a learned input (a probe, a query) through this matrix
      found += [_f.Used(kept[d], 'contracted', eqn) for d in dims]
  # A batch dimension both of whose operands' axes come from parameters: per-slice
  # matrices on per-slice activations (a `vmap` over stacked layers lowered).
  axes = [lhs.axes[a] | rhs.axes[b] | (
      {_info.BATCHED} if _info.params_of(lhs.axes[a]) and _info.params_of(rhs.axes[b])
      else _info.EMPTY) for a, b in zip(lb, rb)]
  axes += [t for i, t in enumerate(lhs.axes) if i not in lc and i not in lb]
  axes += [t for i, t in enumerate(rhs.axes) if i not in rc and i not in rb]
  data, routed = _info.common(ins)
  return Result([Info(tuple(axes), data, routed, last=frozenset(last) if last else None)],
                found)


def _matrix_axes(mine: Info, dims: Any, batch: Any) -> tuple[frozenset, ...]:
  """`mine`'s axes with, on its contracted `dims`, only the leaves that also own one of
  its free axes (a matrix: one side contracted, the other kept): a bias `[H, hd]` added
  to a query contracts its `hd` with the keys, but leaves nothing of its own beside
  it. An operand with no free axis (a vector contracted whole) keeps them all."""
  free = [t for i, t in enumerate(mine.axes) if i not in dims and i not in batch]
  if not free:
    return mine.axes
  owners = {leaf for t in free for leaf, _ in _info.params_of(t)}
  return tuple(t if i not in dims else frozenset(
      x for x in t if not isinstance(x, _info.Param) or x.leaf in owners)
      for i, t in enumerate(mine.axes))


def ragged_dot_general(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`ragged_dot`: the rhs group axis, sized by routed group sizes, is a bank's."""
  lhs, rhs, sizes = ins[0], ins[1], ins[2]
  numbers = eqn.params['ragged_dot_dimension_numbers']
  (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
  groups = tuple(numbers.rhs_group_dimensions)
  found: list[_f.Finding] = []
  for g in groups:
    n = _info.shape_of(eqn.invars[1])[g]
    dec = an.latest(sizes.routed, n)
    found += [_f.Bank(t, dec, 'group axis of a ragged_dot') for t in _info.params_of(rhs.axes[g])
              if an.shapes[t.leaf][t.axis] == n]
  axes = [lhs.axes[a] | rhs.axes[b] for a, b in zip(lb, rb)]
  axes += [t for i, t in enumerate(lhs.axes) if i not in lc and i not in lb]
  axes += [t for i, t in enumerate(rhs.axes) if i not in rc and i not in rb
           and i not in groups]
  data, routed = _info.common(ins)
  if len(axes) != len(_info.shape_of(eqn.outvars[0])):
    axes = list(_info.blank(len(_info.shape_of(eqn.outvars[0]))).axes)
  last, used = _contracted(eqn, lhs, rhs, rc)
  return Result([Info(tuple(axes), data, routed, last=last)], found + used)


def _contracted(eqn: Any, lhs: Info, rhs: Info, dims: Any
                ) -> tuple[Optional[frozenset], list[_f.Finding]]:
  """A parameter's own values (`rhs`) contracted with activations (`lhs`) over `dims`:
  its leaves are the last layer's (None if not such a contraction), and their use."""
  if not lhs.data or rhs.data:
    return None, []
  # a convolution of the raw inputs (ViT's patches): an input layer
  use = 'input' if not lhs.deps and eqn.primitive in _CONV else 'contracted'
  last = frozenset(leaf for d in dims for leaf, _ in _info.params_of(rhs.axes[d]))
  return last or None, [_f.Used(rhs.axes[d], use, eqn) for d in dims]


def conv_general_dilated(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """A convolution: batch and positions from the input, output features from the
  kernel."""
  lhs, rhs = ins[0], ins[1]
  lspec, rspec, ospec = eqn.params['dimension_numbers']
  axes = [_info.EMPTY] * len(_info.shape_of(eqn.outvars[0]))
  axes[ospec[0]] = lhs.axes[lspec[0]]
  axes[ospec[1]] = rhs.axes[rspec[0]]
  for o, i in zip(ospec[2:], lspec[2:]):  # positions (patches) from the input's positions
    axes[o] = lhs.axes[i]
  data, routed = _info.common(ins)
  last, used = _contracted(eqn, lhs, rhs, rspec[1:])
  return Result([Info(tuple(axes), data, routed, last=last)], used)


def triangular_solve(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`x = solve(a, b)` (`a x = b`, or `x a = b` without `left_side`): `b`'s shape.

  The leading axes of `a` and `b` are batch axes (joined, as a `dot_general`'s); `x`'s
  solved axis (its rows with `left_side`, else its columns) is `a`'s outer axis (the one
  `op(a)` keeps, `op` transposing when `transpose_a`), and `a`'s inner axis is contracted
  with `b`'s solved axis. Its values depend on both operands.
  """
  a, b = ins[0], ins[1]
  p = eqn.params
  n = len(b.axes)
  solved = n - 2 if p['left_side'] else n - 1
  # op(a) x = b: x's solved axis runs along op(a)'s columns, contracted with b's
  # solved axis along op(a)'s rows (x op(a) = b: the other way round).
  rows, cols = (n - 1, n - 2) if p['transpose_a'] else (n - 2, n - 1)
  outer, inner = (cols, rows) if p['left_side'] else (rows, cols)
  axes, found = list(b.axes), []
  for d in range(n - 2):
    why = 'batch dim of a triangular_solve with dispatched tokens'
    found += [_f.Meet(a.axes[d], b.axes[d], True, why), _f.Meet(b.axes[d], a.axes[d], True, why)]
    axes[d] = a.axes[d] | b.axes[d]
  why = 'contracted with expert-indexed values (triangular_solve)'
  found += [_f.Meet(a.axes[inner], b.axes[solved], False, why),
            _f.Meet(b.axes[solved], a.axes[inner], False, why),
            _f.NearRouted(a.axes[inner], b), _f.NearRouted(b.axes[solved], a)]
  axes[solved] = a.axes[outer]
  data, routed = _info.common(ins)
  # `a` contracted with activations `b`, else `b` with activations `a` (both kept used)
  last, used = _contracted(eqn, b, a, (inner,))
  if last is None:
    last, more = _contracted(eqn, a, b, (solved,))
    used = used + more
  return Result([Info(tuple(axes), data, routed, last=last)], found + used)


def factorisation(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`cholesky`, `lu`, `qr`, `eigh`, `svd`: each output keeps the operand's batch axes
  (all but its last two); its other axes carry no parameter axis (a factor mixes both
  axes of each matrix)."""
  del an
  x = ins[0]
  batch = x.axes[:len(x.axes) - 2]
  outs = []
  for v in eqn.outvars:
    rank = len(_info.shape_of(v))
    axes = batch[:rank] + (_info.EMPTY,) * max(0, rank - len(batch))
    outs.append(Info(axes, x.data, x.routed))
  return Result(outs)
