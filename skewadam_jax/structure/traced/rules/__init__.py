"""The rule table: one rule per primitive, like jax's `batching.primitive_batchers`.

`RULES[primitive]` maps the facts of an equation's operands to its outputs' and returns
what it finds (`analysis.Rule`, `findings.Result`); the analysis applies the findings.
The table is keyed by the primitive objects jax defines (`primitives.find`), never by
name. Adding a primitive is one function in the module of its family and one line here,
which also says its properties: `TABLE.keeps_positions` (its outputs keep each position
of an axis where it was) and `TABLE.follows_bodies` (its rule enters the equation's
bodies), one table per property. A primitive with no entry goes to `NO_RULE`: its leaves
are undecided, with a warning naming it and the user's line. Every primitive of the jax
version `REVIEWED_FOR_JAX` has an entry or is listed in `WITHOUT_RULE` (by name;
tests/structure/traced/test_rule_table.py).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import primitives as _p
from skewadam_jax.structure.traced.rules import calls
from skewadam_jax.structure.traced.rules import contraction
from skewadam_jax.structure.traced.rules import control
from skewadam_jax.structure.traced.rules import elementwise
from skewadam_jax.structure.traced.rules import indexing
from skewadam_jax.structure.traced.rules import random
from skewadam_jax.structure.traced.rules import selection
from skewadam_jax.structure.traced.rules import shapes


@functools.cache
def _table() -> _analysis.Table:
  """The rule table and its property tables: one line per primitive family (its
  primitives, every spelling), saying its rule and properties."""
  table: dict[Any, _analysis.Rule] = {}
  follows_bodies, keeps_positions = set(), set()

  def add(prims: Iterable[Any], rule: _analysis.Rule, *, keeps: bool = False,
          bodies: bool = False) -> None:
    """`keeps`: the outputs keep every position of an operand axis they carry where it
    was; `bodies`: the rule enters the equation's bodies (`analysis.Table`)."""
    for prim in prims:
      table[prim] = rule
      if keeps:
        keeps_positions.add(prim)
      if bodies:
        follows_bodies.add(prim)

  # elementwise (and value identities: names, sharding annotations, per-device collectives)
  add(elementwise.primitives(), elementwise.elementwise, keeps=True)
  add(_p.find(_p.LAX, 'iota_p'), elementwise.iota)

  # shape ops
  add(_p.find(_p.LAX, 'broadcast_in_dim_p'), shapes.broadcast_in_dim, keeps=True)
  add(_p.find(_p.LAX, 'reshape_p'), shapes.reshape, keeps=True)
  add(_p.find(_p.LAX, 'transpose_p'), shapes.transpose, keeps=True)
  add(_p.find(_p.LAX, 'squeeze_p'), shapes.squeeze, keeps=True)
  add(_p.find(_p.LAX, 'pad_p', 'rev_p'), shapes.same_rank)
  add(_p.find(_p.SLICING, 'slice_p'), shapes.slice_)
  add(_p.find(_p.LAX, 'split_p'), shapes.split)
  add(_p.find(_p.LAX, 'unstack_p'), shapes.unstack)
  add(_p.find(_p.LAX, 'stack_p'), shapes.stack, keeps=True)
  add(_p.find(_p.LAX, 'concatenate_p'), shapes.concatenate, keeps=True)
  add(_p.find(_p.LAX, 'tile_p'), shapes.tile)

  # indexing
  add(_p.find(_p.SLICING, 'gather_p'), indexing.gather)
  add(_p.find(_p.SLICING, 'scatter_p', 'scatter_add_p', 'scatter_mul_p', 'scatter_min_p',
              'scatter_max_p', 'scatter_apply_p', 'scatter_sub_p'), indexing.scatter)
  add(_p.find(_p.SLICING, 'dynamic_slice_p'), indexing.dynamic_slice)
  add(_p.find(_p.SLICING, 'dynamic_update_slice_p'), indexing.dynamic_update_slice)

  # selection and reductions
  add(_p.find(_p.LAX, 'reduce_sum_p', 'reduce_max_p', 'reduce_min_p', 'reduce_prod_p',
              'reduce_and_p', 'reduce_or_p', 'reduce_xor_p', 'reduce_precision_sum_p',
              'argmax_p', 'argmin_p'), selection.reduce, keeps=True)
  add(_p.find(_p.LAX, 'top_k_p'), selection.top_k)
  add(_p.find('jax._src.lax.ann', 'approx_top_k_p'), selection.approx_top_k)
  add(_p.find(_p.LAX, 'sort_p'), selection.sort)
  add(_p.find(_p.CONTROL, 'cumsum_p', 'cumprod_p', 'cummax_p', 'cummin_p',
              'cumlogsumexp_p'), selection.cumulative)

  # contraction
  add(_p.find(_p.LAX, 'dot_general_p'), contraction.dot_general, keeps=True)
  add(_p.find(_p.LAX, 'ragged_dot_general_p'), contraction.ragged_dot_general)
  add(_p.find('jax._src.lax.convolution', 'conv_general_dilated_p'),
      contraction.conv_general_dilated)
  add(_p.find(_p.LINALG, 'triangular_solve_p'), contraction.triangular_solve)
  add(_p.find(_p.LINALG, 'cholesky_p', 'lu_p', 'qr_p', 'eigh_p', 'svd_p'),
      contraction.factorisation)

  # control flow
  add(_p.find(_p.CONTROL, 'scan_p'), control.scan, bodies=True)
  add(_p.find(_p.CONTROL, 'while_p'), control.while_, bodies=True)
  add(_p.find(_p.CONTROL, 'cond_p'), control.cond, bodies=True)
  add(_p.find(_p.CONTROL, 'linear_solve_p'), control.linear_solve)

  # calls: entered (their body maps their operands one to one), opaque, hijax
  add((*_p.find(_p.PJIT, 'jit_p', 'pjit_p'), *_p.find(_p.CORE, 'closed_call_p', 'named_call_p'),
       *_p.find(_p.CHECKPOINT, 'remat_p'),
       *_p.find('jax._src.custom_derivatives', 'custom_jvp_call_p', 'custom_vjp_call_p',
                'custom_vjp_call_jaxpr_p'),
       *_p.find('jax._src.shard_map', 'shard_map_p'),
       *_p.find('jax.experimental.shard_map', 'shard_map_p'),
       *_p.find('jax._src.interpreters.ad', 'custom_lin_p')), calls.call, bodies=True)
  add((*_p.find('jax._src.pallas.pallas_call', 'pallas_call_p'),
       *_p.find('jax._src.callback', 'pure_callback_p', 'io_callback_p'),
       *_p.find('jax._src.ffi', 'ffi_call_p'),
       *_p.find('jax._src.debugging', 'debug_callback_p')), calls.opaque_call)
  add(_p.find('jax._src.hijax', 'call_hi_primitive_p'), calls.hi_primitive, bodies=True)

  # random keys (typed or legacy)
  add((*_p.find('jax._src.random.prng', 'random_seed_p', 'random_bits_p', 'random_split_p',
                'random_fold_in_p', 'random_wrap_p', 'random_unwrap_p'),
       *_p.find('jax._src.prng', 'random_seed_p', 'random_bits_p', 'random_split_p',
                'random_fold_in_p', 'random_wrap_p', 'random_unwrap_p', 'random_clone_p',
                'threefry2x32_p'),
       *_p.find('jax._src.random', 'random_clone_p'),
       *_p.find('jax._src.random.threefry2x32', 'threefry2x32_p')), random.key_op)
  return _analysis.Table(table, calls.no_rule, frozenset(follows_bodies),
                         frozenset(keeps_positions))


def __getattr__(name: str) -> Any:
  """`TABLE` (the rules and their properties) and `RULES` (its rules), built at their
  first read: some primitives' modules (Pallas') are what `import skewadam_jax` does not
  import (the analysis reads the table when it runs)."""
  if name == 'TABLE':
    return _table()
  if name == 'RULES':
    return _table().rules
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


NO_RULE = calls.no_rule  # (also `TABLE.no_rule`)

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
