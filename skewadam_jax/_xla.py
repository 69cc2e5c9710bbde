"""Workarounds for XLA:CPU's fusion decisions, applied only when compiling for the CPU.

On XLA:CPU an elementwise producer shared by two consumers (a reduction and the final
elementwise pass, or two reductions) is materialised as a full-size temporary, and a
reduction of a reduction is fused into one slow kernel. An optimisation barrier and an
exact `reduce_precision` prevent both. On GPUs XLA fuses such producers into each
consumer (multi-output fusion) without a temporary, and the barriers would only split
kernels (more launches, longer compiles), so there they are left out:
`jax.lax.platform_dependent` resolves the choice when the step is lowered, and the
compiled program contains only the branch of its platform.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax

T = TypeVar('T')


def _identity(x: T) -> T:
  return x


def _exact_f32(x: jax.Array) -> jax.Array:
  return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23)


def cpu_barrier(tree: T) -> T:
  """`jax.lax.optimization_barrier(tree)` on the CPU, `tree` unchanged elsewhere."""
  return jax.lax.platform_dependent(tree, cpu=jax.lax.optimization_barrier,
                                    default=_identity)


def cpu_fusion_boundary(x: Any) -> Any:
  """`x` (float32) computed by its own kernel on the CPU; `x` unchanged elsewhere.

  XLA:CPU fuses a reduction of `x` into the reduction that produced it, and the fused
  kernel runs 1.5-10x slower than the two separate reductions (measured on
  [128, 512, 512] and [50304, 512]). An optimisation barrier does not stop that fusion;
  `reduce_precision` to float32's own exponent and mantissa widths is an exact identity
  that the fused kernel cannot contain, so it does.
  """
  return jax.lax.platform_dependent(x, cpu=_exact_f32, default=_identity)
