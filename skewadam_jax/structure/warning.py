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
from typing import Any, Callable, Iterator, NamedTuple, Optional, TypeVar

_F = TypeVar('_F', bound=Callable[..., Any])
_NO_POLICY = object()  # `reported_once` without a policy: the caller's is kept

# Modules whose frames are never the caller's line: this library, and the frameworks
# that call into it (optax's chain, jax's tracing, Flax and Equinox wrappers).
_INTERNAL = frozenset({'skewadam_jax', 'jax', 'jaxlib', 'optax', 'flax', 'equinox', 'chex',
                       'contextlib', 'functools'})

# What the rule of a line is, for the fix's last paragraph.
_RULES = ("the rule its line above gives (a ('<pattern>', '<tier>') rule of "
          'sj.make_labeler, or a batch-axes rule of sj.moe_batch_axes)')


class Policy(NamedTuple):
  """The user's `tiers` argument, as the fix prints it (`transforms.presets.policy_of`
  renders it: this layer does not know the presets)."""
  argument: str  # 'tiers=sj.MUON_CODED_TIERS, ', 'tiers=<your tiers>, ' or '' (default)
  hidden: bool  # whether the policy has a 'hidden' tier (the fix's labeler then keeps it)


def fix(policy: Optional[Policy] = None) -> str:
  """The fix the warning prints, as code that keeps the user's `policy` (their `tiers`
  argument; None: the call that labels is not a `skewadam`'s, whose tiers are then
  unknown) and names the rule it refers to."""
  known = policy is not None
  tiers = policy.argument if known else ''
  hidden = known and policy.hidden
  labeler = "sj.make_labeler([('<pattern>', '<tier>')])"
  rules = f'lambda p: sj.hidden_param_labels(p, {labeler})' if hidden else labeler
  unknown = ('' if known else ' (add your own tiers=..., if your optimizer has them: '
             'the trace serves every policy)')
  return ('The labels of a model are read from what it computes, whatever its leaves and '
          'containers are called: call sj.trace_structure with your loss (or forward) '
          'function, the params (Flax NNX, Equinox: the model itself, with a loss of the '
          'model) and an example batch (arrays or jax.ShapeDtypeStruct), and pass the trace '
          f'to your optimizer{unknown}:\n\n'
          '    trace = sj.trace_structure(loss_fn, params, batch)\n'
          f'    tx = sj.skewadam(learning_rate, {tiers}param_labels=trace)\n\n'
          '(the trace gives the labels, the batch axes, the hidden matrices of a policy '
          "with a 'hidden' tier, and, to the leaves it cannot decide, the safe rule: "
          f'{SAFE_RULE}), or settle each leaf with {_RULES}:\n\n'
          f'    tx = sj.skewadam(learning_rate, {tiers}param_labels={rules})\n\n'
          '(strict=True in sj.make_labeler makes this warning an error).')


# The treatment every policy gives the leaves the analysis leaves undecided
# (`transforms.tier.undecided_tier`), in words.
SAFE_RULE = ('no orthogonalisation and no statistic shared across any of their axes (an '
             'exact second moment, an uncoded momentum, no update clip), under every '
             'policy')

# The `tiers` argument of the `skewadam` whose call is labelling, as a 1-tuple (None:
# not within one), for the fix.
_POLICY: contextvars.ContextVar[Optional[tuple[Any]]] = contextvars.ContextVar(
    'skewadam_jax_policy', default=None)
# The policies of the `skewadam`s that labelled within the outermost call (`one_warning`).
_CALL_POLICIES: contextvars.ContextVar[Optional[list[tuple[Any]]]] = contextvars.ContextVar(
    'skewadam_jax_call_policies', default=None)
# The lines already warned in this process (under the filters that show a warning once
# per place: 'default', 'module', 'once'), so that a cause is warned once, not at every
# `label_table`, `init` and jit trace.
_WARNED: set[str] = set()


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
  policies = _CALL_POLICIES.set([])
  try:
    yield
    lines = _PENDING.get()
    seen = _CALL_POLICIES.get()
  finally:
    _PENDING.reset(token)
    _CALL_POLICIES.reset(policies)
  if lines:
    # A `skewadam` labelling within an outer call (`label_table(tx, params)`): its tiers.
    token = _POLICY.set(seen[0]) if seen and _POLICY.get() is None else None
    try:
      _warn(lines)
    finally:
      if token is not None:
        _POLICY.reset(token)


@contextlib.contextmanager
def silenced() -> Iterator[None]:
  """Within: unsure lines are dropped (a second look at a tree already reported)."""
  token = _PENDING.set([])
  try:
    yield
  finally:
    _PENDING.reset(token)


def reported_once(fn: _F, policy: Any = _NO_POLICY) -> _F:
  """`fn` within `one_warning`: one warning per call, however often it labels; with
  `policy` (a `skewadam`'s `tiers` argument as a `Policy`), its fix keeps those tiers."""

  @functools.wraps(fn)
  def call(*args: Any, **kwargs: Any) -> Any:
    token = None if policy is _NO_POLICY else _POLICY.set((policy,))
    seen = _CALL_POLICIES.get()
    if token is not None and seen is not None:
      seen.append((policy,))
    try:
      with one_warning():
        return fn(*args, **kwargs)
    finally:
      if token is not None:
        _POLICY.reset(token)

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


# Lines shown in one warning: a leaf it does not name is not reported (one line per layer
# of a Python loop, and a ViT with random names, hold a few dozen).
_SHOWN_LINES = 40


def _body(lines: list[str]) -> str:
  n = _SHOWN_LINES
  shown = lines[:n] + ([f'... and {len(lines) - n} more'] if len(lines) > n else [])
  return '\n'.join(f'  - {line}' for line in shown)


def _caller() -> Any:
  """The first frame outside this library and the frameworks it runs under, or None."""
  frame = inspect.currentframe()
  while frame is not None and frame.f_globals.get('__name__', '').split('.')[0] in _INTERNAL:
    frame = frame.f_back
  return frame


def _action(message: str, module: str, lineno: int) -> str:
  """What the active warning filters do with an `UnsureLabelWarning` of `message` from
  `module`'s line `lineno` (as `warnings.warn_explicit` matches them)."""
  for action, msg, category, mod, line in warnings.filters:
    if (issubclass(UnsureLabelWarning, category) and (msg is None or msg.match(message))
        and (mod is None or mod.match(module)) and line in (0, lineno)):
      return action
  return warnings.defaultaction


def _warn(lines: list[str]) -> None:
  """One `UnsureLabelWarning` listing `lines`, attributed to the caller's line, and
  keeping the policy of the call (`_POLICY`). Under the filters that show a warning
  once per place ('default', 'module', 'once': Python's default), a line already warned
  in this process is dropped: one warning per cause, not per call."""
  frame = _caller()
  module = frame.f_globals.get('__name__', '') if frame is not None else ''
  lineno = frame.f_lineno if frame is not None else 0
  policy = _POLICY.get()
  tail = fix(policy[0] if policy else None)

  def message_of(shown: list[str]) -> str:
    return ('skewadam_jax labels: names and shapes leave these parameters labelled by a '
            f'guess:\n{_body(shown)}\n{tail}')

  message = message_of(lines)
  if _action(message, module, lineno) in ('default', 'module', 'once'):
    lines = [line for line in lines if line not in _WARNED]
    if not lines:
      return
    _WARNED.update(lines)
    message = message_of(lines)
  if frame is None:
    warnings.warn(message, UnsureLabelWarning, stacklevel=2)
    return
  module_globals = frame.f_globals
  where = dict(module=module_globals.get('__name__'),
               registry=module_globals.setdefault('__warningregistry__', {}))
  try:
    warnings.warn_explicit(message, UnsureLabelWarning, frame.f_code.co_filename,
                           frame.f_lineno, module_globals=module_globals, **where)
  except ImportError:
    # The caller's globals let the warning show its source line, through their module's
    # loader; code read from stdin (`python -`) has a loader that cannot give it.
    warnings.warn_explicit(message, UnsureLabelWarning, frame.f_code.co_filename,
                           frame.f_lineno, **where)
