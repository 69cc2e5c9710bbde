"""Validation of static and numeric hyperparameters, with messages that name the argument.

Numeric hyperparameters are only checked when they are concrete Python, NumPy or JAX
numbers: traced values (for example under `optax.inject_hyperparams`) and schedules
pass through unchanged so that they can still be traced.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Callable, Iterable, Mapping, Optional

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


def _is_scalar_number(value: Any) -> bool:
  """Whether `value` is a real number or a 0-d numeric array (possibly traced)."""
  if is_concrete_number(value):
    return True
  return isinstance(value, (jax.Array, np.ndarray, np.number)) and np.ndim(value) == 0 and (
      jnp.issubdtype(jnp.result_type(value), jnp.number)) and not jnp.issubdtype(
          jnp.result_type(value), jnp.complexfloating)


def concrete_value(value: Any) -> Optional[float]:
  """The value of a concrete real scalar of any Python, NumPy or JAX type (a 0-d integer
  array included), or None for a tracer, a schedule or anything not a real scalar.

  Range checks read this rather than `is_concrete_number`, so that no spelling of a
  number (`np.array(2)`, `jnp.asarray(2.0)`, `np.int64(2)`) slips past them.
  """
  if isinstance(value, (bool, np.bool_)) or isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
    dtype = np.dtype(value.dtype)
    if np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating):
      try:
        return float(value)
      except (TypeError, jax.errors.ConcretizationTypeError):  # not concrete after all
        return None
  return None


def check_scalar(name: str, value: Any, schedule: bool = False) -> None:
  """Raises unless `value` is a real number or a scalar array (or, if allowed, a schedule).

  Arrays and tracers pass, so that `optax.inject_hyperparams` can inject the value.
  """
  if _is_scalar_number(value) or (schedule and callable(value)):
    return
  allowed = 'a float, a scalar array or an optax schedule (a callable of the step count)' if (
      schedule) else 'a float or a scalar array'
  raise TypeError(f'`{name}` must be {allowed}, got {type(value).__name__} {value!r}.')


def check_beta(name: str, value: Any) -> None:
  """Raises unless `value` is a scalar; raises if a concrete one lies outside [0, 1)."""
  check_scalar(name, value)
  v = concrete_value(value)
  if v is not None and not 0.0 <= v < 1.0:
    raise ValueError(f'`{name}` must be in [0, 1), got {value!r}.')


def check_learning_rate(value: Any) -> None:
  """Raises unless `value` is a number, a scalar array or a schedule (a callable)."""
  check_scalar('learning_rate', value, schedule=True)
  v = concrete_value(value)
  if v is not None and not math.isfinite(v):
    raise ValueError(f'`learning_rate` must be finite, got {value!r}.')


def check_non_negative(name: str, value: Any, schedule: bool = False) -> None:
  """Raises unless `value` is a scalar (or a schedule, if allowed); raises if a concrete
  one is negative (or NaN)."""
  check_scalar(name, value, schedule)
  v = concrete_value(value)
  if v is not None and not v >= 0.0:
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
  """Raises a clear error for complex parameter leaves, which the rules do not support.

  Integer and boolean leaves pass: they keep no state and get a zero update, as
  `optax.adamw` accepts them (see `transforms.per_leaf.trains`).
  """
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(
        f'{where}: parameter {path} has complex dtype {dtype}; only real floating '
        'parameters are supported (split complex parameters into real and imaginary '
        'parts, or exclude them with a mask).')


def is_transform(tx: Any) -> bool:
  """Whether `tx` looks like an optax GradientTransformation (init and update)."""
  return callable(getattr(tx, 'init', None)) and callable(getattr(tx, 'update', None))


def _short_repr(value: Any, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + '...'


def check_transform_first(tx: Any, params: Any, call: str) -> None:
  """Raises a TypeError naming `tx` unless it looks like an optax GradientTransformation.

  Every report takes the optimizer first, as optax does; where the optimizer came as
  `params` instead, the message says the two are swapped.

  Args:
    tx: the argument that must be the optimizer.
    params: the call's params argument (only read to tell a swap apart).
    call: the call with its argument names in order, e.g. 'sj.memory_report(tx, params)'.
  """
  if is_transform(tx):
    return
  if is_transform(params):
    raise TypeError(f'`tx` must be the optimizer, got {type(tx).__name__}, and `params` '
                    f'got the optimizer: the arguments are swapped. Call {call}, the '
                    'optimizer first, as optax does.')
  check_transform(tx)


def check_transform(tx: Any) -> None:
  """Raises unless `tx` looks like an optax GradientTransformation (init and update)."""
  if is_transform(tx):
    return
  raise TypeError('`tx` must be an optax.GradientTransformation (e.g. sj.skewadam(3e-4) '
                  f'or optax.adamw(1e-3)), got {type(tx).__name__} {_short_repr(tx)}.')


def check_update_order(updates: Any, state: Any, params: Any,
                       is_state: Callable[[Any], bool], where: str) -> None:
  """Raises a TypeError naming `state` and `params` if `tx.update` got them swapped.

  `tx.update(updates, params, state)` otherwise fails deep inside (optax's chain
  counts the params' entries as states: "The number of updates and states has to be
  the same in chain!"), naming neither argument. Only types and tree structures are
  read, at trace time: nothing runs in the compiled step, and a `state` that
  `is_state` accepts costs one isinstance check.

  Args:
    updates: the `updates` argument.
    state: the `state` argument.
    params: the `params` argument (None if not given).
    is_state: whether a value is this transform's state (its type, a chain's tuple).
    where: the transform, for the message, e.g. 'sj.skewadam'.
  """
  if is_state(state):
    return
  params_is_state = params is not None and is_state(params)
  state_is_params = (jax.tree_util.tree_structure(state)
                     == jax.tree_util.tree_structure(updates))
  if not (params_is_state or state_is_params):
    return  # not a swap: the transform's own checks say what else is wrong
  if params_is_state:
    found = 'the optimizer state as `params`: `state` and `params` are swapped'
  else:
    found = ('a `state` with the tree structure of the updates (the params?), not the '
             'optimizer state: `state` and `params` are swapped, or `state` is missing')
  raise TypeError(f'{where}: `tx.update` got {found}. The order is '
                  '`tx.update(updates, state, params)`, with `state` from `tx.init(params)` '
                  'or the previous update.')


def _shapes(tree: Any) -> Any:
  """`tree` with each array-like leaf as its shape tuple (for comparisons and messages)."""
  return jax.tree.map(lambda a: tuple(a.shape) if hasattr(a, 'shape') else a, tree)


def _shapes_and_dtypes(tree: Any) -> Any:
  """`tree` with each array-like leaf as 'dtype[shape]' (for comparisons and messages)."""
  return jax.tree.map(
      lambda a: f'{jnp.dtype(a.dtype)}{list(a.shape)}' if hasattr(a, 'shape') else a, tree)


def check_grad_shape(path: str, grad_shape: tuple[int, ...], expected: tuple[int, ...],
                     what: str) -> None:
  """Raises if a gradient's shape is not its parameter's (`what` has `expected`).

  Checked at trace time (shapes are static): a gradient of another shape would
  otherwise broadcast against the state into a full-size update, silently.
  """
  if tuple(grad_shape) != tuple(expected):
    raise ValueError(
        f'The gradient of parameter {path} has shape {tuple(grad_shape)}, but {what} has '
        f'shape {tuple(expected)}: gradients (updates) must have their parameters\' shapes.')


def check_grad_fits_stats(path: str, grad_shape: tuple[int, ...], stats: Any, expected: Any,
                          error: Optional[Exception] = None) -> None:
  """Raises if `stats` (a leaf's state) do not have the shapes a gradient's would have.

  `expected` are the (abstract) statistics the leaf's estimator makes for a parameter
  of `grad_shape`, or None if it could not make any (`error` says why).
  """
  if expected is not None and _shapes(stats) == _shapes(expected):
    return
  message = (f'The gradient of parameter {path} has shape {tuple(grad_shape)}, which does '
             f'not fit its optimizer state (statistics of shapes {_shapes(stats)}')
  if expected is not None:
    message += f'; a parameter of the gradient\'s shape has {_shapes(expected)}'
  message += '): gradients (updates) must have their parameters\' shapes.'
  if error is not None:
    raise ValueError(message) from error
  raise ValueError(message)


def _estimator_name(estimator: Any) -> str:
  name = getattr(estimator, 'name', None)
  kind = type(estimator).__name__
  return f'{name!r} ({kind})' if isinstance(name, str) and name != kind else kind


def check_estimator_init(estimator: Any, path: str, stats: Any,
                         fields: tuple[str, ...]) -> None:
  """Raises unless a second-moment estimator's `init` gave a dict keyed by `fields`."""
  if not isinstance(stats, dict) or any(k not in fields for k in stats):
    raise TypeError(
        f'Second-moment estimator {_estimator_name(estimator)}: `init` for parameter '
        f'{path} must return a dict whose keys are among {fields}, got '
        f'{_short_repr(_shapes_and_dtypes(stats), 200)}.')


def check_estimator_update(estimator: Any, path: str, grad_shape: tuple[int, ...], u: Any,
                           stats: Any, new_stats: Any) -> None:
  """Raises unless an estimator's `update` kept its statistics' structure, shapes and
  dtypes (the state must be the same at every step) and gave `u` the gradient's shape.

  Runs at trace time; a mismatch would otherwise fail deep inside `jit`, `lax.scan` or
  a checkpoint restore, or broadcast silently.
  """
  name = _estimator_name(estimator)
  if not (hasattr(u, 'shape') and hasattr(u, 'dtype')):
    raise TypeError(f'Second-moment estimator {name}: `update` for parameter {path} must '
                    f'return an array `u` first, got {type(u).__name__}.')
  if tuple(u.shape) != tuple(grad_shape):
    raise ValueError(
        f'Second-moment estimator {name}: `update` for parameter {path} returned an update '
        f'of shape {tuple(u.shape)}, but the gradient has shape {tuple(grad_shape)}; the '
        'update must have the gradient\'s shape.')
  if not jnp.issubdtype(u.dtype, jnp.floating):
    raise TypeError(f'Second-moment estimator {name}: `update` for parameter {path} returned '
                    f'an update of non-floating dtype {jnp.dtype(u.dtype)}.')
  before, after = _shapes_and_dtypes(dict(stats)), (
      _shapes_and_dtypes(dict(new_stats)) if isinstance(new_stats, Mapping) else None)
  if (after is None or jax.tree.structure(before) != jax.tree.structure(after)
      or before != after):
    raise ValueError(
        f'Second-moment estimator {name}: `update` for parameter {path} returned statistics '
        f'{_short_repr(after if after is not None else new_stats, 300)}, but its state holds '
        f'{_short_repr(before, 300)} (as `init` made them); `update` must return statistics '
        'of the same structure, shapes and dtypes (cast them back to their stored dtype).')
