"""Scanned stacks and expert banks, read from paths and shapes without trusting names.

Both carry one extra axis of a common length on every leaf of a subtree: a scanned
(stacked) block puts its repeat count R on every leaf it holds (a norm scale [R, d],
a projection [R, d, h], an expert bank [R, E, d, f]); an expert bank puts its expert
count E on every leaf of the bank ([E, d, f], [E, f, d], a bias [E, f]). What tells
them apart is the router: a bank of E experts sits beside a router candidate, a kernel
[d, E] (or [E, d] in PyTorch's layout) whose other axis d is an axis of the bank, while
a stack's length is an axis of nothing outside the stack. A shared length that is
neither (a feature width shared by q, k and v) is left alone.

A subtree is examined (outermost first, so that E is never read from an axis a scan
explains) when

* a module name says it is a stack (`layers`, `*_layers`, `scan`, `blocks`, ...; not
  followed by a numbered module, as unrolled `layers/0` are): the one position not yet
  explained that has the same length in all its leaves is the layer axis; or
* it is not the whole tree, it holds >= 2 array leaves, each with >= 2 axes not yet
  explained and one with >= 3, and some position (see below) has the same
  length (> 1) in all of them: that position is the layer axis of a stack if nothing
  outside has that length and the leaves belong to >= 2 modules, the expert axis of a
  bank if a router candidate sits beside the subtree. (The position may be the last
  axis of a stacked vector, a scale or bias [d, L] beside [d, L, h] as MaxText and
  Linen's `nn.scan(variable_axes={'params': 1})` lay them out; never of a kernel, which
  may be a router [d, E], nor of a leaf with more axes.) Vectors with one axis left (a
  per-expert scale [E] beside [E, d, f]) take no part in finding the position; with
  them the subtree is a bank only, each vector's length its expert count.

Whatever the subtree is called, a shared position is the layer axis of stacked MoE
layers when, with it taken away, the leaves still hold a router [d, E] and its bank
[E, d, f] (`_moe_layer_axis`): a bank of L experts has no router carrying L. The
same reading finds such a stack among the children of any module that no subtree
explains, the root included (`_sibling_stacks`: `{emb [V, d], wq [L, d, d],
router [L, d, E], w1 [L, E, d, f], ...}`), leaving out the leaves beside it.

A bank may also be the sibling leaves of one module beside their router
(`ffn/{sel [d, E], w_in [E, d, f], w_out [E, f, d]}`): those are found last.

A length shared by the leaves of one module only, with no router beside it, is a
layer axis or an expert axis alike: the module is reported with all its leaves (its
vectors and matrices too, which the rank-3 report of the defaults does not name).

Two readable positions (R == E laid out alike, or two lengths no other leaf explains)
are reported: which axis stacks the layers and which indexes the experts is then a
guess, and the report names the paths and the rule that settles it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure.vocabulary import EXPERTS
from skewadam_jax.structure.vocabulary import ROUTER


@dataclasses.dataclass
class Group:
  """A subtree whose leaves share one axis length: a scanned stack or an expert bank."""
  prefix: tuple[str, ...]  # lowercase segments of the subtree's module
  members: list[int]  # indices of its leaves
  axis: int  # the shared axis, as a position in each member's full shape
  length: int  # R (stack) or E (bank)
  kind: str  # 'stack' | 'bank'
  named: bool  # a module name says it is a stack
  routers: list[int] = dataclasses.field(default_factory=list)  # candidates beside a bank


@dataclasses.dataclass
class StacksAndBanks:
  """Scan axes of every leaf, the stacks and banks found, and unsure findings."""
  scan: list[set[int]]  # per leaf: positions of its scanned (layer) axes
  groups: list[Group]
  ambiguous: list[str]  # named stacks whose layer axis is unclear: the paths and the fix
  # Subtrees that read as a stack of layers and as a bank of experts alike: (the finding
  # with the paths and the fix, the leaves concerned).
  confusions: list[tuple[str, list[int]]]


def _named(prefix: tuple[str, ...], segs: Sequence[tuple[str, ...]], members: list[int]
           ) -> bool:
  """Whether `prefix` ends in a scan module name not followed by a numbered module."""
  if not _vocabulary.SCAN_MODULE.match(prefix[-1]):
    return False
  return not any(segs[i][len(prefix)].isdigit() for i in members)


def analyse(paths: Sequence[str], segs: Sequence[tuple[str, ...]],
            shapes: Sequence[Optional[tuple[int, ...]]],
            tiers: Sequence[Optional[str]], decided_by_name: Sequence[bool]) -> StacksAndBanks:
  """Finds the stacks and banks of a tree of leaves (flattening order).

  Args:
    paths: each leaf's '/'-joined path (for the findings).
    segs: each leaf's lowercase normalised path segments.
    shapes: each leaf's shape, or None for a leaf that is not an array.
    tiers: each leaf's tier where already known (names, rules, given labels), else None.
    decided_by_name: whether a name (a rule) decided the leaf's tier; such a leaf is
      never a router candidate unless its tier is `router`, and a subtree of them
      that names a dense tier is not a bank.

  Returns:
    The `StacksAndBanks`: scan axes per leaf, the groups found, the unsure findings.
  """
  scan: list[set[int]] = [set() for _ in shapes]
  groups: list[Group] = []
  ambiguous: list[str] = []
  confusions: list[tuple[str, list[int]]] = []
  nodes = _paths.subtrees(segs)
  seen: set[tuple[int, ...]] = set()
  arrays = [i for i, s in enumerate(shapes) if s is not None]
  for prefix in sorted(nodes, key=len):  # outer modules first
    members = [i for i in nodes[prefix] if shapes[i] is not None]
    key = tuple(members)
    if len(members) < 2 or key in seen:
      continue
    named = _named(prefix, segs, members)
    known = set.intersection(*(scan[i] for i in members))
    free = [[p for p in range(len(shapes[i])) if p not in known] for i in members]
    if named:
      ndim = min(len(shapes[i]) for i in members)
      common = [p for p in range(ndim) if p not in known
                and len({shapes[i][p] for i in members}) == 1]
      if len(common) == 1:
        seen.add(key)
        _stack(groups, scan, prefix, members, common[0], shapes, named=True)
      elif len(common) > 1:
        seen.add(key)
        where = '/'.join(prefix)
        ambiguous.append(
            f'{where}: axes {common} have the same length in all {len(members)} leaves, '
            'so which one stacks the layers is unclear; pass batch_axes rules, e.g. '
            f"sj.moe_batch_axes(params, rules=[('{where}/**', ({common[0]},))])")
      continue
    # Vectors with one axis left (a per-expert scale [E] beside the bank's [E, d, f]) do
    # not say where the shared axis is: it is read from the other leaves, and the subtree
    # is then a bank only, each vector's length the expert count (a stack's vectors
    # carry its layer axis too).
    vectors = [i for i, f in zip(members, free) if len(f) == 1]
    body = [(i, f) for i, f in zip(members, free) if len(f) != 1]
    if not body or any(len(f) < 2 for _, f in body) or max(len(f) for _, f in body) < 3:
      continue
    # A stacked or banked leaf keeps its own axes last, so the shared axis is the last
    # axis of no leaf, except of a stacked vector: a scale or bias [d, L] beside [d, L, h]
    # (Linen's `nn.scan(variable_axes={'params': 1})`, MaxText). A kernel [d, n] is not
    # one: it may be a router [d, E] beside banks [.., E, d, f].
    first = body[0][0]
    ndim = min(len(shapes[i]) for i, _ in body)
    common = [p for p in range(ndim) if p not in known and shapes[first][p] > 1
              and len({shapes[i][p] for i, _ in body}) == 1
              and all(p != f[-1] or (len(f) == 2 and _vocabulary.is_vector(segs[i]))
                      for i, f in body)]
    lengths = {shapes[i][f[0]] for i, f in zip(members, free) if i in vectors}
    if vectors:
      common = [p for p in common if lengths == {shapes[first][p]}]
    if not common:
      continue
    inside = set(members)
    outside = [i for i in arrays if i not in inside]
    if all(tiers[i] == EXPERTS for i in members):
      seen.add(key)  # a bank by its names: its expert axis is the experts tier's
      continue
    layer = None if vectors else _moe_layer_axis(members, common, segs, shapes,
                                                         scan, tiers, decided_by_name)
    if layer is not None:  # a router and its bank under a shared axis: stacked MoE layers
      seen.add(key)
      _stack(groups, scan, prefix, members, layer, shapes, named=False)
      continue
    dense_by_name = all(decided_by_name[i] and tiers[i] not in (None, EXPERTS)
                        for i in members)
    # A stack of layers holds several modules (norms, attention, MLP); the leaves of one
    # module sharing a length (w [4, d, f], b [4, f]) may as well be a bank whose router
    # is not in sight, so they are no stack by shapes (and stay reported).
    modules = len({segs[i][:-1] for i in members})
    readings = []
    for p in common:
      n = shapes[first][p]
      dims = {shapes[i][q] for i, f in body for q in f if q != p}
      routers = [] if dense_by_name else _router_candidates(
          prefix[:-1], n, dims, outside, segs, shapes, scan, tiers, decided_by_name)
      if routers:
        readings.append((p, 'bank', routers))
      elif not vectors and not any(n in _paths.core_shape(shapes[i], scan[i])
                                   for i in outside):
        # A length nothing else has: a stack's; in one module, perhaps a bank's too.
        readings.append((p, 'stack' if modules >= 2 else 'lone', []))
    if readings and all(kind == 'lone' for _, kind, _ in readings):
      # No router, one module: stack or bank is a guess. The defaults report its rank-3
      # leaves, not its vectors and matrices ([R, d] or [E, f], no batch axis by
      # default), which are wrong either way if it is a stack or a bank: report them all.
      if any(len(f) < 3 for f in free):
        seen.add(key)
        confusions.append((_lone_finding(prefix, members, readings, paths, shapes),
                           members))
      continue
    if len(readings) == 1:
      seen.add(key)
      p, kind, routers = readings[0]
      if kind == 'stack':
        _stack(groups, scan, prefix, members, p, shapes, named=False)
      else:
        groups.append(Group(prefix, members, p, shapes[first][p], 'bank', False,
                            routers))
    elif len(readings) > 1:
      seen.add(key)
      where = '/'.join(prefix)
      said = ', '.join(f'axis {p} ({shapes[first][p]}): '
                       + ('an expert axis beside router ' + paths[r[0]] if kind == 'bank'
                          else 'a layer axis or an expert axis' if kind == 'lone'
                          else 'a layer axis')
                       for p, kind, r in readings)
      confusions.append((
          f"{where}/** ({', '.join(paths[i] for i in members[:3])}"
          f"{', ...' if len(members) > 3 else ''}): every leaf shares more than one axis "
          f'length, so a stack of layers and a bank of experts could be confused ({said}); '
          'say which: batch_axes=lambda p, param_labels: sj.moe_batch_axes('
          "p, param_labels, rules=[('"
          f"{where}/**', (<layer and expert axes>,))]) and, for a bank, "
          f"param_labels=sj.make_labeler([('{where}', {EXPERTS!r})])", members))
  for module, members, layer in _sibling_stacks(segs, shapes, scan, tiers,
                                                        decided_by_name):
    _stack(groups, scan, module, members, layer, shapes, named=False)
  _sibling_banks(groups, segs, shapes, scan, tiers, decided_by_name)
  return StacksAndBanks(scan, groups, ambiguous, confusions)


def scan_leaves(leaves: list[_paths.Leaf], decided_by_name: Sequence[bool]
                ) -> StacksAndBanks:
  """`analyse` on leaf records: sets each leaf's `scan` and returns the `StacksAndBanks`."""
  found = analyse([x.path for x in leaves], [x.segs for x in leaves],
                  [x.shape if x.is_array else None for x in leaves],
                  [x.tier for x in leaves], decided_by_name)
  for leaf, scan in zip(leaves, found.scan):
    leaf.scan = scan
  return found


def _sibling_banks(groups: list[Group], segs: Sequence[tuple[str, ...]],
                   shapes: Sequence[Optional[tuple[int, ...]]], scan: list[set[int]],
                   tiers: Sequence[Optional[str]], decided_by_name: Sequence[bool]) -> None:
  """Banks written as sibling leaves of one module beside their router, e.g.
  `ffn/{sel [d, E], w_in [E, d, f], w_out [E, f, d]}`: the leaves (>= 3 unscanned
  axes, or a bias beside them) whose first unscanned axis has a length E that a
  router candidate in the same module (or in a child module of its own) maps to."""
  grouped = {i for g in groups if g.kind == 'bank' for i in g.members}
  modules: dict[tuple[str, ...], list[int]] = {}
  for i, s in enumerate(segs):
    if shapes[i] is not None and i not in grouped:
      modules.setdefault(s[:-1], []).append(i)
  arrays = [i for i, x in enumerate(shapes) if x is not None]
  for module, children in modules.items():
    by_length: dict[int, list[int]] = {}
    for i in children:
      free = _paths.core_axes(shapes[i], scan[i])
      if len(free) >= 2 and not (decided_by_name[i] and tiers[i] != EXPERTS):
        by_length.setdefault(shapes[i][free[0]], []).append(i)
    for n, members in by_length.items():
      if n < 2 or all(len(_paths.core_axes(shapes[i], scan[i])) < 3 for i in members):
        continue
      if all(tiers[i] == EXPERTS for i in members):
        continue  # a bank by its names: the name-based structure reads it
      dims = {shapes[i][q] for i in members for q in _paths.core_axes(shapes[i], scan[i])[1:]}
      inside = set(members)
      outside = [i for i in arrays if i not in inside]
      near = [i for i in outside if len(segs[i]) <= len(module) + 2]  # `sel/kernel` too
      routers = _router_candidates(module, n, dims, near, segs, shapes, scan, tiers,
                                   decided_by_name)
      if routers:
        axis = _paths.core_axes(shapes[members[0]], scan[members[0]])[0]
        groups.append(Group(module, members, axis, n, 'bank', False, routers))


def _lone_finding(prefix: tuple[str, ...], members: list[int],
                  readings: list[tuple[int, str, list[int]]], paths: Sequence[str],
                  shapes: Sequence[Optional[tuple[int, ...]]]) -> str:
  """The report on one module whose leaves share a length that nothing else explains."""
  where = '/'.join(prefix)
  axes = ', '.join(f'axis {p} ({shapes[members[0]][p]})' for p, _, _ in readings)
  return (f"{where}/** ({', '.join(paths[i] for i in members)}): the leaves of one module "
          f'share {axes}, which no leaf outside has and no router maps to, so it is the '
          'layer axis of a stack or the expert axis of a bank whose router is not in sight; '
          'say which: batch_axes=lambda p, param_labels: sj.moe_batch_axes('
          "p, param_labels, rules=[('"
          f"{where}/**', (<layer and expert axes>,))]) and, for a bank, "
          f"param_labels=sj.make_labeler([('{where}', {EXPERTS!r})])")


def _stack(groups: list[Group], scan: list[set[int]], prefix: tuple[str, ...],
           members: list[int], axis: int, shapes: Sequence[Optional[tuple[int, ...]]],
           named: bool) -> None:
  for i in members:
    scan[i].add(axis)
  groups.append(Group(prefix, members, axis, shapes[members[0]][axis], 'stack', named))


def _router_candidates(area: tuple[str, ...], n: int, dims: set[int], outside: list[int],
                       segs: Sequence[tuple[str, ...]],
                       shapes: Sequence[Optional[tuple[int, ...]]], scan: list[set[int]],
                       tiers: Sequence[Optional[str]], decided_by_name: Sequence[bool]
                       ) -> list[int]:
  """Of the leaves `outside` a bank that no name or rule gave another tier, the kernels
  under the module `area` that map an axis of the bank's leaves (`dims`) to `n` outputs."""
  eligible = [i for i in outside if _may_route(i, tiers, decided_by_name)]
  return kernels_mapping(area, n, dims, eligible, segs, shapes, scan)


def kernels_mapping(area: tuple[str, ...], n: int, dims: set[int], candidates: list[int],
                    segs: Sequence[tuple[str, ...]],
                    shapes: Sequence[Optional[tuple[int, ...]]], scan: list[set[int]]
                    ) -> list[int]:
  """Of `candidates`, the kernels under the module `area` that map an axis length in
  `dims` to `n` outputs: [d, n] (or [n, d] for a PyTorch `weight`)."""
  return [i for i in candidates if segs[i][:len(area)] == area
          and not _vocabulary.is_vector(segs[i]) and _vocabulary.router_count(
              _paths.core_shape(shapes[i], scan[i]), _vocabulary.is_torch_layout(segs[i]),
              dims) == n]


def _may_route(i: int, tiers: Sequence[Optional[str]], decided_by_name: Sequence[bool]
               ) -> bool:
  """Whether leaf `i` may be a router: undecided, or labelled `router`."""
  return tiers[i] in (None, ROUTER) and not (decided_by_name[i] and tiers[i] != ROUTER)


def _moe_layer_axis(members: Sequence[int], positions: Sequence[int],
                    segs: Sequence[_paths.Segments], shapes: Sequence[Optional[tuple[int, ...]]],
                    scan: Sequence[set[int]], tiers: Sequence[Optional[str]],
                    decided_by_name: Sequence[bool]) -> Optional[int]:
  """Of `positions` (each with one length in every member), the layer axis of stacked
  MoE layers: the first one that, taken away, leaves a router kernel [d, E] and a bank
  leaf [E, ..] (>= 3 axes, d among them) among `members`; None if there is none."""
  for p in positions:
    cores = {i: [shapes[i][q] for q in range(len(shapes[i])) if q != p and q not in scan[i]]
             for i in members}
    banks = [i for i in members if len(cores[i]) >= 3 and not (
        decided_by_name[i] and tiers[i] not in (None, EXPERTS))]
    for r in members:
      if not _may_route(r, tiers, decided_by_name) or _vocabulary.is_vector(segs[r]):
        continue
      for b in banks:
        e = _vocabulary.router_count(cores[r], _vocabulary.is_torch_layout(segs[r]),
                                      set(cores[b][1:]))
        if b != r and e is not None and e >= 2 and e == cores[b][0]:
          return p
  return None


def _sibling_stacks(segs: Sequence[_paths.Segments], shapes: Sequence[Optional[tuple[int, ...]]],
                    scan: Sequence[set[int]], tiers: Sequence[Optional[str]],
                    decided_by_name: Sequence[bool]
                    ) -> list[tuple[_paths.Segments, list[int], int]]:
  """Stacked MoE layers among the children of one module (the root too) that no subtree
  explained: `(module, members, layer axis)` per stack found, outer modules first.

  A child (a leaf, or a subtree all of whose array leaves qualify) takes part when
  nothing scanned it yet and it has >= 2 axes with the length `n` at position `p`; the
  children sharing (p, n) are a stack when `_moe_layer_axis` finds a router and its bank
  among them. Leaves beside them with other lengths there (an embedding [V, d] beside
  the stack at the root) stay out.
  """
  arrays = [i for i, s in enumerate(shapes) if s is not None and not scan[i]]
  # A stacked router has >= 3 axes: only the modules above one, and its axes, are tried.
  routers = [i for i in arrays if len(shapes[i]) >= 3 and not _vocabulary.is_vector(segs[i])
             and _may_route(i, tiers, decided_by_name)]
  modules = sorted({segs[r][:k] for r in routers for k in range(len(segs[r]))}, key=len)
  found = []
  taken: set[int] = set()
  for module in modules:
    children: dict[str, list[int]] = {}
    for i in arrays:
      if i not in taken and len(segs[i]) > len(module) and segs[i][:len(module)] == module:
        children.setdefault(segs[i][len(module)], []).append(i)
    keys = sorted({(p, shapes[r][p]) for r in routers if r not in taken
                   and segs[r][:len(module)] == module for p in range(len(shapes[r]))})
    for p, n in keys:
      members = [i for leaves in children.values()
                 if all(len(shapes[i]) >= 2 and len(shapes[i]) > p and shapes[i][p] == n
                        for i in leaves) for i in leaves]
      if n >= 2 and len(members) >= 2 and _moe_layer_axis(
          members, [p], segs, shapes, scan, tiers, decided_by_name) is not None:
        found.append((module, members, p))
        taken.update(members)
        break
  return found
