"""Numeric faults: NaN/Inf gradients, zero gradients, bf16 parameters.

What happens to a non-finite gradient *without* `optax.apply_if_finite` is pinned here
exactly as docs/numerics.md describes it: which part of the update and of the state
it reaches depends on the leaf's second-moment estimator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj
from skewadam_jax.transforms import tier as _tier

GROUPED_TIERS = {
    'backbone': sj.Tier(momentum=True, second_moment='grouped', group_size=2),
    'experts': sj.Tier(momentum=False, second_moment='grouped', group_size=2,
                       group_axis=-2),
    'router': sj.PUBLISHED_TIERS['router'],
}
OPTIMIZERS = {
    'skewadam': lambda: sj.skewadam(1e-2, weight_decay=0.1),
    'skewadam_grouped': lambda: sj.skewadam(1e-2, weight_decay=0.1, tiers=GROUPED_TIERS),
    'adampm': lambda: sj.adampm(1e-2, weight_decay=0.1, group_size=4),
}
SHAPES = {'embed': (8, 6), 'ln': {'scale': (6,)},
          'moe': {'router': {'kernel': (6, 3)}, 'experts': {'w1': (3, 6, 5)}}}


def _params(dtype=jnp.float32, seed=0):
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(seed)
  return treedef.unflatten([jnp.asarray(rng.standard_normal(s), dtype) for s in leaves])


def _grads(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(100 + seed)
  return treedef.unflatten([jnp.asarray(rng.standard_normal(p.shape), p.dtype)
                            for p in leaves])


def _poison(grads, value, where=('moe', 'experts', 'w1'), index=(1, 2, 3)):
  """`grads` with one element of one leaf set to `value` (NaN or Inf)."""
  node = grads
  for key in where[:-1]:
    node = node[key]
  node[where[-1]] = node[where[-1]].at[index].set(value)
  return grads


def _step_fn(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates
  return step


def _all_finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact))


# ---------------------------------------------------------------------------------------
# apply_if_finite: a bad step is skipped and nothing is lost.


@functools.cache
def _guarded(name):
  """`optax.apply_if_finite(optimizer)` and its jitted step, built once per optimizer."""
  tx = optax.apply_if_finite(OPTIMIZERS[name](), max_consecutive_errors=3)
  return tx, _step_fn(tx)


@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize('name', tuple(OPTIMIZERS))
def test_apply_if_finite_skips_bad_step_and_loses_nothing(name, bad):
  tx, step = _guarded(name)
  params = _params()
  state = tx.init(params)
  for i in range(2):
    params, state, _ = step(params, state, _grads(params, i))

  bad_params, bad_state, updates = step(params, state, _poison(_grads(params, 2), bad))
  jax.tree.map(lambda u: np.testing.assert_array_equal(u, jnp.zeros_like(u)), updates)
  jax.tree.map(np.testing.assert_array_equal, bad_params, params)
  jax.tree.map(np.testing.assert_array_equal, bad_state.inner_state, state.inner_state)
  assert int(bad_state.notfinite_count) == 1 and int(bad_state.total_notfinite) == 1

  # The next good step continues exactly as if the bad one had never been seen.
  got, got_state, _ = step(bad_params, bad_state, _grads(params, 3))
  want, want_state, _ = step(params, state, _grads(params, 3))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  jax.tree.map(np.testing.assert_array_equal, got_state.inner_state, want_state.inner_state)
  assert int(got_state.notfinite_count) == 0
  assert _all_finite((got, got_state))


# ---------------------------------------------------------------------------------------
# Without apply_if_finite: how far a non-finite gradient reaches (docs/numerics.md).


def _run_tier(tier, shape, bad, index, steps_before=2):
  """A fresh tier transform on one leaf: good steps, then one with `bad` at `index`.

  Returns the update of the bad step and the state after it.
  """
  tx = sj.scale_by_tiered_adam(tier=tier)
  rng = np.random.default_rng(0)
  update = jax.jit(tx.update)
  state = tx.init(jnp.zeros(shape))
  for _ in range(steps_before):
    _, state = update(jnp.asarray(rng.standard_normal(shape), jnp.float32), state)
  g = jnp.asarray(rng.standard_normal(shape), jnp.float32).at[index].set(bad)
  u, state = update(g, state)
  return np.asarray(u), state


def test_nan_in_factored_expert_reaches_only_that_expert():
  """Factored statistics are per expert: a NaN at (e, i, j) makes expert e's whole update
  NaN (its row mean and its RMS clip see it) and leaves the other experts finite."""
  u, state = _run_tier(sj.PUBLISHED_TIERS['experts'], (3, 6, 5), np.nan, (1, 2, 3))
  assert np.isnan(u[1]).all()
  assert np.isfinite(u[[0, 2]]).all()
  row, col = np.asarray(state.v_row), np.asarray(state.v_col)
  assert np.isnan(row[1, 2]) and np.isnan(col[1, 3])
  assert np.isfinite(np.delete(row[1], 2)).all() and np.isfinite(np.delete(col[1], 3)).all()
  assert np.isfinite(row[[0, 2]]).all() and np.isfinite(col[[0, 2]]).all()


def test_inf_in_factored_expert_reaches_only_that_expert():
  u, state = _run_tier(sj.PUBLISHED_TIERS['experts'], (3, 6, 5), np.inf, (1, 2, 3))
  assert np.isnan(u[1]).all()  # inf / inf in the reconstruction
  assert np.isfinite(u[[0, 2]]).all()
  assert np.isposinf(np.asarray(state.v_row)[1, 2])


@pytest.mark.parametrize('clip', [1.0, None])
def test_nan_in_exact_leaf_reaches_the_element_or_the_clipped_matrix(clip):
  """Exact second moment: the NaN stays in its element; the RMS clip (on by default)
  spreads it over the matrix it normalises."""
  tier = sj.PUBLISHED_TIERS['router'].replace(clip_threshold=clip)
  u, state = _run_tier(tier, (6, 3), np.nan, (4, 1))
  v = np.asarray(state.v)
  assert np.isnan(v[4, 1]) and np.isfinite(np.delete(v.ravel(), 4 * 3 + 1)).all()
  if clip is None:
    assert np.isnan(u[4, 1]) and np.isfinite(np.delete(u.ravel(), 4 * 3 + 1)).all()
  else:
    assert np.isnan(u).all()


def test_nan_in_grouped_leaf_reaches_its_group():
  """Grouped second moment (AdamPM): the NaN reaches its element's momentum and its
  group's pooled statistic, hence the update of the whole group, and nothing else."""
  tx = sj.scale_by_grouped_second_moment(group_size=4)
  rng = np.random.default_rng(0)
  update = jax.jit(tx.update)
  state = tx.init(jnp.zeros((3, 10)))
  _, state = update(jnp.asarray(rng.standard_normal((3, 10)), jnp.float32), state)
  g = jnp.asarray(rng.standard_normal((3, 10)), jnp.float32).at[1, 5].set(np.nan)
  u, state = update(g, state)
  u, mu, nu = np.asarray(u), np.asarray(state.mu), np.asarray(state.nu)
  group = np.zeros((3, 10), bool)
  group[1, 4:8] = True
  assert np.isnan(u[group]).all() and np.isfinite(u[~group]).all()
  assert np.isnan(mu[1, 5]) and np.isfinite(np.delete(mu.ravel(), 15)).all()
  assert np.isnan(nu[1, 1]) and np.isfinite(np.delete(nu.ravel(), 1 * 3 + 1)).all()


def test_inf_in_grouped_leaf_freezes_its_group():
  """An Inf makes its element's update NaN and its group's pooled statistic Inf: without
  momentum the group then gets zero updates for good (silently frozen)."""
  tier = sj.Tier(momentum=False, second_moment='grouped', group_size=4, clip_threshold=None)
  tx = sj.scale_by_tiered_adam(tier=tier)
  update = jax.jit(tx.update)
  state = tx.init(jnp.zeros((3, 10)))
  g = jnp.ones((3, 10))
  u, state = update(g.at[1, 5].set(np.inf), state)
  u = np.asarray(u)
  assert np.isnan(u[1, 5])
  np.testing.assert_array_equal(u[1, [4, 6, 7]], 0.0)
  for _ in range(2):
    u, state = update(g, state)
  u = np.asarray(u)
  np.testing.assert_array_equal(u[1, 4:8], 0.0)
  assert np.all(np.abs(np.delete(u.ravel(), range(14, 18))) > 0.1)


def test_nan_stays_in_state_without_apply_if_finite():
  """The moving averages keep a NaN for good: later finite gradients still give NaN
  updates for the poisoned expert. This is why apply_if_finite is recommended."""
  tier = sj.PUBLISHED_TIERS['experts']
  tx = sj.scale_by_tiered_adam(tier=tier)
  update = jax.jit(tx.update)
  state = tx.init(jnp.zeros((3, 6, 5)))
  g = jnp.ones((3, 6, 5))
  _, state = update(g.at[1, 2, 3].set(np.nan), state)
  for _ in range(3):
    u, state = update(g, state)
  assert np.isnan(np.asarray(u)[1]).all() and np.isfinite(np.asarray(u)[[0, 2]]).all()


# ---------------------------------------------------------------------------------------
# Zero gradients.

ALL_TIERS = [
    sj.Tier(momentum=m, second_moment=k, eps_mode=e, clip_threshold=c, group_size=4)
    for m in (True, False) for k in _tier.SECOND_MOMENTS for e in _tier.EPS_MODES
    for c in (1.0, None)
]
ZERO_SHAPES = [(), (5,), (3, 4, 7)]


def _shapes(tier) -> list[tuple[int, ...]]:
  """ZERO_SHAPES that `tier` accepts: an orthogonal update needs a matrix per slice."""
  if tier is not None and tier.second_moment == 'orthogonal':
    return [s for s in ZERO_SHAPES if len(s) >= 2]
  return ZERO_SHAPES


def _zero_updates(grad_fn, steps=1):
  """Runs every tier of ALL_TIERS and AdamPM on every shape of ZERO_SHAPES it accepts
  for `steps` steps of `grad_fn(shape)` gradients, in one compiled function; returns
  (updates, state, shapes) per transform."""
  txs = [(sj.scale_by_tiered_adam(tier=t), _shapes(t)) for t in ALL_TIERS]
  txs.append((sj.scale_by_grouped_second_moment(group_size=4), ZERO_SHAPES))

  @jax.jit
  def run():
    out = []
    for tx, shapes in txs:
      params = [jnp.zeros(s) for s in shapes]
      state = tx.init(params)
      for _ in range(steps):
        u, state = tx.update([grad_fn(s) for s in shapes], state)
      out.append((u, state))
    return out

  return [(u, state, shapes) for (u, state), (_, shapes) in zip(run(), txs)]


def test_zero_gradients_give_zero_updates_and_no_nan():
  """The factored reconstruction's 0/0 (`r / mean(r)` with r = 0) is guarded; so is every
  other estimator, in both eps modes, with and without clipping and momentum."""
  for u, state, _ in _zero_updates(jnp.zeros):
    jax.tree.map(lambda x: np.testing.assert_array_equal(x, np.zeros_like(x)), u)
    assert _all_finite(state)


def test_zero_rows_and_experts_give_zero_updates_there():
  """Embedding rows or experts that got no tokens in a batch: zero gradient there, an
  ordinary one elsewhere; the zero parts update by exactly 0 (no momentum) and nothing
  is NaN."""
  def grad(shape):
    g = jnp.ones(shape) * jnp.arange(1, int(np.prod(shape)) + 1).reshape(shape) / 10
    if len(shape) >= 2:
      g = g.at[..., 0, :].set(0.0)  # a zero row (in every expert)
    if len(shape) == 3:
      g = g.at[0].set(0.0)  # and a whole zero expert
    return g

  for index, (u, state, shapes) in enumerate(_zero_updates(grad)):
    assert _all_finite((u, state))
    momentum = index == len(ALL_TIERS) or ALL_TIERS[index].momentum  # the last is AdamPM
    if not momentum:
      for x, shape in zip(u, shapes):
        if len(shape) >= 2:
          np.testing.assert_array_equal(x[..., 0, :], 0.0)
        if len(shape) == 3:
          np.testing.assert_array_equal(x[0], 0.0)


def test_eps_zero_gives_nan_on_zero_gradients():
  """Documented: `eps` is what guards 0/0 in the denominators, as in Adam; eps=0 is
  allowed but makes zero gradients NaN."""
  for tier in (sj.Tier(momentum=False, second_moment='exact', eps_mode='floor'),
               sj.Tier(momentum=False, second_moment='factored', eps_mode='adam')):
    tx = sj.scale_by_tiered_adam(eps=0.0, tier=tier)
    u, _ = jax.jit(tx.update)(jnp.zeros((4, 4)), tx.init(jnp.zeros((4, 4))))
    assert np.isnan(np.asarray(u)).all()


# ---------------------------------------------------------------------------------------
# bf16 parameters.


@pytest.mark.parametrize('name', tuple(OPTIMIZERS))
def test_bf16_params_stay_bf16_with_fp32_state(name):
  tx = OPTIMIZERS[name]()
  if name == 'adampm':  # AdamPM stores state in the params' dtype unless told otherwise
    tx = sj.adampm(1e-2, weight_decay=0.1, group_size=4, mu_dtype=jnp.float32,
                   nu_dtype=jnp.float32)
  step = _step_fn(tx)
  p16 = _params(jnp.bfloat16)
  p32 = jax.tree.map(lambda x16: x16.astype(jnp.float32), p16)  # the same start
  s16, s32 = tx.init(p16), tx.init(p32)
  for i in range(5):
    g32 = _grads(p32, i)
    p16, s16, u16 = step(p16, s16, jax.tree.map(lambda g: g.astype(jnp.bfloat16), g32))
    p32, s32, _ = step(p32, s32, g32)
    assert {x.dtype for x in jax.tree.leaves((p16, u16))} == {jnp.dtype(jnp.bfloat16)}
  state_dtypes = {x.dtype for x in jax.tree.leaves(s16) if x.ndim}
  assert state_dtypes == {jnp.dtype(jnp.float32)}
  assert _all_finite(s16)
  # The bf16 run tracks the float32 one to bf16 precision (3 significant digits).
  for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(p32)):
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2e-2, atol=2e-2)
  moved = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
              for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(_params(jnp.bfloat16))))
  assert moved > 1e-2


def test_adampm_default_state_dtype_follows_params():
  """Like optax.adam, AdamPM keeps mu and nu in the params' dtype by default."""
  state = sj.adampm(1e-2).init({'w': jnp.zeros((4, 16), jnp.bfloat16)})
  dtypes = {x.dtype for x in jax.tree.leaves(state) if x.ndim}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}


def test_tier_statistics_are_fp32_for_bf16_params():
  tiers = {'backbone': sj.Tier(mu_dtype=jnp.bfloat16, second_moment='factored'),
           'experts': GROUPED_TIERS['experts'], 'router': sj.PUBLISHED_TIERS['router']}
  state = sj.skewadam(1e-2, tiers=tiers).init(_params(jnp.bfloat16))
  tiered = state[0]
  for field in ('v_row', 'v_col', 'v'):
    assert {x.dtype for x in jax.tree.leaves(getattr(tiered, field))} == {
        jnp.dtype(jnp.float32)}, field
  assert tiered.mu['embed'].dtype == jnp.bfloat16
