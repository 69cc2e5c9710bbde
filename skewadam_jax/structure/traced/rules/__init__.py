"""The rule table: one rule per primitive, like jax's `batching.primitive_batchers`.

`RULES[name]` maps the facts of an equation's operands to its outputs' and records what
it finds on the analysis (`analysis.Rule`). Adding a primitive is one function in the
module of its family and one line here. A primitive with no entry goes to `NO_RULE`:
its leaves are undecided, with a warning naming it and the user's line. Every primitive
of the jax version `REVIEWED_FOR_JAX` has an entry or is listed in `WITHOUT_RULE`
(tests/structure/traced/test_rule_table.py).
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

# The jax version whose primitives (those `jax._src.lax` defines, with the AD, random and
# control-flow ones) were last read against this table: each has a rule above or is in
# WITHOUT_RULE (tests/structure/traced/test_rule_table.py diffs them).
REVIEWED_FOR_JAX = '0.10.2'

# Primitives left to NO_RULE by design: what their outputs hold cannot be read as a
# parameter's axes (communication, linear algebra factorisations, FFT, windowed
# reductions, mutable references, debugging, raw random bits), so the leaves whose flow
# crosses one are undecided, with a warning naming it: the safe rule, never a guess.
WITHOUT_RULE = frozenset({
    # collectives, their async halves, and per-device values
    'all_gather', 'all_gather_done', 'all_gather_invariant', 'all_gather_reduced',
    'all_gather_reduced_start', 'all_gather_start', 'all_to_all', 'all_to_all_done',
    'all_to_all_start', 'axis_index', 'pbroadcast_done', 'pbroadcast_start',
    'ppermute_done', 'ppermute_start', 'precv', 'preduced', 'psend', 'psum_done',
    'psum_invariant', 'psum_invariant_start', 'psum_start', 'ragged_all_to_all',
    'reduce_scatter', 'reduce_scatter_done', 'reduce_scatter_start', 'reduced_vary_cast_p',
    'unreduced_psum', 'unreduced_psum_start', 'unreduced_reduce_scatter',
    'unreduced_reduce_scatter_start', 'vary_unreduced_cast_p', 'platform_index',
    # linear algebra and FFT
    'cholesky_update', 'eig', 'fft', 'geqp3', 'geqrf', 'hessenberg', 'householder_product',
    'lu_pivots_to_permutation', 'ormqr', 'schur', 'symmetric_product', 'tridiagonal',
    'tridiagonal_solve',
    # windowed and variadic reductions
    'reduce', 'reduce_window', 'reduce_window_max', 'reduce_window_min', 'reduce_window_sum',
    'select_and_gather_add', 'select_and_scatter', 'select_and_scatter_add',
    # scaled (quantised) products
    'scaled_dot',
    # references, tokens, staging and other program plumbing
    'accum_grad_in_ref', 'after_all', 'create_token', 'dce_sink', 'empty', 'empty2',
    'empty_ref', 'free_ref', 'freeze', 'new_ref', 'stage', 'tie', 'unreachable',
    'from_edtype', 'to_edtype', 'layout_constraint', 'inspect_sharding', 'debug_print',
    'composite', 'call', 'eval_jaxpr', 'linear_call', 'custom_jvp_call_jaxpr', 'remat_opt',
    # gradient accumulation and zeros of the autodiff machinery
    'add_any', 'zeros_like',
    # raw random bits
    'random_gamma', 'rng_bit_generator', 'rng_uniform',
})
