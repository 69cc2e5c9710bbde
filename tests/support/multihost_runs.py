"""Two-process `jax.distributed` training for tests/integrations/test_multihost.py (CPU, gloo).

  python tests/support/multihost_runs.py PROCESS_ID PORT OUT  # one of 2 processes, 4 devices each
  python tests/support/multihost_runs.py single - OUT          # one process, 8 devices (and 1)
  python tests/support/multihost_runs.py ckpt PROCESS_ID PORT OUT CKPT_DIR # checkpointed, resumable

Both layouts train 5 donated steps of SkewAdam and AdamPM on the same (2, 4)
('data', 'expert') mesh from the same start, so the only difference is that the
`data` axis spans two processes in the first: its reductions go through the
cross-process (gloo) all-reduce. `single` also trains on one device without a mesh,
whose reductions run unsharded. Each run writes OUT/<run>_<name>.npz of the gathered
params and state (process 0 only) and OUT/<layout>.json of its topology.

`ckpt` trains SkewAdam for CKPT_STEPS steps on the same two-process mesh with the
examples' `TrainCheckpointer` (a checkpoint every CKPT_EVERY steps), resuming from the
newest intact step in CKPT_DIR; tools/crash_resume.py kills one process, restarts both
and compares OUT/ckpt_skewadam.npz with an uninterrupted run's.

Self-contained rather than importing tests/support/sharding_runs.py: that module sets XLA_FLAGS
to 8 devices at import and imports the examples. Importing this one has no side effects
beyond importing jax, so that pytest's doctest collection may import it.
"""

from __future__ import annotations

import os
import sys

if __name__ == '__main__':  # before jax is imported: the device count is read once
  _DEVICES = 8 if sys.argv[1] == 'single' else 4
  # The repository root, for `examples.checkpointing` in the `ckpt` mode.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={_DEVICES}'
  os.environ['JAX_PLATFORMS'] = 'cpu'

import contextlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import skewadam_jax as sj  # noqa: E402

N_STEPS = 5
CKPT_STEPS = 16
CKPT_EVERY = 2
MESH_SHAPE = (2, 4)
EXPERT_SPEC = P('expert', None, 'data')
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    'skewadam': lambda: sj.skewadam(1e-2, weight_decay=0.1),
    'adampm': lambda: sj.adampm(1e-2, weight_decay=0.1, group_size=8),
}
# name -> shape: MoE-shaped paths, so that `moe_param_labels` gives every SkewAdam tier.
LEAVES: dict[str, tuple[int, ...]] = {
    'blocks/0/attn_norm/scale': (32,),
    'blocks/0/attn/q_proj/kernel': (32, 32),
    'blocks/1/moe/router/kernel': (32, 4),
    'blocks/1/moe/experts/w1': (4, 32, 64),
    'blocks/1/moe/experts/w3': (4, 64, 32),
}


def init_params() -> Any:
  """Nested dicts of deterministic N(0, 0.02^2) float32 host arrays (same in every process)."""
  rng = np.random.default_rng(0)
  out: dict[str, Any] = {}
  for path, shape in LEAVES.items():
    node = out
    *parents, leaf = path.split('/')
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
  return out


def param_specs(params: Any) -> Any:
  """Expert stacks `P('expert', None, 'data')`; everything else replicated."""
  return jax.tree.map(lambda label: EXPERT_SPEC if label == 'experts' else P(),
                      sj.moe_param_labels(params))


def grads_at(seed: Any, t: jax.Array) -> Any:
  """Step-dependent pseudo-gradients, elementwise in the fixed initial params `seed`.

  Elementwise, so they are bitwise the same whatever the layout: any difference
  between the runs comes from the optimizer's own reductions.
  """
  return jax.tree.map(
      lambda p: jnp.sin(37.0 * p * (t + 1.0)) + 0.1 * jnp.cos(11.0 * p + t), seed)


def place(host: Any, mesh: jax.sharding.Mesh, specs: Any) -> Any:
  """Global arrays of the host values; each process fills only its addressable shards."""
  def one(x: np.ndarray, spec: P) -> jax.Array:
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                        lambda idx: x[idx], dtype=x.dtype)
  return jax.tree.map(one, host, specs)


def donated_step(tx: optax.GradientTransformation) -> Any:
  """`jit(step)` donating params and state; the pseudo-gradients are a function of the
  seed tree and the step number only."""
  def step(params, state, seed, t):
    updates, state = tx.update(grads_at(seed, t), state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def train(name: str, mesh: jax.sharding.Mesh | None) -> tuple[Any, Any, bool]:
  """5 donated, jitted steps on `mesh` (None: one device, no mesh); the final params
  and state, and whether all of the first step's params and state were donated."""
  tx = OPTIMIZERS[name]()
  host = init_params()
  specs = param_specs(host)

  jstep = donated_step(tx)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    if mesh is None:
      params, seed = jax.device_put((host, host), jax.devices()[0])
      # Committed like the step's outputs (init's are not), or the step compiles twice.
      state = jax.device_put(jax.jit(tx.init)(params), jax.devices()[0])
    else:
      params, seed = place(host, mesh, specs), place(host, mesh, specs)
      state = jax.jit(tx.init)(params)
    first = jax.tree.leaves((params, state))
    donated = False
    for i in range(N_STEPS):
      params, state = jstep(params, state, seed, np.float32(i))
      if i == 0:
        donated = all(x.is_deleted() for x in first)
  return params, state, donated


def flat(tree: Any) -> dict[str, np.ndarray]:
  """`{keystr: host array}` of every leaf."""
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def save_npz(path: Path, params: Any, state: Any) -> None:
  np.savez(path, **{'params' + k: v for k, v in flat(params).items()},
           **{'state' + k: v for k, v in flat(state).items()})


def train_checkpointed(ckpt_dir: str, out_dir: Path) -> None:
  """CKPT_STEPS donated steps of SkewAdam, checkpointed and resumed (a function of the
  step only: the pseudo-gradients take the step number); writes ckpt_skewadam.npz."""
  from examples import checkpointing  # imports Orbax; only this mode needs it

  tx = OPTIMIZERS['skewadam']()
  host = init_params()
  specs = param_specs(host)

  jstep = donated_step(tx)
  mesh = jax.make_mesh(MESH_SHAPE, ('data', 'expert'))
  with jax.set_mesh(mesh):
    params, seed = place(host, mesh, specs), place(host, mesh, specs)
    state = jax.jit(tx.init)(params)
    ckpt = checkpointing.TrainCheckpointer(
        ckpt_dir, every=CKPT_EVERY, log=lambda line: print(line, flush=True))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {'params': params, 'opt_state': state})
    restored = ckpt.restore(target)
    start = 0
    if restored is not None:
      start, saved, _ = restored
      params, state = saved['params'], saved['opt_state']
    for i in range(start, CKPT_STEPS):
      params, state = jstep(params, state, seed, np.float32(i))
      print(f'step {i + 1}', flush=True)
      ckpt.save(i + 1, {'params': params, 'opt_state': state}, force=i + 1 == CKPT_STEPS)
    ckpt.close()
    params, state = multihost_utils.process_allgather((params, state), tiled=True)
  if jax.process_index() == 0:
    save_npz(out_dir / 'ckpt_skewadam.npz', params, state)


def main(process_id: str, port: str, out: str, ckpt_dir: str | None = None) -> None:
  out_dir = Path(out)
  if ckpt_dir is not None:  # `ckpt PROCESS_ID PORT OUT CKPT_DIR`, shifted by the caller
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(f'localhost:{port}', num_processes=2,
                               process_id=int(process_id), initialization_timeout=120)
    train_checkpointed(ckpt_dir, out_dir)
    jax.distributed.shutdown()
    return
  layout = 'single' if process_id == 'single' else 'multi'
  if layout == 'multi':
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(f'localhost:{port}', num_processes=2,
                               process_id=int(process_id), initialization_timeout=120)
  mesh = jax.make_mesh(MESH_SHAPE, ('data', 'expert'))
  meshes: dict[str, jax.sharding.Mesh | None] = {layout: mesh}
  if layout == 'single':
    meshes['one_device'] = None
  info: dict[str, Any] = {
      'process_count': jax.process_count(),
      'device_count': jax.device_count(),
      'local_device_count': jax.local_device_count(),
      # Processes owning each row of the mesh's `data` axis.
      'data_rows_processes': [sorted({d.process_index for d in row})
                              for row in mesh.devices.tolist()],
      'collectives': jax.config.jax_cpu_collectives_implementation,
  }
  for run, run_mesh in meshes.items():
    for name in OPTIMIZERS:
      params, state, donated = train(name, run_mesh)
      w1 = params['blocks']['1']['moe']['experts']['w1']
      info[f'{run}_{name}_donated'] = donated
      info[f'{run}_{name}_w1_local_shards'] = len(w1.addressable_shards)
      info[f'{run}_{name}_w1_shard_shape'] = list(w1.addressable_shards[0].data.shape)
      # A collective: every process calls it; tiled gives the global arrays.
      params, state = multihost_utils.process_allgather((params, state), tiled=True)
      if jax.process_index() == 0:
        save_npz(out_dir / f'{run}_{name}.npz', params, state)
  if jax.process_index() == 0:
    (out_dir / f'{layout}.json').write_text(json.dumps(info, indent=1))
  if layout == 'multi':
    jax.distributed.shutdown()


if __name__ == '__main__':
  if sys.argv[1] == 'ckpt':
    main(*sys.argv[2:])
  else:
    main(*sys.argv[1:])
