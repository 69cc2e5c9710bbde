"""Distances in units in the last place (ulp), for fixtures recorded on another CPU.

XLA compiles the same program differently for different CPUs (vector width, fused
multiply-add, the order of a reduction's partial sums), so float32 results recorded on
one machine differ from another's by a few ulp: measured 4 ulp at most over every
frozen case on an AMD EPYC (AVX2), against arrays recorded on another x86-64 machine.
A changed update rule moves results by orders of magnitude more (changing `b2` in its
fourth decimal moves the first step's bias correction by 10%), so a bound of a few ulp
keeps the fixtures as strict as a rule test can be while holding on any CPU.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# 8 ulp: twice the worst difference measured between two CPUs, and 1e-6 relative,
# 1e5 times below what the smallest changed rule in test_frozen.py produces.
FLOAT32_ULPS = 8
# bfloat16 leaves are rounded from float32 maths, so a few-ulp float32 difference can
# flip one rounding; a flipped momentum feeds the next steps, so allow 2.
BFLOAT16_ULPS = 2


def _ordered(x: np.ndarray) -> np.ndarray:
  """Integers whose order and distance follow the floats' (so -0.0 == +0.0)."""
  bits = {2: np.int16, 4: np.int32}[x.dtype.itemsize]
  i = x.view(bits).astype(np.int64)
  sign = np.int64(1) << (8 * x.dtype.itemsize - 1)
  return np.where(i < 0, -(i & (sign - 1)), i)


def ulp_distance(got: np.ndarray, want: np.ndarray, dtype) -> np.ndarray:
  """Elementwise distance in ulp of `dtype` (float32 or bfloat16) between two arrays."""
  dtype = np.dtype(dtype)
  return np.abs(_ordered(np.asarray(got).astype(dtype)) - _ordered(np.asarray(want).astype(dtype)))


def assert_within_ulp(got, want, dtype, *, ulps: int | None = None, err_msg: str = '') -> None:
  """Fails unless `got` is within `ulps` ulp of `want` in `dtype`, elementwise.

  An element near zero that is the difference of larger terms (a momentum whose signs
  alternate) carries the rounding of those terms, so it may also be within `ulps` ulp
  of the leaf's largest magnitude (measured: at most 1.5 such ulp between two CPUs).
  Integer arrays and non-finite values must be equal.
  """
  dtype = np.dtype(dtype)
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, f'{err_msg}: shape {got.shape} != {want.shape}'
  if not np.issubdtype(dtype, np.floating) and dtype != ml_dtypes.bfloat16:
    np.testing.assert_array_equal(got, want, err_msg=err_msg)
    return
  if ulps is None:
    ulps = BFLOAT16_ULPS if dtype == ml_dtypes.bfloat16 else FLOAT32_ULPS
  finite = np.isfinite(want)
  np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f'{err_msg}: non-finite')
  np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=f'{err_msg}: non-finite')
  g, w = got[finite].astype(np.float32), want[finite].astype(np.float32)
  if not g.size:
    return
  own = ulp_distance(g, w, dtype) <= ulps
  scale = np.max(np.abs(w)).astype(dtype)
  near = np.abs(g - w) <= ulps * np.spacing(scale).astype(np.float32)
  bad = ~(own | near)
  if bad.any():
    i = np.flatnonzero(bad)
    raise AssertionError(
        f'{err_msg}: {bad.sum()} of {bad.size} elements differ by more than {ulps} ulp '
        f'({dtype}); worst {ulp_distance(g, w, dtype).max()} ulp; first: got {g[i[0]]!r}, '
        f'want {w[i[0]]!r}')
