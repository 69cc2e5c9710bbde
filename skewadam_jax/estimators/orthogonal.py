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
batch slices at once). `ns_dtype` sets the iteration's dtype: bfloat16 operands with
float32 accumulation, as Muon runs it, or float32; the default 'auto' is bfloat16 on
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
from typing import Any, Callable, Mapping, Optional, Sequence

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

# Muon's quintic Newton-Schulz coefficients (Jordan et al. 2024; optax's default).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# The dtypes a Newton-Schulz iteration can run in (`Orthogonal.ns_dtype`).
NS_DTYPES = ('auto', 'float32', 'bfloat16')
# Platforms (`jax.Device.platform`) whose matrix units multiply bfloat16 faster than
# float32: where `ns_dtype='auto'` iterates in bfloat16.
FAST_BFLOAT16_PLATFORMS = ('gpu', 'cuda', 'rocm', 'tpu')


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


def iteration_dtype(ns_dtype: str, x: Optional[jax.Array] = None) -> jnp.dtype:
  """The dtype a Newton-Schulz iteration of `x` runs in, for an `Orthogonal.ns_dtype`.

  'float32' and 'bfloat16' name it; 'auto' is bfloat16 where the matrices are computed
  on a GPU or TPU (whose matrix units run bfloat16 products several times faster than
  float32 ones) and float32 elsewhere (XLA:CPU has no fast bfloat16 products: it
  converts them to float32, so bfloat16 would only add rounding). The platform is that
  of `x`'s devices when `x` is a concrete array, else (under `jit`, where `x` is a
  tracer, or with no `x`) `jax.default_backend()` when the program is traced: a
  program traced for a backend other than the default one (`jax.jit(f,
  backend='cpu')` on a GPU machine) should name the dtype.
  """
  _checks.check_choice('ns_dtype', ns_dtype, NS_DTYPES)
  if ns_dtype != 'auto':
    return jnp.dtype(ns_dtype)
  if x is not None and not isinstance(x, jax.core.Tracer) and hasattr(x, 'devices'):
    platforms = {d.platform for d in x.devices()}
  else:
    platforms = {jax.default_backend()}
  fast = platforms and all(p in FAST_BFLOAT16_PLATFORMS for p in platforms)
  return jnp.dtype(jnp.bfloat16 if fast else jnp.float32)


def newton_schulz(x: jax.Array, coeffs: tuple[float, float, float] = NS_COEFFS,
                  steps: int = 5, eps: float = 1e-8, ns_dtype: Optional[str] = None
                  ) -> jax.Array:
  """Approximate polar factor of each matrix `x[..., R, C]`, batched.

  The Frobenius norm normalises each matrix (all singular values <= 1), then `steps`
  quintic iterations push them towards 1; the iteration runs on the wide orientation
  (`X X^T` is the smaller Gram matrix), which gives the same result as on `X^T`.

  In float32 every operation is float32. In bfloat16 (Muon's own practice) the iterate
  `X` is stored in bfloat16 and every product takes bfloat16 operands (`X`, the Gram
  matrix `A`, the polynomial `b A + c A A`) and accumulates in float32
  (`preferred_element_type`); the norm and the elementwise sums are float32, rounded
  to bfloat16 once per iteration. Each step thus rounds its operands to 8 significant
  bits (relative error <= 2^-8 each); the factor stays within 0.1 of the float32 one
  in relative Frobenius norm and its singular values within 0.15, inside the spread the
  float32 iteration leaves around 1; tests/test_orthogonal.py states the bounds and
  why. Rounding the products to bfloat16 as well (the iteration without float32
  accumulation) is further off (measured:
  benchmarks/RESULTS.md, "Numbers behind the library's choices").

  Args:
    x: the matrices, `[..., R, C]`, float32 or bfloat16.
    coeffs: the quintic's `(a, b, c)`.
    steps: iterations.
    eps: added to the Frobenius norm.
    ns_dtype: 'float32', 'bfloat16' or 'auto' (`iteration_dtype`); None: `x`'s dtype.

  Returns:
    The approximate polar factors, like `x`, in the iteration's dtype.
  """
  dtype = x.dtype if ns_dtype is None else iteration_dtype(ns_dtype, x)
  if dtype == jnp.bfloat16:
    return _newton_schulz_bfloat16(x, coeffs, steps, eps)
  a, b, c = coeffs
  if ns_dtype is not None:
    x = x.astype(dtype)
  transposed = x.shape[-2] > x.shape[-1]
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  x = _whole_matrices(x)
  norm = _xla.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))
  x = x / (norm + eps)
  for _ in range(steps):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = _whole_matrices(a * x + (b * gram + c * gram @ gram) @ x)
  return jnp.swapaxes(x, -1, -2) if transposed else x


def _newton_schulz_bfloat16(x: jax.Array, coeffs: tuple[float, float, float], steps: int,
                            eps: float) -> jax.Array:
  """`newton_schulz` with bfloat16 operands and float32 accumulation (its docstring)."""
  a, b, c = coeffs
  transposed = x.shape[-2] > x.shape[-1]
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  f = x.astype(jnp.float32)
  norm = _xla.sqrt(jnp.sum(f * f, axis=(-2, -1), keepdims=True))
  x = _whole_matrices((f / (norm + eps)).astype(jnp.bfloat16))
  for _ in range(steps):
    gram = _dot32(x, jnp.swapaxes(x, -1, -2))
    g16 = gram.astype(jnp.bfloat16)
    poly = b * gram + c * _dot32(g16, g16)
    x = _whole_matrices((a * x.astype(jnp.float32)
                         + _dot32(poly.astype(jnp.bfloat16), x)).astype(jnp.bfloat16))
  return jnp.swapaxes(x, -1, -2) if transposed else x


def _dot32(p: jax.Array, q: jax.Array) -> jax.Array:
  """`p @ q` of bfloat16 operands, accumulated and returned in float32."""
  return jnp.matmul(p, q, preferred_element_type=jnp.float32)


def _whole_matrices(x: jax.Array) -> jax.Array:
  """`x` asked to be whole (replicated) on its two matrix axes under an Auto mesh.

  Under Auto axes XLA's propagation would otherwise keep the iterate sharded as its
  input was and gather it again for every Gram product, every iteration. The mesh
  must be in context (`jax.set_mesh`), which is also where the other axes stay XLA's
  choice; under Explicit axes `Orthogonal.prepare` already gathered the matrices, and
  with no mesh (or inside `shard_map`) there is nothing to ask.
  """
  get_mesh = getattr(jax.sharding, 'get_abstract_mesh', None)  # jax >= 0.6
  mesh = None if get_mesh is None else get_mesh()
  if mesh is None or mesh.empty or not getattr(mesh, 'are_all_axes_auto', False):
    return x
  free = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - 2)
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*free, None, None))


def wide(shape: tuple[int, ...]) -> tuple[int, int]:
  """The `[R, C]` of a matrix as the iteration runs it: the wide orientation (R <= C)."""
  r, c = shape[-2:]
  return (r, c) if r <= c else (c, r)


def padded_shape(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
  """The `[R, C]` a shared call pads its matrices to: the largest wide `R` and `C`."""
  wides = [wide(s) for s in shapes]
  return max(r for r, _ in wides), max(c for _, c in wides)


def newton_schulz_shared(mats: list[jax.Array], coeffs: tuple[float, float, float] = NS_COEFFS,
                         steps: int = 5, eps: float = 1e-8, ns_dtype: Optional[str] = None,
                         max_batch: Optional[int] = None,
                         key: Optional[jax.Array] = None) -> list[jax.Array]:
  """`[newton_schulz(m, ...) for m in mats]` as one batched iteration.

  `mats` are `[n_i, R_i, C_i]`. Each is turned wide (`R <= C`, as `newton_schulz` does)
  and written, zero-padded, into one buffer of `k * b` matrices of the largest `[R, C]`
  (`k = ceil(N / max_batch)` chunks of `b = ceil(N / k)`, zero matrices filling the
  last; `N = sum(n_i)`); the chunks are orthogonalised one after the other by one
  compiled iteration (`lax.map`), and each leaf's matrices are read back. Each matrix
  is normalised and iterated on its own, and zero rows and columns stay zero through
  the iteration (`X X^T` has them as zero rows and columns, so each product keeps the
  matrix's block), so the result is that of separate calls up to rounding; a zero
  matrix stays zero.

  Why this shape of program: XLA compiles one kernel per distinct operation, and a
  slice at a constant offset is a different operation at every offset. With `key`, the
  offsets of the leaves in the buffer are runtime values (`core.xla.opaque_uints`), so
  that writing and reading the leaves of one shape is one kernel however many leaves
  there are; and the chunks all have one shape, so that the iteration is compiled once.

  Args:
    mats: the matrices of each leaf, `[n_i, R_i, C_i]`.
    coeffs, steps, eps: as in `newton_schulz`.
    ns_dtype: the iteration's dtype, as in `newton_schulz`; None: that of `mats` (the
      buffer's is their common dtype: `Orthogonal.prepare` casts them to the dtype of
      its `ns_dtype`, and leaves of other dtypes never share a call).
    max_batch: at most this many matrices per chunk (None: one chunk): the float32
      temporaries of the iteration are those of one chunk.
    key: a float32 scalar known only at run time and never NaN (the step count), which
      hides the offsets from XLA's constant folding; None leaves them constants.

  Returns:
    The orthogonalised `mats`, each `[n_i, R_i, C_i]`.
  """
  sizes = [m.shape[0] for m in mats]
  total = sum(sizes)
  if len(mats) == 1 and (max_batch is None or total <= max_batch):
    return [newton_schulz(mats[0], coeffs, steps, eps, ns_dtype)]
  shape = padded_shape([m.shape for m in mats])
  tall = [m.shape[1] > m.shape[2] for m in mats]
  mats = [jnp.swapaxes(m, 1, 2) if t else m for m, t in zip(mats, tall)]
  chunks = 1 if max_batch is None else -(-total // max(1, max_batch))
  per = -(-total // chunks)
  starts = [sum(sizes[:i]) for i in range(len(sizes))]
  # Unsigned, so that jax adds no wrap-around of negative indices.
  offsets = (tuple(jnp.uint32(o) for o in starts) if key is None
             else _xla.opaque_uints(starts, key))
  zero = jnp.uint32(0)
  dtype = (jnp.result_type(*mats) if ns_dtype is None
           else iteration_dtype(ns_dtype, mats[0]))
  buf = jnp.zeros((chunks * per,) + shape, dtype)
  for m, o in zip(mats, offsets):
    buf = jax.lax.dynamic_update_slice(buf, m.astype(dtype), (o, zero, zero))
  if chunks == 1:
    out = newton_schulz(buf, coeffs, steps, eps)
  else:
    out = jax.lax.map(lambda b: newton_schulz(b, coeffs, steps, eps),
                      buf.reshape((chunks, per) + buf.shape[1:])).reshape(buf.shape)
  back = [jax.lax.dynamic_slice(out, (o, zero, zero), m.shape) for m, o in zip(mats, offsets)]
  return [jnp.swapaxes(b, 1, 2) if t else b for b, t in zip(back, tall)]


# A shared iteration holds its float32 temporaries for every matrix of a chunk at
# once, where leaf-by-leaf calls each held their own: chunks hold up to the largest leaf
# of the shape (and at least this many elements), so the many small matrices of a model
# share one chunk while the peak stays that of its largest leaf.
MIN_SHARED_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class NewtonSchulzGroup(_second_moment.SharedGroup):
  """The leaves whose matrices one batched Newton-Schulz call orthogonalises
  (`Orthogonal.shared`): matrices of one wide `[R, C]` (R <= C) and one iteration.

  Attributes:
    wide: the matrices' `[R, C]`, turned wide (`wide`).
    iteration: what fixes the iteration besides the shape, `newton_schulz`'s arguments
      after the matrices: `(ns_coeffs, ns_steps, eps, ns_dtype)` for `Orthogonal`
      (`Orthogonal.iteration`), any leading part of it for an estimator of your own.
  """
  wide: tuple[int, int]
  iteration: tuple[Any, ...]

  def __str__(self) -> str:
    return str((self.wide, self.iteration))

  @property
  def item_size(self) -> int:  # type: ignore[override]
    return math.prod(self.wide)

  def hosts(self, other: _second_moment.SharedGroup) -> bool:
    """Smaller matrices of the same iteration, zero-padded: the same result per matrix."""
    return (isinstance(other, NewtonSchulzGroup) and other.iteration == self.iteration
            and self.wide[0] >= other.wide[0] and self.wide[1] >= other.wide[1])

  def run(self, operands: Sequence[jax.Array], key: jax.Array) -> list[jax.Array]:
    """One `newton_schulz_shared` in chunks of at most as many elements as the largest
    leaf (or `MIN_SHARED_ELEMENTS`)."""
    matrix = math.prod(padded_shape([m.shape for m in operands]))
    budget = max(MIN_SHARED_ELEMENTS, max(m.shape[0] * matrix for m in operands))
    return newton_schulz_shared(list(operands), *self.iteration,
                                max_batch=max(1, budget // matrix), key=key)

  def run_one(self, operand: jax.Array) -> jax.Array:
    return newton_schulz(operand, *self.iteration)


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
    Matrices sharded over their batch axes are iterated where they lie (`alone`)."""
    if type(self).update is not Orthogonal.update:
      return None
    mats, finish = self.prepare(x, step)
    group = NewtonSchulzGroup(wide(mats.shape), self.iteration)
    return _second_moment.Shared(mats, group, finish,
                                 alone=(_blocks.explicit_spec(mats) is not None
                                        or bool(_second_moment.varying_axes(mats))))

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
