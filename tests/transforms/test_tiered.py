"""SkewAdam's tier rule against the NumPy reference and exact identities."""

import dataclasses
import pickle

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj
from reference import RefTier
from skewadam_jax.transforms import alias as _alias
from trees import MOE_LEAVES, init_params, make_grads_fn, nest, run_optax
from ulp import assert_within_ulp

STEPS = 30
LR = 1e-2


def _tier_of(name: str) -> str:
  if 'experts' in name:
    return 'experts'
  if 'router' in name:
    return 'router'
  return 'backbone'


def _ref_run(tier_kwargs_of, steps=STEPS, lr=LR, wd=0.0, leaves=MOE_LEAVES, decay=None):
  params = init_params(leaves=leaves)
  grads_fn = make_grads_fn(leaves=leaves)
  rules = {k: RefTier(v.shape, **tier_kwargs_of(k)) for k, v in params.items()}
  p = {k: v.copy() for k, v in params.items()}
  for i in range(steps):
    g = grads_fn(i, p)
    for k in p:
      w = wd if (decay is None or decay(k)) else 0.0
      p[k] = p[k] - lr * (rules[k].update(g[k]) + w * p[k])
  return p, rules


PUBLISHED_REF = {
    'backbone': dict(momentum=True, second_moment='factored'),
    'experts': dict(momentum=False, second_moment='factored'),
    'router': dict(momentum=False, second_moment='exact'),
}


ADAM_EPS_REF = {'backbone': dict(momentum=True, second_moment='factored', eps_mode='adam'),
                'experts': dict(momentum=False, second_moment='factored', eps_mode='adam'),
                'router': dict(momentum=True, second_moment='exact', eps_mode='adam')}
ADAM_ROUTER_REF = dict(PUBLISHED_REF, router=ADAM_EPS_REF['router'])


@pytest.mark.parametrize('tiers, ref', [
    (None, PUBLISHED_REF), (sj.ADAM_EPS_TIERS, ADAM_EPS_REF),
    (sj.ADAM_ROUTER_TIERS, ADAM_ROUTER_REF)], ids=['published', 'adam_eps', 'adam_router'])
def test_tier_policy_matches_reference_over_30_steps(tiers, ref):
  wd = 0.1
  expected, rules = _ref_run(lambda k: ref[_tier_of(k)], wd=wd,
                             decay=lambda k: _tier_of(k) != 'router')
  got, _ = run_optax(sj.skewadam(LR, weight_decay=wd, tiers=tiers), init_params(),
                     make_grads_fn(), STEPS)
  worst = max(np.max(np.abs(got[k] - expected[k])) for k in expected)
  assert worst <= 1e-5, worst
  # The trajectory exercises the RMS clip, and the eps floor wherever a tier keeps it.
  assert sum(r.clipped for r in rules.values()) > 0
  floor = [k for k in rules if ref[_tier_of(k)].get('eps_mode', 'floor') == 'floor']
  assert not floor or sum(rules[k].floored for k in floor) > 0
  # And the parameters really moved (a no-op optimizer would not pass).
  start = init_params()
  assert min(np.max(np.abs(got[k] - start[k])) for k in start) > 1e-3


def _extra_state_bytes(tiers) -> tuple[int, int]:
  """(state bytes of `tiers` - those of the published tiers, the router's bytes)."""
  params = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32) for k, v in init_params().items()}
  published = sj.memory_report(sj.skewadam(1e-3), nest(params)).total_state_bytes
  ours = sj.memory_report(sj.skewadam(1e-3, tiers=tiers), nest(params)).total_state_bytes
  router = sum(v.size * 4 for k, v in params.items() if _tier_of(k) == 'router')
  return ours - published, router


def test_adam_eps_tiers_differ_from_published_only_in_eps_and_router_momentum():
  for name, tier in sj.ADAM_EPS_TIERS.items():
    published = sj.PUBLISHED_TIERS[name]
    changes = {'eps_mode': 'adam'}
    if name == 'router':
      changes['momentum'] = True
    assert tier == published.replace(**changes), name
  extra, router = _extra_state_bytes(sj.ADAM_EPS_TIERS)
  assert router > 0 and extra == router


def test_adam_router_tiers_differ_from_published_only_in_the_router():
  assert sj.ADAM_ROUTER_TIERS['backbone'] == sj.PUBLISHED_TIERS['backbone']
  assert sj.ADAM_ROUTER_TIERS['experts'] == sj.PUBLISHED_TIERS['experts']
  assert sj.ADAM_ROUTER_TIERS['router'] == sj.ADAM_EPS_TIERS['router']
  extra, router = _extra_state_bytes(sj.ADAM_ROUTER_TIERS)
  assert router > 0 and extra == router


PRESETS = ['PUBLISHED_TIERS', 'ADAM_EPS_TIERS', 'ADAM_ROUTER_TIERS', 'MUON_TIERS',
           'MUON_CODED_TIERS']
# Every way a dict is changed in place.
CHANGES = {
    'setitem': lambda tiers: tiers.__setitem__('router', sj.Tier()),
    'delitem': lambda tiers: tiers.__delitem__('router'),
    'update': lambda tiers: tiers.update(router=sj.Tier()),
    'pop': lambda tiers: tiers.pop('router'),
    'popitem': lambda tiers: tiers.popitem(),
    'setdefault': lambda tiers: tiers.setdefault('new', sj.Tier()),
    'clear': lambda tiers: tiers.clear(),
    'ior': lambda tiers: tiers.__ior__({'router': sj.Tier()}),
    'setattr': lambda tiers: setattr(tiers, '_tiers', {}),
}


@pytest.mark.parametrize('name', PRESETS)
def test_presets_are_read_only_and_every_later_default_stays(name):
  preset = getattr(sj, name)
  before = dict(preset)
  params = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32) for k, v in init_params().items()}
  default_bytes = sj.memory_report(sj.skewadam(1e-3), nest(params)).total_state_bytes
  for change, apply in CHANGES.items():
    with pytest.raises(TypeError, match=rf'{name} is read-only .*dict\(sj\.{name}\).*tiers='):
      apply(preset)
    assert dict(preset) == before, change
  # The default optimizer is the published one still, not what a caller tried.
  assert sj.memory_report(sj.skewadam(1e-3), nest(params)).total_state_bytes == default_bytes
  assert sj.PUBLISHED_TIERS['router'] == sj.Tier(momentum=False, second_moment='exact',
                                                 apply_weight_decay=False)


@pytest.mark.parametrize('name', PRESETS)
def test_a_preset_copies_into_a_dict_that_every_tiers_argument_takes(name):
  preset = getattr(sj, name)
  copy = dict(preset)
  assert copy == preset and preset == copy and len(preset) == len(copy)
  assert list(preset) == list(copy) and {**preset} == copy
  assert preset | {'extra': sj.Tier()} == {**copy, 'extra': sj.Tier()}
  assert {'extra': sj.Tier()} | preset == {'extra': sj.Tier(), **copy}
  copy['router'] = copy['router'].replace(lr_scale=0.5)  # the copy is the caller's
  assert preset['router'].lr_scale == 1.0
  assert pickle.loads(pickle.dumps(preset)) == preset
  # The frozen preset and its plain-dict copy build the same optimizer.
  params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), nest(init_params()))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
  results = []
  for tiers in (preset, dict(preset)):
    tx = sj.skewadam(1e-3, tiers=tiers)
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    results.append((jax.tree.structure(state), updates))
  assert results[0][0] == results[1][0]
  jax.tree.map(np.testing.assert_array_equal, results[0][1], results[1][1])
  table = [(r.path, r.tier) for r in sj.label_table(sj.skewadam(1e-3, tiers=dict(preset)),
                                                    params).rows]
  assert table == [(r.path, r.tier)
                   for r in sj.label_table(sj.skewadam(1e-3, tiers=preset), params).rows]


# A smaller tree for the option grid: stacked odd experts, a matrix with tiny
# gradients, a 1-D leaf of odd length and a scalar.
SMALL_LEAVES = {k: MOE_LEAVES[k] for k in (
    'blocks/1/moe/experts/odd', 'blocks/0/attn/k_proj/kernel', 'blocks/0/attn/q_proj/kernel',
    'blocks/0/ln1/scale', 'logit_scale')}
SMALL_LEAVES['odd_vector'] = ((11,), 0.5)

OPTIONS = [
    dict(momentum=m, second_moment=sm, eps_mode=e, clip_threshold=c)
    for m in (True, False)
    for sm in ('exact', 'factored', 'grouped')
    for e in ('floor', 'adam')
    for c in (1.0, 0.5, None)
]


@pytest.mark.parametrize('opts', OPTIONS, ids=lambda o: '-'.join(map(str, o.values())))
def test_every_tier_option_matches_reference(opts):
  tier = sj.Tier(group_size=3, **opts)
  ref_kwargs = dict(momentum=opts['momentum'], second_moment=opts['second_moment'],
                    eps_mode=opts['eps_mode'], clip=opts['clip_threshold'], group_size=3)
  expected, _ = _ref_run(lambda k: ref_kwargs, steps=12, leaves=SMALL_LEAVES)
  tx = optax.chain(sj.scale_by_tiered_adam(tier=tier), optax.scale(-LR))
  got, _ = run_optax(tx, init_params(leaves=SMALL_LEAVES),
                     make_grads_fn(leaves=SMALL_LEAVES), 12)
  worst = max(np.max(np.abs(got[k] - expected[k])) for k in expected)
  assert worst <= 1e-5, worst


def test_adam_like_tier_equals_optax_adam():
  tier = sj.Tier(momentum=True, second_moment='exact', eps_mode='adam',
                 clip_threshold=None)
  params = nest({k: jnp.asarray(v, jnp.float32) for k, v in init_params().items()})
  ours, theirs = sj.scale_by_tiered_adam(tier=tier), optax.scale_by_adam()
  s1, s2 = ours.init(params), theirs.init(params)
  grads_fn = make_grads_fn()
  for i in range(20):
    flat = {k: np.asarray(v) for k, v in init_params().items()}
    g = nest({k: jnp.asarray(v, jnp.float32) for k, v in grads_fn(i, flat).items()})
    u1, s1 = jax.jit(ours.update)(g, s1)
    u2, s2 = jax.jit(theirs.update)(g, s2)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_stacked_experts_are_factored_and_clipped_per_expert():
  e, r, c = 4, 6, 10
  rng = np.random.default_rng(0)
  # Experts with gradient scales four decades apart: per-expert statistics must not mix.
  g = rng.standard_normal((e, r, c)) * (10.0 ** np.arange(e))[:, None, None]
  tx = sj.scale_by_tiered_adam(tier=sj.PUBLISHED_TIERS['experts'])
  state = tx.init(jnp.zeros((e, r, c)))
  assert state.v_row.shape == (e, r) and state.v_col.shape == (e, c)
  assert state.mu is None  # no momentum: no slot (an empty node, no leaf)
  u, state = tx.update(jnp.asarray(g, jnp.float32), state)
  for i in range(e):
    single = sj.scale_by_tiered_adam(tier=sj.PUBLISHED_TIERS['experts'])
    ui, _ = single.update(jnp.asarray(g[i], jnp.float32), single.init(jnp.zeros((r, c))))
    np.testing.assert_allclose(u[i], ui, rtol=1e-5, atol=1e-7)
    ref = RefTier((r, c), momentum=False)
    np.testing.assert_allclose(u[i], ref.update(g[i]), rtol=1e-5, atol=1e-7)


def test_state_fields_hold_only_what_the_tier_needs():
  params = {'w': jnp.zeros((3, 5, 7)), 'b': jnp.zeros((7,)), 's': jnp.zeros(())}
  backbone = sj.scale_by_tiered_adam(tier=sj.PUBLISHED_TIERS['backbone']).init(params)
  assert backbone.mu['w'].dtype == jnp.float32 and backbone.mu['w'].shape == (3, 5, 7)
  assert backbone.v_row['w'].shape == (3, 5) and backbone.v_col['w'].shape == (3, 7)
  assert backbone.v["w"] is None
  assert backbone.v["b"].shape == (7,) and backbone.v_row["b"] is None
  assert backbone.v['s'].shape == ()
  grouped = sj.scale_by_tiered_adam(second_moment='grouped', group_size=4,
                                    momentum=False).init(params)
  assert grouped.v['w'].shape == (3, 5, 2) and grouped.v['b'].shape == (2,)
  assert jax.tree.leaves(grouped.mu) == []


def test_bf16_momentum_is_stored_in_bf16():
  tx = sj.scale_by_tiered_adam(mu_dtype=jnp.bfloat16)
  params = {'w': jnp.zeros((4, 6), jnp.bfloat16)}
  state = tx.init(params)
  assert state.mu['w'].dtype == jnp.bfloat16
  u, state = tx.update({'w': jnp.ones((4, 6), jnp.bfloat16)}, state)
  assert u['w'].dtype == jnp.bfloat16 and state.mu['w'].dtype == jnp.bfloat16


def test_zero_gradients_give_zero_updates():
  for tier in [*sj.PUBLISHED_TIERS.values(), sj.Tier(eps_mode='adam'),
               sj.Tier(second_moment='grouped', eps_mode='adam')]:
    tx = sj.scale_by_tiered_adam(tier=tier)
    params = {'w': jnp.zeros((3, 4, 5)), 'b': jnp.zeros(5)}
    u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params))
    for leaf in jax.tree.leaves(u):
      assert np.all(np.asarray(leaf) == 0.0)


# ------------------------------------------------------------- one state for every tier


def _toy():
  return {'embed': jnp.ones((16, 8)), 'attn': {'q': jnp.ones((8, 8)), 'norm': jnp.ones((8,))},
          'moe': {'router': jnp.zeros((8, 4)),
                  'experts': {'w1': jnp.ones((4, 8, 16)), 'w2': jnp.ones((4, 16, 8))}}}


def _with_masked_nodes(tree):
  """Leaves with `optax.MaskedNode`s counted as leaves too (a slot an optax state keeps
  for nothing; an absent slot of ours is None, which no pytree library sees as a leaf)."""
  return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))


@pytest.mark.parametrize('policy', ['PUBLISHED_TIERS', 'MUON_TIERS', 'ADAM_EPS_TIERS'])
def test_state_has_one_entry_per_array_kept(policy):
  """One step count for every tier, and per parameter only the arrays its tier keeps:
  no empty slot anywhere (a partition of tiers had one per field, tier and parameter)."""
  params, tiers = _toy(), getattr(sj, policy)
  state = sj.skewadam(1e-3, tiers=tiers).init(params)
  arrays = jax.tree.leaves(state)
  assert len(_with_masked_nodes(state)) == len(arrays)
  assert [x.shape for x in arrays if x.dtype == jnp.int32] == [()]  # one step count
  # The arrays of a partition of the same tiers (one count per tier), no more, no less.
  labels = _alias.tier_labeler(tiers)(params)
  partition = optax.partition({k: sj.scale_by_tiered_adam(tier=t) for k, t in tiers.items()},
                              labels)
  assert len(arrays) == len(jax.tree.leaves(partition.init(params))) - len(tiers) + 1


def test_nnx_optimizer_boxes_one_variable_per_array():
  from flax import nnx  # noqa: PLC0415

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(8, 8, rngs=rngs)
      self.r = nnx.Linear(8, 4, rngs=rngs)
      self.e = nnx.Param(jnp.ones((4, 8, 16)))

  for tx in (sj.skewadam(1e-3), sj.skewadam(1e-3, tiers=sj.MUON_TIERS), sj.adampm(1e-3)):
    opt = nnx.Optimizer(Model(nnx.Rngs(0)), tx, wrt=nnx.Param)
    state = nnx.state(opt.opt_state)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(isinstance(v, nnx.Variable) for v in variables)
    assert len(variables) == len(jax.tree.leaves(state))


def test_one_transform_of_tiers_updates_as_a_partition_of_tiers():
  """`scale_by_tiers` is bitwise `optax.partition` of `scale_by_tiered_adam` per tier,
  with one state holding only what each leaf keeps."""
  params = _toy()
  labels = sj.moe_param_labels(params)
  tiers = dict(sj.MUON_TIERS, experts=sj.Tier(momentum=False, second_moment='grouped',
                                                group_size=4))
  ours = sj.scale_by_tiers(tiers, labels, 0.8, 0.99, 1e-8)
  theirs = optax.partition(
      {name: sj.scale_by_tiered_adam(0.8, 0.99, 1e-8, tier=tier)
       for name, tier in tiers.items()}, labels)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  step_ours, step_theirs = jax.jit(ours.update), jax.jit(theirs.update)
  for i in range(3):
    g = jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 1) + jnp.arange(p.size).reshape(p.shape)),
                     params)
    u_ours, s_ours = step_ours(g, s_ours, params)
    u_theirs, s_theirs = step_theirs(g, s_theirs, params)
    jax.tree.map(np.testing.assert_array_equal, u_ours, u_theirs)
  for name in tiers:
    inner = s_theirs.inner_states[name].inner_state
    for field in ('mu', 'v_row', 'v_col', 'v'):
      kept = jax.tree.leaves(getattr(inner, field))
      mine = [x for x, label in zip(jax.tree.leaves(getattr(s_ours, field), is_leaf=lambda x:
                                                    x is None),
                                    jax.tree.leaves(labels)) if label == name and x is not None]
      assert len(kept) == len(mine)
      for a, b in zip(kept, mine):
        np.testing.assert_array_equal(a, b)
  assert int(s_ours.count) == 3


# ---------------------------------------------------------------------------------------
# `Tier.apply_weight_decay`, formerly `weight_decay` (the name of `skewadam`'s rate).


def test_tier_field_is_apply_weight_decay():
  names = [f.name for f in dataclasses.fields(sj.Tier)]
  assert 'apply_weight_decay' in names and 'weight_decay' not in names
  assert names.index('apply_weight_decay') == names.index('eps_mode') + 1  # same position
  off = sj.Tier(apply_weight_decay=False)
  assert off.apply_weight_decay is False and sj.Tier().apply_weight_decay is True
  assert off == sj.Tier().replace(apply_weight_decay=False) != sj.Tier()
  assert hash(off) == hash(sj.Tier().replace(apply_weight_decay=False))
  assert 'apply_weight_decay=False' in repr(off) and ' weight_decay' not in repr(off)
  assert sj.PUBLISHED_TIERS['router'].apply_weight_decay is False
  assert sj.ADAM_EPS_TIERS['router'].apply_weight_decay is False
  assert sj.PUBLISHED_TIERS['backbone'].apply_weight_decay is True


def test_the_removed_weight_decay_spelling_is_a_type_error():
  # `weight_decay` is `skewadam`'s rate; a tier's flag is only `apply_weight_decay`.
  with pytest.raises(TypeError, match="unexpected keyword argument 'weight_decay'"):
    sj.Tier(momentum=False, weight_decay=False)
  with pytest.raises(TypeError, match=r"Unknown Tier option\(s\) \['weight_decay'\].*"
                                      r'apply_weight_decay'):
    sj.Tier(momentum=False).replace(weight_decay=False)
  with pytest.raises(TypeError, match='weight_decay'):
    sj.scale_by_tiered_adam(weight_decay=False, momentum=False)
  assert not hasattr(sj.Tier(), 'weight_decay')


def test_a_weight_decay_flag_that_is_not_a_bool_is_a_type_error_naming_it():
  with pytest.raises(TypeError, match='`apply_weight_decay` must be a bool, got 1'):
    sj.Tier(apply_weight_decay=1)
  with pytest.raises(TypeError, match='`apply_weight_decay` must be a bool, got 0'):
    sj.Tier().replace(apply_weight_decay=0)


@pytest.mark.parametrize('momentum', [True, False])
def test_grouped_tier_pooled_along_a_batch_axis_matches_the_reference(momentum):
  """Groups along the expert axis, the clip per expert matrix: as the NumPy reference
  over 6 steps, and, with the batch axis moved (`batch_axes=(1,)`), the same updates."""
  shape, s = (4, 6, 10), 2
  rng = np.random.default_rng(3)
  grads = [rng.standard_normal(shape).astype(np.float32) * (1 + 3 * (i % 2))
           for i in range(6)]
  tier = sj.Tier(second_moment='grouped', momentum=momentum, group_size=s, group_axis=0,
                 clip_threshold=0.5)
  ref = RefTier(shape, momentum=momentum, second_moment='grouped', clip=0.5, group_size=s,
                group_axis=0)
  tx = sj.scale_by_tiered_adam(tier=tier)
  moved = sj.scale_by_tiered_adam(tier=tier.replace(group_axis=1),
                                  batch_axes={'w': (1,)})
  state = tx.init({'w': jnp.zeros(shape)})
  state_moved = moved.init({'w': jnp.zeros((6, 4, 10))})
  for g in grads:
    u, state = jax.jit(tx.update)({'w': jnp.asarray(g)}, state)
    u_moved, state_moved = jax.jit(moved.update)(
        {'w': jnp.asarray(g.transpose(1, 0, 2))}, state_moved)
    want = ref.update(g)
    np.testing.assert_allclose(np.asarray(u['w']), want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(u_moved['w']).transpose(1, 0, 2), want,
                               rtol=2e-5, atol=1e-7)
  assert ref.clipped > 0



@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
    shapes=st.lists(st.sampled_from([(16,), (8, 16), (16, 8), (2, 8, 16), (24, 16)]),
                    min_size=1, max_size=6),
    estimator=st.sampled_from([sj.Factored(), sj.Exact(), sj.Grouped(group_size=4)]),
    momentum=st.booleans(), seed=st.integers(0, 2**16))
def test_leaves_of_one_shape_share_one_traced_estimator_update(shapes, estimator, momentum,
                                                               seed):
  # A built-in estimator's update is one jitted function of the estimator and the step's
  # static options: traced once per shape, called once per leaf; the same updates and
  # statistics as the update traced leaf by leaf (within the ulp bound).
  params = {f'p{i}': jnp.zeros(s) for i, s in enumerate(shapes)}
  rng = np.random.default_rng(seed)
  grads = [{k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
            for k, v in params.items()} for _ in range(3)]
  tier = sj.Tier(momentum=momentum, second_moment=estimator)
  runs = {}
  classes = (sj.Exact, sj.Factored, sj.Grouped)
  for name in ('cached', 'per leaf'):
    for cls in classes:  # `per_shape`: the protocol that caches the traced update
      cls.per_shape = name == 'cached'
    try:
      tx = sj.scale_by_tiered_adam(tier=tier)
      state = tx.init(params)
      for g in grads:
        u, state = jax.jit(tx.update)(g, state)
      runs[name] = (u, state)
      calls = [e for e in jax.make_jaxpr(tx.update)(grads[0], state).eqns
               if e.primitive.name in ('pjit', 'jit')
               and e.params.get('name') == '_cached_update']
    finally:
      for cls in classes:
        cls.per_shape = True
    if name == 'cached':
      assert len(calls) == len(shapes)
      assert len({id(e.params['jaxpr']) for e in calls}) == len(set(shapes))
    else:
      assert not calls
  for a, b in zip(jax.tree.leaves(runs['cached']), jax.tree.leaves(runs['per leaf'])):
    assert_within_ulp(a, b, np.float32)
