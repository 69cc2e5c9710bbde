"""Validation of static and numeric hyperparameters, with messages that name the argument.

Numeric hyperparameters are only checked when they are concrete Python or NumPy
numbers: traced values (for example under `optax.inject_hyperparams`) and schedules
pass through unchanged so that they can still be traced.
"""

from __future__ import annotations

import difflib
import numbers
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete_number(x: Any) -> bool:
  """Whether `x` is a plain (non-traced, non-callable) real number."""
  if isinstance(x, bool):
    return False
  if isinstance(x, numbers.Real):
    return True
  return isinstance(x, np.ndarray) and x.ndim == 0 and np.issubdtype(x.dtype, np.floating)


def check_beta(name: str, value: Any) -> None:
  """Raises if a concrete decay rate lies outside [0, 1)."""
  if is_concrete_number(value) and not 0.0 <= float(value) < 1.0:
    raise ValueError(f'`{name}` must be in [0, 1), got {value!r}.')


def check_learning_rate(value: Any) -> None:
  """Raises unless `value` is a number, a scalar array or a schedule (a callable)."""
  if callable(value) or is_concrete_number(value):
    return
  if isinstance(value, (jax.Array, np.ndarray, np.number)) and np.ndim(value) == 0 and (
      jnp.issubdtype(jnp.result_type(value), jnp.number)):
    return
  raise TypeError('`learning_rate` must be a float, a scalar array or an optax schedule '
                  f'(a callable of the step count), got {type(value).__name__} {value!r}.')


def check_non_negative(name: str, value: Any) -> None:
  """Raises if a concrete number is negative (or NaN)."""
  if is_concrete_number(value) and not float(value) >= 0.0:
    raise ValueError(f'`{name}` must be >= 0, got {value!r}.')


def _is_array(value: Any) -> bool:
  """Whether `value` is a (possibly traced) JAX or NumPy array rather than a Python value."""
  return isinstance(value, (jax.Array, np.ndarray))


def _static_hint(name: str) -> str:
  """How to keep a static argument static under `optax.inject_hyperparams`."""
  return (f' `optax.inject_hyperparams` turns int arguments into arrays: pass '
          f"`static_args=('{name}', ...)` to keep `{name}` a Python value, e.g. "
          "`optax.inject_hyperparams(sj.adampm, static_args=('group_size', 'axis'))`.")


def check_positive_int(name: str, value: Any) -> int:
  """Returns `value` if it is a positive Python int; raises otherwise."""
  if _is_array(value):
    raise TypeError(
        f'`{name}` must be a static positive Python int (allowed: 1, 2, 3, ...), got an '
        f'array {value!r}.' + _static_hint(name))
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(
        f'`{name}` must be a positive Python int (it is static, not a traced or '
        f'float value), got {value!r} of type {type(value).__name__}.')
  if value < 1:
    raise ValueError(f'`{name}` must be a positive int (>= 1), got {value!r}.')
  return int(value)


def check_axis(value: Any, name: str = 'axis') -> int:
  """Returns `value` if it is a Python int usable as an axis; raises otherwise."""
  if _is_array(value):
    raise TypeError(f'`{name}` must be a static Python int (negative allowed), got an '
                    f'array {value!r}.' + _static_hint(name))
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f'`{name}` must be a Python int (negative allowed), got {value!r}.')
  return int(value)


def check_float_dtype(name: str, value: Any) -> Any:
  """`value` as a floating `jnp.dtype` (None passes through); raises otherwise.

  Arrays are rejected: `optax.inject_hyperparams` treats a dtype class such as
  `jnp.float32` as a schedule and would pass its value (an array) instead.
  """
  if value is None:
    return None
  if _is_array(value):
    raise TypeError(
        f'`{name}` must be a floating dtype or None, got an array {value!r}. '
        '`optax.inject_hyperparams` treats dtype classes such as `jnp.float32` as '
        f"schedules: pass `static_args=('{name}', ...)` or the dtype's name as a string.")
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise TypeError(f'`{name}` must be a floating dtype (e.g. jnp.float32, '
                    f"jnp.bfloat16, 'float32') or None, got {value!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f'`{name}` must be a floating dtype (e.g. jnp.float32, '
                    f"jnp.bfloat16, 'float32') or None, got {value!r}.")
  return dtype


def did_you_mean(value: Any, allowed: Iterable[str]) -> str:
  """' (did you mean 'x'?)' for the closest of `allowed`, or '' if none is close."""
  if not isinstance(value, str):
    return ''
  close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.6)
  return f' (did you mean {close[0]!r}?)' if close else ''


def check_choice(name: str, value: Any, allowed: tuple[str, ...], also: str = '') -> str:
  """Returns `value` if it is one of `allowed`; raises otherwise."""
  try:
    ok = value in allowed
  except TypeError:  # unhashable or uncomparable
    ok = False
  if not ok:
    extra = f'; {also}' if also else ''
    raise ValueError(f'`{name}` must be one of {allowed}, got {value!r}'
                     f'{did_you_mean(value, allowed)}{extra}.')
  return value


def check_float_leaf(path: str, dtype: Any, where: str) -> None:
  """Raises a clear error for parameter leaves that the rules do not support."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(
        f'{where}: parameter {path} has complex dtype {dtype}; only real floating '
        'parameters are supported (split complex parameters into real and imaginary '
        'parts, or exclude them with a mask).')
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f'{where}: parameter {path} has non-floating dtype {dtype}; mask integer or '
        'boolean leaves out: give the optimizer only the floating parameters (e.g. '
        '`nnx.Optimizer(model, tx, wrt=nnx.Param)`), or wrap it as `optax.masked(tx, '
        'mask)` with `mask` False on this leaf.')


def check_transform(tx: Any) -> None:
  """Raises unless `tx` looks like an optax GradientTransformation (init and update)."""
  if not (callable(getattr(tx, 'init', None)) and callable(getattr(tx, 'update', None))):
    raise TypeError('`tx` must be an optax.GradientTransformation (e.g. sj.skewadam(3e-4) '
                    f'or optax.adamw(1e-3)), got {type(tx).__name__} {tx!r}.')
