"""SkewAdam's tier rule: one configurable Adam-like rule per parameter tier.

A tier chooses momentum (on/off and its dtype), a second-moment estimator (`exact`,
`factored` row/column, or `grouped` as in AdamPM), an RMS clip of the update, how
`eps` enters, and whether weight decay applies. `PUBLISHED_TIERS` is the policy of the
SkewAdam paper: the dense backbone keeps momentum and a factored second moment, the
expert bank only a factored second moment per expert, the router an exact one.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax import _checks
from skewadam_jax import _factored
from skewadam_jax import _grouped
from skewadam_jax import _tree

SECOND_MOMENTS = ('exact', 'factored', 'grouped')
EPS_MODES = ('floor', 'adam')


@dataclasses.dataclass(frozen=True)
class Tier:
  """Static configuration of one tier of `scale_by_tiered_adam`.

  Attributes:
    momentum: keep a first moment (EMA of gradients) for this tier.
    mu_dtype: dtype the first moment is stored in (float32 as published).
    second_moment: `'factored'` (row/column statistics for leaves with ndim >= 2,
      per matrix over leading batch axes; exact for ndim < 2), `'exact'` (Adam's full
      second moment) or `'grouped'` (AdamPM pooling over `group_size` neighbours).
    group_size: group size of the `'grouped'` estimator.
    group_axis: axis the `'grouped'` estimator pools along.
    clip_threshold: RMS clip of the update (over the last two axes, i.e. per expert
      for stacked experts), or None for no clipping.
    eps_mode: `'floor'` (as published: `eps` floors the uncorrected second moment
      inside the square root) or `'adam'` (`u = m_hat / (sqrt(v_hat) + eps)`).
    weight_decay: whether decoupled weight decay applies to this tier.
  """
  momentum: bool = True
  mu_dtype: Any = jnp.float32
  second_moment: str = 'factored'
  group_size: int = 8
  group_axis: int = -1
  clip_threshold: Optional[float] = 1.0
  eps_mode: str = 'floor'
  weight_decay: bool = True

  def __post_init__(self):
    if not isinstance(self.momentum, bool):
      raise TypeError(f'`momentum` must be a bool, got {self.momentum!r}.')
    try:
      mu_dtype = jnp.dtype(self.mu_dtype)
    except TypeError as e:
      raise TypeError(f'`mu_dtype` must be a floating dtype, got {self.mu_dtype!r}.') from e
    if not jnp.issubdtype(mu_dtype, jnp.floating):
      raise TypeError(f'`mu_dtype` must be a floating dtype, got {self.mu_dtype!r}.')
    object.__setattr__(self, 'mu_dtype', mu_dtype)
    _checks.check_choice('second_moment', self.second_moment, SECOND_MOMENTS)
    _checks.check_positive_int('group_size', self.group_size)
    _checks.check_axis(self.group_axis, 'group_axis')
    if self.clip_threshold is not None:
      if not _checks.is_concrete_number(self.clip_threshold):
        raise TypeError('`clip_threshold` must be a positive float or None, got '
                        f'{self.clip_threshold!r}.')
      if not float(self.clip_threshold) > 0:
        raise ValueError('`clip_threshold` must be a positive float or None, got '
                         f'{self.clip_threshold!r}.')
    _checks.check_choice('eps_mode', self.eps_mode, EPS_MODES)
    if not isinstance(self.weight_decay, bool):
      raise TypeError(f'`weight_decay` must be a bool, got {self.weight_decay!r}.')

  def replace(self, **changes: Any) -> Tier:
    """A copy of this tier with some options changed."""
    return dataclasses.replace(self, **changes)


PUBLISHED_TIERS: Mapping[str, Tier] = {
    'backbone': Tier(momentum=True, second_moment='factored'),
    'experts': Tier(momentum=False, second_moment='factored'),
    'router': Tier(momentum=False, second_moment='exact', weight_decay=False),
}


class TieredAdamState(NamedTuple):
  """State of `scale_by_tiered_adam`; unused fields of a leaf hold `optax.MaskedNode`."""
  count: jax.Array  # shape=(), int32: number of updates applied so far.
  mu: optax.Updates  # like params, dtype tier.mu_dtype; MaskedNode without momentum.
  v_row: optax.Updates  # factored leaves: shape [..., R] float32; else MaskedNode.
  v_col: optax.Updates  # factored leaves: shape [..., C] float32; else MaskedNode.
  v: optax.Updates  # exact: like param; grouped: pooled axis; float32; else MaskedNode.


def leaf_kind(shape: tuple[int, ...], tier: Tier) -> str:
  """Which estimator a leaf of `shape` gets under `tier`: exact/factored/grouped."""
  if tier.second_moment == 'factored':
    return 'factored' if _factored.is_factored(shape) else 'exact'
  if tier.second_moment == 'grouped':
    return 'grouped' if len(shape) >= 1 else 'exact'
  return 'exact'


def _clip_divisor(u_of: Any, operands: tuple[Any, ...], ndim: int, clip: float
                  ) -> jax.Array:
  """`max(1, rms(u) / clip)`, rms over the last two axes (the whole leaf if ndim < 2).

  `u = u_of(*operands)` is recomputed inside the reduction from operands passed through
  an optimisation barrier: without it XLA:CPU materialises the full-size `u` that feeds
  both this reduction and the final elementwise pass. Scalars that `u_of` uses must be
  operands too, or XLA materialises their full-size broadcast, shared by both passes.
  """
  u = u_of(*jax.lax.optimization_barrier(operands))
  axes = (-2, -1) if ndim >= 2 else None
  rms = jnp.sqrt(jnp.mean(u * u, axis=axes, keepdims=ndim >= 2))
  return jnp.maximum(1.0, rms / clip)


def _grouped_clip_divisor(pooled_sq: jax.Array, denom: jax.Array, num_scale: Any,
                          shape: tuple[int, ...], axis: int, tier: Tier, clip: float
                          ) -> jax.Array:
  """`max(1, rms(u) / clip)` of `u = g * num_scale / expand(denom)` from pooled arrays.

  `pooled_sq` is the group mean of `g^2`, so `pooled_sq * count` is the group's sum of
  squares; no pass over the full-size leaf is needed.
  """
  n = shape[axis]
  counts = np.minimum(n - tier.group_size * np.arange(denom.shape[axis]), tier.group_size)
  counts = counts.astype(np.float32).reshape((-1,) + (1,) * (len(shape) - axis - 1))
  terms = pooled_sq * jnp.asarray(counts) * jnp.square(num_scale / denom)
  axes = (-2, -1) if len(shape) >= 2 else None
  size = shape[-2] * shape[-1] if len(shape) >= 2 else max(int(np.prod(shape)), 1)
  rms = jnp.sqrt(jnp.sum(terms, axis=axes, keepdims=len(shape) >= 2) / size)
  return jnp.maximum(1.0, rms / clip)


def _grouped_clip_divisor_by_reshape(x: jax.Array, denom: jax.Array, num_scale: Any,
                                     shape: tuple[int, ...], axis: int, tier: Tier,
                                     clip: float) -> jax.Array:
  """`max(1, rms(u) / clip)` of `u = x * num_scale / expand(denom)`, when groups divide.

  The expansion is a broadcast over a reshape `[..., n / s, s, ...]`, which XLA keeps
  inside the reduction, so nothing of the leaf's size is materialised.
  """
  x, denom, num_scale = jax.lax.optimization_barrier((x, denom, num_scale))
  n, s = shape[axis], tier.group_size
  grouped = x.reshape(shape[:axis] + (n // s, s) + shape[axis + 1:]).astype(jnp.float32)
  u = grouped * num_scale / jnp.expand_dims(denom, axis + 1)
  if len(shape) >= 2:
    ms = jnp.sum(u * u, axis=(-3, -2, -1)) / (shape[-2] * shape[-1])
    ms = ms.reshape(shape[:-2] + (1, 1))
  else:
    ms = jnp.mean(u * u)
  return jnp.maximum(1.0, jnp.sqrt(ms) / clip)


def scale_by_tiered_adam(
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = 1e-8,
    *,
    tier: Optional[Tier] = None,
    **tier_options: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates with one SkewAdam tier's rule.

  Per leaf, with `bc1 = 1 - b1^t`, `bc2 = 1 - b2^t` and gradients in float32::

    factored (ndim >= 2, leading axes are batch axes, e.g. experts):
      r <- b2 r + (1 - b2) mean(g^2, -1);   c <- b2 c + (1 - b2) mean(g^2, -2)
      D = sqrt(max(r / max(mean(r), 1e-15), eps)) [.., :, None] * sqrt(max(c, eps)) [.., None, :]
    exact (also every leaf with ndim < 2):  v <- b2 v + (1 - b2) g^2;  D = sqrt(max(v, eps))
    grouped:  nu <- b2 nu + (1 - b2) groupmean(g^2);  D = sqrt(max(expand(nu), eps))
    u = m sqrt(bc2) / bc1 / D  with m <- b1 m + (1 - b1) g   (momentum)
        g sqrt(bc2) / D                                       (no momentum)
    u = u / max(1, rms(u) / clip)      (rms per matrix: over the last two axes)

  With `eps_mode='adam'`, `u = m_hat / (sqrt(v_hat) + eps)` instead, `v_hat` being the
  bias-corrected exact, factored (`r / mean(r)` times `c`) or pooled estimate.

  Args:
    b1: decay rate of the first moment (unused without momentum).
    b2: decay rate of the second-moment statistics.
    eps: floor on the uncorrected second moment (`eps_mode='floor'`) or Adam's
      additive term (`eps_mode='adam'`).
    tier: the tier's static configuration; default `Tier()`.
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
  tier = (tier or Tier()).replace(**tier_options) if tier_options else (tier or Tier())
  if not isinstance(tier, Tier):
    raise TypeError(f'`tier` must be a skewadam_jax.Tier, got {type(tier).__name__}.')
  _checks.check_beta('b1', b1)
  _checks.check_beta('b2', b2)
  _checks.check_non_negative('eps', eps)
  floor = tier.eps_mode == 'floor'

  def grouped_axis(path: str, shape: tuple[int, ...]) -> Optional[int]:
    return _grouped.resolve_axis(len(shape), tier.group_axis, path, 'group_axis')

  def init_leaf(path: str, p: Any) -> tuple[Any, Any, Any, Any]:
    _checks.check_float_leaf(path, p.dtype, 'scale_by_tiered_adam')
    shape = tuple(p.shape)
    kind = leaf_kind(shape, tier)
    mu = jnp.zeros_like(p, dtype=tier.mu_dtype) if tier.momentum else optax.MaskedNode()
    v_row = v_col = v = optax.MaskedNode()
    # Every statistic is derived from the parameter (never `jnp.zeros(shape)`) so that
    # it inherits the parameter's sharding.
    if kind == 'factored':
      v_row, v_col = _factored.zero_row_col(p)
    elif kind == 'grouped':
      ax = grouped_axis(path, shape)
      _grouped.check_whole_groups(p, tier.group_size, ax, path)
      v = _grouped.zero_grouped(p, tier.group_size, ax, jnp.dtype(jnp.float32))
    else:
      v = jnp.zeros_like(p, dtype=jnp.float32)
    return mu, v_row, v_col, v

  def init_fn(params):
    leaves, treedef = _tree.flatten_with_paths(params)
    fields = [init_leaf(path, p) for path, p in leaves]
    trees = [treedef.unflatten([f[i] for f in fields]) for i in range(4)]
    return TieredAdamState(jnp.zeros([], jnp.int32), *trees)

  def update_leaf(path, g, mu, v_row, v_col, v, bc1, bc2):
    # Every full-size array below is either an input, a state output or computed inside
    # the one fused pass that also applies the update: statistics come from reductions
    # over the stored arrays, and nothing of the leaf's size is materialised in between.
    shape = tuple(g.shape)
    kind = leaf_kind(shape, tier)
    clip = tier.clip_threshold
    g32 = g.astype(jnp.float32)
    if tier.momentum:
      mu = (b1 * mu.astype(jnp.float32) + (1.0 - b1) * g32).astype(mu.dtype)
      src = mu  # the stored (cast) momentum: no defensive copy of the uncast one
      num_scale = 1.0 / bc1
    else:
      src = g
      num_scale = 1.0
    if floor:
      num_scale = num_scale * jnp.sqrt(bc2)
    num_scale = jnp.asarray(num_scale, jnp.float32)
    eps32 = jnp.asarray(eps, jnp.float32)

    if kind == 'factored':
      row_mean, col_mean = _factored.row_col_means(g)
      v_row = b2 * v_row + (1.0 - b2) * row_mean
      v_col = b2 * v_col + (1.0 - b2) * col_mean
      rows = _factored.normalised_rows(v_row)
      if floor:
        # u = num * a_i * b_j is separable: the clip needs only sum_j (num * b_j)^2 per
        # row, and the final pass only multiplies by per-row and per-column factors.
        col_inv = jax.lax.rsqrt(jnp.maximum(v_col, eps))
        row_scale = num_scale * jax.lax.rsqrt(jnp.maximum(rows, eps))
        if clip is not None:
          sumsq = _factored.scaled_row_sumsq(src, col_inv)
          ms = (jnp.sum(sumsq * jnp.square(row_scale), axis=-1, keepdims=True)
                / (shape[-2] * shape[-1]))
          row_scale = row_scale / jnp.maximum(1.0, jnp.sqrt(ms) / clip)
        u = src.astype(jnp.float32) * row_scale[..., :, None] * col_inv[..., None, :]
        return u.astype(g.dtype), mu, v_row, v_col, v
      operands = (src, jnp.sqrt(rows)[..., :, None], jnp.sqrt(v_col / bc2)[..., None, :],
                  num_scale, eps32)

      def u_of(x, row_d, col_d, scale, eps_):
        return x.astype(jnp.float32) * scale / (row_d * col_d + eps_)
    elif kind == 'grouped':
      ax = grouped_axis(path, shape)
      pooled_sq = _grouped.groupmean(g32 * g32, tier.group_size, ax)
      v = b2 * v + (1.0 - b2) * pooled_sq
      # The denominator at the pooled resolution, expanded inside the final pass.
      denom = jnp.sqrt(jnp.maximum(v, eps)) if floor else jnp.sqrt(v / bc2) + eps
      expand = functools.partial(_grouped.expand_groups, group_size=tier.group_size,
                                 axis=ax, n=shape[ax])
      u = src.astype(jnp.float32) * num_scale / expand(denom)
      if clip is not None:
        inside = len(shape) < 2 or ax >= len(shape) - 2  # groups lie inside one matrix
        if inside and not tier.momentum:
          # sum(u^2) = sum over groups of num_scale^2 * (sum of g^2 in the group) /
          # denom^2: the statistic itself gives it, no pass over the leaf is needed.
          u = u / _grouped_clip_divisor(pooled_sq, denom, num_scale, shape, ax, tier, clip)
        elif inside and shape[ax] % tier.group_size == 0:
          u = u / _grouped_clip_divisor_by_reshape(src, denom, num_scale, shape, ax, tier,
                                                   clip)
        else:  # u recomputed in the reduction (expand is a gather there: full-size temp)
          u = u / _clip_divisor(lambda x, d, scale: x.astype(jnp.float32) * scale / expand(d),
                                (src, denom, num_scale), len(shape), clip)
      return u.astype(g.dtype), mu, v_row, v_col, v
    else:
      v = b2 * v + (1.0 - b2) * g32 * g32
      operands = (src, v, num_scale, eps32, bc2)

      def u_of(x, v_, scale, eps_, bc2_):
        if floor:
          return x.astype(jnp.float32) * scale / jnp.sqrt(jnp.maximum(v_, eps_))
        return x.astype(jnp.float32) * scale / (jnp.sqrt(v_ / bc2_) + eps_)

    u = u_of(*operands)
    if clip is not None:
      u = u / _clip_divisor(u_of, operands, len(shape), clip)
    return u.astype(g.dtype), mu, v_row, v_col, v

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args  # unused; accepted so that the transform chains like optax's
    leaves, treedef = _tree.flatten_with_paths(updates)
    mus = treedef.flatten_up_to(state.mu)
    rows = treedef.flatten_up_to(state.v_row)
    cols = treedef.flatten_up_to(state.v_col)
    vs = treedef.flatten_up_to(state.v)
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    bc1 = 1.0 - jnp.asarray(b1, jnp.float32) ** t
    bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** t
    out = [update_leaf(path, g, mu, r, c, v, bc1, bc2)
           for (path, g), mu, r, c, v in zip(leaves, mus, rows, cols, vs)]
    trees = [treedef.unflatten([o[i] for o in out]) for i in range(5)]
    return trees[0], TieredAdamState(count, *trees[1:])

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
