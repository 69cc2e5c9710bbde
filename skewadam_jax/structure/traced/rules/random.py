"""Random-key rules: keys carry no parameter information.

Seeding, splitting, folding in, wrapping and unwrapping keys (typed `key<impl>` arrays
or legacy `uint32[2]` ones) and drawing bits from them make values that depend on the
keys only: no parameter axis and no decision reaches them, but an input key (a dropout
or jitter key passed to the loss) makes them data. Their shapes are read from
`aval.shape`: a key's dtype is no NumPy dtype.
"""

from __future__ import annotations

from typing import Any

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import findings as _f
from skewadam_jax.structure.traced import info as _info

Info = _info.Info


def key_op(an: _analysis.Analysis, eqn: Any, ins: list[Info]) -> _f.Result:
  """Every random-key primitive: outputs of their own shape, nothing on their axes."""
  del an
  data, routed = _info.common(ins)
  return _f.Result([Info(_info.blank(len(_info.shape_of(v))).axes, data, routed)
                    for v in eqn.outvars])
