"""Small pytree helpers: what a leaf is (an array, a number, a function) and its shape.

Paths live in `structure.paths`, Flax boxes in `structure.boxes`."""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_array_like(x: Any) -> bool:
  """Whether `x` has a shape and a dtype (an array, a tracer, a `jax.ShapeDtypeStruct`)."""
  return hasattr(x, 'shape') and hasattr(x, 'dtype') and not isinstance(x, type)


def is_array_leaf(x: Any) -> bool:
  """Whether a leaf is an array (or tracer, `ShapeDtypeStruct`, Flax box of one), or a
  Python/NumPy number that optax would treat as a 0-d array; not a function or string."""
  return is_array_like(x) or isinstance(x, (int, float, complex))


def leaf_shape(x: Any) -> tuple[int, ...]:
  """The shape of a leaf (a box's, a number's `()`); `()` for what has none."""
  shape = getattr(x, 'shape', None)
  if shape is None:
    try:
      shape = np.shape(x)
    except Exception:  # noqa: BLE001 -- not array-like: no shape to use
      shape = ()
  return tuple(int(d) for d in shape)


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
