"""AdamPM (grouped second moment) against the NumPy reference and Adam identities."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj
from skewadam_jax.estimators import pooling as _pooling
from reference import RefAdamPM, leaf_axis, ref_expand, ref_groupmean
from trees import init_params, make_grads_fn, nest, run_optax

STEPS = 30
LR = 1e-2


@pytest.mark.parametrize('shape,axis,s', [
    ((16,), 0, 8), ((13,), 0, 8), ((1,), 0, 8), ((5,), 0, 8), ((4, 20), -1, 8),
    ((4, 20), 0, 3), ((3, 7, 10), 1, 4), ((3, 7, 10), -3, 2), ((6, 9), -2, 9),
    ((6, 9), 1, 1),
])
def test_groupmean_and_expand_match_reference(shape, axis, s):
  x = np.random.default_rng(0).standard_normal(shape)
  ax = axis % len(shape)
  got = sj.groupmean(jnp.asarray(x), s, ax)
  want = ref_groupmean(x, s, ax)
  assert got.shape == want.shape == _pooling.grouped_shape(shape, s, ax)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(sj.expand_groups(got, s, ax, shape[ax]),
                             ref_expand(want, s, ax, shape[ax]), rtol=1e-5, atol=1e-7)


def test_short_last_group_is_mean_of_its_real_elements():
  x = jnp.arange(10.0)
  np.testing.assert_allclose(sj.groupmean(x, 4, 0), [1.5, 5.5, 8.5])


@pytest.mark.parametrize('axis', [-1, -2, 0, 1])
def test_nu_stored_at_ceil_n_over_s_along_axis(axis):
  params = {'w': jnp.zeros((6, 21)), 'b': jnp.zeros((21,)), 'c': jnp.zeros(())}
  state = sj.scale_by_grouped_second_moment(group_size=8, axis=axis).init(params)
  want = [6, 21]
  want[axis] = -(-want[axis] // 8)
  assert state.nu['w'].shape == tuple(want)
  assert state.nu['b'].shape == (3,) and state.nu['c'].shape == ()
  assert state.mu['w'].shape == (6, 21)


@pytest.mark.parametrize('s', [1, 3, 8])
def test_nu_is_groupmean_of_adam_nu(s):
  params = nest({k: jnp.asarray(v, jnp.float32) for k, v in init_params().items()})
  ours, adam = sj.scale_by_grouped_second_moment(group_size=s), optax.scale_by_adam()
  s1, s2 = ours.init(params), adam.init(params)
  grads_fn = make_grads_fn()
  flat0 = init_params()
  for i in range(10):
    g = nest({k: jnp.asarray(v, jnp.float32) for k, v in grads_fn(i, flat0).items()})
    _, s1 = jax.jit(ours.update)(g, s1)
    _, s2 = jax.jit(adam.update)(g, s2)
  for nu, v in zip(jax.tree.leaves(s1.nu), jax.tree.leaves(s2.nu)):
    ax = leaf_axis(v.ndim, -1)
    np.testing.assert_allclose(nu, ref_groupmean(np.asarray(v, np.float64), s, ax),
                               rtol=1e-5, atol=1e-30)
  for m1, m2 in zip(jax.tree.leaves(s1.mu), jax.tree.leaves(s2.mu)):
    np.testing.assert_allclose(m1, m2, rtol=1e-5, atol=1e-6 * float(np.abs(m2).max()))


def test_group_size_one_is_adam():
  got, _ = run_optax(sj.adampm(LR, group_size=1), init_params(), make_grads_fn(), STEPS)
  want, _ = run_optax(optax.adam(LR), init_params(), make_grads_fn(), STEPS)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('s,axis', [(8, -1), (3, -2), (4, 0)])
def test_adampm_matches_reference_over_30_steps(s, axis):
  wd = 0.05
  params = init_params()
  grads_fn = make_grads_fn()
  rules = {k: RefAdamPM(v.shape, s=s, axis=axis) for k, v in params.items()}
  p = {k: v.copy() for k, v in params.items()}
  for i in range(STEPS):
    g = grads_fn(i, p)
    for k in p:
      decay = wd if p[k].ndim >= 2 else 0.0
      p[k] = p[k] - LR * (rules[k].update(g[k]) + decay * p[k])

  def mask(tree):
    return jax.tree.map(lambda x: x.ndim >= 2, tree)

  got, _ = run_optax(sj.adampm(LR, weight_decay=wd, group_size=s, axis=axis, mask=mask),
                     params, grads_fn, STEPS)
  worst = max(np.max(np.abs(got[k] - p[k])) for k in p)
  assert worst <= 1e-5, worst
  assert min(np.max(np.abs(got[k] - params[k])) for k in params) > 1e-4


def test_mu_dtype_stores_momentum_in_that_dtype():
  tx = sj.adampm(1e-3, mu_dtype=jnp.bfloat16)
  state = tx.init({'w': jnp.zeros((4, 16))})
  inner = state[0]
  assert inner.mu['w'].dtype == jnp.bfloat16 and inner.nu['w'].dtype == jnp.float32
  assert inner.nu['w'].shape == (4, 2)


def test_schedule_learning_rate_equals_float_at_each_step():
  sched = optax.linear_schedule(1e-2, 1e-3, 10)
  got, _ = run_optax(sj.adampm(sched), init_params(), make_grads_fn(), 10)
  p = {k: v.copy() for k, v in init_params().items()}
  rules = {k: RefAdamPM(v.shape) for k, v in p.items()}
  grads_fn = make_grads_fn()
  for i in range(10):
    g = grads_fn(i, p)
    for k in p:
      p[k] = p[k] - float(sched(i)) * rules[k].update(g[k])
  assert max(np.max(np.abs(got[k] - p[k])) for k in p) <= 1e-5


def test_adampm_updates_on_a_named_axis_of_one_shard():
  # A mesh axis of size 1 still types the array as sharded on it (Explicit mode); the
  # expansion must not take the unsharded gather path, which cannot infer a sharding.
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((1, 1), ('data', 'expert'))
  tx = sj.adampm(1e-3, group_size=8)
  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.ones((2, 4, 16)), NamedSharding(mesh, P('expert', None, 'data')))
    params = {'w': w}
    state = jax.jit(tx.init)(params)
    updates, state = jax.jit(tx.update)(params, state, params)
  assert updates['w'].shape == (2, 4, 16)
  assert np.all(np.isfinite(np.asarray(updates['w'])))


@pytest.mark.parametrize('axis', [-1, -2, -3])
def test_groupmean_and_expand_groups_take_negative_axes(axis):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 10, 7)), jnp.float32)
  ax = axis % x.ndim
  pooled = sj.groupmean(x, 4, axis)
  np.testing.assert_array_equal(pooled, sj.groupmean(x, 4, ax))
  assert pooled.shape == _pooling.grouped_shape(x.shape, 4, ax)
  np.testing.assert_array_equal(sj.expand_groups(pooled, 4, axis, x.shape[ax]),
                                sj.expand_groups(pooled, 4, ax, x.shape[ax]))
  with pytest.raises(ValueError, match=r'`axis`=3 is out of range .* -3\.\.2'):
    sj.groupmean(x, 4, 3)


def test_axis_and_group_axis_name_one_option():
  """`axis=` is AdamPM's documented keyword; `group_axis=` (Tier's spelling) is the same
  option; both, differing, are an error; the estimator `Grouped` takes `group_axis` only."""
  params = {'w': jnp.zeros((8, 12))}
  new = sj.adampm(1e-3, group_axis=0).init(params)
  assert new[0].nu['w'].shape == (1, 12)
  assert sj.Grouped(4, group_axis=0) == sj.Grouped(4, 0)
  assert sj.Tier(second_moment='grouped', group_axis=0).estimator == sj.Grouped(8, 0)
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # the documented keyword warns about nothing
    old = sj.adampm(1e-3, axis=0).init(params)
    tx = sj.scale_by_grouped_second_moment(axis=0)
  jax.tree.map(np.testing.assert_array_equal, old, new)
  assert tx.init(params).nu['w'].shape == (1, 12)
  assert sj.adampm(1e-3, axis=0, group_axis=0).init(params)[0].nu['w'].shape == (1, 12)
  with pytest.raises(TypeError, match='same option'):
    sj.adampm(1e-3, axis=0, group_axis=1)
  with pytest.raises(TypeError, match='same option'):
    sj.scale_by_grouped_second_moment(axis=1, group_axis=0)
  with pytest.raises(TypeError, match="unexpected keyword argument 'axis'"):
    sj.Grouped(4, axis=0)
  with pytest.raises(ValueError, match='`axis`=2'):
    sj.adampm(1e-3, axis=2).init(params)  # errors name the argument as given
  with pytest.raises(ValueError, match='`group_axis`=2'):
    sj.adampm(1e-3, group_axis=2).init(params)


def test_eps_root_enters_inside_the_square_root_as_in_optax():
  params = {'w': jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)}
  grads = {'w': jnp.cos(params['w'] * 3.0) * 1e-3}
  ours = sj.adampm(1e-2, eps_root=1e-6, group_size=1)
  theirs = optax.adamw(1e-2, eps_root=1e-6, weight_decay=0.0)
  u_ours, _ = ours.update(grads, ours.init(params), params)
  u_theirs, _ = theirs.update(grads, theirs.init(params), params)
  np.testing.assert_allclose(u_ours['w'], u_theirs['w'], rtol=1e-6)
  plain, _ = sj.adampm(1e-2, group_size=1).update(grads, ours.init(params), params)
  assert not np.allclose(plain['w'], u_ours['w'], rtol=1e-3)
