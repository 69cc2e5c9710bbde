"""Saving and restoring params + optimizer state with Orbax, on one device or sharded.

The recipe, in three lines::

  description = sj.describe_state(tx, params)        # tiers, estimators, codecs
  save_checkpoint(path, {'params': params, 'opt_state': opt_state}, description)
  target = abstract_target(tx, abstract_params, param_shardings)   # nothing allocated
  restored = restore_checkpoint(path, target, description)         # any mesh

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

Training that survives a crash: `TrainCheckpointer` wraps Orbax's `CheckpointManager`
(one directory per step, written to a temporary directory and renamed when complete,
asynchronously by default) and adds what a restart needs:

* after Orbax commits a step, a manifest (`integrity.sha256.json`: size and sha256 of
  every file) is written into it, atomically; a step without one is incomplete;
* `restore` takes the newest step whose files all match their manifest, says which
  newer steps it skipped and why (incomplete, truncated, corrupted), moves them aside
  to `DIR/damaged/`, and stops with a clear error if steps exist but none is intact;
* before reading any array it compares the checkpoint's tree with the state this
  optimizer builds (`skewadam_jax.check_checkpoint_matches`), so a checkpoint of
  another optimizer, tier policy, labels or group size is an error naming what differs.

`examples/moe_lm/train.py --ckpt-dir DIR --ckpt-every N` and
`examples/sharded_moe.py --ckpt-dir DIR --ckpt-every N` use it: the same command,
rerun after a crash, resumes from the last intact step and ends bitwise where an
uninterrupted run ends.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
import sys
import tempfile
from typing import Any, Callable, Optional

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


def save_checkpoint(path: str | os.PathLike[str], tree: Any,
                    description: Optional[dict[str, Any]] = None) -> None:
  """Writes a pytree of (sharded) arrays to the new directory `path`, waits, and seals it.

  Args:
    path: the checkpoint directory (must not exist yet; absolute or relative).
    tree: e.g. `{'params': params, 'opt_state': opt_state, 'step': step}`.
    description: `sj.describe_state(tx, params)`, saved with it so that a restore
      with another codec or estimator is refused (`restore_checkpoint`).
  """
  checkpointer = ocp.StandardCheckpointer()
  path = os.path.abspath(path)
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  # A sha256 of every file (and the description): `restore_checkpoint` verifies them.
  if jax.process_index() == 0:
    sj.seal_checkpoint(path, description)


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


def restore_checkpoint(path: str | os.PathLike[str], target: Any,
                       description: Optional[dict[str, Any]] = None) -> Any:
  """Verifies a checkpoint and reads it onto the shapes, dtypes and shardings of `target`.

  Args:
    path: the directory written by `save_checkpoint`.
    target: a pytree of sharded `jax.ShapeDtypeStruct`s (see `abstract_target`).
    description: `sj.describe_state(tx, params)` of the optimizer restoring it, compared
      with the one saved (codecs, estimators, tiers, shapes).

  Returns:
    The restored pytree, with `target`'s structure and shardings.

  Raises:
    ValueError: a file is missing, truncated or corrupted (`damaged: <file>`,
      `skewadam_jax.check_checkpoint`), or the checkpoint holds another optimizer's
      state (or other params); the message names what differs
      (`skewadam_jax.check_checkpoint_matches`).
  """
  checkpointer = ocp.StandardCheckpointer()
  path = os.path.abspath(path)
  saved = sj.check_checkpoint(path)
  sj.check_checkpoint_matches(target, checkpointer.metadata(path), source=f'Checkpoint {path}',
                              description=description, saved_description=saved)
  return checkpointer.restore(path, target)


# ----------------------------------------------------------------------------- crash-safe training

MANIFEST = sj.integrations.sealing.MANIFEST  # written into a step once Orbax committed it
DAMAGED_DIR = 'damaged'  # where restore moves the steps it cannot use


def write_manifest(step_dir: str | os.PathLike[str],
                   description: Optional[dict[str, Any]] = None) -> None:
  """Seals a step: its description and `MANIFEST` (size and sha256 of every file)."""
  sj.seal_checkpoint(step_dir, description)


def saved_description(step_dir: str | os.PathLike[str]) -> Optional[dict[str, Any]]:
  """The `sj.describe_state` sealed into a verified step (None if it has none); read
  without hashing the files again (`verify_step` did)."""
  path = Path(step_dir) / sj.integrations.sealing.DESCRIPTION
  return json.loads(path.read_text()) if path.exists() else None


def verify_step(step_dir: str | os.PathLike[str]) -> Optional[str]:
  """Why the step directory cannot be restored (None: every file matches its manifest)."""
  if not (Path(step_dir) / MANIFEST).exists():
    return 'incomplete: its save did not finish (no integrity manifest)'
  return sj.integrations.sealing.checkpoint_damage(step_dir)


def fingerprint(tree: Any) -> str:
  """sha256 of every leaf's bytes, shape and dtype: equal trees, equal fingerprints.

  Needs the whole arrays on this host (one process, or gathered first).
  """
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    x = np.asarray(leaf)
    h.update(f'{jax.tree_util.keystr(path)}:{x.dtype}:{x.shape};'.encode())
    h.update(x.tobytes())
  return h.hexdigest()[:16]


class TrainCheckpointer:
  """Saves `{'params', 'opt_state'}` every `every` steps; restores the newest intact step.

  A thin layer over `ocp.CheckpointManager` with two items per step: `state` (the
  arrays, Orbax's standard format) and `record` (a JSON dict, e.g. the loss history).
  What it adds, and why:

  * Orbax writes a step to `<step>.orbax-checkpoint-tmp` and renames it when complete,
    so a kill during a save leaves no step behind, but nothing detects a step whose
    files were truncated or corrupted afterwards: the manifest does.
  * `restore` never returns a partial or damaged step: it falls back to the newest
    intact one (printing which steps it skipped and why), or raises if there is none.
  * The tree is checked against the restore target before anything is read.

  Every RNG, batch and schedule of the loop must be a function of the step (not of how
  many steps this process ran) for a resumed run to equal an uninterrupted one.

  Args:
    directory: the run's checkpoint directory (created if needed).
    every: save after every `every`-th step (and wherever `save(force=True)`).
    keep: how many of the newest steps to keep (the older are deleted).
    use_async: write in a background thread while training continues (Orbax copies
      the arrays to host memory before `save` returns, so donated buffers are safe).
    log: where progress lines go (`print` by default).
    show_fingerprints: also log `fingerprint` of the saved and restored trees (a host
      copy of every array; for tests and tools/crash_resume.py).
    description: `sj.describe_state(tx, params)`: saved with every step and compared
      at restore, so that a step of another codec or estimator is refused.
  """

  def __init__(self, directory: str | os.PathLike[str], *, every: int, keep: int = 3,
               use_async: bool = True, log: Callable[[str], None] = print,
               show_fingerprints: bool = False,
               description: Optional[dict[str, Any]] = None):
    if every < 1:
      raise ValueError(f'`every` (steps between checkpoints) must be >= 1, not {every}.')
    if keep < 1:
      raise ValueError(f'`keep` (checkpoints kept) must be >= 1, not {keep}.')
    self.directory = Path(directory).absolute()
    self.every = every
    self.use_async = use_async
    self.show_fingerprints = show_fingerprints
    self.description = description
    self._log = log
    self._saving: Optional[int] = None  # the step whose async save is in flight
    self._is_writer = jax.process_index() == 0
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=use_async,
        async_options=(ocp.AsyncOptions(post_finalization_callback=self._committed)
                       if use_async else None))
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'record': ocp.JsonCheckpointHandler()})

  # --------------------------------------------------------------------------- save

  def _committed(self) -> None:
    """Runs once Orbax has written the step in flight: its manifest makes it complete.

    Asynchronously Orbax calls it from its background thread after the files are
    finalised and before it renames `<step>.orbax-checkpoint-tmp` to `<step>`, so the
    manifest lands in the temporary directory and the rename publishes both at once.
    """
    step, self._saving = self._saving, None
    if step is None:
      return
    if self._is_writer:
      final = self.directory / str(step)
      tmp = sorted(self.directory.glob(f'{step}.orbax-checkpoint-tmp*'))
      where = final if final.is_dir() else tmp[0] if tmp else None
      if where is None:  # never restored then: a step without a manifest is incomplete
        self._log(f'checkpoint: step {step} written but not found; no manifest')
        return
      write_manifest(where, self.description)
    self._log(f'checkpoint: step {step} complete')

  def save(self, step: int, state: Any, record: Optional[dict[str, Any]] = None, *,
           force: bool = False) -> bool:
    """Saves `state` (and the JSON `record`) as `step` if due; returns whether it did."""
    if not force and step % self.every:
      return False
    if step in self.manager.all_steps():
      return False
    self.manager.wait_until_finished()  # one save in flight at a time
    if self.show_fingerprints:
      self._log(f'checkpoint: step {step} fingerprint {fingerprint(state)}')
    self._log(f'checkpoint: saving step {step}' + (' (async)' if self.use_async else ''))
    self._saving = step
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record or {})),
        force=True)
    if not self.use_async:
      self._committed()
    return True

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is complete, manifest included."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()

  # --------------------------------------------------------------------------- restore

  def _barrier(self, name: str) -> None:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(name)

  def _move_aside(self, step: int) -> None:
    """Moves a step the run cannot use to `DIR/damaged/<step>[.n]` (kept for a look)."""
    dest = self.directory / DAMAGED_DIR / str(step)
    n = 0
    while dest.exists():
      n += 1
      dest = self.directory / DAMAGED_DIR / f'{step}.{n}'
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(self.directory / str(step), dest)

  def restore(self, target: Any, *, step: Optional[int] = None
              ) -> Optional[tuple[int, Any, dict[str, Any]]]:
    """`(step, state, record)` of the newest intact step, or None if there is no step.

    Args:
      target: the abstract state, `{'params': ..., 'opt_state': ...}` of sharded
        `jax.ShapeDtypeStruct`s (see `abstract_target`).
      step: restore exactly this step (an error if it is missing or not intact).

    Raises:
      ValueError: the checkpoint was written by another optimizer, tier policy, labels
        or group size (`skewadam_jax.check_checkpoint_matches`).
      RuntimeError: steps exist but none is intact, or `step` is not intact.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if step is not None:
      if step not in steps:
        raise RuntimeError(f'No checkpoint of step {step} in {self.directory} '
                           f'(steps: {sorted(steps) or "none"}).')
      steps = [step]
    chosen, skipped = None, []
    for s in steps:
      why = verify_step(self.directory / str(s))
      if why is None:
        chosen = s
        break
      skipped.append(s)
      self._log(f'checkpoint: step {s} in {self.directory} is {why}; '
                + ('not restoring it' if step is not None else 'trying the one before'))
    self._barrier('skewadam_verify_steps')
    if skipped and step is None and chosen is not None:
      if self._is_writer:
        for s in skipped:
          self._move_aside(s)
      self._barrier('skewadam_move_damaged')
      self.manager.reload()
      self._log(f'checkpoint: moved step(s) {", ".join(map(str, skipped))} to '
                f'{self.directory / DAMAGED_DIR}')
    if chosen is None and step is not None:
      raise RuntimeError(f'Checkpoint step {step} in {self.directory} is {why}; not restoring it.')
    if chosen is None:
      if skipped:
        raise RuntimeError(
            f'No intact checkpoint in {self.directory}: step(s) '
            f'{", ".join(map(str, skipped))} are incomplete or damaged (see above). '
            'Refusing to train from them; remove them (or the directory) to start afresh.')
      return None
    metadata = self.manager.item_metadata(chosen)['state']
    sj.check_checkpoint_matches(
        target, metadata, source=f'Checkpoint step {chosen} in {self.directory}',
        description=self.description,
        saved_description=saved_description(self.directory / str(chosen)))
    restored = self.manager.restore(chosen, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), record=ocp.args.JsonRestore()))
    state, record = restored['state'], restored['record'] or {}
    self._log(f'checkpoint: restored step {chosen} from {self.directory}')
    if self.show_fingerprints:
      self._log(f'checkpoint: restored step {chosen} fingerprint {fingerprint(state)}')
    return chosen, state, record


# ----------------------------------------------------------------------------- demo


def add_resume_options(parser: argparse.ArgumentParser, *, every: Optional[int] = None,
                       keep: int = 3) -> None:
  """The crash-safe checkpoint flags that the training examples share: how often and
  how many checkpoints `TrainCheckpointer` keeps, async or not, and fingerprints."""
  _cli.option(parser, '--ckpt-every', type=int, default=every,
              help='save every this many steps (and after the last) with --ckpt-dir')
  _cli.option(parser, '--ckpt-keep', type=int, default=keep,
              help='checkpoints kept (the older are deleted)')
  _cli.option(parser, '--sync-ckpt', action='store_true',
              help='save synchronously; by default Orbax saves asynchronously, training '
                   'while a background thread writes')
  _cli.option(parser, '--ckpt-fingerprints', action='store_true',
              help='print a sha256 of params + state at every save and restore (a host '
                   'copy of every array; used by tools/crash_resume.py)')


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
  description = sj.describe_state(tx, params)
  save_checkpoint(path, saved, description)
  target = abstract_target(tx, jax.eval_shape(lambda: params))
  return {'tx': tx, 'saved': saved,
          'restored': restore_checkpoint(path, target, description)}


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
