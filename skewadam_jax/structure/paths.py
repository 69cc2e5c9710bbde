"""Paths of a parameter tree, and every per-leaf decision made from them.

One engine serves the labeler (`structure.labels`), the batch axes (`structure.axes`), the
hidden-matrix split (`structure.hidden`) and the transforms (`transforms.tiers`):

* paths: a leaf's key path as normalised segments (keys stringified, a trailing
  `value` dropped, so that Flax boxes at `init` and the pure arrays of `update` agree)
  and as a '/'-joined string;
* patterns: whole-segment globs, case-insensitive, `**` for any run of segments (but
  never across a shared-expert segment), matched on a contiguous run of segments;
* rules: ordered `(pattern, value)` pairs, checked once, first match wins;
* leaves: one record per leaf (path, shape, axis names, and what the deciders find);
* per-leaf values: a tree given by the user (the params' structure, a prefix of it, or
  the same paths) or a function of the params returning one, as one value per leaf.

Only paths and shapes are read (axis names where the caller passes them), so the same
tree gets the same decisions whether its leaves are arrays, tracers, Flax boxes or
`jax.ShapeDtypeStruct`s.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import jax

from skewadam_jax.core import tree as _tree

Segments = tuple[str, ...]
Rule = tuple[str, Any]  # (pattern, value): pattern is '/'-separated segment globs.
CompiledRule = tuple[tuple[Any, ...], Any, str]  # (compiled pattern, value, pattern)

# ---------------------------------------------------------------------------- paths


def key_to_str(key: Any) -> str:
  """One path entry as a plain string (dict key, attribute, index)."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_segments(path: tuple[Any, ...]) -> Segments:
  """Normalised segments of a key path: stringified, trailing `value` dropped.

  Flax wraps parameters in boxes whose array sits under a `value` attribute (boxed
  Linen params, `nnx.State` at `init`), while the pure arrays that `nnx.Optimizer`
  passes to `update` have no such entry; dropping it gives both the same path.
  """
  segments = tuple(key_to_str(k) for k in path)
  while segments and segments[-1] in ('value', 'raw_value'):
    segments = segments[:-1]
  return segments


def join(segments: Sequence[str]) -> str:
  """Segments as one '/'-joined path; the root is `<root>`."""
  return '/'.join(segments) or '<root>'


def path_str(path: tuple[Any, ...]) -> str:
  """A key path as a '/'-joined string of normalised segments."""
  return join(path_segments(path))


def flatten_with_paths(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
  """Leaves of `tree` with their '/'-joined paths, and the treedef."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in with_path], treedef


def lower_segments(path: Union[str, Sequence[str]]) -> Segments:
  """A '/'-joined path (or its segments) as lowercase segments, as patterns see them."""
  return tuple(s.lower() for s in (path.split('/') if isinstance(path, str) else path))


def subtrees(segs: Sequence[Segments]) -> dict[Segments, list[int]]:
  """Every module prefix (not the root, not a leaf itself) -> indices of its leaves."""
  nodes: dict[Segments, list[int]] = {}
  for i, s in enumerate(segs):
    for n in range(1, len(s)):
      nodes.setdefault(s[:n], []).append(i)
  return nodes


# ---------------------------------------------------------------------------- patterns

_SHARED = re.compile(r'shared[_-]?(expert|mlp|ffn|ffw|feed|dense|moe)')


def _is_shared(segment: str) -> bool:
  """Whether a (lowercase) segment names a shared expert / shared dense branch."""
  return segment == 'shared' or bool(_SHARED.search(segment))


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> tuple[Any, ...]:
  """A pattern's segments: `**` kept, every other glob compiled (case-insensitive)."""
  return tuple('**' if s == '**' else re.compile(fnmatch.translate(s.lower()))
               for s in pattern.strip('/').split('/'))


def _match_end(pat: Sequence[Any], segs: Sequence[str], i: int) -> Optional[int]:
  """End index of a match of `pat` starting at `segs[i]`, or None.

  `**` spans any number of segments except a shared-expert one, so that an expert rule
  such as `*moe*/**/wi_0` never reaches into `moe_block/shared_experts/wi_0`.
  """
  if not pat:
    return i
  head, rest = pat[0], pat[1:]
  if head == '**':
    j = i
    while True:
      end = _match_end(rest, segs, j)
      if end is not None:
        return end
      if j >= len(segs) or _is_shared(segs[j]):
        return None
      j += 1
  if i < len(segs) and head.match(segs[i]):
    return _match_end(rest, segs, i + 1)
  return None


def match_span(pat: Sequence[Any], segs: Sequence[str]) -> Optional[tuple[int, int]]:
  """(start, end) of the first match of a compiled pattern on a contiguous run of
  (lowercase) `segs`, or None."""
  for start in range(len(segs)):
    end = _match_end(pat, segs, start)
    if end is not None and end > start:
      return start, end
  return None


def match_path(pattern: str, path: Union[str, Sequence[str]]) -> bool:
  """Whether `pattern` matches a contiguous run of whole segments of `path`.

  Matching is case-insensitive; each pattern segment is a glob (`*`, `?`, `[..]`) and
  `**` matches any number of segments (but never a shared-expert segment). `'experts'`
  matches `moe/experts/w1` but not `shared_experts/w1`; `'gate'` matches
  `moe/gate/kernel` but not `mlp/gate_proj`.
  """
  return match_span(compile_pattern(pattern), lower_segments(path)) is not None


# ---------------------------------------------------------------------------- rules


def check_rules(rules: Optional[Iterable[Any]], is_value: Callable[[Any], bool],
                expected: str) -> tuple[Rule, ...]:
  """`rules` as a tuple of `(pattern, value)` pairs; raises a TypeError naming `expected`
  (e.g. "`rules` must be a sequence of (pattern, tier) string pairs") for a bad rule."""
  out = []
  for rule in rules or ():
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2
            and isinstance(rule[0], str) and is_value(rule[1])):
      raise TypeError(f'{expected}, got {rule!r}.')
    out.append((rule[0], rule[1]))
  return tuple(out)


def compile_rules(rules: Iterable[Rule]) -> list[CompiledRule]:
  """Checked rules with their patterns compiled, in order."""
  return [(compile_pattern(p), value, p) for p, value in rules]


def first_match(rules: Sequence[CompiledRule], segs: Sequence[str]
                ) -> Optional[tuple[tuple[int, int], Any, str]]:
  """(span, value, pattern) of the first rule matching lowercase `segs`, or None."""
  for pat, value, text in rules:
    span = match_span(pat, segs)
    if span is not None:
      return span, value, text
  return None


# ---------------------------------------------------------------------------- leaves


def core_axes(shape: Sequence[int], scan: set[int]) -> list[int]:
  """Positions of `shape` that no scan explains, in order."""
  return [p for p in range(len(shape)) if p not in scan]


def core_shape(shape: Sequence[int], scan: set[int]) -> tuple[int, ...]:
  """`shape` without its scanned axes: the shape of one layer's leaf."""
  return tuple(shape[p] for p in core_axes(shape, scan))


@dataclasses.dataclass
class Leaf:
  """What is known and decided about one leaf of a parameter tree."""
  path: str  # '/'-joined normalised segments, as written
  segs: Segments  # lowercase normalised segments, as patterns see them
  shape: tuple[int, ...]
  names: Optional[tuple[Any, ...]]  # logical axis names, as attached (or None)
  is_array: bool = True  # False: a static field (a function, a string), not a parameter
  tier: Optional[str] = None
  source: str = ''  # what decided (tier or axes): 'rule ...' | 'structure' | 'default' ...
  why: str = ''
  unit: Segments = ()  # the matched module (router / expert bank) it belongs to
  count: Optional[int] = None  # expert count, where structure knows it
  note: str = ''
  scan: set[int] = dataclasses.field(default_factory=set)  # scanned (layer) axes
  axes: Optional[set[int]] = None  # decided batch axes

  @property
  def core(self) -> tuple[int, ...]:
    """The shape of one layer's leaf: `shape` without its scanned axes."""
    return core_shape(self.shape, self.scan)

  @property
  def names_well_formed(self) -> bool:
    """Whether the leaf has one axis name (or None) per axis."""
    return self.names is not None and len(self.names) == len(self.shape)


def leaves_of(tree: Any, names: Optional[Mapping[Segments, tuple[Any, ...]]] = None
              ) -> tuple[list[Leaf], Any]:
  """A `Leaf` per leaf of `tree` (flattening order), and `tree`'s treedef.

  Args:
    tree: a pytree of arrays, tracers, `jax.ShapeDtypeStruct`s, Flax boxes, numbers or
      static fields.
    names: axis names by normalised path segments (`structure.boxes.axis_names_by_path`).
  """
  names = names or {}
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = []
  for path, x in flat:
    segs = path_segments(path)
    leaves.append(Leaf(path=join(segs), segs=lower_segments(segs),
                       shape=_tree.leaf_shape(x), names=names.get(segs),
                       is_array=_tree.is_array_leaf(x)))
  return leaves, treedef


# ---------------------------------------------------------------------------- per leaf


def per_leaf(tree: Any, given: Any, name: str, is_value: Optional[Callable[[Any], bool]]
             = None, what: str = 'values', unused_ok: bool = False, example: str = ''
             ) -> list[Any]:
  """One value per leaf of `tree` (flattening order) from what the user gave as `name`.

  `given` is a tree of values with `tree`'s structure or a prefix of it (a value for a
  whole subtree), a tree whose normalised paths are `tree`'s or prefixes of them (so a
  tree computed once from an `nnx.State`, whose leaves are Variables, also fits the
  pure arrays of `update`), or a function of `tree` returning one. Structure is tried
  first; by path, the longest path of `given` that is a prefix of a leaf's path wins.

  Args:
    tree: the params (or updates).
    given: the user's tree or function.
    name: the argument's name, for messages.
    is_value: what is one value (default: any pytree leaf); every value of `given` is
      checked with it.
    what: the values, for messages (e.g. 'int tuples (or None)').
    unused_ok: accept paths of `given` that `tree` does not have (a tree made for the
      whole params, seen by a transform of `optax.partition` with other leaves masked).
    example: appended to the mismatch message, e.g. ', e.g. sj.moe_batch_axes'.

  Raises:
    TypeError: if a value of `given` fails `is_value`.
    ValueError: if `given` matches `tree` neither by structure nor by path.
  """
  if _tree.is_function(given):  # not a callable tree (an Equinox module)
    given = given(tree)
  flat, given_def = jax.tree_util.tree_flatten_with_path(given, is_leaf=is_value)
  if is_value is not None:
    for path, value in flat:
      if not is_value(value):
        raise TypeError(f'`{name}` must be a tree of {what}, got {value!r} at '
                        f'{path_str(path)}.')
  try:
    blocks = given_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    error = str(e)
  else:
    return [value for (_, value), block in zip(flat, blocks)
            for _ in jax.tree_util.tree_leaves(block)]
  table = {path_segments(path): value for path, value in flat}
  out, used, missing = [], set(), []
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    segs = path_segments(path)
    key = next((segs[:n] for n in range(len(segs), -1, -1) if segs[:n] in table), None)
    if key is None:
      missing.append(join(segs))
    else:
      out.append(table[key])
      used.add(key)
  unused = [join(k) for k in table if k not in used]
  if missing or (unused and not unused_ok):
    found = (f'no entry for {missing[:5]}' if missing else
             f'entries for paths the params do not have: {unused[:5]}')
    raise ValueError(
        f'`{name}` must be a pytree with the same structure as the params (or a prefix of '
        f'it, or the same paths) of {what}, or a function returning one{example}; it has '
        f'{found}; by structure: {error}')
  return out


def is_axes(x: Any) -> bool:
  """Whether `x` is one leaf's batch axes: None (the default) or a sequence of ints."""
  return x is None or (isinstance(x, (tuple, list)) and all(
      isinstance(a, int) and not isinstance(a, bool) for a in x))


def leaf_batch_axes(batch_axes: Any, tree: Any) -> list[Optional[tuple[int, ...]]]:
  """Each leaf's batch axes (None: the default) from `batch_axes` for `tree`.

  `batch_axes` is None, a tree of axis tuples matching `tree` as `per_leaf` matches
  (structure, prefix or path; one tuple for every leaf), or a function of `tree`
  returning one.
  """
  if batch_axes is None:
    return [None] * len(jax.tree_util.tree_leaves(tree))
  got = per_leaf(tree, batch_axes, 'batch_axes', is_axes, 'int tuples (or None)',
                 unused_ok=True, example=', e.g. sj.moe_batch_axes')
  return [None if axes is None else tuple(axes) for axes in got]
