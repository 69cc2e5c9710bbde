"""The estimator interface: built-in estimators, a user's own estimator, their specs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import skewadam_jax as sj


@jax.jit
def _zero_rows(p: jax.Array) -> jax.Array:
  # Reduced from zeros_like(p) so that it inherits p's sharding; jitted so that XLA
  # folds the full-size zeros away.
  return jnp.zeros_like(p, dtype=jnp.float32).sum(axis=-1)


@dataclasses.dataclass(frozen=True)
class RowMean(sj.SecondMoment):
  """One second-moment scalar per row (Adam-mini style): v_i = EMA of mean_j g_ij^2."""

  name = 'row mean'

  def for_leaf(self, shape, batch_axes=None):
    return self if len(shape) >= 2 else sj.Exact()

  def init(self, param, path):
    return {'v_row': _zero_rows(param)}

  def update(self, g, stats, x, step):
    g32 = g.astype(jnp.float32)
    v = step.b2 * stats['v_row'] + (1.0 - step.b2) * jnp.mean(g32 * g32, axis=-1)
    if step.floor:
      d = jnp.sqrt(jnp.maximum(v, step.eps))
    else:
      d = jnp.sqrt(v / step.bc2) + step.eps
    u = x.astype(jnp.float32) * step.num_scale / d[..., None]
    if step.clip is not None:
      rms = jnp.sqrt(jnp.mean(u * u, axis=(-2, -1), keepdims=True))
      u = u / jnp.maximum(1.0, rms / step.clip)
    return u, {'v_row': v}

  def specs(self, spec, shape, mesh, path):
    return {'v_row': P(*spec[:-1])}


# A square embedding: from shapes alone, its [8] row statistic could have dropped
# either axis, so only the estimator knows the spec.
PARAMS = {'embed': jnp.linspace(-1.0, 1.0, 64).reshape(8, 8),
          'norm': jnp.ones((8,)),
          'moe': {'router': jnp.zeros((8, 4)),
                  'experts': {'w1': jnp.linspace(-1.0, 1.0, 4 * 8 * 6).reshape(4, 8, 6)}}}
SPECS = {'embed': P('data', None), 'norm': P(), 'moe': {'router': P(),
                                                        'experts': {'w1': P('expert')}}}
TIERS = {**sj.PUBLISHED_TIERS,
         'backbone': sj.PUBLISHED_TIERS['backbone'].replace(second_moment=RowMean())}


def _grads(params, step):
  return jax.tree.map(lambda p: jnp.cos(p * (step + 1.0)) * (1.0 + step), params)


def _reference_row_mean(p, grads, lr, b1=0.9, b2=0.999, eps=1e-8, clip=1.0):
  """NumPy float64: momentum + one floored second moment per row + per-matrix clip."""
  m, v, p = np.zeros_like(p), np.zeros(p.shape[:-1]), np.array(p, np.float64)
  for t, g in enumerate(grads, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * np.mean(g * g, axis=-1)
    u = m * np.sqrt(1 - b2**t) / (1 - b1**t) / np.sqrt(np.maximum(v, eps))[..., None]
    u = u / max(1.0, np.sqrt(np.mean(u * u)) / clip)
    p = p - lr * u
  return p


def test_user_estimator_trains_through_skewadam_against_a_numpy_reference():
  tx = sj.skewadam(1e-2, tiers=TIERS)
  params, state = PARAMS, tx.init(PARAMS)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  grads = []
  for i in range(5):
    g = _grads(params, i)
    grads.append(np.asarray(g['embed'], np.float64))
    params, state = step(params, state, g)
  backbone = state[0]
  assert backbone.v_row['embed'].shape == (8,)
  assert backbone.v_col['embed'] is None  # the user estimator keeps rows only
  assert backbone.v['norm'].shape == (8,)  # the fallback for 1-D leaves
  # The reference feeds the gradients actually seen (they depend on the params).
  expected = _reference_row_mean(PARAMS['embed'], grads, 1e-2)
  np.testing.assert_allclose(params['embed'], expected, rtol=0, atol=1e-6)
  assert np.max(np.abs(params['embed'] - PARAMS['embed'])) > 1e-2


def test_user_estimator_statistics_get_the_estimators_spec():
  shardings = sj.state_shardings(sj.skewadam(1e-3, tiers=TIERS), PARAMS, SPECS)
  backbone = shardings[0]
  assert backbone.v_row['embed'] == P('data')
  assert backbone.mu['embed'] == P('data', None)
  # Inferred from shapes alone, the ambiguous square case is replicated instead.
  adamw_like = sj.state_shardings(optax.adafactor(1e-3), PARAMS, SPECS)
  assert P('data') not in jax.tree.leaves(adamw_like)


def test_user_estimator_in_sharded_abstract_state_memory_report_and_label_table():
  mesh = jax.make_mesh((1, 1), ('data', 'expert'))
  tx = sj.skewadam(1e-3, tiers=TIERS)
  target = sj.sharded_abstract_state(tx, PARAMS, SPECS, mesh=mesh)
  row = target[0].v_row['embed']
  assert row.shape == (8,) and row.sharding.spec == P('data')
  report = sj.memory_report(tx, PARAMS)
  backbone = {t.tier: t for t in report.tiers}['backbone']
  # momentum of embed and norm, 8 row scalars, the norm's exact v
  assert backbone.state_bytes == 4 * (64 + 8 + 8 + 8)
  rows = {r.path: r for r in sj.label_table(tx, PARAMS)}
  assert rows['embed'].second_moment == 'row mean'
  assert rows['embed'].state_bytes == 4 * (64 + 8)
  assert rows['norm'].second_moment == 'exact'
  assert 'row mean' in sj.label_table(tx, PARAMS).format()


@pytest.mark.parametrize('shape, name', [((4, 6), 'factored'), ((6,), 'exact'),
                                         ((), 'exact'), ((2, 4, 6), 'factored')])
def test_factored_falls_back_to_exact_below_two_dimensions(shape, name):
  assert sj.Factored().for_leaf(shape).name == name


@pytest.mark.parametrize('shape, name', [((4, 6), 'grouped'), ((6,), 'grouped'),
                                         ((), 'exact')])
def test_grouped_falls_back_to_exact_for_scalars(shape, name):
  assert sj.Grouped(4).for_leaf(shape).name == name


def test_tier_accepts_an_estimator_object_and_names_give_the_builtin_ones():
  assert sj.Tier(second_moment='grouped', group_size=4, group_axis=0).estimator == (
      sj.Grouped(4, 0))
  assert sj.Tier(second_moment='factored').estimator == sj.Factored()
  assert sj.Tier(second_moment=sj.Exact()).estimator == sj.Exact()


# ----------------------------------------------------------------------------- group specs


def test_state_shardings_use_the_estimators_group_size():
  # n = 12 on 3 shards: shard length 4. Groups of 5 straddle shards although 12 / 5
  # rounds up to 3 groups, one per shard (the shape-based check accepted this).
  params = {'w': jax.ShapeDtypeStruct((2, 12), jnp.float32)}
  mesh = AbstractMesh((3,), ('data',))
  specs = {'w': P(None, 'data')}
  with pytest.raises(ValueError, match=r'group_size=5 .* shard length 4'):
    sj.state_shardings(sj.adampm(1e-3, group_size=5), params, specs, mesh=mesh)
  tier = {'backbone': sj.Tier(second_moment='grouped', group_size=5)}
  with pytest.raises(ValueError, match=r'group_size=5 .* shard length 4'):
    sj.state_shardings(sj.skewadam(1e-3, tiers=tier), params, specs, mesh=mesh)
  shardings = sj.state_shardings(sj.adampm(1e-3, group_size=4), params, specs, mesh=mesh)
  assert shardings[0].nu['w'].spec == P(None, 'data')


def test_straddle_error_reports_the_real_group_size():
  # 12 on 3 shards in groups of 8 gives 2 groups; the shape-based check took the group
  # size for ceil(12 / 2) = 6. The estimator knows it is 8.
  params = {'w': jax.ShapeDtypeStruct((3, 12), jnp.float32)}
  with pytest.raises(ValueError, match=r'parameter w in groups of group_size=8 along axis '
                                       r'1: .* 3 shards of shard length 4'):
    sj.state_shardings(sj.adampm(1e-3, group_size=8), params, {'w': P(None, 'data')},
                       mesh=AbstractMesh((3,), ('data',)))
  ok = sj.state_shardings(sj.adampm(1e-3, group_size=8), {'w': params['w']},
                          {'w': P(None, 'data')}, mesh=AbstractMesh((1,), ('data',)))
  assert ok[0].nu['w'].spec == P(None, 'data')


@dataclasses.dataclass(frozen=True)
class _Broken(sj.SecondMoment):
  """An estimator with one bug: `bug` says which (for the trace-time checks)."""

  bug: str = 'stats_shape'
  name = 'broken'

  def init(self, param, path):
    if self.bug == 'init_key':
      return {'nu': jnp.zeros_like(param, dtype=jnp.float32)}
    return {'v': jnp.zeros_like(param, dtype=jnp.float32)}

  def update(self, g, stats, x, step):
    v = step.b2 * stats['v'] + (1.0 - step.b2) * jnp.square(g.astype(jnp.float32))
    u = x.astype(jnp.float32) * step.num_scale / (jnp.sqrt(v / step.bc2) + step.eps)
    if self.bug == 'stats_shape':
      v = jnp.mean(v, axis=-1)
    elif self.bug == 'stats_dtype':
      v = v.astype(jnp.bfloat16)
    elif self.bug == 'stats_key':
      return u, {'v_row': v}
    elif self.bug == 'update_shape':
      u = jnp.mean(u, axis=-1, keepdims=True)
    return u, {'v': v}


@pytest.mark.parametrize('bug,message', [
    ('stats_shape', r"estimator 'broken' \(_Broken\): `update` for parameter w returned "
                    r"statistics \{'v': 'float32\[256\]'\}, but its state holds "
                    r"\{'v': 'float32\[256, 64\]'\}"),
    ('stats_dtype', r"parameter w returned statistics \{'v': 'bfloat16\[256, 64\]'\}, but "
                    r"its state holds \{'v': 'float32\[256, 64\]'\}"),
    ('stats_key', r"returned statistics \{'v_row': 'float32\[256, 64\]'\}"),
    ('update_shape', r"estimator 'broken' \(_Broken\): `update` for parameter w returned an "
                     r"update of shape \(256, 1\), but the gradient has shape \(256, 64\)"),
])
@pytest.mark.parametrize('via', ['scale_by_tiered_adam', 'skewadam'])
def test_user_estimator_that_breaks_its_state_is_named_at_trace_time(via, bug, message):
  estimator = _Broken(bug)
  params = {'w': jnp.ones((256, 64))}
  if via == 'skewadam':
    tiers = {'backbone': sj.Tier(second_moment=estimator)}
    tx = sj.skewadam(1e-3, tiers=tiers, param_labels={'w': 'backbone'})
  else:
    tx = sj.scale_by_tiered_adam(second_moment=estimator)
  state = tx.init(params)
  with pytest.raises((ValueError, TypeError), match=message):
    jax.jit(tx.update).lower(params, state, params)  # tracing alone raises


def test_user_estimator_init_with_unknown_fields_is_named():
  with pytest.raises(TypeError, match=r"estimator 'broken' \(_Broken\): `init` for parameter "
                                      r"w must return a dict whose keys are among \('v_row', "
                                      r"'v_col', 'v'\), got \{'nu'"):
    sj.scale_by_tiered_adam(second_moment=_Broken('init_key')).init({'w': jnp.ones((4, 4))})


def test_a_correct_user_estimator_passes_the_checks():
  params = {'w': jnp.ones((256, 64))}
  tx = sj.scale_by_tiered_adam(second_moment=_Broken('none'))
  state = tx.init(params)
  _, new = jax.jit(tx.update)(params, state)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), new) == jax.tree.map(
      lambda a: (a.shape, a.dtype), state)
