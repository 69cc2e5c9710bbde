"""The MoE labeler: maps parameter paths and shapes to SkewAdam tiers.

Paths are normalised (keys stringified, a trailing `value` dropped, joined with `/`)
so that `init` (boxed Linen params, `nnx.State`) and `update` (the pure arrays that
`nnx.Optimizer` passes) see identical labels. A leaf's tier is decided, in order, by

1. the user's rules (whole-segment globs, first match wins);
2. numbered sibling modules (`expert_0 .. expert_{n-1}`): one module per expert;
3. `DEFAULT_RULES` (first match wins);
4. logical axis names, only in `moe_param_labels(..., use_axis_names=True)`;
5. shapes alone (`_stacks`): scanned stacks (a subtree whose leaves all share one
   axis length that nothing outside has), whose axis is then never read as an expert
   count, and expert banks (a subtree whose leaves share an axis length E, beside a
   router candidate [d, E] whose d is an axis of the bank): bank and router, whatever
   they are called;
6. structure, within one MoE block: leaves beside a router [d, E] whose first axis
   (after the scanned ones) is E are experts; a kernel [..., E] beside a bank of E
   experts is a router;
7. `DENSE_RULES` (known dense modules, backbone);
8. the default tier, `backbone` (lossless).

Only paths and shapes are used (plus axis names where asked), so the same tree gets the
same labels whether its leaves are arrays, tracers or `jax.ShapeDtypeStruct`s, and
whatever the container (dicts, lists, Flax states and boxes, Equinox modules, custom
pytree nodes); a leaf that is not an array (an Equinox module's function or integer
field) is static, as `eqx.filter(model, eqx.is_array)` has it: it gets the default
tier and takes no part in the structure. Leaves the labeler is unsure about are
reported (a warning, or a `ValueError` when `strict`); so are numbered units of identical
shapes beside a router candidate (`_stacks.numbered_units`), an expert bank kept as
separate leaves or unrolled dense layers, which shapes cannot tell apart.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax

from skewadam_jax.core import checks as _checks
from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import stacks as _stacks

Rule = tuple[str, str]  # (pattern, tier): pattern is '/'-separated segment globs.

# Ordered, first match wins; checked after the user's rules and after numbered expert
# modules, before the structural recognition.
DEFAULT_RULES: tuple[Rule, ...] = (
    # Shared experts see every token: dense, whatever their inside is called. Covers
    # DeepSeek/Llama 4 `shared_experts`, Qwen `shared_expert` and its output gate
    # `shared_expert_gate` [d, 1] (it routes nothing), Linen `SharedExpert_0`.
    ('*shared_expert*', 'backbone'),
    ('*sharedexpert*', 'backbone'),
    ('*shared_mlp*', 'backbone'),
    ('*shared_ffn*', 'backbone'),
    # Expert banks. An expert's own sub-module called `gate` stays an expert.
    ('routed_experts/gate', 'router'),  # MaxText Qwen3-Next: the router inside the bank
    ('experts', 'experts'),  # Flax/NNX MoE layers, EasyDeL, HF-style experts/w1..w3
    ('routed_experts', 'experts'),  # MaxText Qwen3-Next
    ('expert', 'experts'),  # Flaxformer
    ('*moe*/**/wi_0', 'experts'),  # MaxText MoeBlock: bare wi_0, wi_1, wo kernels
    ('*moe*/**/wi_1', 'experts'),
    ('*moe*/**/wi', 'experts'),
    ('*moe*/**/wo', 'experts'),
    ('*moe*/**/wi_0_bias', 'experts'),  # and their per-expert biases
    ('*moe*/**/wi_1_bias', 'experts'),
    ('*moe*/**/wi_bias', 'experts'),
    ('*moe*/**/wo_bias', 'experts'),
    ('per_expert_*', 'experts'),  # gemma / MaxText Gemma 4 `per_expert_scale` [E]
    # Dense modules that routers and experts are never inside of.
    ('*attention*', 'backbone'),
    ('*attn*', 'backbone'),
    ('*norm*', 'backbone'),
    ('*embed*', 'backbone'),
    # Routers.
    ('*router*', 'router'),  # router, gemma router_logits/router_scale, router_weights
    ('gate', 'router'),  # MaxText, HF Mixtral `block_sparse_moe/gate` (not `gate_proj`)
    ('pre_forward_scale_2', 'router'),  # MaxText Gemma 4: the router's input scale
)

# Dense MLP blocks: backbone. Checked after the structural recognition, because some
# MoE blocks are called `mlp` (gemma's `mlp` is its MoE, `mlp2` the dense branch); a
# leaf these name is known dense, so it is not reported as unsure.
DENSE_RULES: tuple[Rule, ...] = (
    ('*mlp*', 'backbone'),
    ('*ffn*', 'backbone'),
    ('*ffw*', 'backbone'),
    ('*feed_forward*', 'backbone'),
    ('*feedforward*', 'backbone'),
    ('lm_head', 'backbone'),
)
DEFAULT_TIER = 'backbone'

# Logical / mesh axis names that mark an expert axis (MaxText 'exp', Linen boxes).
EXPERT_AXIS_NAMES = frozenset({'exp', 'expert', 'experts', 'num_experts', 'routed_experts'})

_NUMBERED_EXPERT = re.compile(r'^(?P<stem>.*?experts?)[_-]?(?P<idx>\d+)$')
_NOT_KERNEL = _stacks.NOT_KERNEL  # router leaves that do not carry the expert count


class UnsureLabelWarning(UserWarning):
  """Some leaves' tiers are guesses: add rules (`make_labeler`) or pass `strict=True`."""


# ---------------------------------------------------------------------------- rules


def _check_rules(rules: Optional[Iterable[Rule]]) -> tuple[Rule, ...]:
  return _paths.check_rules(rules, lambda tier: isinstance(tier, str),
                            '`rules` must be a sequence of (pattern, tier) string pairs')


def label_for_path(path: str, rules: Sequence[Rule] = DEFAULT_RULES,
                   default: str = DEFAULT_TIER) -> str:
  """The tier of one normalised path by name alone: the first matching rule's, else
  `default` (no structure: use `make_labeler` for whole trees)."""
  found = _paths.first_match(_paths.compile_rules(rules), _paths.lower_segments(path))
  return default if found is None else found[1]


# ---------------------------------------------------------------------------- leaves


def _named_expert_axis(leaf: _paths.Leaf) -> Optional[int]:
  """Index of an axis whose name marks experts (only for well-formed names)."""
  if not leaf.names_well_formed:
    return None
  for i, entry in enumerate(leaf.names):
    entries = entry if isinstance(entry, (tuple, list)) else (entry,)
    if any(isinstance(e, str) and e.lower() in EXPERT_AXIS_NAMES for e in entries):
      return i
  return None


# ---------------------------------------------------------------------------- deciding


def _apply_rules(leaves: list[_paths.Leaf], rules: Sequence[_paths.CompiledRule],
                 source: str) -> None:
  """Gives every undecided leaf the tier of the first rule that matches its path."""
  for leaf in leaves:
    found = None if leaf.tier is not None else _paths.first_match(rules, leaf.segs)
    if found is not None:
      span, tier, text = found
      leaf.tier, leaf.source, leaf.why = tier, source, f'rule {text!r}'
      leaf.unit = leaf.segs[:span[1]]


def _numbered_experts(leaves: list[_paths.Leaf]) -> None:
  """Sibling modules `<..expert(s)>_0 .. _{n-1}` (n >= 2), one per expert: experts."""
  groups: dict[tuple[tuple[str, ...], str], dict[int, list[_paths.Leaf]]] = {}
  for leaf in leaves:
    if leaf.tier is not None:
      continue
    for k, seg in enumerate(leaf.segs):
      m = _NUMBERED_EXPERT.match(seg)
      if m and 'shared' not in m['stem']:
        key = (leaf.segs[:k], m['stem'])
        groups.setdefault(key, {}).setdefault(int(m['idx']), []).append(leaf)
        break
  for (prefix, stem), by_index in groups.items():
    n = len(by_index)
    if n < 2 or sorted(by_index) != list(range(n)):
      continue
    for members in by_index.values():
      for leaf in members:
        leaf.tier, leaf.source, leaf.count = 'experts', 'structure', n
        leaf.why = f'one of {n} numbered sibling modules {stem}_0..{stem}_{n - 1}'
        leaf.unit = leaf.segs[:len(prefix) + 1]


def _axis_name_experts(leaves: list[_paths.Leaf]) -> None:
  """Undecided leaves whose (well-formed) axis names include an expert axis: experts."""
  for leaf in leaves:
    axis = _named_expert_axis(leaf)
    if leaf.tier is None and axis is not None:
      leaf.tier, leaf.source = 'experts', 'axis names'
      leaf.why = f'axis {axis} is named {leaf.names[axis]!r}'
      leaf.unit = leaf.segs


def _router_count(leaf: _paths.Leaf) -> Optional[int]:
  """The expert count E of a router kernel: [d, E] or (transposed) [E, d], read after
  the scanned axes are removed (a stacked router [R, d, E] or [d, L, E] is [d, E])."""
  core = leaf.core
  if len(core) < 2 or any(s in leaf.segs[-1] for s in _NOT_KERNEL):
    return None
  return min(core[0], core[-1])  # E < d in every MoE


def _stacks_and_banks(leaves: list[_paths.Leaf], label: bool) -> _stacks.Structure:
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
            'experts', 'structure', group.prefix, group.length)
        leaf.why = (f'axis {group.axis} ({group.length}) is shared by the leaves of a '
                    f'bank in {where}, beside router candidate {first}')
    for r in group.routers:
      router = leaves[r]
      module = router.segs[:-1]
      if router.tier is None:
        router.tier, router.source, router.unit = 'router', 'structure', module
        router.why = (f'maps an axis of bank {where} to its {group.length} experts')
      # A router module of its own brings its bias / scale along; a router kernel that is
      # a bare leaf beside the bank's leaves (`ffn/{sel, w_in, w_out}`) brings a bias [E]
      # only: the module's other leaves (a norm scale, a dense kernel) route nothing.
      beside = any(leaves[i].segs[:-1] == module for i in group.members)
      for leaf in leaves:  # its bias / scale, in the same module
        if leaf.tier is None and leaf.segs[:-1] == module and (
            not beside or leaf.core == (group.length,)):
          leaf.tier, leaf.source, leaf.unit = 'router', 'structure', router.segs[:-1]
          leaf.why = f'beside router kernel {router.path}'
  return found


def _structure(leaves: list[_paths.Leaf], use_axis_names: bool) -> None:
  """Experts beside a router, and a router beside a bank, within one MoE block."""
  children = {prefix: [leaves[i] for i in members]
              for prefix, members in _paths.subtrees([x.segs for x in leaves]).items()}

  def free(leaf: _paths.Leaf) -> bool:
    # Axis names that are well formed and name no expert axis rule an expert out.
    return leaf.tier is None and not (use_axis_names and leaf.names_well_formed)

  # Leaves beside a router [d, E] (under its block) whose leading axis is E: experts.
  for router in [x for x in leaves if x.tier == 'router' and x.unit]:
    e, block = _router_count(router), router.unit[:-1]
    if e is None or e < 2 or not block:
      continue
    for leaf in children.get(block, []):
      if free(leaf) and leaf.core and leaf.core[0] == e and not (
          leaf.segs[:len(router.unit)] == router.unit):
        leaf.tier, leaf.source, leaf.unit = 'experts', 'structure', leaf.segs
        leaf.why = (f'{"first unscanned" if leaf.scan else "leading"} axis {e} = the '
                    f'expert count of router {router.path}')

  # A kernel [..., E] beside a bank of E experts (in a block with no router): router.
  banks: dict[tuple[str, ...], dict[tuple[str, ...], list[_paths.Leaf]]] = {}
  for leaf in leaves:
    if leaf.tier == 'experts' and len(leaf.unit) > 1:
      banks.setdefault(leaf.unit[:-1], {}).setdefault(leaf.unit, []).append(leaf)
  for block, units in banks.items():
    if any(x.tier == 'router' for x in children.get(block, [])):
      continue
    counts = {_bank_count(members, unit) for unit, members in units.items()} - {None}
    if len(counts) != 1 or min(counts) < 2:
      continue
    e = counts.pop()
    found = []
    for leaf in children.get(block, []):
      core = leaf.core
      if leaf.tier is not None or len(core) < 2:
        continue
      torch_layout = leaf.segs[-1] == 'weight'  # [out, in]
      count = core[0] if torch_layout else core[-1]
      other = core[-1] if torch_layout else core[0]
      if count == e and other != e:
        leaf.tier, leaf.source, leaf.unit = 'router', 'structure', leaf.segs[:-1]
        leaf.why = (f'{"first" if torch_layout else "last"} axis {e} = the expert count '
                    f'of the bank beside it in {"/".join(block)}')
        found.append(leaf)
    for router in found:  # its bias / scale, in the same module
      for leaf in children.get(router.unit, []):
        # A bare router kernel of the block itself brings a bias [E] only (as above).
        if leaf.tier is None and (router.unit != block or leaf.core == (e,)):
          leaf.tier, leaf.source, leaf.unit = 'router', 'structure', router.unit
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


# ---------------------------------------------------------------------------- reports


def _rule_hint(path: str, tier: str) -> str:
  return f"sj.make_labeler([({path!r}, {tier!r})])"


def _unit_findings(leaves: list[_paths.Leaf], use_axis_names: bool) -> list[str]:
  """Numbered units of identical shapes beside a router candidate [d, n] that nothing
  decided (`_stacks.numbered_units`), one line per router: an expert bank kept as
  separate leaves and its router, or unrolled dense layers beside an unrelated kernel.
  Shapes cannot tell these apart, so the leaves keep the default tier and are reported
  (with the rules that settle it either way); sets each reported leaf's `note`."""

  def free(leaf: _paths.Leaf) -> bool:
    # Decided by no rule and no structure. A dense name (`mlp`, `ffn`) does not rule a bank
    # out, as it does not for a stacked bank (MoE blocks are called `mlp` too); as in
    # `_structure`, well-formed axis names without an expert axis do.
    return leaf.source in ('default', 'dense rule') and not (
        use_axis_names and leaf.names_well_formed)

  found = _stacks.numbered_units(
      [x.segs for x in leaves], [x.shape if x.is_array else None for x in leaves],
      [x.scan for x in leaves], [free(x) for x in leaves],
      [free(x) or x.tier == 'router' for x in leaves])
  by_routers: dict[tuple[int, ...], list[_stacks.Units]] = {}
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
    label = [(p, 'experts') for p in patterns] + [(p, 'router') for p in router_rules]
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


def _unit_pattern(leaves: list[_paths.Leaf], family: _stacks.Units) -> str:
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


def _issues(leaves: list[_paths.Leaf], use_axis_names: bool,
            found: Optional[_stacks.Structure] = None) -> list[str]:
  """Unsure leaves, one line per finding; also sets each reported leaf's `note`."""
  lines = _unit_findings(leaves, use_axis_names)
  for line, members in (found.confusions if found is not None else ()):
    for i in members:
      leaves[i].note = 'UNSURE: a stack of layers or a bank of experts (see the warning)'
    lines.append(line)
  for leaf in leaves:
    where = f'{leaf.path} {list(leaf.shape)}'
    core = leaf.core
    if leaf.source == 'default' and len(core) >= 3 and core[0] > 1 and not (
        use_axis_names and leaf.names_well_formed) and not leaf.note:
      scanned = f' beside scanned axes {sorted(leaf.scan)}' if leaf.scan else ''
      reason = (f'rank-{len(core)} leaf{scanned} left in {leaf.tier!r} by default (no '
                'rule or structure says what it is)')
      leaf.note = f'UNSURE: {reason}'
      lines.append(f"{where}: {reason}; if it is an expert bank, label it: "
                   f"{_rule_hint(leaf.path, 'experts')}, or confirm it: "
                   f'{_rule_hint(leaf.path, leaf.tier)}')
    axis = _named_expert_axis(leaf)
    if axis is not None and leaf.tier not in ('experts', 'router') and leaf.source != 'rule':
      reason = f'axis {axis} is named {leaf.names[axis]!r} but the leaf is {leaf.tier!r}'
      leaf.note = f'UNSURE: {reason}'
      lines.append(f"{where}: {reason}; label it: {_rule_hint(leaf.path, 'experts')}, or "
                   'pass param_labels=sj.moe_param_labels(params, use_axis_names=True)')
  routers = [x for x in leaves if x.tier == 'router']
  experts = [x for x in leaves if x.tier == 'experts']
  for mine, others, what, missing, hint in (
      (experts, routers, 'experts', 'router', '<router module>'),
      (routers, experts, 'router', 'experts', '<expert bank>')):
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
                 f"{_rule_hint(guessed[0].path, 'backbone')}")
  return lines


def _report(lines: list[str], strict: bool) -> None:
  """One warning (or, if `strict`, one ValueError) listing every unsure finding."""
  if not lines:
    return
  shown = lines[:10] + ([f'... and {len(lines) - 10} more'] if len(lines) > 10 else [])
  body = '\n'.join(f'  - {line}' for line in shown)
  if strict:
    raise ValueError('skewadam_jax could not label these parameters with confidence '
                     f'(strict=True):\n{body}\nPass rules as '
                     "param_labels=sj.make_labeler([('<pattern>', '<tier>')], strict=True).")
  warnings.warn('skewadam_jax labels: these parameters are labelled by a guess:\n'
                f'{body}\nAdd rules with sj.make_labeler([(\'<pattern>\', \'<tier>\')]) '
                '(strict=True makes this an error).', UnsureLabelWarning, stacklevel=4)


# ---------------------------------------------------------------------------- labelers


class Labeler:
  """A labeler for `optax.partition`: params (or updates) -> pytree of tier names.

  Made by `make_labeler`. Uses paths and shapes only, so the labels at `init` (boxed
  params, `nnx.State`) and at `update` (pure arrays) are identical.
  """

  def __init__(self, rules: Sequence[Rule], default: str, use_default_rules: bool,
               strict: bool):
    self.rules = tuple(rules)
    self.default = default
    self.use_default_rules = use_default_rules
    self.strict = strict
    self._user = _paths.compile_rules(self.rules)
    self._default_rules = _paths.compile_rules(DEFAULT_RULES)
    self._dense_rules = _paths.compile_rules(DENSE_RULES)

  def __repr__(self) -> str:
    return (f'Labeler(rules={list(self.rules)!r}, default={self.default!r}, '
            f'use_default_rules={self.use_default_rules}, strict={self.strict})')

  def __call__(self, params: Any) -> Any:
    return self.explain(params)[0]

  def explain(self, params: Any, *, use_axis_names: bool = False
              ) -> tuple[Any, list[str]]:
    """(labels, a note per leaf in flattening order); warns or raises once if unsure."""
    leaves, treedef, found = self._decide(params, use_axis_names)
    _report(_issues(leaves, use_axis_names, found), self.strict)
    notes = [x.note or (f'{x.source}: {x.why}' if x.source in ('structure', 'axis names')
                        else '') for x in leaves]
    return treedef.unflatten([x.tier for x in leaves]), notes

  def _decide(self, params: Any, use_axis_names: bool
              ) -> tuple[list[_paths.Leaf], Any, _stacks.Structure]:
    leaves, treedef = _paths.leaves_of(params, _flax.axis_names_by_path(params))
    for leaf in leaves:
      if not leaf.is_array:  # a static field: no parameter, no state
        leaf.tier, leaf.source, leaf.why = self.default, 'static', 'not an array'
    _apply_rules(leaves, self._user, 'rule')
    if self.use_default_rules:
      _numbered_experts(leaves)
      _apply_rules(leaves, self._default_rules, 'default rule')
      if use_axis_names:
        _axis_name_experts(leaves)
      found = _stacks_and_banks(leaves, label=True)
      _structure(leaves, use_axis_names)
      _apply_rules(leaves, self._dense_rules, 'dense rule')
    else:
      if use_axis_names:
        _axis_name_experts(leaves)
      found = _stacks_and_banks(leaves, label=False)
    for leaf in leaves:
      if leaf.tier is None:
        leaf.tier, leaf.source = self.default, 'default'
    return leaves, treedef, found


def make_labeler(rules: Optional[Iterable[Rule]] = None, *, default: str = DEFAULT_TIER,
                 use_default_rules: bool = True, strict: bool = False) -> Labeler:
  """A labeler for `optax.partition`: params (or updates) -> pytree of tier names.

  Args:
    rules: ordered `(pattern, tier)` pairs checked before everything built in.
    default: tier of leaves nothing recognises (keep it lossless: `backbone`).
    use_default_rules: also apply the built-in recognition (numbered expert modules,
      `DEFAULT_RULES`, structure, `DENSE_RULES`) after the user's rules.
    strict: raise a `ValueError` instead of warning when a label is a guess (a rank >= 3
      leaf left in the default tier, experts with no router, a router with no experts).

  Returns:
    A callable mapping a pytree to a same-structure pytree of tier names.
  """
  return Labeler(_check_rules(rules), default, use_default_rules, strict)


def moe_param_labels(params: Any, rules: Optional[Iterable[Rule]] = None, *,
                     default: str = DEFAULT_TIER, use_default_rules: bool = True,
                     strict: bool = False, use_axis_names: bool = False) -> Any:
  """Labels every leaf of a (Flax) MoE parameter tree `backbone`/`experts`/`router`.

  Recognises Flax Linen and NNX layers written the obvious way (`router`, `experts`),
  MaxText (`gate`; bare `wi_0`, `wi_1`, `wo` inside an MoE block; `routed_experts`),
  EasyDeL, gemma (`router_logits`), Flaxformer (`router_weights`, `expert`), HF-style
  `experts/w1..w3`, one module per expert (`expert_0..`), and MoE blocks whose names
  say nothing (by shape: leaves beside a router [d, E] with leading axis E). Shared
  experts and a dense MLP's `gate_proj` stay in the backbone.

  With `use_axis_names=True`, logical axis names (NNX `sharding_names`, Linen
  `nn.Partitioned` names; e.g. MaxText's 'exp') also decide leaves that no rule does.
  They exist only in the model's state, not in the pure arrays `nnx.Optimizer.update`
  passes, so use the result as a label tree computed once, never as a labeler function:
  `sj.skewadam(lr, param_labels=sj.moe_param_labels(nnx.state(model, nnx.Param),
  use_axis_names=True))` (label trees match the params by path as well as structure).

  Args:
    params: a pytree of arrays, `jax.ShapeDtypeStruct`s or Flax variables.
    rules: extra ordered `(pattern, tier)` rules, checked first.
    default: tier of unrecognised leaves.
    use_default_rules: whether to apply the built-in recognition after `rules`.
    strict: raise a `ValueError` naming the unsure leaves instead of warning.
    use_axis_names: let logical axis names decide leaves no rule decides.

  Returns:
    A pytree of the same structure as `params` with tier names as leaves.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> sj.moe_param_labels({'moe': {'router': {'kernel': jnp.zeros((4, 2))},
    ...                              'experts': {'w1': jnp.zeros((2, 4, 8))}}})
    {'moe': {'experts': {'w1': 'experts'}, 'router': {'kernel': 'router'}}}
  """
  labeler = make_labeler(rules, default=default, use_default_rules=use_default_rules,
                         strict=strict)
  return labeler.explain(params, use_axis_names=use_axis_names)[0]


_DEFAULT_LABELER = Labeler((), DEFAULT_TIER, True, False)


@dataclasses.dataclass(frozen=True)
class LeafReport:
  """One row of `label_table`: a leaf, its tier, what its state costs, and why unsure."""
  path: str
  shape: tuple[int, ...]
  dtype: str
  tier: str
  second_moment: str
  param_bytes: int
  state_bytes: int
  note: str = ''  # how structure / axis names decided it, or why the label is a guess
  batch_axes: tuple[int, ...] = ()  # axes indexing independent matrices (experts, layers)


# ---------------------------------------------------------------------------- label trees


def broadcast_labels(params: Any, labels: Any) -> Any:
  """`labels` (the params' structure, a prefix of it, the same paths, or a function of
  the params returning one) on every leaf, matched as `_paths.per_leaf` matches.

  Matching by structure first, then by normalised path: a label tree computed once from
  an `nnx.State` (whose leaves are variables) also labels the pure arrays of `update`.
  """
  treedef = jax.tree_util.tree_structure(params)
  return treedef.unflatten(_paths.per_leaf(params, labels, 'param_labels', what='tier names'))


def resolve_labels(params: Any, param_labels: Any = None) -> Any:
  """Full label tree for `params`: from a callable, an explicit label tree, or the
  default labeler (which, unlike `moe_param_labels(use_axis_names=True)`, sees no
  axis names, so `init` and `update` agree)."""
  return broadcast_labels(params, _DEFAULT_LABELER if param_labels is None else param_labels)


def labels_and_notes(params: Any, param_labels: Any = None) -> tuple[Any, list[str]]:
  """`resolve_labels` plus a note per leaf (flattening order) where the labeler has one."""
  labeler = param_labels
  if param_labels is None or param_labels is moe_param_labels:
    labeler = _DEFAULT_LABELER
  if isinstance(labeler, Labeler):
    labels, notes = labeler.explain(params)
    return broadcast_labels(params, labels), notes
  labels = resolve_labels(params, param_labels)
  return labels, [''] * len(jax.tree_util.tree_leaves(params))


def expand_labels(params: Any, labels: Any, tiers: Mapping[str, Any]) -> Any:
  """`labels` (same structure as `params`, or a prefix of it) broadcast to every leaf.

  Raises:
    ValueError: if the label tree does not match the params, or names no tier.
  """
  full = broadcast_labels(params, labels)
  unknown = sorted({x for x in jax.tree_util.tree_leaves(full) if x not in tiers}, key=repr)
  if unknown:
    hint = _checks.did_you_mean(unknown[0], [str(t) for t in tiers])
    raise ValueError(f'`param_labels` names tiers {[repr(x) for x in unknown]} that are not '
                     f'in `tiers`; allowed tier names are {sorted(tiers)}{hint}.')
  return full
