"""The orthogonalised (Muon) update as a tier option, its labels and `MUON_TIERS`.

Against the float64 NumPy reference of tests/support/reference.py (independent of optax) and
against `optax.contrib.muon`. Float32 tolerances: the Newton-Schulz iteration in
float32 agrees with float64 to ~1e-6 of the update's RMS on these sizes; 1e-4 of the
RMS (1e-5 against optax, the same float32 algorithm) leaves room for any CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from optax import contrib

import skewadam_jax as sj
from reference import RefOrthogonalTier, RefTier, ref_newton_schulz
from trees import MOE_LEAVES, init_params, make_grads_fn, run_optax

HIDDEN = sj.MUON_TIERS['hidden']
HIDDEN_NS_STEPS = sj.Orthogonal().ns_steps

# name -> (shape, batch axes): stacked experts [E, in, out], scanned layers [L, in, out],
# layers stacked on axis 1 as MaxText does [in, L, out], tall and wide matrices, and a
# leaf whose rows are two axes [in, heads, head_dim].
LEAVES = {
    'experts': ((4, 12, 20), (0,)),
    'scanned': ((3, 20, 12), (0,)),
    'maxtext': ((12, 3, 20), (1,)),
    'tall': ((24, 10), ()),
    'wide': ((10, 24), ()),
    'heads': ((8, 3, 5), ()),
}


def _grads(step: int, shape, scale=1.0):
  rng = np.random.default_rng(100 + step)
  return scale * rng.standard_normal(shape)


def _run_tier(tier, shape, axes, steps, scale=1.0):
  tx = sj.scale_by_tiered_adam(tier=tier, batch_axes={'w': axes})
  state = tx.init({'w': jnp.zeros(shape)})
  out = []
  for i in range(steps):
    u, state = tx.update({'w': jnp.asarray(_grads(i, shape, scale), jnp.float32)}, state)
    out.append(np.asarray(u['w'], np.float64))
  return out, state


def _assert_close_in_rms(got, want, rel):
  rms = np.sqrt(np.mean(want * want))
  assert rms > 0
  assert np.max(np.abs(got - want)) <= rel * rms, (np.max(np.abs(got - want)), rms)


def test_newton_schulz_reference_is_near_orthogonal():
  # The reference itself: Muon's coefficients leave singular values in about [0.7, 1.2].
  x = np.random.default_rng(0).standard_normal((12, 20))
  s = np.linalg.svd(ref_newton_schulz(x), compute_uv=False)
  assert 0.6 < s.min() and s.max() < 1.25


@pytest.mark.parametrize('name', LEAVES)
@pytest.mark.parametrize('opts', [
    dict(momentum=True, nesterov=True, b1=0.95), dict(momentum=True, nesterov=False),
    dict(momentum=False)], ids=['nesterov', 'momentum', 'none'])
def test_orthogonal_tier_matches_reference_over_steps(name, opts):
  shape, axes = LEAVES[name]
  tier = sj.Tier(second_moment='orthogonal', clip_threshold=None, **opts)
  got, _ = _run_tier(tier, shape, axes, steps=6)
  ref = RefOrthogonalTier(shape, batch_axes=axes, **opts)
  for i, u in enumerate(got):
    _assert_close_in_rms(u, ref.update(_grads(i, shape)), 1e-4)


def test_each_batch_slice_is_orthogonalised_on_its_own():
  # Experts with gradients four decades apart: each slice has the same update RMS.
  shape = (4, 12, 20)
  g = _grads(0, shape) * (10.0 ** np.arange(4))[:, None, None]
  tx = sj.scale_by_tiered_adam(tier=sj.Tier(momentum=False, second_moment='orthogonal',
                                            clip_threshold=None), batch_axes={'w': (0,)})
  u, _ = tx.update({'w': jnp.asarray(g, jnp.float32)}, tx.init({'w': jnp.zeros(shape)}))
  rms = np.sqrt(np.mean(np.asarray(u['w'], np.float64) ** 2, axis=(1, 2)))
  np.testing.assert_allclose(rms, rms[0], rtol=0.1)
  assert 0.1 < rms[0] < 0.3  # the Adam-like RMS, 0.2 for exactly orthogonal matrices
  for i in range(4):
    want = 0.2 * np.sqrt(20) * ref_newton_schulz(g[i])
    _assert_close_in_rms(np.asarray(u['w'][i], np.float64), want, 1e-4)


def test_width_scaling_when_rms_scale_is_none():
  shape = (10, 24)
  tier = sj.Tier(momentum=False, second_moment=sj.Orthogonal(rms_scale=None),
                 clip_threshold=None)
  (u,), _ = _run_tier(tier, shape, (), steps=1)
  _assert_close_in_rms(u, np.sqrt(24 / 10) * ref_newton_schulz(_grads(0, shape)), 1e-4)


@pytest.mark.parametrize('name', ['experts', 'scanned', 'maxtext', 'tall', 'wide'])
def test_hidden_tier_matches_optax_muon(name):
  shape, axes = LEAVES[name]
  matrix = [a for a in range(len(shape)) if a not in axes]
  dims = contrib.MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]),
                                      output_axis=matrix[-1])
  params = {'w': jnp.asarray(0.1 * _grads(99, shape), jnp.float32)}
  ours = optax.chain(sj.scale_by_tiered_adam(tier=HIDDEN, batch_axes={'w': axes}),
                     optax.add_decayed_weights(0.1), optax.scale_by_learning_rate(1e-2))
  theirs = contrib.muon(1e-2, beta=0.95, nesterov=True, weight_decay=0.1,
                        consistent_rms=0.2, muon_weight_dimension_numbers={'w': dims})
  po, pt = params, params
  so, st = ours.init(po), theirs.init(pt)
  ours_update, theirs_update = jax.jit(ours.update), jax.jit(theirs.update)
  for i in range(8):
    g = {'w': jnp.asarray(_grads(i, shape), jnp.float32)}
    uo, so = ours_update(g, so, po)
    ut, st = theirs_update(g, st, pt)
    _assert_close_in_rms(np.asarray(uo['w'], np.float64), np.asarray(ut['w'], np.float64),
                         1e-5)
    po, pt = optax.apply_updates(po, uo), optax.apply_updates(pt, ut)
  # The same momentum (Muon's state is the tier's momentum).
  _assert_close_in_rms(np.asarray(so[0].mu['w'], np.float64),
                       np.asarray(st.inner_states['muon'].inner_state[0].mu['w'], np.float64),
                       1e-5)


def test_floor_and_adam_eps_modes_give_the_same_update():
  # The floor mode's sqrt(bc2) numerator factor is undone: the update does not depend on it.
  shape = (12, 20)
  a, _ = _run_tier(HIDDEN, shape, (), steps=3)
  b, _ = _run_tier(HIDDEN.replace(eps_mode='adam'), shape, (), steps=3)
  for x, y in zip(a, b):
    _assert_close_in_rms(x, y, 1e-5)


def test_state_is_the_momentum_only_and_nothing_without_momentum():
  params = {'w': jnp.zeros((4, 12, 20)), 'v': jnp.zeros((12, 20))}
  state = sj.scale_by_tiered_adam(tier=HIDDEN).init(params)
  assert state.mu['w'].shape == (4, 12, 20) and state.mu['w'].dtype == jnp.float32
  for field in (state.v_row, state.v_col, state.v):
    assert all(x is None for x in field.values())
  assert sj.state_bytes(state) == 4 * (4 * 12 * 20 + 12 * 20)
  stateless = sj.scale_by_tiered_adam(momentum=False, second_moment='orthogonal')
  assert sj.optimizer_state_bytes(stateless, params) == 0


def test_leaves_without_a_matrix_are_rejected_or_fall_back():
  tx = sj.scale_by_tiered_adam(tier=HIDDEN)
  with pytest.raises(ValueError, match=r'norm.*needs a matrix.*fallback'):
    tx.init({'norm': jnp.zeros((8,))})
  # A per-expert bias [E, F] has a vector per expert: no matrix either.
  experts = sj.scale_by_tiered_adam(momentum=False, second_moment='orthogonal',
                                    batch_axes={'b': (0,)})
  with pytest.raises(ValueError, match='needs a matrix'):
    experts.init({'b': jnp.zeros((4, 8))})
  fallback = sj.Tier(momentum=False, clip_threshold=None,
                     second_moment=sj.Orthogonal(fallback=sj.Factored()))
  tx = sj.scale_by_tiered_adam(tier=fallback, batch_axes={'b': (0,), 'w': (0,)})
  params = {'b': jnp.zeros((4, 8)), 'w': jnp.zeros((4, 8, 6))}
  state = tx.init(params)
  assert state.v['b'].shape == (4, 8) and state.v['w'] is None
  rows = sj.label_table(sj.skewadam(1.0, tiers={'backbone': fallback},
                                    batch_axes={'b': (0,), 'w': (0,)}), params)
  assert [r.second_moment for r in rows] == ['exact', 'orthogonal']
  g = {'b': jnp.ones((4, 8)), 'w': jnp.asarray(_grads(0, (4, 8, 6)), jnp.float32)}
  u, _ = tx.update(g, state)
  ref = RefTier((4, 8), momentum=False, second_moment='exact', clip=None)
  np.testing.assert_allclose(u['b'], ref.update(np.ones((4, 8))), rtol=1e-5)


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(rms_scale=0.0), ValueError, 'rms_scale'),
    (dict(rms_scale='x'), ValueError, 'rms_scale'),
    (dict(ns_steps=0), ValueError, 'ns_steps'),
    (dict(ns_coeffs=(1.0, 2.0)), TypeError, 'ns_coeffs'),
    (dict(fallback='factored'), TypeError, 'fallback'),
    (dict(ns_dtype='float16'), ValueError, "`ns_dtype` must be one of .*'auto'.*'float32'"),
    (dict(ns_dtype=jnp.bfloat16), ValueError, 'ns_dtype'),
])
def test_bad_options_are_rejected(kwargs, error, match):
  with pytest.raises(error, match=match):
    sj.Orthogonal(**kwargs)


def test_tier_rejects_nesterov_without_momentum_and_a_bad_b1():
  with pytest.raises(ValueError, match='nesterov'):
    sj.Tier(momentum=False, nesterov=True)
  with pytest.raises(ValueError, match='b1'):
    sj.Tier(b1=1.5)
  with pytest.raises(TypeError, match='nesterov'):
    sj.Tier(nesterov=1)


def test_nesterov_with_adam_statistics_matches_optax_nadam():
  # The Nesterov numerator is optax's: an exact tier with Adam's eps is optax.nadam.
  tier = sj.Tier(momentum=True, nesterov=True, second_moment='exact', eps_mode='adam',
                 clip_threshold=None)
  shape = (6, 5)
  ours = sj.scale_by_tiered_adam(tier=tier)
  theirs = optax.scale_by_adam(nesterov=True)
  so, st = ours.init({'w': jnp.zeros(shape)}), theirs.init({'w': jnp.zeros(shape)})
  ours_update, theirs_update = jax.jit(ours.update), jax.jit(theirs.update)
  for i in range(5):
    g = {'w': jnp.asarray(_grads(i, shape), jnp.float32)}
    uo, so = ours_update(g, so)
    ut, st = theirs_update(g, st)
    np.testing.assert_allclose(uo['w'], ut['w'], rtol=2e-5, atol=1e-7)


# ----------------------------------------------------------------------------- labels


def test_hidden_labels_split_the_backbone_by_shape_and_name():
  params = {
      'tok': {'embedding': jnp.zeros((256, 16))},  # named: an embedding
      'pos_embed': jnp.zeros((32, 16)),  # named: its shape is a hidden one's
      'blocks': {'attn': {'q': jnp.zeros((16, 16)), 'o': jnp.zeros((4, 4, 16))},
                 'mlp': {'w1': jnp.zeros((16, 64)), 'w2': jnp.zeros((64, 16))},
                 'norm': {'scale': jnp.zeros((16,))}},
      'readout': {'kernel': jnp.zeros((16, 256))},  # untied head: the vocab axis
      'moe': {'router': {'kernel': jnp.zeros((16, 4))},
              'experts': {'w1': jnp.zeros((4, 16, 32))}},
  }
  labels = sj.hidden_param_labels(params)
  assert labels['tok']['embedding'] == 'backbone'
  assert labels['pos_embed'] == 'backbone'
  assert labels['readout']['kernel'] == 'backbone'
  assert labels['blocks']['norm']['scale'] == 'backbone'
  assert labels['blocks']['attn'] == {'q': 'hidden', 'o': 'hidden'}
  assert labels['blocks']['mlp'] == {'w1': 'hidden', 'w2': 'hidden'}
  assert labels['moe'] == {'router': {'kernel': 'router'}, 'experts': {'w1': 'experts'}}


def test_hidden_labels_of_scanned_layers_use_the_batch_axes():
  params = {'layers': {'mlp': {'w1': jnp.zeros((3, 20, 64))}, 'norm': jnp.zeros((3, 16))},
            'embed': jnp.zeros((100, 16))}
  labels = sj.hidden_param_labels(params)
  assert labels == {'layers': {'mlp': {'w1': 'hidden'}, 'norm': 'backbone'},
                    'embed': 'backbone'}


def test_label_table_and_skewadam_use_hidden_labels_for_muon_tiers():
  params = {'embed': jnp.zeros((64, 16)), 'mlp': jnp.zeros((16, 32)),
            'norm': jnp.zeros((16,)),
            'moe': {'router': jnp.zeros((16, 4)), 'experts': {'w1': jnp.zeros((4, 16, 32))}}}
  tx = sj.skewadam(1e-3, tiers=sj.MUON_TIERS)
  rows = {r.path: r for r in sj.label_table(tx, params)}
  assert (rows['mlp'].tier, rows['mlp'].second_moment) == ('hidden', 'orthogonal')
  assert rows['mlp'].state_bytes == 16 * 32 * 4  # its momentum, no statistics
  assert (rows['embed'].tier, rows['embed'].second_moment) == ('backbone', 'factored')
  assert (rows['moe/experts/w1'].tier, rows['moe/experts/w1'].batch_axes) == ('experts', (0,))
  assert rows['moe/router'].tier == 'router'
  assert sj.optimizer_state_bytes(tx, params) == sum(r.state_bytes for r in rows.values())
  report = sj.memory_report(tx, params, param_labels=sj.hidden_param_labels)
  assert {t.tier: t.state_bytes for t in report.tiers}['hidden'] == 16 * 32 * 4


def test_state_shardings_of_the_hidden_tier_follow_the_params():
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                        {'embed': (100, 32), 'mlp': (32, 64), 'norm': (32,),
                         'moe': {'router': (32, 4), 'experts': {'w1': (4, 32, 64)}}},
                        is_leaf=lambda x: isinstance(x, tuple))
  specs = {'embed': P(None, 'data'), 'mlp': P('data', None), 'norm': P(),
           'moe': {'router': P(), 'experts': {'w1': P('expert', None, 'data')}}}
  variant = dict(sj.MUON_TIERS, experts=sj.Tier(momentum=False, second_moment='orthogonal',
                                                  clip_threshold=None))
  shardings = sj.state_shardings(sj.skewadam(1e-3, tiers=variant), params, specs)
  state = shardings[0]
  assert state.mu['mlp'] == P('data', None)  # the hidden tier: momentum only
  assert state.v_row['mlp'] is None
  # The stateless orthogonal experts keep nothing: no slot in any field.
  assert all(field['moe']['experts']['w1'] is None
             for field in (state.mu, state.v_row, state.v_col, state.v))
  assert state.v_col['embed'] == P('data')


# ----------------------------------------------------------------------------- the policy


def _muon_ref(name: str, shape) -> object:
  if 'experts' in name and len(shape) >= 3:  # each expert's gradient, orthogonalised
    return RefOrthogonalTier(shape, momentum=False)
  if 'experts' in name:  # a per-expert vector: the fallback, factored (here exact)
    return RefTier(shape, momentum=False, second_moment='factored')
  if 'router' in name:
    return RefTier(shape, momentum=True, second_moment='exact', eps_mode='adam')
  if len(shape) == 2 and 'embed' not in name:
    return RefOrthogonalTier(shape, momentum=True, nesterov=True, b1=0.95)
  return RefTier(shape, momentum=True, second_moment='factored')


@pytest.mark.slow
def test_muon_tiers_match_reference_over_30_steps():
  lr, wd, steps = 1e-2, 0.1, 30
  params = init_params()
  grads_fn = make_grads_fn()
  rules = {k: _muon_ref(k, v.shape) for k, v in params.items()}
  hidden = [k for k, r in rules.items() if isinstance(r, RefOrthogonalTier) and r.momentum]
  assert len(hidden) == 2  # q and k
  assert any(isinstance(r, RefOrthogonalTier) and not r.momentum for r in rules.values())
  p = {k: v.copy() for k, v in params.items()}
  for i in range(steps):
    g = grads_fn(i, p)
    for k in p:
      w = 0.0 if 'router' in k else wd
      p[k] = p[k] - lr * (rules[k].update(g[k]) + w * p[k])
  got, _ = run_optax(sj.skewadam(lr, weight_decay=wd, tiers=sj.MUON_TIERS), params,
                     grads_fn, steps)
  for k in p:
    moved = np.max(np.abs(p[k] - params[k]))
    assert np.max(np.abs(got[k] - p[k])) <= 1e-5 + 1e-4 * moved, k
  assert min(np.max(np.abs(got[k] - params[k])) for k in params) > 1e-4
  assert set(MOE_LEAVES) == set(got)


@pytest.mark.slow
def test_jit_and_inject_hyperparams_with_muon_tiers():
  kw = dict(learning_rate=1e-2, weight_decay=0.1, tiers=sj.MUON_TIERS)
  eager, _ = run_optax(sj.skewadam(**kw), init_params(), make_grads_fn(), 2, jit=False)
  jitted, _ = run_optax(sj.skewadam(**kw), init_params(), make_grads_fn(), 2, jit=True)
  injected_tx = optax.inject_hyperparams(sj.skewadam)(**kw)
  injected, state = run_optax(injected_tx, init_params(), make_grads_fn(), 2)
  for k in eager:
    moved = np.max(np.abs(eager[k] - init_params()[k]))
    assert np.max(np.abs(jitted[k] - eager[k])) <= 1e-7 + 1e-5 * moved, k
    assert np.max(np.abs(injected[k] - eager[k])) <= 1e-7 + 1e-5 * moved, k
  assert float(state.hyperparams['learning_rate']) == pytest.approx(1e-2)


@pytest.mark.parametrize('name', ['skewadam-muon', 'skewadam-muon-orthogonal-experts'])
def test_example_optimizers_of_the_muon_tiers(name):
  from flax import nnx

  from examples.moe_lm import model as model_lib
  from examples.moe_lm import optimizers as opt_lib

  # nnx.to_pure_dict: State.to_pure_dict() is deprecated.
  params = nnx.to_pure_dict(model_lib.abstract_params(model_lib.get_config('tiny')))
  tx, info = opt_lib.make_optimizer(name, 1e-3, total_steps=10, warmup_steps=1)
  rows = sj.label_table(tx, params)
  assert sj.optimizer_state_bytes(tx, params) == sum(r.state_bytes for r in rows)
  hidden = [r for r in rows if r.tier == 'hidden']
  assert hidden and all(r.second_moment == 'orthogonal' for r in hidden)
  assert not any('embed' in r.path for r in hidden)
  experts = [r for r in rows if r.tier == 'experts']
  stateless = name.endswith('orthogonal-experts')
  assert experts and all((r.state_bytes == 0) == stateless for r in experts)
  assert info['lr'] == 1e-3


def test_leaves_of_one_matrix_shape_share_one_newton_schulz_iteration():
  # `scale_by_tiers` orthogonalises every leaf of one wide [R, C] (after the batch axes;
  # a tall [C, R] is run transposed, as `newton_schulz` runs it) in one batched
  # iteration: a bank [E, 12, 20], two [12, 20] matrices, the same shape reached through
  # a transposed layout, and a [6, 10] matrix that few enough to be zero-padded into it
  # (`MAX_PADDED_SHARE`). Per matrix the operations are those of a separate call, so the
  # updates match leaf-by-leaf transforms within 8 ulp (the padded one within 1e-5 of
  # its RMS: its sums run over zeros in another order), and the traced update holds 3
  # dots per iteration per call (here two: [10, 24] fits in no larger shape), not per leaf.
  from ulp import assert_within_ulp
  shapes = {'bank': (8, 12, 20), 'a': (12, 20), 'b': (12, 20), 'tall': (20, 12),
            'c': (10, 24), 'small': (6, 10)}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  axes = {'bank': (0,), 'a': (), 'b': (), 'tall': (), 'c': (), 'small': ()}
  tx = sj.scale_by_tiered_adam(tier=HIDDEN, batch_axes=axes)
  state = tx.init(params)
  singles = {k: sj.scale_by_tiered_adam(tier=HIDDEN, batch_axes={k: axes[k]}) for k in shapes}
  single_states = {k: t.init({k: params[k]}) for k, t in singles.items()}
  for step in range(3):
    grads = {k: jnp.asarray(_grads(step, s) + i, jnp.float32)
             for i, (k, s) in enumerate(shapes.items())}
    u, state = tx.update(grads, state)
    for k in shapes:
      want, single_states[k] = singles[k].update({k: grads[k]}, single_states[k])
      if k == 'small':  # its products sum over padded zeros: another rounding order
        _assert_close_in_rms(np.asarray(u[k], np.float64), np.asarray(want[k], np.float64),
                             1e-5)
      else:
        assert_within_ulp(np.asarray(u[k]), np.asarray(want[k]), np.float32,
                          err_msg=f'{k} at step {step}')
  jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s))(grads, state)
  dots = sum(e.primitive.name == 'dot_general' for e in jaxpr.eqns)
  assert dots == 2 * sj.Orthogonal().ns_steps * 3, dots


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(['a', 'b', 'c', 'd']), st.integers(1, 9)),
                min_size=1, max_size=8))
def test_shared_calls_pad_few_small_matrices_into_a_larger_shape(leaves):
  # Shapes: a [4, 8] holds b [2, 8] and d [3, 5]; c [5, 5] holds d; nothing holds a or c
  # but themselves. A leaf joins a larger call only if its shape's matrices are at most
  # 1/8 of that call's own; every leaf is in exactly one call, of one iteration.
  from skewadam_jax.estimators.newton_schulz import NewtonSchulzGroup
  from skewadam_jax.transforms import tier_leaf
  wide = {'a': (4, 8), 'b': (2, 8), 'c': (5, 5), 'd': (3, 5)}
  keys = [NewtonSchulzGroup(wide[s], ('it',)) for s, _ in leaves]
  counts = [n for _, n in leaves]
  calls = tier_leaf.shared_calls(keys, counts)
  assert sorted(i for c in calls for i in c) == list(range(len(leaves)))
  for call in calls:
    shapes = {keys[i].wide for i in call}
    host = max(shapes, key=lambda s: s[0] * s[1])
    own = sum(counts[i] for i in call if keys[i].wide == host)
    for s in shapes - {host}:
      assert s[0] <= host[0] and s[1] <= host[1]
      assert sum(counts[i] for i in call if keys[i].wide == s) <= own / 8
  # Leaves of one shape are never split over calls.
  for s in wide.values():
    assert sum(any(keys[i].wide == s for i in call) for call in calls) <= 1
  # Another iteration never shares.
  assert len(tier_leaf.shared_calls([NewtonSchulzGroup((4, 8), 1), NewtonSchulzGroup((2, 8), 2)],
                                    [80, 1])) == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(['a', 'b', 'c', 'd']), st.integers(1, 9)),
                min_size=1, max_size=8),
       st.integers(8, 200))
def test_shared_calls_bound_the_elements_of_a_call(leaves, budget):
  # A call takes its group's leaves up to `MAX_SHARED_CALL_ELEMENTS` (items x item
  # size), so a leaf above it is alone; a smaller group joins a call only if the call
  # stays within it. Every leaf is in exactly one call.
  from skewadam_jax.estimators.newton_schulz import NewtonSchulzGroup
  from skewadam_jax.transforms import tier_leaf
  wide = {'a': (4, 8), 'b': (2, 8), 'c': (5, 5), 'd': (3, 5)}
  keys = [NewtonSchulzGroup(wide[s], ('it',)) for s, _ in leaves]
  counts = [n for _, n in leaves]
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(tier_leaf, 'MAX_SHARED_CALL_ELEMENTS', budget)
    calls = tier_leaf.shared_calls(keys, counts)
  assert sorted(i for c in calls for i in c) == list(range(len(leaves)))
  for call in calls:
    host = max((keys[i] for i in call), key=lambda k: k.item_size)
    elements = host.item_size * sum(counts[i] for i in call)
    assert len(call) == 1 or elements <= budget, (call, elements)
    for i in call:
      assert host.hosts(keys[i])
  big = [i for i, k in enumerate(keys) if counts[i] * k.item_size > budget]
  assert all([i] in calls for i in big)


def test_large_leaf_iterates_alone_in_place_in_bounded_chunks():
  # A leaf above `MAX_SHARED_CALL_ELEMENTS` is a call of its own, iterated in chunks of
  # at most `MAX_CHUNK_ELEMENTS` written back over the leaf's own matrices (a loop whose
  # only carries are the trip count and the [n, R, C] leaf: no zero-padded copy, no
  # stacked output); its gradient and step scalars pass an optimization barrier of
  # their own, so XLA does not fuse its elementwise work with another leaf's. The
  # updates match leaf-by-leaf transforms within 1e-5 of the RMS (the chunks' body is
  # compiled, as above). Under the default bounds these small leaves share one call.
  from skewadam_jax.estimators import newton_schulz as ns
  from skewadam_jax.transforms import tier_leaf
  shapes = {'bank': (6, 12, 20), 'tall': (4, 20, 12), 'a': (12, 20), 'b': (12, 20)}
  axes = {'bank': (0,), 'tall': (0,), 'a': (), 'b': ()}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  grads = {k: jnp.asarray(_grads(i, s), jnp.float32) for i, (k, s) in enumerate(shapes.items())}
  tx = sj.scale_by_tiered_adam(tier=HIDDEN, batch_axes=axes)
  state = tx.init(params)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(tier_leaf, 'MAX_SHARED_CALL_ELEMENTS', 3 * 240)
    mp.setattr(ns, 'MAX_CHUNK_ELEMENTS', 2 * 240)
    mp.setattr(ns, 'MIN_SHARED_ELEMENTS', 2 * 240)
    u, _ = tx.update(grads, state)
    # A fresh function each time: jax caches traces by function, not by these bounds.
    jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s))(grads, state)
  for k in shapes:
    single = sj.scale_by_tiered_adam(tier=HIDDEN, batch_axes={k: axes[k]})
    want, _ = single.update({k: grads[k]}, single.init({k: params[k]}))
    _assert_close_in_rms(np.asarray(u[k], np.float64), np.asarray(want[k], np.float64), 1e-5)
  # bank (6 matrices) and tall (4) alone, in 3 and 2 chunks of 2; a and b in one call.
  scans = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
  assert sorted(e.params['length'] for e in scans) == [2, 3]
  for e in scans:
    assert e.params['num_carry'] == 2 and len(e.outvars) == 2
    assert e.outvars[1].aval.shape in {(6, 12, 20), (4, 12, 20)}
  assert sum(e.primitive.name == 'dot_general' for e in jaxpr.eqns) == 3 * HIDDEN_NS_STEPS
  assert sum(e.primitive.name == 'optimization_barrier' for e in jaxpr.eqns) == 2
  default = jax.make_jaxpr(lambda g, s: tx.update(g, s))(grads, state)
  assert not any(e.primitive.name in ('scan', 'optimization_barrier') for e in default.eqns)


@pytest.mark.parametrize('tiers', ['MUON_CODED_TIERS', 'MUON_TIERS'])
def test_large_leaf_updates_in_place_slices_of_its_batch_axis(tiers):
  # A leaf too large to share a call, whose update maps slices of its first batch axis
  # to slices of its update and state (the expert tiers: `MUON_CODED_TIERS`' 6-bit
  # momentum codes per row block and Nesterov, `MUON_TIERS`' none; each matrix
  # orthogonalised on its own), runs that update slice by slice in one loop, writing
  # the update over the gradient and the state over the old (`LEAF_SLICE_ELEMENTS`):
  # XLA holds one slice's temporaries, not the leaf's. The same operations per slice,
  # so the updates and the state match the whole-leaf step over two steps within 8 ulp
  # (bitwise on the CPU where this was written: it bounds the other CPUs' fusions); under
  # the default bounds these small leaves are not sliced.
  from ulp import assert_within_ulp
  from skewadam_jax.transforms import tier_leaf, tier_slices
  shapes = {'bank': (8, 16, 256), 'w': (16, 256)}
  axes = {'bank': (0,), 'w': ()}
  tx = sj.scale_by_tiered_adam(tier=getattr(sj, tiers)['experts'], batch_axes=axes)
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  grads = [{k: jnp.asarray(_grads(i, s), jnp.float32) for k, s in shapes.items()}
           for i in range(2)]

  def run():
    # A fresh function, traced anew: jax caches traces by function, not by the bounds.
    step = jax.jit(lambda g_, s_: tx.update(g_, s_))
    state, out = tx.init(params), []
    for g in grads:
      u, state = step(g, state)
      out.append((u, state))
    return out, step.trace(grads[0], tx.init(params)).jaxpr

  whole, whole_jaxpr = run()
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(tier_leaf, 'MAX_SHARED_CALL_ELEMENTS', 3 * 16 * 256)
    mp.setattr(tier_slices, 'LEAF_SLICE_ELEMENTS', 2 * 16 * 256)
    sliced, sliced_jaxpr = run()
    # An estimator that shares no work (the published factored experts) streams its
    # leaf in one fused pass: no slices, no barrier, whatever its size.
    plain = sj.scale_by_tiered_adam(tier=sj.PUBLISHED_TIERS['experts'], batch_axes=axes)
    plain_jaxpr = jax.make_jaxpr(lambda g_, s_: plain.update(g_, s_))(
        grads[0], plain.init(params))
    # Codes rounded at random draw per leaf position: not sliced (its Newton-Schulz
    # call runs alone, unchunked at these sizes).
    drawn = sj.scale_by_tiered_adam(tier=sj.MUON_CODED_TIERS['experts'].replace(
        mu_codec=sj.Blockwise(6, 256, rounding='stochastic')), batch_axes=axes)
    drawn_jaxpr = jax.make_jaxpr(lambda g_, s_: drawn.update(g_, s_))(
        grads[0], drawn.init(params))
  assert not any(e.primitive.name in ('scan', 'optimization_barrier')
                 for e in plain_jaxpr.eqns)
  assert not any(e.primitive.name == 'scan' for e in drawn_jaxpr.eqns)
  loops = [e for e in sliced_jaxpr.eqns if e.primitive.name == 'scan']
  assert [e.params['length'] for e in loops] == [4]  # bank: 4 slices of 2 matrices
  assert not any(e.primitive.name == 'scan' for e in whole_jaxpr.eqns)
  for step, ((u_w, s_w), (u_s, s_s)) in enumerate(zip(whole, sliced)):
    for k in shapes:
      assert_within_ulp(np.asarray(u_s[k]), np.asarray(u_w[k]), np.float32,
                        err_msg=f'{k} at step {step}')
    for a, b in zip(jax.tree.leaves(s_s), jax.tree.leaves(s_w)):
      if jnp.issubdtype(a.dtype, jnp.floating):
        assert_within_ulp(np.asarray(a), np.asarray(b), np.float32)
      else:  # codes: a code flips only where its value lies on a rounding boundary
        assert np.mean(np.asarray(a) != np.asarray(b)) <= 1e-3


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5),
       max_batch=st.one_of(st.none(), st.integers(1, 7)), keyed=st.booleans())
def test_shared_iteration_in_equal_chunks_is_the_separate_calls(sizes, max_batch, keyed):
  # Leaves of n_i matrices written into chunks of one size (zero matrices fill the
  # last), each chunk iterated by one compiled body, each leaf read back at its offset
  # (runtime offsets when keyed): per matrix the operations of a separate call. The
  # chunks' body is compiled (`lax.map`) where the reference runs op by op, so the two
  # round differently (fused multiply-adds) and five iterations grow that: within 1e-5
  # of the update's RMS, as against optax's float32 Muon.
  from skewadam_jax.estimators import newton_schulz as ns
  rng = np.random.default_rng(sum(sizes))
  # Mixed shapes, tall ones among them: zero-padded into one [R, C] buffer, wide.
  shapes = [(6, 9), (9, 6), (4, 9), (6, 7), (3, 3)]
  mats = [jnp.asarray(rng.standard_normal((n,) + shapes[i % len(shapes)]), jnp.float32)
          for i, n in enumerate(sizes)]
  key = jnp.float32(3.0) if keyed else None
  got = ns.newton_schulz_shared(mats, max_batch=max_batch, key=key)
  for m, g in zip(mats, got):
    assert g.shape == m.shape
    _assert_close_in_rms(np.asarray(g, np.float64),
                         np.asarray(ns.newton_schulz(m), np.float64), 1e-5)


def test_bfloat16_iteration_keeps_zero_padding_zero():
  # The bfloat16 step (a I + A (b I + c A)) X puts `a` on the padded diagonal of its
  # left factor, but the padded rows and columns of X are zero, so they stay zero, and
  # each matrix of a shared call is iterated on its own: within the distance two
  # bfloat16 runs summed in other orders keep (mesh_cases.ORTHOGONAL_BF16_REL_FROBENIUS).
  from skewadam_jax.estimators import newton_schulz as ns
  rng = np.random.default_rng(0)
  m = rng.standard_normal((3, 5, 9)).astype(np.float32)
  padded = np.zeros((3, 8, 12), np.float32)
  padded[:, :5, :9] = m
  out = np.asarray(ns.newton_schulz(jnp.asarray(padded), ns_dtype='bfloat16').astype(jnp.float32))
  assert not out[:, 5:, :].any() and not out[:, :, 9:].any()
  mats = [jnp.asarray(rng.standard_normal(s), jnp.float32)
          for s in ((3, 6, 9), (2, 4, 9), (1, 9, 6))]
  got = ns.newton_schulz_shared(mats, ns_dtype='bfloat16')
  for x, g in zip(mats, got):
    want = np.asarray(ns.newton_schulz(x, ns_dtype='bfloat16').astype(jnp.float32), np.float64)
    g = np.asarray(g.astype(jnp.float32), np.float64)
    assert g.shape == x.shape
    assert np.linalg.norm(g - want) <= 0.05 * np.linalg.norm(want)


def test_chunked_shared_iteration_holds_one_iteration_and_bounded_chunks(monkeypatch):
  # More matrices of one shape than a chunk holds: equal chunks under `lax.map`, so the
  # jaxpr holds the iteration once (3 dots x ns_steps) and the updates still match
  # leaf-by-leaf transforms (within 1e-5 of the RMS: the chunks' body is compiled).
  from skewadam_jax.estimators import newton_schulz as ns
  monkeypatch.setattr(ns, 'MIN_SHARED_ELEMENTS', 1)
  shapes = {'bank': (3, 12, 20), 'a': (12, 20), 'b': (12, 20), 'c': (2, 12, 20)}
  axes = {'bank': (0,), 'a': (), 'b': (), 'c': (0,)}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  tx = sj.scale_by_tiered_adam(tier=HIDDEN, batch_axes=axes)
  state = tx.init(params)
  grads = {k: jnp.asarray(_grads(i, s), jnp.float32) for i, (k, s) in enumerate(shapes.items())}
  u, _ = tx.update(grads, state)
  for k in shapes:
    single = sj.scale_by_tiered_adam(tier=HIDDEN, batch_axes={k: axes[k]})
    want, _ = single.update({k: grads[k]}, single.init({k: params[k]}))
    _assert_close_in_rms(np.asarray(u[k], np.float64), np.asarray(want[k], np.float64), 1e-5)
  jaxpr = jax.make_jaxpr(tx.update)(grads, state)
  # 7 matrices, chunks of at most 3 (the largest leaf): 3 chunks of 3, one `lax.map`.
  scans = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
  assert len(scans) == 1 and scans[0].params['length'] == 3
  inner = scans[0].params['jaxpr'].jaxpr
  assert sum(e.primitive.name == 'dot_general' for e in inner.eqns) == 3 * HIDDEN_NS_STEPS
  assert not any(e.primitive.name == 'dot_general' for e in jaxpr.eqns)


# ----------------------------------------------------------------- bfloat16 Newton-Schulz

# The bfloat16 iteration (`ns_dtype='bfloat16'`) against the float32 one, per matrix:
# relative Frobenius distance of the factors, and the largest distance between their
# sorted singular values. Each of the 5 steps rounds its product operands (X, A = X X^T,
# b I + c A and a I + A (b I + c A)) to bfloat16, a relative error of at most u = 2^-8
# each, and sums each product in float32. A later step can grow an earlier error by the
# quintic's slope (|p'| <= 3.9 on the band [0.68, 1.2] where the singular values
# oscillate), so the worst case of first-order analysis, ~u * sum_k 3.9^k ~ 300 u ~ 1.2,
# says nothing; the roundings are independent and mostly cancel: over 360 random banks
# (1,050 matrices of 2 to 129 rows and columns, the spectra below;
# benchmarks/ns_bfloat16.py) the largest relative Frobenius distance measured was 0.059
# (15 u; median 0.018, 4.5 u) and the largest singular-value distance 0.086 (median
# 0.015). The bounds leave room for the draws hypothesis finds: 0.1 (26 u) and 0.15, both
# far inside what the float32 iteration itself leaves of the true polar factor (its
# singular values spread over [0.68, 1.13] around 1). Muon's reference code (every
# product and sum in bfloat16) measured a median distance 2.9x ours, and a largest one
# of 0.15, past the bound.
NS_BF16_REL_FROBENIUS = 0.1
NS_BF16_SINGULAR_VALUES = 0.15


@jax.jit
def _ns_float32_and_bfloat16(x):
  """Both iterations of `x`, compiled once per shape (op by op would compile every
  primitive for every shape)."""
  from skewadam_jax.estimators import newton_schulz as ns
  return (ns.newton_schulz(x, ns_dtype='float32'),
          ns.newton_schulz(x, ns_dtype='bfloat16'))


def _ns_bf16_distances(x):
  """(relative Frobenius distance, largest singular-value distance) per matrix of `x`."""
  want, got = _ns_float32_and_bfloat16(x)
  want = np.asarray(want, np.float64)
  assert got.dtype == jnp.bfloat16 and got.shape == x.shape
  got = np.asarray(got.astype(jnp.float32), np.float64)
  rel = np.linalg.norm(got - want, axis=(-2, -1)) / np.linalg.norm(want, axis=(-2, -1))
  sv = np.abs(np.linalg.svd(got, compute_uv=False) - np.linalg.svd(want, compute_uv=False))
  return rel, sv.max(axis=-1)


# Wide, tall, square, thin (3 columns: one singular value has none to average with),
# an expert bank [E, R, C] and a bank of scanned layers [L, E, R, C]. A few
# shapes, so that the draws (the spectra, the values) share their compiles.
NS_BF16_SHAPES = ((20, 48), (48, 20), (32, 32), (28, 3), (4, 12, 40), (2, 3, 7, 9))


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from(NS_BF16_SHAPES),
       spectrum=st.sampled_from(['gaussian', 'decaying rows', 'decaying columns', 'scaled']),
       seed=st.integers(0, 2**16))
def test_bfloat16_newton_schulz_is_within_its_bound_of_float32(shape, spectrum, seed):
  # A Gaussian spectrum, one decaying over three decades along the rows or the columns
  # (the small singular values, which the iteration grows most), or a scale from 1e-6
  # to 1e6.
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape)
  if spectrum == 'decaying rows':
    x = x * np.geomspace(1, 1e-3, shape[-2])[:, None]
  elif spectrum == 'decaying columns':
    x = x * np.geomspace(1, 1e-3, shape[-1])
  elif spectrum == 'scaled':
    x = x * 10.0 ** rng.uniform(-6, 6)
  rel, sv = _ns_bf16_distances(jnp.asarray(x, jnp.float32))
  assert np.all(rel <= NS_BF16_REL_FROBENIUS), rel
  assert np.all(sv <= NS_BF16_SINGULAR_VALUES), sv


def test_bfloat16_iteration_multiplies_bfloat16_and_accumulates_in_float32():
  from skewadam_jax.estimators import newton_schulz as ns
  x = jnp.ones((3, 6, 10), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda x: ns.newton_schulz(x, ns_dtype='bfloat16'))(x)
  dots = [e for e in jaxpr.eqns if e.primitive.name == 'dot_general']
  assert len(dots) == 3 * 5
  for e in dots:  # each product takes and writes bfloat16 ...
    assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars)
    assert e.params['preferred_element_type'] == jnp.bfloat16
  # ... and sums in float32, rounding once: the result is the exact product rounded to
  # bfloat16 (but where float32's own rounding, ~2^-16 of a bfloat16 step here, tips a
  # near-tie), where a bfloat16 sum (running or pairwise) of 4096 terms would be
  # several bfloat16 steps off.
  rng = np.random.default_rng(0)
  p, q = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((32, 4096), (4096, 32)))
  exact = np.asarray(p, np.float64) @ np.asarray(q, np.float64)
  got = np.asarray(ns._dot16(p, q).astype(jnp.float32), np.float64)
  rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
  assert np.mean(got == rounded) >= 0.99
  assert np.all(np.abs(got - exact) <= 2.0 ** -8 * np.abs(exact))
  # The float32 iteration holds no bfloat16 at all.
  jaxpr = jax.make_jaxpr(lambda x: ns.newton_schulz(x, ns_dtype='float32'))(x)
  assert all(v.aval.dtype == jnp.float32 for e in jaxpr.eqns for v in e.outvars)


def test_auto_ns_dtype_is_float32_on_cpu_and_bfloat16_on_gpu_and_tpu(monkeypatch):
  # Decided when the update is traced: from a concrete array's devices, else (under
  # `jit`) from the default backend.
  from skewadam_jax.estimators import newton_schulz as ns
  x = jnp.ones((4, 6))
  assert ns.iteration_dtype('auto', x) == jnp.float32
  assert ns.iteration_dtype('bfloat16', x) == jnp.bfloat16
  for backend, want in (('gpu', jnp.bfloat16), ('tpu', jnp.bfloat16), ('cpu', jnp.float32)):
    monkeypatch.setattr(jax, 'default_backend', lambda b=backend: b)
    traced = jax.jit(lambda y: ns.newton_schulz(y, ns_dtype='auto'))
    assert traced.eval_shape(x).dtype == want, backend
    assert ns.iteration_dtype('auto') == want
    # A concrete array's devices win over the default backend: this one is on the CPU.
    assert ns.iteration_dtype('auto', x) == jnp.float32


def test_auto_ns_dtype_gives_the_float32_update_bitwise_on_cpu():
  shapes = {'bank': (4, 12, 20), 'w': (20, 12)}
  axes = {'bank': (0,), 'w': ()}

  def run(ns_dtype):
    tier = HIDDEN.replace(second_moment=sj.Orthogonal(ns_dtype=ns_dtype))
    tx = sj.scale_by_tiered_adam(tier=tier, batch_axes=axes)
    state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})
    grads = {k: jnp.asarray(_grads(i, s), jnp.float32) for i, (k, s) in enumerate(shapes.items())}
    return jax.jit(tx.update)(grads, state)[0]

  auto, f32, bf16 = run('auto'), run('float32'), run('bfloat16')
  for k in shapes:
    np.testing.assert_array_equal(np.asarray(auto[k]), np.asarray(f32[k]))
    # Through the tier (a shared call, then the RMS scale): the update in bfloat16 is
    # within the iteration's bound of float32's, and float32 itself.
    assert bf16[k].dtype == jnp.float32
    got, want = np.asarray(bf16[k], np.float64), np.asarray(f32[k], np.float64)
    assert np.linalg.norm(got - want) <= NS_BF16_REL_FROBENIUS * np.linalg.norm(want)
    assert not np.array_equal(got, want)


def test_leaves_of_another_ns_dtype_never_share_an_iteration():
  # The same matrix shape in a float32 and a bfloat16 tier: two shared calls (3 dots per
  # iteration each), not one.
  tiers = {'a': HIDDEN.replace(second_moment=sj.Orthogonal(ns_dtype='float32')),
           'b': HIDDEN.replace(second_moment=sj.Orthogonal(ns_dtype='bfloat16'))}
  params = {'a': jnp.zeros((12, 20)), 'b': jnp.zeros((12, 20))}
  tx = sj.scale_by_tiers(tiers, lambda p: {'a': 'a', 'b': 'b'})
  grads = {k: jnp.asarray(_grads(0, (12, 20)), jnp.float32) for k in params}
  jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params))
  dots = [e for e in jaxpr.eqns if e.primitive.name == 'dot_general']
  assert len(dots) == 2 * 3 * HIDDEN_NS_STEPS
  assert sum(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots) == 3 * HIDDEN_NS_STEPS
