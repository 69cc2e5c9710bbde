"""Sharded and multi-device training: meshes, pmap, Orbax checkpoints, state shardings.

The multi-device checks run tests/support/sharding_runs.py in subprocesses on 8 simulated CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=8): one process trains and
saves, a fresh one restores and continues. The unit tests of `state_shardings` run
here, on abstract shapes only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax
import pytest

import skewadam_jax as sj

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'tests' / 'support' / 'sharding_runs.py'
NAMES = ('skewadam', 'adampm')


def _run(mode: str, out: Path) -> dict:
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
  proc = subprocess.run([sys.executable, str(SCRIPT), mode, str(out)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, f'{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}'
  results = json.loads((out / f'{mode}.json').read_text())
  assert results['devices'] == 8
  return results


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  out = tmp_path_factory.mktemp('sharding')
  train = _run('train', out)
  resume = _run('resume', out)  # a fresh process
  return {'train': train, 'resume': resume}


def _expert_entries(specs: dict) -> dict:
  return {path: spec for path, spec in specs.items() if "['experts']" in path}


# ----------------------------------------------------------------------------- meshes


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES + ('grouped_tiers',))
def test_sharded_training_matches_single_device(runs, name):
  r = runs['train']
  assert r[f'single_{name}_moved'] > 1e-2  # the 5 steps really moved the params
  assert r[f'mesh_{name}_vs_single'] <= 1e-6  # params and every state leaf


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_sharded_steps_donate_params_and_state(runs, name):
  assert runs['train'][f'mesh_{name}_donated'] is True


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_expert_state_is_sharded_on_the_expert_axis(runs, name):
  for key in (f'mesh_{name}_state_specs', f'mesh_{name}_final_specs'):
    experts = _expert_entries(runs['train'][key])
    arrays = {path: spec for path, spec in experts.items() if spec}  # not the counts
    assert len(arrays) >= 2
    assert all(spec[0] == 'expert' for spec in arrays.values()), arrays
  experts = _expert_entries(runs['train'][f'mesh_{name}_state_specs'])
  w1 = {path.split('.')[-1].split('[')[0]: spec for path, spec in experts.items()
        if path.endswith("['w1']")}
  if name == 'skewadam':  # no momentum on experts; row/col statistics lose one axis
    assert w1 == {'v_row': ['expert', None], 'v_col': ['expert', 'data']}
  else:  # momentum like the param; pooled nu keeps the param's spec
    assert w1 == {'mu': ['expert', None, 'data'], 'nu': ['expert', None, 'data']}


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_state_shardings_agree_with_explicit_mesh_init(runs, name):
  r = runs['train']
  helper = r[f'mesh_{name}_helper_specs']
  actual = r[f'mesh_{name}_state_specs']
  assert helper.keys() == actual.keys()
  for path, spec in actual.items():
    assert helper[path] + [None] * (len(spec) - len(helper[path])) == spec, path


@pytest.mark.slow
def test_auto_mesh_with_state_shardings_matches_single_device(runs):
  r = runs['train']
  assert r['auto_skewadam_vs_single'] <= 1e-6
  arrays = {p: s for p, s in _expert_entries(r['auto_skewadam_state_specs']).items() if s}
  assert arrays and all(spec[0] == 'expert' for spec in arrays.values())


@pytest.mark.slow
def test_pmap_matches_single_device_on_concatenated_batch(runs):
  r = runs['train']
  assert r['pmap_skewadam_moved'] > 1e-3
  assert r['pmap_skewadam_vs_single'] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize('name', ('adampm', 'tiered', 'helper'))
def test_groups_straddling_shards_raise_a_clear_error(runs, name):
  message = runs['train'][f'straddle_{name}']
  assert message is not None, 'no error for groups that straddle shards'
  for part in ('group_size=16', 'axis 1', "'data'", 'shard length 24'):
    assert part in message, message


@pytest.mark.slow
@pytest.mark.parametrize('name', ('adampm', 'tiered'))
def test_whole_groups_per_shard_keep_the_param_sharding(runs, name):
  assert runs['train'][f'whole_groups_{name}_spec'][-1] == [None, 'data']


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.slow
@pytest.mark.parametrize('kind', ('single', 'mesh'))
@pytest.mark.parametrize('name', NAMES)
def test_resume_from_checkpoint_is_bitwise_identical(runs, name, kind):
  r = runs['resume']
  assert r[f'{kind}_{name}_bitwise'] is True, r[f'{kind}_{name}_max_diff']
  if kind == 'mesh':
    assert r[f'mesh_{name}_structure_ok'] is True
    assert r[f'mesh_{name}_restored_bitwise'] is True
    assert r[f'mesh_{name}_mesh'] == {'data': 2, 'expert': 4}


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_restore_onto_a_different_mesh(runs, name):
  r = runs['resume']
  assert r[f'remesh_{name}_mesh'] == {'data': 4, 'expert': 2}
  assert r[f'remesh_{name}_w1_shard_shape'] == [2, 32, 16]  # [4, 32, 64] over (2, ., 4)
  assert r[f'remesh_{name}_structure_ok'] is True
  assert r[f'remesh_{name}_restored_bitwise'] is True
  arrays = {p: s for p, s in _expert_entries(r[f'remesh_{name}_restored_specs']).items() if s}
  assert arrays and all(spec[0] == 'expert' for spec in arrays.values())
  # Continuing on another mesh changes only the order of the sharded reductions.
  assert r[f'remesh_{name}_max_diff'] <= 1e-6
  assert r[f'unshard_{name}_max_diff'] <= 1e-6  # and onto a single device


# ----------------------------------------------------------------------------- state_shardings


def _abstract(shapes: dict) -> dict:
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


PARAMS = _abstract({'embed': (64, 32), 'norm': (32,),
                    'moe': {'router': (32, 4), 'experts': {'w1': (4, 32, 64)}}})
SPECS = {'embed': P(None, 'data'), 'norm': P(),
         'moe': {'router': P(), 'experts': {'w1': P('expert', None, 'data')}}}


def _tiers(shardings):
  """The tiers' state (one `TieredAdamState` for every tier), by the tier a test reads."""
  return dict.fromkeys(('backbone', 'experts', 'router'), shardings[0])


def test_state_shardings_give_factored_statistics_the_reduced_spec():
  # optax.tree_utils.tree_map_params would hand every params-shaped subtree the
  # param's full-rank spec, P('expert', None, 'data'), for the [E, R] and [E, C] stats.
  tiers = _tiers(sj.state_shardings(sj.skewadam(1e-3), PARAMS, SPECS))
  experts, backbone = tiers['experts'], tiers['backbone']
  assert experts.v_row['moe']['experts']['w1'] == P('expert', None)
  assert experts.v_col['moe']['experts']['w1'] == P('expert', 'data')
  assert backbone.v_row['embed'] == P(None)
  assert backbone.v_col['embed'] == P('data')
  assert backbone.mu['embed'] == P(None, 'data')
  assert backbone.v['norm'] == P()
  assert tiers['router'].v['moe']['router'] == P()
  assert experts.count == P()
  assert experts.mu['moe']['experts']['w1'] is None  # no momentum: no slot, no spec


def test_state_shardings_keep_pooled_nu_on_the_param_spec():
  state = sj.state_shardings(sj.adampm(1e-3, group_size=8), PARAMS, SPECS)[0]
  assert state.nu['moe']['experts']['w1'] == P('expert', None, 'data')
  assert state.mu['moe']['experts']['w1'] == P('expert', None, 'data')
  assert state.nu['embed'] == P(None, 'data')


@pytest.mark.parametrize('wrap', ('inject', 'chain', 'masked', 'multisteps', 'partition'))
def test_state_shardings_through_optax_wrappers(wrap):
  if wrap == 'inject':
    tx = optax.inject_hyperparams(sj.skewadam)(learning_rate=1e-3)
  elif wrap == 'chain':
    tx = optax.chain(optax.clip_by_global_norm(1.0), sj.skewadam(1e-3))
  elif wrap == 'masked':
    tx = optax.masked(sj.skewadam(1e-3), {'embed': False, 'norm': True, 'moe': True})
  elif wrap == 'multisteps':
    tx = optax.MultiSteps(sj.skewadam(1e-3), 2)
  else:
    tx = optax.partition({'pm': sj.adampm(1e-3), 'w': optax.adamw(1e-3)},
                         {'embed': 'w', 'norm': 'w', 'moe': 'pm'})
  shardings = sj.state_shardings(tx, PARAMS, SPECS)
  abstract = jax.eval_shape(tx.init, PARAMS)
  is_spec = lambda x: isinstance(x, P)
  assert jax.tree.structure(shardings, is_leaf=is_spec) == jax.tree.structure(abstract)
  pairs = list(zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings, is_leaf=is_spec)))
  assert all(len(spec) <= a.ndim for a, spec in pairs)
  expert_specs = [tuple(spec) for a, spec in pairs if a.shape[:1] == (4,) and a.ndim >= 2]
  assert expert_specs and all(spec[0] == 'expert' for spec in expert_specs)
  assert all(tuple(spec) == () or set(spec) == {None} for a, spec in pairs if a.ndim == 0)


def test_state_shardings_for_adamw_follow_the_params():
  state = sj.state_shardings(optax.adamw(1e-3), PARAMS, SPECS)[0]
  assert state.mu == SPECS and state.nu == SPECS


def test_state_shardings_with_a_mesh_give_named_shardings():
  mesh = jax.make_mesh((1, 1), ('data', 'expert'))
  shardings = sj.state_shardings(sj.skewadam(1e-3), PARAMS, SPECS, mesh=mesh)
  row = _tiers(shardings)['experts'].v_row['moe']['experts']['w1']
  assert row == jax.sharding.NamedSharding(mesh, P('expert', None))
  target = sj.sharded_abstract_state(sj.skewadam(1e-3), PARAMS, SPECS, mesh=mesh)
  row = _tiers(target)['experts'].v_row['moe']['experts']['w1']
  assert row.shape == (4, 32) and row.sharding.spec == P('expert', None)


def test_state_shardings_accept_a_prefix_tree():
  tiers = _tiers(sj.state_shardings(sj.skewadam(1e-3), PARAMS,
                                    {'embed': P(None, 'data'), 'norm': None,
                                     'moe': P('expert')}))
  assert tiers['experts'].v_row['moe']['experts']['w1'] == P('expert', None)
  assert tiers['experts'].v_col['moe']['experts']['w1'] == P('expert', None)
  assert tiers['router'].v['moe']['router'] == P('expert')


def test_state_shardings_reject_a_mismatched_tree():
  with pytest.raises(ValueError, match='param_shardings'):
    sj.state_shardings(sj.skewadam(1e-3), PARAMS, {'embed': P(), 'other': P()})


@pytest.mark.parametrize('name', NAMES)
def test_sharded_abstract_state_on_one_device_takes_the_params_shardings(name):
  """`x.sharding` of arrays on one device (SingleDeviceSharding) is a restore target."""
  tx = {'skewadam': sj.skewadam, 'adampm': sj.adampm}[name](1e-3)
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), PARAMS)
  param_sh = jax.tree.map(lambda x: x.sharding, params)
  device_sharding = jax.tree.leaves(param_sh)[0]
  assert isinstance(device_sharding, jax.sharding.SingleDeviceSharding)
  target = sj.sharded_abstract_state(tx, params, param_sh)
  abstract = jax.eval_shape(tx.init, params)
  assert jax.tree.structure(target) == jax.tree.structure(abstract)
  assert all(t.shape == a.shape and t.dtype == a.dtype and t.sharding == device_sharding
             for t, a in zip(jax.tree.leaves(target), jax.tree.leaves(abstract)))
  shardings = sj.state_shardings(tx, params, param_sh)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  assert all(x.sharding == device_sharding for x in jax.tree.leaves(state))


def test_single_device_shardings_beside_a_mesh_or_specs():
  params = {'w': jnp.zeros((4, 8)), 'b': jnp.zeros((8,))}
  device = jax.devices()[0]
  # Beside NamedShardings on a mesh of the same devices: replicated on the mesh.
  mesh = jax.make_mesh((1,), ('data',))
  sh = sj.state_shardings(sj.skewadam(1e-3), params,
                          {'w': jax.sharding.NamedSharding(mesh, P('data')),
                           'b': jax.sharding.SingleDeviceSharding(device)})
  assert all(isinstance(s, jax.sharding.NamedSharding) for s in jax.tree.leaves(sh))
  with pytest.raises(ValueError, match=r'pass `mesh=`'):
    sj.state_shardings(sj.skewadam(1e-3), params,
                       {'w': P('data'), 'b': jax.sharding.SingleDeviceSharding(device)})
