"""What the traced analysis knows about one jaxpr variable, and how two such facts join.

Every variable carries, per axis, a set of tokens:

* `(leaf, axis)`: the axis derives from that axis of a parameter leaf;
* `INPUT_AXIS`: it derives from an axis of the function's inputs (tokens, batch,
  sequence), as opposed to one a parameter's axis produces;
* `BATCHED`: it was a batch dimension of a contraction whose both operands' axes come
  from parameters (each slice's own matrices applied to each slice's own activations);
* `('d', dec)`: it runs over tokens dispatched by routing decision `dec`;
  `('e', dec)`: it indexes the experts of `dec`;
* `('1', (leaf, axis, start))`: it is the single piece at `start` (None: at a loop
  counter) of that parameter axis;
* `('m', parts)`: parameter axes merged by a reshape, `parts` their (size, tokens), to be
  given back if a reshape splits the same sizes apart again;
* `('s', (tokens, sizes, position))`: the part at `position` of a parameter axis a
  reshape split into `sizes`, to be given back if a reshape merges the parts again;
* `('u', units)`: values computed from separate leaves joined along this axis
  (`stack([unit(x) for unit in modules])`): `units[p]` holds the leaves that position
  `p` is computed from and no other position is; `('v', units)`: the same, once an
  operation may have moved the positions (a slice, a sort, a reshape merging the axis).

Besides the axes, the value facts (`Info`'s other fields) flow from every operand to
every output of an equation (`Analysis.depend`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np

from skewadam_jax.core.lazy import source_info_util

EMPTY: frozenset = frozenset()
INPUT_AXIS = ('x', 0)
BATCHED = ('b', 0)


class Info(NamedTuple):
  """What the analysis knows about one jaxpr variable."""
  axes: tuple[frozenset, ...]  # per axis, its tokens (see the module docstring)
  data: bool = False  # depends on the function's inputs (not only on parameters)
  routed: frozenset = EMPTY  # routing decisions it depends on
  eid: Optional[int] = None  # its values are expert ids of this decision
  iota: Optional[int] = None  # its values are the index along this axis
  deps: frozenset = EMPTY  # leaves its values depend on
  free: frozenset = EMPTY  # leaves reaching it other than through a router's logits
  # (decision, id or None) pairs: its values are zero wherever that decision's expert id
  # differs from the id (`i == 2`, a one-hot's column 2; None: an id not known here)
  mask: frozenset = EMPTY
  unmask: frozenset = EMPTY  # ... (decision, id) pairs: false only where the id is it
  open: frozenset = EMPTY  # leaves reaching it other than through such a mask
  # (leaf, axis, index): its values are computed from that single piece of a parameter
  # axis (`w[2]`); None: those of its operands (set by `Analysis.depend`)
  piece: Optional[frozenset] = None
  # per position of its last axis, the decision whose expert ids that column holds (an
  # index vector `[arange(T), ids]` built for a scatter or gather); () when unknown
  columns: tuple[Optional[int], ...] = ()
  # leaves whose contraction with activations made these values last (the output layer,
  # read at the outputs); None: those of its operands (set by `Analysis.depend`)
  last: Optional[frozenset] = None


def blank(ndim: int) -> Info:
  """A fact with nothing known about its `ndim` axes (a constant)."""
  return Info((EMPTY,) * ndim)


def shape_of(var: Any) -> tuple[int, ...]:
  """A variable's shape, -1 for a dimension that is not a known int.

  Read from `aval.shape`, which a PRNG key's aval has too (its dtype is no NumPy one).
  """
  return tuple(int(d) if isinstance(d, (int, np.integer)) else -1
               for d in getattr(var.aval, 'shape', ()))


def is_integer(var: Any) -> bool:
  """Whether a variable holds integers (PRNG keys and other extended dtypes do not)."""
  dtype = getattr(var.aval, 'dtype', None)
  if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return False
  return bool(np.issubdtype(dtype, np.integer))


def params_of(tokens: frozenset) -> list[tuple[int, int]]:
  """The (leaf, axis) tokens of an axis."""
  return [t for t in tokens if isinstance(t[0], int)]


def flags(tokens: frozenset, kind: str) -> set[Any]:
  """The payloads of an axis' tokens of one kind (`'d'`, `'e'`, ...)."""
  return {t[1] for t in tokens if t[0] == kind}


def units_of(tokens: frozenset, kinds: tuple[str, ...] = ('u',)
             ) -> list[tuple[str, tuple[frozenset, ...]]]:
  """The (kind, units) of an axis' joined-units tokens of the given kinds."""
  return [t for t in tokens if t[0] in kinds]


def lose_units(tokens: frozenset) -> frozenset:
  """An axis whose positions may have moved: its units' positions are no longer known."""
  if not any(t[0] == 'u' for t in tokens):
    return tokens
  return frozenset(('v', t[1]) if t[0] == 'u' else t for t in tokens)


def pieces(info: Info) -> frozenset:
  """The parameter pieces a fact's values are computed from (none if not set)."""
  return info.piece or EMPTY


def join(a: Info, b: Info) -> Info:
  """The least upper bound of two facts about the same variable."""
  axes = a.axes if len(a.axes) != len(b.axes) else tuple(x | y for x, y in zip(a.axes, b.axes))
  piece = None if a.piece is None and b.piece is None else pieces(a) | pieces(b)
  last = None if a.last is None and b.last is None else (a.last or EMPTY) | (b.last or EMPTY)
  return Info(axes, a.data or b.data, a.routed | b.routed,
              a.eid if a.eid == b.eid else None, a.iota if a.iota == b.iota else None,
              a.deps | b.deps, a.free | b.free, a.mask & b.mask,
              a.unmask & b.unmask, a.open | b.open, piece,
              a.columns if a.columns == b.columns else (), last)


def common(ins: Sequence[Info]) -> tuple[bool, frozenset]:
  """Whether any operand depends on the inputs, and the decisions any depends on."""
  return any(x.data for x in ins), frozenset().union(*(x.routed for x in ins))


def elementwise_shapes(eqn: Any) -> bool:
  """Whether every operand has the output's shape, up to size-1 or scalar broadcasts."""
  out = {shape_of(v) for v in eqn.outvars}
  if len(out) != 1:
    return False
  shape = out.pop()
  for v in eqn.invars:
    s = shape_of(v)
    if s and (len(s) != len(shape) or any(a not in (b, 1) for a, b in zip(s, shape))):
      return False
  return True


def reshape_groups(src: Sequence[int], dst: Sequence[int]
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


def axis_list(axes: Sequence[int]) -> str:
  """'0,2' for axes {2, 0}."""
  return ','.join(map(str, sorted(axes)))


def source_line(eqn: Any) -> str:
  """The user's source line that made an equation (`file.py:12:7 (fn)`)."""
  return source_info_util.summarize(eqn.source_info)
