"""Extension by protocol: a user's estimator and codec get what the built-ins get.

The estimator and codec are the ones docs/estimators.md writes out (executed from the
document itself). Each is compared with a built-in on leaves of the same shapes: the
update traced once per shape (`per_shape`), one batched Newton-Schulz call per matrix
shape (`shared`), and the same number of equations in the traced step. The last test
checks that the plan changed no result: every exported preset updates bitwise as the
reference commit does.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax as sj
from skewadam_jax.transforms import plan as _plan

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / 'docs' / 'estimators.md'
# The last commit before the plan (and the protocol): presets must update bitwise as it.
REFERENCE = '2d13ee1'


def _docs_class(name: str) -> type:
  """The class `name` as the code block of docs/estimators.md that defines it runs."""
  blocks = re.findall(r'```python\n(.*?)```', DOCS.read_text(), re.S)
  block = next(b for b in blocks if f'class {name}(' in b)
  namespace = {'params': {'w': jnp.zeros((4, 6))}, 'print': lambda *a, **k: None}
  exec(compile(block, str(DOCS), 'exec'), namespace)  # noqa: S102 - the docs' own code
  return namespace[name]


RowMean = _docs_class('RowMean')
Polar = _docs_class('Polar')
Bfloat16Momentum = _docs_class('Bfloat16Momentum')

SHAPES = {'a': (12, 20), 'b': (12, 20), 'c': (12, 20), 'd': (20, 7), 'e': (20, 7)}


def _grads(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}


def _step_jaxpr(tier: sj.Tier):
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  tx = sj.scale_by_tiered_adam(tier=tier)
  state = tx.init(params)
  return jax.make_jaxpr(lambda g, s: tx.update(g, s))(_grads(), state)


def _cached_calls(jaxpr, name: str = '_cached_update') -> list:
  """The calls of the jitted `name` in `jaxpr`, also inside the branches of a
  conditional (the stacked groups' `platform_dependent`)."""
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name in ('pjit', 'jit') and e.params.get('name') == name:
      out.append(e)
      continue
    for v in e.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          out += _cached_calls(inner, name)
  return out


def _calls_and_bodies(jaxpr, name: str) -> tuple[int, int]:
  calls = _cached_calls(jaxpr, name)
  return len(calls), len({id(e.params['jaxpr']) for e in calls})


@pytest.mark.parametrize('builtin', [sj.Exact(), sj.Factored()])
def test_a_per_shape_user_estimator_is_traced_once_per_shape_as_a_builtin(builtin):
  # Five leaves of two shapes: one jitted call per leaf and one traced body per shape
  # (the CPU's leaf-by-leaf update), and one stacked call per shape (`stacks`: other
  # platforms), for the docs' RowMean as for the built-in; the step's top level is the
  # same size. Without `stacks`, no stacked call.
  got = {}
  for name, est in (('user', RowMean()), ('builtin', builtin)):
    jaxpr = _step_jaxpr(sj.Tier(second_moment=est, clip_threshold=None))
    got[name] = (_calls_and_bodies(jaxpr, '_cached_update'),
                 _calls_and_bodies(jaxpr, '_stacked_update'), len(jaxpr.eqns))
  shapes = len(set(SHAPES.values()))
  assert got['user'][:2] == ((len(SHAPES), shapes), (shapes, shapes)), got
  assert got['user'] == got['builtin'], got

  class RowMeanAlone(RowMean):
    stacks = False

  jaxpr = _step_jaxpr(sj.Tier(second_moment=RowMeanAlone(), clip_threshold=None))
  assert _calls_and_bodies(jaxpr, '_cached_update') == (len(SHAPES), shapes)
  assert _calls_and_bodies(jaxpr, '_stacked_update') == (0, 0)


def test_a_per_shape_user_estimator_is_traced_once_per_shape(monkeypatch):
  # Counting Python traces of `update` (a fresh jit cache): per shape, not per leaf,
  # once for the CPU's leaf-by-leaf update and once stacked (`stacks`, for other
  # platforms); without `per_shape`, one per leaf.
  counts = {}
  for per_shape in (True, False):
    calls = []
    update = RowMean.update
    monkeypatch.setattr(RowMean, 'update', lambda self, *a, calls=calls, update=update: (
        calls.append(1) or update(self, *a)))
    monkeypatch.setattr(RowMean, 'per_shape', per_shape)
    jax.clear_caches()
    _step_jaxpr(sj.Tier(second_moment=RowMean(), clip_threshold=None))
    counts[per_shape] = len(calls)
    monkeypatch.undo()
  assert counts == {True: 2 * len(set(SHAPES.values())), False: len(SHAPES)}, counts


def test_a_user_estimator_shares_the_newton_schulz_call_as_orthogonal():
  # The docs' Polar returns `sj.Shared` with a `sj.NewtonSchulzGroup`: the leaves of a
  # matrix shape share one batched iteration (3 dots per Newton-Schulz step per call),
  # as `sj.Orthogonal`'s do; the [20, 7] leaves (wide [7, 20]) fit in no [12, 20] call
  # (20 columns, but they are 2 leaves against 3: more than `MAX_PADDED_SHARE`), so two
  # calls.
  dots = {}
  for name, est in (('user', Polar()), ('builtin', sj.Orthogonal())):
    jaxpr = _step_jaxpr(sj.Tier(second_moment=est, clip_threshold=None))
    dots[name] = sum(e.primitive.name == 'dot_general' for e in jaxpr.eqns)
  assert dots['user'] == dots['builtin'] == 2 * 3 * sj.Orthogonal().ns_steps, dots


def test_polar_shared_and_alone_give_the_same_update():
  # The shared call and the leaf's own call: the same operations per matrix.
  params = {'w': jnp.zeros((12, 20)), 'v': jnp.zeros((12, 20))}
  grads = {k: v for k, v in _grads().items() if k in ('a', 'b')}
  grads = {'w': grads['a'], 'v': grads['b']}
  tier = sj.Tier(second_moment=Polar(), clip_threshold=None)
  both = sj.scale_by_tiered_adam(tier=tier)
  u, _ = both.update(grads, both.init(params))
  one = sj.scale_by_tiered_adam(tier=tier)
  alone, _ = one.update({'w': grads['w']}, one.init({'w': params['w']}))
  np.testing.assert_allclose(np.asarray(u['w']), np.asarray(alone['w']), rtol=0, atol=1e-6)


def test_a_per_shape_user_codec_is_planned_and_jitted_once_per_shape_as_blockwise(monkeypatch):
  # The docs' Bfloat16Momentum against `sj.Blockwise`: the coded momentum's step is one
  # jitted call per leaf with one traced body per shape, and the abstract form of
  # `init` is computed once per shape when the updates are planned (once per leaf
  # without `per_shape`).
  shapes = len(set(SHAPES.values()))
  got = {}
  for name, codec, per_shape in (('user', Bfloat16Momentum(), True),
                                 ('builtin', sj.Blockwise(block_size=4, fit='nearest'), True),
                                 ('user per leaf', Bfloat16Momentum(), False)):
    inits = []
    init = type(codec).init
    monkeypatch.setattr(type(codec), 'init', lambda self, *a, inits=inits, init=init: (
        inits.append(1) or init(self, *a)))
    monkeypatch.setattr(type(codec), 'per_shape', per_shape)
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    tx = sj.scale_by_tiered_adam(tier=sj.Tier(mu_codec=codec))
    state = tx.init(params)
    _plan._cached_eval_shape.cache_clear()
    inits.clear()
    jaxpr = jax.make_jaxpr(tx.update)(_grads(), state)
    calls = [e for e in jaxpr.eqns if e.primitive.name in ('pjit', 'jit')
             and e.params.get('name') == '_coded_momentum']
    got[name] = (len(calls), len({id(e.params['jaxpr']) for e in calls}), len(inits))
    monkeypatch.undo()
  assert got['user'] == got['builtin'] == (len(SHAPES), shapes, shapes), got
  assert got['user per leaf'][2] == len(SHAPES), got


def test_user_estimator_and_codec_reach_the_reports():
  # The plan carries them: label table, memory report and shardings read it.
  from jax.sharding import PartitionSpec as P
  params = {'w': jax.ShapeDtypeStruct((8, 6), jnp.float32)}
  tier = sj.Tier(second_moment=RowMean(), mu_codec=Bfloat16Momentum())
  tx = sj.skewadam(1e-3, tiers={'backbone': tier, 'experts': tier, 'router': tier})
  (row,) = sj.label_table(tx, params)
  assert (row.second_moment, row.state_bytes) == ('row mean', 8 * 6 * 2 + 8 * 4)
  specs = sj.state_shardings(tx, params, {'w': P('data', None)})
  assert specs[0].v_row['w'] == P('data') and specs[0].mu['w'] == P()
  described = sj.describe_state(tx, params)['params']['w']
  assert described['mu_codec']['type'] == 'Bfloat16Momentum'


def test_two_skewadams_under_partition_each_report_their_own_plan():
  # The reports walk the optimizer for its planners and pair each with its own state,
  # in the order jax flattens the partition's dict (sorted keys, not the order given).
  import optax
  from jax.sharding import PartitionSpec as P
  params = {'a': jax.ShapeDtypeStruct((8, 6), jnp.float32),
            'z': jax.ShapeDtypeStruct((8, 6), jnp.float32)}
  exact = {name: sj.Tier(second_moment='exact') for name in ('backbone', 'experts', 'router')}
  tx = optax.partition({'zz': sj.skewadam(1e-3, tiers=exact), 'aa': sj.skewadam(1e-3)},
                       {'a': 'zz', 'z': 'aa'})
  rows = {r.path: (r.second_moment, r.state_bytes) for r in sj.label_table(tx, params)}
  assert rows == {'a': ('exact', 2 * 8 * 6 * 4), 'z': ('factored', (8 * 6 + 8 + 6) * 4)}
  specs = sj.state_shardings(tx, params, {'a': P('d', None), 'z': P('d', None)})
  assert specs.inner_states['zz'].inner_state[0].v['a'] == P('d', None)
  assert specs.inner_states['aa'].inner_state[0].v_row['z'] == P('d')


def test_a_batch_axes_function_gets_the_labels_only_when_it_takes_them():
  # No context carries the labels into a `batch_axes` function: one that takes
  # `param_labels` is passed them (the per-expert bias beside its bank then gets the
  # expert axis); one of the params alone labels them by default (the bias, a backbone
  # leaf there, keeps the default axes).
  import functools
  import warnings
  params = {'blk': {'w': jax.ShapeDtypeStruct((4, 8, 16), jnp.float32),
                    'b': jax.ShapeDtypeStruct((4, 16), jnp.float32)}}
  labels = sj.make_labeler([('blk/*', 'experts')])
  got = {}
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', sj.UnsureLabelWarning)
    for name, axes in (('partial', functools.partial(sj.moe_batch_axes)),
                       ('takes labels', lambda p, param_labels: sj.moe_batch_axes(
                           p, param_labels)),
                       ('params only', lambda p: sj.moe_batch_axes(p))):
      table = sj.label_table(sj.skewadam(1e-3, param_labels=labels, batch_axes=axes), params)
      got[name] = {r.path: r.batch_axes for r in table}
  assert got['partial'] == got['takes labels'] == {'blk/b': (0,), 'blk/w': (0,)}, got
  assert got['params only'] == {'blk/b': (), 'blk/w': (0,)}, got


@pytest.mark.slow
def test_presets_update_bitwise_as_the_reference(tmp_path):
  # Every exported preset (and AdamPM, an AdamW-like tier, grouped tiers) on the MoE
  # trees of `trees`, three steps: parameters, state and reports as the reference
  # commit's package gives them, bit for bit.
  reference = tmp_path / 'reference'
  reference.mkdir()
  try:
    archive = subprocess.run(['git', 'archive', REFERENCE, 'skewadam_jax'], cwd=ROOT,
                             capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    pytest.skip(f'the reference commit {REFERENCE} is not in this checkout')
  subprocess.run(['tar', '-x', '-C', str(reference)], input=archive, check=True)
  outputs = {}
  for name, package in (('reference', reference), ('this', ROOT)):
    out = tmp_path / f'{name}.npz'
    env = {'PYTHONPATH': f'{package}:{ROOT / "tests" / "support"}', 'PATH': '/usr/bin:/bin',
           'JAX_PLATFORMS': 'cpu'}
    subprocess.run([sys.executable, str(ROOT / 'tests' / 'support' / 'preset_runs.py'), str(out)],
                   env=env, check=True, timeout=900)
    outputs[name] = np.load(out)
  want, got = outputs['reference'], outputs['this']
  assert want.files == got.files
  differ = [k for k in want.files if want[k].dtype != got[k].dtype
            or want[k].shape != got[k].shape or want[k].tobytes() != got[k].tobytes()]
  # `Orthogonal(ns_dtype=...)` came after the reference: the checkpoint description of an
  # orthogonal leaf names it (`'ns_dtype': 'auto'`, float32 on this CPU, so the arrays
  # stay bitwise); without it, the descriptions must be the reference's.
  added = re.compile(r", 'ns_dtype': '[a-z0-9]+'")
  differ = [k for k in differ if not (
      k.endswith('|report|description') and added.search(str(got[k]))
      and added.sub('', str(got[k])) == str(want[k]))]
  assert not differ, differ[:10]
