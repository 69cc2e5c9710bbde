"""Shape rules: layout ops move the operand's axes and keep their tokens.

A parameter axis stays one through `transpose`, `broadcast_in_dim`, slices and a
`reshape` that keeps it as its own dimension. A reshape that merges or splits axes
remembers the parameter axes involved and gives them back when a later reshape undoes it
(`[T, E] -> [T, G, E/G] -> [T, E]`, `[L, E] -> [L * E] -> [L, E]`). A width-1 piece of a
parameter axis taken out and dropped (`w[2]`, `unstack`) is recorded (a stack of separate
matrices) and remembered on the values computed from it, so that `stack` or a
`concatenate` of those values, piece `i` at position `i`, gives the axis back.

Values computed from separate leaves, stacked (one module per expert, each applied to
the tokens: `stack([unit(x) for unit in modules])`), join those units along the new axis:
position `p` remembers the leaves only it is computed from (an `info.Units` token). The
primitives that keep positions where they are are listed in
`analysis.Table.keeps_positions`; through any other (and through a reshape that merges
or splits the axis, or a concatenation along it) the units are marked lost.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import units as _units

Info = _info.Info
Result = _f.Result
EMPTY = _info.EMPTY


def broadcast_in_dim(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  del an
  x, src = ins[0], _info.shape_of(eqn.invars[0])
  shape = _info.shape_of(eqn.outvars[0])
  axes = [EMPTY] * len(shape)
  dims = eqn.params['broadcast_dimensions']
  for i, d in enumerate(dims):
    if src[i] == shape[d]:
      axes[d] = x.axes[i]
  columns = x.columns if src and dims and dims[-1] == len(shape) - 1 else ()
  iota = dims[x.iota] if x.iota is not None else None
  return Result([x._replace(axes=tuple(axes), iota=iota, columns=columns)])


def _split_tokens(tokens: frozenset, sizes: tuple[int, ...]) -> list[frozenset]:
  """The parts of an axis split into `sizes`: each remembers its place in the axis."""
  params = frozenset(_info.params_of(tokens))
  if not params:
    return [EMPTY] * len(sizes)
  return [frozenset({_info.Split(params, sizes, k)}) for k in range(len(sizes))]


def _merged_tokens(parts: list[frozenset], sizes: tuple[int, ...]) -> frozenset:
  """The parameter axes whose parts, split into `sizes`, are merged again in order."""
  found = EMPTY
  for s in _info.of_kind(parts[0], _info.Split):
    if s.position == 0 and s.sizes == sizes and all(
        _info.Split(s.params, sizes, i) in t for i, t in enumerate(parts)):
      found = found | s.params
  return found


def reshape(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  x = ins[0]
  src, dst = _info.shape_of(eqn.invars[0]), _info.shape_of(eqn.outvars[0])
  axes = [EMPTY] * len(dst)
  iota, found = None, []
  piece = _info.pieces(x)
  for gi, gj in _info.reshape_groups(src, dst):
    if len(gi) == 1 and len(gj) == 1:
      axes[gj[0]] = x.axes[gi[0]]
      iota = gj[0] if x.iota == gi[0] else iota
    elif gi and gj:
      # A merged or split axis is no parameter axis, but stays dispatched: the major
      # part of a split dispatched axis ([E * C] -> [E, C]) indexes the experts.
      flags = _info.lose_units(frozenset(t for i in gi for t in x.axes[i]
                                         if not isinstance(t, (_info.Param, _info.Split))))
      if len(gj) == 1:
        # The merged axes are remembered, to be given back if split apart again; parts
        # of one split axis merged back in order are that axis again.
        parts = tuple((src[i], frozenset(_info.params_of(x.axes[i]))) for i in gi)
        merged = {_info.Merged(parts)} if any(p for _, p in parts) else set()
        axes[gj[0]] = flags | merged | _merged_tokens([x.axes[i] for i in gi],
                                                      tuple(src[i] for i in gi))
        continue
      axes[next(j for j in gj if dst[j] > 1)] = flags
      if _info.INPUT_AXIS in flags:  # every part of an input's axis is the input's (the
        for j in gj:  # positions of [B * S] -> [B, S], whatever a table added along S)
          axes[j] = axes[j] | {_info.INPUT_AXIS} if dst[j] > 1 else axes[j]
      if len(gi) == 1:
        sizes = tuple(dst[j] for j in gj)
        for j, part in zip(gj, _split_tokens(x.axes[gi[0]], sizes)):
          axes[j] = axes[j] | part
        for t in _info.of_kind(x.axes[gi[0]], _info.Merged):
          if tuple(n for n, _ in t.parts) == sizes:
            for j, (_, tokens) in zip(gj, t.parts):
              axes[j] = axes[j] | tokens
    elif gi:  # a size-1 axis dropped
      found.append(_f.TakenApart(x.axes[gi[0]]))
      piece = piece | _piece_of(x.axes[gi[0]])
  return Result([x._replace(axes=tuple(axes), iota=iota, piece=piece, columns=())], found)


def _piece_of(tokens: frozenset) -> frozenset:
  """The (leaf, axis, index) pieces a dropped width-1 axis held (at known indices)."""
  return frozenset((t.leaf, t.axis, t.start) for t in _info.of_kind(tokens, _info.Piece)
                   if t.start is not None)


def width_one(tokens: frozenset, before: int, after: int, start: Optional[int]) -> frozenset:
  """Marks the parameter axes of an axis cut from `before` to the one element at `start`
  (None: at a loop counter)."""
  if after != 1 or before <= 1:
    return tokens
  return tokens | {_info.Piece(t.leaf, t.axis, start) for t in _info.params_of(tokens)}


def transpose(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  del an
  x, perm = ins[0], eqn.params['permutation']
  iota = perm.index(x.iota) if x.iota is not None else None
  return Result([x._replace(axes=tuple(x.axes[p] for p in perm), iota=iota, columns=())])


def squeeze(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  x = ins[0]
  ndim = len(x.axes)
  drop = {d % ndim for d in eqn.params['dimensions']}
  keep = [i for i in range(ndim) if i not in drop]
  piece = _info.pieces(x)
  for d in drop:
    piece = piece | _piece_of(x.axes[d])
  return Result([x._replace(axes=tuple(x.axes[i] for i in keep), piece=piece, columns=(),
                            iota=keep.index(x.iota) if x.iota in keep else None)],
                [_f.TakenApart(x.axes[d]) for d in drop])


def same_rank(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`pad`, `rev`: every axis keeps its tokens; the values are no index any more."""
  del an, eqn
  return Result([ins[0]._replace(iota=None, columns=())])


def slice_(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  del an
  x, src, dst = ins[0], _info.shape_of(eqn.invars[0]), _info.shape_of(eqn.outvars[0])
  starts = eqn.params['start_indices']
  return Result([x._replace(axes=tuple(width_one(*z) for z in zip(x.axes, src, dst, starts)),
                            iota=None, columns=())])


def split(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`jnp.split`: each piece keeps the operand's axes, as a slice does."""
  del an
  x, src, axis = ins[0], _info.shape_of(eqn.invars[0]), eqn.params['axis'] % len(ins[0].axes)
  starts = np.cumsum([0, *eqn.params['sizes']])
  return Result([x._replace(axes=tuple(
      width_one(t, src[a], _info.shape_of(v)[a], int(start)) if a == axis else t
      for a, t in enumerate(x.axes)), iota=None, columns=())
                 for v, start in zip(eqn.outvars, starts)])


def unstack(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`jnp.unstack`: the axis is taken apart into its single pieces."""
  x, axis = ins[0], eqn.params['axis'] % len(ins[0].axes)
  axes = tuple(t for a, t in enumerate(x.axes) if a != axis)
  del an
  outs, found = [], []
  for i in range(len(eqn.outvars)):
    tokens = width_one(x.axes[axis], 2, 1, i)
    found.append(_f.TakenApart(tokens))
    outs.append(x._replace(axes=axes, iota=None, columns=(),
                           piece=_info.pieces(x) | _piece_of(tokens)))
  return Result(outs, found)


def _regained(an: _analysis.Analysis, ins: list[Info]) -> set[_info.Param]:
  """Parameter axes of length n whose piece `i` the `i`-th of n operands is computed from
  (and no other piece of that axis)."""
  found = None
  for i, x in enumerate(ins):
    here: dict[_info.Param, set[int]] = {}
    for leaf, axis, index in _info.pieces(x):
      here.setdefault(_info.Param(leaf, axis), set()).add(index)
    mine = {k for k, v in here.items() if v == {i}}
    found = mine if found is None else found & mine
  return {k for k in found or () if an.shapes[k.leaf][k.axis] == len(ins)}


def _stacked(an: _analysis.Analysis, ins: list[Info], axes: list[frozenset], axis: int
             ) -> Result:
  """The output of stacking (or concatenating width-1 pieces) along `axis`."""
  regained = _regained(an, ins)
  axes[axis] = _info.lose_units(axes[axis]) | frozenset(regained)
  units = _units.joined(ins)
  if units:
    axes[axis] = axes[axis] | {_info.Units(units)}
  piece = frozenset(t for x in ins for t in _info.pieces(x) if t[:2] not in regained)
  data, routed = _info.common(ins)
  ids = {x.eid for x in ins}
  return Result([Info(tuple(axes), data, routed, ids.pop() if len(ids) == 1 else None,
                      piece=piece)], [_f.Joins()] if units else [])


def stack(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`jnp.stack`: a new axis at `axis`, the operands' axes joined around it.

  The new axis is no parameter's own axis, unless the operands are computed from the
  pieces of one, piece `i` at position `i` (`stack([x @ w[e] for e in range(E)])`); it
  joins the units the operands are computed from (`stack([x @ w0, x @ w1])`).
  """
  axis = eqn.params['axis'] % len(_info.shape_of(eqn.outvars[0]))
  rank = len(ins[0].axes)
  axes = [frozenset().union(*(x.axes[a] for x in ins)) for a in range(rank)]
  return _stacked(an, ins, axes[:axis] + [EMPTY] + axes[axis:], axis)


def concatenate(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """A concatenated axis is no parameter's own axis (but see `stack`).

  Concatenated along the last axis, index columns (`[arange(T), ids]`) keep which of
  them hold expert ids.
  """
  dim = eqn.params['dimension']
  shape = _info.shape_of(eqn.outvars[0])
  axes = []
  for ax in range(len(shape)):
    tokens = frozenset().union(*(x.axes[ax] for x in ins))
    if ax == dim:
      tokens = _info.lose_units(_info.without_params(tokens))
    axes.append(tokens)
  widths = [_info.shape_of(v)[dim] for v in eqn.invars]
  if all(w == 1 for w in widths):
    out, found = _stacked(an, ins, axes, dim)
  else:
    data, routed = _info.common(ins)
    ids = {x.eid for x in ins}
    out, found = [Info(tuple(axes), data, routed, ids.pop() if len(ids) == 1 else None)], ()
  if dim == len(shape) - 1:
    columns = [c for x, w in zip(ins, widths)
               for c in (x.columns if len(x.columns) == w else (x.eid,) * w)]
    if any(c is not None for c in columns):
      out = [out[0]._replace(columns=tuple(columns))]
  return Result(out, found)


def tile(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`jnp.tile`: a repeated axis is no parameter's own axis, as if concatenated."""
  del an
  x = ins[0]
  axes = [t if r == 1 else _info.without_params(t)
          for t, r in zip(x.axes, eqn.params['reps'])]
  return Result([x._replace(axes=tuple(axes), iota=None, eid=None, columns=())])
