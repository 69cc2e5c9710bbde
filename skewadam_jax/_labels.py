"""The MoE labeler: maps parameter paths to SkewAdam tiers.

Paths are normalised (keys stringified, a trailing `value` dropped, joined with `/`)
so that `init` (boxed Linen params, `nnx.State`) and `update` (the pure arrays that
`nnx.Optimizer` passes) see identical labels. Rules are matched on whole segments, in
order; the first match wins, and unknown leaves go to the safe `backbone` tier.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import jax

from skewadam_jax import _checks
from skewadam_jax import _tree

Rule = tuple[str, str]  # (pattern, tier): pattern is '/'-separated segment globs.

# Ordered, first match wins. Expert rules come before router rules so that an expert's
# own sub-module called `gate` stays in the expert tier.
DEFAULT_RULES: tuple[Rule, ...] = (
    ('experts', 'experts'),  # Flax/NNX MoE layers, HF-style experts/w1..w3
    ('expert', 'experts'),  # Flaxformer
    ('*moe*/**/wi_0', 'experts'),  # MaxText MoeBlock: bare wi_0, wi_1, wo kernels
    ('*moe*/**/wi_1', 'experts'),
    ('*moe*/**/wi', 'experts'),
    ('*moe*/**/wo', 'experts'),
    ('router', 'router'),
    ('router_weights', 'router'),  # Flaxformer
    ('gate', 'router'),  # MaxText, HF Mixtral `block_sparse_moe/gate` (not `gate_proj`)
)
DEFAULT_TIER = 'backbone'


def _match_at(pattern: Sequence[str], segments: Sequence[str]) -> bool:
  """Whether `pattern` matches a prefix of `segments` (`**` spans any segments)."""
  if not pattern:
    return True
  head, rest = pattern[0], pattern[1:]
  if head == '**':
    return any(_match_at(rest, segments[i:]) for i in range(len(segments) + 1))
  return bool(segments) and fnmatch.fnmatchcase(segments[0], head) and _match_at(
      rest, segments[1:])


def match_path(pattern: str, path: Union[str, Sequence[str]]) -> bool:
  """Whether `pattern` matches a contiguous run of whole segments of `path`.

  Matching is case-insensitive; each pattern segment is a glob (`*`, `?`, `[..]`) and
  `**` matches any number of segments. `'experts'` matches `moe/experts/w1` but not
  `shared_experts/w1`; `'gate'` matches `moe/gate/kernel` but not `mlp/gate_proj`.
  """
  segments = path.split('/') if isinstance(path, str) else list(path)
  segments = [s.lower() for s in segments]
  pat = [s.lower() for s in pattern.strip('/').split('/')]
  return any(_match_at(pat, segments[i:]) for i in range(len(segments)))


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
  """The tier of one normalised path: the first matching rule's, else `default`."""
  for pattern, tier in rules:
    if match_path(pattern, path):
      return tier
  return default


def make_labeler(rules: Optional[Iterable[Rule]] = None, *, default: str = DEFAULT_TIER,
                 use_default_rules: bool = True) -> Callable[[Any], Any]:
  """A labeler for `optax.partition`: params (or updates) -> pytree of tier names.

  Args:
    rules: ordered `(pattern, tier)` pairs checked before the default rules.
    default: tier of leaves no rule matches (keep it lossless: `backbone`).
    use_default_rules: append `DEFAULT_RULES` after the user's rules.

  Returns:
    A function mapping a pytree to a same-structure pytree of tier names.
  """
  ordered = _check_rules(rules or ()) + (DEFAULT_RULES if use_default_rules else ())

  def labeler(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: label_for_path(_tree.path_str(path), ordered, default), params)

  return labeler


def moe_param_labels(params: Any, rules: Optional[Iterable[Rule]] = None, *,
                     default: str = DEFAULT_TIER, use_default_rules: bool = True) -> Any:
  """Labels every leaf of a (Flax) MoE parameter tree `backbone`/`experts`/`router`.

  Recognises Flax Linen and NNX layers written the obvious way (`router`, `experts`),
  MaxText (`gate`; bare `wi_0`, `wi_1`, `wo` inside an MoE block), Flaxformer
  (`router_weights`, `expert`) and HF-style `experts/w1..w3`; a dense MLP's
  `gate_proj` stays in the backbone. Paths at `init` (ending in `value`) and at
  `update` get identical labels.

  Args:
    params: a pytree of arrays, `jax.ShapeDtypeStruct`s or Flax variables.
    rules: extra ordered `(pattern, tier)` rules, checked first.
    default: tier of unmatched leaves.
    use_default_rules: whether to apply `DEFAULT_RULES` after `rules`.

  Returns:
    A pytree of the same structure as `params` with tier names as leaves.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> sj.moe_param_labels({'moe': {'router': {'kernel': jnp.zeros((4, 2))}}})
    {'moe': {'router': {'kernel': 'router'}}}
  """
  return make_labeler(rules, default=default, use_default_rules=use_default_rules)(params)


@dataclasses.dataclass(frozen=True)
class LeafReport:
  """One row of `label_table`: a leaf, its tier and what its state costs."""
  path: str
  shape: tuple[int, ...]
  dtype: str
  tier: str
  second_moment: str
  param_bytes: int
  state_bytes: int


def resolve_labels(params: Any, param_labels: Any = None) -> Any:
  """Labels for `params`: from a callable, an explicit label tree, or the default."""
  if param_labels is None:
    return moe_param_labels(params)
  if callable(param_labels):
    return param_labels(params)
  return param_labels


def expand_labels(params: Any, labels: Any, tiers: Mapping[str, Any]) -> Any:
  """`labels` (same structure as `params`, or a prefix of it) broadcast to every leaf.

  Raises:
    ValueError: if the label tree does not match the params, or names no tier.
  """
  try:
    full = jax.tree_util.tree_map(
        lambda label, sub: jax.tree_util.tree_map(lambda _: label, sub), labels, params)
  except (ValueError, TypeError) as e:
    raise ValueError(
        '`param_labels` must be a pytree with the same structure as the params (or a '
        'prefix of it, or a function returning one); got a label tree that does not '
        f'match the params: {e}') from None
  unknown = sorted({x for x in jax.tree_util.tree_leaves(full) if x not in tiers}, key=repr)
  if unknown:
    hint = _checks.did_you_mean(unknown[0], [str(t) for t in tiers])
    raise ValueError(f'`param_labels` names tiers {[repr(x) for x in unknown]} that are not '
                     f'in `tiers`; allowed tier names are {sorted(tiers)}{hint}.')
  return full
