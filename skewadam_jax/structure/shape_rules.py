"""Tiers from shapes: expert banks and their routers, whatever they are called.

After the name rules, the labeler reads the structure of the tree: the scanned stacks
and name-free banks that `stacks` finds (a bank beside a router candidate [d, E]), then
a vector [E] beside a router kernel [d, E] (its bias), then, within one MoE block,
leaves beside a router [d, E] whose first unscanned axis is E (experts) and a kernel
[..., E] beside a bank of E experts (a router).
"""

from __future__ import annotations

from typing import Optional

from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import stacks as _stacks
from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure.vocabulary import EXPERTS
from skewadam_jax.structure.vocabulary import ROUTER


def _router_count(leaf: _paths.Leaf) -> Optional[int]:
  """The expert count E of a router kernel: [d, E] or (transposed) [E, d], read after
  the scanned axes are removed (a stacked router [R, d, E] or [d, L, E] is [d, E])."""
  return None if _vocabulary.is_vector(leaf.segs) else _vocabulary.expert_count(leaf.core)


def stacks_and_banks(leaves: list[_paths.Leaf], label: bool) -> _stacks.StacksAndBanks:
  """Scanned axes of every leaf; with `label`, name-free banks and their routers."""
  found = _stacks.scan_leaves(leaves, [x.tier is not None for x in leaves])
  if not label:
    return found
  for group in found.groups:
    if group.kind != 'bank':
      continue
    where = '/'.join(group.prefix) or '<root>'
    first = leaves[group.routers[0]].path
    for i in group.members:
      leaf = leaves[i]
      if leaf.tier is None:
        leaf.tier, leaf.source, leaf.unit, leaf.count = (
            EXPERTS, 'structure', group.prefix, group.length)
        leaf.why = (f'axis {group.axis} ({group.length}) is shared by the leaves of a '
                    f'bank in {where}, beside router candidate {first}')
    for r in group.routers:
      router = leaves[r]
      module = router.segs[:-1]
      if router.tier is None:
        router.tier, router.source, router.unit = ROUTER, 'structure', module
        router.why = (f'maps an axis of bank {where} to its {group.length} experts')
      # A router module of its own brings its bias / scale along; a router kernel that is
      # a bare leaf beside the bank's leaves (`ffn/{sel, w_in, w_out}`) brings a bias [E]
      # only: the module's other leaves (a norm scale, a dense kernel) route nothing.
      beside = any(leaves[i].segs[:-1] == module for i in group.members)
      for leaf in leaves:  # its bias / scale, in the same module
        if leaf.tier is None and leaf.segs[:-1] == module and (
            not beside or leaf.core == (group.length,)):
          leaf.tier, leaf.source, leaf.unit = ROUTER, 'structure', router.segs[:-1]
          leaf.why = f'beside router kernel {router.path}'
  return found


def block_structure(leaves: list[_paths.Leaf], use_axis_names: bool) -> None:
  """Experts beside a router, and a router beside a bank, within one MoE block."""
  children = {prefix: [leaves[i] for i in members]
              for prefix, members in _paths.subtrees([x.segs for x in leaves]).items()}

  def free(leaf: _paths.Leaf) -> bool:
    # Axis names that are well formed and name no expert axis rule an expert out.
    return leaf.tier is None and not (use_axis_names and leaf.names_well_formed)

  # Leaves beside a router [d, E] (under its block) whose leading axis is E: experts.
  for router in [x for x in leaves if x.tier == ROUTER and x.unit]:
    e, block = _router_count(router), router.unit[:-1]
    if e is None or e < 2 or not block:
      continue
    for leaf in children.get(block, []):
      if free(leaf) and leaf.core and leaf.core[0] == e and not (
          leaf.segs[:len(router.unit)] == router.unit):
        leaf.tier, leaf.source, leaf.unit = EXPERTS, 'structure', leaf.segs
        leaf.why = (f'{"first unscanned" if leaf.scan else "leading"} axis {e} = the '
                    f'expert count of router {router.path}')

  # A kernel [..., E] beside a bank of E experts (in a block with no router): router.
  banks: dict[tuple[str, ...], dict[tuple[str, ...], list[_paths.Leaf]]] = {}
  for leaf in leaves:
    if leaf.tier == EXPERTS and len(leaf.unit) > 1:
      banks.setdefault(leaf.unit[:-1], {}).setdefault(leaf.unit, []).append(leaf)
  for block, units in banks.items():
    if any(x.tier == ROUTER for x in children.get(block, [])):
      continue
    counts = {_bank_count(members, unit) for unit, members in units.items()} - {None}
    if len(counts) != 1 or min(counts) < 2:
      continue
    e = counts.pop()
    found = []
    for leaf in children.get(block, []):
      core = leaf.core
      if leaf.tier is not None or len(core) != 2:  # (a router is [d, E]: [d, H, hd] is not)
        continue
      torch_layout = _vocabulary.is_torch_layout(leaf.segs)  # [out, in]
      count, other = _vocabulary.kernel_sides(core, torch_layout)
      if count == e and other != e:
        leaf.tier, leaf.source, leaf.unit = ROUTER, 'structure', leaf.segs[:-1]
        leaf.why = (f'{"first" if torch_layout else "last"} axis {e} = the expert count '
                    f'of the bank beside it in {"/".join(block)}')
        found.append(leaf)
    for router in found:  # its bias / scale, in the same module
      for leaf in children.get(router.unit, []):
        # A bare router kernel of the block itself brings a bias [E] only (as above).
        if leaf.tier is None and (router.unit != block or leaf.core == (e,)):
          leaf.tier, leaf.source, leaf.unit = ROUTER, 'structure', router.unit
          leaf.why = f'beside router kernel {router.path}'


def _bank_count(members: list[_paths.Leaf], unit: tuple[str, ...]) -> Optional[int]:
  """E of an expert bank: its numbered modules' count, else its common leading axis."""
  if members[0].count is not None:
    return members[0].count
  numbered = {m.segs[len(unit)] for m in members if len(m.segs) > len(unit)}
  if numbered and all(s.isdigit() for s in numbered):
    return len(numbered)  # HF-style experts/0/w1, experts/1/w1, ...
  leading = {m.core[0] for m in members if len(m.core) >= 2}
  return leading.pop() if len(leading) == 1 else None


def bias_kernels(leaves: list[_paths.Leaf]) -> None:
  """The kernel of a router whose bias [E] a name decided: in the bias's module, with no
  router kernel there, the one undecided kernel [d, E] ([E, d] for a PyTorch `weight`)
  mapping a width to the bias's E entries (`{router_bias [E], kt [d, E], w [d, f]}`)."""
  for bias in [x for x in leaves if x.tier == ROUTER and len(x.core) == 1]:
    e, module = bias.core[0], bias.segs[:-1]
    beside = [x for x in leaves if x.segs[:-1] == module and len(x.core) == 2]
    if e < 2 or any(x.tier == ROUTER for x in beside):
      continue
    found = [x for x in beside if x.tier is None and not _vocabulary.is_vector(x.segs)
             and _vocabulary.kernel_sides(x.core, _vocabulary.is_torch_layout(x.segs))[0]
             == e and min(x.core) == e and max(x.core) != e]
    if len(found) == 1:
      kernel = found[0]
      kernel.tier, kernel.source, kernel.unit = ROUTER, 'structure', module
      kernel.why = f'maps a width to the {e} entries of router bias {bias.path}'


def router_vectors(leaves: list[_paths.Leaf]) -> None:
  """Vectors [E] that nothing decided beside a router kernel [d, E] in its module: the
  router's (selection) bias, whatever it is called (`{router [d, E], bq [E], experts:
  [...]}`). Beside a bank's leaves in the same module ([E, d, f]) such a vector may as
  well be a per-expert scale: it is labelled as a bias, and `unsure` reports it."""
  for router in [x for x in leaves if x.tier == ROUTER and len(x.core) == 2]:
    e = _router_count(router)
    if e is None or e < 2:
      continue
    for leaf in leaves:
      if leaf.tier is None and leaf.core == (e,) and leaf.segs[:-1] == router.segs[:-1]:
        leaf.tier, leaf.source, leaf.unit = ROUTER, 'structure', router.segs[:-1]
        leaf.why = f'a vector [{e}] beside router kernel {router.path}: its bias'
