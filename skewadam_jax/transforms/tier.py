"""One tier's configuration: `Tier`, the static choices of a tier of SkewAdam's rule.

A tier chooses momentum (on/off, its dtype, Nesterov), a second-moment estimator
(`exact`, `factored` row/column, `grouped` as in AdamPM, `orthogonal` as in Muon, or a
user's `SecondMoment`), an RMS clip of the update, how `eps` enters, and whether weight
decay applies. The policies built from tiers are in `presets`; the rule that steps
them is `tiers.scale_by_tiers`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Union

import jax.numpy as jnp

from skewadam_jax.core import checks as _checks
from skewadam_jax.estimators import exact as _exact
from skewadam_jax.estimators import factored as _factored
from skewadam_jax.estimators import grouped as _grouped
from skewadam_jax.estimators import orthogonal as _orthogonal
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.estimators import codec as _codec
from skewadam_jax.structure.vocabulary import BACKBONE

SECOND_MOMENTS = ('exact', 'factored', 'grouped', 'orthogonal')
EPS_MODES = ('floor', 'adam')

@dataclasses.dataclass(frozen=True)
class Tier:
  """Static configuration of one tier of `scale_by_tiered_adam`.

  Attributes:
    momentum: keep a first moment (EMA of gradients) for this tier.
    mu_dtype: dtype the first moment is stored in (float32 as published).
    second_moment: `'factored'` (row/column statistics for leaves with ndim >= 2,
      per matrix over the batch axes; exact for < 2 non-batch axes), `'exact'` (Adam's full
      second moment), `'grouped'` (AdamPM pooling over `group_size` neighbours),
      `'orthogonal'` (no statistics: each matrix orthogonalised as in Muon, see
      `sj.Orthogonal`), or an estimator object (a `skewadam_jax.SecondMoment`, e.g. one
      of your own).
    group_size: group size of the `'grouped'` estimator.
    group_axis: axis the `'grouped'` estimator pools along.
    clip_threshold: RMS clip of the update (per slice of the batch axes, i.e. per
      expert for stacked experts), or None for no clipping.
    eps_mode: `'floor'` (as published: `eps` floors the uncorrected second moment
      inside the square root) or `'adam'` (`u = m_hat / (sqrt(v_hat) + eps)`).
    apply_weight_decay: whether decoupled weight decay (`skewadam`'s `weight_decay`
      rate) applies to this tier.
    nesterov: with momentum, the numerator is optax's Nesterov form (as in
      `optax.adam(nesterov=True)` and `optax.contrib.muon`) instead of `m / bc1`:
      `x = b1 m / (1 - b1^(t+1)) + (1 - b1) g / bc1`.
    b1: this tier's momentum decay rate, or None for the transform's `b1` (Muon's
      tiers use 0.95 beside Adam's 0.9).
    mu_codec: how the momentum is stored between steps: None (an array of `mu_dtype`)
      or a state codec, e.g. `sj.Blockwise(bits=8, block_size=256)` (uint8 codes and
      one float32 scale per block; `mu_dtype` must then stay float32, the dtype the
      step decodes to). The step decodes the momentum, updates it in float32, computes
      the update from it and encodes it again (see `skewadam_jax/estimators/codec.py`).
    lr_scale: a static factor on this tier's update (after the clip, before weight
      decay and the learning rate): `p <- p - lr (lr_scale u + wd p)`. It lets
      Adam-like tiers run at a fraction of the learning rate of orthogonalised ones
      beside them (as `optax.contrib.muon`'s `adam_learning_rate`); weight decay is not
      scaled.

  Memory: every estimator keeps the step free of full-size temporaries, in any layout
  of batch axes, except a `'grouped'` tier with a clip whose groups do not divide the
  pooled axis, where the clip recomputes the update through a gather (temporaries of
  about the leaf's size or more). Pool in dividing groups, or drop the clip, where memory is
  tight. On XLA:CPU only (the barrier that keeps the clip's two passes apart is left out
  on GPUs), a `nesterov` tier with a clip also materialises its numerator `x`
  (`MUON_TIERS`' Nesterov tier has none). The figures: see benchmarks/RESULTS.md.
  """
  momentum: bool = True
  mu_dtype: Any = jnp.float32
  second_moment: Union[str, _second_moment.SecondMoment] = 'factored'
  group_size: int = 8
  group_axis: int = -1
  clip_threshold: Optional[float] = 1.0
  eps_mode: str = 'floor'
  apply_weight_decay: bool = True
  nesterov: bool = False
  b1: Optional[float] = None
  mu_codec: Optional[_codec.StateCodec] = None
  lr_scale: float = 1.0

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
    if not isinstance(self.second_moment, _second_moment.SecondMoment):
      _checks.check_choice('second_moment', self.second_moment, SECOND_MOMENTS,
                           'an estimator object (a skewadam_jax.SecondMoment) works too')
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
    if not isinstance(self.apply_weight_decay, bool):
      raise TypeError(f'`apply_weight_decay` must be a bool, got {self.apply_weight_decay!r}.')
    if not isinstance(self.nesterov, bool):
      raise TypeError(f'`nesterov` must be a bool, got {self.nesterov!r}.')
    if self.nesterov and not self.momentum:
      raise ValueError('`nesterov=True` needs `momentum=True`: Nesterov momentum is a rule '
                       'of the first moment, which this tier does not keep.')
    if self.b1 is not None:
      if not _checks.is_concrete_number(self.b1):
        raise TypeError(f'`b1` of a Tier must be a float in [0, 1) or None, got {self.b1!r}.')
      _checks.check_beta('b1', self.b1)
    if self.mu_codec is not None:
      if not isinstance(self.mu_codec, _codec.StateCodec):
        raise TypeError('`mu_codec` must be a state codec (e.g. sj.Blockwise(bits=8, '
                        f'block_size=256)) or None, got {self.mu_codec!r}.')
      if not self.momentum:
        raise ValueError('`mu_codec` stores the momentum, which a tier with '
                         '`momentum=False` does not keep: set `momentum=True` or drop it.')
      if mu_dtype != jnp.float32:
        raise ValueError(f'`mu_dtype`={mu_dtype} and `mu_codec`={self.mu_codec!r} both say '
                         'how the momentum is stored: with a codec, leave `mu_dtype` at '
                         'float32 (the dtype the step decodes to).')
    if not (_checks.is_concrete_number(self.lr_scale) and math.isfinite(float(self.lr_scale))
            and float(self.lr_scale) > 0):
      raise ValueError(f'`lr_scale` must be a static positive float, got {self.lr_scale!r}.')
    object.__setattr__(self, 'lr_scale', float(self.lr_scale))

  def replace(self, **changes: Any) -> Tier:
    """A copy of this tier with some options changed."""
    fields = {f.name for f in dataclasses.fields(self)}
    unknown = sorted(set(changes) - fields)
    if unknown:
      hint = _checks.did_you_mean(unknown[0], fields)
      raise TypeError(f'Unknown Tier option(s) {unknown}{hint}; the options are '
                      f'{sorted(fields)}.')
    return dataclasses.replace(self, **changes) if changes else self

  @property
  def estimator(self) -> _second_moment.SecondMoment:
    """The tier's second-moment estimator (before the per-leaf fallback to exact)."""
    if isinstance(self.second_moment, _second_moment.SecondMoment):
      return self.second_moment
    if self.second_moment == 'grouped':
      return _grouped.Grouped(self.group_size, self.group_axis, axis_arg='group_axis')
    return {'exact': _exact.EXACT, 'factored': _factored.FACTORED,
            'orthogonal': _orthogonal.ORTHOGONAL}[self.second_moment]


def undecided_tier(tiers: Any) -> Tier:
  """The safe rule for a leaf whose structure is undecided, the same under every policy.

  Nothing of the update is shared across any axis of the leaf, since none of them is
  known to index the same matrix: an exact (elementwise) second moment, no
  orthogonalisation, no update clip (an RMS over the leaf's matrix), and the momentum
  uncoded (a blockwise code's scale is shared by the elements of a block, which may
  span experts or layers). Scaling one slice of any axis of its gradient moves only that
  slice's update. The rest (momentum on or off, its dtype and `b1`, Nesterov,
  `eps_mode`, weight decay, `lr_scale`) is the policy's `backbone` tier's, so that the
  leaf steps at the policy's learning rate.

  Args:
    tiers: the policy (tier name -> `Tier`); its `backbone` tier, if any, gives the rest.

  Returns:
    The `Tier` of the undecided leaves.
  """
  base = tiers.get(BACKBONE, Tier()) if isinstance(tiers, Mapping) else Tier()
  return base.replace(second_moment='exact', clip_threshold=None, mu_codec=None)
