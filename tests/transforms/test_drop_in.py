"""Drop-in for `optax.adamw`: what a user swaps in behaves as AdamW does at the API.

The calling conventions (which argument is wrong when `update`'s are swapped), the
dtype of the updates and the parameter trees accepted are AdamW's, checked against
`optax.adamw` itself on the same inputs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj

PARAMS = {'embed': jnp.ones((6, 4)),
          'moe': {'router': jnp.ones((4, 3)), 'experts': {'w1': jnp.ones((3, 4, 5))}}}

# Every public transform a user calls `update` on.
TRANSFORMS = {
    'skewadam': lambda: sj.skewadam(1e-3),
    'adampm': lambda: sj.adampm(1e-3),
    'scale_by_tiers': lambda: sj.scale_by_tiers(None, None),
    'scale_by_tiered_adam': sj.scale_by_tiered_adam,
    'scale_by_grouped_second_moment': sj.scale_by_grouped_second_moment,
}


# ---------------------------------------------------------------------------------------
# `update`'s arguments in the wrong order.


@pytest.mark.parametrize('jit', [False, True])
@pytest.mark.parametrize('name', tuple(TRANSFORMS))
def test_swapped_state_and_params_name_both_and_the_right_order(name, jit):
  tx = TRANSFORMS[name]()
  state = tx.init(PARAMS)
  update = jax.jit(tx.update) if jit else tx.update
  right = re.escape('The order is `tx.update(updates, state, params)`')
  with pytest.raises(TypeError, match=rf'sj.{name}: .*`state` and `params` are swapped.*'
                                      + right):
    update(PARAMS, PARAMS, state)
  with pytest.raises(TypeError, match=r'`state` is missing.*' + right):
    update(PARAMS, PARAMS)  # the params given as the state
  updates, _ = update(PARAMS, state, PARAMS)  # the right order still runs
  assert jax.tree.structure(updates) == jax.tree.structure(PARAMS)


# ---------------------------------------------------------------------------------------
# The dtype of the updates: optax.adamw's on the same inputs.

# Every tier of every policy, and the estimators and first-moment rules none of them has.
TIERS = {f'{policy}/{name}': tier for policy, tiers in [
    ('published', sj.PUBLISHED_TIERS), ('adam_eps', sj.ADAM_EPS_TIERS),
    ('adam_router', sj.ADAM_ROUTER_TIERS), ('muon', sj.MUON_TIERS)]
         for name, tier in tiers.items()}
TIERS.update({'grouped': sj.Tier(second_moment='grouped', group_size=2),
              'exact_no_momentum': sj.Tier(momentum=False, second_moment='exact'),
              'nesterov_bf16_mu': sj.Tier(nesterov=True, mu_dtype=jnp.bfloat16)})
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# A leaf of every rank: matrices, a stack of them, a vector and a scalar.
SHAPES = {'w': (6, 4), 'stack': (2, 4, 6), 'bias': (4,), 'scale': ()}


def _update_dtypes(tx, grad_dtype, param_dtype, shapes=SHAPES):
  """The dtype of each leaf's update, from an abstract trace of `init` and `update`."""
  params = {k: jax.ShapeDtypeStruct(s, param_dtype) for k, s in shapes.items()}
  grads = {k: jax.ShapeDtypeStruct(s, grad_dtype) for k, s in shapes.items()}
  state = jax.eval_shape(tx.init, params)
  updates, _ = jax.eval_shape(tx.update, grads, state, params)
  return {k: jnp.dtype(u.dtype) for k, u in updates.items()}


@pytest.mark.parametrize('param_dtype', DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize('grad_dtype', DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize('tier', tuple(TIERS))
def test_every_tier_updates_in_adamws_dtype(tier, grad_dtype, param_dtype):
  # bfloat16 gradients on float32 parameters: float32 updates, as AdamW's.
  shapes = SHAPES
  if isinstance(TIERS[tier].estimator, sj.Orthogonal):  # matrices only
    shapes = {k: s for k, s in SHAPES.items() if len(s) >= 2}
  for weight_decay in (0.0, 0.1):  # decay adds the parameter, which promotes in adamw
    tx = sj.skewadam(1e-3, weight_decay=weight_decay, tiers={'t': TIERS[tier]},
                     param_labels=lambda tree: jax.tree.map(lambda _: 't', tree))
    want = _update_dtypes(optax.adamw(1e-3, weight_decay=weight_decay), grad_dtype,
                          param_dtype, shapes)
    assert _update_dtypes(tx, grad_dtype, param_dtype, shapes) == want


@pytest.mark.parametrize('param_dtype', DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize('grad_dtype', DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_adampm_updates_in_adamws_dtype(grad_dtype, param_dtype):
  want = _update_dtypes(optax.adamw(1e-3), grad_dtype, param_dtype)
  assert _update_dtypes(sj.adampm(1e-3, group_size=2), grad_dtype, param_dtype) == want
  # The state's storage dtype is not the update's (as in every tier).
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = sj.adampm(1e-3, group_size=2, mu_dtype=dtype, nu_dtype=dtype)
    assert _update_dtypes(tx, grad_dtype, param_dtype) == want


def test_bfloat16_gradients_of_the_moe_tree_update_in_float32():
  """The default labels (backbone, experts, router) on float32 params: every update is
  float32, as AdamW's, not only the tiers that weight decay promotes."""
  grads = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  for tx in (sj.skewadam(1e-3, weight_decay=0.1), sj.adampm(1e-3, weight_decay=0.1)):
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(jnp.float32)}


# ---------------------------------------------------------------------------------------
# Integer and boolean leaves in the params: accepted as optax.adamw accepts them.

INTS = {'step': jnp.asarray(3, jnp.int32), 'buffer': jnp.arange(5, dtype=jnp.int32) * 1000,
        'flag': jnp.asarray(True)}
WITH_INTS = {**PARAMS, 'counters': INTS}
# What each transform is checked against: adamw for the optimizers, its rule for ours.
REFERENCES = {
    'skewadam': lambda: (sj.skewadam(1e-3, weight_decay=0.1),
                         optax.adamw(1e-3, weight_decay=0.1)),
    'skewadam_no_decay': lambda: (sj.skewadam(1e-3), optax.adamw(1e-3, weight_decay=0.0)),
    'adampm': lambda: (sj.adampm(1e-3, weight_decay=0.1), optax.adamw(1e-3, weight_decay=0.1)),
    'scale_by_tiers': lambda: (sj.scale_by_tiers(None, None), optax.scale_by_adam()),
    'scale_by_tiered_adam': lambda: (sj.scale_by_tiered_adam(), optax.scale_by_adam()),
    'scale_by_grouped_second_moment': lambda: (sj.scale_by_grouped_second_moment(),
                                               optax.scale_by_adam()),
}


def _counters(tree):
  return tree['counters']


@pytest.mark.parametrize('name', tuple(REFERENCES))
def test_integer_leaves_update_as_adamw_does_and_keep_no_state(name):
  tx, adamw = REFERENCES[name]()
  # No state for the integer leaves: the state of the float leaves alone.
  assert sj.state_bytes(tx.init(WITH_INTS)) == sj.state_bytes(tx.init(PARAMS))
  ours, theirs = WITH_INTS, WITH_INTS
  state, ref_state = tx.init(ours), adamw.init(theirs)
  for _ in range(3):  # integer leaves have zero gradients (jax.grad gives float0)
    grads = jax.tree.map(jnp.zeros_like, ours)
    updates, state = jax.jit(tx.update)(grads, state, ours)
    ref, ref_state = jax.jit(adamw.update)(grads, ref_state, theirs)
    for u, r in zip(jax.tree.leaves(_counters(updates)), jax.tree.leaves(_counters(ref))):
      assert u.dtype == r.dtype == jnp.float32
      np.testing.assert_allclose(u, r, rtol=1e-6)  # XLA may fuse lr * wd * p otherwise
    ours, theirs = optax.apply_updates(ours, updates), optax.apply_updates(theirs, ref)
    for a, b in zip(jax.tree.leaves(_counters(ours)), jax.tree.leaves(_counters(theirs))):
      assert a.dtype == b.dtype and a.dtype in (jnp.int32, jnp.bool_)
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('name', ['skewadam', 'adampm'])
def test_float0_gradients_of_integer_leaves_are_zero_gradients(name):
  """`jax.grad(..., allow_int=True)` gives integer leaves float0 gradients (optax.adamw
  raises on them): the same update as a zero gradient."""
  tx, _ = REFERENCES[name]()
  state = tx.init(WITH_INTS)
  grads = jax.grad(lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(p) if x.dtype.kind == 'f'),
                   allow_int=True)(WITH_INTS)
  assert {g.dtype for g in jax.tree.leaves(_counters(grads))} == {jax.dtypes.float0}
  updates, _ = tx.update(grads, state, WITH_INTS)
  zeros, _ = tx.update(jax.tree.map(lambda g, p: jnp.zeros_like(p) if g.dtype ==
                                    jax.dtypes.float0 else g, grads, WITH_INTS),
                       state, WITH_INTS)
  for u, z in zip(jax.tree.leaves(updates), jax.tree.leaves(zeros)):
    np.testing.assert_array_equal(u, z)


def test_reports_of_a_tree_with_integer_leaves():
  tx = sj.skewadam(1e-3)
  table = {r.path: r for r in sj.label_table(tx, WITH_INTS)}
  for path in ('counters/step', 'counters/buffer', 'counters/flag'):
    row = table[path]
    assert (row.second_moment, row.state_bytes) == ('-', 0)
    assert 'no state' in row.note and row.dtype in ('int32', 'bool')
  report = sj.memory_report(tx, WITH_INTS)
  assert report.total_state_bytes == sj.memory_report(tx, PARAMS).total_state_bytes
  assert report.total_params == sj.memory_report(tx, PARAMS).total_params + 1 + 5 + 1
  # AdamW keeps both moments of every leaf, the integer buffer's too (those of the 0-d
  # leaves count as step counters).
  adamw = sj.memory_report(optax.adamw(1e-3), WITH_INTS).total_state_bytes
  assert adamw - sj.memory_report(optax.adamw(1e-3), PARAMS).total_state_bytes == 2 * 5 * 4


@pytest.mark.parametrize('name', ['scale_by_tiers', 'scale_by_tiered_adam',
                                  'scale_by_grouped_second_moment'])
@pytest.mark.parametrize('grad_dtype', DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_a_scaling_transform_without_params_updates_in_the_gradients_dtype(name,
                                                                          grad_dtype):
  # docs/numerics.md: with no params to promote with, the update keeps the gradient's
  # dtype, whatever dtype the state was initialised from.
  tx = TRANSFORMS[name]()
  state = tx.init(PARAMS)
  grads = jax.tree.map(lambda p: jnp.ones(p.shape, grad_dtype), PARAMS)
  updates, _ = tx.update(grads, state)
  assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(grad_dtype)}
