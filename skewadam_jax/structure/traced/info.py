"""What the traced analysis knows about one jaxpr variable, and how two such facts join.

Every variable carries, per axis, a set of tokens, one class per kind:

* `Param(leaf, axis)`: the axis derives from that axis of a parameter leaf;
* `INPUT_AXIS` (`InputAxis`): it derives from an axis of the function's inputs (tokens,
  batch, sequence), as opposed to one a parameter's axis produces;
* `BATCHED` (`Batched`): it was a batch dimension of a contraction whose both operands'
  axes come from parameters (each slice's own matrices applied to each slice's own
  activations);
* `Dispatched(dec)`: it runs over tokens dispatched by routing decision `dec`;
  `Experts(dec)`: it indexes the experts of `dec`;
* `Piece(leaf, axis, start)`: it is the single piece at `start` (None: at a loop
  counter) of that parameter axis;
* `Merged(parts)`: parameter axes merged by a reshape, `parts` their (size, params), to
  be given back if a reshape splits the same sizes apart again;
* `Split(params, sizes, position)`: the part at `position` of a parameter axis a reshape
  split into `sizes`, to be given back if a reshape merges the parts again;
* `Units(units)`: values computed from separate leaves joined along this axis
  (`stack([unit(x) for unit in modules])`): `units[p]` holds the leaves that position
  `p` is computed from and no other position is; `MovedUnits(units)`: the same, once an
  operation may have moved the positions (a slice, a sort, a reshape merging the axis).

`Param` is a `NamedTuple`, equal to its `(leaf, axis)` pair: the analysis keys what it
finds per parameter axis by it. The other kinds are frozen dataclasses, equal only to
their own kind (`Experts(0) != Dispatched(0)`).

Besides the axes, the value facts (`Info`'s other fields) flow from every operand to
every output of an equation (`Analysis.depend`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import numpy as np

from skewadam_jax.core.lazy import source_info_util

EMPTY: frozenset = frozenset()


class Param(NamedTuple):
  """The axis derives from axis `axis` of parameter leaf `leaf`."""
  leaf: int
  axis: int


_token = dataclasses.dataclass(frozen=True)


@_token
class InputAxis:
  """The axis derives from an axis of the function's inputs."""


@_token
class Batched:
  """A batch dimension of a contraction whose both operands' axes come from parameters."""


@_token
class Dispatched:
  """The axis runs over tokens dispatched by routing decision `dec`."""
  dec: int


@_token
class Experts:
  """The axis indexes the experts of routing decision `dec`."""
  dec: int


@_token
class Piece:
  """The single piece at `start` (None: at a loop counter) of a parameter axis."""
  leaf: int
  axis: int
  start: Optional[int]

  @property
  def param(self) -> Param:
    return Param(self.leaf, self.axis)


@_token
class Merged:
  """Parameter axes merged by a reshape: per merged axis, (size, its `Param`s)."""
  parts: tuple[tuple[int, frozenset], ...]


@_token
class Split:
  """The part at `position` of the parameter axes `params`, split into `sizes`."""
  params: frozenset
  sizes: tuple[int, ...]
  position: int


@_token
class Units:
  """Separate leaves joined along the axis: `units[p]` those only position `p` is
  computed from."""
  units: tuple[frozenset, ...]


@_token
class MovedUnits:
  """`Units` whose positions an operation may have moved."""
  units: tuple[frozenset, ...]


Token = Union[Param, InputAxis, Batched, Dispatched, Experts, Piece, Merged, Split, Units,
              MovedUnits]
INPUT_AXIS = InputAxis()
BATCHED = Batched()


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


def params_of(tokens: frozenset) -> list[Param]:
  """The `Param` tokens of an axis."""
  return [t for t in tokens if isinstance(t, Param)]


def of_kind(tokens: frozenset, *kinds: type) -> list[Any]:
  """An axis' tokens of the given kinds."""
  return [t for t in tokens if isinstance(t, kinds)]


def without_params(tokens: frozenset) -> frozenset:
  """An axis' tokens other than `Param`s (a concatenated or tiled axis is no parameter's
  own)."""
  return frozenset(t for t in tokens if not isinstance(t, Param))


def decisions_of(tokens: frozenset, kind: type) -> set[int]:
  """The decisions of an axis' `Experts` or `Dispatched` tokens."""
  return {t.dec for t in tokens if isinstance(t, kind)}


def lose_units(tokens: frozenset) -> frozenset:
  """An axis whose positions may have moved: its units' positions are no longer known."""
  if not any(isinstance(t, Units) for t in tokens):
    return tokens
  return frozenset(MovedUnits(t.units) if isinstance(t, Units) else t for t in tokens)


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
