"""Name rules: the built-in rule tables, and the tiers that names decide.

A leaf's tier is first decided by names: the user's rules, numbered sibling modules
(`expert_0 .. expert_{n-1}`), `DEFAULT_RULES`, and, where asked, logical axis names.
`DENSE_RULES` come last, after the structure read from shapes (`shape_rules`). Every rule
is a `(pattern, tier)` pair of whole-segment globs, first match wins (`paths`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure.vocabulary import BACKBONE
from skewadam_jax.structure.vocabulary import DEFAULT_TIER
from skewadam_jax.structure.vocabulary import EXPERTS
from skewadam_jax.structure.vocabulary import ROUTER
from skewadam_jax.structure import vocabulary as _vocabulary

Rule = tuple[str, str]  # (pattern, tier): pattern is '/'-separated segment globs.

# Ordered, first match wins; checked after the user's rules and after numbered expert
# modules, before the structural recognition.
DEFAULT_RULES: tuple[Rule, ...] = (
    # Shared experts see every token: dense, whatever their inside is called. Covers
    # DeepSeek/Llama 4 `shared_experts`, Qwen `shared_expert` and its output gate
    # `shared_expert_gate` [d, 1] (it routes nothing), Linen `SharedExpert_0`.
    ('*shared_expert*', BACKBONE),
    ('*sharedexpert*', BACKBONE),
    ('*shared_mlp*', BACKBONE),
    ('*shared_ffn*', BACKBONE),
    # Expert banks. An expert's own sub-module called `gate` stays an expert.
    ('routed_experts/gate', ROUTER),  # MaxText Qwen3-Next: the router inside the bank
    ('experts', EXPERTS),  # Flax/NNX MoE layers, EasyDeL, HF-style experts/w1..w3
    ('routed_experts', EXPERTS),  # MaxText Qwen3-Next
    ('expert', EXPERTS),  # Flaxformer
    ('*moe*/**/wi_0', EXPERTS),  # MaxText MoeBlock: bare wi_0, wi_1, wo kernels
    ('*moe*/**/wi_1', EXPERTS),
    ('*moe*/**/wi', EXPERTS),
    ('*moe*/**/wo', EXPERTS),
    ('*moe*/**/wi_0_bias', EXPERTS),  # and their per-expert biases
    ('*moe*/**/wi_1_bias', EXPERTS),
    ('*moe*/**/wi_bias', EXPERTS),
    ('*moe*/**/wo_bias', EXPERTS),
    ('per_expert_*', EXPERTS),  # gemma / MaxText Gemma 4 `per_expert_scale` [E]
    # Dense modules that routers and experts are never inside of.
    *((p, BACKBONE) for p in _vocabulary.ATTENTION_MODULES),  # `*attention*`, `*attn*`
    ('*norm*', BACKBONE),
    ('*embed*', BACKBONE),
    ('wq', BACKBONE),  # attention projections stored flat (`layer/{wq, wk, wv, w1, ...}`;
    ('wk', BACKBONE),  # not `wo`: MoE banks are called that too)
    ('wv', BACKBONE),
    # Routers.
    ('*router*', ROUTER),  # router, gemma router_logits/router_scale, router_weights
    ('gate', ROUTER),  # MaxText, HF Mixtral `block_sparse_moe/gate` (not `gate_proj`)
    ('pre_forward_scale_2', ROUTER),  # MaxText Gemma 4: the router's input scale
)

# Dense MLP blocks: backbone. Checked after the structural recognition, because some
# MoE blocks are called `mlp` (gemma's `mlp` is its MoE, `mlp2` the dense branch); a
# leaf these name is known dense, so it is not reported as unsure.
DENSE_RULES: tuple[Rule, ...] = (
    *((p, BACKBONE) for p in _vocabulary.MLP_MODULES),  # `*mlp*`, `*ffn*`, `*ffw*`, ...
    ('lm_head', BACKBONE),
)


# ---------------------------------------------------------------------------- rules


def check_rules(rules: Optional[Iterable[Rule]]) -> tuple[Rule, ...]:
  """The user's `(pattern, tier)` rules as a tuple; a TypeError for a bad rule."""
  return _paths.check_rules(rules, lambda tier: isinstance(tier, str),
                            '`rules` must be a sequence of (pattern, tier) string pairs')


def label_for_path(path: str, rules: Sequence[Rule] = DEFAULT_RULES,
                   default: str = DEFAULT_TIER) -> str:
  """The tier of one normalised path by name alone: the first matching rule's, else
  `default` (no structure: use `make_labeler` for whole trees)."""
  found = _paths.first_match(_paths.compile_rules(rules), _paths.lower_segments(path))
  return default if found is None else found[1]


# ---------------------------------------------------------------------------- leaves


def named_expert_axis(leaf: _paths.Leaf) -> Optional[int]:
  """Index of an axis whose name marks experts (only for well-formed names)."""
  if not leaf.names_well_formed:
    return None
  for i, entry in enumerate(leaf.names):
    entries = entry if isinstance(entry, (tuple, list)) else (entry,)
    if any(isinstance(e, str) and e.lower() in _vocabulary.EXPERT_AXIS_NAMES for e in entries):
      return i
  return None


# ---------------------------------------------------------------------------- deciding


def apply_rules(leaves: list[_paths.Leaf], rules: Sequence[_paths.CompiledRule],
                source: str) -> None:
  """Gives every undecided leaf the tier of the first rule that matches its path."""
  for leaf in leaves:
    found = None if leaf.tier is not None else _paths.first_match(rules, leaf.segs)
    if found is not None:
      span, tier, text = found
      leaf.tier, leaf.source, leaf.why = tier, source, f'rule {text!r}'
      leaf.unit = leaf.segs[:span[1]]


def numbered_experts(leaves: list[_paths.Leaf]) -> None:
  """Sibling modules `<..expert(s)>_0 .. _{n-1}` (n >= 2), one per expert: experts."""
  groups: dict[tuple[tuple[str, ...], str], dict[int, list[_paths.Leaf]]] = {}
  for leaf in leaves:
    if leaf.tier is not None:
      continue
    for k, seg in enumerate(leaf.segs):
      m = _vocabulary.NUMBERED_EXPERT.match(seg)
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
        leaf.tier, leaf.source, leaf.count = EXPERTS, 'structure', n
        leaf.why = f'one of {n} numbered sibling modules {stem}_0..{stem}_{n - 1}'
        leaf.unit = leaf.segs[:len(prefix) + 1]


def router_counts(leaves: Sequence[_paths.Leaf]) -> set[int]:
  """The expert counts the routers labelled so far map to: a router kernel's axis named
  like experts, else its output axis (the last; the first of a PyTorch `weight`). The
  name counts only on the shorter of the last two axes (E < d in every MoE): a mesh axis
  called `expert` may shard the router's input width d as well."""
  counts = set()
  for leaf in leaves:
    if leaf.tier != ROUTER or len(leaf.shape) < 2 or _vocabulary.is_vector(leaf.segs):
      continue
    axis = named_expert_axis(leaf)
    if axis is not None and leaf.shape[axis] != min(leaf.shape[-2:]):
      axis = None
    counts.add(leaf.shape[axis] if axis is not None else _vocabulary.kernel_sides(
        leaf.shape, _vocabulary.is_torch_layout(leaf.segs))[0])
  return counts


def confirmed_expert_axis(leaf: _paths.Leaf, counts: set[int]) -> Optional[int]:
  """The leaf's axis named like experts, where its shape says so too: it is the leaf's
  first axis not named like a layer axis and its length is a router's expert count
  (`counts`). Sharding names are hints: a mesh axis called `expert` also shards dense
  weights (an embedding [V, d], attention, the output layer) in expert-parallel setups,
  whose lengths no router maps to."""
  axis = named_expert_axis(leaf)
  if axis is None or leaf.shape[axis] not in counts:
    return None
  layers = {i for i, entry in enumerate(leaf.names) if _is_layer_name(entry)}
  first = next((i for i in range(len(leaf.shape)) if i not in layers), None)
  return axis if axis == first else None


def axis_name_experts(leaves: list[_paths.Leaf]) -> None:
  """Undecided leaves whose (well-formed) axis names include an expert axis that their
  shape confirms (`confirmed_expert_axis`): experts."""
  counts = router_counts(leaves)
  for leaf in leaves:
    axis = None if leaf.tier is not None else confirmed_expert_axis(leaf, counts)
    if axis is not None:
      leaf.tier, leaf.source = EXPERTS, 'axis names'
      leaf.why = f'axis {axis} is named {leaf.names[axis]!r}'
      leaf.unit = leaf.segs


def _is_layer_name(entry: Any) -> bool:
  entries = entry if isinstance(entry, (tuple, list)) else (entry,)
  return any(isinstance(e, str) and _vocabulary.LAYER_AXIS_NAME.match(e.lower()) for e in entries)
