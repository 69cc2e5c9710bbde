"""Batch axes: which axes of each leaf index independent matrices.

A factored second moment treats a leaf as a stack of matrices. The axes that index
the stack (the batch axes) must be the ones along which the model's matrices are
independent: the expert axis of an expert bank, and the layer axis of scanned layers,
wherever it sits (MaxText stacks layers at axis 1: a norm scale [d, L], a query kernel
[d, L, heads, head_dim], an expert bank [E, L, d, f]). Statistics and the RMS clip are
then per slice, and a leaf whose other axes form a vector gets the exact estimate.

`moe_batch_axes` decides each leaf's batch axes, in order, by

1. the user's rules `(pattern, axes)` (whole-segment globs, first match wins);
2. logical axis names, only with `use_axis_names=True`: axes named like a layer stack
   (`layers`, `dense_layers`, `local_layers`, `stage`, ...) or experts (`exp`, ...);
3. structure, from paths and shapes (`structure.stacks`):
   * scanned layers: under a module called `layers`, `*_layers`, `scanned_blocks`, ...
     (not followed by a numbered sub-module, as unrolled `layers/0` are), the one
     axis position that has the same length in every leaf is the layer axis (nested
     scans add one axis per level); under any other module whose leaves all share one
     axis length that no leaf outside it has, and beside no router candidate, that
     axis (so a stack is found whatever it is called);
   * the expert tier: the first axis that no scan explains is the expert axis of a
     stacked bank (also for a per-expert bias [E, F] or scale [E] beside a stacked
     kernel [E, ..., d, f]);
   * gemma's `kv_einsum` stacks k and v on axis 0;
   * outside attention, axes before the last two of what is left stay batch axes, as
     by default (attention head axes are part of the matrix);
4. the default, every axis before the last two.

Only paths and shapes are used (plus axis names where asked), so `init` (Flax boxes)
and `update` (the pure arrays that `nnx.Optimizer` passes) get the same axes.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence


from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import paths as _paths
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.structure import stacks as _stacks
from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure import warning as _warning
from skewadam_jax.structure.vocabulary import EXPERTS

AxesRule = tuple[str, tuple[int, ...]]  # (pattern, batch axes of the matching leaves)

# Modules whose leaves are single tensors, not stacks: attention (head axes are part of
# the matrix) and embeddings (a position table [1, T, d], a patch kernel [p, p, c, d]).
_WHOLE = ('attn', 'attention', 'embed')
_QKVO = ('wq', 'wk', 'wv', 'wo')  # attention projections stored flat: [d, heads, head_dim]
_QKVO_LAST = tuple((name,) for name in _QKVO)  # as a path's last segment (a root leaf has none)
# Built-in rules: gemma stacks the k and v projections of `kv_einsum` on axis 0.
DEFAULT_AXES_RULES: tuple[AxesRule, ...] = (('*kv_einsum/w', (0,)),)
_DEFAULT_RULES = _paths.compile_rules(DEFAULT_AXES_RULES)


def _named(entry: Any, pattern: Any, names: frozenset[str]) -> bool:
  entries = entry if isinstance(entry, (tuple, list)) else (entry,)
  return any(isinstance(e, str) and (bool(pattern.match(e.lower())) or e.lower() in names)
             for e in entries)


def _expert_axis(leaf: _paths.Leaf) -> Optional[int]:
  """The first axis of `leaf` that no scan explains (where a stacked bank keeps E)."""
  free = _paths.core_axes(leaf.shape, leaf.scan)
  return free[0] if free else None


def _banked(leaves: list[_paths.Leaf]) -> set[int]:
  """Indices of experts-tier leaves whose first unscanned axis indexes the experts.

  A per-expert bias [E, F] or scale [E] sits beside a stacked kernel [E, ..., d, f]
  (>= 3 unscanned axes, same first unscanned length) under its own parent module; an
  expert written as its own module (`expert_0/w` [d, f]) has no such neighbour, and
  keeps the default.
  """
  stacked = [x for x in leaves if x.tier == EXPERTS and len(x.core) >= 3]
  out = set()
  for i, leaf in enumerate(leaves):
    if leaf.tier != EXPERTS or not leaf.core:
      continue
    parent = leaf.segs[:-1]
    if any(y is not leaf and y.segs[:len(parent)] == parent and y.core[0] == leaf.core[0]
           for y in stacked):
      out.add(i)
  return out


def _structure(leaf: _paths.Leaf, banked: bool) -> set[int]:
  axes = set(leaf.scan)
  ndim = len(leaf.shape)
  if banked:
    axes.add(_expert_axis(leaf))
  if not any(a in seg for seg in leaf.segs for a in _WHOLE) and leaf.segs[-1:] not in _QKVO_LAST:
    # (an axis of length 1 stacks nothing: a class token [1, 1, d] is one vector)
    rest = [a for a in range(ndim) if a not in axes and leaf.shape[a] > 1]
    axes.update(rest[:-2])
  return axes


def _labels_for(params: Any, labels: Any) -> tuple[Any, bool]:
  """The full label tree of `params`, and whether a `Labeler` reported on it already."""
  reported = labels is None or labels is _labels.moe_param_labels or isinstance(
      labels, _labels.Labeler)
  return _labels.resolve_labels(params, labels), reported


@_warning.reported_once
def decide(params: Any, labels: Any = None, rules: Sequence[AxesRule] = (),
           use_axis_names: bool = False, warn: bool = True,
           labels_reported: Optional[bool] = None) -> tuple[list[_paths.Leaf], Any]:
  """Every leaf of `params` with its batch axes decided (flattening order), and treedef.

  `labels_reported`: whether the labeler already reported the subtrees that read as a
  stack and as a bank alike (default: when `labels` is None or a `Labeler`).
  """
  names = _flax.axis_names_by_path(params) if use_axis_names else {}
  full_labels, reported = _labels_for(params, labels)
  if labels_reported is not None:
    reported = labels_reported
  leaves, treedef = _paths.leaves_of(params, names)
  for leaf, tier in zip(leaves, treedef.flatten_up_to(full_labels)):
    leaf.tier = tier
  compiled = _paths.compile_rules(rules)
  for leaf in leaves:
    match = _paths.first_match(compiled, leaf.segs)
    if match is not None:
      _, axes, text = match
      leaf.axes = {a % len(leaf.shape) for a in _check_rule_axes(text, tuple(axes), leaf)}
      leaf.source = f'rule {text!r}'
  for leaf in leaves:
    if leaf.axes is None and leaf.names_well_formed:
      # An expert axis name counts on the experts tier only: sharding names are hints,
      # and a mesh axis called `expert` also shards dense weights.
      experts = _vocabulary.EXPERT_AXIS_NAMES if leaf.tier == EXPERTS else frozenset()
      leaf.axes = {i for i, e in enumerate(leaf.names)
                   if _named(e, _vocabulary.LAYER_AXIS_NAME, experts)}
      leaf.source = 'axis names'
  found = _stacks.scan_leaves(leaves, [True] * len(leaves))
  unsure = found.ambiguous + ([] if reported else [line for line, _ in found.confusions])
  banked = _banked(leaves)
  for i, leaf in enumerate(leaves):
    if leaf.axes is not None:
      continue
    match = _paths.first_match(_DEFAULT_RULES, leaf.segs)
    if match is not None and len(leaf.shape) > max(match[1]):
      leaf.axes = set(match[1]) | leaf.scan
      leaf.source = f'default rule {match[2]!r}'
    else:
      leaf.axes = _structure(leaf, i in banked)
      default = set(_second_moment.default_batch_axes(len(leaf.shape)))
      leaf.source = 'default' if leaf.axes == default and not leaf.scan else 'structure'
  if warn:
    _warning.report(unsure, strict=False)
  return leaves, treedef


def _check_rule_axes(text: str, axes: tuple[int, ...], leaf: _paths.Leaf) -> tuple[int, ...]:
  ndim = len(leaf.shape)
  bad = [a for a in axes if not -ndim <= a < ndim]
  if bad:
    raise ValueError(f'batch-axes rule {text!r} gives axes {axes} to {leaf.path} of shape '
                     f'{leaf.shape}: allowed axes are {-ndim}..{ndim - 1}.')
  return axes


def _check_rules(rules: Optional[Iterable[AxesRule]]) -> tuple[AxesRule, ...]:
  return _paths.check_rules(
      rules, lambda axes: axes is not None and _paths.is_axes(axes),
      "batch-axes `rules` must be (pattern, axes) pairs, e.g. ('decoder/layers/**', (1,))")


def moe_batch_axes(params: Any, param_labels: Any = None, *,
                   rules: Optional[Iterable[AxesRule]] = None,
                   use_axis_names: bool = False) -> Any:
  """The batch axes of every leaf: the axes that index independent matrices.

  SkewAdam's default (`sj.skewadam(..., batch_axes=None)`); a factored second moment
  keeps its statistics and clip per batch slice, and the other axes form the matrix.
  Recognises stacked experts (axis 0 of a stacked bank in the `experts` tier, and of
  the per-expert biases and scales beside it), scanned layers wherever
  their axis sits (MaxText's axis 1, Flax `nn.scan`'s axis 0, nested scans), and
  gemma's stacked `kv_einsum`; attention head axes stay in the matrix.

  With `use_axis_names=True`, logical axis names (NNX `sharding_names`, Linen
  `nn.Partitioned` names, e.g. MaxText's 'layers' and 'exp') decide the leaves that
  carry them. They exist only in the model's state, not in the pure arrays that
  `nnx.Optimizer.update` passes, so use the result as a tree computed once:
  `sj.skewadam(lr, batch_axes=sj.moe_batch_axes(nnx.state(model, nnx.Param),
  use_axis_names=True))` (trees match the params by path as well as structure).

  Args:
    params: a pytree of arrays, `jax.ShapeDtypeStruct`s or Flax variables.
    param_labels: the tiers (a label tree or labeler); default `moe_param_labels`. A
      `batch_axes` function given to `skewadam` that takes `param_labels` gets the
      labels `skewadam` uses (`batch_axes=functools.partial(sj.moe_batch_axes,
      rules=...)`, or `lambda p, param_labels: sj.moe_batch_axes(p, param_labels, ...)`).
    rules: ordered `(pattern, axes)` pairs checked first, e.g.
      `[('decoder/layers/**', (1,))]`; negative axes count from the end.
    use_axis_names: let logical axis names decide the leaves that carry them.

  Returns:
    A pytree like `params` whose leaves are tuples of sorted non-negative axes.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> scanned = {'norm': jnp.zeros((8, 3)),  # MaxText layout: layers on axis 1
    ...            'attn': {'q': jnp.zeros((8, 3, 4, 2)), 'out': jnp.zeros((4, 3, 2, 8))}}
    >>> sj.moe_batch_axes({'layers': scanned})
    {'layers': {'attn': {'out': (1,), 'q': (1,)}, 'norm': (1,)}}
  """
  leaves, treedef = decide(params, param_labels, _check_rules(rules), use_axis_names)
  return treedef.unflatten([tuple(sorted(x.axes)) for x in leaves])


def batch_axes_tree(params: Any, labels: Any, *, labels_reported: bool) -> Any:
  """`moe_batch_axes(params, labels)`, saying whether the labeler reported already."""
  leaves, treedef = decide(params, labels, labels_reported=labels_reported)
  return treedef.unflatten([tuple(sorted(x.axes)) for x in leaves])
