"""Coded state under faults: zero-size leaves, NaN and Inf in coded blocks, every
spelling of a bad hyperparameter, gradients of another tree, and a state whose tree
structure is the same before and after a step (one trace of a jitted NNX step)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import skewadam_jax as sj

PRESETS = {
    'published': sj.PUBLISHED_TIERS,
    'muon': sj.MUON_TIERS,
    'muon_coded': sj.MUON_CODED_TIERS,
}
LABELS = sj.make_labeler([('router/*', 'router'), ('bank/*', 'experts'),
                          ('hid/*', 'hidden'), ('*', 'backbone')])
# The published tiers have no hidden tier: their hidden matrices are backbone.
PUBLISHED_LABELS = sj.make_labeler([('router/*', 'router'), ('bank/*', 'experts'),
                                    ('*', 'backbone')])


def _quiet(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    return fn(*args, **kwargs)


def _tx(preset, **kw):
  labels = PUBLISHED_LABELS if preset == 'published' else LABELS
  return sj.skewadam(1e-2, tiers=PRESETS[preset], param_labels=labels, **kw)


def _finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.floating))


# ------------------------------------------------------------------ zero-size leaves

ZERO_SHAPES = [(4, 0, 128), (0, 16, 32), (0,), (16, 0), (2, 3, 0, 8)]


@pytest.mark.parametrize('preset', sorted(PRESETS))
@pytest.mark.parametrize('shape', ZERO_SHAPES)
def test_zero_size_leaves_train_like_adamw(preset, shape):
  """A leaf with no elements in any tier: zero update, finite state, the other leaves'
  updates those of the tree without it, as `optax.adamw` treats it."""
  rng = np.random.default_rng(0)
  rest = {'hid': {'w': jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)},
          'bank': {'w': jnp.asarray(rng.standard_normal((4, 64, 128)), jnp.float32)},
          'router': {'w': jnp.asarray(rng.standard_normal((64, 4)), jnp.float32)}}
  empty = jnp.zeros(shape, jnp.float32)
  # (a vector labelled hidden is refused whatever its size: no matrix to orthogonalise)
  for tier in ('hid', 'bank', 'router', 'norm') if len(shape) > 1 else ('router', 'norm'):
    params = jax.tree.map(lambda x: x, rest)
    params.setdefault(tier, {})['empty'] = empty
    tx = _tx(preset)
    state = _quiet(tx.init, params)
    base_tx = _tx(preset)
    base_state = _quiet(base_tx.init, rest)
    step = jax.jit(tx.update)
    base_step = jax.jit(base_tx.update)
    for _ in range(3):
      u, state = _quiet(step, params, state, params)
      bu, base_state = _quiet(base_step, rest, base_state, rest)
    assert u[tier]['empty'].shape == shape
    assert _finite(state), (tier, shape)
    for k in rest:
      for name in rest[k]:
        np.testing.assert_array_equal(u[k][name], bu[k][name])


@pytest.mark.parametrize('bits', [8, 6, 4, 2])
@pytest.mark.parametrize('shape', ZERO_SHAPES)
def test_zero_size_leaves_under_every_codec(bits, shape):
  codec = sj.Blockwise(bits=bits, block_size=64, min_size=0)
  tx = sj.scale_by_tiered_adam(tier=sj.Tier(mu_codec=codec))
  params = {'w': jnp.zeros(shape)}
  state = tx.init(params)
  u, state = jax.jit(tx.update)(params, state, params)
  assert u['w'].shape == shape and _finite(state)
  assert codec.for_leaf(shape).decode(codec.for_leaf(shape).encode(params['w'])).shape == shape


# ------------------------------------------------------------------ NaN / Inf in codes


@settings(max_examples=30, deadline=None)
@given(block=st.sampled_from([16, 64, 256]), bits=st.sampled_from([8, 6, 4]),
       mapping=st.sampled_from(['linear', 'dynamic']),
       bad=st.sampled_from([np.nan, np.inf, -np.inf]), seed=st.integers(0, 2**31 - 1),
       count=st.integers(1, 5))
def test_non_finite_values_make_their_blocks_nan_eagerly_and_jitted(block, bits, mapping,
                                                                    bad, seed, count):
  """A NaN or an Inf anywhere in a block: that block decodes to NaN and every other
  block decodes as without it, the same eagerly and under jit (whatever a platform's
  max reduction does with NaN)."""
  rng = np.random.default_rng(seed)
  shape = (4, 8, 64)
  x = rng.standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1).copy()
  where = rng.choice(flat.size, count, replace=False)
  flat[where] = bad
  y = flat.reshape(shape)
  codec = sj.Blockwise(bits=bits, block_size=block, mapping=mapping).for_leaf(shape)
  blocks = np.zeros(flat.size, bool)
  blocks[where] = True
  poisoned = blocks.reshape(-1, block).any(axis=1).repeat(block).reshape(shape)
  clean = codec.decode(codec.encode(jnp.asarray(np.where(poisoned, 0, x))))
  for run in (lambda v: codec.decode(codec.encode(v)),
              jax.jit(lambda v: codec.decode(codec.encode(v)))):
    out = np.asarray(run(jnp.asarray(y)))
    assert np.isnan(out[poisoned]).all()
    np.testing.assert_array_equal(out[~poisoned], np.asarray(clean)[~poisoned])
  eager, jitted = codec.encode(jnp.asarray(y)), jax.jit(codec.encode)(jnp.asarray(y))
  np.testing.assert_array_equal(eager.codes, jitted.codes)


@pytest.mark.parametrize('bad', [np.nan, np.inf])
def test_non_finite_gradient_persists_in_coded_momentum_as_in_float32(bad):
  """Without `apply_if_finite`, a NaN (or Inf) expert gradient poisons that expert's
  update at this step and every later one, with coded momentum as with float32."""
  rng = np.random.default_rng(0)
  params = {'bank': {'w': jnp.asarray(rng.standard_normal((4, 64, 128)), jnp.float32)},
            'router': {'w': jnp.asarray(rng.standard_normal((64, 4)), jnp.float32)}}
  coded = sj.MUON_CODED_TIERS
  plain = {**coded, 'experts': coded['experts'].replace(mu_codec=None)}
  for tiers in (coded, plain):
    tx = sj.skewadam(1e-2, tiers=tiers, param_labels=LABELS)
    state = _quiet(tx.init, params)
    g = jax.tree.map(jnp.ones_like, params)
    g['bank']['w'] = g['bank']['w'].at[1, 3, 5].set(bad)
    for step in (jax.jit(tx.update), tx.update):
      s = state
      u, s = _quiet(step, g, s, params)
      assert not np.isfinite(np.asarray(u['bank']['w'][1])).all()
      assert np.isfinite(np.asarray(u['bank']['w'][0])).all()
      u, s = _quiet(step, jax.tree.map(jnp.ones_like, params), s, params)
      assert not np.isfinite(np.asarray(u['bank']['w'][1])).all(), tiers is coded


# ------------------------------------------------------------------ hyperparameter types

SPELLINGS = [float, int, np.float32, np.int64, lambda v: np.array(v), lambda v: np.array(
    float(v)), lambda v: jnp.asarray(v), lambda v: jnp.asarray(float(v))]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(['b1', 'b2']), value=st.sampled_from([1, 2, -1, 7]),
       spell=st.sampled_from(SPELLINGS), factory=st.sampled_from(['skewadam', 'adampm']))
def test_betas_out_of_range_are_refused_in_every_spelling(name, value, spell, factory):
  make = getattr(sj, factory)
  with pytest.raises(ValueError, match=rf'`{name}` must be in \[0, 1\)'):
    make(1e-3, **{name: spell(value)})


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(['eps', 'weight_decay']), spell=st.sampled_from(SPELLINGS),
       factory=st.sampled_from(['skewadam', 'adampm']))
def test_negative_values_are_refused_in_every_spelling(name, spell, factory):
  with pytest.raises(ValueError, match=rf'`{name}` must be >= 0'):
    getattr(sj, factory)(1e-3, **{name: spell(-1)})


@pytest.mark.parametrize('spell', SPELLINGS[:2] + SPELLINGS[4:6])
def test_in_range_values_in_every_spelling_give_finite_updates(spell):
  params = {'w': jnp.ones((8, 4))}
  tx = sj.skewadam(1e-3, b1=spell(0), b2=spell(0), eps=spell(0))
  u, _ = tx.update(params, tx.init(params), params)
  assert _finite(u)


def test_learning_rate_must_be_finite():
  with pytest.raises(ValueError, match='`learning_rate` must be finite'):
    sj.skewadam(np.array(np.nan))


# ------------------------------------------------------------------ tree mismatches


@pytest.mark.parametrize('make', [lambda: sj.skewadam(1e-3), lambda: sj.adampm(1e-3),
                                  lambda: _tx('muon_coded')])
def test_a_grads_tree_of_other_leaves_names_the_paths(make):
  params = {'a': {'w': jnp.ones((4, 4))}, 'b': jnp.ones(3)}
  tx = make()
  state = _quiet(tx.init, params)
  with pytest.raises(ValueError, match=r'missing from the updates: b\b'):
    tx.update({'a': {'w': jnp.ones((4, 4))}}, state, params)
  with pytest.raises(ValueError, match=r'not in the optimizer state: c\b'):
    tx.update({**params, 'c': jnp.ones(2)}, state, params)


# ------------------------------------------------------------------ structure stability


@pytest.mark.parametrize('preset', sorted(PRESETS))
def test_nnx_optimizer_step_traces_once(preset):
  """The state's tree structure after a step is `init`'s: a jitted `nnx.Optimizer` step
  compiles once over three steps (a coded momentum once came back as a dict)."""
  nnx = pytest.importorskip('flax.nnx')

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.router = nnx.Linear(16, 4, rngs=rngs)
      self.bank = nnx.Param(0.1 * jax.random.normal(rngs.params(), (4, 16, 512)))
      self.hid = nnx.Linear(512, 512, rngs=rngs)
      self.out = nnx.Linear(512, 16, rngs=rngs)

    def __call__(self, x):
      gate = jax.nn.softmax(self.router(x))
      h = jnp.einsum('be,bef->bf', gate, jnp.einsum('bd,edf->bef', x, self.bank[...]))
      return self.out(self.hid(h))

  labels = sj.make_labeler([('router/*', 'router'), ('bank', 'experts')] + (
      [] if preset == 'published' else [('hid/kernel', 'hidden')]) + [('*', 'backbone')])
  model = Model(nnx.Rngs(0))
  opt = _quiet(nnx.Optimizer, model, sj.skewadam(1e-3, tiers=PRESETS[preset],
                                                 param_labels=labels), wrt=nnx.Param)
  before = jax.tree_util.tree_structure(nnx.state(opt))
  traces = []

  @nnx.jit
  def step(model, opt, x):
    traces.append(None)
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)

  for _ in range(3):
    _quiet(step, model, opt, jnp.ones((8, 16)))
  assert len(traces) == 1
  assert jax.tree_util.tree_structure(nnx.state(opt)) == before


@pytest.mark.parametrize('preset', sorted(PRESETS))
def test_plain_state_structure_is_stable(preset):
  rng = np.random.default_rng(0)
  params = {'bank': {'w': jnp.asarray(rng.standard_normal((4, 64, 128)), jnp.float32)},
            'hid': {'w': jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)},
            'router': {'w': jnp.asarray(rng.standard_normal((64, 4)), jnp.float32)},
            'norm': {'scale': jnp.ones(64)}}
  tx = _tx(preset)
  state = _quiet(tx.init, params)
  _, new = _quiet(jax.jit(tx.update), params, state, params)
  assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), new) == jax.tree.map(
      lambda x: (x.shape, x.dtype), state)


def test_optax_chain_keeps_the_skewadam_state_structure():
  params = {'bank': {'w': jnp.ones((4, 64, 128))}, 'router': {'w': jnp.ones((64, 4))}}
  tx = optax.chain(optax.clip_by_global_norm(1.0), _tx('muon_coded'))
  state = _quiet(tx.init, params)
  _, new = _quiet(jax.jit(tx.update), params, state, params)
  assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)


# ------------------------------------------------------------------ jax.grad


def _grad_setup():
  codec = sj.Blockwise(bits=8, block_size=64)
  shape = (16, 64)
  rng = np.random.default_rng(0)
  p = {'w': jnp.asarray(rng.standard_normal(shape), jnp.float32)}
  g0 = {'w': jnp.asarray(rng.standard_normal(shape), jnp.float32)}
  weights = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  g1 = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return codec, shape, p, g0, weights, g1


def test_grad_of_one_coded_step_is_the_float32_steps():
  """One step's update is computed from the float32 momentum: its derivative with
  respect to the gradient is that of a float32 momentum holding the decoded codes."""
  codec, shape, p, g0, weights, g1 = _grad_setup()
  coded = sj.scale_by_tiered_adam(tier=sj.Tier(mu_codec=codec))
  plain = sj.scale_by_tiered_adam(tier=sj.Tier())
  sc = coded.update(g0, coded.init(p), p)[1]
  sf = plain.update(g0, plain.init(p), p)[1]
  sf = sf._replace(mu={'w': codec.for_leaf(shape).decode(sc.mu['w'])})

  def loss(tx, s):
    return lambda g: jnp.sum(tx.update({'w': g}, s, p)[0]['w'] * weights)

  a = jax.grad(loss(coded, sc))(g1)
  b = jax.grad(loss(plain, sf))(g1)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_grad_through_coded_state_is_refused():
  """Across steps the derivative would flow through the codes' scales alone (the codes
  are integers): refused with a TypeError, where a float32 momentum differentiates."""
  codec, _, p, g0, weights, g1 = _grad_setup()

  def two_steps(tx):
    def f(g):
      s = tx.update({'w': g}, tx.init(p), p)[1]
      return jnp.sum(tx.update(g0, s, p)[0]['w'] * weights)
    return f

  assert _finite(jax.grad(two_steps(sj.scale_by_tiered_adam(tier=sj.Tier())))(g1))
  with pytest.raises(TypeError, match='jax.grad through a coded momentum'):
    jax.grad(two_steps(sj.scale_by_tiered_adam(tier=sj.Tier(mu_codec=codec))))(g1)
