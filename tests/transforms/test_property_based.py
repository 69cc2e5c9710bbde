"""Property-based tests: every rule against the NumPy float64 reference on random input.

Hypothesis draws shapes (0-d, 1-d, length 1, lengths not divisible by the group size,
stacked 3-d leaves), axes, group sizes, tier choices (momentum on/off, exact /
factored / grouped second moment, eps as floor or Adam's term, RMS clip or none),
decay rates and gradient scales from 1e-8 to 1e4, and checks updates *and* state
over several steps. Examples are derandomised so CI is deterministic; shapes are
small because each example compiles its own update.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import example, given, HealthCheck, settings
from hypothesis import strategies as st

import skewadam_jax as sj
from skewadam_jax.estimators import pooling as _pooling
from skewadam_jax.transforms import tier as _tier
from reference import leaf_axis, RefAdamPM, ref_expand, ref_groupmean, RefTier

FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
STEPS = 4


def shapes(max_ndim: int = 3, max_len: int = 7):
  """0-d to `max_ndim`-d shapes with lengths 1..max_len."""
  return st.integers(0, max_ndim).flatmap(
      lambda nd: st.tuples(*[st.integers(1, max_len)] * nd))


@st.composite
def axis_for(draw, shape):
  """A valid (possibly negative) axis for `shape`; any small int for 0-d and 1-d."""
  nd = len(shape)
  if nd < 2:
    return draw(st.integers(-1, 0))
  return draw(st.integers(-nd, nd - 1))


@dataclasses.dataclass(frozen=True)
class Case:
  """One drawn fuzz case: a leaf shape, hyperparameters and a gradient scale."""
  shape: tuple
  b1: float
  b2: float
  eps: float
  log_scale: float
  seed: int


def _cases(shape_strategy=None):
  return st.builds(
      Case,
      shape=shape_strategy or shapes(),
      b1=st.sampled_from([0.0, 0.5, 0.9]),
      b2=st.sampled_from([0.5, 0.9, 0.99, 0.999]),
      eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
      log_scale=st.floats(-8.0, 4.0),
      seed=st.integers(0, 2**16),
  )


def gradients(case: Case, steps: int = STEPS) -> list[np.ndarray]:
  """`steps` float32-representable gradients of scale 10**log_scale, with rows and
  columns rescaled over two decades so that factored and pooled estimates are inexact."""
  rng = np.random.default_rng(case.seed)
  factor = np.ones(case.shape)
  if len(case.shape) >= 1:
    factor = factor * 10 ** rng.uniform(-1, 1, case.shape[-1])
  if len(case.shape) >= 2:
    factor = factor * (10 ** rng.uniform(-1, 1, case.shape[-2]))[:, None]
  scale = 10.0 ** case.log_scale
  return [(scale * factor * rng.standard_normal(case.shape)).astype(np.float32)
          for _ in range(steps)]


def assert_close(got, want, rtol=2e-4, what=''):
  """Elementwise rtol plus an atol relative to the largest reference magnitude, so that
  tiny gradient scales (1e-8) are compared as strictly as large ones."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  scale = float(np.max(np.abs(want))) if want.size else 0.0
  np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5 * scale + 1e-37, err_msg=what)


def run_transform(tx, grads):
  """Runs `tx` on one leaf; yields (update, state) per step (one compilation)."""
  state = tx.init(jnp.zeros(grads[0].shape, jnp.float32))
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(jnp.asarray(g), state)
    yield np.asarray(u), state


# ---------------------------------------------------------------------------------------
# SkewAdam's tier rule.


@st.composite
def tier_cases(draw):
  case = draw(_cases())
  tier = sj.Tier(
      momentum=draw(st.booleans()),
      # The second-moment estimators of tests/support/reference.py; the orthogonal update has
      # its own NumPy reference (tests/estimators/test_orthogonal.py).
      second_moment=draw(st.sampled_from(
          [k for k in _tier.SECOND_MOMENTS if k != 'orthogonal'])),
      group_size=draw(st.integers(1, 5)),
      group_axis=draw(axis_for(case.shape)),
      clip_threshold=draw(st.one_of(st.none(), st.sampled_from([0.05, 0.5, 1.0, 4.0]))),
      eps_mode=draw(st.sampled_from(_tier.EPS_MODES)),
      apply_weight_decay=True)
  return case, tier


def _ref_tier(case: Case, tier: sj.Tier) -> RefTier:
  return RefTier(case.shape, momentum=tier.momentum, second_moment=tier.second_moment,
                 clip=tier.clip_threshold, eps_mode=tier.eps_mode,
                 group_size=tier.group_size, group_axis=tier.group_axis, b1=case.b1,
                 b2=case.b2, eps=case.eps)


_FLOOR = (Case((3, 5, 7), 0.9, 0.999, 1e-8, -8.0, 0),
          sj.Tier(momentum=False, second_moment='factored'))
_CLIP = (Case((2, 6, 4), 0.5, 0.9, 1e-6, 1.0, 1),
         sj.Tier(momentum=True, second_moment='grouped', group_size=4, group_axis=-2,
                 clip_threshold=0.05, eps_mode='adam'))


@FUZZ
@given(tier_cases())
@example(_FLOOR)
@example(_CLIP)
def test_tier_rule_matches_reference(case_and_tier):
  case, tier = case_and_tier
  tx = sj.scale_by_tiered_adam(case.b1, case.b2, case.eps, tier=tier)
  ref = _ref_tier(case, tier)
  grads = gradients(case)
  for step, (u, state) in enumerate(run_transform(tx, grads), start=1):
    want = ref.update(grads[step - 1])
    assert_close(u, want, what=f'update at step {step}')
    assert int(state.count) == step
    if tier.momentum:
      assert_close(state.mu, ref.m, rtol=1e-5, what='mu')
    else:
      assert not jax.tree.leaves(state.mu)  # no momentum stored
    if ref.kind == 'factored':
      assert_close(state.v_row, ref.r, rtol=1e-5, what='v_row')
      assert_close(state.v_col, ref.c, rtol=1e-5, what='v_col')
      assert not jax.tree.leaves(state.v)
    else:
      assert_close(state.v, ref.v, rtol=1e-5, what='v')
      assert not jax.tree.leaves((state.v_row, state.v_col))
  if (case, tier) == _FLOOR:
    assert ref.floored == STEPS
  if (case, tier) == _CLIP:
    assert ref.clipped == STEPS


# ---------------------------------------------------------------------------------------
# AdamPM.


@st.composite
def grouped_cases(draw):
  case = draw(_cases())
  return case, draw(st.integers(1, 9)), draw(axis_for(case.shape))


@FUZZ
@given(grouped_cases())
@example((Case((5, 11), 0.9, 0.999, 1e-8, 0.0, 3), 4, -1))  # 11 % 4 != 0
@example((Case((1,), 0.9, 0.999, 1e-8, -8.0, 4), 8, 0))  # length 1, tiny gradients
def test_adampm_matches_reference_and_pools_adams_nu(case_group_axis):
  case, s, axis = case_group_axis
  tx = sj.scale_by_grouped_second_moment(case.b1, case.b2, case.eps, group_size=s,
                                         axis=axis)
  adam = optax.scale_by_adam(case.b1, case.b2, case.eps)
  adam_state = adam.init(jnp.zeros(case.shape, jnp.float32))
  adam_update = jax.jit(adam.update)
  ref = RefAdamPM(case.shape, case.b1, case.b2, case.eps, s, axis)
  grads = gradients(case)
  ax = leaf_axis(len(case.shape), axis)
  for step, (u, state) in enumerate(run_transform(tx, grads), start=1):
    assert_close(u, ref.update(grads[step - 1]), what=f'update at step {step}')
    assert_close(state.nu, ref.nu, rtol=1e-5, what='nu')
    adam_u, adam_state = adam_update(jnp.asarray(grads[step - 1]), adam_state)
    # Pooling and the EMA are linear: AdamPM's nu is the group mean of Adam's nu.
    assert_close(state.nu, ref_groupmean(np.asarray(adam_state.nu, np.float64), s, ax),
                 rtol=1e-5, what='nu vs groupmean(adam nu)')
    assert_close(state.mu, adam_state.mu, rtol=1e-5, what='mu vs adam mu')
    if s == 1 or len(case.shape) == 0:  # no pooling: Adam exactly
      assert_close(u, adam_u, rtol=1e-5, what='group_size 1 is Adam')


# ---------------------------------------------------------------------------------------
# The pooling primitives, and the full optimizers.


@FUZZ
@given(shapes(max_ndim=3, max_len=9).flatmap(
    lambda shape: st.tuples(st.just(shape), st.integers(1, 10), axis_for(shape),
                            st.integers(0, 2**16))))
def test_groupmean_and_expand_match_reference(drawn):
  shape, s, axis, seed = drawn
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  ax = leaf_axis(len(shape), axis)
  pooled = jax.jit(functools.partial(sj.groupmean, group_size=s, axis=ax))(x)
  want = ref_groupmean(x.astype(np.float64), s, ax)
  assert pooled.shape == _pooling.grouped_shape(shape, s, ax) == want.shape
  np.testing.assert_allclose(pooled, want, rtol=1e-5, atol=1e-6)
  n = shape[ax] if ax is not None else 1
  expanded = sj.expand_groups(pooled, s, ax, n)
  np.testing.assert_array_equal(expanded, ref_expand(np.asarray(pooled), s, ax, n))


TREE_SHAPES = {'embed': (9, 6), 'norm': (6,), 'scale': (),
               'router': (6, 3), 'experts': (3, 6, 5)}


@settings(FUZZ, max_examples=10)  # each labelling compiles a whole optimizer
@given(st.fixed_dictionaries({name: st.sampled_from(['backbone', 'experts', 'router'])
                              for name in TREE_SHAPES}),
       st.floats(-6.0, 2.0), st.sampled_from([0.0, 0.1]), st.integers(0, 2**16))
def test_skewadam_with_any_labelling_matches_reference(labels, log_scale, wd, seed):
  """Whatever tier each leaf is given, the full optimizer (partition, decoupled decay on
  the tiers that opt in, learning rate) follows the per-leaf reference rules."""
  lr = 1e-2
  tiers = sj.PUBLISHED_TIERS
  rng = np.random.default_rng(seed)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in TREE_SHAPES.items()}
  grads = [{k: (10 ** log_scale * rng.standard_normal(s)).astype(np.float32)
            for k, s in TREE_SHAPES.items()} for _ in range(3)]
  tx = sj.skewadam(lr, weight_decay=wd, param_labels=labels)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  p, state = params, tx.init(params)
  refs = {k: RefTier(s, momentum=tiers[labels[k]].momentum,
                     second_moment=tiers[labels[k]].second_moment,
                     clip=tiers[labels[k]].clip_threshold) for k, s in TREE_SHAPES.items()}
  want = {k: v.astype(np.float64) for k, v in params.items()}
  for g in grads:
    p, state = step(p, state, g)
    for k in want:
      decay = wd if tiers[labels[k]].apply_weight_decay else 0.0
      want[k] = want[k] - lr * (refs[k].update(g[k]) + decay * want[k])
  for k in want:
    np.testing.assert_allclose(p[k], want[k], rtol=1e-5, atol=2e-6, err_msg=k)
