"""The layer axis that router kernels reveal in a stack of MoE layers.

A router kernel maps the model width d to the expert count E: [d, E], or [E, d] in
PyTorch's `weight` layout (`vocabulary.router_count`). A bank of E experts holds E
matrices that each read or write d: [E, d, f], [E, f, d]. Stacking MoE layers (a scan
over L layers) puts one more axis of length L on every leaf of the layer: the router
becomes [L, d, E], the bank [L, E, d, f], the attention and norm weights beside them
[L, d, d] and [L, d].

So a group of leaves that share one axis length at one position is a stack of layers,
not a bank, when, with that axis taken away, the group still holds a router and its
bank: a kernel [d, E] and a leaf [E, ..] with >= 3 axes that has d among its others. A
bank of L experts would need its router to carry L on an axis of its own, which no
router does. This reads the layer axis from what the leaves are, whatever their
containers are called (`blocks`, `body`, a random token or the root).
"""

from __future__ import annotations

from typing import Optional, Sequence

from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure.vocabulary import EXPERTS
from skewadam_jax.structure.vocabulary import ROUTER


def may_route(i: int, tiers: Sequence[Optional[str]], decided_by_name: Sequence[bool]
              ) -> bool:
  """Whether leaf `i` may be a router: undecided, or labelled `router`."""
  return tiers[i] in (None, ROUTER) and not (decided_by_name[i] and tiers[i] != ROUTER)


def moe_layer_axis(members: Sequence[int], positions: Sequence[int],
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
      if not may_route(r, tiers, decided_by_name) or _vocabulary.is_vector(segs[r]):
        continue
      for b in banks:
        e = _vocabulary.router_count(cores[r], _vocabulary.is_torch_layout(segs[r]),
                                      set(cores[b][1:]))
        if b != r and e is not None and e >= 2 and e == cores[b][0]:
          return p
  return None


def sibling_stacks(segs: Sequence[_paths.Segments], shapes: Sequence[Optional[tuple[int, ...]]],
                   scan: Sequence[set[int]], tiers: Sequence[Optional[str]],
                   decided_by_name: Sequence[bool]
                   ) -> list[tuple[_paths.Segments, list[int], int]]:
  """Stacked MoE layers among the children of one module (the root too) that no subtree
  explained: `(module, members, layer axis)` per stack found, outer modules first.

  A child (a leaf, or a subtree all of whose array leaves qualify) takes part when
  nothing scanned it yet and it has >= 2 axes with the length `n` at position `p`; the
  children sharing (p, n) are a stack when `moe_layer_axis` finds a router and its bank
  among them. Leaves beside them with other lengths there (an embedding [V, d] beside
  the stack at the root) stay out.
  """
  arrays = [i for i, s in enumerate(shapes) if s is not None and not scan[i]]
  # A stacked router has >= 3 axes: only the modules above one, and its axes, are tried.
  routers = [i for i in arrays if len(shapes[i]) >= 3 and not _vocabulary.is_vector(segs[i])
             and may_route(i, tiers, decided_by_name)]
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
      if n >= 2 and len(members) >= 2 and moe_layer_axis(
          members, [p], segs, shapes, scan, tiers, decided_by_name) is not None:
        found.append((module, members, p))
        taken.update(members)
        break
  return found
