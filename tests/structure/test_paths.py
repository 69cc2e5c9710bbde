"""The path engine (`_paths`): one per-leaf matcher for labels, batch axes and the rest."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import skewadam_jax as sj
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import paths as _paths

PARAMS = {'moe': {'a': jnp.zeros((4, 5, 6)), 'b': jnp.zeros((4, 5, 6))},
          'w': jnp.zeros((5, 6))}


def test_batch_axes_accept_a_prefix_tree_as_labels_do():
  prefix = {'moe': (1,), 'w': ()}
  assert _paths.leaf_batch_axes(prefix, PARAMS) == [(1,), (1,), ()]
  assert _labels.broadcast_labels(PARAMS, {'moe': 'experts', 'w': 'backbone'}) == {
      'moe': {'a': 'experts', 'b': 'experts'}, 'w': 'backbone'}
  state = sj.scale_by_tiered_adam(batch_axes=prefix).init(PARAMS)
  assert state.v_row['moe']['a'].shape == (4, 5)  # per slice of axis 1: the columns go
  assert state.v_col['moe']['a'].shape == (5, 6)  # and the rows


def test_paths_match_when_structures_differ():
  # A trailing `value` (a Flax box's array) is not part of the path; a shorter path of
  # the given tree covers the subtree below it.
  given = {'moe': (1,), 'w': {'value': ()}}
  assert _paths.leaf_batch_axes(given, PARAMS) == [(1,), (1,), ()]
  labels = {'moe': 'experts', 'w': {'value': 'backbone'}}
  assert _paths.per_leaf(PARAMS, labels, 'param_labels') == ['experts', 'experts', 'backbone']


def test_a_function_a_single_value_and_none():
  assert _paths.leaf_batch_axes(lambda p: {'moe': (0,), 'w': ()}, PARAMS) == [(0,), (0,), ()]
  assert _paths.leaf_batch_axes((0,), PARAMS) == [(0,)] * 3
  assert _paths.leaf_batch_axes({'moe': None, 'w': [0]}, PARAMS) == [None, None, (0,)]
  assert _paths.leaf_batch_axes(None, PARAMS) == [None] * 3


def test_entries_the_params_do_not_have():
  # Batch axes made for the whole params also serve a tier of `optax.partition`, which
  # sees the other tiers' leaves masked; a label tree must name exactly the params.
  masked = {'moe': optax.MaskedNode(), 'w': PARAMS['w']}
  assert _paths.leaf_batch_axes({'moe': {'a': (0,), 'b': (0,)}, 'w': ()}, masked) == [()]
  with pytest.raises(ValueError, match=r"paths the params do not have: \['moe/c'\]"):
    _labels.broadcast_labels(PARAMS, {'moe': {'a': 'x', 'b': 'x', 'c': 'x'}, 'w': 'x'})
  with pytest.raises(ValueError, match=r"`batch_axes` must be a pytree .* no entry for "
                                       r"\['moe/b'\]"):
    _paths.leaf_batch_axes({'moe': {'a': (0,)}, 'w': ()}, PARAMS)
  with pytest.raises(TypeError, match=r"int tuples \(or None\), got 'x' at moe"):
    _paths.leaf_batch_axes({'moe': 'x', 'w': ()}, PARAMS)


def test_rules_are_checked_and_matched_once():
  rules = _paths.check_rules([('moe/**', (1,)), ['w', (0,)]], _paths.is_axes, 'bad rule')
  assert rules == (('moe/**', (1,)), ('w', (0,)))
  with pytest.raises(TypeError, match=r"bad rule, got \('w', 'x'\)"):
    _paths.check_rules([('w', 'x')], _paths.is_axes, 'bad rule')
  compiled = _paths.compile_rules(rules)
  assert _paths.first_match(compiled, ('moe', 'a')) == ((0, 1), (1,), 'moe/**')  # ** spans none
  assert _paths.first_match(compiled, ('x', 'w')) == ((1, 2), (0,), 'w')
  assert _paths.first_match(compiled, ('v',)) is None
  # `**` never crosses a shared expert.
  assert not _paths.match_path('*moe*/**/wi_0', 'moe_block/shared_experts/wi_0')


def test_one_leaf_record():
  leaves, _ = _paths.leaves_of({'Layers': {'W': jnp.zeros((2, 3))}, 'f': len, 'n': 1.0},
                               {('Layers', 'W'): ('layers', None)})
  assert [(x.path, x.segs, x.shape, x.names, x.is_array) for x in leaves] == [
      ('Layers/W', ('layers', 'w'), (2, 3), ('layers', None), True),
      ('f', ('f',), (), None, False),
      ('n', ('n',), (), None, True)]
  leaves[0].scan = {0}
  assert leaves[0].core == (3,) and leaves[0].names_well_formed
