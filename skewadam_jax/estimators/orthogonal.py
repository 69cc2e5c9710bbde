"""The orthogonalised update: Muon's Newton-Schulz step in place of a second moment.

A tier with `second_moment=Orthogonal()` keeps no statistics at all. Each matrix of
the numerator `x` (the tier's momentum, or the gradient without momentum) is replaced
by an approximation of its orthogonal polar factor `U V^T` (`x = U S V^T`), computed
by a quintic Newton-Schulz iteration, and rescaled so that its RMS matches Adam's::

  X  = x s / (||x s||_F + eps)                        (s: the step's num_scale)
  X <- a X + (b A + c A A) X,   A = X X^T             (ns_steps times; on X^T if R > C)
  u  = rms_scale * sqrt(max(R, C)) * X                (rms_scale None: sqrt(max(1, C / R)))

with `(a, b, c) = (3.4445, -4.7750, 2.0315)` (Muon's coefficients, which leave the
singular values in about [0.7, 1.2] instead of exactly 1). An `[R, C]` matrix with
unit singular values has RMS `sqrt(min(R, C) / (R C)) = 1 / sqrt(max(R, C))`, so the
default `rms_scale=0.2` gives every matrix an update RMS of about 0.2, that of a
typical Adam update: one learning rate serves an orthogonalised tier and the Adam-like
tiers beside it (Liu et al. 2025; optax's `muon(consistent_rms=0.2)`). With
`rms_scale=None` the scale is Muon's width rule `sqrt(max(1, C / R))` instead, for
Muon's own learning rates.

The matrix of a leaf is laid out as in `Factored`: the batch axes (the expert axis of
a stacked bank, a scanned layer axis, wherever they sit) index independent matrices,
each orthogonalised on its own; of the remaining axes the last is the column (output)
axis `C` and the others together the rows (input) `R`, e.g. `[E, d, f]` is `E`
matrices `[d, f]`. A leaf with fewer than two non-batch axes (a bias, a norm scale, a
per-expert bias `[E, F]`) has no matrix to orthogonalise: it gets `fallback`, or is
rejected at `init` with a `ValueError` when `fallback` is None.

No statistic means no bytes, no sharding specs, and no RMS clip in practice (the
update RMS is `rms_scale` by construction; a tier's clip still applies per matrix).

Cost: unlike the other estimators, the step is compute-bound and has full-size
temporaries (the `X` of every matrix and the Gram products of each iteration, all
batch slices at once). `ns_dtype` sets the iteration's dtype: bfloat16 products
accumulated in float32, as Muon runs it, or float32; the default 'auto' is bfloat16 on
GPU and TPU and float32 on CPU (see `iteration_dtype`). Its temporaries and time on
XLA:CPU, against `optax.contrib.muon`'s:
benchmarks/RESULTS.md, "Numbers behind the library's choices".

References:
  Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024
  (https://kellerjordan.github.io/posts/muon/).
  Liu et al., Muon is Scalable for LLM Training, arXiv 2502.16982, 2025.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from skewadam_jax.core import checks as _checks
from skewadam_jax.core import xla as _xla
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.estimators import blocks as _blocks
from skewadam_jax.estimators.base import Spec
from skewadam_jax.estimators.base import Stats
from skewadam_jax.estimators.base import Step
from skewadam_jax.estimators.newton_schulz import auto_mesh_in_context
from skewadam_jax.estimators.newton_schulz import iteration_dtype
from skewadam_jax.estimators.newton_schulz import newton_schulz
from skewadam_jax.estimators.newton_schulz import NewtonSchulzGroup
from skewadam_jax.estimators.newton_schulz import NS_COEFFS
from skewadam_jax.estimators.newton_schulz import NS_DTYPES
from skewadam_jax.estimators.newton_schulz import wide


def has_matrix(shape: tuple[int, ...], batch_axes: tuple[int, ...]) -> bool:
  """Whether a leaf of `shape` with `batch_axes` holds matrices worth orthogonalising.

  Each matrix is `[R, C]` as `Orthogonal` lays it out (the rows' product, the column).
  With a side of 1 (a gate `[d, 1]`, a row `[1, d]`) it is a vector: its orthogonal
  polar factor is only its direction, the update of normalised gradient descent, with
  nothing of Adam's per-entry scale. So it needs two non-batch axes, both sides > 1.
  """
  layout = _second_moment.Layout.of(len(shape), tuple(batch_axes))
  if len(layout.matrix) < 2:
    return False
  return min(math.prod(shape[a] for a in layout.rows), shape[layout.col]) > 1


@dataclasses.dataclass(frozen=True)
class Orthogonal(_second_moment.SecondMoment):
  """No second moment: each matrix's update is orthogonalised (Muon), RMS-matched.

  Attributes:
    rms_scale: the update of an `[R, C]` matrix is scaled by
      `rms_scale * sqrt(max(R, C))`, so that its RMS is about `rms_scale` (0.2: Adam's,
      one learning rate for every tier); None scales by Muon's `sqrt(max(1, C / R))`.
    ns_steps: Newton-Schulz iterations.
    ns_coeffs: the quintic's `(a, b, c)`.
    eps: added to the Frobenius norm that normalises each matrix.
    ns_dtype: the dtype of the iteration: 'float32'; 'bfloat16' (bfloat16 operands,
      float32 accumulation, as Muon runs it: faster where matrix units multiply
      bfloat16 faster, within 0.1 of float32 in relative Frobenius norm); or
      'auto' (default), bfloat16 on GPU and TPU, float32 on CPU, decided when the
      update is traced from the platform of the arrays' devices, or under `jit` from
      `jax.default_backend()` (`iteration_dtype`).
    fallback: the estimator of leaves with fewer than two non-batch axes (e.g.
      `sj.Factored()`, which gives them `Exact`); None rejects them at `init`.
    batch_axes: the leaf's batch axes (sorted, non-negative), or None for the default
      (every axis before the last two); `for_leaf` sets it per leaf.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> hidden = sj.Tier(momentum=True, nesterov=True, b1=0.95,
    ...                  second_moment=sj.Orthogonal(), clip_threshold=None)
    >>> tx = sj.scale_by_tiered_adam(tier=hidden)
    >>> state = tx.init({'w': jnp.zeros((8, 16))})  # the momentum only

  References:
    Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024.
    Liu et al., Muon is Scalable for LLM Training, arXiv 2502.16982, 2025.
  """

  rms_scale: Optional[float] = 0.2
  ns_steps: int = 5
  ns_coeffs: tuple[float, float, float] = NS_COEFFS
  eps: float = 1e-8
  fallback: Optional[_second_moment.SecondMoment] = None
  batch_axes: Optional[tuple[int, ...]] = None
  ns_dtype: str = 'auto'
  name = 'orthogonal'
  reduces_matrices = True

  def __post_init__(self):
    if self.rms_scale is not None and not (_checks.is_concrete_number(self.rms_scale)
                                           and float(self.rms_scale) > 0):
      raise ValueError(f'`rms_scale` must be a positive float or None, got {self.rms_scale!r}.')
    _checks.check_positive_int('ns_steps', self.ns_steps)
    coeffs = tuple(self.ns_coeffs) if hasattr(self.ns_coeffs, '__iter__') else ()
    if len(coeffs) != 3 or not all(_checks.is_concrete_number(c) for c in coeffs):
      raise TypeError(f'`ns_coeffs` must be three floats (a, b, c), got {self.ns_coeffs!r}.')
    object.__setattr__(self, 'ns_coeffs', tuple(float(c) for c in coeffs))
    _checks.check_non_negative('eps', self.eps)
    _checks.check_choice('ns_dtype', self.ns_dtype, NS_DTYPES)
    if self.fallback is not None and not isinstance(self.fallback,
                                                    _second_moment.SecondMoment):
      raise TypeError('`fallback` must be a skewadam_jax.SecondMoment (e.g. sj.Factored()) '
                      f'or None, got {self.fallback!r}.')

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> _second_moment.SecondMoment:
    layout = _second_moment.Layout.of(len(shape), batch_axes)
    batch_axes = layout.batch
    if len(layout.matrix) < 2:
      if self.fallback is None:
        return _NoMatrix(tuple(shape), batch_axes)
      return self.fallback.for_leaf(tuple(shape), batch_axes)
    return self if batch_axes == self.batch_axes else dataclasses.replace(
        self, batch_axes=batch_axes)

  def init(self, param: Any, path: str) -> Stats:
    del param, path
    return {}

  def update(self, g: jax.Array, stats: Stats, x: jax.Array, step: Step
             ) -> tuple[jax.Array, Stats]:
    del g, stats
    mats, finish = self.prepare(x, step)
    return finish(newton_schulz(mats, *self.iteration)), {}

  @property
  def iteration(self) -> tuple[Any, ...]:
    """What fixes the Newton-Schulz iteration besides the matrices' shape: leaves whose
    prepared matrices have the same shape and `iteration` can share one batched call;
    `newton_schulz(mats, *iteration)` is the iteration of `prepare`'s matrices."""
    return (self.ns_coeffs, self.ns_steps, self.eps, self.ns_dtype)

  def shared(self, x: jax.Array, step: Step) -> Optional[_second_moment.Shared]:
    """The Newton-Schulz iteration of `x`'s matrices, shared with the other leaves of
    its `NewtonSchulzGroup`; None for a subclass that overrides `update` (it runs whole).
    Matrices sharded over their batch axes are iterated where they lie (`alone`), and
    so are a leaf's several matrices under an Auto mesh in context, where their
    placement is XLA's to keep: a shared buffer of other leaves' matrices would gather
    an expert-parallel bank onto every device."""
    if type(self).update is not Orthogonal.update:
      return None
    mats, finish = self.prepare(x, step)
    group = NewtonSchulzGroup(wide(mats.shape), self.iteration)
    return _second_moment.Shared(mats, group, finish,
                                 alone=(_blocks.explicit_spec(mats) is not None
                                        or bool(_second_moment.varying_axes(mats))
                                        or (mats.shape[0] > 1 and auto_mesh_in_context())))

  def prepare(self, x: jax.Array, step: Step
              ) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """`update` in two halves around the Newton-Schulz iteration.

    Returns `(mats, finish)`: the matrices to orthogonalise, `[n, R, C]` (one per batch
    slice) in the iteration's dtype (`iteration_dtype(self.ns_dtype, x)`), and the
    function that turns their orthogonalised form (the result of
    `newton_schulz(mats, *self.iteration)`) into the leaf's update. `scale_by_tiers` runs
    one `newton_schulz_shared` for all leaves whose `mats` have the same `[R, C]` and
    `iteration`: the result per matrix is the same, and a model's compile holds one
    iteration per matrix shape instead of one per leaf.
    """
    layout = _second_moment.Layout.of(x.ndim, self.batch_axes)
    batch, rows, col = layout.batch, layout.rows, layout.col
    r = math.prod(x.shape[a] for a in rows)
    c = x.shape[col]
    # The floor mode's sqrt(bc2) only rescales `x`, which the normalisation undoes.
    s = step.bc1_scale
    if s is None:
      s = step.num_scale * _xla.rsqrt(step.bc2) if step.floor else step.num_scale
    perm = batch + rows + (col,)
    # Under an Explicit mesh every matrix is gathered whole (its matrix axes resharded
    # to replicated) once per step, before the iteration: each Gram product then
    # contracts an axis every device holds in full, and the reshapes below move no
    # data. Sharded batch axes (experts, layers) stay where they lie: each device
    # iterates its own matrices. The update is resharded back to `x`'s placement.
    placed = _blocks.explicit_spec(x)
    gathered = placed
    if placed is not None:
      entries = tuple(None if a in layout.matrix else e for a, e in enumerate(placed.entries))
      gathered = placed._replace(entries=entries) if any(entries) else None
      if entries != placed.entries:
        x = jax.sharding.reshard(x, _named(placed._replace(entries=entries)))
    # A sharded batch keeps its axes (merging them would move data between devices
    # unless only the first were sharded), so its matrices are `[*batch, R, C]`.
    # The batch count spelled out, not -1: a zero-size leaf has no -1 to infer.
    lead = ((math.prod(x.shape[a] for a in batch),) if gathered is None
            else tuple(x.shape[a] for a in batch))
    # Scaled in float32, then cast to the iteration's dtype (bfloat16 halves the bytes
    # a shared call's buffer moves; its norm is taken in float32 from these values).
    dtype = iteration_dtype(self.ns_dtype, x)
    mats = jnp.transpose(x.astype(jnp.float32) * s, perm).reshape(lead + (r, c))
    mats = mats.astype(dtype)
    scale = (self.rms_scale * math.sqrt(max(r, c)) if self.rms_scale is not None
             else math.sqrt(max(1.0, c / r)))

    def finish(o: jax.Array) -> jax.Array:
      u = jnp.transpose((o.astype(jnp.float32) * scale).reshape(tuple(x.shape[a] for a in perm)),
                        _inverse(perm))
      u = _second_moment.clipped(lambda u_: u_, (u,), layout, step.clip)
      if placed is None or placed.entries == getattr(gathered, 'entries', None):
        return u
      return jax.sharding.reshard(u, _named(placed))

    return mats, finish

  def specs(self, spec: Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Mapping[str, Any]:
    del spec, shape, mesh, path
    return {}


@dataclasses.dataclass(frozen=True)
class _NoMatrix(_second_moment.SecondMoment):
  """What `Orthogonal` without a fallback gives a leaf with no matrix: an error at init."""

  shape: tuple[int, ...]
  batch_axes: Optional[tuple[int, ...]]
  name = 'orthogonal (no matrix)'

  def init(self, param: Any, path: str) -> Stats:
    axes = ('the default (all but the last two)' if self.batch_axes is None
            else str(self.batch_axes))
    raise ValueError(
        f'{path}: an orthogonal update needs a matrix (two or more non-batch axes) per batch '
        f'slice; shape {self.shape} with batch axes {axes} has fewer. Give such leaves '
        'another tier, or a fallback estimator: sj.Orthogonal(fallback=sj.Factored()).')

  def update(self, g: jax.Array, stats: Stats, x: jax.Array, step: Step
             ) -> tuple[jax.Array, Stats]:  # pragma: no cover - init raises first
    raise AssertionError('unreachable: init rejects the leaf')


def _named(placed: _blocks.Placed) -> NamedSharding:
  return NamedSharding(placed.mesh, PartitionSpec(*placed.entries))


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
  out = [0] * len(perm)
  for i, p in enumerate(perm):
    out[p] = i
  return tuple(out)


ORTHOGONAL = Orthogonal()
