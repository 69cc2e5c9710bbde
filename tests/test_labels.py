"""The MoE labeler on real Flax models and on MaxText/Flaxformer/HF-style trees."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import skewadam_jax as sj
from skewadam_jax import _labels
from skewadam_jax import _tree
import moe_models as mm


def _labels_by_path(tree):
  labels = sj.moe_param_labels(tree)
  leaves, _ = jax.tree_util.tree_flatten_with_path(labels)
  return {_tree.path_str(p): label for p, label in leaves}


def test_nnx_model_labels_at_init_and_update_agree():
  model = mm.NNXMoELM(nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  assert _labels_by_path(state) == mm.NNX_EXPECTED
  pure = nnx.to_pure_dict(state)  # what nnx.Optimizer passes to `update`: no `value`
  assert _labels_by_path(pure) == mm.NNX_EXPECTED


@pytest.mark.parametrize('boxed', [False, True])
def test_linen_model_labels(boxed):
  model = mm.LinenMoELM(boxed=boxed)
  variables = model.init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))
  assert _labels_by_path(variables) == mm.LINEN_EXPECTED
  if boxed:
    # Boxed params end in `value` at init; the unboxed updates do not.
    unboxed = jax.tree.map(lambda x: x, variables)
    from flax.core import meta
    assert _labels_by_path(meta.unbox(unboxed)) == mm.LINEN_EXPECTED


@pytest.mark.parametrize('tree,expected', [
    (mm.MAXTEXT_TREE, mm.MAXTEXT_EXPECTED),
    (mm.FLAXFORMER_TREE, mm.FLAXFORMER_EXPECTED),
    (mm.HF_TREE, mm.HF_EXPECTED),
], ids=['maxtext', 'flaxformer', 'hf'])
def test_known_layouts(tree, expected):
  assert _labels_by_path(tree) == expected


def test_whole_segments_only():
  assert _labels.match_path('gate', 'mlp/gate/kernel')
  assert not _labels.match_path('gate', 'mlp/gate_proj/kernel')
  assert not _labels.match_path('experts', 'mlp/shared_experts/w1')
  assert _labels.match_path('*moe*/**/wo', 'decoder/MoeBlock_0/wo')
  assert _labels.match_path('*moe*/**/wo', 'decoder/moe/inner/wo')
  assert not _labels.match_path('*moe*/**/wo', 'decoder/mlp/wo')
  assert _labels.label_for_path('anything/else') == 'backbone'


def test_user_rules_come_first_and_default_is_backbone():
  tree = {'moe': {'experts': {'w1': jnp.zeros((2, 3, 4))}, 'router': jnp.zeros((3, 2))},
          'mystery': jnp.zeros(3)}
  labels = sj.moe_param_labels(tree, rules=[('moe/router', 'backbone'), ('mystery', 'experts')])
  assert labels == {'moe': {'experts': {'w1': 'experts'}, 'router': 'backbone'},
                    'mystery': 'experts'}
  only_user = sj.moe_param_labels(tree, rules=[('w1', 'router')], use_default_rules=False)
  assert only_user == {'moe': {'experts': {'w1': 'router'}, 'router': 'backbone'},
                       'mystery': 'backbone'}
  with pytest.raises(TypeError, match='rules'):
    sj.moe_param_labels(tree, rules=['experts'])


def test_label_table_reports_every_leaf_with_state_bytes():
  model = mm.NNXMoELM(nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  rows = sj.label_table(state)
  assert {r.path: r.tier for r in rows} == mm.NNX_EXPECTED
  by_path = {r.path: r for r in rows}
  # experts: factored per expert, no momentum: (E*D + E*F) float32
  assert by_path['blocks/1/experts/w1'].state_bytes == 4 * (mm.E * mm.D + mm.E * mm.F)
  # router: exact second moment, no momentum
  assert by_path['blocks/1/router/kernel'].state_bytes == 4 * mm.D * mm.E
  # backbone matrix: fp32 momentum + row + col
  assert by_path['embed/embedding'].state_bytes == 4 * (mm.V * mm.D + mm.V + mm.D)
  text = sj.format_label_table(rows)
  for path in mm.NNX_EXPECTED:
    assert path in text
  total = sj.optimizer_state_bytes(sj.skewadam(1e-3), state)
  assert sum(r.state_bytes for r in rows) == total


def test_label_naming_no_tier_is_a_clear_error():
  params = {'w': jnp.zeros((2, 3))}
  tx = sj.skewadam(1e-3, param_labels={'w': 'expert'})
  with pytest.raises(ValueError, match=r"\['backbone', 'experts', 'router'\]"):
    tx.init(params)


def test_label_tree_not_matching_params_is_a_clear_error():
  params = {'w': jnp.zeros((2, 3)), 'b': jnp.zeros(3)}
  tx = sj.skewadam(1e-3, param_labels={'w': 'backbone'})
  with pytest.raises(ValueError, match='same structure as the params'):
    tx.init(params)


def test_prefix_label_tree_is_broadcast():
  params = {'dense': {'w': jnp.ones((2, 3)), 'b': jnp.ones(3)}, 'r': jnp.ones((3, 2))}
  tx = sj.skewadam(1e-3, param_labels={'dense': 'backbone', 'r': 'router'})
  state = tx.init(params)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  assert isinstance(optax.tree_utils.tree_get(state, 'inner_states'), dict)
