"""Saving and restoring params + optimizer state with Orbax, on one device or sharded.

The recipe, in three lines::

  save_checkpoint(path, {'params': params, 'opt_state': opt_state})
  target = abstract_target(tx, abstract_params, param_shardings)   # nothing allocated
  restored = restore_checkpoint(path, target)                      # any mesh

Orbax writes every array with its shards; `restore_checkpoint` reads them back onto
whatever shardings the *target* names, so a checkpoint written on one mesh restores
onto another (or onto one device). The target must be the full abstract state,
`jax.eval_shape(tx.init, params)` with a sharding per leaf: optax states hold
`optax.MaskedNode`s and empty NamedTuples (`EmptyState`) that have no arrays, so Orbax
cannot rebuild them from the files alone; from the target it does, and the restored
state has exactly `tx.init`'s structure.

The step counters live inside the optimizer state, so restoring params + state and
feeding the same batches resumes the uninterrupted trajectory bit for bit.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import SingleDeviceSharding
import optax
import orbax.checkpoint as ocp

import skewadam_jax as sj


def save_checkpoint(path: str | os.PathLike[str], tree: Any) -> None:
  """Writes a pytree of (sharded) arrays to the new directory `path` and waits.

  Args:
    path: the checkpoint directory (must not exist yet; absolute or relative).
    tree: e.g. `{'params': params, 'opt_state': opt_state, 'step': step}`.
  """
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(path), tree)
  checkpointer.wait_until_finished()


def abstract_target(tx: optax.GradientTransformation, abstract_params: Any,
                    param_shardings: Any = None, *, mesh: Optional[Mesh] = None) -> Any:
  """The restore target `{'params', 'opt_state'}` as sharded `jax.ShapeDtypeStruct`s.

  Args:
    tx: the optimizer whose state was saved.
    abstract_params: the params as `jax.ShapeDtypeStruct`s (or arrays).
    param_shardings: the params' `NamedSharding`s on the mesh to restore onto, or
      `PartitionSpec`s with `mesh` (same structure as the params); None restores
      everything onto the first device.
    mesh: the mesh for `PartitionSpec`s.

  Returns:
    `{'params': ..., 'opt_state': ...}` of `jax.ShapeDtypeStruct`s with shardings.
  """
  if param_shardings is None:
    one = SingleDeviceSharding(jax.devices()[0])
    place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)
    return {'params': jax.tree.map(place, abstract_params),
            'opt_state': jax.tree.map(place, jax.eval_shape(tx.init, abstract_params))}
  if mesh is not None:
    param_shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), param_shardings,
        is_leaf=lambda x: isinstance(x, PartitionSpec))
  params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params,
      param_shardings)
  return {'params': params,
          'opt_state': sj.sharded_abstract_state(tx, abstract_params, param_shardings)}


def restore_checkpoint(path: str | os.PathLike[str], target: Any) -> Any:
  """Reads a checkpoint onto the shapes, dtypes and shardings of `target`.

  Args:
    path: the directory written by `save_checkpoint`.
    target: a pytree of sharded `jax.ShapeDtypeStruct`s (see `abstract_target`).

  Returns:
    The restored pytree, with `target`'s structure and shardings.
  """
  return ocp.StandardCheckpointer().restore(os.path.abspath(path), target)
