"""Value dependences: which leaves, masks and parameter pieces each output depends on.

After a rule has said how an equation's axes map (`analysis.Analysis.eqn`), the value
facts flow from every operand to every output, with three refinements: the logits of a
dispatching decision stay behind (`free`), expert-id masks pass through `masks.masks`,
and an output axis aligned with a mapped (per-slice decision) axis is mapped too.
"""

from __future__ import annotations

from typing import Any

from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import masks as _masks

Info = _info.Info


def depend(an: Any, eqn: Any, ins: list[Info], outs: list[Info]) -> list[Info]:
  """Value dependences: every output depends on every input.

  `free` leaves the logits of a dispatching decision behind: where a contraction or
  an elementwise op makes values carrying a router's expert axis (`an.cut`), the
  operands none of whose axes line up with that axis (the hidden states and their
  scales, contracted into the logits) stop there. A rule that sets an output's `piece`
  has said which parameter pieces it is computed from; otherwise it is its operands'.
  """
  deps = frozenset().union(*(x.deps for x in ins))
  free = frozenset().union(*(x.free for x in ins))
  piece = frozenset().union(*(_info.pieces(x) for x in ins))
  last = frozenset().union(*(x.last or _info.EMPTY for x in ins))
  if an.cut and (eqn.primitive in _masks.DOT or (
      len(outs) == 1 and _info.elementwise_shapes(eqn))):
    hot = [bool(an.cut.intersection(t)) for t in outs[0].axes]
    if any(hot):
      free = frozenset().union(*(x.free for x, v in zip(ins, eqn.invars)
                                 if _masks.aligned(eqn, x, v, hot, an.cut)))
  mask, unmask, open_ = _masks.masks(eqn, ins, an.masked)
  if an.mapped:
    # An output axis joins the operand axes a rule aligned (elementwise, batch
    # dimensions): those aligned with a mapped axis run along it too.
    for o, v in zip(outs, eqn.outvars):
      for tokens, n in zip(o.axes, _info.shape_of(v)):
        if an.is_mapped(tokens):
          an.map_axes(tokens, n)
  return [o._replace(deps=deps, free=free, mask=mask, unmask=unmask, open=open_,
                     piece=piece if o.piece is None else o.piece,
                     last=last if o.last is None else o.last) for o in outs]
