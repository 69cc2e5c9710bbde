"""Newton-Schulz: the iteration that orthogonalises matrices, alone or many in one call.

`newton_schulz` runs Muon's quintic iteration on a batch of `[R, C]` matrices (in
float32, or in bfloat16 with float32 accumulation: `iteration_dtype`);
`newton_schulz_shared` runs it on the matrices of several leaves as one batched call
(zero-padded to a common shape, which leaves each matrix's result unchanged), and
`NewtonSchulzGroup` is how `Orthogonal.shared` tells the tier which leaves may share
one. The estimator that uses it is `Orthogonal` (`estimators.orthogonal`).

References:
  Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024
  (https://kellerjordan.github.io/posts/muon/).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from skewadam_jax.core import checks as _checks
from skewadam_jax.core import xla as _xla
from skewadam_jax.estimators import base as _second_moment

# Muon's quintic Newton-Schulz coefficients (Jordan et al. 2024; optax's default).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# The dtypes a Newton-Schulz iteration can run in (`Orthogonal.ns_dtype`).
NS_DTYPES = ('auto', 'float32', 'bfloat16')
# Platforms (`jax.Device.platform`) whose matrix units multiply bfloat16 faster than
# float32: where `ns_dtype='auto'` iterates in bfloat16.
FAST_BFLOAT16_PLATFORMS = ('gpu', 'cuda', 'rocm', 'tpu')


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
  `X` is stored in bfloat16 and each step is `X <- (a I + A (b I + c A)) X`, `A = X X^T`:
  three products of bfloat16 operands, each accumulated in float32 and rounded to
  bfloat16 once, with the quintic's linear terms (`a X`, `b A`) summed inside the
  products rather than added to their rounded results; the norm is float32. Each step
  thus rounds its operands to 8 significant bits (relative error <= 2^-8 each); the
  factor stays within 0.1 of the float32 one in relative Frobenius norm and its
  singular values within 0.15, inside the spread the float32 iteration leaves around 1;
  tests/estimators/test_orthogonal.py states the bounds and why. Muon's reference code
  (each product rounded, then the sums in bfloat16) is further off (measured:
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
  """`newton_schulz` with bfloat16 operands and float32 accumulation (its docstring).

  Each step is `X <- (a I + A (b I + c A)) X` with `A = X X^T`: the quintic's
  `a X + (b A + c A A) X` with its linear terms folded into the products' operands, so
  that every sum is accumulated inside a product. Why: XLA:GPU does not fuse an
  elementwise epilogue (`a X + P X`, or a float32 product's rounding) into its matrix
  kernels, so the written-out iteration (float32 products, then sums and roundings)
  moved 268 bytes per matrix element over 5 steps against 136 for this form (square
  [512, 512] matrices, benchmarks/gpu_compile.py's counter), and 2x the temporaries.
  """
  a, b, c = coeffs
  transposed = x.shape[-2] > x.shape[-1]
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  f = x.astype(jnp.float32)
  norm = _xla.sqrt(jnp.sum(f * f, axis=(-2, -1), keepdims=True))
  x = _whole_matrices((f / (norm + eps)).astype(jnp.bfloat16))
  eye = jnp.eye(x.shape[-2], dtype=jnp.float32)
  for _ in range(steps):
    gram = _dot16(x, jnp.swapaxes(x, -1, -2))
    poly = _dot16(gram, (c * gram.astype(jnp.float32) + b * eye).astype(jnp.bfloat16))
    step = (poly.astype(jnp.float32) + a * eye).astype(jnp.bfloat16)
    x = _whole_matrices(_dot16(step, x))
  return jnp.swapaxes(x, -1, -2) if transposed else x


def _dot16(p: jax.Array, q: jax.Array) -> jax.Array:
  """`p @ q` of bfloat16 operands, rounded to bfloat16 once.

  Every XLA backend accumulates a bfloat16 product in float32 (the GPU's and TPU's
  matrix units, and XLA:CPU, which computes it in float32); `preferred_element_type`
  names the result's dtype, so the product writes bfloat16 where a float32 result
  would be written, read back and rounded by a kernel of its own.
  """
  return jnp.matmul(p, q, preferred_element_type=jnp.bfloat16)


def _whole_matrices(x: jax.Array) -> jax.Array:
  """`x` asked to be whole (replicated) on its two matrix axes under an Auto mesh.

  Under Auto axes XLA's propagation would otherwise keep the iterate sharded as its
  input was and gather it again for every Gram product, every iteration. The mesh
  must be in context (`jax.set_mesh`), which is also where the other axes stay XLA's
  choice; under Explicit axes `Orthogonal.prepare` already gathered the matrices, and
  with no mesh (or inside `shard_map`) there is nothing to ask.
  """
  if not auto_mesh_in_context():
    return x
  free = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - 2)
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*free, None, None))


def auto_mesh_in_context() -> bool:
  """Whether a mesh of Auto axes is in context (`jax.set_mesh`): where XLA, not the
  arrays' types, decides how the iteration's operands are laid out."""
  get_mesh = getattr(jax.sharding, 'get_abstract_mesh', None)  # jax >= 0.6
  mesh = None if get_mesh is None else get_mesh()
  return not (mesh is None or mesh.empty or not getattr(mesh, 'are_all_axes_auto', False))


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
  compiled iteration (`lax.map`; a single leaf that fills its chunks is the buffer
  itself, each chunk's result written over it), and each leaf's matrices are read
  back. Each matrix is normalised and iterated on its own, and zero rows and columns
  stay zero through the iteration (`X X^T` has them as zero rows and columns, so each
  product keeps the matrix's block), so the result is that of separate calls up to
  rounding; a zero matrix stays zero.

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
  alone = len(mats) == 1 and chunks * per == total
  if alone:  # one leaf in equal chunks: the leaf is the buffer, no zero-padded copy
    buf = mats[0].astype(dtype)
  else:
    buf = jnp.zeros((chunks * per,) + shape, dtype)
    for m, o in zip(mats, offsets):
      buf = jax.lax.dynamic_update_slice(buf, m.astype(dtype), (o, zero, zero))
  if chunks == 1:
    out = newton_schulz(buf, coeffs, steps, eps)
  elif alone:
    # Each chunk's result is written over the chunk it was read from: one buffer of the
    # leaf's size holds its matrices and then their results, where `lax.map` (its
    # stacked output apart) would hold two. (Only for one leaf: for the shared call of
    # the 128.7M-parameter model's update, XLA:GPU compiled this loop into 15 kernels
    # more than `lax.map`: 272 against 257, benchmarks/gpu_compile.py.)
    def chunk(i: jax.Array, b: jax.Array) -> jax.Array:
      start = (i * per).astype(jnp.uint32)
      x = jax.lax.dynamic_slice(b, (start, zero, zero), (per,) + shape)
      return jax.lax.dynamic_update_slice(b, newton_schulz(x, coeffs, steps, eps),
                                          (start, zero, zero))
    out = jax.lax.fori_loop(0, chunks, chunk, buf)
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
# ... and at most this many (unless one matrix is larger): a chunk's iteration holds
# about five chunk-sized float32 temporaries (the iterate, its Gram matrix and products),
# which for a whole expert bank of a large model would be several times the bank itself
# (the published 6.78B model's [128, 4096, 4096] banks: 8 GiB each in float32). 2^26
# elements (256 MiB in float32, four 4096 x 4096 matrices) still give every product of
# the iteration thousands of GPU blocks of work, so the chunks cost only loop trips.
MAX_CHUNK_ELEMENTS = 1 << 26


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
    leaf, within `MIN_SHARED_ELEMENTS` and `MAX_CHUNK_ELEMENTS`."""
    matrix = math.prod(padded_shape([m.shape for m in operands]))
    largest = max(m.shape[0] * matrix for m in operands)
    budget = max(MIN_SHARED_ELEMENTS, min(MAX_CHUNK_ELEMENTS, largest))
    return newton_schulz_shared(list(operands), *self.iteration,
                                max_batch=max(1, budget // matrix), key=key)

  def run_one(self, operand: jax.Array) -> jax.Array:
    return newton_schulz(operand, *self.iteration)
