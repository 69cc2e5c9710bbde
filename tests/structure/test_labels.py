"""The MoE labeler on real Flax models and on MaxText/Flaxformer/HF-style trees."""

import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax import nnx

import skewadam_jax as sj
from skewadam_jax.structure import name_rules as _name_rules
from skewadam_jax.structure import paths as _paths
import moe_models as mm


def _labels_by_path(tree):
  labels = sj.moe_param_labels(tree)
  leaves, _ = jax.tree_util.tree_flatten_with_path(labels)
  return {_paths.path_str(p): label for p, label in leaves}


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
  assert _paths.match_path('gate', 'mlp/gate/kernel')
  assert not _paths.match_path('gate', 'mlp/gate_proj/kernel')
  assert not _paths.match_path('experts', 'mlp/shared_experts/w1')
  assert _paths.match_path('*moe*/**/wo', 'decoder/MoeBlock_0/wo')
  assert _paths.match_path('*moe*/**/wo', 'decoder/moe/inner/wo')
  assert not _paths.match_path('*moe*/**/wo', 'decoder/mlp/wo')
  assert _name_rules.label_for_path('anything/else') == 'backbone'


def test_user_rules_come_first_and_default_is_backbone():
  tree = {'moe': {'experts': {'w1': jnp.zeros((2, 3, 4))}, 'router': jnp.zeros((3, 2))},
          'mystery': jnp.zeros(3)}
  # The user's rule leaves the experts without a router: reported, labels unchanged.
  with pytest.warns(sj.UnsureLabelWarning,
                    match="moe/experts/w1: labelled 'experts' but no leaf .* 'router'"):
    labels = sj.moe_param_labels(tree, rules=[('moe/router', 'backbone'),
                                              ('mystery', 'experts')])
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
  rows = sj.label_table(sj.skewadam(1e-3), state)
  assert {r.path: r.tier for r in rows} == mm.NNX_EXPECTED
  by_path = {r.path: r for r in rows}
  # experts: factored per expert, no momentum: (E*D + E*F) float32
  assert by_path['blocks/1/experts/w1'].state_bytes == 4 * (mm.E * mm.D + mm.E * mm.F)
  # router: exact second moment, no momentum
  assert by_path['blocks/1/router/kernel'].state_bytes == 4 * mm.D * mm.E
  # backbone matrix: fp32 momentum + row + col
  assert by_path['embed/embedding'].state_bytes == 4 * (mm.V * mm.D + mm.V + mm.D)
  text = rows.format()
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
  tiered = state[0]
  assert isinstance(tiered, sj.TieredAdamState)
  # Each leaf keeps its label's tier's state: backbone momentum, the router's exact v.
  assert tiered.mu['dense']['w'].shape == (2, 3) and tiered.mu['r'] is None
  assert tiered.v['r'].shape == (3, 2) and tiered.v['dense']['w'] is None


# ---------------------------------------------------------------------------- rules


def _quiet_labels(tree, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    return _labels_by_path_of(sj.moe_param_labels(tree, **kwargs))


def _labels_by_path_of(labels):
  leaves, _ = jax.tree_util.tree_flatten_with_path(labels)
  return {_paths.path_str(p): label for p, label in leaves}


def test_double_star_never_reaches_into_shared_experts():
  assert not _paths.match_path('*moe*/**/wi_0', 'moe_block/shared_experts/wi_0/kernel')
  assert not _paths.match_path('*moe*/**/wi_0', 'moe/SharedExpert_0/inner/wi_0')
  assert _paths.match_path('*moe*/**/wi_0', 'moe_block/MoeBlock_0/wi_0')
  assert _paths.match_path('moe/shared_experts/wi_0', 'x/moe/shared_experts/wi_0/kernel')


def test_shared_experts_are_backbone_inside_an_moe_block():
  z = jnp.zeros
  tree = {'DeepSeekMoeBlock_0': {
      'MoeBlock_0': {'gate': {'kernel': z((8, 4))}, 'wi_0': z((4, 8, 6)), 'wo': z((4, 6, 8))},
      'shared_experts': {'wi_0': {'kernel': z((8, 6))}, 'wo': {'kernel': z((6, 8))}},
      'shared_mlp': {'wi': {'kernel': z((8, 6))}}}}
  assert _quiet_labels(tree) == {
      'DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel': 'router',
      'DeepSeekMoeBlock_0/MoeBlock_0/wi_0': 'experts',
      'DeepSeekMoeBlock_0/MoeBlock_0/wo': 'experts',
      'DeepSeekMoeBlock_0/shared_experts/wi_0/kernel': 'backbone',
      'DeepSeekMoeBlock_0/shared_experts/wo/kernel': 'backbone',
      'DeepSeekMoeBlock_0/shared_mlp/wi/kernel': 'backbone'}


def test_new_names_routed_experts_router_logits_scales_and_biases():
  z = jnp.zeros
  tree = {'mlp': {'routed_experts': {'gate': {'kernel': z((8, 4))}, 'wi_0': z((4, 8, 6))},
                  'shared_expert_gate': {'kernel': z((8, 1))}},
          'moe': {'router_logits': {'w': z((8, 4))}, 'router_scale': z(8),
                  'per_expert_scale': z(4), 'experts': {'w': z((4, 8, 6))},
                  'MoeBlock_0': {'wo': z((4, 6, 8)), 'wo_bias': z((4, 8))}}}
  assert _quiet_labels(tree) == {
      'mlp/routed_experts/gate/kernel': 'router', 'mlp/routed_experts/wi_0': 'experts',
      'mlp/shared_expert_gate/kernel': 'backbone',
      'moe/router_logits/w': 'router', 'moe/router_scale': 'router',
      'moe/per_expert_scale': 'experts', 'moe/experts/w': 'experts',
      'moe/MoeBlock_0/wo': 'experts', 'moe/MoeBlock_0/wo_bias': 'experts'}


# ---------------------------------------------------------------------------- structure


def test_experts_beside_a_router_by_their_leading_axis():
  """gemma's MoE is called `mlp`: only the router's name and the shapes say so."""
  z = jnp.zeros
  layer = {'attn': {'attn_vec_einsum': {'w': z((4, 8, 16))}},  # 4 heads = E, elsewhere
           'mlp': {'router_logits': {'w': z((16, 4))}, 'gating_einsum': {'w': z((4, 2, 6, 16))},
                   'linear': {'w': z((4, 6, 16))}},
           'mlp2': {'gating_einsum': z((2, 6, 16)), 'linear': z((6, 16))}}
  labels = _quiet_labels({'layer_0': layer})
  assert labels == {
      'layer_0/attn/attn_vec_einsum/w': 'backbone',
      'layer_0/mlp/router_logits/w': 'router', 'layer_0/mlp/gating_einsum/w': 'experts',
      'layer_0/mlp/linear/w': 'experts',
      'layer_0/mlp2/gating_einsum': 'backbone', 'layer_0/mlp2/linear': 'backbone'}
  rows = {r.path: r.note for r in sj.label_table(sj.skewadam(1e-3), {'layer_0': layer})}
  assert rows['layer_0/mlp/linear/w'] == (
      'structure: leading axis 4 = the expert count of router layer_0/mlp/router_logits/w')


def test_a_dense_kernel_beside_a_bank_of_e_experts_is_the_router():
  z = jnp.zeros
  tree = {'moe': {'experts': {'w1': z((4, 8, 6)), 'w2': z((4, 6, 8))},
                  'gating': {'proj': {'kernel': z((8, 4)), 'bias': z(4)}}},
          'mlp': {'kernel': z((8, 4))}}  # [d, 4] outside the MoE block: not a router
  assert _quiet_labels(tree) == {
      'moe/experts/w1': 'experts', 'moe/experts/w2': 'experts',
      'moe/gating/proj/kernel': 'router', 'moe/gating/proj/bias': 'router',
      'mlp/kernel': 'backbone'}


class _LinenExpert(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(mm.D, name='wo')(nn.gelu(nn.Dense(mm.F, name='wi')(x)))


class _LinenGate(nn.Module):
  """A router that is a plain dense layer inside a module named for the gate."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(mm.E)(x)


class _LinenPerExpertMoE(nn.Module):
  """One Linen module per expert (`expert_0..expert_{E-1}`), Switch-style."""

  @nn.compact
  def __call__(self, x):
    probs = jax.nn.softmax(_LinenGate(name='TopKGate')(x))
    ys = [_LinenExpert(name=f'expert_{i}')(x) for i in range(mm.E)]
    return sum(p[..., None] * y for p, y in zip(jnp.moveaxis(probs, -1, 0), ys))


def test_one_module_per_expert_and_a_gate_module_router():
  variables = _LinenPerExpertMoE().init(jax.random.key(0), jnp.zeros((2, mm.D)))
  labels = _quiet_labels(variables)
  assert labels['params/TopKGate/Dense_0/kernel'] == 'router'
  assert labels['params/TopKGate/Dense_0/bias'] == 'router'
  experts = [p for p in labels if '/expert_' in p]
  assert len(experts) == 4 * mm.E and all(labels[p] == 'experts' for p in experts)
  # Same labels on the pure arrays, and with a trailing `value` at init.
  boxed = jax.tree.map(lambda x: {'value': x}, variables)
  assert _quiet_labels(boxed) == labels


def test_structure_works_on_abstract_leaves_and_under_jit():
  z = jnp.zeros
  tree = {'layer': {'mlp': {'router_logits': {'w': z((16, 4))}, 'linear': {'w': z((4, 6, 16))}}}}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  expected = _quiet_labels(tree)
  assert _quiet_labels(abstract) == expected
  seen = {}

  @jax.jit
  def f(t):
    seen.update(_labels_by_path_of(sj.moe_param_labels(t)))
    return t

  f(tree)
  assert seen == expected


# ---------------------------------------------------------------------------- reports


def test_experts_without_router_and_router_without_experts_are_reported():
  with pytest.warns(sj.UnsureLabelWarning, match="moe/experts/w1: labelled 'experts'"):
    sj.moe_param_labels({'moe': {'experts': {'w1': jnp.zeros((4, 8, 6))}}})
  with pytest.warns(sj.UnsureLabelWarning, match="moe/router: labelled 'router'"):
    sj.moe_param_labels({'moe': {'router': jnp.zeros((8, 4))}})
  with pytest.raises(ValueError, match=r"moe/router: .*sj\.make_labeler"):
    sj.moe_param_labels({'moe': {'router': jnp.zeros((8, 4))}}, strict=True)
  # The user's own rules are not guesses.
  quiet = sj.make_labeler([('moe/router', 'router')], strict=True)
  assert quiet({'moe': {'router': jnp.zeros((8, 4))}}) == {'moe': {'router': 'router'}}


def test_label_table_format_has_a_note_column():
  tree = {'moe': {'experts': {'w1': jnp.zeros((4, 8, 6))}}}
  with pytest.warns(sj.UnsureLabelWarning):
    text = sj.label_table(sj.skewadam(1e-3), tree).format()
  header = text.splitlines()[0].split()
  assert header[-1] == 'note'
  assert "UNSURE: labelled 'experts' but no leaf of the tree is labelled 'router'" in text
  assert text.splitlines()[-1].endswith('1 unsure labels (see note)')


# ---------------------------------------------------------------------------- axis names


class _NamedBank(nnx.Module):
  """An expert bank that only its logical axis names identify (no name, no router nearby)."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.1)
    with nnx.use_eager_sharding(False):
      self.tok = nnx.Embed(mm.V, mm.D, rngs=rngs)
      self.moe = nnx.Dict(router=nnx.Linear(mm.D, mm.E, use_bias=False, rngs=rngs))
      self.ffn_bank = nnx.Param(init(rngs.params(), (mm.E, mm.D, mm.F)),
                                out_sharding=('exp', 'embed', 'mlp'))

  def __call__(self, tokens):
    x = self.tok(tokens)
    gates = jax.nn.softmax(self.moe['router'](x))
    h = jnp.einsum('btd,edf->btef', x, self.ffn_bank[...])
    return jnp.sum(jnp.einsum('btef,bte->btf', h, gates) ** 2)


def test_axis_names_only_confirm_in_a_labeler_function():
  state = nnx.state(_NamedBank(nnx.Rngs(0)), nnx.Param)
  with pytest.warns(sj.UnsureLabelWarning) as rec:
    labels = sj.moe_param_labels(state)  # names do not decide: same as on pure arrays
  assert _labels_by_path_of(labels)['ffn_bank'] == 'backbone'
  # Without names the bank looks like a dense `ffn`; the lone router still gets reported.
  with pytest.warns(sj.UnsureLabelWarning, match="moe/router/kernel: labelled 'router'"):
    pure = sj.make_labeler()(nnx.to_pure_dict(state))
  assert _labels_by_path_of(pure) == _labels_by_path_of(labels)
  message = str(rec[0].message)
  assert "ffn_bank [4, 16, 24]: axis 0 is named 'exp' but the leaf is 'backbone'" in message
  assert 'use_axis_names=True' in message


@pytest.mark.slow
def test_label_tree_from_axis_names_trains_with_nnx_optimizer():
  model = _NamedBank(nnx.Rngs(0))
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(nnx.state(model, nnx.Param), use_axis_names=True)
    assert _labels_by_path_of(labels) == {'tok/embedding': 'backbone',
                                          'moe/router/kernel': 'router',
                                          'ffn_bank': 'experts'}
    # The label tree (of variables) also labels the pure arrays `update` passes.
    opt = nnx.Optimizer(model, sj.skewadam(1e-2, param_labels=labels), wrt=nnx.Param)
    tokens = jnp.arange(6).reshape(2, 3) % mm.V
    before = model.ffn_bank[...]
    opt.update(model, nnx.grad(lambda m: m(tokens))(model))
  assert not jnp.allclose(before, model.ffn_bank[...])
  v_row = optax.tree_utils.tree_get(opt.opt_state, 'v_row')
  mu = optax.tree_utils.tree_get(opt.opt_state, 'mu')
  assert v_row['ffn_bank'].shape == (mm.E, mm.D)  # factored per expert: the experts tier
  assert mu['ffn_bank'] is None  # and no momentum, as the experts tier keeps none


def test_a_bare_router_kernel_brings_only_its_bias_into_the_router_tier():
  """An unnamed router kernel [d, E] that is a bare leaf of the block holding the bank:
  its bias [E] is the router's, the block's norm scale and dense kernel are not."""
  z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  tree = {'tok': z(64, 16),
          'blk': {'sel': z(16, 4), 'sel_b': z(4), 'scale': z(16), 'w': z(16, 16),
                  'experts': {'w_in': z(4, 16, 32), 'w_out': z(4, 32, 16)}}}
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(tree)
  assert labels['blk'] == {'sel': 'router', 'sel_b': 'router', 'scale': 'backbone',
                           'w': 'backbone', 'experts': {'w_in': 'experts',
                                                        'w_out': 'experts'}}


def test_a_per_expert_scale_beside_a_bank_keeps_the_bank_and_its_router():
  """A per-expert scale [E] in the bank's module, all names random: the bank (its scale
  too, expert axis 0) and the router kernel beside it are read from shapes, quietly."""
  z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  tree = {'ab': {'kr': z(8, 4)}, 'cd': {'wx': z(4, 8, 12), 'wy': z(4, 12, 8), 'sc': z(4)}}
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(tree)
    axes = sj.moe_batch_axes(tree)
  assert labels == {'ab': {'kr': 'router'},
                    'cd': {'wx': 'experts', 'wy': 'experts', 'sc': 'experts'}}
  assert axes == {'ab': {'kr': ()}, 'cd': {'wx': (0,), 'wy': (0,), 'sc': (0,)}}


@pytest.mark.parametrize('bank', ['units', 'stacked'])
def test_a_vector_beside_a_named_router_kernel_is_its_bias(bank):
  """A selection bias [E] with a random name beside a `router` kernel [d, E] in one flat
  dict, the bank in a module of its own (one module per expert, or stacked): router."""
  z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  experts = ([{'w1': z(8, 12), 'w2': z(12, 8)} for _ in range(4)] if bank == 'units'
             else {'w1': z(4, 8, 12), 'w2': z(4, 12, 8)})
  tree = {'router': z(8, 4), 'bq': z(4), 'experts': experts}
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(tree)
  assert labels['router'] == labels['bq'] == 'router'
  assert set(jax.tree_util.tree_leaves(labels['experts'])) == {'experts'}


def test_the_kernel_beside_a_named_router_bias_is_the_router():
  """A router kernel [d, E] with a random name beside a `router_bias` [E] and dense
  kernels [d, f], one module per expert beside them: the kernel mapping to E is the
  router's (not silently backbone)."""
  z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  tree = {'kt': z(8, 4), 'router_bias': z(4), 'pre_norm': z(8), 'bx': z(8, 12),
          'rk': z(12, 8), 'experts': [{'w1': z(8, 12), 'w2': z(12, 8)} for _ in range(4)]}
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(tree)
  assert {k: v for k, v in labels.items() if k != 'experts'} == {
      'kt': 'router', 'router_bias': 'router', 'pre_norm': 'backbone', 'bx': 'backbone',
      'rk': 'backbone'}


def test_a_vector_beside_a_router_kernel_and_its_flat_bank_is_reported():
  """In one flat module with a router kernel [d, E] and the bank's leaves [E, ...], a
  vector [E] may be the router's bias or a per-expert scale: no name tells, so it is
  named in the warning; one named after the router kernel (`kr_b`) is its bias."""
  z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  tree = {'kr': z(8, 4), 'kr_b': z(4), 'sc': z(4), 'wx': z(4, 8, 12), 'wy': z(4, 12, 8)}
  labels, text = _unsure(tree)
  assert labels == {'kr': 'router', 'kr_b': 'router', 'sc': 'router', 'wx': 'experts',
                    'wy': 'experts'}
  assert _named_in('sc', text) and not _named_in('kr_b', text)
  assert "sj.make_labeler([('sc', 'experts')])" in text


def test_an_expert_mesh_axis_on_the_router_input_width_confirms_nothing():
  """A mesh axis called `expert` sharding the router kernel's input width d ([d, E]
  named (expert, tensor)) says nothing about the expert count: a dense output layer
  [d, V] sharded the same way is not reported."""
  boxed = lambda shape, names: nn.Partitioned(jnp.zeros(shape), names=names)  # noqa: E731
  tree = {'router': {'kernel': boxed((8, 4), ('expert', 'tensor'))},
          'experts': {'w1': boxed((4, 8, 12), ('expert', None, None)),
                      'w2': boxed((4, 12, 8), ('expert', None, None))},
          'lm_head': {'kernel': boxed((8, 11), ('expert', None))}}
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(tree)
    sj.moe_batch_axes(tree)
  assert _labels_by_path_of(labels) == {'router/kernel': 'router', 'experts/w1': 'experts',
                                        'experts/w2': 'experts', 'lm_head/kernel': 'backbone'}


# ---------------------------------------------------------------------------- numbered units


def _unsure(tree, **kwargs):
  """Labels by path, and the text of every unsure-label warning."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    labels = _labels_by_path_of(sj.moe_param_labels(tree, **kwargs))
  text = '\n'.join(str(w.message) for w in caught
                   if issubclass(w.category, sj.UnsureLabelWarning))
  return labels, text


def _named_in(path, text):
  return re.search(rf'(^|\W){re.escape(path)}\W', text) is not None


_UNIT_CONTAINERS = {'list': list, 'tuple': tuple,
                    'digit_keys': lambda xs: {str(i): x for i, x in enumerate(xs)}}
if hasattr(nnx, 'List'):  # Flax >= 0.11
  _UNIT_CONTAINERS['nnx_list'] = nnx.List


@pytest.mark.parametrize('container', sorted(_UNIT_CONTAINERS))
def test_a_list_of_units_beside_a_router_is_reported(container):
  """E separate matrices [d, f] (and [f, d]), one per unit, beside a kernel [d, E]: an
  expert bank kept as separate leaves and its router, or E dense layers beside an
  unrelated matrix. No name says which, so the labels stay lossless (backbone) and the
  warning names every unit and the router candidate, with the rules that settle it."""
  z, d, e, f, v = jnp.zeros, mm.D, mm.E, mm.F, mm.V
  make = _UNIT_CONTAINERS[container]
  tree = {'tab': z((v, d)), 'q': z((d, e)), 'u': make([z((d, f)) for _ in range(e)]),
          'v': make([z((f, d)) for _ in range(e)]), 'out': z((d, v))}
  labels, text = _unsure(tree)
  units = [f'{n}/{i}' for n in ('u', 'v') for i in range(e)]
  assert set(labels) == {'tab', 'q', 'out', *units}
  assert set(labels.values()) == {'backbone'}
  assert [p for p in units + ['q'] if not _named_in(p, text)] == []
  assert not _named_in('tab', text) and not _named_in('out', text)
  rule = "[('u/*', 'experts'), ('v/*', 'experts'), ('q', 'router')]"
  assert f'sj.make_labeler({rule})' in text
  with pytest.raises(ValueError, match='numbered units'):
    sj.make_labeler(strict=True)(tree)
  with pytest.warns(sj.UnsureLabelWarning):
    rows = {r.path: r.note for r in sj.label_table(sj.skewadam(1e-3), tree)}
  assert {p for p, note in rows.items() if note.startswith('UNSURE')} == {*units, 'q'}
  with pytest.warns(sj.UnsureLabelWarning):  # the labels moe_batch_axes reads
    axes = sj.moe_batch_axes(tree)
  assert jax.tree.leaves(axes, is_leaf=lambda x: x == ()) == [()] * 11  # one matrix each
  # The suggested rules settle it either way, quietly.
  fixed = sj.make_labeler([('u/*', 'experts'), ('v/*', 'experts'), ('q', 'router')],
                          strict=True)
  assert _labels_by_path_of(fixed(tree)) == {
      **{p: 'experts' for p in units}, 'q': 'router', 'tab': 'backbone', 'out': 'backbone'}
  sj.make_labeler([('u/*', 'backbone'), ('v/*', 'backbone')], strict=True)(tree)


def test_numbered_unit_modules_beside_a_router_module_are_reported():
  """`<stem>_0 .. <stem>_{E-1}` modules of two matrices and a bias each, beside a router
  kernel [d, E] in a module of its own (with its bias [E]): the units, the kernel and
  its bias are named, and the rule labels the module."""
  z, d, e, f = jnp.zeros, mm.D, mm.E, mm.F
  cell = lambda: {'a': z((d, f)), 'a_b': z(f), 'b': z((f, d))}  # noqa: E731
  tree = {'tab': z((mm.V, d)),
          'blk': {'pre': z(d), 'sel': {'kernel': z((d, e)), 'bias': z(e)},
                  **{f'Cell_{i}': cell() for i in range(e)}}}
  labels, text = _unsure(tree)
  assert set(labels.values()) == {'backbone'}
  units = [f'blk/Cell_{i}/{n}' for i in range(e) for n in ('a', 'a_b', 'b')]
  assert [p for p in units + ['blk/sel/kernel', 'blk/sel/bias'] if not _named_in(p, text)
          ] == []
  assert not _named_in('blk/pre', text)
  rules = [('blk/Cell_*', 'experts'), ('blk/sel', 'router')]
  assert f'sj.make_labeler({rules!r})' in text
  got = _labels_by_path_of(sj.make_labeler(rules, strict=True)(tree))
  assert {p for p, t in got.items() if t == 'experts'} == set(units)
  assert {p for p, t in got.items() if t == 'router'} == {'blk/sel/kernel', 'blk/sel/bias'}


def _dense_layers(form, n):
  """A table [V, d], n dense layers of identical structure (`blocks_<i>` or a list) and
  a head [d, V]."""
  z, d = jnp.zeros, mm.D
  layers = [{'w_in': z((d, mm.F)), 'b_in': z(mm.F), 'w_out': z((mm.F, d)), 'scale': z(d)}
            for _ in range(n)]
  body = ({f'blocks_{i}': x for i, x in enumerate(layers)} if form == 'stem'
          else {'blocks': layers})
  return {'tab': z((mm.V, d)), **body, 'head': z((d, mm.V))}


@pytest.mark.parametrize('form', ['stem', 'list'])
def test_numbered_dense_layers_without_a_router_shaped_leaf_are_quiet(form):
  """A guard (the labeler before numbered units were read passes it too): no leaf maps
  the layers' width to their count, so nothing is reported and all is backbone."""
  tree = _dense_layers(form, 3)
  labels, text = _unsure(tree)
  assert text == ''
  assert set(labels.values()) == {'backbone'}


def test_a_dense_kernel_mapping_the_width_to_the_layer_count_changes_no_tier():
  """The dense layers beside a classifier [d, 3] with 3 layers: it reads as their
  router, so it and the layers are reported, but nothing becomes experts or router, and
  confirming the layers dense settles it."""
  tree = {**_dense_layers('stem', 3), 'cls': jnp.zeros((mm.D, 3))}
  labels, text = _unsure(tree)
  assert set(labels.values()) == {'backbone'}
  assert _named_in('cls', text) and _named_in('blocks_2/w_out', text)
  assert "sj.make_labeler([('blocks_*', 'backbone')])" in text
  sj.make_labeler([('blocks_*', 'backbone')], strict=True)(tree)


# ---------------------------------------------------------------------------- sharding names


class _ExpertShardedDense(nnx.Module):
  """An MoE model sharded expert-parallel: the mesh axis `expert` also shards the
  embedding, the attention and the output layer (dense weights), as well as the bank."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.1)
    on_expert = nnx.with_partitioning
    with nnx.use_eager_sharding(False):
      self.embed = nnx.Embed(mm.V, mm.D, embedding_init=on_expert(init, ('expert', None)),
                             rngs=rngs)
      self.attn = nnx.MultiHeadAttention(
          2, mm.D, mm.D, kernel_init=on_expert(init, ('expert', None, None)), use_bias=False,
          decode=False, rngs=rngs)
      self.router = nnx.Linear(mm.D, mm.E, use_bias=False,
                               kernel_init=on_expert(init, (None, 'expert')), rngs=rngs)
      self.bank = nnx.Param(init(rngs.params(), (mm.E, mm.D, mm.F)),
                            out_sharding=('expert', None, None))
      self.out = nnx.Linear(mm.D, mm.V, use_bias=False,
                            kernel_init=on_expert(init, (None, 'expert')), rngs=rngs)
      self.lm_head = nnx.Param(init(rngs.params(), (mm.D, mm.V)),
                               out_sharding=(None, 'expert'))


_SHARDED_EXPECTED = {'attn/key/kernel': ('backbone', ()), 'attn/out/kernel': ('backbone', ()),
                     'attn/query/kernel': ('backbone', ()),
                     'attn/value/kernel': ('backbone', ()),
                     'bank': ('experts', (0,)), 'embed/embedding': ('backbone', ()),
                     'lm_head': ('backbone', ()), 'out/kernel': ('backbone', ()),
                     'router/kernel': ('router', ())}


@pytest.mark.skipif(not hasattr(nnx, 'use_eager_sharding'),
                    reason='NNX sharding metadata as built here needs Flax >= 0.11')
@pytest.mark.parametrize('use_axis_names', [False, True])
def test_sharding_names_are_hints_not_structure(use_axis_names):
  """A mesh axis called `expert` on dense weights (embedding, attention, output layer)
  neither warns nor changes their tiers or batch axes, with or without
  `use_axis_names`; on the bank, whose router maps to its length, it confirms."""
  state = nnx.state(_ExpertShardedDense(nnx.Rngs(0)), nnx.Param)
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(state, use_axis_names=use_axis_names)
    axes = sj.moe_batch_axes(state, labels, use_axis_names=use_axis_names)
    rows = sj.label_table(sj.skewadam(1e-3, param_labels=labels, batch_axes=axes), state)
    default_rows = sj.label_table(sj.skewadam(1e-3), state)
  got = {path: (tier, tuple(a)) for (path, tier), a in zip(
      _labels_by_path_of(labels).items(), jax.tree_util.tree_leaves(
          axes, is_leaf=lambda x: isinstance(x, tuple)))}
  assert got == _SHARDED_EXPECTED
  for table in (rows, default_rows):
    assert {r.path: (r.tier, r.batch_axes) for r in table} == _SHARDED_EXPECTED
    assert not any(r.note.startswith('UNSURE') for r in table)


def test_sharding_names_on_a_linen_model_are_hints_not_structure():
  """The same with Linen's logical partitioning (`nn.with_logical_partitioning`)."""

  class Model(nn.Module):

    @nn.compact
    def __call__(self, tokens):
      on = nn.with_logical_partitioning
      init = nn.initializers.normal(0.1)
      x = nn.Embed(mm.V, mm.D, embedding_init=on(init, ('expert', None)), name='embed')(tokens)
      x = nn.MultiHeadDotProductAttention(2, kernel_init=on(init, ('expert', None, None)),
                                          use_bias=False, name='attn')(x)
      gates = nn.Dense(mm.E, use_bias=False, kernel_init=on(init, (None, 'expert')),
                       name='router')(x)
      bank = self.param('bank', on(init, ('expert', None, None)), (mm.E, mm.D, mm.F))
      h = jnp.einsum('btd,edf,bte->btf', x, bank, gates)
      return nn.Dense(mm.V, kernel_init=on(init, (None, 'expert')), use_bias=False,
                      name='head')(h @ jnp.ones((mm.F, mm.D)))

  variables = jax.eval_shape(Model().init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
  for use_axis_names in (False, True):
    with warnings.catch_warnings():
      warnings.simplefilter('error', sj.UnsureLabelWarning)
      labels = _labels_by_path_of(sj.moe_param_labels(variables,
                                                      use_axis_names=use_axis_names))
    assert {p for p, t in labels.items() if t != 'backbone'} == {
        'params/bank', 'params/router/kernel'}
    assert labels['params/bank'] == 'experts'


# ---------------------------------------------------------------------------- the warning


def _units_model():
  """A bank kept as a Python list of units beside its router, with its loss: shapes
  cannot tell it from dense layers, the computation can (tests/support/structure_models.py)."""
  pytest.importorskip('equinox')
  import structure_models  # noqa: PLC0415 (needs Equinox, as test_stacks' models do)
  return structure_models.units_case()


def test_the_unsure_warning_comes_once_from_the_callers_line():
  case = _units_model()
  params = case.params
  calls = [lambda: sj.moe_param_labels(params),
           lambda: sj.make_labeler()(params),
           lambda: sj.moe_batch_axes(params),
           lambda: sj.skewadam(1e-3).init(params),
           lambda: jax.jit(sj.skewadam(1e-3).init)(params),
           lambda: optax.chain(optax.clip(1.0), sj.skewadam(1e-3)).init(params),
           lambda: sj.label_table(sj.skewadam(1e-3), params),
           lambda: sj.memory_report(sj.skewadam(1e-3), params),
           lambda: sj.memory_report(optax.adamw(1e-3), params)]
  for call in calls:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      call()
    unsure = [w for w in caught if issubclass(w.category, sj.UnsureLabelWarning)]
    assert len(unsure) == 1, [str(w.message)[:200] for w in unsure]
    assert (unsure[0].filename, unsure[0].lineno) == (__file__, call.__code__.co_firstlineno)
    assert 'sj.trace_structure(loss_fn, params, batch)' in str(unsure[0].message)


def test_the_code_the_unsure_warning_suggests_gives_the_right_labels():
  """The message's code, run as printed with the user's loss, params and batch, labels
  every leaf right; the rule it suggests for a bank is right too."""
  case = _units_model()
  params = case.params
  with pytest.warns(sj.UnsureLabelWarning) as record:
    guessed = _labels_by_path_of(sj.moe_param_labels(params))
  assert set(guessed.values()) == {'backbone'}  # lossless while unsure
  message = str(record[0].message)
  # The first block of code is the trace (the second the rules' form).
  code = message.split('\n\n')[1]
  code = '\n'.join(line[4:] for line in code.splitlines())
  assert code.startswith('trace = sj.trace_structure(')
  namespace = {'sj': sj, 'loss_fn': case.fn, 'params': params, 'batch': case.args[0],
               'learning_rate': 1e-3}
  exec(code, namespace)  # noqa: S102 (the printed fix, run as printed)
  assert _labels_by_path_of(namespace['trace'].labels) == case.tiers
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    rows = sj.label_table(namespace['tx'], params)
  assert {r.path: r.tier for r in rows} == case.tiers
  assert {r.path: r.batch_axes for r in rows} == case.axes
  # The rules it names for the bank reading: right on this bank, and quiet.
  rule = re.search(r'if it is a bank, label it: (sj\.make_labeler\(\[.*?\]\))', message)[1]
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    assert _labels_by_path_of(eval(rule, {'sj': sj})(params)) == case.tiers  # noqa: S307
