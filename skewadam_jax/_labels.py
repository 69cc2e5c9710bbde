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
reported (a warning, or a `ValueError` when `strict`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
import warnings
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from skewadam_jax import _checks
from skewadam_jax import _stacks
from skewadam_jax import _tree

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

_SHARED = re.compile(r'shared[_-]?(expert|mlp|ffn|ffw|feed|dense|moe)')
_NUMBERED_EXPERT = re.compile(r'^(?P<stem>.*?experts?)[_-]?(?P<idx>\d+)$')
_NOT_KERNEL = _stacks.NOT_KERNEL  # router leaves that do not carry the expert count


class UnsureLabelWarning(UserWarning):
  """Some leaves' tiers are guesses: add rules (`make_labeler`) or pass `strict=True`."""


def _is_shared(segment: str) -> bool:
  """Whether a (lowercase) segment names a shared expert / shared dense branch."""
  return segment == 'shared' or bool(_SHARED.search(segment))


# ---------------------------------------------------------------------------- matching


@functools.lru_cache(maxsize=1024)
def _compile(pattern: str) -> tuple[Any, ...]:
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


def _match_span(pat: Sequence[Any], segs: Sequence[str]) -> Optional[tuple[int, int]]:
  """(start, end) of the first match of `pat` on a contiguous run of `segs`."""
  for start in range(len(segs)):
    end = _match_end(pat, segs, start)
    if end is not None and end > start:
      return start, end
  return None


def _lower(path: Union[str, Sequence[str]]) -> tuple[str, ...]:
  return tuple(s.lower() for s in (path.split('/') if isinstance(path, str) else path))


def match_path(pattern: str, path: Union[str, Sequence[str]]) -> bool:
  """Whether `pattern` matches a contiguous run of whole segments of `path`.

  Matching is case-insensitive; each pattern segment is a glob (`*`, `?`, `[..]`) and
  `**` matches any number of segments (but never a shared-expert segment). `'experts'`
  matches `moe/experts/w1` but not `shared_experts/w1`; `'gate'` matches
  `moe/gate/kernel` but not `mlp/gate_proj`.
  """
  return _match_span(_compile(pattern), _lower(path)) is not None


def _check_rules(rules: Iterable[Rule]) -> tuple[Rule, ...]:
  rules = tuple(rules)
  for rule in rules:
    if (not isinstance(rule, tuple) or len(rule) != 2
        or not all(isinstance(x, str) for x in rule)):
      raise TypeError('`rules` must be a sequence of (pattern, tier) string pairs, got '
                      f'{rule!r}.')
  return rules


def label_for_path(path: str, rules: Sequence[Rule] = DEFAULT_RULES,
                   default: str = DEFAULT_TIER) -> str:
  """The tier of one normalised path by name alone: the first matching rule's, else
  `default` (no structure: use `make_labeler` for whole trees)."""
  segs = _lower(path)
  for pattern, tier in rules:
    if _match_span(_compile(pattern), segs) is not None:
      return tier
  return default


# ---------------------------------------------------------------------------- leaves


@dataclasses.dataclass
class _Leaf:
  """What the labeler knows and decides about one leaf."""
  path: str
  segs: tuple[str, ...]  # lowercase normalised segments
  shape: tuple[int, ...]
  names: Optional[tuple[Any, ...]]  # logical axis names, as attached (or None)
  tier: Optional[str] = None
  source: str = ''  # 'rule' | 'numbered' | 'default rule' | 'axis names' | ...
  why: str = ''
  unit: tuple[str, ...] = ()  # the matched module (router / expert bank) it belongs to
  count: Optional[int] = None  # expert count, where structure knows it
  note: str = ''
  is_array: bool = True  # False: a static field (a function, an int), not a parameter
  scan: set[int] = dataclasses.field(default_factory=set)  # scanned (layer) axes

  @property
  def core(self) -> tuple[int, ...]:
    """The shape of one layer's leaf: `shape` without its scanned axes."""
    return _stacks.core_shape(self.shape, self.scan)

  @property
  def named_expert_axis(self) -> Optional[int]:
    """Index of an axis whose name marks experts (only for well-formed names)."""
    if self.names is None or len(self.names) != len(self.shape):
      return None
    for i, entry in enumerate(self.names):
      entries = entry if isinstance(entry, (tuple, list)) else (entry,)
      if any(isinstance(e, str) and e.lower() in EXPERT_AXIS_NAMES for e in entries):
        return i
    return None

  @property
  def names_well_formed(self) -> bool:
    return self.names is not None and len(self.names) == len(self.shape)


def _is_array(x: Any) -> bool:
  """Whether a leaf is an array (or tracer, `ShapeDtypeStruct`, Flax box of one), or a
  Python/NumPy number that optax would treat as a 0-d array; not a function or string."""
  return hasattr(x, 'shape') and hasattr(x, 'dtype') or isinstance(x, (int, float, complex))


def _shape(x: Any) -> tuple[int, ...]:
  shape = getattr(x, 'shape', None)
  if shape is None:
    try:
      shape = np.shape(x)
    except Exception:  # noqa: BLE001 -- not array-like: no shape to use
      shape = ()
  return tuple(int(d) for d in shape)


def _axis_names_by_path(params: Any) -> dict[tuple[str, ...], tuple[Any, ...]]:
  """Normalised path -> axis names, for every Flax box in `params` that has them."""
  types = _tree.box_types()
  if not types:
    return {}
  boxes, _ = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, types))
  out = {}
  for path, box in boxes:
    if isinstance(box, types):
      names = _tree.box_names(box)
      if names is not None:
        out[_tree.path_segments(path)] = names
  return out


# ---------------------------------------------------------------------------- deciding


def _apply_rules(leaves: list[_Leaf], rules: Sequence[tuple[tuple[Any, ...], str, str]],
                 source: str) -> None:
  """Gives every undecided leaf the tier of the first rule that matches its path."""
  for leaf in leaves:
    if leaf.tier is not None:
      continue
    for pat, tier, text in rules:
      span = _match_span(pat, leaf.segs)
      if span is not None:
        leaf.tier, leaf.source, leaf.why = tier, source, f'rule {text!r}'
        leaf.unit = leaf.segs[:span[1]]
        break


def _numbered_experts(leaves: list[_Leaf]) -> None:
  """Sibling modules `<..expert(s)>_0 .. _{n-1}` (n >= 2), one per expert: experts."""
  groups: dict[tuple[tuple[str, ...], str], dict[int, list[_Leaf]]] = {}
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


def _axis_name_experts(leaves: list[_Leaf]) -> None:
  """Undecided leaves whose (well-formed) axis names include an expert axis: experts."""
  for leaf in leaves:
    axis = leaf.named_expert_axis
    if leaf.tier is None and axis is not None:
      leaf.tier, leaf.source = 'experts', 'axis names'
      leaf.why = f'axis {axis} is named {leaf.names[axis]!r}'
      leaf.unit = leaf.segs


def _router_count(leaf: _Leaf) -> Optional[int]:
  """The expert count E of a router kernel: [d, E] or (transposed) [E, d], read after
  the scanned axes are removed (a stacked router [R, d, E] or [d, L, E] is [d, E])."""
  core = leaf.core
  if len(core) < 2 or any(s in leaf.segs[-1] for s in _NOT_KERNEL):
    return None
  return min(core[0], core[-1])  # E < d in every MoE


def _stacks_and_banks(leaves: list[_Leaf], label: bool) -> _stacks.Structure:
  """Scanned axes of every leaf; with `label`, name-free banks and their routers."""
  found = _stacks.analyse([x.path for x in leaves], [x.segs for x in leaves],
                          [x.shape if x.is_array else None for x in leaves],
                          [x.tier for x in leaves], [x.tier is not None for x in leaves])
  for leaf, scan in zip(leaves, found.scan):
    leaf.scan = scan
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


def _structure(leaves: list[_Leaf], use_axis_names: bool) -> None:
  """Experts beside a router, and a router beside a bank, within one MoE block."""
  children: dict[tuple[str, ...], list[_Leaf]] = {}
  for leaf in leaves:
    for n in range(1, len(leaf.segs)):
      children.setdefault(leaf.segs[:n], []).append(leaf)

  def free(leaf: _Leaf) -> bool:
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
  banks: dict[tuple[str, ...], dict[tuple[str, ...], list[_Leaf]]] = {}
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


def _bank_count(members: list[_Leaf], unit: tuple[str, ...]) -> Optional[int]:
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


def _issues(leaves: list[_Leaf], use_axis_names: bool,
            found: Optional[_stacks.Structure] = None) -> list[str]:
  """Unsure leaves, one line per finding; also sets each reported leaf's `note`."""
  lines = []
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
    axis = leaf.named_expert_axis
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
    self._user = [(_compile(p), t, p) for p, t in self.rules]
    self._default_rules = [(_compile(p), t, p) for p, t in DEFAULT_RULES]
    self._dense_rules = [(_compile(p), t, p) for p, t in DENSE_RULES]

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
              ) -> tuple[list[_Leaf], Any, _stacks.Structure]:
    names = _axis_names_by_path(params)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = []
    for path, x in flat:
      segs = _tree.path_segments(path)
      leaves.append(_Leaf(path='/'.join(segs) or '<root>', segs=_lower(segs),
                          shape=_shape(x), names=names.get(segs), is_array=_is_array(x)))
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
  return Labeler(_check_rules(rules or ()), default, use_default_rules, strict)


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


def _mismatch(detail: str) -> ValueError:
  return ValueError(
      '`param_labels` must be a pytree with the same structure as the params (or a '
      'prefix of it, or a function returning one); got a label tree that does not '
      f'match the params: {detail}')


def broadcast_labels(params: Any, labels: Any) -> Any:
  """`labels` (the params' structure, a prefix of it, or the same paths) on every leaf.

  Matching by structure first, then by normalised path: a label tree computed once from
  an `nnx.State` (whose leaves are variables) also labels the pure arrays of `update`.
  """
  try:
    return jax.tree_util.tree_map(
        lambda label, sub: jax.tree_util.tree_map(lambda _: label, sub), labels, params)
  except (ValueError, TypeError) as e:
    error = str(e)
  table: dict[tuple[str, ...], Any] = {}
  for path, label in jax.tree_util.tree_flatten_with_path(labels)[0]:
    table[_tree.path_segments(path)] = label
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  out, used = [], set()
  for path, _ in flat:
    segs = _tree.path_segments(path)
    for n in range(len(segs), -1, -1):
      if segs[:n] in table:
        out.append(table[segs[:n]])
        used.add(segs[:n])
        break
    else:
      raise _mismatch(f"no label for {'/'.join(segs) or '<root>'}; by structure: {error}"
                      ) from None
  unused = [k for k in table if k not in used]
  if unused:
    raise _mismatch(f"labels for paths the params do not have: "
                    f"{['/'.join(k) for k in unused[:5]]}; by structure: {error}") from None
  return treedef.unflatten(out)


def resolve_labels(params: Any, param_labels: Any = None) -> Any:
  """Full label tree for `params`: from a callable, an explicit label tree, or the
  default labeler (which, unlike `moe_param_labels(use_axis_names=True)`, sees no
  axis names, so `init` and `update` agree)."""
  if param_labels is None:
    labels = _DEFAULT_LABELER(params)
  elif _tree.is_function(param_labels):  # not a callable tree (an Equinox module)
    labels = param_labels(params)
  else:
    labels = param_labels
  return broadcast_labels(params, labels)


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
