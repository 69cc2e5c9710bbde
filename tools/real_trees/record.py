"""Record the parameter trees of real MoE models from real libraries, without arrays.

Run inside a virtualenv that has ONE of the libraries installed (see README.md beside
this file):

    python tools/real_trees/record.py --library easydel
    python tools/real_trees/record.py --library maxtext --models mixtral_scan,gpt_oss
    python tools/real_trees/record.py --library gemma --out /tmp/trees

Each model is built with a tiny random-init configuration, abstractly (`nnx.eval_shape`
/ `jax.eval_shape`, nothing is allocated), and the tree that the library's trainer
hands to the optimizer is flattened with `jax.tree_util.tree_flatten_with_path`:

* EasyDeL: `EasyDeLState.create(model=..., tx=...)` calls `tx.init(model.graphstate)`,
  i.e. `nnx.split(model, nnx.Param, ...)[1]`;
* MaxText: its trainers wrap the NNX model in `nnx.Optimizer(model, tx, wrt=nnx.Param)`,
  which calls `tx.init(nnx.state(model, nnx.Param))`;
* gemma (kauldron trainer): `optimizer.init(params)` on the Linen `'params'` collection.

Keys are stringified (dict key / attribute name / sequence index) and joined with '/';
for NNX states the trailing `value` attribute is dropped (it is what `nnx.Optimizer`'s
`update` drops too: it passes the pure arrays).

`tier` and `batch_axes` are hand judgements written as explicit per-library rules
below; a leaf that looks MoE-related but matches no rule stops the recorder, so every
new kind of leaf gets looked at by a person. See README.md for the conventions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any, Callable, Optional

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import jax  # noqa: E402
import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, 'tests', 'data', 'real_trees')


# --------------------------------------------------------------------------- helpers


def key_str(k: Any) -> str:
  """One path entry as a string: dict key, attribute name or sequence index."""
  if isinstance(k, jax.tree_util.DictKey):
    return str(k.key)
  if isinstance(k, jax.tree_util.GetAttrKey):
    return str(k.name)
  if isinstance(k, jax.tree_util.SequenceKey):
    return str(k.idx)
  if isinstance(k, jax.tree_util.FlattenedIndexKey):
    return str(k.key)
  return str(k)


def dtype_str(dt: Any) -> str:
  return str(np.dtype(dt))


def names_or_none(names: Any) -> Optional[list]:
  if names is None:
    return None
  if isinstance(names, str):
    names = (names,)
  try:
    names = tuple(names)
  except TypeError:
    return None
  if not names:
    return None
  return [None if n is None else str(n) for n in names]


def nnx_param_leaves(state) -> list[dict]:
  """Leaves of an `nnx.State` of `nnx.Param`s: optax's paths, shapes, dtypes, metadata."""
  from flax import nnx

  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  variables, _ = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  if len(flat) != len(variables):
    raise AssertionError(f'{len(flat)} array leaves but {len(variables)} variables')
  out = []
  for (path, leaf), (vpath, var) in zip(flat, variables):
    segs = [key_str(k) for k in path]
    vsegs = [key_str(k) for k in vpath]
    if segs and segs[-1] == 'value':
      segs = segs[:-1]
    if segs != vsegs:
      raise AssertionError(f'path mismatch {segs} vs {vsegs}')
    meta = var.get_metadata() if hasattr(var, 'get_metadata') else {}
    names = None
    for key in ('sharding_names', 'out_sharding', 'sharding'):
      if meta.get(key) is not None:
        names = names_or_none(meta[key])
        if names is not None:
          break
    out.append({
        'segs': segs,
        'shape': [int(d) for d in leaf.shape],
        'dtype': dtype_str(leaf.dtype),
        'axis_names': names,
        'meta': meta,
        'var_type': type(var).__name__,
    })
  return out


def linen_param_leaves(params) -> list[dict]:
  """Leaves of a Linen params tree; `nn.Partitioned` boxes give their names."""
  import flax.linen as nn

  boxed = lambda x: isinstance(x, nn.Partitioned)  # LogicallyPartitioned subclasses it
  flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=boxed)
  out = []
  for path, leaf in flat:
    names = None
    if boxed(leaf):
      names = names_or_none(leaf.names)
      leaf = leaf.value
    out.append({
        'segs': [key_str(k) for k in path],
        'shape': [int(d) for d in leaf.shape],
        'dtype': dtype_str(leaf.dtype),
        'axis_names': names,
        'meta': {},
        'var_type': type(leaf).__name__,
    })
  return out


MOE_WORDS = ('expert', 'router', 'moe', 'gate')


def looks_moe(segs: list[str]) -> bool:
  return any(w in s.lower() for s in segs for w in MOE_WORDS)


class Unjudged(Exception):
  pass


# --------------------------------------------------------------------------- EasyDeL

ED_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64)

EASYDEL_MODELS: dict[str, dict] = {
    'mixtral': dict(
        module='mixtral', config_cls='MixtralConfig', model_cls='MixtralForCausalLM',
        config=dict(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2),
        num_experts=4,
        notes='Routed experts: block_sparse_moe/experts/w1,w2,w3/kernel [E, in, out], expert '
              'axis 0. Router: block_sparse_moe/gate/kernel [d, E]. No scan: layers are an '
              'nnx.List, so the layer index is a path segment, not an array axis. EasyDeL '
              'attaches no logical axis names to its variables (sharding comes from regex '
              'partition rules), so axis_names is null throughout.'),
    'qwen2_moe': dict(
        module='qwen2_moe', config_cls='Qwen2MoeConfig', model_cls='Qwen2MoeForCausalLM',
        config=dict(intermediate_size=48, moe_intermediate_size=40,
                    shared_expert_intermediate_size=56, num_experts=4, num_experts_per_tok=2,
                    qkv_bias=True),
        num_experts=4,
        notes='Routed experts: mlp/experts/{gate,up,down}_proj/kernel [E, in, out], axis 0. '
              'Router: mlp/gate/kernel [d, E]. mlp/shared_expert/* is a dense MLP that sees '
              'every token -> backbone. mlp/shared_expert_gate/kernel [d, 1] is the sigmoid '
              'gate that scales the shared expert output; it does not route among the E '
              'experts, so it is judged backbone (part of the dense shared branch), not router. '
              'qkv_bias=True as in the released Qwen1.5-MoE.'),
    'qwen3_moe': dict(
        module='qwen3_moe', config_cls='Qwen3MoeConfig', model_cls='Qwen3MoeForCausalLM',
        config=dict(intermediate_size=48, moe_intermediate_size=40, num_experts=4,
                    num_experts_per_tok=2),
        num_experts=4,
        notes='Routed experts: mlp/experts/{gate,up,down}_proj/kernel [E, in, out], axis 0. '
              'Router: mlp/gate/kernel [d, E]. No shared expert. q_norm/k_norm are per-head-dim '
              'RMSNorm scales (backbone).'),
    'deepseek_v2': dict(
        module='deepseek_v2', config_cls='DeepseekV2Config', model_cls='DeepseekV2ForCausalLM',
        config=dict(intermediate_size=48, moe_intermediate_size=40, n_shared_experts=1,
                    n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8,
                    v_head_dim=8, num_key_value_heads=4),
        num_experts=4,
        notes='Layer 0 is dense (first_k_dense_replace=1): its mlp/{gate,up,down}_proj are '
              'backbone. Layer 1: routed experts mlp/experts/*/kernel [E, in, out], axis 0; '
              'shared experts mlp/shared_experts/* are backbone. Router: mlp/gate/kernel is '
              'an ArrayParam stored TRANSPOSED, [E, d] (HF layout), not [d, E]; it is still '
              'one matrix, so batch_axes []. MLA attention (q_a/q_b/kv_a/kv_b) is backbone.'),
    'deepseek_v3': dict(
        module='deepseek_v3', config_cls='DeepseekV3Config', model_cls='DeepseekV3ForCausalLM',
        config=dict(intermediate_size=48, moe_intermediate_size=40, n_shared_experts=1,
                    n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8,
                    v_head_dim=8, num_key_value_heads=4, n_group=2, topk_group=1),
        num_experts=4,
        notes='Layer 0 dense (backbone MLP); layer 1 MoE. Routed experts mlp/experts/*/kernel '
              '[E, in, out], axis 0; shared experts backbone. Router: mlp/gate/kernel [d, E] '
              'and mlp/gate/e_score_correction_bias [E]. The correction bias is an nnx Param '
              '(ArrayParam) here, so the optimizer does see it; it is the router\'s '
              'load-balancing bias -> router tier.'),
    'gpt_oss': dict(
        module='gpt_oss', config_cls='GptOssConfig', model_cls='GptOssForCausalLM',
        config=dict(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8),
        num_experts=4,
        notes='Routed experts: mlp/experts/{gate,up,down}_proj/kernel [E, in, out] and their '
              'biases [E, out] (expert axis 0 -> batch_axes [0]). Router: mlp/router/kernel '
              '[d, E] and mlp/router/bias [E]. self_attn/sinks [heads] (ArrayParam) are '
              'attention-sink logits -> backbone.'),
    'llama4': dict(
        module='llama4', config_cls='Llama4TextConfig', model_cls='Llama4ForCausalLM',
        config=dict(intermediate_size=40, intermediate_size_mlp=48, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16),
        num_experts=4,
        notes='interleave_moe_layer_step=2 (Maverick-style): layer 0 has a dense '
              'feed_forward/{gate,up,down}_proj (backbone), layer 1 is MoE. Routed experts: '
              'feed_forward/experts/*/kernel [E, in, out], axis 0. Router: '
              'feed_forward/router/kernel [d, E]. feed_forward/shared_expert/* backbone.'),
}


def easydel_judge(leaf: dict, spec: dict) -> tuple[str, list[int]]:
  segs, shape = leaf['segs'], leaf['shape']
  low = [s.lower() for s in segs]
  if any(s in ('shared_expert', 'shared_experts', 'shared_expert_gate') for s in low):
    return 'backbone', []
  if 'experts' in low:
    if shape[0] != spec['num_experts']:
      raise Unjudged(f'expert leaf without a leading expert axis: {segs} {shape}')
    return 'experts', [0]
  if len(segs) >= 2 and low[-2] in ('gate', 'router'):
    if spec['num_experts'] not in shape:
      raise Unjudged(f'router leaf without an expert-sized axis: {segs} {shape}')
    return 'router', []
  if looks_moe(segs) and not any(s in ('gate_proj',) for s in low):
    raise Unjudged(f'unjudged MoE-looking leaf {segs} {shape}')
  return 'backbone', []


def record_easydel(names: list[str]) -> list[dict]:
  import importlib

  import jax.numpy as jnp
  from flax import nnx

  version = importlib.metadata.version('easydel')
  out = []
  for name in names:
    spec = EASYDEL_MODELS[name]
    mod = importlib.import_module(f'easydel.modules.{spec["module"]}')
    cfg_values = {**ED_COMMON, **spec['config']}
    cfg = getattr(mod, spec['config_cls'])(**cfg_values)
    model_cls = getattr(mod, spec['model_cls'])
    model = model_cls.lazy_init(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                precision=None, rngs=nnx.Rngs(0))
    # What EasyDeLState.create(model=model, tx=tx, init_opt_state=True) feeds tx.init.
    graphstate = model.split_module()[1]
    leaves = nnx_param_leaves(graphstate)
    judged = [_finish(leaf, easydel_judge(leaf, spec)) for leaf in leaves]
    out.append(dict(
        library='easydel', library_version=version, model=name,
        config={**cfg_values, 'model_class': spec['model_cls'], 'dtype': 'bfloat16',
                'param_dtype': 'bfloat16', 'init': f'{spec["model_cls"]}.lazy_init'},
        notes=spec['notes'], leaves=judged))
  return out


# --------------------------------------------------------------------------- MaxText

MT_COMMON = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8,
                 base_mlp_dim=40, base_moe_mlp_dim=40, vocab_size=128, num_experts=4,
                 num_experts_per_tok=2, max_target_length=16, per_device_batch_size=1)

MT_SCAN_NOTE = ('scan_layers=True stacks each scanned block\'s layers at axis 1 '
                '(param_scan_axis=1), e.g. attention query [d, L, heads, head_dim], norm '
                'scale [d, L], expert kernels [E, L, in, out]: batch_axes lists 1 (and 0 for '
                'experts). ')

MAXTEXT_MODELS: dict[str, dict] = {
    'mixtral_scan': dict(
        model_name='mixtral-8x7b', scan=True, config=dict(base_num_decoder_layers=3),
        scan_sizes={'layers': 3},
        notes=MT_SCAN_NOTE + 'Routed experts decoder/layers/MoeBlock_0/wi_0,wi_1 [E, L, d, F] '
              'and wo [E, L, F, d]: batch_axes [0, 1]. Router MoeBlock_0/gate/kernel [d, L, E]: '
              'batch_axes [1]. 3 layers so that L differs from every other tiny size.'),
    'mixtral_scan_linen': dict(
        model_name='mixtral-8x7b', scan=True, linen=True, config=dict(base_num_decoder_layers=3),
        scan_sizes={'layers': 3},
        notes='NOT the training tree: MaxText 0.2.5 trains the NNX model (see mixtral_scan); '
              'this is its Linen wrapper (models.transformer_as_linen), still used by its '
              'checkpoint conversion and decode utilities, recorded because it is a real '
              'boxed Linen tree: maxtext_utils.get_abstract_param(model, config), i.e. the '
              'whole model.init variables {"params": ...} with nn.LogicallyPartitioned leaves '
              '(what a Linen TrainState.create(params=model_vars, tx=tx) would hand to '
              'tx.init). Paths start with params/ and omit the boxes\' trailing value; '
              'axis_names are the boxes\' names. Same shapes and judgements as mixtral_scan.'),
    'mixtral_noscan': dict(
        model_name='mixtral-8x7b', scan=False, config=dict(base_num_decoder_layers=2),
        scan_sizes={},
        notes='scan_layers=False: layers are path segments layers_0, layers_1, no layer axis. '
              'Experts layers_i/MoeBlock_0/wi_0,wi_1,wo [E, in, out], batch_axes [0]; router '
              'layers_i/MoeBlock_0/gate/kernel [d, E].'),
    'qwen3_moe': dict(
        model_name='qwen3-30b-a3b', scan=True, config=dict(base_num_decoder_layers=3),
        scan_sizes={'layers': 3},
        notes=MT_SCAN_NOTE + 'The MoE block is called moe_block (not MoeBlock_0): experts '
              'decoder/layers/moe_block/wi_0,wi_1,wo [E, L, ., .], router moe_block/gate/kernel '
              '[d, L, E]. query_norm/key_norm scales [head_dim, L] are backbone.'),
    'deepseek3': dict(
        model_name='deepseek3-671b', scan=True,
        config=dict(base_num_decoder_layers=5, first_num_dense_layers=2, base_mlp_dim=48,
                    shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, base_num_kv_heads=4, n_routing_groups=2,
                    topk_routing_group=1),
        scan_sizes={'dense_layers': 2, 'moe_layers': 3},
        notes=MT_SCAN_NOTE + 'Two separately scanned stacks: decoder/dense_layers (L=2, '
              'logical axis name \'dense_layers\') and decoder/moe_layers (L=3, '
              '\'moe_layers\'), both at axis 1. Routed experts '
              'moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0,wi_1,wo [E, L, ., .]; router '
              'MoeBlock_0/gate/kernel [d, L, E] (logical name embed_router). '
              'DeepSeekMoeBlock_0/shared_experts/* are backbone. The routed (loss-free '
              'balancing) gate bias is a MoEBiasVar, not an nnx.Param, so the optimizer never '
              'sees it and it is not in this tree. MLA attention wq_a/wq_b/wkv_a/wkv_b and '
              'q_norm/kv_norm are backbone.'),
    'llama4': dict(
        model_name='llama4-17b-128e', scan=True,
        config=dict(base_num_decoder_layers=12, num_experts_per_tok=1, shared_experts=1,
                    base_mlp_dim=48),
        scan_sizes={'layers': 3},
        notes=MT_SCAN_NOTE + 'inhomogeneous_layer_cycle_interval=4: one scanned block of 4 '
              'sub-layers (layers_0..layers_3, path segments) repeated L=3 times at axis 1. '
              'interleave_moe_layer_step=2: layers_0/layers_2 have a dense mlp (backbone), '
              'layers_1/layers_3 have Llama4MoEBlock_0 with routed experts '
              'MoeBlock_0/wi_0,wi_1,wo [E, L, ., .], router MoeBlock_0/gate/kernel [d, L, E] '
              'and shared_experts/* (backbone).'),
    'gemma4': dict(
        model_name='gemma4-26b', scan=True,
        config=dict(base_num_decoder_layers=18, shared_experts=1, base_mlp_dim=48,
                    global_head_dim=16, global_num_kv_heads=1, sliding_window_size=8),
        scan_sizes={'scanned_blocks': 3}, inner_size=5,
        notes=MT_SCAN_NOTE + 'Nested scan: decoder/scanned_blocks repeats (5 local + 1 '
              'global) L=3 times at axis 1; inside it local_layers stacks the 5 sliding-window '
              'layers at axis 2 (logical name local_layers), so local leaves have batch_axes '
              '[1, 2] (plus 0 for experts), global_layer leaves [1]. Routed experts '
              'mlp/moe_block/MoeBlock_0/wi_0,wi_1,wo and per_expert_scale [E, L(, 5)] -> '
              'experts. Router: MoeBlock_0/gate/kernel AND mlp/pre_forward_scale_2 [d, L(, 5)], '
              'which is the router input scale (gemma\'s router_scale: gate input = '
              'rms_norm(x) * d**-0.5 * pre_forward_scale_2), so router tier despite its name. '
              'mlp/moe_block/shared_experts/* is the dense shared branch -> backbone; '
              'pre_feedforward_layernorm_2 / post_feedforward_layernorm_1/2 are d-vector norms '
              'around the two branches -> backbone. layer_scalar [1, L(, 5)] backbone.'),
    'gpt_oss': dict(
        model_name='gpt-oss-20b', scan=True,
        config=dict(base_num_decoder_layers=6, sliding_window_size=8),
        scan_sizes={'layers': 3},
        notes=MT_SCAN_NOTE + 'inhomogeneous_layer_cycle_interval=2 (sliding/global): scanned '
              'block of layers_0, layers_1 repeated L=3 times. The MoE block is GptOssMlp (no '
              '"moe" in its name): experts GptOssMlp/wi_0,wi_1 [E, L, d, F], wo [E, L, F, d] '
              'and their biases wi_0_bias,wi_1_bias [E, L, F], wo_bias [E, L, d] -> experts, '
              'batch_axes [0, 1]. Router GptOssMlp/gate/kernel [d, L, E] and gate/bias [E, L] '
              '-> router, batch_axes [1]. GptOssAttention/sinks [heads, L] and attention biases '
              'are backbone.'),
    'qwen3_next': dict(
        model_name='qwen3-next-80b-a3b', scan=True,
        config=dict(base_num_decoder_layers=8, shared_experts=1, gdn_key_head_dim=8,
                    gdn_value_head_dim=8, gdn_num_key_heads=2, gdn_num_value_heads=4,
                    gdn_chunk_size=8),
        scan_sizes={'layers': 2}, inner_size=3,
        notes=MT_SCAN_NOTE + 'Nested scan: decoder/layers repeats (3 Gated-DeltaNet + 1 full '
              'attention) L=2 times at axis 1; local_layers stacks the 3 GDN layers at axis 2 '
              '-> batch_axes [1, 2] for local_layers leaves, [1] for global_layer leaves. '
              'Routed experts mlp/routed_experts/wi_0,wi_1,wo; router '
              'mlp/routed_experts/gate/kernel. mlp/shared_expert/* and '
              'mlp/shared_expert_gate/kernel [d, L(, 3), 1] (sigmoid gate on the shared '
              'expert output, routes nothing) -> backbone. GDN A_log, dt_bias, conv1d, '
              'in_proj_*, out_proj, norm -> backbone. CAUTION: MaxText 0.2.5 attaches '
              'inconsistent logical names here (recorded as is): A_log/dt_bias/conv1d have '
              'none; input_layernorm/post_attention_layernorm/GDN norm scales carry '
              "('local_layers', 'layers') for a [d, L, 3] array and the global norms "
              "('layers',) for [d, L]: fewer names than axes and in the wrong order; "
              'batch_axes were judged from the scan structure, not from these names.'),
}

MT_MOE_BLOCKS = ('MoeBlock_0', 'moe_block', 'routed_experts', 'GptOssMlp')
MT_SCAN_CONTAINERS = ('layers', 'dense_layers', 'moe_layers', 'scanned_blocks')
MT_EXPERT_LEAVES = ('wi_0', 'wi_1', 'wo', 'wi_0_bias', 'wi_1_bias', 'wo_bias', 'per_expert_scale')


def maxtext_judge(leaf: dict, spec: dict, num_experts: int) -> tuple[str, list[int]]:
  segs, shape, names = leaf['segs'], leaf['shape'], leaf['axis_names']
  if segs[0] == 'params':  # the Linen variables dict
    segs = segs[1:]
  # Layer (scan) axes, from the structure of the scan, checked against the sizes.
  layer_axes: list[int] = []
  if spec['scan'] and len(segs) > 1 and segs[0] == 'decoder' and segs[1] in MT_SCAN_CONTAINERS:
    size = spec['scan_sizes'][segs[1]]
    if len(shape) < 2 or shape[1] != size:
      raise Unjudged(f'expected the scanned layer axis (size {size}) at 1: {segs} {shape}')
    if leaf['meta'].get('param_scan_axis', 1) != 1:
      raise Unjudged(f'param_scan_axis != 1: {segs}')
    layer_axes = [1]
    if 'local_layers' in segs:
      if len(shape) < 3 or shape[2] != spec['inner_size']:
        raise Unjudged(f'expected the inner local_layers axis at 2: {segs} {shape}')
      layer_axes = [1, 2]
  # Cross-check against well-formed logical names.
  if names is not None and len(names) == len(shape):
    for ax, n in enumerate(names):
      if n in ('layers', 'dense_layers', 'moe_layers', 'local_layers') and ax not in layer_axes:
        raise Unjudged(f'logical name {n} at axis {ax} not judged a layer axis: {segs}')
  if any(s in ('shared_experts', 'shared_expert', 'shared_expert_gate') for s in segs):
    return 'backbone', layer_axes
  if segs[-1] == 'pre_forward_scale_2':  # Gemma4's router input scale.
    return 'router', layer_axes
  if any(s in MT_MOE_BLOCKS for s in segs):
    if 'gate' in segs:
      core = [d for ax, d in enumerate(shape) if ax not in layer_axes]
      if core[-1] != num_experts:
        raise Unjudged(f'router leaf whose last non-layer axis is not E: {segs} {shape}')
      return 'router', layer_axes
    if segs[-1] in MT_EXPERT_LEAVES:
      if shape[0] != num_experts:
        raise Unjudged(f'expert leaf whose axis 0 is not E: {segs} {shape}')
      if names is not None and names[0] != 'exp':
        raise Unjudged(f'expert leaf whose axis 0 is not named exp: {segs} {names}')
      return 'experts', [0] + layer_axes
    raise Unjudged(f'unjudged leaf inside an MoE block: {segs} {shape}')
  if looks_moe([s for s in segs if s not in MT_SCAN_CONTAINERS]):
    raise Unjudged(f'unjudged MoE-looking leaf {segs} {shape}')
  return 'backbone', layer_axes


def record_maxtext(names: list[str]) -> list[dict]:
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.utils import maxtext_utils, model_creation_utils
  from maxtext.utils.globals import MAXTEXT_PKG_DIR

  version = importlib.metadata.version('maxtext')
  out = []
  for name in names:
    spec = MAXTEXT_MODELS[name]
    overrides = {**MT_COMMON, **spec['config']}
    argv = [None, os.path.join(MAXTEXT_PKG_DIR, 'configs', 'base.yml'),
            f'model_name={spec["model_name"]}', f'scan_layers={spec["scan"]}',
            'attention=dot_product', 'skip_jax_distributed_system=True',
            'override_model_config=True'] + [f'{k}={v}' for k, v in overrides.items()]
    config = pyconfig.initialize(argv)
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    # The same abstract NNX model that MaxText's trainers build before
    # nnx.Optimizer(model, tx, wrt=nnx.Param) calls tx.init(nnx.state(model, nnx.Param)).
    if spec.get('linen'):
      model = model_creation_utils.create_model(config, mesh)  # no rngs: the Linen wrapper
      leaves = linen_param_leaves(maxtext_utils.get_abstract_param(model, config))
      init = 'maxtext_utils.get_abstract_param(model_creation_utils.create_model(config, mesh))'
    else:
      _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
      leaves = nnx_param_leaves(nnx.state(model, nnx.Param))
      init = 'model_creation_utils.create_nnx_abstract_model'
    judged = [_finish(leaf, maxtext_judge(leaf, spec, config.num_experts)) for leaf in leaves]
    out.append(dict(
        library='maxtext', library_version=version, model=name,
        config={'model_name': spec['model_name'], 'scan_layers': spec['scan'],
                'attention': 'dot_product', 'weight_dtype': str(config.weight_dtype),
                **overrides, 'init': init},
        notes=spec['notes'], leaves=judged))
  return out


# --------------------------------------------------------------------------- gemma

GEMMA_MODELS = {
    'gemma4_26b_a4b': dict(
        config=dict(num_embed=128, embed_dim=32, hidden_dim=48, num_heads=4, head_dim=8,
                    num_kv_heads=2, num_global_kv_heads=1, global_key_size=16,
                    sliding_window_size=8, num_experts=4, expert_dim=40, top_k_experts=2,
                    moe_dense_hidden_dim=48),
        notes='gm.nn.Gemma4_26B_A4B with its config shrunk by dataclasses.replace, text only '
              '(vision encoder dropped, as text_only=True does), 2 layers: layer_0 sliding, '
              'layer_1 global (k_eq_v: k_einsum only). Plain Linen params, no nn.Partitioned '
              'boxes, so axis_names is null. No scan: layer_i are path segments. In each '
              'layer "mlp" is the MoE (MoERagged) and "mlp2" the dense shared branch '
              '(backbone). Experts: mlp/gating_einsum/w [E, 2, F, d] (axis 1 stacks the '
              'gate and up projections: two independent [F, d] matrices -> batch_axes '
              '[0, 1]), mlp/linear/w [E, F, d] -> [0], mlp/per_expert_scale [E] -> [0]. '
              'Router: mlp/router_logits/w [d, E] and mlp/router_scale [d] (scales the '
              'router input). Backbone with a pair axis: mlp2/gating_einsum [2, F, d] and '
              'attn/kv_einsum/w [2, kv_heads, d, head_dim] (k and v) -> batch_axes [0]. '
              'Heads axes are not batch axes (same convention as MaxText attention).'),
}


def gemma_judge(leaf: dict, spec: dict) -> tuple[str, list[int]]:
  segs, shape = leaf['segs'], leaf['shape']
  e = spec['config']['num_experts']
  if len(segs) >= 2 and segs[1] == 'mlp':  # the MoE branch
    tail = segs[2:]
    if tail == ['gating_einsum', 'w']:
      assert shape[0] == e and shape[1] == 2, (segs, shape)
      return 'experts', [0, 1]
    if tail == ['linear', 'w']:
      assert shape[0] == e, (segs, shape)
      return 'experts', [0]
    if tail == ['per_expert_scale']:
      assert shape == [e], (segs, shape)
      return 'experts', [0]
    if tail == ['router_logits', 'w']:
      assert shape[-1] == e, (segs, shape)
      return 'router', []
    if tail == ['router_scale']:
      return 'router', []
    raise Unjudged(f'unjudged leaf in the MoE branch: {segs} {shape}')
  if segs[-1] == 'gating_einsum' or segs[-2:] == ['kv_einsum', 'w']:
    assert shape[0] == 2, (segs, shape)
    return 'backbone', [0]
  if looks_moe(segs):
    raise Unjudged(f'unjudged MoE-looking leaf {segs} {shape}')
  return 'backbone', []


def record_gemma(names: list[str]) -> list[dict]:
  import dataclasses

  import jax.numpy as jnp
  from gemma import gm
  from gemma.gm.nn.gemma4 import _modules

  version = importlib.metadata.version('gemma')
  out = []
  for name in names:
    spec = GEMMA_MODELS[name]
    attn = (_modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL)
    cfg = dataclasses.replace(gm.nn.Gemma4_26B_A4B.config, attention_types=attn,
                              vision_encoder=None, audio_encoder=None, **spec['config'])
    model = gm.nn.Gemma4_26B_A4B(config=cfg)
    tokens = jnp.ones((1, 8), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    # kauldron's trainer: params = collections.pop('params'); optimizer.init(params).
    leaves = linen_param_leaves(variables['params'])
    judged = [_finish(leaf, gemma_judge(leaf, spec)) for leaf in leaves]
    out.append(dict(
        library='gemma', library_version=version, model=name,
        config={**spec['config'], 'attention_types': [str(a.name) for a in attn],
                'dtype': dtype_str(model.dtype),
                'base': 'gm.nn.Gemma4_26B_A4B.config', 'vision_encoder': None,
                'enable_moe': bool(cfg.enable_moe),
                'init': 'jax.eval_shape(model.init, key, tokens[1, 8])'},
        notes=spec['notes'], leaves=judged))
  return out


# --------------------------------------------------------------------------- main


def _finish(leaf: dict, judgement: tuple[str, list[int]]) -> dict:
  tier, batch_axes = judgement
  assert tier in ('backbone', 'experts', 'router'), tier
  assert all(0 <= a < len(leaf['shape']) for a in batch_axes), (leaf['segs'], batch_axes)
  assert batch_axes == sorted(set(batch_axes)), batch_axes
  return {
      'path': '/'.join(leaf['segs']),
      'shape': leaf['shape'],
      'dtype': leaf['dtype'],
      'axis_names': leaf['axis_names'],
      'tier': tier,
      'batch_axes': batch_axes,
  }


LIBRARIES: dict[str, tuple[dict, Callable[[list[str]], list[dict]]]] = {
    'easydel': (EASYDEL_MODELS, record_easydel),
    'maxtext': (MAXTEXT_MODELS, record_maxtext),
    'gemma': (GEMMA_MODELS, record_gemma),
}


def write(record: dict, out_dir: str) -> str:
  record = dict(record)
  record['versions'] = {p: importlib.metadata.version(p) for p in ('jax', 'jaxlib', 'flax')}
  record['python'] = '.'.join(map(str, sys.version_info[:3]))
  order = ['library', 'library_version', 'model', 'versions', 'python', 'config', 'notes', 'leaves']
  record = {k: record[k] for k in order}
  path = os.path.join(out_dir, f'{record["library"]}_{record["model"]}.json')
  lines = [json.dumps({k: v for k, v in record.items() if k != 'leaves'}, indent=1)[:-2] + ',',
           ' "leaves": [']
  lines += ['  ' + json.dumps(leaf) + (',' if i + 1 < len(record['leaves']) else '')
            for i, leaf in enumerate(record['leaves'])]
  lines += [' ]', '}']
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  with open(path) as f:
    json.load(f)  # round-trips
  return path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--library', required=True, choices=sorted(LIBRARIES))
  p.add_argument('--models', default='', help='comma-separated subset (default: all)')
  p.add_argument('--out', default=DEFAULT_OUT)
  args = p.parse_args(argv)
  models, recorder = LIBRARIES[args.library]
  names = [m for m in args.models.split(',') if m] or list(models)
  unknown = [m for m in names if m not in models]
  if unknown:
    p.error(f'unknown models {unknown}; known: {sorted(models)}')
  os.makedirs(args.out, exist_ok=True)
  failed = []
  for name in names:
    try:
      (record,) = recorder([name])
    except Exception as e:  # pylint: disable=broad-except
      failed.append(name)
      print(f'FAILED {args.library}/{name}: {type(e).__name__}: {e}', file=sys.stderr)
      continue
    path = write(record, args.out)
    tiers = {t: sum(leaf['tier'] == t for leaf in record['leaves'])
             for t in ('backbone', 'experts', 'router')}
    print(f'{path}: {len(record["leaves"])} leaves {tiers}')
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
