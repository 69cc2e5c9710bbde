"""The rule table: one rule per primitive, like jax's `batching.primitive_batchers`.

`RULES[name]` maps the facts of an equation's operands to its outputs' and records what
it finds on the analysis (`analysis.Rule`). Adding a primitive is one function in the
module of its family and one line here. A primitive with no entry goes to `NO_RULE`:
its leaves are undecided, with a warning naming it and the user's line.
"""

from __future__ import annotations

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced.rules import calls
from skewadam_jax.structure.traced.rules import contraction
from skewadam_jax.structure.traced.rules import control
from skewadam_jax.structure.traced.rules import elementwise
from skewadam_jax.structure.traced.rules import indexing
from skewadam_jax.structure.traced.rules import random
from skewadam_jax.structure.traced.rules import selection
from skewadam_jax.structure.traced.rules import shapes

RULES: dict[str, _analysis.Rule] = {}

# elementwise (and value identities: names, sharding annotations, per-device collectives)
for _name in elementwise.NAMES:
  RULES[_name] = elementwise.elementwise
RULES['iota'] = elementwise.iota

# shape ops
RULES['broadcast_in_dim'] = shapes.broadcast_in_dim
RULES['reshape'] = shapes.reshape
RULES['transpose'] = shapes.transpose
RULES['squeeze'] = shapes.squeeze
RULES['pad'] = shapes.same_rank
RULES['rev'] = shapes.same_rank
RULES['slice'] = shapes.slice_
RULES['split'] = shapes.split
RULES['unstack'] = shapes.unstack
RULES['stack'] = shapes.stack
RULES['concatenate'] = shapes.concatenate
RULES['tile'] = shapes.tile

# indexing
RULES['gather'] = indexing.gather
for _name in indexing.SCATTERS:
  RULES[_name] = indexing.scatter
RULES['dynamic_slice'] = indexing.dynamic_slice
RULES['dynamic_update_slice'] = indexing.dynamic_update_slice

# selection and reductions
for _name in selection.REDUCTIONS:
  RULES[_name] = selection.reduce
RULES['top_k'] = selection.top_k
RULES['approx_top_k'] = selection.approx_top_k
RULES['sort'] = selection.sort
for _name in selection.CUMULATIVE:
  RULES[_name] = selection.cumulative

# contraction
RULES['dot_general'] = contraction.dot_general
RULES['ragged_dot_general'] = contraction.ragged_dot_general
RULES['conv_general_dilated'] = contraction.conv_general_dilated
RULES['triangular_solve'] = contraction.triangular_solve
for _name in contraction.FACTORISATIONS:
  RULES[_name] = contraction.factorisation

# control flow
RULES['scan'] = control.scan
RULES['while'] = control.while_
RULES['cond'] = control.cond
RULES['custom_linear_solve'] = control.linear_solve

# calls
for _name in calls.ENTERED:
  RULES[_name] = calls.call
for _name in calls.OPAQUE:
  RULES[_name] = calls.opaque_call
for _name in calls.HIGH:
  RULES[_name] = calls.hi_primitive

# random keys
for _name in random.NAMES:
  RULES[_name] = random.key_op

NO_RULE = calls.no_rule
