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

Run as a script, it demonstrates the recipe on the `tiny` MoE LM: a few SkewAdam (or
AdamPM) updates, a checkpoint of params + state, a restore onto the abstract target
and a bitwise comparison::

  python examples/checkpointing.py                    # in a temporary directory
  python examples/checkpointing.py --dir /tmp/ckpt --optimizer adampm --steps 5

`examples/sharded_moe.py --ckpt-dir DIR --save-at N` / `--resume N` uses the same
helpers on a device mesh.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import sys
import tempfile
from typing import Any, Optional

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import SingleDeviceSharding
import numpy as np
import optax
import orbax.checkpoint as ocp

if __package__ in (None, ''):  # `python examples/checkpointing.py`: the repository root
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import skewadam_jax as sj  # noqa: E402
from examples import _cli  # noqa: E402


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


# ----------------------------------------------------------------------------- demo


def demo(path: str | os.PathLike[str], optimizer: str = 'skewadam', preset: str = 'tiny',
         steps: int = 2, seed: int = 0) -> dict[str, Any]:
  """Trains `steps` updates, saves params + state to `path` and restores them.

  The gradients are random (the checkpoint does not care where they come from): what
  matters is that the state holds non-trivial statistics and step counts.

  Returns:
    `{'tx', 'saved', 'restored'}`: the optimizer, the saved tree and the tree restored
    onto `abstract_target(tx, ...)` (one device).
  """
  # Imported here: the helpers above need neither Flax nor the example model.
  from flax import nnx

  from examples.moe_lm import model as model_lib

  params = nnx.state(model_lib.MoELM(model_lib.get_config(preset), rngs=nnx.Rngs(seed)),
                     nnx.Param)
  tx = (sj.adampm(1e-3, weight_decay=0.1) if optimizer == 'adampm'
        else sj.skewadam(1e-3, weight_decay=0.1))

  @jax.jit
  def step(params, opt_state, key):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    grads = treedef.unflatten([0.01 * jax.random.normal(k, x.shape, x.dtype)
                               for k, x in zip(keys, leaves)])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for i in range(steps):
    params, opt_state = step(params, opt_state, jax.random.key(seed * 1000 + i))
  saved = {'params': params, 'opt_state': opt_state}
  save_checkpoint(path, saved)
  target = abstract_target(tx, jax.eval_shape(lambda: params))
  return {'tx': tx, 'saved': saved, 'restored': restore_checkpoint(path, target)}


def mismatches(a: Any, b: Any) -> list[str]:
  """Paths of the leaves where two trees differ in structure, dtype, shape or any bit."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return ['<tree structure>']
  out = []
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
      out.append(jax.tree_util.keystr(path))
  return out


def build_parser() -> argparse.ArgumentParser:
  """The demo's command line."""
  parser = _cli.parser(__doc__.splitlines()[0])
  _cli.option(parser, '--dir', default=None,
              help='checkpoint directory to create (must not exist); unset: a temporary '
                   'one, deleted afterwards')
  _cli.option(parser, '--optimizer', default='skewadam', choices=('skewadam', 'adampm'),
              help='optimizer whose state is saved')
  _cli.option(parser, '--preset', default='tiny', choices=('tiny', 'small'),
              help='model size')
  _cli.option(parser, '--steps', type=int, default=2, help='updates before saving')
  _cli.option(parser, '--seed', type=int, default=0, help='weights and gradients')
  return parser


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  """Runs the demo, prints a short report; returns `demo`'s dict plus `mismatched`."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.steps < 0:
    parser.error(f'--steps must be >= 0, not {args.steps}')
  if args.dir is not None and os.path.exists(args.dir):
    parser.error(f'--dir {args.dir} exists: Orbax writes a new directory')
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(args.dir) if args.dir is not None else Path(tmp) / 'ckpt'
    out = demo(path, args.optimizer, args.preset, args.steps, args.seed)
    files = sum(1 for f in path.rglob('*') if f.is_file())
    saved, restored = out['saved'], out['restored']
    out['mismatched'] = mismatches(saved, restored)  # before the files go
  n_params = sum(x.size for x in jax.tree.leaves(saved['params']))
  state = jax.tree.leaves(saved['opt_state'])
  fresh = jax.tree.structure(jax.eval_shape(out['tx'].init, saved['params']))
  print(f'{args.preset} MoE LM: {n_params:,} parameters; {args.optimizer} state after '
        f'{args.steps} updates: {len(state)} arrays, '
        f'{sum(x.nbytes for x in state):,} bytes')
  print(f'saved params + state to {path}'
        + (' (temporary, deleted)' if args.dir is None else '') + f': {files} files')
  print(f'restored onto the abstract target (one device); state structure '
        f'{"equals" if jax.tree.structure(restored["opt_state"]) == fresh else "DIFFERS from"}'
        " tx.init's")
  if out['mismatched']:
    print(f'{len(out["mismatched"])} arrays differ: {", ".join(out["mismatched"][:5])}')
  else:
    print(f'all {len(jax.tree.leaves(saved))} arrays bitwise equal')
  return out


if __name__ == '__main__':
  sys.exit(1 if main()['mismatched'] else 0)
