"""The full optimizers inside real pipelines: jit, inject_hyperparams, chain, MultiSteps,
abstract init and flax.nnx.Optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj
import moe_models as mm
from trees import init_params, make_grads_fn, nest, run_optax

FACTORIES = {'skewadam': sj.skewadam, 'adampm': sj.adampm}


def _params():
  return nest({k: jnp.asarray(v, jnp.float32) for k, v in init_params().items()})


@pytest.mark.parametrize('name', FACTORIES)
def test_jit_equals_eager(name):
  tx = FACTORIES[name](learning_rate=1e-2, weight_decay=0.1)
  eager, _ = run_optax(tx, init_params(), make_grads_fn(), 3, jit=False)
  jitted, _ = run_optax(tx, init_params(), make_grads_fn(), 3, jit=True)
  for k in eager:
    np.testing.assert_allclose(jitted[k], eager[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('name', FACTORIES)
def test_inject_hyperparams_gives_same_results(name):
  kw = dict(learning_rate=1e-2, b1=0.8, b2=0.99, weight_decay=0.1)
  plain, s_plain = run_optax(FACTORIES[name](**kw), init_params(), make_grads_fn(), 5)
  # Group size and axis are static: optax would turn the ints into traced arrays.
  static = ('group_size', 'axis') if name == 'adampm' else ()
  injected_tx = optax.inject_hyperparams(FACTORIES[name], static_args=static)(**kw)
  injected, s_inj = run_optax(injected_tx, init_params(), make_grads_fn(), 5)
  for k in plain:
    np.testing.assert_allclose(injected[k], plain[k], rtol=1e-6, atol=1e-7)
  assert float(s_inj.hyperparams['b1']) == pytest.approx(0.8)
  # Changing an injected value changes the trajectory (so it is really used).
  s_inj.hyperparams['learning_rate'] = jnp.asarray(0.0)
  p = nest({k: jnp.asarray(v, jnp.float32) for k, v in injected.items()})
  updates, _ = injected_tx.update(jax.tree.map(jnp.ones_like, p), s_inj, p)
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))


@pytest.mark.parametrize('name', FACTORIES)
def test_inside_chain_with_clipping(name):
  tx = optax.chain(optax.clip_by_global_norm(1.0), FACTORIES[name](learning_rate=1e-2))
  got, _ = run_optax(tx, init_params(), make_grads_fn(), 5)
  assert all(np.all(np.isfinite(v)) for v in got.values())
  moved = max(np.max(np.abs(got[k] - v)) for k, v in init_params().items())
  assert moved > 1e-3


@pytest.mark.parametrize('name', FACTORIES)
def test_multisteps_accumulates_then_applies(name):
  k = 3
  tx = optax.MultiSteps(FACTORIES[name](learning_rate=1e-2), every_k_schedule=k)
  params = _params()
  state = tx.init(params)
  g = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
  update = jax.jit(tx.update)
  for i in range(k):
    updates, state = update(g, state, params)
    nonzero = any(float(jnp.max(jnp.abs(u))) > 0 for u in jax.tree.leaves(updates))
    assert nonzero == (i == k - 1)
  # The applied update equals one step of the inner optimizer on the mean gradient.
  inner = FACTORIES[name](learning_rate=1e-2)
  want, _ = inner.update(g, inner.init(params), params)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize('name', FACTORIES)
def test_init_on_shape_dtype_structs(name):
  tx = FACTORIES[name](learning_rate=1e-3)
  params = _params()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  shapes = jax.eval_shape(tx.init, abstract)
  concrete = tx.init(params)
  assert jax.tree.structure(shapes) == jax.tree.structure(concrete)
  for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(concrete)):
    assert a.shape == b.shape and a.dtype == b.dtype


def test_schedule_learning_rate():
  sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10)
  got, state = run_optax(sj.skewadam(sched), init_params(), make_grads_fn(), 4)
  steps = [float(sched(i)) for i in range(4)]
  assert steps[0] == 0.0 and steps[3] > 0
  moved = max(np.max(np.abs(got[k] - v)) for k, v in init_params().items())
  assert moved > 1e-4


def test_router_tier_is_not_decayed():
  params = {'moe': {'router': jnp.ones((4, 3)), 'experts': {'w1': jnp.ones((3, 4, 5))}},
            'embed': jnp.ones((6, 4))}
  tx = sj.skewadam(1.0, weight_decay=0.5)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  assert float(jnp.max(jnp.abs(updates['moe']['router']))) == 0.0
  np.testing.assert_allclose(updates['embed'], -0.5 * params['embed'])
  np.testing.assert_allclose(updates['moe']['experts']['w1'], -0.5)


@pytest.mark.parametrize('name', FACTORIES)
def test_nnx_optimizer_trains_an_moe_model(name):
  losses, optimizer = mm.train_nnx(FACTORIES[name](learning_rate=1e-2))
  assert losses[-1] < 0.7 * losses[0], losses
  if name == 'skewadam':
    state = optimizer.opt_state[0]  # one state for every tier, one step count
    assert isinstance(state, sj.TieredAdamState) and int(state.count[...]) == 20


def _python_float_case(name, jit):
  """A Python float leaf is a 0-d float32 array, as `optax.adamw` treats it: the same
  updates and state as with `jnp.asarray(1.5)`."""
  tx = FACTORIES[name](1e-2, weight_decay=0.1)
  w = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  scalar, array = {'w': w, 's': 1.5}, {'w': w, 's': jnp.asarray(1.5)}
  grads, array_grads = {'w': jnp.cos(w), 's': 0.25}, {'w': jnp.cos(w), 's': jnp.asarray(0.25)}
  types = lambda tree: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)
  state = tx.init(scalar)
  assert types(state) == types(tx.init(array))
  update = jax.jit(tx.update) if jit else tx.update
  ref, ref_state = jax.jit(tx.update)(array_grads, state, array)
  updates, new_state = update(grads, state, scalar)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert types(new_state) == types(ref_state) == types(state)  # it feeds back
  assert float(ref['s']) != 0.0


@pytest.mark.parametrize('name', FACTORIES)
def test_python_float_leaves_work_as_in_optax_under_jit(name):
  _python_float_case(name, jit=True)


@pytest.mark.slow  # eager: every op of the first update is compiled on its own
@pytest.mark.parametrize('name', FACTORIES)
def test_python_float_leaves_work_as_in_optax_eagerly(name):
  _python_float_case(name, jit=False)


def test_adampm_arguments_after_eps_are_keywords_in_optax_adamw_order():
  import inspect  # noqa: PLC0415
  names = list(inspect.signature(sj.adampm).parameters)
  adamw = [n for n in inspect.signature(optax.adamw).parameters if n in names]
  assert [n for n in names if n in adamw] == adamw  # the same relative order
  assert names[:4] == ['learning_rate', 'b1', 'b2', 'eps']
  # A fifth positional argument is refused (optax.adamw's would be eps_root).
  with pytest.raises(TypeError, match=r'takes from 1 to 4 positional arguments'):
    sj.adampm(1e-3, 0.9, 0.999, 1e-8, 0.1)
  a = sj.adampm(1e-3, 0.9, 0.999, 1e-8, weight_decay=0.1)
  params = {'w': jnp.ones((4, 8))}
  u, _ = a.update(jax.tree.map(jnp.zeros_like, params), a.init(params), params)
  np.testing.assert_allclose(u['w'], -1e-3 * 0.1 * params['w'], rtol=1e-6)


def test_skewadam_mask_selects_the_leaves_weight_decay_applies_to():
  """Decay applies where the tier's flag and `mask` both say so (as optax.adamw's)."""
  params = {'embed': jnp.ones((16, 8)), 'norm': {'scale': jnp.ones((8,))},
            'moe': {'router': jnp.ones((8, 4)), 'experts': {'w1': jnp.ones((4, 8, 16))}}}
  zeros = jax.tree.map(jnp.zeros_like, params)
  mask = {'embed': True, 'norm': False, 'moe': True}  # a prefix of the params

  def decayed(tx):
    u, _ = tx.update(zeros, tx.init(params), params)
    return {k: bool(jnp.any(v != 0)) for k, v in
            zip(['embed', 'experts', 'router', 'norm'],
                [u['embed'], u['moe']['experts']['w1'], u['moe']['router'],
                 u['norm']['scale']])}

  assert decayed(sj.skewadam(1e-2, weight_decay=0.1)) == {
      'embed': True, 'experts': True, 'router': False, 'norm': True}
  expected = {'embed': True, 'experts': True, 'router': False, 'norm': False}
  assert decayed(sj.skewadam(1e-2, weight_decay=0.1, mask=mask)) == expected
  assert decayed(sj.skewadam(1e-2, weight_decay=0.1, mask=lambda p: mask)) == expected
