"""The Flax sharding route on a real MaxText tree, for tests/structure/test_flax.py.

  python tests/support/metadata_runs.py OUT   # on 8 simulated CPU devices; writes OUT/metadata.json

The parameters are MaxText Mixtral's (scanned layers, tests/data/real_trees), as
`nnx.Param`s carrying their logical axis names, held by a tiny `nnx.Module` and
trained through a real `nnx.Optimizer`. The shardings of the model and optimizer
states come from the plain Flax route,
`nn.logical_to_mesh_sharding(nnx.get_partition_spec(state), mesh, RULES)`, and a
jitted step with those `in_shardings`/`out_shardings` runs 3 steps on a (2, 2, 2)
mesh; the same step on one device is the reference. For each optimizer the JSON
records the error of the route (None if it worked), the largest difference from the
single-device run, and the state leaves whose spec differs from `sj.state_shardings`.
"""

from __future__ import annotations

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                           + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import json  # noqa: E402
from pathlib import Path  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Callable  # noqa: E402

from flax import nnx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import skewadam_jax as sj  # noqa: E402
from skewadam_jax.structure import paths as _paths  # noqa: E402

RECORD = ROOT / 'tests' / 'data' / 'real_trees' / 'maxtext_mixtral_scan.json'
N_STEPS = 3
MESH_SHAPE = (2, 2, 2)
MESH_AXES = ('data', 'model', 'expert')
# MaxText's logical names -> mesh axes: embeddings on 'data', heads, vocabulary and the
# experts' embedding axis on 'model', experts on 'expert'; the MoE hidden axis (40, not
# a multiple of 2 x AdamPM's group of 8), layers and head dims replicated.
RULES = (
    ('exp', 'expert'),
    ('embed', 'data'),
    ('embed_attn', 'data'),
    ('embed_vocab', 'data'),
    ('norm', 'data'),
    ('embed_moe', 'model'),
    ('q_heads', 'model'),
    ('kv_heads', 'model'),
    ('heads', 'model'),
    ('vocab', 'model'),
    ('mlp_moe', None),
    ('layers', None),
    ('kv', None),
    ('kv_head_dim', None),
)
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    'skewadam': lambda: sj.skewadam(1e-3),
    'adampm': lambda: sj.adampm(1e-3),
    'adamw': lambda: optax.adamw(1e-3),  # the control: full-rank state only
}


class Holder(nnx.Module):
  """A module whose attributes are the recorded top-level subtrees of `nnx.Param`s."""

  def __init__(self, tree: dict[str, Any]):
    for name, sub in tree.items():
      setattr(self, name, nnx.data(sub))


def make_model() -> Holder:
  """The recorded tree as `nnx.Param`s (small random values) with their axis names."""
  record = json.loads(RECORD.read_text())
  rng = np.random.default_rng(0)
  tree: dict[str, Any] = {}
  with nnx.use_eager_sharding(False):
    for leaf in record['leaves']:
      *parents, name = leaf['path'].split('/')
      node = tree
      for p in parents:
        node = node.setdefault(p, {})
      value = jnp.asarray((0.1 * rng.standard_normal(leaf['shape'])).astype(leaf['dtype']))
      names = leaf['axis_names']
      node[name] = (nnx.Param(value) if names is None
                    else nnx.Param(value, out_sharding=tuple(names)))
    return Holder(tree)


def loss_fn(model: Holder) -> jax.Array:
  """A quadratic in every parameter (different targets, so every leaf moves)."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return sum(jnp.sum(jnp.square(p - 0.01 * i)) for i, p in enumerate(leaves))


def _flat(tree: Any) -> dict[str, Any]:
  """Normalised path -> leaf (trailing `value` dropped), Variables looked through."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_paths.path_str(p): leaf for p, leaf in leaves}


def _trimmed(spec: Any) -> tuple[Any, ...]:
  entries = tuple(spec)
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return entries


def run(name: str) -> dict[str, Any]:
  """Trains 3 steps on the mesh through the Flax route and on one device."""
  tx = OPTIMIZERS[name]()
  mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_SHAPE))
  model = make_model()
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  model_def, model_state = nnx.split(model)
  opt_def, opt_state = nnx.split(optimizer)

  def step(model_state, opt_state):
    model = nnx.merge(model_def, model_state)
    optimizer = nnx.merge(opt_def, opt_state)
    optimizer.update(model, nnx.grad(loss_fn)(model))
    return nnx.state(model), nnx.state(optimizer)

  out: dict[str, Any] = {'error': None}
  # The reference: the same step on one device.
  single = jax.jit(step)
  ref = (model_state, opt_state)
  for _ in range(N_STEPS):
    ref = single(*ref)
  ref_flat = _flat(ref)
  out['moved'] = float(max(
      np.max(np.abs(np.asarray(a) - np.asarray(b)))
      for a, b in zip(jax.tree.leaves(model_state), jax.tree.leaves(ref[0]))))

  try:
    # The plain Flax route.
    specs = nnx.get_partition_spec((model_state, opt_state))
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    start = time.perf_counter()
    sharded = jax.jit(step, in_shardings=shardings, out_shardings=shardings)
    states = jax.jit(lambda s: s, out_shardings=shardings)((model_state, opt_state))
    for _ in range(N_STEPS):
      states = sharded(*states)
    jax.block_until_ready(states)
    out['mesh_seconds'] = time.perf_counter() - start
  except Exception as e:  # noqa: BLE001 -- the message is the result
    out['error'] = f'{type(e).__name__}: {e}'
    out['traceback'] = traceback.format_exc()[-4000:]
    return out

  flat = _flat(states)
  out['leaves'] = len(flat)
  out['max_diff'] = float(max(
      np.max(np.abs(np.asarray(flat[k], np.float64) - np.asarray(ref_flat[k], np.float64)))
      for k in flat if np.size(flat[k])))
  out['same_paths'] = sorted(flat) == sorted(ref_flat)

  # The route's specs against sj.state_shardings, on the state nnx.Optimizer holds.
  route = _flat(nn.logical_to_mesh_sharding(nnx.get_partition_spec(optimizer.opt_state),
                                            mesh, RULES))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  param_specs = nn.logical_to_mesh(nnx.as_pure(nnx.get_partition_spec(
      nnx.state(model, nnx.Param))), RULES)
  expected = _flat(sj.state_shardings(tx, params, param_specs, mesh=mesh))
  out['compared'] = len(expected)
  out['missing'] = sorted(set(expected) - set(route))
  out['mismatches'] = {
      path: [str(route[path].spec), str(s.spec)] for path, s in expected.items()
      if path in route and _trimmed(route[path].spec) != _trimmed(s.spec)}
  # The state's real shardings after the steps, where the route put them.
  final = _flat(states[1])
  out['sharded_leaves'] = sorted(
      path for path, x in final.items() if any(e is not None for e in x.sharding.spec))
  # Statistics of a lower rank than their parameter: proof that the reduced ones exist.
  out['reduced_rank_leaves'] = sum(
      1 for path, x in final.items() if '/v_row/' in path or '/v_col/' in path)
  return out


def main(out: str) -> None:
  results: dict[str, Any] = {'devices': jax.device_count()}
  for name in OPTIMIZERS:
    start = time.perf_counter()
    results[name] = run(name)
    results[name]['seconds'] = time.perf_counter() - start
  Path(out, 'metadata.json').write_text(json.dumps(results, indent=1))


if __name__ == '__main__':
  main(*sys.argv[1:])
