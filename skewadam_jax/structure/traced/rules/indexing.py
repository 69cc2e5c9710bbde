"""Indexing rules: gathers, scatters and dynamic slices.

Indices that are a decision's expert ids make the axis they index expert-indexed: a
parameter axis of length E gathered or dynamically sliced by them is a bank's expert
axis, and the axis of a scatter's output they write along (`zeros([T, E]).at[arange(T),
ids].set(w)`, combine weights placed by the ids) indexes the experts. Indices computed
from a decision dispatch the tokens: the axes they produce carry `info.Dispatched(dec)`.
"""

from __future__ import annotations

from typing import Any, Optional

from skewadam_jax.core.lazy import jex_core

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced.rules import shapes as _shapes

Info = _info.Info
Result = _f.Result
EMPTY = _info.EMPTY

def _index_ids(idx: Info, n: int) -> list[Optional[int]]:
  """Per position of an `n`-long index vector, the decision whose expert ids it holds."""
  if idx.eid is not None and n == 1:
    return [idx.eid]
  if len(idx.columns) == n:
    return list(idx.columns)
  return [None] * n


def gather(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  x, idx = ins[0], ins[1]
  dn = eqn.params['dimension_numbers']
  sizes = eqn.params['slice_sizes']
  src = _info.shape_of(eqn.invars[0])
  found: list[_f.Finding] = []
  for axis, eid in zip(dn.start_index_map, _index_ids(idx, len(dn.start_index_map))):
    if eid is None and idx.eid is not None:
      eid = idx.eid  # several axes indexed by (broadcast) ids: each by the ids
    if eid is not None:
      found.append(_f.MeetUnits(x.axes[axis], frozenset({_info.Experts(eid)}), False))
      e = an.decision(eid).num_experts
      found += [_f.Bank(t, eid, 'gathered by expert id') for t in _info.params_of(x.axes[axis])
                if an.shapes[t.leaf][t.axis] == e]
  if idx.eid is None and not x.data:  # a table's rows read by token ids or positions
    found += [_f.Used(x.axes[axis], 'gathered', eqn) for axis in dn.start_index_map]
  out_shape = _info.shape_of(eqn.outvars[0])
  kept = [d for d in range(len(src)) if d not in dn.collapsed_slice_dims
          and d not in dn.operand_batching_dims]
  idx_dims = [d for d in range(len(idx.axes)) if d != len(idx.axes) - 1]
  batch_pos = [p for p in range(len(out_shape)) if p not in dn.offset_dims]
  axes = [EMPTY] * len(out_shape)
  for p, d in zip(dn.offset_dims, kept):
    if sizes[d] == out_shape[p]:
      axes[p] = x.axes[d]
  flags = frozenset(_info.Dispatched(d) for d in idx.routed)
  pairs = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims))
  for p, d in zip(batch_pos, idx_dims):
    tokens = idx.axes[d] | flags
    if d in pairs:
      tokens = tokens | x.axes[pairs[d]]
    axes[p] = tokens
  data, routed = _info.common(ins)
  eid = x.eid
  if eid is None and x.iota is not None and x.iota in dn.start_index_map:
    # `jnp.repeat(arange(E), group_sizes)[i]`: reading the index along an E-long axis
    # at positions computed from a decision's choices yields that decision's ids.
    eid = an.latest(idx.routed, src[x.iota])
  return Result([Info(tuple(axes), data, routed, eid)], found)


def scatter(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """Every scatter (`.at[...].set/add/mul/min/max/apply`)."""
  x, idx, upd = ins[0], ins[1], ins[2]
  dn = eqn.params['dimension_numbers']
  axes = list(x.axes)
  window = [d for d in range(len(axes)) if d not in dn.inserted_window_dims
            and d not in dn.operand_batching_dims]
  for p, d in zip(dn.update_window_dims, window):
    axes[d] = axes[d] | upd.axes[p]
  shape = _info.shape_of(eqn.outvars[0])
  dims = dn.scatter_dims_to_operand_dims
  for d, eid in zip(dims, _index_ids(idx, len(dims))):
    axes[d] = axes[d] | frozenset(_info.Dispatched(r) for r in idx.routed)
    if eid is not None and shape[d] == an.decision(eid).num_experts:
      axes[d] = axes[d] | {_info.Experts(eid)}
  data, routed = _info.common(ins)
  return Result([Info(tuple(axes), data, routed)])


def dynamic_slice(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  x, starts = ins[0], ins[1:]
  axes = list(x.axes)
  src, dst = _info.shape_of(eqn.invars[0]), _info.shape_of(eqn.outvars[0])
  found = []
  for axis, s in enumerate(starts):
    if s.eid is not None:
      e = an.decision(s.eid).num_experts
      found += [_f.Bank(t, s.eid, 'dynamically sliced by expert id')
                for t in _info.params_of(x.axes[axis]) if an.shapes[t.leaf][t.axis] == e]
    elif not s.data and not s.routed:  # a constant or a loop counter, not data
      var = eqn.invars[1 + axis]
      start = int(var.val) if isinstance(var, jex_core.Literal) else None
      axes[axis] = _shapes.width_one(axes[axis], src[axis], dst[axis], start)
  data, routed = _info.common(ins)
  return Result([Info(tuple(axes), data, routed, x.eid)], found)


def dynamic_update_slice(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  del an, eqn
  x, u = ins[0], ins[1]
  data, routed = _info.common(ins)
  return Result([Info(tuple(a | b for a, b in zip(x.axes, u.axes)), data, routed)])
