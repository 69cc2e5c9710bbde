"""A checkpoint's tree as optimizer state: its leaves by path, field, tier and parameter.

The walk that `checkpoint` (does a checkpoint match?) and `relayout` (the same state in
another layout) share. Nothing reads an array: the leaves are Orbax metadata (`shape`
and `dtype`) or abstract arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from skewadam_jax.estimators import codec as _codec

from skewadam_jax.structure import paths as _paths
from skewadam_jax.core import tree as _tree

# Field names of the optimizer states that mark where a parameter's path starts.
STATE_FIELDS = ('count', 'mu', 'nu', 'v', 'v_row', 'v_col')
# How many differences of each kind a message lists before it says "and N more".
MAX_LISTED = 6


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array of a tree: its path segments, shape and dtype (None if not an array)."""
  path: tuple[str, ...]
  shape: Optional[tuple[int, ...]]
  dtype: Optional[np.dtype]

  @property
  def name(self) -> str:
    return _paths.join(self.path)

  @property
  def tier(self) -> Optional[str]:
    """The SkewAdam tier (the key under `optax.partition`'s `inner_states`), if any."""
    for i, seg in enumerate(self.path[:-1]):
      if seg == 'inner_states':
        return self.path[i + 1]
    return None

  @property
  def field(self) -> Optional[tuple[int, str]]:
    """`(index, name)` of the last state field in the path (`mu`, `v_row`, ...), if any."""
    for i in range(len(self.path) - 1, -1, -1):
      if self.path[i] in STATE_FIELDS:
        return i, self.path[i]
    return None

  @property
  def coded(self) -> bool:
    """Whether the leaf is an array of a coded momentum (`mu/<param>/codes`, `.../scales`
    of a `Tier(mu_codec=...)`)."""
    field = self.field
    return (field is not None and field[1] == 'mu' and field[0] + 2 < len(self.path)
            and self.path[-1] in _codec.Coded._fields)

  @property
  def field_label(self) -> Optional[str]:
    """The field's name in messages: `mu (coded)` for a coded momentum."""
    field = self.field
    if field is None:
      return None
    return f'{field[1]} (coded)' if self.coded else field[1]

  @property
  def param(self) -> Optional[str]:
    """The parameter a state leaf belongs to (the path after its field, without a coded
    momentum's `codes`/`scales`), if any."""
    field = self.field
    if field is None or field[0] + 1 >= len(self.path):
      return None
    # A Flax box around a coded momentum keeps its `value` above `codes`/`scales`.
    return _paths.join(_paths.path_segments(self.path[field[0] + 1:len(self.path)
                                                      - int(self.coded)]))


def dtype_of(x: Any) -> Optional[np.dtype]:
  try:
    return np.dtype(x)
  except TypeError:
    return None


def unwrap(tree: Any) -> Any:
  """The tree Orbax wraps: StepMetadata.item_metadata -> TreeMetadata.tree -> the tree."""
  for attr in ('item_metadata', 'tree'):
    if not isinstance(tree, (dict, list, tuple)) and hasattr(tree, attr):
      tree = getattr(tree, attr)
  return tree


def with_segments(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
  """`(path segments, leaf)` of every leaf of the (unwrapped) tree, arrays whole; None
  and empty nodes have no leaves."""
  flat, _ = jax.tree_util.tree_flatten_with_path(unwrap(tree), is_leaf=_tree.is_array_like)
  return [(_paths.path_segments(path), leaf) for path, leaf in flat]


def leaves_of(tree: Any) -> dict[tuple[str, ...], Leaf]:
  """`{path segments: Leaf}` of every leaf (None and empty nodes dropped)."""
  out = {}
  for segments, leaf in with_segments(tree):
    if _tree.is_array_like(leaf):
      out[segments] = Leaf(segments, tuple(int(n) for n in leaf.shape), dtype_of(leaf.dtype))
    else:  # a Python scalar or string saved as is
      out[segments] = Leaf(segments, None, None)
  return out


def signature(leaves: dict[tuple[str, ...], Leaf]) -> str:
  """What kind of optimizer state a tree holds: its tiers and state fields."""
  tiers = sorted({leaf.tier for leaf in leaves.values() if leaf.tier is not None})
  fields = sorted({leaf.field[1] for leaf in leaves.values() if leaf.field is not None},
                  key=STATE_FIELDS.index)
  if not fields:
    return 'no optimizer state fields'
  kind = f'state fields {", ".join(fields)}'
  return f'tiers {", ".join(tiers)}; {kind}' if tiers else kind


def placement(leaves: list[Leaf]) -> str:
  """`(v_row, v_col)`, or `tier 'experts' (v_row, v_col)` in a state of tiers composed
  with `optax.partition`: what one parameter's state holds, and where."""
  by_tier: dict[Optional[str], list[str]] = {}
  for leaf in leaves:
    by_tier.setdefault(leaf.tier, []).append(leaf.field_label)
  parts = []
  for tier, fields in sorted(by_tier.items(), key=lambda kv: str(kv[0])):
    fields = sorted(set(fields), key=lambda f: (STATE_FIELDS.index(f.split()[0]), f))
    where = f'tier {tier!r} ' if tier is not None else ''
    parts.append(f'{where}({", ".join(fields)})')
  return ' and '.join(parts)


def listed(lines: list[str]) -> list[str]:
  """At most MAX_LISTED lines, then a count of the rest."""
  if len(lines) <= MAX_LISTED:
    return lines
  return lines[:MAX_LISTED] + [f'... and {len(lines) - MAX_LISTED} more']
