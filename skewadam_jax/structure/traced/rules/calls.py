"""Call rules: calls the analysis enters, calls it cannot, and primitives with no rule.

`jit`/`pjit`, `remat`, `custom_jvp`/`custom_vjp` calls, `shard_map` and other calls
whose body maps their operands one to one are entered. A hijax primitive
(`call_hi_primitive`: jax's `HiPrim`, such as `jnp.searchsorted` from jax 0.12) is entered
through its expansion in lower-level primitives (`expand`), traced once on its operands'
shapes. A call the analysis cannot enter (a Pallas kernel, a callback) is read as a
grouped matmul when its integer operands carry a routing decision; otherwise the
parameters reaching it are undecided. A primitive with no rule (or a hijax primitive
whose expansion cannot be traced) makes every leaf whose flow crosses it undecided,
with one warning naming it and the user's line (`Analysis.unknown`).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax

from skewadam_jax.core.lazy import jex_core
from skewadam_jax.core.lazy import source_info_util

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info

Info = _info.Info
Result = _f.Result


def sub_jaxpr(eqn: Any) -> Optional[tuple[Any, list[Any]]]:
  """(jaxpr, consts) of a call-like equation whose body maps its operands one to one."""
  for name in ('jaxpr', 'call_jaxpr', 'fun_jaxpr'):
    sub = eqn.params.get(name)
    if isinstance(sub, jex_core.ClosedJaxpr):
      sub, consts = sub.jaxpr, list(sub.consts)
    elif isinstance(sub, jex_core.Jaxpr):
      consts = []
    else:
      continue
    if len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
      return sub, consts
  return None


def call(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """A call: its body's facts (one it cannot enter is an unknown primitive)."""
  sub = sub_jaxpr(eqn)
  if sub is None:
    return no_rule(an, eqn, ins)
  return Result(an.run(sub[0], ins, sub[1]))


def expansion(eqn: Any) -> Union[tuple[Any, list[Any]], str]:
  """(jaxpr, consts) of a hijax primitive's expansion in lower-level primitives, traced on
  its operands' shapes and dtypes (the flat operands and results, as the equation has
  them); or why it cannot be had.

  The equations of the expansion carry the hijax primitive's source line, so that what
  the analysis reports inside it names the user's line.
  """
  prim = eqn.params.get('_prim')
  name = type(prim).__name__
  try:
    in_tree, out_tree = prim.in_tree, prim.out_tree

    def flat(*args: Any) -> list[Any]:
      return list(out_tree.flatten_up_to(prim.expand(*in_tree.unflatten(args))))

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=eqn.source_info.name_stack):
      closed = jax.make_jaxpr(flat)(*avals)
  except Exception as e:  # pylint: disable=broad-except  # any failure: loud, not fatal
    return f'{name}: its expansion could not be traced ({type(e).__name__})'
  jaxpr = closed.jaxpr
  if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
    return f'{name}: its expansion does not map its operands and results one to one'
  return jaxpr, list(closed.consts)


def hi_primitive(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """A hijax primitive: the facts of its expansion (traced once per equation, kept by
  a `Memo`); one whose expansion cannot be traced is read as a primitive with no rule."""
  key = ('expansion', id(eqn))
  got = an.memo[key] if key in an.memo else expansion(eqn)
  memo = [] if key in an.memo else [_f.Memo(key, got)]
  if isinstance(got, str):
    outs, found = unreadable(an, eqn, ins, got)
    return Result(an.depend(eqn, ins, outs), [*found, *memo])
  return Result(an.run(got[0], ins, got[1]), memo)


def opaque_call(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """A call the analysis cannot enter (a Pallas kernel, a callback).

  When its integer operands carry a routing decision over E experts (group sizes or
  offsets computed from the expert ids), it is read as a grouped matmul: a parameter
  operand's axis of length E is that decision's expert axis.
  """
  prim = eqn.primitive.name
  routed = frozenset().union(*(x.routed for x, v in zip(ins, eqn.invars)
                               if _info.is_integer(v)))
  found: list[_f.Finding] = []
  for x in ins:
    for tokens in x.axes:
      for t in _info.params_of(tokens):
        dec = an.latest(routed, an.shapes[t.leaf][t.axis])
        if dec is not None:
          found.append(_f.Bank(t, dec, f'an E-long operand axis of {prim}, whose integer '
                               'operands are routed (read as a grouped matmul)'))
  if not found:
    found.append(_f.Unseen(prim, tuple(ins)))
  data, routed = _info.common(ins)
  return Result([Info(_info.blank(len(_info.shape_of(v))).axes, data, routed)
                 for v in eqn.outvars], found)


def no_rule(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """A primitive with no rule: a call whose body maps its operands is entered; any
  other makes the leaves whose flow crosses it undecided (the parameters on its
  operands' axes and those its operands' values depend on). It follows bodies: the
  value facts are its body's, or settled here (`Analysis.depend`)."""
  sub = sub_jaxpr(eqn)
  if sub is not None:
    return Result(an.run(sub[0], ins, sub[1]))
  outs, found = unreadable(an, eqn, ins)
  return Result(an.depend(eqn, ins, outs), found)


def unreadable(an: _analysis.Analysis, eqn: Any, ins: list[Info], why: str = '') -> Result:
  """An equation no rule can read: its outputs carry no parameter axis, and the leaves
  whose flow crosses it are found `Unreadable` (for the warning and the undecided
  reasons).

  Args:
    an: the analysis.
    eqn: the equation.
    ins: its operands' facts.
    why: why it cannot be read, beside the primitive's name ('' : it has no rule).
  """
  del an
  leaves = {leaf for x in ins for t in x.axes for leaf, _ in _info.params_of(t)}
  leaves |= {leaf for x in ins for leaf in x.deps}
  data, routed = _info.common(ins)
  return Result([Info(_info.blank(len(_info.shape_of(v))).axes, data, routed)
                 for v in eqn.outvars], [_f.Unreadable(eqn, frozenset(leaves), why)])
