"""Axis names of the optimizer state's Flax boxes: the Flax sharding route works.

`nnx.Optimizer` hands `tx.init` `nnx.Param`s carrying logical axis names, and Flax's
route to the state's shardings reads the names of each state box:
`nn.logical_to_mesh_sharding(nnx.get_partition_spec(state), mesh, rules)`. Every
statistic's box must therefore name the axes the statistic keeps. The unit tests run on
small NNX and Linen trees here; the acceptance test trains MaxText Mixtral's recorded
tree through a real `nnx.Optimizer` on 8 simulated CPU devices, in a subprocess
(tests/support/metadata_runs.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
from typing import Any

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax
import pytest

import skewadam_jax as sj
from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import paths as _paths

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'tests' / 'support' / 'metadata_runs.py'
to_opt_state = nnx.training.optimizer.to_opt_state

# path -> (shape, logical axis names): every tier and estimator of SkewAdam.
LEAVES: dict[str, tuple[tuple[int, ...], tuple[Any, ...]]] = {
    'embed/embedding': ((16, 8), ('vocab', 'embed')),
    'attn/query/kernel': ((8, 3, 4, 2), ('embed', 'layers', 'heads', 'kv')),
    'attn_norm/scale': ((8,), ('norm',)),
    'moe/router/kernel': ((8, 4), ('embed', None)),
    'moe/experts/w1': ((4, 8, 16), ('exp', 'embed', 'mlp')),
}
FACTORIES = {
    'skewadam': lambda: sj.skewadam(1e-3),
    'adampm': lambda: sj.adampm(1e-3, group_size=2),
    'grouped_tiers': lambda: sj.skewadam(1e-3, tiers={
        name: tier.replace(second_moment='grouped', group_size=2)
        for name, tier in sj.PUBLISHED_TIERS.items()}),
    'adamw': lambda: optax.adamw(1e-3),
}
RULES = (('vocab', 'model'), ('embed', 'data'), ('heads', 'model'), ('exp', 'expert'),
         ('mlp', 'model'), ('norm', None), ('layers', None), ('kv', None))


def _nest(make) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for path, (shape, names) in LEAVES.items():
    *parents, name = path.split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = make(jnp.full(shape, 0.5, jnp.float32), names)
  return tree


def nnx_params() -> nnx.State:
  """What `nnx.Optimizer` hands `tx.init`: an `nnx.State` of named `nnx.Param`s."""
  with nnx.use_eager_sharding(False):
    return nnx.State(_nest(lambda x, names: nnx.Param(x, out_sharding=names)))


def linen_params() -> dict[str, Any]:
  """Boxed Linen params: LogicallyPartitioned (with rules) and Partitioned boxes."""
  def box(x, names):
    if names[0] == 'exp':
      return nn.LogicallyPartitioned(x, names=names, rules=(('exp', 'expert'),))
    return nn.Partitioned(x, names=names)
  return {'params': _nest(box)}


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _boxes(tree: Any) -> dict[str, Any]:
  """Normalised path -> Flax box (NNX Variable or Linen AxisMetadata)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, (nnx.Variable, nn.meta.AxisMetadata)))
  return {_paths.path_str(p): b for p, b in flat}


def _names(box: Any) -> tuple[Any, ...]:
  if isinstance(box, nn.meta.AxisMetadata):
    return tuple(box.names)
  return tuple(box.get_metadata('out_sharding'))


def _value(box: Any) -> Any:
  return box.value if isinstance(box, nn.meta.AxisMetadata) else box.get_value()


def _tier_state(state: Any, tier: str) -> sj.TieredAdamState:
  """The state of `skewadam` (one for every tier; `tier` says which leaves a test reads)."""
  del tier
  return state[0]


# ------------------------------------------------------------------------ unit tests


@pytest.mark.parametrize('kind', ['nnx', 'linen'])
def test_factored_statistics_name_the_axes_they_keep(kind):
  params = nnx_params() if kind == 'nnx' else linen_params()
  prefix = '' if kind == 'nnx' else 'params/'
  state = sj.skewadam(1e-3).init(params)
  backbone, experts = _tier_state(state, 'backbone'), _tier_state(state, 'experts')
  rows, cols = _boxes(experts.v_row), _boxes(experts.v_col)
  assert _names(rows[prefix + 'moe/experts/w1']) == ('exp', 'embed')
  assert _names(cols[prefix + 'moe/experts/w1']) == ('exp', 'mlp')
  rows, cols = _boxes(backbone.v_row), _boxes(backbone.v_col)
  assert _names(rows[prefix + 'embed/embedding']) == ('vocab',)
  assert _names(cols[prefix + 'embed/embedding']) == ('embed',)
  # Each name really is the name of the axis its statistic keeps.
  for path, box in rows.items():
    if not isinstance(_value(box), optax.MaskedNode):
      assert len(_names(box)) == _value(box).ndim, path
  # Momentum, the exact second moments and the router's keep the parameter's names.
  assert _names(_boxes(backbone.mu)[prefix + 'embed/embedding']) == ('vocab', 'embed')
  assert _names(_boxes(backbone.v)[prefix + 'attn_norm/scale']) == ('norm',)
  assert _names(_boxes(_tier_state(state, 'router').v)[prefix + 'moe/router/kernel']) == (
      'embed', None)


def test_linen_boxes_keep_their_other_fields():
  state = sj.skewadam(1e-3).init(linen_params())
  box = _boxes(_tier_state(state, 'experts').v_row)['params/moe/experts/w1']
  assert type(box) is nn.LogicallyPartitioned
  assert box.rules == (('exp', 'expert'),)
  assert box.value.shape == (4, 8)


def test_nnx_variables_keep_their_type_and_other_metadata():
  state = sj.skewadam(1e-3).init(nnx_params())
  box = _boxes(_tier_state(state, 'experts').v_col)['moe/experts/w1']
  assert type(box) is nnx.Param
  metadata = box.get_metadata()
  assert metadata['out_sharding'] == ('exp', 'mlp')
  assert metadata['eager_sharding'] is False
  assert 'sharding_names' not in metadata and 'sharding' not in metadata


@pytest.mark.parametrize('name', ['adampm', 'adamw'])
def test_full_rank_state_keeps_the_parameter_names(name):
  params = nnx_params()
  state = FACTORIES[name]().init(params)
  expected = {path: _names(box) for path, box in _boxes(params).items()}
  for field in (state[0].mu, state[0].nu):
    assert {path: _names(box) for path, box in _boxes(field).items()} == expected


def test_pooled_nu_keeps_names_and_pools_the_last_axis():
  state = sj.adampm(1e-3, group_size=2).init(nnx_params())
  box = _boxes(state[0].nu)['moe/experts/w1']
  assert _value(box).shape == (4, 8, 8)
  assert _names(box) == ('exp', 'embed', 'mlp')


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_route_specs_equal_state_shardings(name):
  """With the names read as mesh axes, Flax's route gives `state_shardings`' specs."""
  tx = FACTORIES[name]()
  params = nnx_params()
  route = _boxes(nnx.get_partition_spec(to_opt_state(tx.init(params))))
  pure = nnx.as_pure(params)
  specs = jax.tree.map(lambda box: P(*_names(box)), params, is_leaf=_is_var)
  expected, _ = jax.tree_util.tree_flatten_with_path(
      sj.state_shardings(tx, pure, nnx.as_pure(specs)))
  assert expected
  for path, spec in expected:
    key = _paths.path_str(path)
    got = route[key].get_value()
    assert _trimmed(got) == _trimmed(spec), key


def _trimmed(spec: Any) -> tuple[Any, ...]:
  entries = tuple(spec)
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return entries


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_nnx_route_places_the_state_under_jit(name):
  """`jit(init, out_shardings=<Flax route>)` on a one-device mesh (ranks are checked
  whatever the mesh size), and `to_opt_state` of the result."""
  tx = FACTORIES[name]()
  params = nnx_params()
  mesh = jax.make_mesh((1, 1, 1), ('data', 'model', 'expert'))
  shardings = nn.logical_to_mesh_sharding(
      nnx.get_partition_spec(to_opt_state(tx.init(params))), mesh, RULES)
  state = jax.jit(lambda p: to_opt_state(tx.init(p)), out_shardings=shardings)(params)
  for path, box in _boxes(state).items():
    value = _value(box)
    if not isinstance(value, optax.MaskedNode):
      assert len(value.sharding.spec) <= value.ndim, path


@pytest.mark.parametrize('name', sorted(FACTORIES))
def test_linen_route_places_the_state_under_jit(name):
  tx = FACTORIES[name]()
  params = linen_params()
  mesh = jax.make_mesh((1, 1, 1), ('data', 'model', 'expert'))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(tx.init(params)), mesh,
                                          RULES)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  rows = _boxes(_tier_state(state, 'experts').v_row) if 'skewadam' == name else {}
  if rows:
    assert tuple(_value(rows['params/moe/experts/w1']).sharding.spec) == ('expert', 'data')


def test_unused_slots_are_empty_for_the_route():
  """A slot a leaf does not keep (`v` of a factored bank, `mu` of a tier without
  momentum) is None, no box: `to_opt_state` boxes one Variable per array of the state,
  and `get_partition_spec` gives specs for exactly those."""
  params = nnx_params()
  state = to_opt_state(sj.skewadam(1e-3).init(params))
  v = _boxes(state[0].v)
  assert 'moe/experts/w1' not in v and 'moe/router/kernel' in v
  assert 'moe/experts/w1' not in _boxes(state[0].mu)
  assert len(_boxes(state)) == len(jax.tree.leaves(state))
  specs = _boxes(nnx.get_partition_spec(state))
  assert set(specs) == set(_boxes(state))
  assert specs['0/v_row/moe/experts/w1'].get_value() == P('exp', 'embed')
  assert specs['0/v/moe/router/kernel'].get_value() == P('embed', None)


def test_nnx_optimizer_trains_with_named_params():
  class Model(nnx.Module):
    def __init__(self):
      with nnx.use_eager_sharding(False):
        self.kernel = nnx.Param(jnp.ones((4, 6)), out_sharding=('embed', 'mlp'))
        self.router = nnx.Param(jnp.ones((4, 2)), out_sharding=('embed', None))

  model = Model()
  labels = {'kernel': 'backbone', 'router': 'router'}  # matched by path
  optimizer = nnx.Optimizer(model, sj.skewadam(1e-2, param_labels=labels), wrt=nnx.Param)
  rows = _boxes(_tier_state(optimizer.opt_state, 'backbone').v_row)
  assert type(rows['kernel']) is nnx.training.optimizer.OptVariable
  assert _names(rows['kernel']) == ('embed',)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.sum(m.kernel[...] ** 2) + jnp.sum(m.router[...]))(model)
    optimizer.update(model, grads)

  step(model, optimizer)
  step(model, optimizer)
  assert float(jnp.max(model.kernel[...])) < 1.0
  assert _names(_boxes(_tier_state(optimizer.opt_state, 'backbone').v_row)['kernel']) == (
      'embed',)


def test_rename_boxes_leaves_plain_trees_and_unchanged_names_alone():
  params = {'w': jnp.ones((3, 4))}
  field = {'w': jnp.zeros((3,))}
  calls = []
  out = _flax.rename_boxes(params, field, lambda *a: calls.append(a))
  assert out['w'] is field['w'] and not calls
  with nnx.use_eager_sharding(False):
    boxed = {'w': nnx.Param(jnp.ones((3, 4)), out_sharding=('a',))}  # padded with None
    stats = {'w': nnx.Param(jnp.zeros((3, 4)), out_sharding=('a',))}
  out = _flax.rename_boxes(boxed, stats, lambda *a: calls.append(a))
  assert calls == [('w', (3, 4), ('a', None))]
  assert out['w'] is stats['w']  # None: unchanged
  out = _flax.rename_boxes(boxed, stats, lambda path, shape, names: names)
  assert out['w'] is stats['w']  # the same names: unchanged


def test_rename_boxes_skips_masked_boxes():
  with nnx.use_eager_sharding(False):
    boxed = {'w': nnx.Param(jnp.ones((3, 4)), out_sharding=('a', 'b')),
             'm': nnx.Param(optax.MaskedNode(), out_sharding=('a', 'b'))}
    stats = {'w': nnx.Param(optax.MaskedNode(), out_sharding=('a', 'b')),
             'm': nnx.Param(optax.MaskedNode(), out_sharding=('a', 'b'))}
  calls = []
  out = _flax.rename_boxes(boxed, stats, lambda *a: calls.append(a) or ('a',))
  assert not calls
  assert out['w'] is stats['w'] and out['m'] is stats['m']


def test_spec_names_of_a_pytree_of_specs():
  assert _flax.spec_names(P('a', None)) == ('a', None)
  assert _flax.spec_names({'x': P('a'), 'y': P('a')}) == ('a',)
  assert _flax.spec_names({'x': P('a'), 'y': P('a', 'b')}) == ()  # replicated


def test_no_flax_import_without_flax():
  code = ('import sys, jax.numpy as jnp, skewadam_jax as sj\n'
          "s = sj.skewadam(1e-3).init({'moe': {'router': jnp.ones((4, 2)), "
          "'experts': jnp.ones((2, 4, 3))}, 'w': jnp.ones((4, 3))})\n"
          "assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)\n")
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
  proc = subprocess.run([sys.executable, '-c', code], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------- acceptance: MaxText on 8 CPUs


@pytest.fixture(scope='module')
def maxtext_runs(tmp_path_factory) -> dict[str, Any]:
  out = tmp_path_factory.mktemp('metadata')
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
  proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}'
  results = json.loads((out / 'metadata.json').read_text())
  assert results['devices'] == 8
  return results


@pytest.mark.slow
@pytest.mark.parametrize('name', ['skewadam', 'adampm', 'adamw'])
def test_flax_route_trains_maxtext_mixtral_on_a_mesh(maxtext_runs, name):
  r = maxtext_runs[name]
  assert r['error'] is None, f"{r['error']}\n{r.get('traceback', '')}"
  assert r['moved'] > 1e-3  # the 3 steps really moved the params
  assert r['same_paths']
  assert r['max_diff'] <= 1e-6  # params and every state leaf, against one device


@pytest.mark.slow
@pytest.mark.parametrize('name', ['skewadam', 'adampm', 'adamw'])
def test_flax_route_agrees_with_state_shardings(maxtext_runs, name):
  r = maxtext_runs[name]
  assert r['error'] is None, r['error']
  assert r['compared'] >= 27  # every array of the state (13 params)
  assert not r['missing']
  assert not r['mismatches'], r['mismatches']


@pytest.mark.slow
def test_skewadam_statistics_are_sharded_on_the_axes_they_keep(maxtext_runs):
  r = maxtext_runs['skewadam']
  assert r['reduced_rank_leaves'] >= 12
  sharded = set(r['sharded_leaves'])
  state = 'opt_state/0'
  for field in ('v_row', 'v_col'):
    for leaf in ('wi_0', 'wi_1', 'wo'):
      assert f'{state}/{field}/decoder/layers/MoeBlock_0/{leaf}' in sharded
  assert f'{state}/v_row/decoder/layers/self_attention/query/kernel' in sharded


def test_boxed_updates_and_memory_report_see_through_renamed_boxes():
  """Linen boxed params through init and two updates (the state keeps its structure,
  reduced statistics keep their reduced names), and `memory_report` attributes every
  statistic to its tier although its box names other axes than its parameter's."""
  import flax.linen as nn  # noqa: PLC0415

  p = {'moe': {'router': {'kernel': nn.LogicallyPartitioned(jnp.zeros((8, 4)), ('embed', None))},
               'experts': {'w1': nn.LogicallyPartitioned(jnp.ones((4, 8, 16)),
                                                         ('exp', 'embed', 'mlp'))}},
       'dense': {'kernel': nn.LogicallyPartitioned(jnp.ones((8, 16)), ('embed', 'mlp'))}}
  tx = sj.skewadam(1e-3)
  state = tx.init(p)
  grads = jax.tree.map(jnp.ones_like, p)
  _, state1 = tx.update(grads, state, p)
  _, state2 = jax.jit(tx.update)(grads, state1, p)
  assert jax.tree.structure(state2) == jax.tree.structure(state)
  inner = state2[0]
  assert inner.v_row['moe']['experts']['w1'].names == ('exp', 'embed')
  tiers = {t.tier: t.state_bytes for t in sj.memory_report(tx, p).tiers}
  assert '(other)' not in tiers and tiers['experts'] == 4 * (8 + 16) * 4
