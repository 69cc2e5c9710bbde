"""Every tier and AdamPM configuration reproduces its frozen 3-step outputs.

The arrays in `tests/data/frozen_3_steps.npz` were written by `tests/support/frozen_cases.py`
before the estimators moved into their own modules; refactoring must not change them
by more than the few ulp that separate two CPUs (`tests/support/ulp.py`). The last tests check
the comparison itself: it accepts outputs moved by 2 ulp and rejects a changed rule.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax as sj
from frozen_cases import DATA, cases, run_native
from ulp import assert_within_ulp

FROZEN = np.load(DATA)
CASES = dict(cases())


def _expected(name: str, dtype: str) -> dict[str, np.ndarray]:
  prefix = f'{name}/{dtype}/'
  expected = {k[len(prefix):]: FROZEN[k] for k in FROZEN.files if k.startswith(prefix)}
  assert expected, f'no frozen arrays for {prefix}'
  return expected


def _compare(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], prefix: str):
  assert sorted(got) == sorted(expected)
  for key, value in expected.items():
    assert_within_ulp(got[key].astype(np.float32), value, got[key].dtype,
                      err_msg=f'{prefix}{key}')


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('name', list(CASES))
def test_outputs_match_frozen_within_ulp(name, dtype):
  got = run_native(CASES[name], jnp.dtype(dtype))
  _compare(got, _expected(name, dtype), f'{name}/{dtype}/')


def _nudge(x: np.ndarray, ulps: int, seed: int) -> np.ndarray:
  """`x` with every float element moved by up to `ulps` ulp of its dtype, either way."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  rng = np.random.default_rng(seed)
  out = x.copy()
  for _ in range(ulps):
    step = rng.integers(-1, 2, x.shape)
    out = np.where(step > 0, np.nextafter(out, np.inf, dtype=out.dtype),
                   np.where(step < 0, np.nextafter(out, -np.inf, dtype=out.dtype), out))
    out = out.astype(x.dtype)
  return out


NAME = 'tier-m1-factored-floor-clip0.05'


def test_comparison_accepts_outputs_moved_by_two_ulp():
  got = run_native(CASES[NAME], jnp.float32)
  moved = {k: _nudge(v, 2, seed=i) for i, (k, v) in enumerate(sorted(got.items()))}
  assert any(not np.array_equal(moved[k], got[k]) for k in got)
  _compare(moved, _expected(NAME, 'float32'), 'moved by 2 ulp/')


@pytest.mark.parametrize('change', ['b2', 'b1', 'eps', 'clip'])
def test_comparison_rejects_a_changed_rule(change):
  tier = dict(momentum=True, second_moment='factored', eps_mode='floor', clip_threshold=0.05,
              group_size=3)
  kwargs = {'b2': dict(b2=0.9991), 'b1': dict(b1=0.9001), 'eps': dict(eps=1.1e-8),
            'clip': {}}[change]
  if change == 'clip':
    tier['clip_threshold'] = 0.0501
  tx = sj.scale_by_tiered_adam(tier=sj.Tier(**tier), **kwargs)
  with pytest.raises(AssertionError, match='ulp'):
    _compare(run_native(tx, jnp.float32), _expected(NAME, 'float32'), f'{change} changed/')
