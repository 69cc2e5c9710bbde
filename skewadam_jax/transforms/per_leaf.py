"""The per-leaf scaffold shared by the transforms: the state's fields, leaf by leaf.

`scale_by_tiers` (SkewAdam's tiers, `scale_by_tiered_adam` for one tier) and
`scale_by_grouped_second_moment` (AdamPM) keep, per parameter, a few arrays (momentum,
statistics), each in a field of one state NamedTuple that has the params' structure.
Their rules differ; what is around the rules is the same, and lives here:

* the params (or updates) flattened with readable paths, a Python scalar leaf as a 0-d
  array (as optax treats it), complex ones refused at `init`; an integer or boolean
  leaf keeps no state and gets a zero update (`trains`);
* each field built from per-leaf values. A slot that a leaf does not keep is `None`
  in place of the leaf (or of its Flax box): an empty pytree node, not a leaf for jax,
  optax, Flax (`nnx.Optimizer` boxes every leaf of the state in a Variable) or Orbax,
  so the state has exactly one entry per array kept. `optax.MaskedNode`s of
  `optax.partition`'s other groups stay where they are;
* each Flax box of a statistic renamed to the axes the statistic keeps
  (`structure.boxes.rename_boxes`), from the specs its estimator gives;
* a field read back per leaf at `update` (also when only box metadata differs, or the
  state was unboxed by `nnx.Optimizer`);
* the step count and Adam's bias corrections `1 - b^t`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from skewadam_jax.core import checks as _checks
from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import paths as _paths
from skewadam_jax.core import tree as _tree

Names = tuple[Any, ...]  # one axis name (or None) per dimension
# The PartitionSpec of each field a leaf keeps (leaf index, parameter's axis names, shape).
SpecsOf = Callable[[int, Names, tuple[int, ...]], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class Leaves:
  """A tree's leaves with their paths, and how to build and read per-leaf fields.

  Attributes:
    tree: the params (at `init`) or the updates (at `update`), as given.
    paths: each leaf's '/'-joined normalised path.
    arrays: each leaf as an array (Python scalars as 0-d arrays).
    treedef: the tree's structure.
  """
  tree: Any
  paths: tuple[str, ...]
  arrays: tuple[Any, ...]
  treedef: Any

  @classmethod
  def of(cls, tree: Any, transform: Optional[str] = None) -> Leaves:
    """`tree`'s leaves; with `transform` (its name, for the error), none may be complex."""
    flat, treedef = _paths.flatten_with_paths(tree)
    paths = tuple(path for path, _ in flat)
    arrays = tuple(_tree.as_array(x) for _, x in flat)
    if transform is not None:
      for path, x in zip(paths, arrays):
        _checks.check_float_leaf(path, x.dtype, transform)
    return cls(tree, paths, arrays, treedef)

  def unflatten(self, values: Sequence[Any]) -> Any:
    """A tree of the leaves' structure holding `values` (the updates)."""
    return self.treedef.unflatten(list(values))

  def field(self, values: Sequence[Any]) -> Any:
    """A state field: `values[i]` at leaf `i`, and `None` for the whole slot (the leaf,
    or its Flax box) where `values[i]` is None."""
    types = _flax.box_types()

    def is_box(x: Any) -> bool:
      return bool(types) and isinstance(x, types)

    slots, slots_def = jax.tree_util.tree_flatten(self.tree, is_leaf=is_box)
    it = iter(values)
    out = []
    for slot in slots:
      if not is_box(slot):
        out.append(next(it))
        continue
      inner = jax.tree_util.tree_structure(slot)
      held = [next(it) for _ in range(inner.num_leaves)]
      # A box holding no array (a MaskedNode of optax.partition) is kept as it is.
      if any(v is None for v in held):
        out.append(None)
      elif inner.num_leaves == 1 and len(jax.tree.leaves(held[0])) > 1:
        # A statistic of several arrays (a coded momentum's codes and scales): one box
        # per array, inside the statistic's own node, so that the state after an
        # update (whose containers hold bare arrays) has the structure of `init`'s
        # where a container boxes each array (NNX's Optimizer): one box holding the
        # node would come back from nnx.update as a dict, and the step trace again.
        out.append(jax.tree.map(lambda a, box=inner: box.unflatten([a]), held[0]))
      else:
        out.append(inner.unflatten(held))
    return slots_def.unflatten(out)

  def fields(self, rows: Sequence[Mapping[str, Any]], names: Sequence[str],
             specs_of: Optional[SpecsOf] = None) -> dict[str, Any]:
    """The state fields `names` from one row (field -> value) per leaf.

    A field missing from a row is `None` there. With `specs_of`, each Flax box of a
    field that `specs_of` gives a spec for names the axes of that spec.
    """
    out = {k: self.field([row.get(k) for row in rows]) for k in names}
    if specs_of is None:
      return out
    index = {path: i for i, path in enumerate(self.paths)}

    def names_for(field: str) -> Callable[[str, tuple[int, ...], Names], Optional[Names]]:
      def rename(path: str, shape: tuple[int, ...], param_names: Names) -> Optional[Names]:
        specs = specs_of(index[path], param_names, shape) if path in index else {}
        return _flax.spec_names(specs[field]) if field in specs else None
      return rename

    return {k: _flax.rename_boxes(self.tree, v, names_for(k)) for k, v in out.items()}

  def read(self, state: Any, names: Sequence[str]) -> list[dict[str, Any]]:
    """One row (field -> value, None where the leaf keeps nothing) per leaf of `state`'s
    fields `names`, which were built for a tree of this one's structure."""
    try:
      columns = [_flax.flatten_like(self.treedef, self.tree, getattr(state, k))
                 for k in names]
    except (ValueError, TypeError) as e:
      if not names:
        raise
      raise ValueError(tree_mismatch(self.tree, getattr(state, names[0]))) from e
    return [dict(zip(names, row)) for row in zip(*columns)] if columns else []


def _leaf_paths(tree: Any) -> list[str]:
  """The paths of `tree`'s leaves, a None (a leaf that keeps no state) counted as one."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
  return [_paths.path_str(path) for path, _ in flat]


def tree_mismatch(updates: Any, state_field: Any) -> str:
  """Why a state built for one tree does not fit the updates' tree: the paths missing
  from the updates and those the optimizer state does not have."""
  have, want = _leaf_paths(updates), _leaf_paths(state_field)
  missing = [p for p in want if p not in set(have)]
  extra = [p for p in have if p not in set(want)]

  def listed(paths: list[str]) -> str:
    return ', '.join(paths[:8]) + (f' and {len(paths) - 8} more' if len(paths) > 8 else '')

  parts = []
  if missing:
    parts.append(f'missing from the updates: {listed(missing)}')
  if extra:
    parts.append(f'not in the optimizer state: {listed(extra)}')
  if not parts:  # the same paths, other containers (a dict where a list was, say)
    parts.append('the same paths in other containers: '
                 f'{jax.tree_util.tree_structure(updates)} against '
                 f'{jax.tree_util.tree_structure(state_field)}')
  return ('The updates do not have the tree structure of the parameters the optimizer '
          f'state was made for ({"; ".join(parts)}). Pass gradients of the whole tree '
          'given to `tx.init` (a zero gradient for a frozen leaf), or make the state '
          'with `tx.init` of this tree.')


def param_leaves(leaves: Leaves, params: Any) -> list[Any]:
  """`params`' leaves beside the updates' (None each if not given or not alike)."""
  if params is not None:
    try:
      return _flax.flatten_like(leaves.treedef, leaves.tree, params)
    except (ValueError, TypeError):  # not the updates' structure: checked by the state
      pass
  return [None] * len(leaves.paths)


def _dtype(x: Any) -> Any:
  """A leaf's dtype (a Python number's as JAX gives it)."""
  return jnp.dtype(x.dtype) if _tree.is_array_like(x) else jnp.result_type(x)


def trains(grad: Any, param: Any = None) -> bool:
  """Whether a leaf is stepped by the rules: its parameter (or, where `update` got no
  params, its gradient) is floating point.

  An integer or boolean leaf (a step counter, an int buffer in a Flax tree) keeps no
  state and gets a zero update. That is `optax.adamw`'s update for it for a zero
  gradient, the only one it has (`jax.grad` gives float0), without AdamW's two
  moments of the leaf's size; weight decay after the rule treats it as AdamW does.
  Complex leaves are refused at `init` (`check_float_leaf`).
  """
  return bool(jnp.issubdtype(_dtype(grad if param is None else param), jnp.inexact))


def update_dtype(grad: Any, param: Any = None) -> Any:
  """The dtype of a leaf's update: `optax.adamw`'s on the same inputs.

  AdamW's update is its new momentum over the square root of its new second moment,
  both of which promote the gradient with the parameter's dtype (their dtype at
  `init`) and with Python floats: bfloat16 gradients on float32 parameters give
  float32 updates, bfloat16 on bfloat16 bfloat16, an integer leaf JAX's default float.
  Every rule computes in float32 and casts to this dtype once. Where the state is
  stored in (`mu_dtype`, `nu_dtype`, `Tier.mu_dtype`) does not change it. `param` (an
  array-like leaf or a Python number) is None where `update` got no params: the
  gradient's dtype then. A float0 gradient (`jax.grad` of an integer) adds nothing.
  """
  dtypes = [_dtype(x) for x in (grad, param) if x is not None]
  return jnp.result_type(*[d for d in dtypes if d != jax.dtypes.float0], float)


def zero_update(path: str, grad: Any, param: Any = None) -> jax.Array:
  """The update of a leaf that `trains` does not step: zeros of `update_dtype`."""
  if param is not None:
    _checks.check_grad_shape(path, tuple(grad.shape), _tree.abstract_leaf(param).shape,
                             'the parameter')
  return jnp.zeros(grad.shape, update_dtype(grad, param))


def bias_correction(decay: Any, t: jax.Array) -> jax.Array:
  """`1 - decay^t` in float32 (`t` the step count as a float32 scalar)."""
  return 1.0 - jnp.asarray(decay, jnp.float32) ** t


def next_count(count: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The step count after this update (saturating, as optax's), and it as a float32."""
  count = optax.safe_increment(count)
  return count, count.astype(jnp.float32)


def zero_count() -> jax.Array:
  """The step count of a fresh state."""
  return jnp.zeros([], jnp.int32)
