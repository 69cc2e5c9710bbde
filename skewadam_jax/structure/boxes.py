"""Flax boxes: finding them, reading and writing their axis names, unboxing them.

Flax wraps a parameter in a box that carries its logical axis names: Linen's
`nn.Partitioned` / `nn.LogicallyPartitioned` (an `AxisMetadata`) in `names`, an NNX
`Variable` in its metadata, under `out_sharding` since Flax 0.12 (which turns the older
`sharding_names` and `sharding` into it) and under those two before. `NNX_KEYS` is the
one order in which the names are read (the first key present wins) and written (every
key present gets the new names).

Why renaming exists: `nnx.Optimizer` hands `tx.init` the params as `nnx.Param`
Variables, and `flax.nnx` copies a parameter's metadata onto every state leaf built
with the params' treedef, e.g. `('embed', 'layers', 'q_heads', 'kv')`. That is right for
momentum but not for the reduced statistics: a factored row statistic `v_row` drops the
column axis, `v_col` the row axes, so each would otherwise claim the parameter's axis
names. Flax's sharding route, `nn.logical_to_mesh_sharding(nnx.get_partition_spec(state),
mesh, rules)`, reads those names, so `rename_boxes` gives each statistic's box the names
its estimator derives from the parameter's (the same derivation as its PartitionSpec in
`state_shardings`).

Flax is not a dependency: boxes are only looked for when Flax is loaded.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Optional

import jax
from jax.sharding import PartitionSpec

from skewadam_jax.structure import paths as _paths

Names = tuple[Any, ...]  # one axis name (or None) per dimension
# Where an NNX Variable keeps its axis names, newest spelling first (see the docstring).
NNX_KEYS = ('out_sharding', 'sharding_names', 'sharding')


def box_types() -> tuple[type, ...]:
  """Flax boxes that carry axis names, if Flax is loaded (nothing to find otherwise)."""
  types: list[type] = []
  nnx = sys.modules.get('flax.nnx')
  if nnx is not None:
    for name in ('Variable', 'VariableState'):
      t = vars(nnx).get(name)  # vars(): no deprecation warning for removed aliases
      if isinstance(t, type):
        types.append(t)
  meta = sys.modules.get('flax.core.meta')
  if meta is not None and isinstance(getattr(meta, 'AxisMetadata', None), type):
    types.append(meta.AxisMetadata)
  return tuple(types)


def _metadata(box: Any) -> Any:
  """An NNX Variable's metadata dict (None for anything else)."""
  get = getattr(box, 'get_metadata', None)
  return get() if callable(get) else getattr(box, 'metadata', None)


def _is_axis_metadata(box: Any) -> bool:
  meta = sys.modules.get('flax.core.meta')
  return meta is not None and isinstance(box, getattr(meta, 'AxisMetadata', ()))


def box_names(box: Any) -> Optional[Names]:
  """Axis names of a Linen `nn.Partitioned` box or an NNX variable's sharding metadata
  (the first of `NNX_KEYS` it holds)."""
  names = getattr(box, 'names', None)
  if names is None:
    metadata = _metadata(box)
    if isinstance(metadata, Mapping):
      names = next((metadata[k] for k in NNX_KEYS if metadata.get(k) is not None), None)
  if names is None or isinstance(names, str):
    return None
  try:
    return tuple(names)
  except TypeError:
    return None


def with_names(box: Any, names: Names) -> Any:
  """A copy of a Flax box (NNX Variable or Linen AxisMetadata) naming its axes `names`.

  NNX Variables get every one of `NNX_KEYS` that their metadata holds; Linen boxes get
  `names`. A box without axis names is returned as is.
  """
  names = tuple(names)
  if _is_axis_metadata(box):
    if getattr(box, 'names', None) is None or not hasattr(box, 'replace'):
      return box
    return box.replace(names=names)
  metadata = _metadata(box)
  if not isinstance(metadata, Mapping):
    return box
  keys = [k for k in NNX_KEYS if metadata.get(k) is not None]
  if not keys:
    return box
  return box.replace(**{k: names for k in keys})


def axis_names_by_path(tree: Any) -> dict[tuple[str, ...], Names]:
  """Normalised path segments -> axis names, for every Flax box in `tree` that has them."""
  types = box_types()
  if not types:
    return {}
  boxes, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, types))
  out = {}
  for path, box in boxes:
    if isinstance(box, types):
      names = box_names(box)
      if names is not None:
        out[_paths.path_segments(path)] = names
  return out


def _box_value(box: Any) -> Any:
  """The array (or `jax.ShapeDtypeStruct`) in a box, or None (e.g. `optax.MaskedNode`)."""
  leaves = jax.tree.leaves(box)
  if len(leaves) == 1 and hasattr(leaves[0], 'shape'):
    return leaves[0]
  return None


def rename_boxes(
    params: Any,
    field: Any,
    names_for: Callable[[str, tuple[int, ...], Names], Optional[Names]],
) -> Any:
  """`field` with each of its Flax boxes naming the axes its statistic keeps.

  `field` is a state field built from `params`' treedef, so that every box of `params`
  (an NNX Variable or a Linen AxisMetadata) faces a box of `field` holding the
  parameter's statistic. For each box of `params` whose value is an array and that has
  axis names, `names_for(path, param_shape, names)` gives the statistic's names (`names`
  padded with None to one per dimension); it returns None to keep the box unchanged.
  Boxes holding no array (`optax.MaskedNode` of unused or masked-out fields: Flax's
  route gives them a spec that matches no array, which `jit` accepts) and anything
  that is not a box are kept as they are.

  Args:
    params: the parameters, as `tx.init` received them.
    field: a tree with `params`' structure (down to `params`' boxes and leaves).
    names_for: the statistic's axis names, or None for the parameter's.

  Returns:
    `field`, with renamed copies of the boxes whose names change.
  """
  types = box_types()
  if not types:
    return field

  def is_box(x: Any) -> bool:
    return isinstance(x, types)

  def rename(path: tuple[Any, ...], param: Any, stat: Any) -> Any:
    if is_box(param) and not is_box(stat) and jax.tree.leaves(stat):
      # A statistic of several arrays, one box each (`Leaves.field`): each box named.
      return jax.tree.map(lambda box: rename(path, param, box), stat, is_leaf=is_box)
    if not (is_box(param) and is_box(stat)):
      return stat
    value = _box_value(param)
    names = box_names(param)
    if value is None or names is None or not jax.tree.leaves(stat):
      return stat
    shape = tuple(value.shape)
    if len(names) > len(shape):
      return stat  # not one name per axis: nothing to derive from
    names = names + (None,) * (len(shape) - len(names))
    new = names_for(_paths.path_str(path), shape, names)
    if new is None or tuple(new) == names:
      return stat
    return with_names(stat, tuple(new))

  return jax.tree_util.tree_map_with_path(rename, params, field, is_leaf=is_box)


def spec_names(spec: Any) -> Optional[Names]:
  """The names of an estimator's spec for one statistic (names standing in for mesh axes).

  A PartitionSpec gives its entries; a pytree of specs (a statistic made of several
  arrays, all in one box) gives the entries they share, or `()` (replicated) if they
  differ, as one box cannot name the axes of arrays of different ranks.
  """
  if isinstance(spec, PartitionSpec):
    return tuple(spec)
  specs = jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, PartitionSpec))
  if not specs or not all(isinstance(s, PartitionSpec) for s in specs):
    return None
  first = tuple(specs[0])
  return first if all(tuple(s) == first for s in specs) else ()


def unbox(tree: Any) -> Any:
  """`tree` with every Flax box (NNX Variable, Linen AxisMetadata) replaced by its value.

  State fields whose boxes name the axes their statistic keeps no longer share the
  params' treedef (box metadata is part of it); unboxed, both have the same structure.
  """
  types = box_types()
  if not types:
    return tree

  def value(x: Any) -> Any:
    if not isinstance(x, types):
      return x
    get = getattr(x, 'get_value', None)
    return get() if callable(get) else x.value

  return jax.tree.map(value, tree, is_leaf=lambda x: isinstance(x, types))


def flatten_like(treedef: Any, params: Any, tree: Any) -> list[Any]:
  """`treedef.flatten_up_to(tree)` (treedef of `params`), also when only box metadata
  differs (a state field whose boxes were renamed by `rename_boxes`)."""
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError):
    return jax.tree_util.tree_structure(unbox(params)).flatten_up_to(unbox(tree))
