"""Control-flow rules: `scan`, `while`, `cond` enter their bodies.

Carries are iterated to a fixed point and `cond` branches are joined; a
`custom_linear_solve` (`jnp.linalg.solve`) runs its `solve` body. **Scanned layers**
are parameters consumed (whatever the layout ops on the way) as the `xs` of a `scan`
that reads no input data: the scanned axis, mapped back to the parameter's own axis, is
a batch axis, one per nesting level.
"""

from __future__ import annotations

from typing import Any, Callable

from skewadam_jax.core.lazy import jex_core

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info

Info = _info.Info
Result = _f.Result


def closed(sub: Any) -> tuple[Any, list[Any]]:
  """(jaxpr, consts) of a closed or open jaxpr."""
  if isinstance(sub, jex_core.ClosedJaxpr):
    return sub.jaxpr, list(sub.consts)
  return sub, []


def _scan_groups(eqn: Any) -> tuple[int, int]:
  """How many of a `scan`'s operands are consts and carries (then come the xs).

  jax < 0.12 gives the counts (`num_consts`, `num_carry`); later versions give `ft_in`,
  the flattened (consts, carry, xs) groups.
  """
  p = eqn.params
  if 'num_consts' in p:
    return p['num_consts'], p['num_carry']
  consts, carry, _ = p['ft_in'].update(list(range(len(eqn.invars)))).unpack()
  return len(list(consts)), len(list(carry))


def _fixpoint(body: Callable[[list[Info]], list[Info]], carry: list[Info]) -> list[Info]:
  """Joins a loop's carried facts with the body's until nothing changes."""
  for _ in range(16):
    out = body(carry)
    new = [_info.join(c, o) for c, o in zip(carry, out)]
    if new == carry:
      return new
    carry = new
  return carry


def scan(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  p = eqn.params
  jaxpr, consts = closed(p['jaxpr'])
  nc, nk = _scan_groups(eqn)
  length = p['length']
  xs = ins[nc + nk:]
  # a stack of parameters: the scanned axis is a layer axis
  found = [_f.Scanned(t, length) for x in xs if not x.data and x.axes
           for t in _info.params_of(x.axes[0])]
  sliced = [x._replace(axes=x.axes[1:], iota=None, columns=()) for x in xs]
  last: list[list[Info]] = []

  def body(carry: list[Info]) -> list[Info]:
    last[:] = [an.run(jaxpr, ins[:nc] + carry + sliced, consts)]
    return last[0][:nk]

  carry = _fixpoint(body, list(ins[nc:nc + nk]))
  ys = last[0][nk:]
  return Result(carry + [y._replace(axes=(_info.EMPTY,) + y.axes, iota=None, columns=())
                         for y in ys], found)


def while_(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  p = eqn.params
  cn, bn = p['cond_nconsts'], p['body_nconsts']
  cond_jaxpr, cond_consts = closed(p['cond_jaxpr'])
  body_jaxpr, body_consts = closed(p['body_jaxpr'])
  cconsts, bconsts = ins[:cn], ins[cn:cn + bn]

  def body(carry: list[Info]) -> list[Info]:
    an.run(cond_jaxpr, cconsts + carry, cond_consts)
    return an.run(body_jaxpr, bconsts + carry, body_consts)

  return Result(_fixpoint(body, list(ins[cn + bn:])))


def cond(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  index, ops = ins[0], ins[1:]
  outs = None
  for branch in eqn.params['branches']:
    jaxpr, consts = closed(branch)
    got = an.run(jaxpr, ops, consts)
    outs = got if outs is None else [_info.join(a, b) for a, b in zip(outs, got)]
  return Result([o._replace(data=o.data or index.data, routed=o.routed | index.routed,
                            deps=o.deps | index.deps, free=o.free | index.free,
                            open=o.open | index.open)
                 for o in outs or []])


def linear_solve(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> Result:
  """`custom_linear_solve`: the axes its `solve` body gives the right-hand side; the
  values depend on every operand (the matrix that `matvec` closes over too)."""
  lengths, jaxprs = eqn.params['const_lengths'], eqn.params['jaxprs']
  start = lengths.matvec + lengths.vecmat
  jaxpr, consts = closed(jaxprs.solve)
  outs = an.run(jaxpr, ins[start:start + lengths.solve] + ins[sum(lengths):], consts)
  if len(outs) != len(eqn.outvars):
    data, routed = _info.common(ins)
    return Result([Info(_info.blank(len(_info.shape_of(v))).axes, data, routed)
                   for v in eqn.outvars])
  return Result(outs)
