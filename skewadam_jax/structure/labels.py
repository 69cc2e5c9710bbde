"""The MoE labeler: maps parameter paths and shapes to SkewAdam tiers.

Paths are normalised (keys stringified, a trailing `value` dropped, joined with `/`)
so that `init` (boxed Linen params, `nnx.State`) and `update` (the pure arrays that
`nnx.Optimizer` passes) see identical labels. A leaf's tier is decided, in order, by

1. the user's rules (whole-segment globs, first match wins);
2. numbered sibling modules (`expert_0 .. expert_{n-1}`): one module per expert;
3. `DEFAULT_RULES` (first match wins);
4. logical axis names, only in `moe_param_labels(..., use_axis_names=True)`, and only
   where the shape agrees (a router maps to the named axis's length): sharding names
   are hints, not structure;
5. shapes alone (`stacks`): scanned stacks (a subtree whose leaves all share one
   axis length that nothing outside has, or a group of children of any module, the
   root too, that holds a router and its bank under a shared axis), whose axis is then
   never read as an expert count, and expert banks (a subtree whose leaves share an
   axis length E, beside a router candidate [d, E] whose d is an axis of the bank):
   bank and router, whatever they are called;
6. structure, within one MoE block: a vector [E] beside a router kernel [d, E] in its
   module is its bias, and the one kernel [d, E] beside a router bias [E] is its
   kernel; leaves beside a router [d, E] whose first axis (after the
   scanned ones) is E are experts; a kernel [..., E] beside a bank of E experts is a
   router;
7. `DENSE_RULES` (known dense modules, backbone);
8. the default tier, `backbone` (lossless).

The name rules (1-4, 7) live in `name_rules`, the structure read from shapes (5-6) in
`shape_rules` (with `stacks`), the reports of unsure leaves in `unsure`; this module puts
them in that order (`Labeler`) and turns label trees into one tier per leaf.

Only paths and shapes are used (plus axis names where asked), so the same tree gets the
same labels whether its leaves are arrays, tracers or `jax.ShapeDtypeStruct`s, and
whatever the container (dicts, lists, Flax states and boxes, Equinox modules, custom
pytree nodes); a leaf that is not an array (an Equinox module's function or integer
field) is static, as `eqx.filter(model, eqx.is_array)` has it: it gets the default
tier and takes no part in the structure. Leaves the labeler is unsure about are
reported (a warning, or a `ValueError` when `strict`); so are numbered units of identical
shapes beside a router candidate (`unsure.numbered_units`), an expert bank kept as
separate leaves or unrolled dense layers, which shapes cannot tell apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax

from skewadam_jax.core import checks as _checks
from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import name_rules as _name_rules
from skewadam_jax.structure import shape_rules as _shape_rules
from skewadam_jax.structure import stacks as _stacks
from skewadam_jax.structure import unsure as _unsure
from skewadam_jax.structure import warning as _warning
from skewadam_jax.structure.vocabulary import DEFAULT_TIER

Rule = _name_rules.Rule


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
    self._default_rules = _paths.compile_rules(_name_rules.DEFAULT_RULES)
    self._dense_rules = _paths.compile_rules(_name_rules.DENSE_RULES)

  def __repr__(self) -> str:
    return (f'Labeler(rules={list(self.rules)!r}, default={self.default!r}, '
            f'use_default_rules={self.use_default_rules}, strict={self.strict})')

  def __call__(self, params: Any) -> Any:
    return self.explain(params)[0]

  def explain(self, params: Any, *, use_axis_names: bool = False
              ) -> tuple[Any, list[str]]:
    """(labels, a note per leaf in flattening order); warns or raises once if unsure."""
    with _warning.one_warning():
      leaves, treedef, found = self._decide(params, use_axis_names)
      _warning.report(_unsure.findings(leaves, use_axis_names, found), self.strict)
    notes = [x.note or (f'{x.source}: {x.why}' if x.source in ('structure', 'axis names')
                        else '') for x in leaves]
    return treedef.unflatten([x.tier for x in leaves]), notes

  def _decide(self, params: Any, use_axis_names: bool
              ) -> tuple[list[_paths.Leaf], Any, _stacks.StacksAndBanks]:
    leaves, treedef = _paths.leaves_of(params, _flax.axis_names_by_path(params))
    for leaf in leaves:
      if not leaf.is_array:  # a static field: no parameter, no state
        leaf.tier, leaf.source, leaf.why = self.default, 'static', 'not an array'
    _name_rules.apply_rules(leaves, self._user, 'rule')
    if self.use_default_rules:
      _name_rules.numbered_experts(leaves)
      _name_rules.apply_rules(leaves, self._default_rules, 'default rule')
      if use_axis_names:
        _name_rules.axis_name_experts(leaves)
      found = _shape_rules.stacks_and_banks(leaves, label=True)
      _shape_rules.bias_kernels(leaves)
      _shape_rules.router_vectors(leaves)
      _shape_rules.block_structure(leaves, use_axis_names)
      _name_rules.apply_rules(leaves, self._dense_rules, 'dense rule')
    else:
      if use_axis_names:
        _name_rules.axis_name_experts(leaves)
      found = _shape_rules.stacks_and_banks(leaves, label=False)
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
  return Labeler(_name_rules.check_rules(rules), default, use_default_rules, strict)


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
  `nn.Partitioned` names; e.g. MaxText's 'exp') also decide leaves that no rule does,
  where the shape agrees: an expert axis name counts on a leaf's first axis (besides
  layer axes) whose length a router maps to, never on an embedding or a head that a
  mesh axis called `expert` merely shards.
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
  the params returning one) on every leaf, matched as `structure.paths.per_leaf` matches.

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
