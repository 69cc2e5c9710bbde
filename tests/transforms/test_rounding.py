"""Stochastic rounding to bfloat16: unbiased, deterministic per key, exact on bf16 values.

The unbiasedness check has a bound that round-to-nearest (and truncation) cannot meet,
and a test shows that they fail it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj

COPIES = 1 << 15  # rounded copies of each value
# bf16 neighbours: bases that are bf16 values (either sign, several binades), and
# fractions of the gap to the next bf16 value above (in magnitude).
BASES = np.asarray(
    jnp.asarray([1.0, -1.0, 3.0, -0.0058, 1.5e-3, 7.5e5, -2.0**-60, 2.0**100, 1e-30],
                jnp.float32).astype(jnp.bfloat16), np.float32)
FRACTIONS = np.array([0.1, 0.3, 0.5, 0.77, 0.9])


def _ulp(b: np.ndarray) -> np.ndarray:
  """Gap between bf16 value `b` and the next bf16 value away from zero (float64)."""
  e = np.floor(np.log2(np.abs(b.astype(np.float64))))
  return 2.0 ** (e - 7)


def _between_neighbours():
  """float32 values strictly between two bf16 neighbours, and those neighbours."""
  b = np.repeat(BASES, len(FRACTIONS)).astype(np.float64)
  f = np.tile(FRACTIONS, len(BASES))
  step = np.sign(b) * _ulp(b)
  x = (b + f * step).astype(np.float32)
  return x, b, b + step


def bias_in_ulps(rounded: np.ndarray, x: np.ndarray) -> np.ndarray:
  """Per value: |mean of the rounded copies - x| in units of the bf16 gap."""
  mean = np.asarray(rounded, np.float64).mean(axis=-1)
  return np.abs(mean - x.astype(np.float64)) / _ulp(x)


# An unbiased rounding has a per-copy standard deviation of at most 0.5 ulp, so the mean
# of COPIES copies lies within 5 * 0.5 / sqrt(COPIES) ulp (about 0.014) of x with
# overwhelming probability; round-to-nearest is off by min(f, 1 - f) >= 0.1 ulp here.
BIAS_BOUND = 5 * 0.5 / np.sqrt(COPIES)


def _stochastic_copies(x, key=None):
  key = jax.random.key(0) if key is None else key
  wide = jnp.broadcast_to(jnp.asarray(x)[:, None], (len(x), COPIES))
  return jax.jit(sj.stochastic_round)(wide, key)


def test_stochastic_round_is_unbiased():
  x, lower, upper = _between_neighbours()
  rounded = _stochastic_copies(x)
  assert rounded.dtype == jnp.bfloat16
  r = np.asarray(rounded, np.float64)
  # Every copy is one of the two neighbours...
  assert np.all((r == lower[:, None]) | (r == upper[:, None]))
  # ...taken with probability equal to the distance from the other one...
  up = (r == upper[:, None]).mean(axis=1)
  frac = (x.astype(np.float64) - lower) / (upper - lower)
  np.testing.assert_allclose(up, frac, atol=5 * 0.5 / np.sqrt(COPIES))
  # ...so that the mean is x.
  assert np.max(bias_in_ulps(r, x)) < BIAS_BOUND


@pytest.mark.parametrize('rounding', ['nearest', 'truncate'])
def test_biased_roundings_fail_the_unbiasedness_check(rounding):
  x, _, _ = _between_neighbours()
  wide = np.broadcast_to(x[:, None], (len(x), COPIES))
  if rounding == 'nearest':
    rounded = jnp.asarray(wide).astype(jnp.bfloat16)
  else:  # cut the low 16 bits: round toward zero
    bits = np.ascontiguousarray(wide).view(np.uint32) & np.uint32(0xFFFF0000)
    rounded = bits.view(np.float32)
  assert np.min(bias_in_ulps(np.asarray(rounded, np.float64), x)) >= 0.1
  assert np.max(bias_in_ulps(np.asarray(rounded, np.float64), x)) > BIAS_BOUND


def test_stochastic_round_is_deterministic_per_key():
  x, _, _ = _between_neighbours()
  a = _stochastic_copies(x, jax.random.key(1))
  b = _stochastic_copies(x, jax.random.key(1))
  c = _stochastic_copies(x, jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert np.mean(np.asarray(a) != np.asarray(c)) > 0.1
  # Old-style uint32 keys work too.
  legacy = jax.jit(sj.stochastic_round)(jnp.asarray(x), jax.random.PRNGKey(3))
  np.testing.assert_array_equal(
      legacy, jax.jit(sj.stochastic_round)(jnp.asarray(x), jax.random.PRNGKey(3)))


def test_stochastic_round_keeps_bf16_values_and_non_finite_values():
  exact = np.array([0.0, -0.0, 1.0, -3.0, 2.0**-100, 65280.0, np.inf, -np.inf, np.nan],
                   np.float32)
  for seed in range(4):
    r = np.asarray(sj.stochastic_round(jnp.asarray(exact), jax.random.key(seed)),
                   np.float32)
    np.testing.assert_array_equal(r, exact)
    assert np.signbit(r[1])  # -0.0 keeps its sign


def test_stochastic_round_to_other_dtypes_is_a_plain_cast():
  x = jnp.asarray([1.0 + 2.0**-12, -3.3, 1e-3], jnp.float32)
  for dtype in (jnp.float32, jnp.float16):
    got = sj.stochastic_round(x, jax.random.key(0), dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, x.astype(dtype))


# ---------------------------------------------------------------------------------------
# apply_updates_stochastic.


def test_small_updates_to_bf16_weights_accumulate_instead_of_vanishing():
  """50 updates of 1/8 of the bf16 gap at 1.0: round-to-nearest loses every one of them,
  stochastic rounding keeps their sum in expectation."""
  n, steps, u = 4096, 50, 2.0**-10  # the gap at 1.0 is 2**-7
  params = {'w': jnp.ones((n,), jnp.bfloat16), 'b': jnp.ones((n,), jnp.float32)}
  updates = {'w': jnp.full((n,), u, jnp.float32), 'b': jnp.full((n,), u, jnp.float32)}
  apply = jax.jit(sj.apply_updates_stochastic)
  apply_nearest = jax.jit(optax.apply_updates)
  nearest = params
  stochastic = params
  for k in jax.random.split(jax.random.key(0), steps):
    stochastic = apply(stochastic, updates, k)
    nearest = apply_nearest(nearest, updates)
  assert stochastic['w'].dtype == jnp.bfloat16 and stochastic['b'].dtype == jnp.float32
  np.testing.assert_array_equal(nearest['w'], 1.0)  # every update lost
  mean = float(np.mean(np.asarray(stochastic['w'], np.float64)))
  # Per element the result has standard deviation <= sqrt(steps) * 0.5 gap; the mean
  # over n elements is within 5 of its standard errors of 1 + steps * u.
  bound = 5 * np.sqrt(steps) * 0.5 * 2.0**-7 / np.sqrt(n)
  assert abs(mean - (1 + steps * u)) < bound, (mean, 1 + steps * u, bound)
  # float32 leaves are applied exactly as optax does.
  np.testing.assert_array_equal(stochastic['b'], nearest['b'])


def test_apply_updates_stochastic_is_deterministic_and_independent_per_leaf():
  x = jnp.linspace(1.0, 2.0, 1000, dtype=jnp.float32).astype(jnp.bfloat16)
  params = {'a': x, 'b': x, 'c': None}
  updates = {'a': jnp.full(x.shape, 1e-3), 'b': jnp.full(x.shape, 1e-3), 'c': None}
  one = sj.apply_updates_stochastic(params, updates, jax.random.key(7))
  two = sj.apply_updates_stochastic(params, updates, jax.random.key(7))
  jax.tree.map(np.testing.assert_array_equal, one, two)
  assert one['c'] is None
  # The two identical leaves get independent noise.
  assert np.mean(np.asarray(one['a']) != np.asarray(one['b'])) > 0.1


def test_apply_updates_stochastic_matches_optax_on_non_bf16_leaves():
  params = {'f32': jnp.linspace(-1, 1, 7), 'f16': jnp.linspace(-1, 1, 7).astype(jnp.float16)}
  updates = jax.tree.map(lambda p: jnp.full(p.shape, 1e-4, p.dtype), params)
  got = sj.apply_updates_stochastic(params, updates, jax.random.key(0))
  want = optax.apply_updates(params, updates)
  for k in params:
    assert got[k].dtype == want[k].dtype
    np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize('fraction', [0.25, 0.75])
def test_values_in_the_last_bf16_gap_round_to_inf_with_their_fraction(fraction):
  # bf16's largest finite value and the gap above it (Inf, where the next value would
  # be); float32 values inside that gap round up, to Inf, with their fraction of it.
  top = float(jnp.finfo(jnp.bfloat16).max)
  gap = 2.0 ** (127 - 7)
  x = jnp.full((COPIES,), top + fraction * gap, jnp.float32)
  r = np.asarray(sj.stochastic_round(x, jax.random.key(0)), np.float32)
  assert set(np.unique(r)) == {np.float32(top), np.float32(np.inf)}
  # 5 standard deviations of the binomial mean over COPIES draws.
  sigma = np.sqrt(fraction * (1 - fraction) / COPIES)
  assert abs(np.mean(np.isinf(r)) - fraction) < 5 * sigma
