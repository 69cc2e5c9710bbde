"""AdamPM's scaling rule: Adam with a second moment pooled over groups of neighbours.

`scale_by_grouped_second_moment` is momentum plus the `Grouped` estimator (see
`estimators.grouped`, which also serves SkewAdam's `'grouped'` tiers), with Adam's
`(m / bc1) / (sqrt(nu_hat + eps_root) + eps)`; `sj.adampm` adds decoupled weight
decay and the learning rate, as `optax.adamw`.

References:
  AdamPM: Adam with a pooled second moment (Beihang University preprint).
  Kingma & Ba, Adam: A Method for Stochastic Optimization, 2015.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from skewadam_jax.core import checks as _checks
from skewadam_jax.estimators import grouped as _grouped
from skewadam_jax.estimators import pooling as _pooling
from skewadam_jax.core import tree as _tree
from skewadam_jax.structure import paths as _paths
from skewadam_jax.transforms import per_leaf as _per_leaf
from skewadam_jax.transforms import plan as _plan

class GroupedSecondMomentState(NamedTuple):
  """State of `scale_by_grouped_second_moment`."""
  count: jax.Array  # shape=(), int32: number of updates applied so far.
  mu: optax.Updates  # like params, dtype mu_dtype (params' dtype by default).
  nu: optax.Updates  # like params with `group_axis` shortened to ceil(n / group_size).


def scale_by_grouped_second_moment(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    group_size: int = 8,
    axis: int = -1,
    group_axis: Optional[int] = None,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by Adam with a second moment pooled over groups (AdamPM).

  With `groupmean_s` the mean over runs of `s` neighbouring elements along
  `axis` and `expand_s` its inverse (repeat each group value `s` times, crop)::

    m  <- b1 * m + (1 - b1) * g
    nu <- b2 * nu + (1 - b2) * groupmean_s(g^2)
    u  =  (m / (1 - b1^t)) / (sqrt(expand_s(nu / (1 - b2^t)) + eps_root) + eps)

  Pooling and the moving average are both linear, so `nu` equals
  `groupmean_s` of Adam's second moment exactly; with `group_size=1` this is Adam.
  0-d leaves keep an exact second moment; 1-D leaves are pooled along their only axis.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the pooled second moment.
    eps: term added to the denominator, as in Adam.
    eps_root: term added to the bias-corrected second moment inside the square root,
      as in `optax.scale_by_adam`.
    mu_dtype: dtype the first moment is stored in; default the parameters' dtype.
    group_size: elements per group (static positive int).
    axis: axis along which neighbours are pooled (static; negative allowed); the
      default pools along rows (the last axis).
    group_axis: the same option as `Tier` spells it; None: `axis` decides.
    nu_dtype: dtype the pooled second moment is stored in; default the parameters'.

  Returns:
    An `optax.GradientTransformationExtraArgs` (extra `update` keywords are ignored).

  Example:
    >>> import jax.numpy as jnp, optax, skewadam_jax as sj
    >>> tx = optax.chain(sj.scale_by_grouped_second_moment(group_size=8),
    ...                  optax.scale(-1e-3))
    >>> state = tx.init({'w': jnp.zeros((4, 16))})
    >>> state[0].nu['w'].shape
    (4, 2)

  References:
    AdamPM: Adam with a pooled second moment (Beihang University preprint).
    Kingma & Ba, Adam: A Method for Stochastic Optimization, 2015.
  """
  group_axis, axis_arg = _pooling.pooled_axis(axis, group_axis,
                                              'scale_by_grouped_second_moment')
  return grouped_adam(b1, b2, eps, eps_root, mu_dtype, group_size, group_axis, nu_dtype,
                      axis_arg)


def grouped_adam(b1: Any, b2: Any, eps: Any, eps_root: Any, mu_dtype: Optional[Any],
                 group_size: int, group_axis: int, nu_dtype: Optional[Any], axis_arg: str
                 ) -> optax.GradientTransformationExtraArgs:
  """`scale_by_grouped_second_moment`, `axis_arg` naming the pooled axis' argument."""
  _checks.check_beta('b1', b1)
  _checks.check_beta('b2', b2)
  _checks.check_non_negative('eps', eps)
  _checks.check_non_negative('eps_root', eps_root)
  group_size = _checks.check_positive_int('group_size', group_size)
  group_axis = _checks.check_axis(group_axis, axis_arg)
  mu_dtype = _checks.check_float_dtype('mu_dtype', mu_dtype)
  nu_dtype = _checks.check_float_dtype('nu_dtype', nu_dtype)
  estimator = _grouped.Grouped(group_size, group_axis, axis_arg=axis_arg)
  # A static zero adds nothing (and no op: the update stays bitwise Adam's form).
  add_root = not (_checks.is_concrete_number(eps_root) and float(eps_root) == 0.0)

  def specs_of(leaves: _per_leaf.Leaves) -> _per_leaf.SpecsOf:
    # Flax boxes of `nu` name the axes it keeps (pooling keeps them all: the param's).
    return lambda i, names, shape: estimator.specs(names, shape, None, leaves.paths[i])

  def init_leaf(path: str, p: jax.Array) -> dict[str, Any]:
    mu = jnp.zeros_like(p, dtype=mu_dtype or p.dtype)
    nu = estimator.init(p, path, dtype=nu_dtype or p.dtype)['v']
    return {'mu': mu, 'nu': nu}

  def init_fn(params):
    leaves = _per_leaf.Leaves.of(params, 'scale_by_grouped_second_moment')
    # An integer or boolean leaf keeps nothing (`per_leaf.trains`).
    rows = [init_leaf(path, p) if _per_leaf.trains(p) else {}
            for path, p in zip(leaves.paths, leaves.arrays)]
    return GroupedSecondMomentState(_per_leaf.zero_count(), **leaves.fields(
        rows, ('mu', 'nu'), specs_of(leaves)))

  def plan_fn(tree: Any, explain: bool) -> _plan.Plan:
    """Every floating leaf keeps `mu` and the pooled `nu` (`GroupedSecondMomentState`)."""
    del explain
    leaves = []
    for path, x in _paths.flatten_with_paths(tree)[0]:
      p = _tree.abstract_leaf(x)
      shape = tuple(p.shape)
      if not _per_leaf.trains(p):
        leaves.append(_plan.LeafPlan(path, 'adampm', _plan.NO_STATE, None, None, (), shape,
                                     {}, ''))
        continue
      state = jax.eval_shape(lambda p=p, path=path: init_leaf(
          path, jnp.zeros(p.shape, p.dtype)))
      leaves.append(_plan.LeafPlan(path, 'adampm', _plan.STEPPED, estimator, None, (),
                                   shape, state, ''))
    return _plan.Plan(tuple(leaves), {'nu': 'v'})

  def update_leaf(path: str, g: jax.Array, p: Any, row: dict[str, Any], bc1: jax.Array,
                  bc2: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    if not _per_leaf.trains(g, p):
      return _per_leaf.zero_update(path, g, p), {}
    mu, nu = row['mu'], row['nu']
    dtype = _per_leaf.update_dtype(g, p)  # adamw's: the gradient's promoted with p's
    # At trace time: a gradient of another shape would broadcast into the update.
    _checks.check_grad_shape(path, tuple(g.shape), mu.shape, 'its momentum')
    g32 = g.astype(jnp.float32)
    # The update reads the stored (cast) moments, so that the final fused pass
    # consumes the new state instead of recomputing it from the old one (which would
    # make XLA keep a copy of the old state, and re-pool g^2 per element). With
    # float32 state (the default for float32 parameters) the casts are no-ops.
    mu = (b1 * mu.astype(jnp.float32) + (1.0 - b1) * g32).astype(mu.dtype)
    nu32, _ = estimator.accumulate(nu, g32, b2, path)
    nu_hat = nu32 / bc2 + eps_root if add_root else nu32 / bc2
    denom = estimator.expand(jnp.sqrt(nu_hat) + eps, tuple(g.shape), path)
    u = ((mu.astype(jnp.float32) / bc1) / denom).astype(dtype)
    return u, {'mu': mu, 'nu': nu32.astype(nu.dtype)}

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # unused; accepted so that the transform chains like optax's
    _checks.check_update_order(updates, state, params,
                               lambda s: isinstance(s, GroupedSecondMomentState),
                               'sj.scale_by_grouped_second_moment')
    leaves = _per_leaf.Leaves.of(updates)
    rows = leaves.read(state, ('mu', 'nu'))
    count, t = _per_leaf.next_count(state.count)
    bc1 = _per_leaf.bias_correction(b1, t)
    bc2 = _per_leaf.bias_correction(b2, t)
    out = [update_leaf(path, g, p, row, bc1, bc2)
           for path, g, p, row in zip(leaves.paths, leaves.arrays,
                                      _per_leaf.param_leaves(leaves, params), rows)]
    return leaves.unflatten([u for u, _ in out]), GroupedSecondMomentState(
        count, **leaves.fields([new for _, new in out], ('mu', 'nu')))

  return optax.GradientTransformationExtraArgs(
      _plan.with_planner(
          init_fn, _plan.Planner(plan_fn, GroupedSecondMomentState)), update_fn)
