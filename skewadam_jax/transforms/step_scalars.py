"""The functions of the step count that the tiers' leaves use, computed in one kernel.

Adam's bias corrections `1 - b^t`, their quotients and square roots are scalars, the same
for every leaf of a tier; `tier_scalars` computes those of all tiers of a step together
(see there why), and `tier_leaf.update_leaf` reads its tier's.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from skewadam_jax.core import checks as _checks
from skewadam_jax.core import xla as _xla
from skewadam_jax.transforms.tier import Tier


class TierScalars(NamedTuple):
  """The functions of the step count that one tier's leaves use (`tier_scalars`)."""
  bc2: jax.Array  # shape=(), float32: 1 - b2^t
  num_scale: jax.Array  # shape=(), float32: `Step.num_scale`
  bc1_scale: jax.Array  # shape=(), float32: `Step.bc1_scale`
  x_coeffs: tuple[jax.Array, jax.Array]  # shape=() each: Nesterov's x = c_m m + c_g g


def _vector(values: Sequence[Any]) -> jax.Array:
  """`values` (numbers, or scalars traced under `inject_hyperparams`) as a float32 vector:
  a constant when all are numbers."""
  if all(_checks.is_concrete_number(v) for v in values):
    return jnp.asarray(np.asarray([float(v) for v in values], np.float32))
  return jnp.stack([jnp.asarray(v, jnp.float32) for v in values])


def tier_scalars(tiers: Sequence[Tier], b1: Any, b2: Any, t: jax.Array
                 ) -> dict[int, TierScalars]:
  """Each tier's `TierScalars` at step `t` (float32), by `id(tier)`; `b1` for tiers
  whose own `b1` is None.

  The bias corrections and their quotients and roots are scalar operations that XLA
  will not fuse into several consumers (a power, a division or a root is too costly to
  recompute), so each one became a kernel of its own, with a compile cost of its own on
  XLA:CPU however small (measured:
  benchmarks/RESULTS.md, "Numbers behind the library's choices").
  Here every entry is one element of a single elementwise
  expression over a vector,

    e = (a x) / y,   x = 1 - b^t (or its square root, or 1),   y = 1 - c^(t + d) (or 1),

  with per-entry constants (or traced decays, under `inject_hyperparams`): one kernel
  for all of them, whose consumers only slice and multiply (the step of the example
  model compiled 5 kernels fewer with `MUON_CODED_TIERS`;
  tests/transforms/test_step_scalars.py checks that one fusion holds every power).
  """
  one, zero = 1.0, 0.0
  # Per entry: a, b, uses_b, root, c, d, uses_c.
  rows: list[tuple[Any, Any, bool, bool, Any, float, bool]] = [
      (one, b2, True, False, one, 0.0, False)]  # bc2
  index: dict[int, tuple[int, int, int, int]] = {}
  for tier in tiers:
    if id(tier) in index:
      continue
    b = b1 if tier.b1 is None else tier.b1  # a float, or traced (inject_hyperparams)
    floor = tier.eps_mode == 'floor'
    momentum = tier.momentum and not tier.nesterov  # Nesterov's x is corrected itself
    # num_scale: 1/bc1 with momentum, times sqrt(bc2) in floor mode; bc1_scale: 1/bc1.
    num_scale = (one, b2, floor, True, b, 0.0, momentum)
    bc1_scale = (one, zero, False, False, b, 0.0, momentum)
    # Nesterov (optax's form, the momentum corrected one step ahead, plus g):
    # x = b1 / (1 - b1^(t+1)) m + (1 - b1) / (1 - b1^t) g.
    c_m = (b, zero, False, False, b, 1.0, True)
    c_g = (1.0 - b, zero, False, False, b, 0.0, True)
    index[id(tier)] = tuple(range(len(rows), len(rows) + 4))  # type: ignore[assignment]
    rows += [num_scale, bc1_scale, c_m, c_g]
  a, b, uses_b, root, c, d, uses_c = (list(col) for col in zip(*rows))
  ones = np.ones(len(rows), np.float32)
  x = 1.0 - _vector(b) ** t
  x = jax.lax.select(np.asarray(root), _xla.sqrt(x), x)
  x = jax.lax.select(np.asarray(uses_b), x, ones)
  y = jax.lax.select(np.asarray(uses_c), 1.0 - _vector(c) ** (t + _vector(d)), ones)
  table = _vector(a) * x / y
  entry = [jax.lax.index_in_dim(table, i, keepdims=False) for i in range(len(rows))]
  return {k: TierScalars(entry[0], entry[i], entry[j], (entry[m], entry[n]))
          for k, (i, j, m, n) in index.items()}
