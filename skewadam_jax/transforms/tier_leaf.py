"""One leaf under one tier: its initial state and its step, as its plan says.

`tiers.scale_by_tiers` runs these per parameter, each with the leaf's `plan.LeafPlan`
(its estimator, codec, batch axes and abstract state). What an estimator or codec gets
here it gets through its protocol (`per_shape`, `shared`), never by its type.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from skewadam_jax.core import checks as _checks
from skewadam_jax.core import xla as _xla
from skewadam_jax.estimators import blocks as _blocks
from skewadam_jax.estimators import codec as _codec
from skewadam_jax.estimators import base as _second_moment
from skewadam_jax.core import tree as _tree

from skewadam_jax.transforms import plan as _plan
from skewadam_jax.transforms import stacking as _stacking
from skewadam_jax.transforms import step_scalars as _step_scalars
from skewadam_jax.transforms import tier_slices as _tier_slices
from skewadam_jax.transforms.tier import Tier

FIELDS = ('mu',) + _second_moment.STAT_FIELDS  # the per-parameter fields of the state


def leaf_estimator(shape: tuple[int, ...], tier: Tier, batch_axes: Any = None,
                   path: str = 'leaf') -> _second_moment.SecondMoment:
  """The second-moment estimator a leaf of `shape` with `batch_axes` gets under `tier`."""
  shape = tuple(shape)
  return tier.estimator.for_leaf(shape, _plan.normal_axes(batch_axes, shape, path))


def leaf_codec(shape: tuple[int, ...], tier: Tier, batch_axes: Any = None,
               path: str = 'leaf') -> Optional[_codec.StateCodec]:
  """The codec a leaf of `shape` with `batch_axes` stores its momentum with (None: an
  array of `tier.mu_dtype`, also where the codec leaves the leaf uncoded, e.g. under
  `Blockwise(min_size=...)`)."""
  if tier.mu_codec is None:
    return None
  shape = tuple(shape)
  return tier.mu_codec.for_leaf(shape, _plan.normal_axes(batch_axes, shape, path))


def init_leaf(tier: Tier, leaf: _plan.LeafPlan, p: Any) -> dict[str, Any]:
  """A leaf's state under `tier`, as `leaf` plans it: its momentum (if the tier keeps
  one) and statistics, by field name (`FIELDS`); fields the leaf does not keep are
  absent."""
  path = leaf.path
  p = _tree.as_array(p)  # a Python scalar leaf is a 0-d array, as in optax
  _checks.check_float_leaf(path, p.dtype, 'scale_by_tiered_adam')
  if leaf.problem is not None and leaf.problem[0] == 'decide':
    raise leaf.problem[1]
  estimator, codec = leaf.estimator, leaf.codec
  if codec is not None:  # init refuses a leaf the codec does not fit, naming it
    mu = codec.init(p, path)
  else:
    mu = jnp.zeros_like(p, dtype=tier.mu_dtype) if tier.momentum else None
  stats = dict(estimator.init(p, path))
  _checks.check_estimator_init(estimator, path, stats, _second_moment.STAT_FIELDS)
  return {'mu': mu, **stats} if tier.momentum else stats


def as_stored(stored: Any, expected: Any) -> Any:
  """A coded momentum in the structure its codec made (`expected`, abstract).

  `nnx.Optimizer` writes each new state back through `nnx.state`, which turns a pytree
  held in a Variable (the codec's `Coded` NamedTuple) into an `nnx.State` of its fields;
  the arrays are the same, so they are put back by field name (or in order).
  """
  if jax.tree.structure(stored) == jax.tree.structure(expected):
    return stored
  fields = getattr(type(expected), '_fields', None)
  if fields is not None and isinstance(stored, Mapping) and set(stored) == set(fields):
    return type(expected)(**{k: stored[k] for k in fields})
  leaves = jax.tree.leaves(stored)
  if len(leaves) == jax.tree.structure(expected).num_leaves:
    return jax.tree.structure(expected).unflatten(leaves)
  return stored  # the shape check names what differs


def _hashable(x: Any) -> bool:
  """Whether `x` can key a cache (an `lru_cache`, a jit's static argument)."""
  try:
    hash(x)
  except TypeError:
    return False
  return True


def check_grad(tier: Tier, leaf: _plan.LeafPlan, g: jax.Array, param: Any,
               row: Mapping[str, Any]) -> dict[str, Any]:
  """Raises unless gradient `g` fits its leaf's state (and parameter, if given); else
  returns the state the update uses: the statistics it keeps (and a coded momentum).

  `leaf` is the plan of the gradient (`plan.plan_leaves` of the updates): the
  estimator, codec and abstract state a parameter of the gradient's shape gets. Shapes
  are static, so the checks run once, at trace time; without them a gradient of
  another shape (e.g. [256, 1] for a [256, 64] parameter) would broadcast against the
  state into a full-size update. The gradient is checked against its parameter (if
  `params` are given), its momentum (if kept) and the statistics its estimator makes
  for a parameter of the gradient's shape.
  """
  path, shape = leaf.path, tuple(g.shape)
  if param is not None:
    _checks.check_grad_shape(path, shape, _tree.abstract_leaf(param).shape, 'the parameter')
  stage, error = leaf.problem if leaf.problem is not None else (None, None)
  coded = tier.momentum and tier.mu_codec is not None
  if coded and (stage == 'mu' or stage == 'decide'):
    _checks.check_grad_fits_stats(path, shape, {'mu': row['mu']}, None, error)
    raise error
  codec = leaf.codec if coded else None
  if tier.momentum and codec is None:
    if hasattr(row['mu'], 'shape'):
      _checks.check_grad_shape(path, shape, row['mu'].shape, 'its momentum')
    else:  # e.g. codes where this codec keeps a small leaf in float32
      _checks.check_grad_fits_stats(path, shape, {'mu': row['mu']},
                                    {'mu': jax.ShapeDtypeStruct(shape, tier.mu_dtype)})
  elif tier.momentum:
    expected = leaf.state['mu']
    row = {**row, 'mu': as_stored(row['mu'], expected)}
    _checks.check_grad_fits_stats(path, shape, {'mu': row['mu']}, {'mu': expected})
  present = {k: row[k] for k in _second_moment.STAT_FIELDS if row.get(k) is not None}
  if error is not None:  # e.g. batch axes out of range for `g`'s rank
    _checks.check_grad_fits_stats(path, shape, present, None, error)
    raise error
  _checks.check_grad_fits_stats(path, shape, present, {
      k: v for k, v in leaf.state.items() if k in _second_moment.STAT_FIELDS})
  if codec is not None:
    present = {'mu': row['mu'], **present}
  return present


def path_hash(path: str) -> int:
  """The hash of a leaf's path that its stochastic codec's seeds start from."""
  return zlib.crc32(path.encode())


def codec_path_hashes(leaf_tiers: list[Tier], paths: list[str], t: jax.Array
                      ) -> dict[int, jax.Array]:
  """`path_hash` of each leaf (by index) whose tier's codec draws random numbers, as
  runtime values (`core.xla.opaque_uints`): a hash folded into the encoding kernel as a
  constant makes it a kernel of its own for every leaf; as a runtime value, the leaves
  of one shape share one compiled kernel. (A hash no leaf uses, e.g. of a leaf that does
  not train, is dropped by XLA.)"""
  index = [i for i, tier in enumerate(leaf_tiers)
           if tier.momentum and tier.mu_codec is not None and tier.mu_codec.needs_seed]
  return dict(zip(index, _xla.opaque_uints([path_hash(paths[i]) for i in index], t)))


def _codec_seed(t: jax.Array, path_key: Any) -> jax.Array:
  """The seed (uint32) of a stochastic codec at step `t` for the leaf whose
  `path_hash` is `path_key`: a function of both only, so that a run resumed from a
  checkpoint draws what the uninterrupted run drew, and leaves of one shape draw
  different numbers."""
  step = _blocks.fmix32(t.astype(jnp.uint32) + jnp.uint32(0x9E3779B9))
  return _blocks.fmix32(step ^ jnp.asarray(path_key, jnp.uint32))


def _coded_momentum(codec: _codec.StateCodec, b1: Any, stored: Any, g: jax.Array,
                    t: jax.Array, seed: Optional[jax.Array]) -> tuple[jax.Array, Any]:
  m = b1 * codec.decode(stored) + (1.0 - b1) * g.astype(jnp.float32)
  # Stored once: the encoding's scales (a reduction: Blockwise's absmax) read it, so it is
  # written to memory anyway, and the encoding and the update read it from there (on the
  # CPU XLA would recompute it, with the decode, inside the encoding kernel).
  m = _xla.cpu_materialize(m, t)
  return m, (codec.encode(m) if seed is None else codec.encode(m, seed))


# A model repeats few shapes: as a jitted function of the (static) codec, the decode,
# moving average and encode are traced and lowered once per codec and shape and called
# for each leaf (XLA inlines the calls, so the compiled program is the same).
_coded_momentum_jit = jax.jit(_coded_momentum, static_argnums=(0,))


def coded_momentum(codec: _codec.StateCodec, b1: Any, stored: Any, g: jax.Array,
                   t: jax.Array, seed: Optional[jax.Array] = None
                   ) -> tuple[jax.Array, Any]:
  """The new float32 momentum `m = b1 decode(stored) + (1 - b1) g` and its encoding
  (with `seed` for a codec that rounds stochastically); `t`: the step count (float32)."""
  # A user codec that is not hashable cannot key the jit's cache: traced per leaf.
  run = _coded_momentum_jit if _hashable(codec) else _coded_momentum
  return run(codec, b1, stored, g, t, seed)


class Deferred(NamedTuple):
  """A leaf's update waiting for work it shares with other leaves (`SecondMoment.shared`)."""
  shared: _second_moment.Shared  # the leaf's operand, its group and how it finishes
  resume: Callable[[jax.Array], tuple[jax.Array, dict[str, Any]]]  # result -> update, state


def update_leaf(tier: Tier, leaf: _plan.LeafPlan, b1: Any, b2: Any, eps: Any,
                g: jax.Array, mu: Any, present: Mapping[str, Any], t: jax.Array,
                scalars: _step_scalars.TierScalars, dtype: Any = None, defer: bool = False,
                path_key: Any = None
                ) -> Union[tuple[jax.Array, dict[str, Any]], Deferred, _stacking.Stacked]:
  """A leaf's update under `tier` (`t` the step count after it, as a float32; `scalars`
  its tier's `step_scalars.tier_scalars`), in `dtype` (default the gradient's;
  `per_leaf.update_dtype`), and its new state (field name -> array; a coded momentum as
  its codec stores it), with the estimator and codec of its plan `leaf`. `path_key`: the
  leaf's `path_hash` as `codec_path_hashes` gives it (None: computed here, a constant).

  With `defer`, a leaf whose estimator shares work (`SecondMoment.shared`, e.g. the
  Newton-Schulz iteration of `Orthogonal`) returns a `Deferred` instead, and one whose
  estimator `stacks` a `stacking.Stacked`, which `resolve` completes together with the
  others of its group."""
  # Every full-size array below is either an input, a state output or computed inside
  # the one fused pass that also applies the update: statistics come from reductions
  # over the stored arrays, and nothing of the leaf's size is materialised in between
  # (but a coded momentum's `m`, which its absmax reads anyway: `coded_momentum`).
  path, estimator = leaf.path, leaf.estimator
  # A leaf of an estimator that shares work (it declares `shared`), too large to share a
  # call (`shared_calls`), also keeps its elementwise work to itself: its gradient and
  # step scalars pass a barrier of their own, or XLA:GPU fuses the same elementwise steps
  # of several such leaves into one kernel (they read the same step scalars), whose
  # outputs (each a float32 copy of its leaf) are then alive at once. Where it can, it
  # runs in slices (`tier_slices.in_slices`). Other estimators' updates stream their leaf
  # in one fused pass and are left as they are.
  alone = (defer and g.size > MAX_SHARED_CALL_ELEMENTS
           and type(estimator).shared is not _second_moment.SecondMoment.shared)
  if alone:
    g, t, scalars = jax.lax.optimization_barrier((g, t, scalars))
    sliced = _tier_slices.in_slices(update_leaf, tier, leaf, b1, b2, eps, g, mu, present, t,
                                    scalars, dtype, path_key)
    if sliced is not None:
      return sliced
  codec = leaf.codec if tier.momentum else None
  if codec is not None:
    # Decoded, updated and encoded within the step: the float32 momentum `m` lives only
    # inside it, and the update is computed from `m` itself (as 8-bit Adam does), so the
    # codes' error enters through the next step's decode only.
    seed = None
    if codec.needs_seed:
      seed = _codec_seed(t, path_hash(path) if path_key is None else path_key)
    mu, stored = coded_momentum(codec, b1, mu, g, t, seed)
    if alone:  # encoded before the update's own float32 work: the codes' temporaries
      # are gone before that starts (a leaf not run in slices; the 6.78B step planned
      # 38.1 against 43.6 GiB with it while its expert banks were not).
      mu, stored, g = jax.lax.optimization_barrier((mu, stored, g))
  elif tier.momentum:
    mu = (b1 * mu.astype(jnp.float32) + (1.0 - b1) * g.astype(jnp.float32)).astype(mu.dtype)
  if tier.nesterov:
    # optax's Nesterov form: the momentum corrected one step ahead, plus the gradient.
    c_m, c_g = scalars.x_coeffs
    x = c_m * mu.astype(jnp.float32) + c_g * g.astype(jnp.float32)
  elif tier.momentum:
    x = mu  # the stored (cast) momentum: no defensive copy of the uncast one
  else:
    x = g
  step = _second_moment.Step(
      b2=b2, bc2=scalars.bc2, eps=eps, num_scale=scalars.num_scale,
      floor=tier.eps_mode == 'floor', clip=tier.clip_threshold, x_is_grad=not tier.momentum,
      path=path, bc1_scale=scalars.bc1_scale)

  def end(u: jax.Array, new: Mapping[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
    _checks.check_estimator_update(estimator, path, tuple(g.shape), u, present, new)
    if tier.lr_scale != 1.0:
      u = u * tier.lr_scale
    state = stored if codec is not None else mu
    return u.astype(g.dtype if dtype is None else dtype), (
        {'mu': state, **new} if tier.momentum else dict(new))

  if estimator.reduces_matrices or tier.clip_threshold is not None:  # inside shard_map
    _second_moment.check_whole_matrices(path, (g, x), _second_moment.Layout.of(
        g.ndim, leaf.batch_axes),
        f'its {estimator.name} update' if estimator.reduces_matrices else 'its RMS clip')
  if defer:
    shared = estimator.shared(x, step)
    if shared is not None:
      if shared.alone:  # e.g. a sharded batch: its work runs where it lies
        return end(shared.finish(shared.group.run_one(shared.operand)), {})
      return Deferred(shared, lambda o: end(shared.finish(o), {}))
  cached = (estimator.per_shape and _hashable(estimator) and _checks.is_concrete_number(step.b2)
            and _checks.is_concrete_number(step.eps))  # not traced (inject_hyperparams)
  static = step._replace(path='', bc2=None, num_scale=None, bc1_scale=None)
  step_scalars = (step.bc2, step.num_scale, step.bc1_scale)

  def own() -> tuple[jax.Array, Any]:  # the estimator's update of this leaf alone
    if cached:
      try:
        return _cached_update(estimator, static, g, dict(present), x, step_scalars)
      except (ValueError, TypeError):  # raised again below, naming the leaf
        pass
    return estimator.update(g, present, x, step)

  args = (g, dict(present), x)
  key = (_stacking.key_of(estimator, static, step_scalars, args)
         if defer and cached and _stacking.stackable(estimator, args) else None)
  if key is not None:
    return _stacking.Stacked(key, estimator, static, args, step_scalars, end, own)
  return end(*own())


# An update that depends on shapes and static options only (`SecondMoment.per_shape`)
# is, as a jitted function, traced and lowered once per shape, not once per leaf (a
# model repeats few shapes; XLA inlines the calls, so the program is the same).
@functools.partial(jax.jit, static_argnums=(0, 1))
def _cached_update(estimator: _second_moment.SecondMoment, static: _second_moment.Step,
                   g: jax.Array, present: dict[str, Any], x: jax.Array,
                   scalars: tuple[jax.Array, jax.Array, Any]) -> tuple[jax.Array, Any]:
  bc2, num_scale, bc1_scale = scalars
  return estimator.update(g, present, x, static._replace(bc2=bc2, num_scale=num_scale,
                                                         bc1_scale=bc1_scale))


# Items of a smaller group join the call of a group that `hosts` them (e.g. matrices
# zero-padded to a larger shape: the same result) when they add at most this share to
# its items: each padded item costs the work of a larger one, and a group of its own
# costs a compiled call (for Newton-Schulz about a dozen XLA kernels) for a few items.
MAX_PADDED_SHARE = 1 / 8


# A shared call holds every leaf it takes alive at once, in one buffer of all their
# items (`SharedGroup.run`), where leaves run one by one each hold only their own: XLA
# cannot retire a leaf's gradient (nor run its update within the backward pass) before
# the call has them all. Sharing pays for many small leaves (one compiled call instead
# of one per leaf); a leaf as large as this budget launches its kernels once anyway.
# So a call takes leaves up to this many elements (items x `item_size`), and a leaf
# larger than that is a call of its own: at the published 6.78B model's size the
# Newton-Schulz leaves (three [128, 4096, 4096] expert banks and the backbone's
# 4096 x 4096 matrices) shared one float32 buffer of 25 GiB. 2^27 elements (512 MiB in
# float32) hold every hidden and expert matrix of a 128M-parameter model in one call.
MAX_SHARED_CALL_ELEMENTS = 1 << 27


def shared_calls(groups: list[_second_moment.SharedGroup], counts: list[int]
                 ) -> list[list[int]]:
  """Which leaves share a call: indices into `groups` grouped by equal group, split
  into calls of at most `MAX_SHARED_CALL_ELEMENTS` elements (a larger leaf alone), then
  each group of one call moved into the call of the largest group that `hosts` it, if
  its items (`counts` per leaf) are at most `MAX_PADDED_SHARE` of that call's own."""
  members: dict[Any, list[list[int]]] = {}
  for i, k in enumerate(groups):
    calls = members.setdefault(k, [[]])
    elements = k.item_size * sum(counts[j] for j in calls[-1])
    if calls[-1] and elements + k.item_size * counts[i] > MAX_SHARED_CALL_ELEMENTS:
      calls.append([])
    calls[-1].append(i)
  size = {k: sum(counts[i] for c in calls for i in c) for k, calls in members.items()}
  # Largest items first: a host is never itself moved into another.
  order = sorted(members, key=lambda k: (-k.item_size, -size[k], str(k)))
  hosts: list[tuple[Any, int, list[int]]] = []  # (group, its own items, the call)
  for k in order:
    calls = members[k]
    fits = [c for h, own, c in hosts
            if len(calls) == 1 and h.hosts(k) and size[k] <= MAX_PADDED_SHARE * own
            and (own + size[k]) * h.item_size <= MAX_SHARED_CALL_ELEMENTS]
    if fits:
      fits[0].extend(calls[0])
    else:
      hosts.extend((k, sum(counts[i] for i in c), c) for c in calls)
  return [sorted(c) for _, _, c in hosts]


def resolve(out: list[Any], t: jax.Array) -> list[tuple[jax.Array, dict[str, Any]]]:
  """`out` with every `Deferred` completed: the leaves of one group (and of the smaller
  groups `shared_calls` puts with it) share one `group.run` of the host group, instead
  of one call per leaf; the same operations per item. `t`: the step count (float32),
  which keeps per-leaf offsets runtime values (`SharedGroup.run`'s key). Leaves whose
  estimator `stacks` run first, one vmapped call per group (`stacking.run`)."""
  out = _stacking.run(out)
  deferred = [i for i, o in enumerate(out) if isinstance(o, Deferred)]
  calls = shared_calls([out[i].shared.group for i in deferred],
                       [out[i].shared.operand.shape[0] for i in deferred])
  out = list(out)
  for call in calls:
    idx = [deferred[j] for j in call]
    host = max((out[i].shared.group for i in idx), key=lambda k: k.item_size)
    results = host.run([out[i].shared.operand for i in idx], t)
    for i, o in zip(idx, results):
      out[i] = out[i].resume(o)
  return out
