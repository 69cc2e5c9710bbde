"""The one warning the default route gives when names and shapes leave a guess.

The labeler and the batch axes report what they are unsure of as lines (the paths, why,
and the rules that settle each: `unsure.findings`, the ambiguous stacks of `axes`).
Within one call of the library (`moe_param_labels`, `moe_batch_axes`, a `skewadam`'s
`init` or `update`, `label_table`, `memory_report`), which may label the same tree
several times, the lines are collected and given as **one** `UnsureLabelWarning` when
the call returns (`one_warning`), each line once. The warning is attributed to the
caller's line (the first frame outside this library and the frameworks it runs under),
and it names the fix that reads the structure from the computation,
`sj.trace_structure`, with code that runs as printed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import warnings
from typing import Any, Callable, Iterator, Optional, TypeVar

_F = TypeVar('_F', bound=Callable[..., Any])

# Modules whose frames are never the caller's line: this library, and the frameworks
# that call into it (optax's chain, jax's tracing, Flax and Equinox wrappers).
_INTERNAL = frozenset({'skewadam_jax', 'jax', 'jaxlib', 'optax', 'flax', 'equinox', 'chex',
                       'contextlib', 'functools'})

# The fix, as code the user runs with their own loss (or forward) function and a batch.
FIX = ('The labels of a model are read from what it computes, whatever its leaves and '
       'containers are called: call sj.trace_structure with your loss (or forward) '
       'function and an example batch (arrays or jax.ShapeDtypeStruct):\n\n'
       '    trace = sj.trace_structure(loss_fn, params, batch)\n'
       '    tx = sj.skewadam(learning_rate, param_labels=trace)\n\n'
       "(the trace gives the labels, the batch axes and, to a policy with a 'hidden' "
       'tier such as tiers=sj.MUON_TIERS, the hidden matrices by what each leaf does), '
       'or settle each leaf with the rule given above, in '
       "sj.make_labeler([('<pattern>', '<tier>')]) (strict=True makes this an error).")

# The lines collected within the outermost library call, or None outside one.
_PENDING: contextvars.ContextVar[Optional[list[str]]] = contextvars.ContextVar(
    'skewadam_jax_unsure_lines', default=None)


class UnsureLabelWarning(UserWarning):
  """Some leaves' tiers are guesses: trace the structure (`sj.trace_structure`), add
  rules (`make_labeler`), or pass `strict=True`."""


@contextlib.contextmanager
def one_warning() -> Iterator[None]:
  """Within: unsure lines are collected, and warned once when the outermost one exits."""
  if _PENDING.get() is not None:
    yield
    return
  token = _PENDING.set([])
  try:
    yield
    lines = _PENDING.get()
  finally:
    _PENDING.reset(token)
  if lines:
    _warn(lines)


@contextlib.contextmanager
def silenced() -> Iterator[None]:
  """Within: unsure lines are dropped (a second look at a tree already reported)."""
  token = _PENDING.set([])
  try:
    yield
  finally:
    _PENDING.reset(token)


def reported_once(fn: _F) -> _F:
  """`fn` within `one_warning`: one warning per call, however often it labels."""

  @functools.wraps(fn)
  def call(*args: Any, **kwargs: Any) -> Any:
    with one_warning():
      return fn(*args, **kwargs)

  return call  # type: ignore[return-value]


def report(lines: list[str], strict: bool) -> None:
  """Unsure findings: a ValueError if `strict`, else lines of the call's one warning."""
  if not lines:
    return
  if strict:
    raise ValueError('skewadam_jax could not label these parameters with confidence '
                     f'(strict=True):\n{_body(lines)}\nPass rules as '
                     "param_labels=sj.make_labeler([('<pattern>', '<tier>')], strict=True), "
                     'or read the labels from the computation with sj.trace_structure.')
  pending = _PENDING.get()
  if pending is None:
    _warn(lines)
  else:
    pending.extend(line for line in lines if line not in pending)


def _body(lines: list[str]) -> str:
  shown = lines[:10] + ([f'... and {len(lines) - 10} more'] if len(lines) > 10 else [])
  return '\n'.join(f'  - {line}' for line in shown)


def _warn(lines: list[str]) -> None:
  """One `UnsureLabelWarning` listing `lines`, attributed to the caller's line."""
  message = ('skewadam_jax labels: names and shapes leave these parameters labelled by a '
             f'guess:\n{_body(lines)}\n{FIX}')
  frame = inspect.currentframe()
  while frame is not None and frame.f_globals.get('__name__', '').split('.')[0] in _INTERNAL:
    frame = frame.f_back
  if frame is None:
    warnings.warn(message, UnsureLabelWarning, stacklevel=2)
    return
  module_globals = frame.f_globals
  warnings.warn_explicit(message, UnsureLabelWarning, frame.f_code.co_filename,
                         frame.f_lineno, module=module_globals.get('__name__'),
                         registry=module_globals.setdefault('__warningregistry__', {}),
                         module_globals=module_globals)
