"""SkewAdam's tier rule: a first-moment rule composed with a second-moment estimator.

`scale_by_tiers` steps every parameter by its tier (`tier.Tier`), one state for all
tiers; `scale_by_tiered_adam` is one tier's rule for every leaf it gets. Each estimator
lives in its own module (`estimators.exact`, `.factored`, `.grouped`, `.orthogonal`);
this one only composes them: one leaf's step is `tier_leaf`, the state's scaffold
`per_leaf`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import optax

from skewadam_jax.core import checks as _checks
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import paths as _paths
from skewadam_jax.transforms import per_leaf as _per_leaf
from skewadam_jax.transforms import plan as _plan
from skewadam_jax.transforms import step_scalars as _step_scalars
from skewadam_jax.transforms import tier_leaf as _tier_leaf

from skewadam_jax.transforms import presets as _presets
from skewadam_jax.transforms.tier import Tier



class TieredAdamState(NamedTuple):
  """State of `scale_by_tiers` and `scale_by_tiered_adam`: one step count for every tier,
  and per parameter only the arrays its tier keeps.

  Every field but `count` has the params' structure. A slot that a parameter does not
  keep (the momentum of a tier without one, `v` of a factored leaf) is `None` in place
  of the leaf (or of its Flax box): an empty pytree node, so the state has one leaf
  per array kept, and `nnx.Optimizer` one Variable per array. The leaves of other
  groups of an `optax.partition` hold `optax.MaskedNode`, as in any optax state.
  """
  count: jax.Array  # shape=(), int32: number of updates applied so far (every tier).
  # like params, dtype tier.mu_dtype; with tier.mu_codec its stored pytree per param
  # (sj.Blockwise: Coded(codes uint8, scales float32), the param's rank); None without
  # momentum.
  mu: optax.Updates
  v_row: optax.Updates  # factored leaves: shape [..., R] float32; else None.
  v_col: optax.Updates  # factored leaves: shape [..., C] float32; else None.
  v: optax.Updates  # exact: like param; grouped: pooled axis; float32; else None.


def tiers_transform(tiers: Mapping[str, Tier], plan_fn: Callable[[Any, bool], _plan.Plan],
                    b1: Any, b2: Any, eps: Any, name: str, described: bool = False
                    ) -> optax.GradientTransformationExtraArgs:
  """The tiers' rules on the leaves as `plan_fn(tree, explain)` plans them (a
  `plan.plan_leaves` of `tiers`), exposed as `init.planner` (`described`: see
  `plan.Planner`); `name` is the public transform's, for errors."""
  _checks.check_beta('b1', b1)
  _checks.check_beta('b2', b2)
  _checks.check_non_negative('eps', eps)

  def specs_of(plan: _plan.Plan) -> _per_leaf.SpecsOf:
    # Flax boxes (NNX Variables, Linen Partitioned) of each statistic name the axes it
    # keeps, as its estimator derives them from the parameter's axis names.
    def specs(i: int, names: Any, shape: tuple[int, ...]) -> Mapping[str, Any]:
      leaf = plan.leaves[i]
      if leaf.estimator is None:  # keeps nothing
        return {}
      return leaf.estimator.specs(names, shape, None, leaf.path)
    return specs

  def init_fn(params):
    leaves = _per_leaf.Leaves.of(params)
    plan = plan_fn(params, False)
    # An integer or boolean leaf keeps nothing (`per_leaf.trains`).
    rows = [_tier_leaf.init_leaf(tiers[leaf.tier], leaf, p) if _per_leaf.trains(p) else {}
            for leaf, p in zip(plan.leaves, leaves.arrays)]
    return TieredAdamState(_per_leaf.zero_count(), **leaves.fields(
        rows, _tier_leaf.FIELDS, specs_of(plan)))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # unused; accepted so that the transform chains like optax's
    _checks.check_update_order(updates, state, params,
                               lambda s: isinstance(s, TieredAdamState), name)
    leaves = _per_leaf.Leaves.of(updates)
    plan = plan_fn(updates, False)
    leaf_tiers = [tiers[leaf.tier] for leaf in plan.leaves]
    rows = leaves.read(state, _tier_leaf.FIELDS)
    count, t = _per_leaf.next_count(state.count)
    scalars = _step_scalars.tier_scalars(leaf_tiers, b1, b2, t)
    hashes = _tier_leaf.codec_path_hashes(leaf_tiers, leaves.paths, t)
    out = []
    for i, (tier, leaf, g, p, row) in enumerate(zip(
        leaf_tiers, plan.leaves, leaves.arrays, _per_leaf.param_leaves(leaves, params), rows)):
      path = leaf.path
      if not _per_leaf.trains(g, p):
        out.append((_per_leaf.zero_update(path, g, p), {}))
        continue
      present = _tier_leaf.check_grad(tier, leaf, g, p, row)
      if not g.size:  # nothing to estimate: a statistic of no elements would be 0 / 0
        out.append((_per_leaf.zero_update(path, g, p), {**present, 'mu': row['mu']}
                    if tier.momentum else dict(present)))
        continue
      mu = present.pop('mu', row.get('mu'))  # a coded momentum, as its codec made it
      out.append(_tier_leaf.update_leaf(
          tier, leaf, b1 if tier.b1 is None else tier.b1, b2, eps, g, mu, present, t,
          scalars[id(tier)], _per_leaf.update_dtype(g, p), defer=True,
          path_key=hashes.get(i)))
    out = _tier_leaf.resolve(out, t)
    return leaves.unflatten([u for u, _ in out]), TieredAdamState(count, **leaves.fields(
        [new for _, new in out], _tier_leaf.FIELDS, specs_of(plan)))

  planner = _plan.Planner(plan_fn, TieredAdamState, described)
  return optax.GradientTransformationExtraArgs(_plan.with_planner(init_fn, planner),
                                               update_fn)


def plan_of_tiers(tiers: Mapping[str, Tier], labels_of: Callable[[Any], list[str]],
                  batch_axes: Any) -> Callable[[Any, bool], _plan.Plan]:
  """`plan_fn` of `tiers_transform`: each leaf's tier from `labels_of(tree)` (one label
  per leaf), its batch axes from `batch_axes` (a tree, a function of the tree, None)."""
  def plan_fn(tree: Any, explain: bool) -> _plan.Plan:
    del explain  # no labeler notes: the labels are given
    return _plan.plan_leaves(tiers, tree, labels_of(tree),
                             _paths.leaf_batch_axes(batch_axes, tree))
  return plan_fn


def scale_by_tiers(
    tiers: Optional[Mapping[str, Tier]],
    param_labels: Any,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    batch_axes: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates with SkewAdam's tiers, each leaf by its tier's rule.

  One transform for every tier: each leaf gets the rule of `scale_by_tiered_adam` with
  its tier's configuration (see there for the maths), and the state is one
  `TieredAdamState` with one step count and, per parameter, only the arrays its tier
  keeps. This is what `skewadam` uses; it updates exactly as
  `optax.partition({name: scale_by_tiered_adam(tier=tier) ...}, param_labels)` would,
  whose state repeats every field of every tier for every parameter (a masked slot
  each).

  Args:
    tiers: tier name -> `Tier`, or None for `PUBLISHED_TIERS`.
    param_labels: each leaf's tier name: a pytree matching the params (by structure, as
      a prefix, or by path), or a function of the params (and, at `update`, of the
      updates) returning one, e.g. `sj.moe_param_labels`; None for its default rules.
    b1: decay rate of the first moment, for tiers whose `b1` is None.
    b2: decay rate of the second-moment statistics.
    eps: floor on the uncorrected second moment (`eps_mode='floor'`) or Adam's
      additive term (`eps_mode='adam'`).
    batch_axes: each leaf's batch axes, as in `scale_by_tiered_adam`.

  Returns:
    An `optax.GradientTransformationExtraArgs` (extra `update` keywords are ignored).

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> params = {'w': jnp.zeros((8, 16)), 'router': jnp.zeros((16, 4))}
    >>> tx = sj.scale_by_tiers(sj.PUBLISHED_TIERS, {'w': 'backbone', 'router': 'router'})
    >>> state = tx.init(params)
    >>> state.mu['router'] is None, state.v['router'].shape
    (True, (16, 4))

  References:
    Where Should Optimizer State Live? Tiered State Allocation for Memory-Efficient
    Mixture-of-Experts Training, arXiv 2607.19058.
  """
  tiers = _presets.check_tiers(tiers)

  def labels_of(tree: Any) -> list[str]:
    labels = _labels.resolve_labels(tree, param_labels)
    return jax.tree_util.tree_leaves(_labels.expand_labels(tree, labels, tiers))

  return tiers_transform(tiers, plan_of_tiers(tiers, labels_of, batch_axes), b1, b2, eps,
                         'sj.scale_by_tiers')


def scale_by_tiered_adam(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    tier: Optional[Tier] = None,
    batch_axes: Any = None,
    **tier_options: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates with one SkewAdam tier's rule.

  Per leaf, with `bc1 = 1 - b1^t`, `bc2 = 1 - b2^t` and gradients in float32::

    factored (>= 2 non-batch axes; batch axes per `batch_axes`, by default the leading
    ones, e.g. experts; shown here for the default layout):
      r <- b2 r + (1 - b2) mean(g^2, -1);   c <- b2 c + (1 - b2) mean(g^2, -2)
      D = sqrt(max(r / max(mean(r), 1e-15), eps)) [.., :, None] * sqrt(max(c, eps)) [.., None, :]
    exact (also leaves with < 2 non-batch axes):  v <- b2 v + (1 - b2) g^2;  D = sqrt(max(v, eps))
    grouped:  nu <- b2 nu + (1 - b2) groupmean(g^2);  D = sqrt(max(expand(nu), eps))
    u = m sqrt(bc2) / bc1 / D  with m <- b1 m + (1 - b1) g   (momentum)
        g sqrt(bc2) / D                                       (no momentum)
    u = u / max(1, rms(u) / clip)      (rms per matrix: per slice of the batch axes)

  With `eps_mode='adam'`, `u = m_hat / (sqrt(v_hat) + eps)` instead, `v_hat` being the
  bias-corrected exact, factored (`r / mean(r)` times `c`) or pooled estimate.

  Args:
    b1: decay rate of the first moment (unused without momentum).
    b2: decay rate of the second-moment statistics.
    eps: floor on the uncorrected second moment (`eps_mode='floor'`) or Adam's
      additive term (`eps_mode='adam'`).
    tier: the tier's static configuration; default `Tier()`.
    batch_axes: each leaf's batch axes, the axes that index independent matrices (a
      scanned layer axis, the expert axis), wherever they sit: a tree of int tuples
      matching the params (by structure or path), a function of the params returning
      one (e.g. `sj.moe_batch_axes`), or None for the default (every axis before the
      last two). Statistics and the clip are per batch slice; the other axes form the
      matrix (the last of them its columns); a leaf whose non-batch part is 1-D gets
      the exact estimate.
    **tier_options: overrides of `tier`'s fields, e.g. `momentum=False`.

  Returns:
    An `optax.GradientTransformationExtraArgs` (extra `update` keywords are ignored).

  Example:
    >>> import jax.numpy as jnp, optax, skewadam_jax as sj
    >>> experts = sj.scale_by_tiered_adam(tier=sj.PUBLISHED_TIERS['experts'])
    >>> state = experts.init({'w1': jnp.zeros((8, 16, 32))})

  References:
    Where Should Optimizer State Live? Tiered State Allocation for Memory-Efficient
    Mixture-of-Experts Training, arXiv 2607.19058.
    Shazeer & Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost, 2018.
  """

  if tier is not None and not isinstance(tier, Tier):
    raise TypeError(f'`tier` must be a skewadam_jax.Tier or None, got {type(tier).__name__} '
                    f'{tier!r}; build one with sj.Tier(...) or pass tier options as keywords.')
  tier = (tier or Tier()).replace(**tier_options)
  tiers = {'tier': tier}
  labels_of = lambda tree: ['tier'] * len(jax.tree_util.tree_leaves(tree))  # noqa: E731
  return tiers_transform(tiers, plan_of_tiers(tiers, labels_of, batch_axes), b1, b2, eps,
                         'sj.scale_by_tiered_adam')
