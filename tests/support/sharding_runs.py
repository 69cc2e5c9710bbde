"""Multi-device runs for tests/integrations/test_sharding.py, executed in subprocesses on 8
CPU devices.

  python tests/support/sharding_runs.py train  OUT   # single device vs meshes, pmap, errors; saves
  python tests/support/sharding_runs.py resume OUT   # a fresh process: restore and continue

Each mode writes OUT/<mode>.json with the measured figures; `train` also writes the
uninterrupted trajectories (`*.npz`) and Orbax checkpoints of step K that `resume`
continues from. The parameter tree has the MoE LM's paths (every tier); gradients
are a deterministic elementwise function of the parameters and the step, so that every
run sees the same gradients whatever its sharding.
"""

from __future__ import annotations

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                           + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import functools  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
import sys  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples import checkpointing  # noqa: E402
from examples import pmap_data_parallel as pdp  # noqa: E402
import skewadam_jax as sj  # noqa: E402
import trees  # noqa: E402  (beside this file)

N_STEPS = 5
K = 2  # checkpoint after this step
EXPERT_SPEC = P('expert', None, 'data')
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    'skewadam': lambda: sj.skewadam(1e-2, weight_decay=0.1),
    'adampm': lambda: sj.adampm(1e-2, weight_decay=0.1, group_size=8),
    # Every tier pooled along the (sharded) last axis: AdamPM's grouping inside tiers.
    'grouped_tiers': lambda: sj.skewadam(1e-2, weight_decay=0.1, tiers={
        name: tier.replace(second_moment='grouped', group_size=8)
        for name, tier in sj.PUBLISHED_TIERS.items()}),
}
RESUMED = ('skewadam', 'adampm')


# ----------------------------------------------------------------------------- setup


# name -> shape: the MoE LM's paths (examples/moe_lm), a few leaves of each tier.
LEAVES: dict[str, tuple[int, ...]] = {
    'embed/embedding': (64, 32),
    'blocks/0/attn_norm/scale': (32,),
    'blocks/0/attn/q_proj/kernel': (32, 32),
    'blocks/1/moe/router/kernel': (32, 4),
    'blocks/1/moe/experts/w1': (4, 32, 64),
    'blocks/1/moe/experts/w3': (4, 64, 32),
}


def abstract_params() -> Any:
  """Nested dicts of `jax.ShapeDtypeStruct`s with the MoE LM's paths (float32)."""
  return trees.abstract_tree(LEAVES)


def init_params(abstract: Any) -> Any:
  """Deterministic N(0, 0.02^2) host arrays of the abstract shapes."""
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)


def param_specs(abstract: Any) -> Any:
  """Expert stacks `P('expert', None, 'data')`; 2-D backbone kernels split on `data`."""
  labels = sj.moe_param_labels(abstract)

  def spec(a, label):
    if label == 'experts':
      return EXPERT_SPEC
    if label == 'backbone' and a.ndim == 2 and a.shape[-1] % 8 == 0:
      return P(None, 'data')
    return P()

  return jax.tree.map(spec, abstract, labels)


def explicit_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
  return jax.make_mesh(shape, ('data', 'expert'))


def grads_at(seed: Any, t: jax.Array) -> Any:
  """Step-dependent pseudo-gradients, elementwise in the fixed array `seed`.

  Elementwise, so they keep every sharding and are bitwise the same on any mesh; a
  function of the initial params rather than the current ones, so that float rounding
  differences in the trajectory are not amplified by the gradient.
  """
  return jax.tree.map(
      lambda p: jnp.sin(37.0 * p * (t + 1.0)) + 0.1 * jnp.cos(11.0 * p + t), seed)


@functools.cache
def tx_for(name: str) -> optax.GradientTransformation:
  """One optimizer object per name, so that jitted steps are reused across runs."""
  return OPTIMIZERS[name]()


@functools.cache
def step_for(name: str) -> Callable[..., Any]:
  """The donated, jitted training step of optimizer `name`."""
  tx = tx_for(name)

  def step(params, state, seed, t):
    updates, state = tx.update(grads_at(seed, t), state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def run(name, params, state, start, stop, on_step=None):
  """Steps `start..stop-1` of the donated step; `on_step(i, params, state)` after each.

  The gradient seed is the initial params, placed like `params`.
  """
  step = step_for(name)
  seed = jax.tree.map(lambda x, p: jax.device_put(x, p.sharding),
                      init_params(abstract_params()), params)
  for i in range(start, stop):
    params, state = step(params, state, seed, jnp.float32(i))
    if on_step is not None:
      on_step(i + 1, params, state)
  return params, state


def flat(tree: Any) -> dict[str, np.ndarray]:
  """`{keystr: host array}` of every leaf."""
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
  assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
  return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) if a[k].size else 0.0
             for k in a)


def bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
  return a.keys() == b.keys() and all(
      a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def save_npz(path: Path, params: Any, state: Any) -> None:
  np.savez(path, **{'params' + k: v for k, v in flat(params).items()},
           **{'state' + k: v for k, v in flat(state).items()})


def load_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  with np.load(path) as f:
    params = {k[len('params'):]: f[k] for k in f.files if k.startswith('params')}
    state = {k[len('state'):]: f[k] for k in f.files if k.startswith('state')}
  return params, state


def specs_of(tree: Any) -> dict[str, list[Any]]:
  """`{keystr: spec entries}` of the shardings of every leaf (JSON-friendly)."""
  def entries(x):
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    return [list(e) if isinstance(e, tuple) else e for e in spec]
  return {jax.tree_util.keystr(k): entries(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


# ----------------------------------------------------------------------------- train


def train_single(name: str, out: Path, results: dict[str, Any]) -> dict[str, np.ndarray]:
  """One device: 5 steps, a checkpoint after step K, the final params/state to npz."""
  tx = tx_for(name)
  host = init_params(abstract_params())
  params = jax.device_put(host, jax.devices()[0])
  # Committed like the step's outputs (init's are not), or the step compiles twice.
  state = jax.device_put(jax.jit(tx.init)(params), jax.devices()[0])

  def on_step(i, p, s):
    if i == K:
      checkpointing.save_checkpoint(out / f'single_{name}' / str(K),
                                    {'params': p, 'opt_state': s})

  params, state = run(name, params, state, 0, N_STEPS, on_step)
  save_npz(out / f'single_{name}.npz', params, state)
  results[f'single_{name}_moved'] = max_diff(flat(params), flat(host))
  return {**{'p' + k: v for k, v in flat(params).items()},
          **{'s' + k: v for k, v in flat(state).items()}}


def train_mesh(name: str, out: Path, single: dict[str, np.ndarray],
               results: dict[str, Any]) -> None:
  """2 x 4 Explicit mesh: 5 donated steps from the same start, compared to one device."""
  tx = tx_for(name)
  abstract = abstract_params()
  specs = param_specs(abstract)
  mesh = explicit_mesh((2, 4))
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                          init_params(abstract), specs)
    state = jax.jit(tx.init)(params)
    results[f'mesh_{name}_state_specs'] = specs_of(state)
    # What the helper predicts must be what jit(init) produced under the Explicit mesh.
    predicted = sj.state_shardings(tx, abstract, specs)
    results[f'mesh_{name}_helper_specs'] = {
        jax.tree_util.keystr(k): list(v)
        for k, v in jax.tree_util.tree_leaves_with_path(
            predicted, is_leaf=lambda x: isinstance(x, P))}
    first = (jax.tree.leaves(params)[0], jax.tree.leaves(state)[1])
    donated = []

    def on_step(i, p, s):
      if i == 1:
        donated.append(all(x.is_deleted() for x in first))
      if i == K:
        checkpointing.save_checkpoint(out / f'mesh_{name}' / str(K),
                                      {'params': p, 'opt_state': s})
        save_npz(out / f'mesh_{name}_k.npz', p, s)

    params, state = run(name, params, state, 0, N_STEPS, on_step)
    results[f'mesh_{name}_donated'] = donated[0]
    results[f'mesh_{name}_final_specs'] = specs_of(state)
  save_npz(out / f'mesh_{name}.npz', params, state)
  got = {**{'p' + k: v for k, v in flat(params).items()},
         **{'s' + k: v for k, v in flat(state).items()}}
  results[f'mesh_{name}_vs_single'] = max_diff(got, single)


def train_auto_mesh(name: str, single: dict[str, np.ndarray], results: dict[str, Any]) -> None:
  """2 x 4 Auto mesh: shardings given to jit by `state_shardings`; same numbers."""
  tx = tx_for(name)
  abstract = abstract_params()
  mesh = jax.make_mesh((2, 4), ('data', 'expert'), axis_types=(AxisType.Auto,) * 2)
  param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(abstract))
  state_sh = sj.state_shardings(tx, abstract, param_sh)
  params = jax.device_put(init_params(abstract), param_sh)
  state = jax.jit(tx.init, out_shardings=state_sh)(params)

  def step(p, s, seed, t):
    updates, s = tx.update(grads_at(seed, t), s, p)
    return optax.apply_updates(p, updates), s

  jstep = jax.jit(step, in_shardings=(param_sh, state_sh, param_sh, None),
                  out_shardings=(param_sh, state_sh), donate_argnums=(0, 1))
  seed = jax.device_put(init_params(abstract), param_sh)
  for i in range(N_STEPS):
    params, state = jstep(params, state, seed, jnp.float32(i))
  got = {**{'p' + k: v for k, v in flat(params).items()},
         **{'s' + k: v for k, v in flat(state).items()}}
  results[f'auto_{name}_vs_single'] = max_diff(got, single)
  results[f'auto_{name}_state_specs'] = specs_of(state)


def soft_moe_loss(params: Any, batch: jax.Array, key: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of a small dense-mixture MoE (every expert weighted)."""
  del key
  block0, moe = params['blocks']['0'], params['blocks']['1']['moe']
  x = params['embed']['embedding'][batch[:, :-1]] * block0['attn_norm']['scale']
  x = x + jnp.tanh(x @ block0['attn']['q_proj']['kernel'])
  gates = jax.nn.softmax(x @ moe['router']['kernel'], axis=-1)
  h = jax.nn.silu(jnp.einsum('bsd,edf->bsef', x, moe['experts']['w1']))
  y = jnp.einsum('bsef,efd->bsed', h, moe['experts']['w3'])
  x = x + jnp.einsum('bse,bsed->bsd', gates, y)
  logits = x @ params['embed']['embedding'].T
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))


def pmap_check(results: dict[str, Any]) -> None:
  """pmap data parallelism (examples/pmap_data_parallel.py) vs the concatenated batch."""
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                        abstract_params())
  params['blocks']['0']['attn_norm']['scale'] += 1.0
  batches = [rng.integers(0, 64, size=(16, 9)).astype(np.int32) for _ in range(3)]
  key = jax.random.key(0)
  for name in ('skewadam',):
    tx = tx_for(name)
    data_parallel = pdp.train_pmap(soft_moe_loss, tx, params, batches, key, 8)
    single = pdp.train_single(soft_moe_loss, tx, params, batches, key)
    results[f'pmap_{name}_vs_single'] = pdp.max_abs_diff(data_parallel, single)
    results[f'pmap_{name}_moved'] = pdp.max_abs_diff(single, params)


def straddle_errors(results: dict[str, Any]) -> None:
  """Messages of grouping along a sharded axis whose shards do not hold whole groups."""
  mesh = explicit_mesh((2, 4))
  spec = P(None, 'data')  # shard length 48 / 2 = 24
  txs = {
      'adampm': lambda g: sj.adampm(1e-3, group_size=g),
      'tiered': lambda g: sj.scale_by_tiered_adam(second_moment='grouped', group_size=g),
  }
  with jax.set_mesh(mesh):
    w = jax.device_put(np.ones((8, 48), np.float32), NamedSharding(mesh, spec))
    for name, make in txs.items():
      try:
        jax.jit(make(16).init)({'w': w})
        results[f'straddle_{name}'] = None
      except ValueError as e:
        results[f'straddle_{name}'] = str(e)
      state = jax.jit(make(8).init)({'w': w})  # 24 % 8 == 0: whole groups per shard
      results[f'whole_groups_{name}_spec'] = [list(v) for v in specs_of(state).values()
                                              if len(v) == 2]
  abstract = {'w': jax.ShapeDtypeStruct((8, 48), jnp.float32)}
  try:
    sj.state_shardings(sj.adampm(1e-3, group_size=16), abstract,
                       {'w': NamedSharding(mesh, spec)})
    results['straddle_helper'] = None
  except ValueError as e:
    results['straddle_helper'] = str(e)


# ----------------------------------------------------------------------------- resume


def restore_and_continue(name: str, out: Path, kind: str, mesh_shape: tuple[int, int] | None,
                         results: dict[str, Any], label: str) -> None:
  """Restores the step-K checkpoint of run `kind` onto `mesh_shape` (None: one device)
  and continues to step N; compares with the uninterrupted run."""
  tx = tx_for(name)
  abstract = abstract_params()
  if mesh_shape is None:
    target = checkpointing.abstract_target(tx, abstract)
    restored = checkpointing.restore_checkpoint(out / f'{kind}_{name}' / str(K), target)
    params, state = run(name, restored['params'], restored['opt_state'], K, N_STEPS)
  else:
    mesh = explicit_mesh(mesh_shape)
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(abstract))
    with jax.set_mesh(mesh):
      target = checkpointing.abstract_target(tx, abstract, param_sh)
      restored = checkpointing.restore_checkpoint(out / f'{kind}_{name}' / str(K), target)
      results[f'{label}_restored_specs'] = specs_of(restored['opt_state'])
      w1 = restored['params']['blocks']['1']['moe']['experts']['w1']
      results[f'{label}_mesh'] = dict(w1.sharding.mesh.shape)
      results[f'{label}_w1_shard_shape'] = list(w1.addressable_shards[0].data.shape)
      results[f'{label}_structure_ok'] = (
          jax.tree.structure(restored['opt_state'])
          == jax.tree.structure(jax.eval_shape(tx.init, abstract)))
      if kind == 'mesh':
        saved_p, saved_s = load_npz(out / f'mesh_{name}_k.npz')
        results[f'{label}_restored_bitwise'] = (
            bitwise_equal(flat(restored['params']), saved_p)
            and bitwise_equal(flat(restored['opt_state']), saved_s))
      params, state = run(name, restored['params'], restored['opt_state'], K, N_STEPS)
  ref_p, ref_s = load_npz(out / f'{kind}_{name}.npz')
  got_p, got_s = flat(params), flat(state)
  results[f'{label}_bitwise'] = bitwise_equal(got_p, ref_p) and bitwise_equal(got_s, ref_s)
  results[f'{label}_max_diff'] = max(max_diff(got_p, ref_p), max_diff(got_s, ref_s))


def main(mode: str, out: str) -> None:
  out = Path(out)
  results: dict[str, Any] = {'devices': jax.device_count()}
  if mode == 'train':
    for name in OPTIMIZERS:
      single = train_single(name, out, results)
      train_mesh(name, out, single, results)
      if name == 'skewadam':
        train_auto_mesh(name, single, results)
    pmap_check(results)
    straddle_errors(results)
  elif mode == 'resume':
    for name in RESUMED:
      restore_and_continue(name, out, 'single', None, results, f'single_{name}')
      restore_and_continue(name, out, 'mesh', (2, 4), results, f'mesh_{name}')
      restore_and_continue(name, out, 'mesh', (4, 2), results, f'remesh_{name}')
      restore_and_continue(name, out, 'mesh', None, results, f'unshard_{name}')
  else:
    raise ValueError(f'unknown mode {mode!r}')
  (out / f'{mode}.json').write_text(json.dumps(results, indent=1))


if __name__ == '__main__':
  main(*sys.argv[1:])
