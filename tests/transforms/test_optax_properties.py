"""The properties every optax optimizer has, checked for skewadam and adampm.

Mirrors the common tests of optax's own `optax/_src/alias_test.py`: convergence on
the parabola and Rosenbrock targets (plus a stacked-expert MoE target), no
recompilation on the second jitted update, unknown extra `update` arguments,
`inject_hyperparams`, explicit `mu_dtype`, dtype-preserving updates, state types that
are stable across `lax.cond` branches, `optax.MultiSteps`, schedules, abstract `init`,
large gradients and `optax.tree_utils.tree_get`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj

# A tier mix that uses the grouped (AdamPM-style) second moment in two tiers: pooling
# along rows for the backbone and along the `in` axis (-2) of every expert matrix.
GROUPED_TIERS = {
    'backbone': sj.Tier(momentum=True, second_moment='grouped', group_size=2),
    'experts': sj.Tier(momentum=False, second_moment='grouped', group_size=2,
                       group_axis=-2),
    'router': sj.PUBLISHED_TIERS['router'],
}

# name -> (factory, fixed keyword arguments, names that must be `static_args` under
# optax.inject_hyperparams).
FACTORIES = {
    'skewadam': (sj.skewadam, {}, ()),
    'skewadam_grouped': (sj.skewadam, {'tiers': GROUPED_TIERS}, ()),
    'adampm': (sj.adampm, {}, ('group_size', 'axis')),
}
NAMES = tuple(FACTORIES)


def make(name: str, learning_rate=1e-2, **kwargs) -> optax.GradientTransformation:
  factory, fixed, _ = FACTORIES[name]
  return factory(learning_rate, **fixed, **kwargs)


# Non-default values, so that an ignored injected hyperparameter would show.
HYPERPARAMS = dict(learning_rate=0.05, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)


@functools.cache
def standard(name: str):
  """One optimizer per name with HYPERPARAMS and its jitted init/update, built once so
  that tests with the same argument types share compiled executables."""
  factory, fixed, _ = FACTORIES[name]
  tx = factory(**HYPERPARAMS, **fixed)
  return tx, jax.jit(tx.init), jax.jit(tx.update)


# ---------------------------------------------------------------------------------------
# Targets, as in optax's alias_test.py, plus a stacked-expert MoE target.


def parabola():
  """Quadratic with minimum at [1, -1, 1], from [-1, 10, 1]."""
  final = jnp.array([1.0, -1.0, 1.0])
  return jnp.array([-1.0, 10.0, 1.0]), final, lambda p: jnp.sum((p - final) ** 2)


def rosenbrock():
  """Rosenbrock (a=1, b=100), minimum at [1, 1], from [0, 0]."""
  def objective(p):
    return (1.0 - p[0]) ** 2 + 100.0 * (p[1] - p[0] ** 2) ** 2
  return jnp.array([0.0, 0.0]), jnp.array([1.0, 1.0]), objective


def stacked_experts():
  """A weighted quadratic on an MoE-shaped tree: embedding, norm, router, [E, in, out].

  Curvatures span two decades per element, so each expert matrix (and each row and
  column inside it) needs its own scale; the minimum is a random target.
  """
  rng = np.random.default_rng(0)
  shapes = {'embed': (6, 4), 'ln': {'scale': (4,)},
            'moe': {'router': {'kernel': (4, 3)}, 'experts': {'w1': (3, 4, 5)}}}
  is_shape = lambda x: isinstance(x, tuple)
  final = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32),
                       shapes, is_leaf=is_shape)
  curv = jax.tree.map(lambda s: jnp.asarray(10 ** rng.uniform(-1, 1, s), jnp.float32),
                      shapes, is_leaf=is_shape)

  def objective(p):
    terms = jax.tree.map(lambda x, t, c: jnp.sum(c * (x - t) ** 2), p, final, curv)
    return sum(jax.tree.leaves(terms))

  return jax.tree.map(jnp.zeros_like, final), final, objective


TARGETS = {'parabola': parabola, 'rosenbrock': rosenbrock,
           'stacked_experts': stacked_experts}


def _run(tx, params, objective, steps):
  """`steps` of gradient descent with `tx`, as one compiled scan."""

  def body(carry, _):
    p, state = carry
    updates, state = tx.update(jax.grad(objective)(p), state, p)
    return (optax.apply_updates(p, updates), state), None

  (params, _), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
  return params


@pytest.mark.parametrize('target', tuple(TARGETS))
@pytest.mark.parametrize('name', NAMES)
def test_converges_on_target(name, target):
  init, final, objective = TARGETS[target]()
  start_error = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                    zip(jax.tree.leaves(init), jax.tree.leaves(final)))
  got = jax.jit(functools.partial(_run, make(name, 1e-2), objective=objective,
                                  steps=10_000))(init)
  for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(final)):
    np.testing.assert_allclose(leaf, want, atol=1e-3, rtol=0)
  assert start_error >= 1.0  # the optimizer really had to travel


# ---------------------------------------------------------------------------------------
# Compilation.


@contextlib.contextmanager
def log_compilations():
  """Collects JAX's 'Finished ... compilation' log records (as optax's test_utils)."""
  records: list[logging.LogRecord] = []

  class Handler(logging.Handler):
    def emit(self, record):
      if re.search(r'Finished .* compilation', record.getMessage()):
        records.append(record)

  handler = Handler()
  logger = logging.getLogger('jax')
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      yield records
  finally:
    logger.removeHandler(handler)


def _moe_params(dtype=jnp.float32):
  return jax.tree.map(lambda x: x.astype(dtype), stacked_experts()[1])


def _moe_grads(params, seed=0, scale=1.0):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([(scale * jax.random.normal(k, p.shape)).astype(p.dtype)
                            for k, p in zip(keys, leaves)])


@pytest.mark.parametrize('name', NAMES)
def test_no_recompilation_on_second_update(name):
  _, init, update = standard(name)
  params = _moe_params()
  _, state = update(_moe_grads(params, seed=0), init(params), params)
  with log_compilations() as compiled:
    update(_moe_grads(params, seed=1), state, params)
  assert not compiled, [r.getMessage() for r in compiled]


def test_recompilation_log_sees_a_recompile():
  """The helper above can fail: a changed input dtype recompiles and is logged."""
  f = jax.jit(lambda x: x * 2)
  f(jnp.ones(3, jnp.float32))
  with log_compilations() as compiled:
    f(jnp.ones(3, jnp.bfloat16))
  assert compiled


# ---------------------------------------------------------------------------------------
# Extra arguments.


EXTRA_ARGS_TRANSFORMS = {
    'skewadam': lambda: make('skewadam'),
    'skewadam_grouped': lambda: make('skewadam_grouped'),
    'adampm': lambda: make('adampm'),
    'scale_by_tiered_adam': lambda: sj.scale_by_tiered_adam(),
    'scale_by_tiered_adam_grouped': lambda: sj.scale_by_tiered_adam(
        tier=GROUPED_TIERS['backbone']),
    'scale_by_grouped_second_moment': lambda: sj.scale_by_grouped_second_moment(),
}


@pytest.mark.parametrize('name', tuple(EXTRA_ARGS_TRANSFORMS))
def test_accepts_unknown_extra_args(name):
  """`update(..., some_unknown_arg=1)` traces (under jit) to the same result types, on
  its own and chained after another transform."""
  tx = EXTRA_ARGS_TRANSFORMS[name]()
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  params = _moe_params()
  grads = _moe_grads(params)
  state = tx.init(params)
  extra = {'unexpected_extra_args_your_optimizer_doesnt_expect': 1}
  got = jax.eval_shape(jax.jit(functools.partial(tx.update, **extra)), grads, state, params)
  assert got == jax.eval_shape(tx.update, grads, state, params)
  chained = optax.chain(optax.clip_by_global_norm(1.0), tx)
  jax.eval_shape(functools.partial(chained.update, some_unknown_arg=1), grads,
                 chained.init(params), params)


# ---------------------------------------------------------------------------------------
# inject_hyperparams.


@pytest.mark.parametrize('name', NAMES)
def test_inject_hyperparams_matches_plain_factory(name):
  factory, fixed, static = FACTORIES[name]
  _, plain_init, plain_update = standard(name)
  injected = optax.inject_hyperparams(factory, static_args=static)(**HYPERPARAMS, **fixed)
  inject_update = jax.jit(injected.update)
  params = _moe_params()
  state, istate = plain_init(params), injected.init(params)
  assert set(HYPERPARAMS) <= set(istate.hyperparams)
  for i in range(3):
    grads = _moe_grads(params, seed=i)
    updates, state = plain_update(grads, state, params)
    iupdates, istate = inject_update(grads, istate, params)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7),
                 iupdates, updates)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-9),
                 istate.inner_state, state)
    params = optax.apply_updates(params, updates)
  # The hyperparameters are live: doubling the injected learning rate doubles the step.
  istate.hyperparams['learning_rate'] = 2 * istate.hyperparams['learning_rate']
  grads = _moe_grads(params, seed=9)
  doubled, _ = inject_update(grads, istate, params)
  single, _ = plain_update(grads, state, params)
  # atol as for the updates above: where Adam's step and the weight decay nearly cancel,
  # the difference keeps the float32 rounding of terms of ~0.03 (an ulp is ~4e-9 there),
  # which jit may round differently (jax 0.5.3 did by 1.5e-9 on one element).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 2 * b, rtol=1e-5, atol=1e-7),
               doubled, single)


@pytest.mark.parametrize('static, axis', [
    ((), 'group_axis'), (('group_size',), 'group_axis'), (('group_axis',), 'group_axis'),
    (('group_size',), 'axis')])  # either spelling of the pooled axis, named as given
def test_inject_hyperparams_traced_static_arg_error_names_static_args(static, axis):
  """A pooled axis passed as an int is traced unless static, like `group_size`."""
  missing = axis if 'group_size' in static else 'group_size'  # checked in this order
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    tx = optax.inject_hyperparams(sj.adampm, static_args=static)(learning_rate=1e-3,
                                                                 **{axis: -1})
  with pytest.raises(TypeError, match=rf"`{missing}` must be a static .*static_args=\("
                                      rf"'{missing}'"):
    jax.jit(tx.init)(_moe_params())


def test_inject_hyperparams_dtype_class_must_be_static():
  # inject_hyperparams treats the class `jnp.float32` as a schedule; its value (an
  # array) must not silently become the state dtype.
  tx = optax.inject_hyperparams(sj.adampm, static_args=('group_size', 'axis'))(
      1e-3, mu_dtype=jnp.float32)
  with pytest.raises(TypeError, match=r"`mu_dtype` must be a floating dtype.*static_args"):
    tx.init(_moe_params(jnp.bfloat16))
  ok = optax.inject_hyperparams(sj.adampm, static_args=('group_size', 'axis', 'mu_dtype'))(
      1e-3, mu_dtype=jnp.float32)
  state = ok.init(_moe_params(jnp.bfloat16))
  assert {x.dtype for x in jax.tree.leaves(state.inner_state[0].mu)} == {jnp.dtype('float32')}


def test_inject_hyperparams_with_static_mask_function_matches_plain():
  """A mask function is a callable, which inject_hyperparams would call as a schedule
  (with the step count) unless it is named in `static_args` (docs/numerics.md)."""
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  params = _moe_params()
  injected = optax.inject_hyperparams(sj.adampm, static_args=('group_size', 'axis', 'mask'))(
      1e-2, weight_decay=0.5, mask=mask)
  plain = sj.adampm(1e-2, weight_decay=0.5, mask=mask)
  unmasked = sj.adampm(1e-2, weight_decay=0.5)
  grads = _moe_grads(params)
  got, _ = injected.update(grads, injected.init(params), params)
  want, _ = plain.update(grads, plain.init(params), params)
  # Injected b2 = 0.999 is a float32 array, so 1 - b2 is off by 1e-5 relative.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7), got,
               want)
  # The mask matters here: 1-D leaves get no decay.
  other, _ = unmasked.update(grads, unmasked.init(params), params)
  assert not np.allclose(got['ln']['scale'], other['ln']['scale'])
  np.testing.assert_allclose(got['embed'], other['embed'], rtol=1e-4)


# ---------------------------------------------------------------------------------------
# Dtypes.


@pytest.mark.parametrize('params_dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('mu_dtype', ['bfloat16', 'float32', None])
def test_explicit_mu_dtype_adampm(params_dtype, mu_dtype):
  tx = sj.adampm(0.1, mu_dtype=mu_dtype)
  state = tx.init(jnp.zeros((2, 16), params_dtype))
  mu = optax.tree_utils.tree_get(state, 'mu')
  assert mu.dtype == jnp.dtype(mu_dtype or params_dtype)


@pytest.mark.parametrize('params_dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('mu_dtype', ['bfloat16', 'float32'])
def test_explicit_mu_dtype_skewadam(params_dtype, mu_dtype):
  tiers = dict(sj.PUBLISHED_TIERS)
  tiers['backbone'] = tiers['backbone'].replace(mu_dtype=mu_dtype)
  tx = sj.skewadam(0.1, tiers=tiers)
  params = _moe_params(params_dtype)
  state = tx.init(params)
  mu = optax.tree_utils.tree_get(state, 'mu')
  assert mu['embed'].dtype == jnp.dtype(mu_dtype)
  assert mu['ln']['scale'].dtype == jnp.dtype(mu_dtype)
  # Tiers without momentum store none, whatever the dtype.
  assert not jax.tree.leaves(mu['moe']['experts'])


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('name', NAMES)
def test_updates_keep_param_dtype(name, dtype):
  """Traced (as under jit) for two steps: updates and new params keep the params' dtype,
  and the state after an update has the types `init` gave it."""
  tx, _, _ = standard(name)
  params = _moe_params(dtype)
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return updates, optax.apply_updates(params, updates), state

  for i in range(2):
    updates, params, new_state = jax.eval_shape(step, params, state,
                                                _moe_grads(_moe_params(dtype), seed=i))
    assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(dtype)}
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
    assert _types(new_state) == _types(state)
    state = new_state


def _types(tree):
  return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype), getattr(x, 'weak_type', False)),
                      tree)


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('name', NAMES)
def test_state_types_stable_across_cond_branches(name, dtype):
  """As optax's test_state_shape_dtype_shard_stability: both branches of a `lax.cond`
  (update, or pass params and state through) must give identical types, or tracing
  fails. Tracing is the whole check, so `eval_shape` runs it without compiling."""
  tx, _, _ = standard(name)
  _, _, objective = stacked_experts()

  def step(params, state):
    grads = jax.grad(objective)(params)
    cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
    updates, state = jax.lax.cond(cond, lambda: tx.update(grads, state, params),
                                  lambda: (params, state))
    return optax.apply_updates(params, updates), state

  def two_steps(params, state):
    for _ in range(2):
      params, new_state = step(params, state)
      cond = jax.random.randint(jax.random.key(1), (), 0, 2) == 0
      state = jax.lax.cond(cond, lambda s=state: s, lambda s=new_state: s)
    return params, state

  params = _moe_params(dtype)
  out_params, out_state = jax.eval_shape(two_steps, params, tx.init(params))
  assert {x.dtype for x in jax.tree.leaves(out_params)} == {jnp.dtype(dtype)}
  assert _types(out_state) == _types(tx.init(params))


# ---------------------------------------------------------------------------------------
# Wrappers and schedules.


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('name', NAMES)
def test_multisteps_first_update_is_zero(name, dtype):
  tx = optax.MultiSteps(standard(name)[0], every_k_schedule=4)
  update = jax.jit(tx.update)  # once: `tx.update` is a new bound method at each access
  params = _moe_params(dtype)
  grads = _moe_grads(params)
  state = tx.init(params)
  updates, state = update(grads, state, params)
  jax.tree.map(lambda u: np.testing.assert_array_equal(u, jnp.zeros_like(u)), updates)
  # ...and the fourth (the first real step) is not.
  for _ in range(3):
    updates, state = update(grads, state, params)
  assert all(float(jnp.max(jnp.abs(u.astype(jnp.float32)))) > 0
             for u in jax.tree.leaves(updates))


@pytest.mark.parametrize('name', NAMES)
def test_constant_schedule_equals_float_learning_rate(name):
  factory, fixed, _ = FACTORIES[name]
  _, init, update = standard(name)
  schedule = optax.constant_schedule(HYPERPARAMS['learning_rate'])
  scheduled = factory(**dict(HYPERPARAMS, learning_rate=schedule), **fixed)
  sched_update = jax.jit(scheduled.update)
  params = _moe_params()
  s_float, s_sched = init(params), scheduled.init(params)
  for i in range(3):
    grads = _moe_grads(params, seed=i)
    u_float, s_float = update(grads, s_float, params)
    u_sched, s_sched = sched_update(grads, s_sched, params)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=0),
                 u_sched, u_float)
    params = optax.apply_updates(params, u_float)


@pytest.mark.parametrize('name', NAMES)
def test_init_on_shape_dtype_structs(name):
  tx = make(name)
  params = _moe_params()
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  concrete = tx.init(params)
  spec = lambda s: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), s)
  assert spec(jax.eval_shape(tx.init, abstract)) == spec(concrete)
  direct = tx.init(abstract)  # every state leaf is zeros_like(param): no values needed
  assert spec(direct) == spec(concrete)
  jax.tree.map(np.testing.assert_array_equal, direct, concrete)


# ---------------------------------------------------------------------------------------
# Large gradients and tree_get.


@pytest.mark.parametrize('scale', [1e6, 1e15])
@pytest.mark.parametrize('name', NAMES)
def test_finite_state_and_updates_under_large_gradients(name, scale):
  # 1e15 keeps g^2 (1e30) and its row/column sums inside float32's range (3.4e38).
  _, init, update = standard(name)
  params = _moe_params()
  state = init(params)
  for i in range(3):
    updates, state = update(_moe_grads(params, seed=i, scale=scale), state, params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((updates, state)))
    # Adam-like: the update is scale-free, a step of at most a few learning rates.
    assert max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(updates)) < 20 * 0.05
    params = optax.apply_updates(params, updates)


@pytest.mark.parametrize('name', ['adampm'])
def test_tree_get_finds_mu_and_count_adampm(name):
  _, init, update = standard(name)
  params = _moe_params()
  state = init(params)
  for i in range(3):
    _, state = update(_moe_grads(params, seed=i), state, params)
  mu = optax.tree_utils.tree_get(state, 'mu')
  assert jax.tree.structure(mu) == jax.tree.structure(params)
  assert int(optax.tree_utils.tree_get(state, 'count')) == 3


@pytest.mark.parametrize('name', ['skewadam', 'skewadam_grouped'])
def test_tree_get_finds_mu_and_count_skewadam(name):
  """One state for every tier: one `mu` (a leaf where the tier keeps momentum, None
  elsewhere) and one step count, found by name as in any optax state."""
  _, init, update = standard(name)
  params = _moe_params()
  state = init(params)
  for i in range(3):
    _, state = update(_moe_grads(params, seed=i), state, params)
  mu = optax.tree_utils.tree_get(state, 'mu')
  assert mu['embed'].shape == params['embed'].shape
  assert mu['ln']['scale'].shape == params['ln']['scale'].shape
  assert float(jnp.max(jnp.abs(mu['embed']))) > 0
  assert not jax.tree.leaves(mu['moe'])  # the experts and router tiers keep no momentum
  assert int(optax.tree_utils.tree_get(state, 'count')) == 3
