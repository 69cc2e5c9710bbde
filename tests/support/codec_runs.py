"""Coded momentum on 4 simulated CPU devices, for tests/estimators/test_codec.py (a subprocess).

  python tests/support/codec_runs.py OUT    # writes OUT/codec.json

One process: the same 5 steps on one device, on an Auto mesh (state placed by
`sj.state_shardings`) and on an Explicit mesh (the state as `jit(tx.init)` places it);
an Orbax checkpoint of the sharded run after step 2, checked with
`sj.check_checkpoint_matches` and restored onto `sj.sharded_abstract_state`, then
continued; and a sharding that splits blocks across shards. Gradients are elementwise
in fixed arrays, so every run sees the same gradients whatever its sharding.
"""

from __future__ import annotations

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                           + ' --xla_force_host_platform_device_count=4').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import json  # noqa: E402
from pathlib import Path  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import skewadam_jax as sj  # noqa: E402

STEPS, K = 5, 2
# w3 has w1's shape and sharding: their experts share one Newton-Schulz call (written into
# one buffer at runtime offsets and read back), which must match one device too.
SHAPES = {'embed': (64, 32), 'norm': (32,), 'q_proj': (32, 32),
          'moe': {'router': (32, 4), 'experts': {'w1': (4, 32, 64), 'w2': (4, 64, 32),
                                                 'w3': (4, 32, 64)}}}
SPECS = {'embed': P(None, 'data'), 'norm': P(), 'q_proj': P(None, 'data'),
         'moe': {'router': P(), 'experts': {'w1': P('expert', None, 'data'),
                                            'w2': P('expert', 'data', None),
                                            'w3': P('expert', None, 'data')}}}
LABELS = {'embed': 'backbone', 'norm': 'backbone', 'q_proj': 'backbone',
          'moe': {'router': 'router', 'experts': {'w1': 'experts', 'w2': 'experts',
                                                  'w3': 'experts'}}}


def make_tx(expert_block: int = 32, orthogonal: bool = True, stochastic: bool = False
            ) -> optax.GradientTransformation:
  # The orthogonal estimator's Gram products do not run under an Explicit mesh that
  # shards a matrix axis (XLA asks for their output sharding): factored experts there.
  # `stochastic`: both codecs linear with stochastic rounding (random bits drawn inside
  # the step, which must not depend on the sharding), the backbone's at 5 bits (bit
  # planes: a shard of 16 columns holds two whole groups of 8 codes).
  rounding = 'stochastic' if stochastic else 'nearest'
  tiers = {
      'backbone': sj.PUBLISHED_TIERS['backbone'].replace(
          mu_codec=sj.Blockwise(5 if stochastic else 8, 16, rounding=rounding)),
      'experts': sj.Tier(nesterov=True, b1=0.95, clip_threshold=None,
                         second_moment=(sj.Orthogonal(fallback=sj.Factored()) if orthogonal
                                        else 'factored'),
                         mu_codec=sj.Blockwise(4, expert_block,
                                               'linear' if stochastic else 'dynamic',
                                               rounding=rounding)),
      'router': sj.ADAM_ROUTER_TIERS['router'],
  }
  return sj.skewadam(1e-2, weight_decay=0.1, tiers=tiers, param_labels=LABELS)


def init_params() -> Any:
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: (0.02 * rng.standard_normal(s)).astype(np.float32), SHAPES,
                      is_leaf=lambda x: isinstance(x, tuple))


def grads_at(seed: Any, t: jax.Array) -> Any:
  return jax.tree.map(lambda p: jnp.sin(37.0 * p * (t + 1.0)) + 0.1 * jnp.cos(11.0 * p + t),
                      seed)


def flat(tree: Any) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def bitwise(a: Any, b: Any) -> bool:
  a, b = flat(a), flat(b)
  return a.keys() == b.keys() and all(
      a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def max_diff(a: Any, b: Any) -> float:
  a, b = flat(a), flat(b)
  return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)


def main(out: Path) -> None:
  tx = make_tx()
  host = init_params()
  results: dict[str, Any] = {'devices': len(jax.devices())}
  sharded_runs(tx, host, results, out)
  explicit_runs(make_tx(orthogonal=False), host, results, '')
  # Stochastic rounding: the same codes whatever the sharding.
  stochastic = make_tx(stochastic=True)
  sharded_runs(stochastic, host, results, None, 'stochastic_')
  explicit_runs(make_tx(orthogonal=False, stochastic=True), host, results, 'stochastic_')

  # Blocks of 64 along the experts' last axis, split over 'data' into 32 per shard.
  mesh = jax.make_mesh((2, 2), ('data', 'expert'), axis_types=(AxisType.Auto,) * 2)
  try:
    sj.state_shardings(make_tx(expert_block=64), host,
                       jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS))
    results['straddle_error'] = None
  except ValueError as e:
    results['straddle_error'] = str(e)
  (out / 'codec.json').write_text(json.dumps(results, indent=1))


def _stepper(tx: optax.GradientTransformation):
  def step(params, state, seed, t):
    updates, state = tx.update(grads_at(seed, t), state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(params, state, seed, start, stop, jitted):
  for i in range(start, stop):
    params, state = jitted(params, state, seed, jnp.float32(i))
  return params, state


def sharded_runs(tx: optax.GradientTransformation, host: Any, results: dict[str, Any],
                 out: Any, tag: str = '') -> None:
  """One device against an Auto mesh; with `out`, also the Orbax checkpoint checks."""
  step = _stepper(tx)
  # One device.
  dev = jax.devices()[0]
  params = jax.device_put(host, dev)
  single = run(params, jax.device_put(jax.jit(tx.init)(params), dev), params, 0, STEPS,
               jax.jit(step))

  # Auto mesh: params and state placed by the specs and sj.state_shardings.
  mesh = jax.make_mesh((2, 2), ('data', 'expert'), axis_types=(AxisType.Auto,) * 2)
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS)
  s_sh = sj.state_shardings(tx, host, p_sh)
  params = jax.device_put(host, p_sh)
  state = jax.jit(tx.init, out_shardings=s_sh)(params)
  stepped = jax.jit(step, in_shardings=(p_sh, s_sh, p_sh, None), out_shardings=(p_sh, s_sh))
  half = run(params, state, params, 0, K, stepped)
  if out is None:
    sharded = run(*half, params, K, STEPS, stepped)
    results[tag + 'sharded_vs_single_params_max_diff'] = max_diff(sharded[0], single[0])
    results[tag + 'sharded_vs_single_codes_differ'] = _codes_differ(sharded, single)
    return
  mu = half[1][0].mu
  results['mu_specs'] = {
      'embed': [list(mu['embed'].codes.sharding.spec), list(mu['embed'].scales.sharding.spec)],
      'w1': [list(mu['moe']['experts']['w1'].codes.sharding.spec),
             list(mu['moe']['experts']['w1'].scales.sharding.spec)]}
  # Orbax: save after step K, check the checkpoint, restore onto the sharded target.
  ckpt = ocp.StandardCheckpointer()
  path = out / 'ckpt'
  ckpt.save(path, {'params': half[0], 'opt_state': half[1]})
  ckpt.wait_until_finished()
  sharded = run(*half, params, K, STEPS, stepped)
  target = {'params': jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                     sharding=s), host, p_sh),
            'opt_state': sj.sharded_abstract_state(tx, host, p_sh)}
  sj.check_checkpoint_matches(target, ckpt.metadata(path))
  restored = ckpt.restore(path, target)
  resumed = run(restored['params'], restored['opt_state'], params, K, STEPS, stepped)
  results['resume_bitwise'] = bitwise(resumed, sharded)
  results['restored_bitwise'] = bitwise((restored['params'], restored['opt_state']), half)
  other = {'params': target['params'],
           'opt_state': sj.sharded_abstract_state(make_tx(expert_block=16), host, p_sh)}
  try:
    sj.check_checkpoint_matches(other, ckpt.metadata(path))
    results['other_codec_error'] = None
  except ValueError as e:
    results['other_codec_error'] = str(e)
  results['sharded_vs_single_bitwise'] = bitwise(sharded, single)
  results['sharded_vs_single_params_max_diff'] = max_diff(sharded[0], single[0])
  results['sharded_vs_single_codes_differ'] = _codes_differ(sharded, single)


def _codes_differ(a: Any, b: Any) -> int:
  return int(sum(int(np.sum(np.asarray(x) != np.asarray(y)))
                 for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]))
                 if x.dtype == np.uint8))


def explicit_runs(tx: optax.GradientTransformation, host: Any, results: dict[str, Any],
                  tag: str) -> None:
  """Explicit mesh: jit(tx.init) places the state itself; sj.state_shardings agrees."""
  step = _stepper(tx)
  dev = jax.devices()[0]
  params = jax.device_put(host, dev)
  single = run(params, jax.device_put(jax.jit(tx.init)(params), dev), params, 0, STEPS,
               jax.jit(step))
  emesh = jax.make_mesh((2, 2), ('data', 'expert'), axis_types=(AxisType.Explicit,) * 2)
  with jax.sharding.use_mesh(emesh) if hasattr(jax.sharding, 'use_mesh') else jax.set_mesh(
      emesh):
    e_sh = jax.tree.map(lambda s: NamedSharding(emesh, s), SPECS)
    e_params = jax.device_put(host, e_sh)
    e_state = jax.jit(tx.init)(e_params)
    want = sj.state_shardings(tx, host, e_sh)
    results[tag + 'explicit_init_matches'] = all(
        a.sharding.spec == b.spec or (tuple(a.sharding.spec) + (None,) * a.ndim)[:a.ndim]
        == (tuple(b.spec) + (None,) * a.ndim)[:a.ndim]
        for a, b in zip(jax.tree.leaves(e_state), jax.tree.leaves(want)))
    explicit = run(e_params, e_state, e_params, 0, STEPS, jax.jit(step))
    results[tag + 'explicit_vs_single_params_max_diff'] = max_diff(explicit[0], single[0])
    results[tag + 'explicit_vs_single_codes_differ'] = _codes_differ(explicit, single)
    results[tag + 'explicit_state_specs_kept'] = all(
        a.sharding.spec == b.sharding.spec
        for a, b in zip(jax.tree.leaves(explicit[1]), jax.tree.leaves(e_state)))


if __name__ == '__main__':
  main(Path(sys.argv[1]))
