"""`trace_structure`: trace the forward or loss function, run the analysis, decide.

The analysis runs up to three times over the jaxpr: the first pass finds the decisions
and their routers, the second marks the logits' axes as expert-indexed (the router's
axes, `Analysis.router_tokens`), the third (when a decision dispatches a bank) stops the
value dependences at the logits (`Analysis.cut`), to tell a scale of the router's input
(a router) from a leaf that also reaches the outputs otherwise.
"""

from __future__ import annotations

from typing import Any, Callable
import warnings

import jax
from skewadam_jax.core.lazy import jex_core
import numpy as np

from skewadam_jax.core import tree as _tree
from skewadam_jax.structure import warning as _warning
from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import decide as _decide
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import results as _results
from skewadam_jax.structure.traced import rules as _rules


class TraceWarning(_warning.UnsureLabelWarning):
  """`trace_structure` could not see part of the program: some leaves are undecided.

  An `sj.UnsureLabelWarning`: filtering (or raising) that class covers it too.
  """


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def trace_structure(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any
                    ) -> _results.Structure:
  """Each parameter's tier and batch axes, from what `fn` computes with it.

  Traces `fn(params, *args, **kwargs)` to a jaxpr with abstract values (nothing runs
  on data) and follows every parameter leaf through the program, whatever it is
  called and however it is stored (see the module docstring for the rules): the
  parameters that produce the logits of a routing decision (`top_k`, `argmax`,
  `approx_max_k`, an argsort) are the router, those whose axis of length E is batched,
  contracted or gathered per expert are expert banks (that axis a batch axis), the
  axes scanned over by a `scan` of parameters are layer axes (batch axes too), and
  the rest is backbone. A routing decision that dispatches nothing (an `argmax` for an
  accuracy metric) makes no router.

  Args:
    fn: the model's forward or loss function, called as `fn(params, *args, **kwargs)`.
      For Flax NNX, pass the model itself with a loss of the model (`fn(model,
      batch)`; its labels match `nnx.state(model, nnx.Param)` by path), or its
      `nnx.State` with a function of the state: `graphdef, params, rest =
      nnx.split(model, nnx.Param, ...)`, `fn = lambda p, x: nnx.merge(graphdef, p,
      rest)(x)`; for Equinox, pass the model and `lambda m, x: m(x)`.
    params: a pytree whose array leaves (arrays or `jax.ShapeDtypeStruct`s) are the
      parameters; other leaves (an Equinox module's functions) are passed unchanged
      and get no label.
    *args: example inputs (arrays or `jax.ShapeDtypeStruct`s; other leaves static).
    **kwargs: more example inputs, as `args`.

  Returns:
    A `Structure`: `.labels` and `.batch_axes` (trees like `params`) for
    `sj.skewadam(lr, param_labels=..., batch_axes=...)` and `sj.memory_report`
    (`sj.label_table(tx, params)` then shows what that skewadam gives); `.format()`
    shows every leaf with its evidence, `.roles` what each leaf does (hidden matrix,
    embedding, output layer, ...), `.labels_for(tiers)` the labels for a policy with a
    `'hidden'` tier, and `.undecided` the leaves the analysis could not decide (labelled
    backbone, with a `TraceWarning`).

  Raises:
    TypeError: if `fn` is not callable or `params` has no array leaf, or if `params` is
      an `nnx.State` that `fn` uses as the model (the error names both forms that work).

  Example:
    >>> import jax, jax.numpy as jnp, skewadam_jax as sj
    >>> def forward(p, x):
    ...   probs = jax.nn.softmax(x @ p['w_a'])               # [T, E]
    ...   top, idx = jax.lax.top_k(probs, 1)
    ...   hid = jnp.einsum('td,edf->tef', x, p['w_b'])        # every expert
    ...   mask = jax.nn.one_hot(idx[:, 0], 4) * top
    ...   return jnp.einsum('tef,te->tf', hid, mask) @ p['w_c']
    >>> p = {'w_a': jnp.zeros((8, 4)), 'w_b': jnp.zeros((4, 8, 16)),
    ...      'w_c': jnp.zeros((16, 8))}
    >>> s = sj.trace_structure(forward, p, jax.ShapeDtypeStruct((6, 8), jnp.float32))
    >>> s.labels
    {'w_a': 'router', 'w_b': 'experts', 'w_c': 'backbone'}
    >>> s.batch_axes['w_b']
    (0,)
  """
  if not callable(fn):
    raise TypeError(f'`fn` must be the model\'s forward or loss function, got '
                    f'{type(fn).__name__}.')
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  is_param = [_tree.is_array_like(x) for _, x in flat]
  if not any(is_param):
    raise TypeError('`params` must be a pytree with array (or jax.ShapeDtypeStruct) '
                    f'leaves, got {type(params).__name__} with none.')
  leaves = [x for _, x in flat]
  pidx = [i for i, ok in enumerate(is_param) if ok]
  paths = [_paths.path_str(flat[i][0]) for i in pidx]
  shapes = [tuple(int(d) for d in np.shape(leaves[i])) for i in pidx]
  arg_flat, arg_def = jax.tree_util.tree_flatten((args, kwargs))
  aidx = [i for i, x in enumerate(arg_flat) if _tree.is_array_like(x)]

  def traced(*arrays: Any) -> Any:
    merged = list(leaves)
    for i, a in zip(pidx, arrays[:len(pidx)]):
      merged[i] = a
    inputs = list(arg_flat)
    for i, a in zip(aidx, arrays[len(pidx):]):
      inputs[i] = a
    call_args, call_kwargs = jax.tree_util.tree_unflatten(arg_def, inputs)
    return fn(jax.tree_util.tree_unflatten(treedef, merged), *call_args, **call_kwargs)

  try:
    closed = jax.make_jaxpr(traced)(*[_abstract(leaves[i]) for i in pidx],
                                    *[_abstract(arg_flat[i]) for i in aidx])
  except (TypeError, AttributeError) as e:
    if not _is_nnx_state(params):
      raise
    raise TypeError(
        f'sj.trace_structure: `fn` failed on the nnx.State given as `params` ({e}). A '
        'loss of the model (`loss_fn(model, batch)`) needs the model itself: '
        'sj.trace_structure(loss_fn, model, batch), whose labels match '
        'nnx.state(model, nnx.Param) by path; or a function of the state: graphdef, '
        'state, rest = nnx.split(model, nnx.Param, ...); sj.trace_structure(lambda s, b: '
        'loss_fn(nnx.merge(graphdef, s, rest), b), state, batch).') from e
  jaxpr = closed.jaxpr
  one = [frozenset({k}) for k in range(len(pidx))]
  infos = [_info.Info(tuple(frozenset({_info.Param(k, a)}) for a in range(len(shapes[k]))),
                      deps=one[k], free=one[k], open=one[k]) for k in range(len(pidx))]
  infos += [_info.Info(tuple(frozenset({_info.INPUT_AXIS}) for _ in _info.shape_of(v)),
                       data=True)
            for v in jaxpr.invars[len(pidx):]]

  analysis = _analysis.Analysis(shapes, _rules.TABLE)
  analysis.run(jaxpr, infos, closed.consts)  # first pass: the decisions and routers
  for dec, key in enumerate(analysis.order):
    for token in analysis.decisions[key].routers:
      analysis.router_tokens.setdefault(token, set()).add(dec)
  analysis.banks.clear()
  outs = analysis.run(jaxpr, infos, closed.consts)  # second pass: the logits index experts
  analysis.outputs(outs)
  confirmed = analysis.confirmed()
  analysis.cut = {t for t, decs in analysis.router_tokens.items() if decs & confirmed}
  if analysis.cut:  # third pass: which leaves reach the outputs other than via the logits
    analysis.banks.clear()
    outs = analysis.run(jaxpr, infos, closed.consts)
    analysis.outputs(outs)

  read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jex_core.Literal)}
  read |= {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  structure = _decide.decide(analysis, paths, shapes,
                             [v in read for v in jaxpr.invars[:len(pidx)]], treedef, pidx,
                             len(leaves))
  _warn(analysis, paths, structure.undecided)
  return structure


def _is_nnx_state(x: Any) -> bool:
  """Whether `x` is a Flax NNX `State` (without importing Flax)."""
  return any(c.__name__ == 'State' and c.__module__.startswith('flax.nnx')
             for c in type(x).__mro__)


def _warn(analysis: _analysis.Analysis, paths: list[str], undecided: dict[str, str]) -> None:
  """One warning per primitive with no rule, and per selection deciding nothing, that
  parameters reach: each names the primitive, the user's line and the leaves; and one
  for the other undecided leaves, with their reasons."""
  seen = {paths[k] for leaves in (*analysis.unknown.values(), *analysis.blind.values())
          for k in leaves}
  rest = {path: why for path, why in undecided.items() if path not in seen}
  if rest:
    shown = '; '.join(f'{path}: {why}' for path, why in list(rest.items())[:8])
    more = f'; and {len(rest) - 8} more' if len(rest) > 8 else ''
    warnings.warn(f'sj.trace_structure: {len(rest)} leaves are undecided (see '
                  f'`.undecided`): {shown}{more}. {_SAFE}', TraceWarning, stacklevel=3)
  for (prim, line), leaves in analysis.unknown.items():
    if leaves:
      warnings.warn(
          f'sj.trace_structure: no rule reads the primitive `{prim}` (at {line}); the '
          f'{len(leaves)} leaves whose flow crosses it are undecided unless other evidence '
          f'decides them: {_names(paths, leaves)}. {_SAFE}', TraceWarning, stacklevel=3)
  for (prim, line), leaves in analysis.blind.items():
    warnings.warn(
        f'sj.trace_structure: `{prim}` (at {line}) selects among values computed from '
        f'parameters but makes no routing decision (no expert axis can be told); the '
        f'leaves it depends on are undecided unless other evidence decides them: '
        f'{_names(paths, leaves)}. {_SAFE}', TraceWarning, stacklevel=3)


# What every undecided leaf gets, and how to settle one, in each warning.
_SAFE = ('Passed as sj.skewadam(learning_rate, tiers=<your tiers>, param_labels=trace), '
         "the trace gives every undecided leaf the tier 'undecided', the safe rule: "
         f'{_warning.SAFE_RULE}; to settle one, read its structure from '
         "`trace.format()` and pass your own labels, e.g. "
         "sj.make_labeler([('<path>', '<tier>')])")


def _names(paths: list[str], leaves: set[int], most: int = 8) -> str:
  names = [paths[k] for k in sorted(leaves)]
  return ', '.join(names[:most]) + (f' and {len(names) - most} more' if len(names) > most else '')
