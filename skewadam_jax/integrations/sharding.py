"""Shardings of the optimizer state, derived from the shardings of the parameters.

Under an Explicit mesh (`jax.make_mesh` + `jax.set_mesh`) the state built by
`jax.jit(tx.init)(sharded_params)` already follows the parameters. Everywhere else
(Auto meshes, `jit(..., out_shardings=...)`, Orbax restore targets) the state's
shardings must be given, and a state leaf does not always have its parameter's rank:

* momentum, Adam's and the exact second moment: the parameter's spec;
* factored row statistics `[..., R]`: the spec without the last axis;
* factored column statistics `[..., C]`: the spec without the second-to-last axis;
* pooled (AdamPM) second moments: the parameter's spec, the grouped axis shortened,
  which needs every shard to hold whole groups;
* step counts, hyperparameters and anything not following the params: replicated.

Each statistic's spec comes from the estimator that made it (`SecondMoment.specs`,
a spec or a pytree of specs; a coded momentum's from its codec): `state_shardings`
traces the optimizer's `init` and reads the plan of each transform that plans its
leaves (`reports.trace.trace_init`), which says which state leaves are the statistics
of which parameter, made by which estimator. State of other optax transforms (AdamW's
`mu`/`nu`, Adafactor's factors) is matched to its parameter by the state walk
(`reports.walk`), its spec by shape.

`optax.tree_utils.tree_map_params` hands every params-shaped subtree the parameter's
full-rank spec, which is wrong for the reduced statistics (and it cannot even run our
`init`, which reads shapes); `state_shardings` derives each leaf's spec from the axes
the leaf keeps.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import Sharding

from skewadam_jax.core import checks as _checks
from skewadam_jax.structure import paths as _paths
from skewadam_jax.reports import trace as _trace
from skewadam_jax.core import tree as _tree

Spec = tuple[Any, ...]  # one PartitionSpec entry per dimension


def _is_spec(x: Any) -> bool:
  return x is None or isinstance(x, (PartitionSpec, Sharding))


def _padded(spec: Any, ndim: int) -> Spec:
  """A spec as a tuple with exactly one entry per dimension."""
  entries = tuple(spec) if spec is not None else ()
  if len(entries) > ndim:
    raise ValueError(f'PartitionSpec {spec} has more entries than the {ndim} dimensions '
                     'of its parameter.')
  return entries + (None,) * (ndim - len(entries))


def _shards(entry: Any, mesh: Optional[Mesh]) -> int:
  """Number of shards that a spec entry splits an axis into (1 if unknown)."""
  if mesh is None or not isinstance(entry, (str, tuple)):
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([mesh.shape[name] for name in names], dtype=np.int64))


def _check_shortened_axes(path: str, param_shape: tuple[int, ...], leaf_shape: tuple[int, ...],
                          spec: Spec, mesh: Optional[Mesh]) -> None:
  """Raises if a shortened axis of an unknown statistic cannot keep its sharding."""
  for axis, (n, m) in enumerate(zip(param_shape, leaf_shape)):
    shards = _shards(spec[axis], mesh)
    if n == m or shards == 1:
      continue
    if n % shards or m % shards:
      raise ValueError(
          f'A state leaf of parameter {path} of shape {param_shape} shortens axis {axis} '
          f'to {m}, but that axis is sharded over mesh axis {spec[axis]!r} into {shards} '
          'shards, which divide neither length evenly. Shard this axis differently.')


def _leaf_spec(path: str, param_shape: tuple[int, ...], param_spec: Any, leaf: Any,
               mesh: Optional[Mesh]) -> PartitionSpec:
  """The spec of a state leaf of another transform that follows a parameter (by shape)."""
  shape = tuple(leaf.shape)
  if shape == param_shape:
    return param_spec if isinstance(param_spec, PartitionSpec) else PartitionSpec()
  spec = _padded(param_spec, len(param_shape))
  if len(shape) == len(param_shape) and all(s <= n for s, n in zip(shape, param_shape)):
    _check_shortened_axes(path, param_shape, shape, spec, mesh)
    return PartitionSpec(*spec)
  if len(shape) == len(param_shape) - 1:
    # A reduced statistic: keep the spec if the dropped axis is unambiguous.
    candidates = {spec[:i] + spec[i + 1:] for i in range(len(param_shape))
                  if param_shape[:i] + param_shape[i + 1:] == shape}
    if len(candidates) == 1:
      return PartitionSpec(*candidates.pop())
  return _replicated(leaf)  # safe default


def _replicated(leaf: Any) -> PartitionSpec:
  """The fully replicated spec (of any leaf)."""
  del leaf
  return PartitionSpec()


def _planned_spec(param_spec: Any, shape: tuple[int, ...], planned: _trace.Planned,
                 mesh: Optional[Mesh]) -> PartitionSpec:
  """The spec its plan gives a state leaf (`SecondMoment.specs`, `StateCodec.specs`)."""
  padded = _padded(param_spec, len(shape))
  specs = planned.plan.specs(planned.index, planned.field, padded, mesh)
  # Specs are leaves, and so is None (replicated) in a pytree of statistics' specs.
  known = jax.tree.leaves(specs, is_leaf=_is_spec)[planned.item]
  if known is None:
    return PartitionSpec()
  if tuple(known) == padded:  # the parameter's own spec, as the user wrote it
    return param_spec if isinstance(param_spec, PartitionSpec) else PartitionSpec()
  return known


def _flat_param_specs(params: Any, param_shardings: Any
                      ) -> tuple[list[Any], Optional[Mesh], list[Sharding]]:
  """One spec per parameter leaf (matched as labels are: structure, prefix or path), the
  mesh, if named, and the shardings that are neither NamedShardings nor specs (all fully
  replicated)."""
  flat = _paths.per_leaf(params, param_shardings, 'param_shardings', _is_spec,
                         'PartitionSpecs, NamedShardings or shardings (or None)')
  meshes = {s.mesh for s in flat if isinstance(s, NamedSharding)}
  if len(meshes) > 1:
    raise ValueError('`param_shardings` use more than one mesh.')
  specs, others = [], []
  for (path, _), s in zip(_paths.flatten_with_paths(params)[0], flat):
    if isinstance(s, NamedSharding):
      specs.append(s.spec)
    elif s is None or isinstance(s, PartitionSpec):
      specs.append(s)
    elif isinstance(s, Sharding) and s.is_fully_replicated:
      # E.g. `SingleDeviceSharding` (`x.sharding` of an array on one device): every
      # state leaf of the parameter is whole on the same devices.
      specs.append(PartitionSpec())
      others.append(s)
    else:  # a Sharding (`_is_spec` let no other value through)
      raise TypeError(
          f'`param_shardings` of {path} is a {type(s).__name__} that splits the parameter; '
          'the state can follow only a NamedSharding (or a PartitionSpec with `mesh=`), '
          'or a fully replicated or single-device sharding.')
  return specs, (meshes.pop() if meshes else None), others


def _replicated_sharding(others: list[Sharding], specs: list[Any], mesh: Optional[Mesh]
                         ) -> Optional[Sharding]:
  """The sharding of every state leaf when the params have fully replicated shardings
  other than NamedShardings (e.g. single-device ones) and no mesh; None otherwise."""
  if not others:
    return None
  if mesh is not None:  # those params become replicated NamedShardings on the mesh
    devices = set(mesh.devices.flat)
    for s in others:
      if set(s.device_set) != devices:
        raise ValueError(
            f'`param_shardings` mix a {type(s).__name__} on {sorted(map(str, s.device_set))} '
            f'with a mesh of other devices ({sorted(map(str, devices))}); place every '
            'parameter on the mesh (e.g. `NamedSharding(mesh, PartitionSpec())`).')
    return None
  if len(set(others)) > 1:
    raise ValueError('`param_shardings` place parameters on different devices '
                     f'({sorted({str(s) for s in others})}); put them on the same devices, '
                     'or give NamedShardings on one mesh.')
  if any(spec is not None and any(e is not None for e in spec) for spec in specs):
    raise ValueError('`param_shardings` mix PartitionSpecs that split a parameter with '
                     f'{type(others[0]).__name__}s; pass `mesh=` to say where the '
                     'PartitionSpecs place them.')
  return others[0]


def state_shardings(
    tx: optax.GradientTransformation,
    params: Any,
    param_shardings: Any,
    *,
    mesh: Optional[Mesh] = None,
) -> Any:
  r"""Shardings of `tx`'s state, derived from the params' PartitionSpecs or shardings.

  The state's structure comes from `jax.eval_shape(tx.init, params)` (nothing is
  allocated); each array leaf that follows a parameter gets the parameter's spec
  restricted to the axes the leaf keeps::

    momentum, exact v, Adam's mu/nu       spec
    factored rows    [..., R]             spec[:-1]
    factored columns [..., C]             spec[:-2] + spec[-1:]
    pooled nu        (axis n -> n/s)      spec  (whole groups per shard, checked)
    counts, hyperparameters               replicated

  Works for `skewadam`, `adampm`, `scale_by_tiered_adam`,
  `scale_by_grouped_second_moment` and plain optax states (e.g. `optax.adamw`),
  nested in `optax.chain`, `optax.partition`, `optax.masked`,
  `optax.inject_hyperparams` or `optax.MultiSteps`. Unknown leaves of a lower rank
  keep the spec when the dropped axis is unambiguous from the shapes, and are
  replicated otherwise.

  Args:
    tx: the optimizer.
    params: the parameters, as arrays or `jax.ShapeDtypeStruct`s.
    param_shardings: a pytree with the params' structure (or a prefix of it) of
      `PartitionSpec`s, `NamedSharding`s or None (replicated).
    mesh: the mesh to build `NamedSharding`s on; default the mesh of the given
      `NamedSharding`s. Without either, `PartitionSpec`s are returned.

  Returns:
    A pytree with the structure of `tx.init(params)` of `NamedSharding`s (with a mesh)
    or `PartitionSpec`s, usable as `jax.jit` `out_shardings`/`in_shardings`, in
    `jax.device_put`, or in an Orbax restore target (see `sharded_abstract_state`).

  Raises:
    ValueError: if a pooled axis is sharded so that groups straddle shards (checked
      when the mesh is known).

  Example:
    >>> import jax, jax.numpy as jnp, skewadam_jax as sj
    >>> from jax.sharding import PartitionSpec as P
    >>> params = {'router': jax.ShapeDtypeStruct((16, 8), jnp.float32),
    ...           'experts': {'w1': jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)}}
    >>> specs = {'router': P(), 'experts': {'w1': P('expert', None, 'data')}}
    >>> shardings = sj.state_shardings(sj.skewadam(1e-3), params, specs)
    >>> shardings[0].v_row['experts']['w1']
    P('expert', None)
  """
  _checks.check_transform_first(tx, params, 'sj.state_shardings(tx, params, param_shardings)')
  return _shardings_and_state(tx, params, param_shardings, mesh)[0]


def _shardings_and_state(tx: optax.GradientTransformation, params: Any, param_shardings: Any,
                         mesh: Optional[Mesh]) -> tuple[Any, Any]:
  """`state_shardings` and the abstract state, from one trace of `tx.init`."""
  specs, named_mesh, others = _flat_param_specs(params, param_shardings)
  mesh = mesh if mesh is not None else named_mesh
  replicated = _replicated_sharding(others, specs, mesh)
  trace = _trace.trace_init(tx, params)
  shapes = [tuple(_tree.abstract_leaf(p).shape) for p in jax.tree.leaves(params)]
  out = []
  for leaf in trace.leaves:
    i = leaf.param
    if leaf.planned is not None:  # planned: its estimator or codec knows its spec
      out.append(_planned_spec(specs[i], shapes[i], leaf.planned, mesh))
    elif i is not None:  # another transform's leaf that follows a parameter: by shape
      out.append(_leaf_spec(trace.paths[i], shapes[i], specs[i], leaf.leaf, mesh))
    else:  # step counts, hyperparameters
      out.append(_replicated(leaf.leaf))
  specs_tree = jax.tree.structure(trace.state).unflatten(out)
  if replicated is not None:  # all on the same devices, whole: the same sharding
    return jax.tree.map(lambda spec: replicated, specs_tree), trace.state
  if mesh is None:
    return specs_tree, trace.state
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs_tree), trace.state


def sharded_abstract_state(
    tx: optax.GradientTransformation,
    params: Any,
    param_shardings: Any,
    *,
    mesh: Optional[Mesh] = None,
) -> Any:
  """`jax.eval_shape(tx.init, params)` with a `sharding` on every leaf.

  The restore target for Orbax (`ocp.args.StandardRestore(target)`) or the abstract
  argument of `jax.jit(...).lower`: shapes and dtypes of the state, each leaf placed
  as `state_shardings` says.

  Args:
    tx: the optimizer.
    params: the parameters, as arrays or `jax.ShapeDtypeStruct`s.
    param_shardings: the params' `NamedSharding`s, or `PartitionSpec`s with `mesh`.
    mesh: the mesh, required unless `param_shardings` are `NamedSharding`s.

  Returns:
    A pytree of `jax.ShapeDtypeStruct`s with the structure of `tx.init(params)`.
  """
  _checks.check_transform_first(
      tx, params, 'sj.sharded_abstract_state(tx, params, param_shardings)')
  shardings, abstract = _shardings_and_state(tx, params, param_shardings, mesh)
  if not all(isinstance(s, Sharding) for s in jax.tree.leaves(shardings)):
    raise ValueError('`sharded_abstract_state` needs a mesh: pass NamedShardings or `mesh=`.')
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
