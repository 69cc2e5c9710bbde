"""Batch axes: which axes index independent matrices, and estimators that respect them.

The recorded trees of real MoE models (`tests/data/real_trees`) hold each leaf's
hand-judged batch axes (the scanned layer axis wherever it sits, the expert axis,
gemma's stacked projections). `moe_batch_axes` must give exactly those, from paths and
shapes alone and from logical axis names; and on every model, scaling one slice's
gradient by 1000 must leave every other slice's update unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import skewadam_jax as sj
from skewadam_jax.estimators import factored as _factored
from skewadam_jax.structure import paths as _paths
from skewadam_jax.transforms import tier_leaf as _tier_leaf
from real_trees import abstract as _abstract
from real_trees import nest as _nest
from real_trees import record as _record

from real_trees import FILES


def _axes_by_path(tree: Any) -> dict[str, tuple[int, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
  return {_paths.path_str(p): v for p, v in flat}


def _quietly(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    return fn(*args, **kwargs)


@pytest.fixture(params=FILES, ids=[f.stem for f in FILES])
def record(request) -> dict[str, Any]:
  return _record(request.param)


def _expected(record) -> dict[str, tuple[int, ...]]:
  return {leaf['path']: tuple(leaf['batch_axes']) for leaf in record['leaves']}


def _wrong(got: dict[str, Any], expected: dict[str, Any]) -> str:
  bad = [f'  {p}: {got.get(p)} (hand-judged {e})' for p, e in expected.items()
         if got.get(p) != e]
  return f'{len(bad)} wrong:\n' + '\n'.join(bad)


# ---------------------------------------------------------------------------- real trees


def test_paths_and_shapes_give_the_hand_judged_batch_axes(record):
  tree = _nest(record['leaves'], _abstract)
  got = _axes_by_path(_quietly(sj.moe_batch_axes, tree))
  assert got == _expected(record), _wrong(got, _expected(record))


def test_axis_names_give_the_same_batch_axes(record):
  """With the recorded names on NNX variables, as MaxText attaches them."""
  def variable(leaf):
    if leaf['axis_names'] is None:
      return nnx.Param(_abstract(leaf))
    return nnx.Param(_abstract(leaf), out_sharding=tuple(leaf['axis_names']))

  with nnx.use_eager_sharding(False):
    state = _nest(record['leaves'], variable)
  got = _axes_by_path(_quietly(sj.moe_batch_axes, state, use_axis_names=True))
  assert got == _expected(record), _wrong(got, _expected(record))
  # The default (no names) on the boxed state agrees too: init and update see the same.
  assert _axes_by_path(_quietly(sj.moe_batch_axes, state)) == _expected(record)


def test_label_table_shows_the_batch_axes(record):
  tree = _nest(record['leaves'], _abstract)
  rows = _quietly(sj.label_table, sj.skewadam(1e-3), tree)
  assert {r.path: r.batch_axes for r in rows} == _expected(record)
  text = rows.format()
  assert 'batch axes' in text.splitlines()[0]


def _slice_index(shape, axis):
  index = [slice(None)] * len(shape)
  index[axis] = 0
  return tuple(index)


def _real_tree_arrays(record, seed=0):
  rng = np.random.default_rng(seed)
  return _nest(record['leaves'], lambda leaf: jnp.asarray(
      rng.standard_normal(leaf['shape']) * 0.02, jnp.float32))


# The models with batch axes other than the leading ones (the boxed Linen copy of
# MaxText Mixtral has the scanned NNX tree's leaves); on the others the default layout
# is the hand-judged one and tests/transforms/test_frozen.py holds the numerics.
SLICED = [f for f in FILES if f.stem != 'maxtext_mixtral_scan_linen' and any(
    tuple(leaf['batch_axes']) != tuple(range(max(len(leaf['shape']) - 2, 0)))
    for leaf in _record(f)['leaves'])]


@pytest.mark.slow
@pytest.mark.parametrize('record', [_record(f) for f in SLICED], ids=[f.stem for f in SLICED])
def test_one_slice_scaled_by_1000_moves_no_other_slice(record):
  """Every leaf with batch axes: scale slice 0 along one batch axis of the gradient by
  1000 and every other slice's update stays bitwise the same (2 steps of the published
  tiers, with weight decay, the clip, momentum and the eps floor engaged)."""
  params = _real_tree_arrays(record)
  grads = [_real_tree_arrays(record, seed=s) for s in (1, 2)]
  paths = [p for p, _ in _paths.flatten_with_paths(params)[0]]
  treedef = jax.tree_util.tree_structure(params)
  by_path = _expected(record)
  batch = [by_path[p] for p in paths]
  tx = sj.skewadam(1e-3, weight_decay=0.1)
  step = jax.jit(lambda g, state: tx.update(g, state, params))

  def run(gs):
    state = _quietly(tx.init, params)
    outs = []
    for g in gs:
      u, state = _quietly(step, g, state)
      outs.append(treedef.flatten_up_to(u))
    return outs

  base = run(grads)
  # Alternate leaves take their first and their last batch axis (layer / expert).
  axis_of = [b[-(i % 2)] if b else None for i, b in enumerate(batch)]
  scaled = [treedef.unflatten([
      x if a is None else x.at[_slice_index(x.shape, a)].multiply(1000.0)
      for x, a in zip(treedef.flatten_up_to(g), axis_of)]) for g in grads]
  moved = run(scaled)
  for n in range(len(grads)):
    for path, a, u0, u1 in zip(paths, axis_of, base[n], moved[n]):
      if a is None:
        continue
      rest = [slice(None)] * u0.ndim
      rest[a] = slice(1, None)
      np.testing.assert_array_equal(
          np.asarray(u1[tuple(rest)]), np.asarray(u0[tuple(rest)]),
          err_msg=f"{record['model']} {path}: scaling slice 0 of axis {a} moved others")

# ---------------------------------------------------------------------------- the estimator


def _per_slice_reference(x, grads_seq, batch_axes, tier):
  """The same tier on each batch slice separately, in the default layout.

  Moves the batch axes to the front and reshapes each slice to [prod(rows), C]: the
  default code path (itself checked against NumPy in test_tiered / test_numerics).
  """
  ndim = x.ndim
  matrix = [a for a in range(ndim) if a not in batch_axes]
  order = list(batch_axes) + matrix
  inverse = np.argsort(order)
  bshape = [x.shape[a] for a in batch_axes]
  rshape = [x.shape[a] for a in matrix[:-1]]
  c = x.shape[matrix[-1]]

  def to_default(a):
    t = jnp.transpose(a, order)
    return t.reshape(bshape + [int(np.prod(rshape, dtype=int)) if rshape else 1, c]) \
        if len(matrix) >= 2 else t

  tx = sj.scale_by_tiered_adam(tier=tier)
  state = tx.init({'w': to_default(x)})
  outs = []
  for g in grads_seq:
    u, state = tx.update({'w': to_default(g)}, state)
    u = u['w'].reshape([x.shape[a] for a in order])
    outs.append(jnp.transpose(u, inverse))
  return outs


CASES = [
    ((6, 3, 4, 5), (1,)),  # MaxText scanned attention [d, L, heads, head_dim]
    ((4, 3, 6, 5), (0, 1)),  # scanned expert bank [E, L, in, out] (default layout)
    ((5, 2, 3, 7), (1, 2)),  # nested scan [d, L, L_local, f]
    ((6, 3, 4), ()),  # unscanned attention [d, heads, head_dim]: one matrix
    ((7, 3, 5), (2,)),  # batch axis last
]


@pytest.mark.parametrize('shape,batch', CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize('tier', [
    sj.PUBLISHED_TIERS['backbone'],
    sj.PUBLISHED_TIERS['experts'],
    sj.Tier(momentum=True, eps_mode='adam', clip_threshold=0.05),
    sj.Tier(momentum=False, clip_threshold=0.05),
], ids=['backbone', 'experts', 'adam-eps-clip', 'floor-clip'])
def test_factored_with_batch_axes_equals_each_slice_alone(shape, batch, tier):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  scales = 10.0 ** rng.uniform(-3, 1, size=shape)
  grads = [jnp.asarray(rng.standard_normal(shape) * scales, jnp.float32) for _ in range(5)]
  tx = sj.scale_by_tiered_adam(tier=tier, batch_axes={'w': batch})
  state = tx.init({'w': x})
  expect = _per_slice_reference(x, grads, batch, tier)
  for g, e in zip(grads, expect):
    u, state = tx.update({'w': g}, state)
    np.testing.assert_allclose(np.asarray(u['w']), np.asarray(e), rtol=2e-6, atol=1e-9)


def test_statistics_shapes_follow_the_batch_axes():
  tx = sj.scale_by_tiered_adam(tier=sj.PUBLISHED_TIERS['backbone'],
                               batch_axes={'q': (1,), 'norm': (1,), 'bias': (0,)})
  params = {'q': jnp.zeros((6, 3, 4, 5)), 'norm': jnp.zeros((6, 3)),
            'bias': jnp.zeros((4, 5))}
  state = tx.init(params)
  assert state.v_row['q'].shape == (6, 3, 4)  # rows (d, heads) per layer
  assert state.v_col['q'].shape == (3, 5)  # head_dim per layer
  # A vector per slice: the exact estimate, the parameter's shape.
  assert state.v['norm'].shape == (6, 3) and state.v['bias'].shape == (4, 5)
  assert state.v_row['norm'] is None


def test_specs_of_a_scanned_leaf_keep_the_axes_each_statistic_keeps():
  est = sj.Factored().for_leaf((6, 3, 4, 5), (1,))
  specs = est.specs(('embed', 'layers', 'heads', None), (6, 3, 4, 5), None, 'q')
  assert tuple(specs['v_row']) == ('embed', 'layers', 'heads')
  assert tuple(specs['v_col']) == ('layers', None)
  default = sj.Factored().for_leaf((4, 6, 5))
  assert tuple(default.specs(('exp', 'a', 'b'), (4, 6, 5), None, 'w')['v_col']) == ('exp', 'b')


def test_default_layout_is_one_explicit_tuple_whatever_its_spelling():
  # Estimators get explicit batch axes: None (a direct call) means the default layout,
  # the same estimator as its explicit spelling (the frozen outputs pin its numerics).
  assert sj.Factored().for_leaf((4, 6, 5), (0,)) == sj.Factored().for_leaf((4, 6, 5))
  assert sj.Factored().for_leaf((4, 6, 5)).batch_axes == (0,)
  assert sj.Factored().for_leaf((6, 5), ()) == sj.Factored().for_leaf((6, 5))
  assert sj.Factored().for_leaf((6, 5)).batch_axes == ()
  assert sj.Factored().for_leaf((4, 5), (0,)).name == 'exact'
  # The tier normalises them once, naming the leaf by its path in errors.
  est = _tier_leaf.leaf_estimator((4, 6, 5), sj.Tier(), (-3,), 'blocks/w')
  assert est == _factored.Factored((0,))
  with pytest.raises(ValueError, match=r'`batch_axes` \(3,\) of blocks/w are out of range'):
    _tier_leaf.leaf_estimator((4, 6, 5), sj.Tier(), (3,), 'blocks/w')


def test_skewadam_default_batch_axes_on_our_trees_are_the_default_layout():
  import trees  # noqa: PLC0415
  params = trees.nest(trees.init_params())
  axes = _axes_by_path(sj.moe_batch_axes(params))
  for path, (shape, _) in trees.MOE_LEAVES.items():
    assert axes[path] == tuple(range(max(len(shape) - 2, 0))), path


# ---------------------------------------------------------------------------- bad input


def test_bad_batch_axes_raise_naming_the_leaf():
  params = {'w': jnp.zeros((4, 5, 6))}
  with pytest.raises(ValueError, match=r'`batch_axes` \(3,\) of w are out of range.*-3\.\.2'):
    sj.scale_by_tiered_adam(batch_axes={'w': (3,)}).init(params)
  with pytest.raises(ValueError, match='name an axis twice'):
    sj.scale_by_tiered_adam(batch_axes={'w': (0, -3)}).init(params)
  with pytest.raises(TypeError, match='`batch_axes`'):
    sj.scale_by_tiered_adam(batch_axes={'w': 'layers'}).init(params)
  with pytest.raises(ValueError, match=r"no entry for \['v'\]"):
    sj.scale_by_tiered_adam(batch_axes={'w': (0,)}).init({'w': params['w'], 'v': params['w']})
  with pytest.raises(TypeError, match=r'\(pattern, axes\) pairs'):
    sj.moe_batch_axes(params, rules=[('w', 1)])
  with pytest.raises(ValueError, match='batch-axes rule'):
    sj.moe_batch_axes(params, rules=[('w', (5,))])


def test_rules_come_first_and_a_tree_computed_once_fits_the_pure_arrays():
  params = {'layers': {'a': jnp.zeros((8, 3, 5)), 'b': jnp.zeros((8, 3, 5))}}
  with pytest.warns(sj.UnsureLabelWarning, match='layers: axes'):
    sj.moe_batch_axes(params)  # every axis has one length: which one stacks is unclear
  axes = sj.moe_batch_axes(params, rules=[('layers/**', (1,))])
  assert _axes_by_path(axes) == {'layers/a': (1,), 'layers/b': (1,)}
  with nnx.use_eager_sharding(False):
    boxed = jax.tree.map(nnx.Param, params)
  tx = sj.skewadam(1e-3, batch_axes=sj.moe_batch_axes(boxed, rules=[('layers/**', (1,))]),
                   param_labels=sj.make_labeler([('layers/**', 'backbone')]))
  state = tx.init(params)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)


def test_an_expert_written_as_its_own_module_is_one_matrix():
  params = {'moe': {'router': {'kernel': jnp.zeros((8, 4))},
                    **{f'expert_{i}': {'w1': jnp.zeros((8, 16)), 'b1': jnp.zeros((16,))}
                       for i in range(4)}},
            'bank': {'experts': {'w': jnp.zeros((4, 8, 16)), 'bias': jnp.zeros((4, 16))},
                     'router': {'kernel': jnp.zeros((8, 4))}}}
  axes = _axes_by_path(_quietly(sj.moe_batch_axes, params))
  assert axes['moe/expert_0/w1'] == () and axes['moe/expert_3/b1'] == ()
  assert axes['bank/experts/w'] == (0,) and axes['bank/experts/bias'] == (0,)
  assert axes['bank/router/kernel'] == ()
