"""Leaves of one shape updated together: one stacked, vmapped estimator call per group.

An estimator's update of a small leaf is a handful of kernels on a GPU (row and column
reductions, the clip's reduction, the small vectors between them, the final pass), each
costing a launch (about 5 us on an H100 or H200) whatever the leaf's size. XLA fuses
elementwise work only within a leaf, so a model of many small matrices of a few shapes
(per-layer projections, norms) pays those launches per leaf. A `SecondMoment` that
declares `stacks` instead gets one call of `jax.vmap(update)` for every group of
leaves with equal estimator, step options, tier scalars, shapes and dtypes: the
gradients, numerators and statistics are stacked on a new leading axis inside the step
(the state keeps one entry per leaf), and every reduction of the group is one kernel.

  u_i, new_i = update(g_i, stats_i, x_i)   for each leaf i of a group    (as before)
  U, NEW = vmap(update)(stack(g), stack(stats), stack(x));  u_i = U[i], new_i = NEW[i]

Per item the operations are the same, but XLA may add a stacked reduction's terms in
another order: float32 rounding, within a few ulp of the leaf-by-leaf update
(tests/transforms/test_stacking.py). So the choice is made when the step is lowered: the CPU, where
a kernel costs no launch, runs each leaf alone, bitwise as without stacking; GPUs and
TPUs run the stacked call.

Only leaves of at most `MAX_STACKED_SIZE` elements stack: above it a leaf's kernels
stream memory for longer than a launch takes, and stacking costs traffic (XLA then
no longer fuses the momentum's update into the row reduction, one more read of the
gradient). Leaves that vary over a manual mesh axis (inside `shard_map`) update alone.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from skewadam_jax.estimators import base as _second_moment

# Measured on the 128.7M example tree compiled for an H200 (benchmarks/gpu_compile.py):
# stacking its three [128, 512, 512] expert banks saved one kernel of 16 and added
# 0.4 GB of traffic (a row reduction no longer fused with another pass), about 80 us
# at HBM bandwidth against 5 us of launch; its [512, 512] matrices save launches.
MAX_STACKED_SIZE = 1 << 20


class Stacked(NamedTuple):
  """A leaf's estimator update waiting to run stacked with the others of its group."""
  key: Any  # equal keys stack (`key_of`)
  estimator: _second_moment.SecondMoment
  static: _second_moment.Step  # the step without its traced scalars and path
  args: tuple[Any, Any, Any]  # (g, statistics, x) of the leaf
  scalars: tuple[Any, Any, Any]  # (bc2, num_scale, bc1_scale): the tier's, shared
  resume: Callable[[jax.Array, Any], Any]  # (u, new statistics) -> the leaf's result
  own: Callable[[], tuple[jax.Array, Any]]  # (u, new statistics) of the leaf alone


def _sharding(a: Any) -> Any:
  """The sharding in `a`'s type where it has one (so that leaves sharded differently
  do not stack, which would make XLA move data), else None."""
  try:
    return jax.typeof(a).sharding
  except (AttributeError, TypeError):
    return None


def stackable(estimator: _second_moment.SecondMoment, args: tuple[Any, Any, Any]) -> bool:
  """Whether a leaf with `args` (g, statistics, x) may stack: its estimator declares
  `stacks`, it is small (`MAX_STACKED_SIZE`) and it varies over no manual mesh axis."""
  g = args[0]
  if not estimator.stacks or g.size > MAX_STACKED_SIZE:
    return False
  return not any(_second_moment.varying_axes(a) for a in jax.tree.leaves(args))


def key_of(estimator: _second_moment.SecondMoment, static: _second_moment.Step,
           scalars: tuple[Any, Any, Any], args: tuple[Any, Any, Any]) -> Optional[Any]:
  """What leaves that stack share: the estimator and static step (hashable), the
  tier's scalars (the same arrays), and the arrays' structure, shapes, dtypes and
  shardings; None where the step cannot be a key (a hyperparameter given as a NumPy
  array is concrete but unhashable): that leaf updates on its own."""
  leaves, treedef = jax.tree.flatten(args)
  key = (estimator, static, tuple(id(s) for s in scalars), treedef,
         tuple((tuple(a.shape), jnp.dtype(a.dtype), _sharding(a)) for a in leaves))
  try:
    hash(key)
  except TypeError:
    return None
  return key


@functools.partial(jax.jit, static_argnums=(0, 1))
def _stacked_update(estimator: _second_moment.SecondMoment, static: _second_moment.Step,
                    g: jax.Array, stats: Any, x: jax.Array,
                    scalars: tuple[Any, Any, Any]) -> tuple[jax.Array, Any]:
  bc2, num_scale, bc1_scale = scalars
  step = static._replace(bc2=bc2, num_scale=num_scale, bc1_scale=bc1_scale)
  return jax.vmap(lambda g_, s_, x_: estimator.update(g_, s_, x_, step))(g, stats, x)


def by_platform(*operands: Any, cpu: Callable[..., Any], default: Callable[..., Any]
                ) -> Any:
  """`cpu(*operands)` where the step is lowered for the CPU, `default(*operands)`
  elsewhere (`jax.lax.platform_dependent`: XLA sees only the branch it runs)."""
  return jax.lax.platform_dependent(*operands, cpu=cpu, default=default)


def _alone(items: list[Stacked]) -> list[tuple[jax.Array, Any]]:
  """The estimator's results of `items`, each leaf on its own (as without stacking)."""
  return [o.own() for o in items]


def _stacked(first: Stacked, own: Any, args: list[tuple[Any, Any, Any]],
             scalars: tuple[Any, Any, Any]) -> list[tuple[jax.Array, Any]]:
  """The estimator's results of a group's leaves (`args` each) from one vmapped call
  (`own`, the leaf-by-leaf results, unused: the CPU's branch)."""
  del own
  g, stats, x = jax.tree.map(lambda *a: jnp.stack(a), *args)
  # The old statistics read by one kernel: the new ones are written in place of the
  # donated old ones, and XLA copies an old statistic first where two kernels read it
  # (one copy kernel per leaf).
  stats = jax.lax.optimization_barrier(stats)
  u, new = _stacked_update(first.estimator, first.static, g, stats, x, scalars)
  return [(u[j], jax.tree.map(lambda a, j=j: a[j], new)) for j in range(len(args))]


def run(out: list[Any]) -> list[Any]:
  """`out` with every `Stacked` entry replaced by its leaf's result: one vmapped call
  per group of two or more where the step is lowered for a GPU (or any platform but the
  CPU), each leaf on its own on the CPU.

  XLA:CPU runs each leaf alone, as without stacking: a CPU kernel costs no launch, and a
  stacked reduction may add its terms in another order (float32 rounding:
  tests/transforms/test_stacking.py bounds it), so on the CPU the results stay bitwise those of the
  leaf-by-leaf update. The leaves' own calls are traced for every platform (a platform
  that runs the stacked call drops them as dead code).
  """
  out = list(out)
  groups: dict[Any, list[int]] = {}
  for i, o in enumerate(out):
    if isinstance(o, Stacked):
      groups.setdefault(o.key, []).append(i)
  for idx in groups.values():
    items = [out[i] for i in idx]
    results = _alone(items)
    if len(idx) > 1:
      try:
        results = by_platform(results, [o.args for o in items], items[0].scalars,
                              cpu=lambda own, args, scalars: own,
                              default=functools.partial(_stacked, items[0]))
      except (ValueError, TypeError, NotImplementedError):
        pass  # each leaf on its own: what the estimator cannot do stacked
    for i, o, (u, new) in zip(idx, items, results):
      out[i] = o.resume(u, new)
  return out
