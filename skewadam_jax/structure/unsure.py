"""Unsure labels: what the labeler could not decide with confidence.

The findings name the leaves whose tier is a guess (numbered units beside a router
candidate, subtrees that read as a stack and as a bank alike, rank >= 3 leaves left in
the default tier, vectors beside a router kernel in a flat module (a norm or the
router's input scale; a router bias or a per-expert scale), an expert axis name
that the shape confirms on a leaf of another tier, experts without a router or a router
without experts), with the rules that settle each; `warning.report` turns them into one
`UnsureLabelWarning` per call (or a `ValueError` when strict).

A bank may also be kept as separate leaves, one unit per expert (`numbered_units`):
n >= 2 sibling units indexed 0..n-1 (list, tuple or `nnx.List` indices, dict keys '0',
'1', ..., or `<stem>_0 .. <stem>_{n-1}`), of identical structure and shapes, beside a
router candidate that maps a width all their matrices share to n outputs. Unrolled dense
layers beside an unrelated [d, n] kernel look exactly the same, so that reading is only
ever reported, never labelled.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import name_rules as _name_rules
from skewadam_jax.structure import stacks as _stacks
from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure.vocabulary import BACKBONE
from skewadam_jax.structure.vocabulary import EXPERTS
from skewadam_jax.structure.vocabulary import ROUTER


_RANKED_APART = 3  # rank >= 3 leaves in the default tier reported one line each


@dataclasses.dataclass
class Units:
  """Sibling units indexed 0..n-1 of identical structure and shapes (an expert bank kept
  as separate leaves, or unrolled dense layers) beside router candidates [d, n]."""
  prefix: tuple[str, ...]  # lowercase segments of the module holding the units
  stem: str  # the units' `<stem>_` ('' for indices and digit keys)
  units: list[list[int]]  # each unit's leaves, unit 0 first
  routers: list[int]  # kernels beside them mapping their shared width to n outputs


def numbered_units(segs: Sequence[tuple[str, ...]],
                   shapes: Sequence[Optional[tuple[int, ...]]], scan: Sequence[set[int]],
                   free: Sequence[bool], router_ok: Sequence[bool]) -> list[Units]:
  """Families of numbered units that may be an expert bank kept as separate leaves.

  A family is the units `<module>/<i>` (or `<module>/<stem>_<i>`), i = 0..n-1 without
  gaps, n >= 2, whose leaves are all `free`, are matrices or vectors (one matrix at
  least: a leaf with more axes is reported as rank >= 3 anyway) and are the same from
  unit to unit (paths below the unit, shapes, scanned axes). It is kept only if a
  router candidate sits beside it, as `stacks` looks for one beside a stacked bank: a
  `router_ok` kernel outside the units, under the module that holds the list (`q`
  beside `u/0..`) or the units (`ffn/sel` beside `ffn/unit_0..`), a bare leaf there or
  the kernel of a module of its own, whose core is [d, n] ([n, d] for a
  PyTorch `weight`) with d an axis length that every matrix of a unit has.

  Args:
    segs: each leaf's lowercase normalised path segments.
    shapes: each leaf's shape, or None for a leaf that is not an array.
    scan: each leaf's scanned (layer) axes.
    free: whether nothing (no rule, name or structure) decided the leaf's tier.
    router_ok: whether the leaf may be a router (free, or labelled `router`).

  Returns:
    The families found, outer modules first.
  """
  families: dict[tuple[tuple[str, ...], str], dict[int, list[int]]] = {}
  for i, s in enumerate(segs):
    if shapes[i] is None:
      continue
    for k, seg in enumerate(s):
      m = _vocabulary.NUMBERED_UNIT.match(seg)
      if m:
        key = (s[:k], m['stem'] or '')
        families.setdefault(key, {}).setdefault(int(m['idx']), []).append(i)
  found = []
  for (prefix, stem), by_index in sorted(families.items(), key=lambda kv: len(kv[0][0])):
    n = len(by_index)
    if n < 2 or sorted(by_index) != list(range(n)):
      continue
    units = [by_index[e] for e in range(n)]
    members = [i for unit in units for i in unit]
    if not all(free[i] for i in members):
      continue
    # Each unit's leaves by their path below the unit, shape and scanned axes.
    signatures = [sorted((segs[i][len(prefix) + 1:], shapes[i], tuple(sorted(scan[i])))
                         for i in unit) for unit in units]
    if any(sig != signatures[0] for sig in signatures[1:]):
      continue
    cores = [_paths.core_shape(shapes[i], scan[i]) for i in units[0]]
    if any(len(c) not in (1, 2) for c in cores) or all(len(c) != 2 for c in cores):
      continue
    widths = set.intersection(*(set(c) for c in cores if len(c) == 2))
    # The module beside which a router sits: the list's parent (`q` beside `u/0..`), or
    # the parent of `<stem>_<i>` units, which take the place of the list.
    area = prefix if stem else prefix[:-1]
    inside = set(members)
    near = [j for j in range(len(segs)) if j not in inside and shapes[j] is not None
            and router_ok[j] and len(segs[j]) <= len(area) + 2]
    routers = _stacks.kernels_mapping(area, n, widths, near, segs, shapes, scan)
    if routers:
      found.append(Units(prefix, stem, units, routers))
  return found


def _rule_hint(path: str, tier: str) -> str:
  return f"sj.make_labeler([({path!r}, {tier!r})])"


def _unit_findings(leaves: list[_paths.Leaf], use_axis_names: bool) -> list[str]:
  """Numbered units of identical shapes beside a router candidate [d, n] that nothing
  decided (`numbered_units`), one line per router: an expert bank kept as
  separate leaves and its router, or unrolled dense layers beside an unrelated kernel.
  Shapes cannot tell these apart, so the leaves keep the default tier and are reported
  (with the rules that settle it either way); sets each reported leaf's `note`."""

  def free(leaf: _paths.Leaf) -> bool:
    # Decided by no rule and no structure. A dense name (`mlp`, `ffn`) does not rule a bank
    # out, as it does not for a stacked bank (MoE blocks are called `mlp` too); as in
    # `block_structure`, well-formed axis names without an expert axis do.
    return leaf.source in ('default', 'dense rule') and not (
        use_axis_names and leaf.names_well_formed)

  found = numbered_units(
      [x.segs for x in leaves], [x.shape if x.is_array else None for x in leaves],
      [x.scan for x in leaves], [free(x) for x in leaves],
      [free(x) or x.tier == ROUTER for x in leaves])
  by_routers: dict[tuple[int, ...], list[Units]] = {}
  for family in found:
    by_routers.setdefault(tuple(family.routers), []).append(family)
  lines = []
  for routers, families in by_routers.items():
    n = len(families[0].units)
    members = [i for f in families for unit in f.units for i in unit]
    patterns = [_unit_pattern(leaves, f) for f in families]
    area = len(families[0].prefix) - (0 if families[0].stem else 1)
    inside = set(members)
    router_rules, along = [], []
    for r in routers:
      # As a router the structure finds: a kernel in a module of its own brings the
      # module (its bias, its scale); a bare kernel beside the units a bias [n] only.
      path, module = leaves[r].path, leaves[r].segs[:-1]
      own = len(leaves[r].segs) == area + 2
      router_rules.append(path.rsplit('/', 1)[0] if own else path)
      along += [j for j, x in enumerate(leaves)
                if x.segs[:-1] == module and free(x) and (own or x.core == (n,))
                and j not in inside and j not in routers and j not in along]
    tier = leaves[members[0]].tier
    label = [(p, EXPERTS) for p in patterns] + [(p, ROUTER) for p in router_rules]
    confirm = [(p, tier) for p in patterns]
    shown = ', '.join(f'{leaves[r].path} {list(leaves[r].shape)}' for r in routers)
    if along:
      shown += f" (with {', '.join(leaves[j].path for j in along)})"
    sets = f'{len(families)} sets of {n}' if len(families) > 1 else f'{n}'
    for i in members:
      leaves[i].note = (f'UNSURE: one of {n} numbered units beside router candidate '
                        f'{leaves[routers[0]].path}: an expert or a dense layer (see the '
                        'warning)')
    for r in [*routers, *along]:
      leaves[r].note = (f"UNSURE: a router candidate [d, {n}] (or its bias) beside {n} "
                        f"numbered units {', '.join(patterns)} (see the warning)")
    lines.append(
        f"{', '.join(leaves[i].path for i in members)}: {sets} numbered units "
        f"({', '.join(patterns)}) of identical structure and shapes beside {shown}, which "
        f'maps a width of theirs to {n} outputs: an expert bank kept as separate leaves '
        f'and its router, or {n} dense layers beside an unrelated matrix, which no name '
        f'tells apart; left in {tier!r} by default; if it is a bank, label it: '
        f'sj.make_labeler({label!r}), or confirm it: sj.make_labeler({confirm!r})')
  return lines


def _unit_pattern(leaves: list[_paths.Leaf], family: Units) -> str:
  """A rule pattern for the units of `family`, as written in the paths: `u/*` for a
  list, `ffn/unit_*` for `<stem>_<i>` modules, `ffn/[0-9]*` for digit keys among
  others."""
  k = len(family.prefix)
  written = leaves[family.units[0][0]].path.split('/')
  module = written[:k]
  if family.stem:
    return '/'.join(module + [written[k].rsplit('_', 1)[0] + '_*'])
  inside = {i for unit in family.units for i in unit}
  alone = all(i in inside for i, x in enumerate(leaves) if x.segs[:k] == family.prefix)
  return '/'.join(module + ['*' if alone and module else '[0-9]*'])


def _router_inputs(leaves: list[_paths.Leaf], use_axis_names: bool) -> list[str]:
  """Vectors [d] that nothing decided in one flat module with a router kernel [d, E]
  and its bank's leaves (`{r [d], s [d], q [d, E], w_in [E, d, f], ...}`, stacked or
  not): a scale of the router's input (router) or of the block's, a norm (backbone).
  No shape tells them apart; they stay in the default tier and are reported."""
  lines = []
  for router in leaves:
    core = router.core
    if router.tier != ROUTER or len(core) != 2 or _vocabulary.is_vector(router.segs):
      continue
    module = router.segs[:-1]
    if not any(x.tier == EXPERTS and x.segs[:-1] == module for x in leaves):
      continue  # the bank has a module of its own: the block's vectors are its norms
    d = _vocabulary.kernel_sides(core, _vocabulary.is_torch_layout(router.segs))[1]
    for leaf in leaves:
      if leaf.segs[:-1] != module or leaf.source != 'default' or leaf.core != (d,) or (
          leaf.note or (use_axis_names and leaf.names_well_formed)):
        continue
      reason = (f'a vector [{d}] beside router kernel {router.path}, which reads that '
                "width: a scale of the router's input or of the block's (a norm), which no "
                f'name tells apart; left in {leaf.tier!r} by default')
      leaf.note = f'UNSURE: {reason}'
      lines.append(f'{leaf.path} {list(leaf.shape)}: {reason}; if it scales the '
                   f"router's input, label it: {_rule_hint(leaf.path, ROUTER)}, or "
                   f'confirm it: {_rule_hint(leaf.path, leaf.tier)}')
  return lines


def _bias_or_scale(leaves: list[_paths.Leaf]) -> list[str]:
  """Vectors [E] that structure decided in one flat module with a router kernel [d, E]
  and its bank's leaves [E, ...] (`{q [d, E], s [E], w_in [E, d, f], ...}`): the router's
  selection bias (router) or a per-expert scale of the bank (experts). No shape tells
  them apart; they keep the label given and are reported, all in one line (one per
  layer of a loop would push others out of the warning)."""
  found: list[tuple[_paths.Leaf, _paths.Leaf]] = []
  for router in leaves:
    core = router.core
    if router.tier != ROUTER or len(core) != 2 or _vocabulary.is_vector(router.segs):
      continue
    module, e = router.segs[:-1], _vocabulary.expert_count(core)
    if not any(x.tier == EXPERTS and x.segs[:-1] == module and len(x.core) >= 2
               and x.core[0] == e for x in leaves):
      continue  # the bank has a module of its own: a vector [E] here is the router's
    for leaf in leaves:
      if leaf.segs[:-1] != module or leaf.source != 'structure' or leaf.core != (e,) or (
          leaf.note or leaf.segs[-1].startswith(router.segs[-1])):
        continue  # (`w_sel_b` beside `w_sel`: the name says whose bias it is)
      leaf.note = (f'UNSURE: a vector [{e}] beside router kernel {router.path} and its '
                   f"bank: its selection bias or a per-expert scale; labelled {leaf.tier!r}")
      found.append((leaf, router))
  if not found:
    return []
  leaf, router = found[0]
  other = EXPERTS if leaf.tier == ROUTER else ROUTER
  shown = ', '.join(f'{x.path} {list(x.shape)} ({x.tier})' for x, _ in found)
  return [f'{shown}: vectors [E] beside a router kernel [d, E] ({router.path}, ...) and '
          "the leaves of its bank in one module: the router's selection bias or a "
          'per-expert scale of the bank, which no name tells apart; labelled as shown; '
          f'if one is the other, label it, e.g. {_rule_hint(leaf.path, other)}, or '
          f'confirm it, e.g. {_rule_hint(leaf.path, leaf.tier)}']


def _odd_members(leaves: list[_paths.Leaf]) -> list[str]:
  """Leaves that shapes alone put in a bank although a size of theirs is no size of the
  bank: the matrices of one bank share their widths (`[E, d, f]`, `[E, f, d]`, a bias
  `[E, f]`, a fused `[E, d, 2f]`), so a member `[E, hd, d]` whose `hd` no other member
  has is as well an attention kernel `[H, hd, d]` with `H == E`. Its tier is a guess;
  it keeps it and is reported, with the rules that settle it."""
  banks: dict[tuple[str, ...], list[_paths.Leaf]] = {}
  for leaf in leaves:
    if leaf.tier == EXPERTS and leaf.source == 'structure' and leaf.count:
      banks.setdefault(leaf.unit, []).append(leaf)
  lines = []
  for members in banks.values():
    sizes = {x.path: [n for a, n in enumerate(x.core) if a != x.core.index(x.count)]
             for x in members if x.count in x.core}
    matrices = len([w for w in sizes.values() if len(w) >= 2])
    if matrices < 2:
      continue  # one matrix: nothing to compare its widths with
    # Two matrices may be a fused gate and up [E, d, 2f] and its down [E, f, d].
    factors = (1, 2, 0.5) if matrices == 2 else (1,)
    for leaf in members:
      others = {k * n for path, widths in sizes.items() if path != leaf.path
                for n in widths for k in factors}
      odd = [n for n in sizes.get(leaf.path, ()) if n not in others]
      if not odd or leaf.note:
        continue
      reason = (f'labelled {leaf.tier!r} from its shape (an axis of {leaf.count}, the '
                f'bank beside it), but its width {odd[0]} is no other leaf of the bank: '
                f'as well a dense kernel whose axis has that length by coincidence (heads '
                f'== E)')
      leaf.note = f'UNSURE: {reason}'
      lines.append(f'{leaf.path} {list(leaf.shape)}: {reason}; if it is dense, label it: '
                   f"{_rule_hint(leaf.path, BACKBONE)}, or confirm it: "
                   f'{_rule_hint(leaf.path, leaf.tier)}')
  return lines + _doubtful_banks(leaves)


def _doubtful_banks(leaves: list[_paths.Leaf]) -> list[str]:
  """Banks that shapes alone found where a width of the model reads as an expert count:
  banks of different counts in one module, each beside a router candidate of its own
  (`{router [d, E], w_in [E, d, f], wq [d, H, hd], w2 [f, d]}` reads as a bank of E and
  a bank of d experts: at most one is), a bank of as many experts as the widest vector
  of the backbone (a norm gain [d]: E < d in every MoE), or one beside a bank the names
  found below its module (`{router, experts: [...], wo [E, hd, d]}`: one router, one
  bank). No shape tells; every such leaf keeps its guess and is reported."""
  widest = max((x.core[0] for x in leaves if len(x.core) == 1 and x.tier not in (
      EXPERTS, ROUTER)), default=None)
  modules: dict[tuple[str, ...], list[_paths.Leaf]] = {}
  for leaf in leaves:
    if leaf.tier in (EXPERTS, ROUTER) and leaf.source == 'structure':
      modules.setdefault(leaf.segs[:-1], []).append(leaf)
  lines = []
  for module, members in modules.items():
    counts = {x.count for x in members if x.tier == EXPERTS and x.count}
    # (a bank the names found below this module: its router serves that one)
    # (or numbered units reported beside a router candidate, which may be that bank)
    named = any((x.tier == EXPERTS and x.source != 'structure' or x.note.startswith(
        'UNSURE: one of')) and len(x.segs) > len(module) + 1
        and x.segs[:len(module)] == module for x in leaves)
    if len(counts) < 2 and not (counts and widest and max(counts) >= widest) and not (
        counts and named):
      continue
    found = [x for x in members if not x.note]
    for leaf in found:
      leaf.note = ('UNSURE: one of banks of ' + ' and '.join(map(str, sorted(counts)))
                   + ' experts read from shapes in one module (see the warning)')
    if found:
      shown = ', '.join(f'{x.path} {list(x.shape)} ({x.tier})' for x in found)
      lines.append(
          f"{shown}: banks of {' and '.join(map(str, sorted(counts)))} experts, each "
          f"beside a router candidate, read from shapes alone in {'/'.join(module)}: "
          'at most one is a bank, and E < d (a length shared by coincidence reads as '
          'another), which no shape tells; labelled as shown; label the dense ones, e.g. '
          f"{_rule_hint(found[0].path, BACKBONE)}")
  return lines


def findings(leaves: list[_paths.Leaf], use_axis_names: bool,
            found: Optional[_stacks.StacksAndBanks] = None) -> list[str]:
  """Unsure leaves, one line per finding; also sets each reported leaf's `note`."""
  lines = (_unit_findings(leaves, use_axis_names) + _bias_or_scale(leaves)
           + _router_inputs(leaves, use_axis_names) + _odd_members(leaves))
  counts = _name_rules.router_counts(leaves)
  for line, members in (found.confusions if found is not None else ()):
    for i in members:
      leaves[i].note = 'UNSURE: a stack of layers or a bank of experts (see the warning)'
    lines.append(line)
  ranked = []  # rank >= 3 leaves left in the default tier: one line each, or one for all
  modules = {x.segs for x in leaves}
  for leaf in leaves:
    where = f'{leaf.path} {list(leaf.shape)}'
    core = leaf.core
    if leaf.source == 'default' and len(core) >= 3 and core[0] > 1 and not (
        use_axis_names and leaf.names_well_formed) and not leaf.note and not (
        leaf.segs[-1] == 'wo' and leaf.segs[:-1] + ('wq',) in modules):  # attention's
      scanned = f' beside scanned axes {sorted(leaf.scan)}' if leaf.scan else ''
      reason = (f'rank-{len(core)} leaf{scanned} left in {leaf.tier!r} by default (no '
                'rule or structure says what it is)')
      leaf.note = f'UNSURE: {reason}'
      ranked.append(leaf)
      lines.append(f"{where}: {reason}; if it is an expert bank, label it: "
                   f"{_rule_hint(leaf.path, EXPERTS)}, or confirm it: "
                   f'{_rule_hint(leaf.path, leaf.tier)}')
    # An expert axis name where the shape agrees (a router maps to its length): a bank
    # that a dense name (`ffn`) or the default left in another tier. Never on a leaf a
    # rule names (`*embed*`, `*attn*`): sharding names are hints, not structure.
    axis = _name_rules.confirmed_expert_axis(leaf, counts)
    if axis is not None and leaf.tier not in (EXPERTS, ROUTER) and leaf.source not in (
        'rule', 'default rule'):
      reason = f'axis {axis} is named {leaf.names[axis]!r} but the leaf is {leaf.tier!r}'
      leaf.note = f'UNSURE: {reason}'
      lines.append(f"{where}: {reason}; label it: {_rule_hint(leaf.path, EXPERTS)}, or "
                   'pass param_labels=sj.moe_param_labels(params, use_axis_names=True)')
  if len(ranked) > _RANKED_APART:  # one line naming them all (the warning shows 10 lines)
    lines = [x for x in lines if not any(x.startswith(f'{y.path} [') for y in ranked)]
    lines.append(f"{', '.join(f'{x.path} {list(x.shape)}' for x in ranked)}: rank >= 3 "
                 f"leaves left in {ranked[0].tier!r} by default (no rule or structure says "
                 "what they are); if one is an expert bank, label it, e.g. "
                 f"{_rule_hint(ranked[0].path, EXPERTS)}, or confirm it: "
                 f'{_rule_hint(ranked[0].path, ranked[0].tier)}')
  routers = [x for x in leaves if x.tier == ROUTER]
  experts = [x for x in leaves if x.tier == EXPERTS]
  for mine, others, what, missing, hint in (
      (experts, routers, EXPERTS, ROUTER, '<router module>'),
      (routers, experts, ROUTER, EXPERTS, '<expert bank>')):
    guessed = [x for x in mine if x.source != 'rule']
    if not guessed or others:
      continue
    reason = f'labelled {what!r} but no leaf of the tree is labelled {missing!r}'
    for leaf in guessed:
      leaf.note = f'UNSURE: {reason}'
    shown = ', '.join(x.path for x in guessed[:5])
    more = f' and {len(guessed) - 5} more' if len(guessed) > 5 else ''
    lines.append(f'{shown}{more}: {reason}; label the {missing} with a rule, e.g. '
                 f'{_rule_hint(hint, missing)}, or these leaves, e.g. '
                 f"{_rule_hint(guessed[0].path, BACKBONE)}")
  return lines
