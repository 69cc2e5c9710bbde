"""Workarounds for XLA:CPU's fusion decisions, applied only when compiling for the CPU.

On XLA:CPU an elementwise producer shared by two consumers (a reduction and the final
elementwise pass, or two reductions) is materialised as a full-size temporary, and a
reduction of a reduction is fused into one slow kernel. An optimisation barrier and an
exact `reduce_precision` prevent both. The opposite case: a value that is materialised
anyway (a reduction reads it) is also recomputed inside every other consumer's kernel,
which makes those kernels larger and slower to compile; a conditional that XLA cannot
resolve keeps them reading it from memory (`cpu_materialize`). On GPUs XLA fuses such
producers into each consumer (multi-output fusion) without a temporary, and the
barriers only split kernels (more launches, more bytes, longer compiles), so there they
are left out.

The choice is made when the step is lowered for its platform, as
`jax.lax.platform_dependent` does, but with identity primitives that have a CPU
lowering of their own: tracing one costs a single `bind`, where `platform_dependent`
traces both branches into a conditional at every call site (its tracing time on a
32-layer MoE tree: benchmarks/RESULTS.md, "Numbers behind the library's choices").
"""

from __future__ import annotations

import functools
from typing import Any, Sequence, TypeVar

import jax
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

T = TypeVar('T')


def _identity_lowering(ctx: Any, *args: Any) -> Sequence[Any]:
  del ctx
  return list(args)


@functools.cache
def _primitives() -> tuple[Any, Any, Any]:
  """The primitives, made and registered when the first step is traced.

  Not at import: `jax.extend` imports all of its submodules, Pallas among them, which
  made up about half of what `import skewadam_jax` added to `import jax, optax`.
  """
  from jax.extend.core import Primitive

  barrier_p = Primitive('skewadam_cpu_barrier')
  barrier_p.multiple_results = True
  barrier_p.def_impl(lambda *xs: list(xs))
  barrier_p.def_abstract_eval(lambda *avals: list(avals))
  mlir.register_lowering(barrier_p, _identity_lowering)
  mlir.register_lowering(
      barrier_p, mlir.lower_fun(lambda *xs: list(jax.lax.optimization_barrier(xs)),
                                multiple_results=True), platform='cpu')
  batching.primitive_batchers[barrier_p] = lambda args, dims: (barrier_p.bind(*args), dims)
  ad.primitive_jvps[barrier_p] = lambda primals, tangents: (barrier_p.bind(*primals),
                                                            list(tangents))

  exact_f32_p = Primitive('skewadam_cpu_fusion_boundary')
  exact_f32_p.def_impl(lambda x: x)
  exact_f32_p.def_abstract_eval(lambda aval: aval)
  mlir.register_lowering(exact_f32_p, lambda ctx, x: [x])
  mlir.register_lowering(
      exact_f32_p, mlir.lower_fun(
          lambda x: jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23),
          multiple_results=False), platform='cpu')
  batching.primitive_batchers[exact_f32_p] = lambda args, dims: (exact_f32_p.bind(*args),
                                                                 dims[0])
  ad.primitive_jvps[exact_f32_p] = lambda primals, tangents: (exact_f32_p.bind(*primals),
                                                              tangents[0])
  materialize_p = Primitive('skewadam_cpu_materialize')
  materialize_p.def_impl(lambda x, key: x)
  materialize_p.def_abstract_eval(lambda aval, key: aval)
  mlir.register_lowering(materialize_p, lambda ctx, x, key: [x])
  mlir.register_lowering(materialize_p, mlir.lower_fun(_through_conditional,
                                                       multiple_results=False),
                         platform='cpu')

  def materialize_batched(args: Sequence[Any], dims: Sequence[Any]) -> tuple[Any, Any]:
    x, key = args
    if dims[1] is not None:  # a batched key is no scalar predicate: `x` as it is
      return x, dims[0]
    return materialize_p.bind(x, key), dims[0]

  batching.primitive_batchers[materialize_p] = materialize_batched
  ad.primitive_jvps[materialize_p] = lambda primals, tangents: (materialize_p.bind(*primals),
                                                                tangents[0])
  return barrier_p, exact_f32_p, materialize_p


def _through_conditional(x: jax.Array, key: jax.Array) -> jax.Array:
  """`x` out of a conditional whose predicate, `key != key`, is false unless `key` is
  NaN, and whose branches return one or the other of two operands that are both `x`:
  XLA cannot fold it, and no fusion crosses it."""
  return jax.lax.cond(key != key, lambda a, b: b, lambda a, b: a, x, x)


def cpu_barrier(tree: T) -> T:
  """`jax.lax.optimization_barrier(tree)` on the CPU, `tree` unchanged elsewhere."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, _primitives()[0].bind(*leaves))


def cpu_fusion_boundary(x: jax.Array) -> jax.Array:
  """`x` (float32) computed by its own kernel on the CPU; `x` unchanged elsewhere.

  XLA:CPU fuses a reduction of `x` into the reduction that produced it, and the fused
  kernel runs slower than the two separate reductions (measured:
  benchmarks/RESULTS.md, "Numbers behind the library's choices").
  An optimisation barrier does not stop that fusion;
  `reduce_precision` to float32's own exponent and mantissa widths is an exact identity
  that the fused kernel cannot contain, so it does.
  """
  return _primitives()[1].bind(x)


def cpu_materialize(x: jax.Array, key: jax.Array) -> jax.Array:
  """`x`, written to memory once on the CPU and read from there by each consumer; `x`
  unchanged elsewhere.

  XLA fuses an elementwise producer into each of its consumers, recomputing it in every
  consumer's kernel, even when it is also written to memory for a consumer that
  cannot fuse it (a reduction). A coded momentum's update (decode, moving average) is
  such a producer: read by the block absmax, the encoding and the update, it was
  recomputed, with the unpacking of its codes, inside the encoding kernel, whose
  generated code it doubled. On the CPU `x` passes through a conditional that XLA cannot
  resolve (`key != key`, false unless `key` is NaN) and no fusion crosses, so every
  consumer reads the one stored `x`: fewer kernels and less generated code, no more
  temporaries (measured: see benchmarks/RESULTS.md).

  Args:
    x: any array.
    key: a float32 scalar known only at run time that is never NaN (a step count).

  Returns:
    `x`.
  """
  return _primitives()[2].bind(x, key)


def opaque_uints(values: Sequence[int], key: jax.Array) -> tuple[jax.Array, ...]:
  """The integers `values` as uint32 scalars that XLA cannot fold into constants.

  XLA compiles one kernel per distinct fused computation, and a constant inside a
  kernel (a leaf's offset into a shared buffer, a hash of its path) makes the kernel of
  every leaf distinct, though they differ in nothing else (measured: see
  benchmarks/RESULTS.md). Here the values come out of a conditional whose
  predicate, `key != key`, is false for every `key` that is not NaN, but which XLA
  cannot decide while compiling; the other branch (the values reversed, never taken)
  keeps XLA from merging the two. Should a compiler fold the predicate anyway, it folds
  it to false: the values are right either way.

  Args:
    values: non-negative integers below 2**32.
    key: a float32 scalar known only at run time that is never NaN (a step count).

  Returns:
    `values` as a tuple of uint32 scalars.
  """
  consts = tuple(jax.numpy.uint32(v) for v in values)
  if not consts:
    return ()
  return tuple(jax.lax.cond(key != key, lambda: consts[::-1], lambda: consts))


# Up to this many elements `sqrt` and `rsqrt` are computed as `power` (below).
SMALL_ELEMENTS = 1 << 16


def sqrt(x: jax.Array) -> jax.Array:
  """`sqrt(x)`; as `x ** 0.5` when `x` has at most `SMALL_ELEMENTS` elements.

  XLA leaves `power` with a constant exponent as it is, while `sqrt` and `rsqrt` (which
  `a / sqrt(b)` becomes) make every kernel that holds them two to five times costlier to
  compile, where `power` costs what a plain multiply-add does (`benchmarks/compile_time.py
  --kernel-cost`; the figures: see benchmarks/RESULTS.md). An optimizer's statistics
  vectors, per-matrix norms and small leaves (norm scales, routers) are many distinct
  kernels of little work. `tests/core/test_xla.py` holds the powers within 2 ulp of float64.
  At run time `pow` is slower per element than `rsqrt` on the CPU, so large operands
  keep `sqrt`.
  """
  return x ** 0.5 if _small(x) else jax.numpy.sqrt(x)


def rsqrt(x: jax.Array) -> jax.Array:
  """`1 / sqrt(x)`; as `x ** -0.5` when `x` is small (see `sqrt`)."""
  return x ** -0.5 if _small(x) else jax.lax.rsqrt(x)


def _small(x: jax.Array) -> bool:
  """Whether `sqrt` and `rsqrt` compute `x`'s roots as powers."""
  return x.size <= SMALL_ELEMENTS
