"""Small pytree helpers: flattening with readable, normalised paths; Flax boxes; leaves
that are Python scalars."""

from __future__ import annotations

import functools
import numbers
import sys
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp


def key_to_str(key: Any) -> str:
  """One path entry as a plain string (dict key, attribute, index)."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_segments(path: tuple[Any, ...]) -> tuple[str, ...]:
  """Normalised segments of a key path: stringified, trailing `value` dropped.

  Flax wraps parameters in boxes whose array sits under a `value` attribute (boxed
  Linen params, `nnx.State` at `init`), while the pure arrays that `nnx.Optimizer`
  passes to `update` have no such entry; dropping it gives both the same path.
  """
  segments = tuple(key_to_str(k) for k in path)
  while segments and segments[-1] in ('value', 'raw_value'):
    segments = segments[:-1]
  return segments


def path_str(path: tuple[Any, ...]) -> str:
  """A key path as a '/'-joined string of normalised segments."""
  return '/'.join(path_segments(path)) or '<root>'


def flatten_with_paths(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
  """Leaves of `tree` with their '/'-joined paths, and the treedef."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in with_path], treedef


def is_array_like(x: Any) -> bool:
  """Whether `x` has a shape and a dtype (an array, a tracer, a `jax.ShapeDtypeStruct`)."""
  return hasattr(x, 'shape') and hasattr(x, 'dtype')


def as_array(x: Any) -> Any:
  """`x` itself if it is array-like, else `jnp.asarray(x)`.

  Optax accepts Python scalars as parameter (and gradient) leaves and treats them as
  0-d arrays of JAX's default dtype (float32 for a float unless x64 is enabled).
  """
  return x if is_array_like(x) else jnp.asarray(x)


def abstract_leaf(x: Any) -> Any:
  """A `jax.ShapeDtypeStruct` for an array-like leaf or a Python number; else `x`."""
  if is_array_like(x):
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
  if isinstance(x, numbers.Number):
    return jax.ShapeDtypeStruct((), jnp.result_type(x))
  return x


def is_function(x: Any) -> bool:
  """Whether `x` is a function of the params (a labeler), not a tree that is callable.

  An Equinox module, an NNX module or variable, or any other registered pytree node
  may be callable (its `__call__` is the model's forward pass) and is still a tree of
  parameters, labels or axes: only a callable that is a pytree leaf (a function, a
  lambda, a `Labeler`, any other callable object) or a `functools.partial` is a
  function. Deciding by `callable` alone would run a model's forward on its params.
  """
  if isinstance(x, functools.partial):  # also jax.tree_util.Partial, a pytree node
    return True
  if not callable(x):
    return False
  treedef = jax.tree_util.tree_structure(x)
  return treedef.num_nodes == 1 and treedef.num_leaves == 1  # x is a leaf


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


def box_names(box: Any) -> Optional[tuple[Any, ...]]:
  """Axis names of a Linen `nn.Partitioned` box or an NNX variable's sharding metadata."""
  names = getattr(box, 'names', None)
  if names is None:
    get = getattr(box, 'get_metadata', None)
    metadata = get() if callable(get) else getattr(box, 'metadata', None)
    if isinstance(metadata, Mapping):
      for key in ('sharding_names', 'out_sharding', 'sharding'):
        if metadata.get(key) is not None:
          names = metadata[key]
          break
  if names is None or isinstance(names, str):
    return None
  try:
    return tuple(names)
  except TypeError:
    return None
