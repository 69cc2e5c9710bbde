"""A large leaf's tier step, slice by slice over its first batch axis, in one loop.

`tier_leaf.update_leaf` runs a leaf too large to share a call (`tier_leaf.
MAX_SHARED_CALL_ELEMENTS`) through `in_slices` where the leaf's update can run that way.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.estimators import blocks as _blocks
from skewadam_jax.transforms import plan as _plan
from skewadam_jax.transforms import step_scalars as _step_scalars
from skewadam_jax.transforms.tier import Tier

# A leaf too large to share a call (`MAX_SHARED_CALL_ELEMENTS`) whose update can run
# slice by slice over its first batch axis does, in slices of at most this many
# elements (`in_slices`): as one piece, its update holds float32 temporaries of the
# whole leaf (the decoded momentum, the Newton-Schulz operand and iterate), which at the
# published 6.78B model's size (one expert bank: 2^31 elements) were 20 GiB a leaf;
# a slice of 2^27 elements holds about 2 GiB. Per slice the operations are the same.
# Each slice costs its kernels' launches: compiled for an H200, that model's
# `MUON_CODED_TIERS` update (bfloat16 Newton-Schulz) is 2,318 kernels in slices of
# 2^27 against 4,190 in slices of 2^26 (about 12 against 21 ms of launches), for a
# training step's peak of 23.3 GiB against 22.4 (benchmarks/gpu_compile.py).
LEAF_SLICE_ELEMENTS = 1 << 27


def in_slices(update_leaf: Callable[..., Any], tier: Tier, leaf: _plan.LeafPlan, b1: Any,
              b2: Any, eps: Any, g: jax.Array, mu: Any, present: Mapping[str, Any],
              t: jax.Array, scalars: _step_scalars.TierScalars, dtype: Any, path_key: Any
              ) -> Optional[tuple[jax.Array, dict[str, Any]]]:
  """`update_leaf(tier, leaf, b1, ...)` (`tier_leaf.update_leaf`) of a large leaf as a
  loop over slices of its first axis, or None where that is not known to give the same
  result.

  Batch axes index independent matrices (`Layout`), so the estimator and the codec
  bound to a slice's shape (`for_leaf`) serve each slice as the leaf's do, if the
  slice's update gives back state of the slice's shape, array for array, cut from the
  leaf's state on that axis (checked here on abstract shapes; a codec whose blocks span
  the axis stores fewer entries along it, and one that rounds at random draws per
  leaf: neither is sliced). Each slice's update is written over the gradient (when of
  the gradient's dtype) and its state over the old, slice by slice, in one loop. Not
  for a leaf whose placement is explicit, that varies inside `shard_map` or while a
  mesh is in context: a slice of a sharded axis would move data between devices.
  """
  codec = leaf.codec if tier.momentum else None
  layout = _second_moment.Layout.of(g.ndim, leaf.batch_axes)
  get_mesh = getattr(jax.sharding, 'get_abstract_mesh', None)  # jax >= 0.6
  mesh = None if get_mesh is None else get_mesh()
  if (0 not in layout.batch or (codec is not None and codec.needs_seed)
      or _blocks.explicit_spec(g) is not None or _second_moment.varying_axes(g)
      or (mesh is not None and not mesh.empty)):
    return None
  n = g.shape[0]
  state = (mu, dict(present))
  if not all(a.ndim and a.shape[0] == n for a in jax.tree.leaves(state)):
    return None
  item = g.size // n
  # The most matrices a slice of at most LEAF_SLICE_ELEMENTS holds that divide `n`.
  per = max(d for d in range(1, n + 1)
            if n % d == 0 and d * item <= max(item, LEAF_SLICE_ELEMENTS))
  if per == n:
    return None
  shape = (per,) + g.shape[1:]
  part = leaf._replace(
      shape=shape, estimator=tier.estimator.for_leaf(shape, layout.batch),
      codec=None if codec is None else tier.mu_codec.for_leaf(shape, layout.batch))
  u_dtype = g.dtype if dtype is None else jnp.dtype(dtype)

  def piece(i: jax.Array, g_: jax.Array, mu_: Any, present_: dict[str, Any]
            ) -> tuple[jax.Array, dict[str, Any]]:
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, i * per, per, 0)  # noqa: E731
    return update_leaf(tier, part, b1, b2, eps, cut(g_), jax.tree.map(cut, mu_),
                       {k: cut(v) for k, v in present_.items()}, t, scalars, dtype,
                       path_key=path_key)

  # The slices' update must give back the state it reads, slice for slice.
  u_c, new_c = jax.eval_shape(lambda *a: piece(jnp.int32(0), *a), g, mu, dict(present))
  want = jax.eval_shape(lambda: jax.tree.map(
      lambda a: jax.lax.dynamic_slice_in_dim(a, 0, per, 0), ({'mu': mu} if tier.momentum
                                                              else {}, dict(present))))
  got = ({k: v for k, v in new_c.items() if k == 'mu'},
         {k: v for k, v in new_c.items() if k != 'mu'})
  if (u_c.shape != shape or jax.tree.structure(got) != jax.tree.structure(want)
      or jax.tree.leaves(got) != jax.tree.leaves(want)):
    return None

  # The update of the gradient's dtype is written over the gradient (each slice is read
  # before it is written): the loop holds no buffer of the leaf's size of its own.
  in_place = u_dtype == g.dtype

  def body(i: jax.Array, carry: tuple[jax.Array, Any, dict[str, Any]]
           ) -> tuple[jax.Array, Any, dict[str, Any]]:
    u, mu_, present_ = carry
    u_i, new = piece(i, u if in_place else g, mu_, present_)
    put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, i * per, 0)  # noqa: E731
    return (put(u, u_i), jax.tree.map(put, mu_, new['mu']) if tier.momentum else mu_,
            {k: put(v, new[k]) for k, v in present_.items()})

  u = g if in_place else jnp.zeros_like(g, u_dtype)
  u, mu, present = jax.lax.fori_loop(0, n // per, body, (u, mu, dict(present)))
  return u, ({'mu': mu, **present} if tier.momentum else present)
