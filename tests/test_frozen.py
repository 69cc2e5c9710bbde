"""Every tier and AdamPM configuration reproduces its frozen 3-step outputs bit for bit.

The arrays in `tests/data/frozen_3_steps.npz` were written by `tests/frozen_cases.py`
before the estimators moved into their own modules; refactoring must not change a bit.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from frozen_cases import DATA, cases, run

FROZEN = np.load(DATA)
CASES = dict(cases())


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('name', list(CASES))
def test_outputs_are_bitwise_frozen(name, dtype):
  got = run(CASES[name], jnp.dtype(dtype))
  prefix = f'{name}/{dtype}/'
  expected = {k[len(prefix):]: FROZEN[k] for k in FROZEN.files if k.startswith(prefix)}
  assert expected, f'no frozen arrays for {prefix}'
  assert sorted(got) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(got[key], value, err_msg=f'{prefix}{key}')
