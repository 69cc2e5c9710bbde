"""The plan: what every leaf gets, decided once by a pure function and read everywhere.

`plan_leaves(tiers, params, labels, batch_axes)` turns an optimizer's configuration and
a params tree into one `LeafPlan` per leaf: its tier, its role, its estimator and codec
(bound to its shape and batch axes), the abstract state its `init` makes, and the
reason for its tier. `scale_by_tiers`' `init` and `update` step the leaves as planned;
the reports (`label_table`, `memory_report`), the sharding helpers and the checkpoint
description read the same plan through the optimizer: a transform that plans exposes a
`Planner` as `tx.init.planner` (a function attribute, which `optax.chain` and the other
wrappers keep reachable), and `Planner.plan(params)` is pure. No recorder, context
variable or registry carries a decision from `init` to a report.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from skewadam_jax.core import tree as _tree
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.estimators import codec as _codec
from skewadam_jax.structure import paths as _paths

STEPPED = 'stepped'  # a floating leaf: stepped by its tier's rule
NO_STATE = 'no state'  # an integer or boolean leaf: no state, a zero update
# The statistics' fields of `TieredAdamState`, each the key of `SecondMoment.specs`.
STAT_KEYS = {k: k for k in _second_moment.STAT_FIELDS}


class LeafPlan(NamedTuple):
  """What one leaf gets."""
  path: str  # the '/'-joined normalised path
  tier: str  # the tier's name
  role: str  # STEPPED or NO_STATE
  estimator: Optional[_second_moment.SecondMoment]  # after `for_leaf`; None: NO_STATE
  codec: Optional[_codec.StateCodec]  # bound to the leaf; None: an array of mu_dtype
  batch_axes: tuple[int, ...]  # sorted, non-negative
  shape: tuple[int, ...]
  # field -> the abstract arrays (`jax.ShapeDtypeStruct` pytrees) `init` makes for it;
  # fields the leaf does not keep are absent.
  state: Mapping[str, Any]
  reason: str  # how its tier was decided, or why it is a guess ('' unless explained)
  # (stage, error) where the estimator or codec cannot serve the leaf ('decide': its
  # batch axes or `for_leaf`; 'mu', 'stats': its state); `init` and `update` raise it.
  problem: Optional[tuple[str, Exception]] = None


class Plan(NamedTuple):
  """The leaves of one transform's params tree, and how its state holds them.

  Attributes:
    leaves: one `LeafPlan` per leaf, in flattening order.
    stat_keys: state field -> the key of `estimator.specs` it holds ('mu' holds the
      momentum, whose spec is the parameter's or its codec's).
  """
  leaves: tuple[LeafPlan, ...]
  stat_keys: Mapping[str, str]

  def specs(self, index: int, field: str, spec: _second_moment.Spec, mesh: Any) -> Any:
    """The PartitionSpec (pytree) of field `field` of leaf `index`, its parameter
    sharded as `spec` (one entry per dimension)."""
    leaf = self.leaves[index]
    if field == 'mu':
      if leaf.codec is not None:
        return leaf.codec.specs(spec, leaf.shape, mesh, leaf.path)
      return PartitionSpec(*spec)
    return leaf.estimator.specs(spec, leaf.shape, mesh, leaf.path)[self.stat_keys[field]]


@dataclasses.dataclass(frozen=True)
class Planner:
  """How a transform plans a params tree: `plan(params)` is `plan_leaves` of its
  configuration. `explain` also fills each leaf's reason (it may label once more).

  Attributes:
    plan_fn: `(params, explain) -> Plan`, pure.
    state_type: the NamedTuple type of the transform's state (where the reports find
      the leaves of the plan in a traced state).
    described: whether `label_table` and `describe_state` show its leaves (a
      `skewadam`'s: its tiers come from its labeler).
  """
  plan_fn: Callable[[Any, bool], Plan]
  state_type: type
  described: bool = False

  def plan(self, params: Any, *, explain: bool = False) -> Plan:
    return self.plan_fn(params, explain)


def with_planner(init_fn: Callable[[Any], Any], planner: Planner) -> Callable[[Any], Any]:
  """`init_fn`, exposing `planner` as its `planner` attribute (for the reports)."""
  init_fn.planner = planner  # type: ignore[attr-defined]
  return init_fn


def normal_axes(batch_axes: Any, shape: tuple[int, ...], path: str) -> tuple[int, ...]:
  """A leaf's batch axes, normalised (`estimators.base.normalise_batch_axes`)."""
  return _second_moment.normalise_batch_axes(batch_axes, tuple(shape), path)


@functools.lru_cache(maxsize=4096)
def _cached_eval_shape(make: Callable[..., Any], obj: Any, shape: tuple[int, ...],
                       dtype: Any, path: str) -> Any:
  return jax.eval_shape(lambda: make(obj, jnp.zeros(shape, dtype), path))


def abstract_init(make: Callable[..., Any], obj: Any, shape: tuple[int, ...], dtype: Any,
                  path: str) -> Any:
  """`make(obj, zeros(shape, dtype), path)` as shapes only: cached per shape where
  `obj.per_shape` (the path only names the leaf in errors), per path where `obj` is
  hashable, not at all otherwise."""
  dtype = jnp.dtype(dtype)
  key = '' if getattr(obj, 'per_shape', False) else path
  try:
    return _cached_eval_shape(make, obj, tuple(shape), dtype, key)
  except (TypeError, ValueError):  # unhashable, or `init` raised: uncached, with the path
    pass
  return jax.eval_shape(lambda: make(obj, jnp.zeros(shape, dtype), path))


def _stats_of(estimator: _second_moment.SecondMoment, p: Any, path: str) -> dict[str, Any]:
  return dict(estimator.init(p, path))


def _coded_of(codec: _codec.StateCodec, p: Any, path: str) -> Any:
  return codec.init(p, path)


def whole_size(leaf: Any, shape: tuple[int, ...]) -> int:
  """The elements of the parameter that `leaf`, of `shape`, is: inside `shard_map` a
  device's shard, whose count times the size of every manual mesh axis it varies over
  is the whole parameter's; elsewhere its own count."""
  size = math.prod(shape)
  axes = _second_moment.varying_axes(leaf)
  if axes:
    mesh = jax.sharding.get_abstract_mesh()
    for a in axes:
      size *= mesh.shape[a]
  return size


def plan_leaf(tier: Any, name: str, path: str, leaf: Any, batch_axes: Any,
              reason: Optional[str] = None) -> LeafPlan:
  """The plan of one leaf (a parameter, a gradient, or their abstract form) under
  `tier` (a `Tier`), named `name`; `reason`: the labeler's note (None: unexplained)."""
  p = _tree.abstract_leaf(leaf)
  shape = tuple(p.shape)
  size = whole_size(leaf, shape)
  dtype = jnp.dtype(p.dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return LeafPlan(path, name, NO_STATE, None, None, (), shape, {}, '' if reason is None
                    else f'{dtype} leaf: no state, update 0 before weight decay '
                    '(as optax.adamw\'s for a zero gradient)')
  try:
    axes = normal_axes(batch_axes, shape, path)
    estimator = tier.estimator.for_leaf(shape, axes)
    codec = (tier.mu_codec.for_shard(shape, axes, size) if tier.mu_codec is not None
             else None)
  except (ValueError, TypeError) as e:
    return LeafPlan(path, name, STEPPED, None, None, (), shape, {}, reason or '',
                    ('decide', e))
  state: dict[str, Any] = {}
  problem = None
  if tier.momentum:
    if codec is None:
      state['mu'] = jax.ShapeDtypeStruct(shape, tier.mu_dtype)
    else:
      try:
        state['mu'] = abstract_init(_coded_of, codec, shape, jnp.float32, path)
      except (ValueError, TypeError) as e:
        problem = ('mu', e)
  try:
    state.update(abstract_init(_stats_of, estimator, shape, dtype, path))
  except (ValueError, TypeError) as e:
    problem = problem or ('stats', e)
  return LeafPlan(path, name, STEPPED, estimator, codec, tuple(axes), shape, state,
                  reason or '', problem)


def plan_leaves(tiers: Mapping[str, Any], params: Any, labels: Sequence[str],
                batch_axes: Sequence[Any], reasons: Optional[Sequence[str]] = None) -> Plan:
  """Every leaf of `params` under its tier: a pure function of its arguments.

  Args:
    tiers: tier name -> `Tier`.
    params: the params (or updates, or their abstract form; Flax boxes allowed).
    labels: each leaf's tier name, in flattening order.
    batch_axes: each leaf's batch axes (None: the default layout), in flattening order.
    reasons: each leaf's reason for its tier (None: not explained, each reason '').

  Returns:
    A `Plan`, one `LeafPlan` per leaf in flattening order.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> from skewadam_jax.transforms import plan
    >>> p = plan.plan_leaves(sj.PUBLISHED_TIERS, {'w': jnp.zeros((3, 4))}, ['backbone'],
    ...                      [None])
    >>> leaf = p.leaves[0]
    >>> leaf.estimator.name, {k: v.shape for k, v in leaf.state.items()}
    ('factored', {'mu': (3, 4), 'v_col': (4,), 'v_row': (3,)})
  """
  flat, _ = _paths.flatten_with_paths(params)
  reasons = [None] * len(flat) if reasons is None else list(reasons)
  leaves = tuple(plan_leaf(tiers[label], label, path, x, axes, reason)
                 for (path, x), label, axes, reason in zip(flat, labels, batch_axes, reasons))
  return Plan(leaves, STAT_KEYS)
