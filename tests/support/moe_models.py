"""Small Flax MoE models (NNX and Linen) and MaxText/Flaxformer/HF-style trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

D, E, F, V = 16, 4, 24, 32


class NNXExperts(nnx.Module):
  """Stacked SwiGLU experts, [E, d, f] and [E, f, d]."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.1)
    self.w1 = nnx.Param(init(rngs.params(), (E, D, F)))
    self.w2 = nnx.Param(init(rngs.params(), (E, D, F)))
    self.w3 = nnx.Param(init(rngs.params(), (E, F, D)))

  def __call__(self, x, combine):
    h = jax.nn.silu(jnp.einsum('td,edf->tef', x, self.w1[...]))
    h = h * jnp.einsum('td,edf->tef', x, self.w2[...])
    y = jnp.einsum('tef,efd->ted', h, self.w3[...])
    return jnp.einsum('ted,te->td', y, combine)


class NNXMoE(nnx.Module):
  """Top-2 MoE layer: an fp32 router and stacked experts."""

  def __init__(self, rngs: nnx.Rngs):
    self.router = nnx.Linear(D, E, use_bias=False, rngs=rngs)
    self.experts = NNXExperts(rngs)

  def __call__(self, x):
    shape = x.shape
    x = x.reshape(-1, D)
    probs = jax.nn.softmax(self.router(x).astype(jnp.float32))
    top, idx = jax.lax.top_k(probs, 2)
    combine = jnp.sum(jax.nn.one_hot(idx, E) * (top / top.sum(-1, keepdims=True))[..., None],
                      axis=-2)
    return self.experts(x, combine).reshape(shape)


class NNXMLP(nnx.Module):
  """Dense SwiGLU MLP with HF-style names (gate_proj stays in the backbone)."""

  def __init__(self, rngs: nnx.Rngs):
    self.gate_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(F, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class NNXMoELM(nnx.Module):
  """Embedding -> dense block -> MoE block -> norm -> tied head."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.blocks = nnx.List([NNXMLP(rngs), NNXMoE(rngs)])
    self.norms = nnx.List([nnx.LayerNorm(D, rngs=rngs) for _ in range(3)])

  def __call__(self, tokens):
    x = self.embed(tokens)
    for norm, block in zip(self.norms, self.blocks):
      x = x + block(norm(x))
    return self.embed.attend(self.norms[2](x))


NNX_EXPECTED = {
    'embed/embedding': 'backbone',
    'blocks/0/gate_proj/kernel': 'backbone',
    'blocks/0/up_proj/kernel': 'backbone',
    'blocks/0/down_proj/kernel': 'backbone',
    'blocks/1/router/kernel': 'router',
    'blocks/1/experts/w1': 'experts',
    'blocks/1/experts/w2': 'experts',
    'blocks/1/experts/w3': 'experts',
    'norms/0/scale': 'backbone', 'norms/0/bias': 'backbone',
    'norms/1/scale': 'backbone', 'norms/1/bias': 'backbone',
    'norms/2/scale': 'backbone', 'norms/2/bias': 'backbone',
}


def nnx_lm_loss(model: NNXMoELM, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy of the NNX model."""
  logits = model(tokens[:, :-1])
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def train_nnx(tx, steps: int = 20):
  """Trains `NNXMoELM` on the copy task through `nnx.Optimizer(model, tx)`, jitted;
  returns the losses and the optimizer."""
  model = NNXMoELM(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  tokens = copy_task_batch()

  @nnx.jit
  def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(nnx_lm_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss

  return [float(train_step(model, optimizer, tokens)) for _ in range(steps)], optimizer


def copy_task_batch(seed: int = 0, batch: int = 8, length: int = 12) -> jax.Array:
  """Tokens of a learnable task: a short pattern repeated."""
  rng = np.random.default_rng(seed)
  pattern = rng.integers(0, V, size=(batch, 4))
  return jnp.asarray(np.tile(pattern, (1, length // 4 + 1))[:, :length], jnp.int32)


class LinenExperts(nn.Module):
  """Stacked experts as Linen params (optionally boxed for partitioning)."""
  boxed: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.normal(0.1)
    if self.boxed:
      init = nn.with_partitioning(init, ('expert', None, None))
    w1 = self.param('w1', init, (E, D, F))
    w3 = self.param('w3', init, (E, F, D))
    x = x.reshape(-1, D)
    return jnp.einsum('tef,efd->td', jnp.einsum('td,edf->tef', x, w1), w3)


class LinenMoELM(nn.Module):
  """A Linen MoE LM with `router` and `experts` submodules."""
  boxed: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D, name='embed')(tokens)
    x = x + nn.Dense(D, use_bias=False, name='mlp_in')(nn.LayerNorm(name='ln0')(x))
    h = nn.LayerNorm(name='ln1')(x)
    _ = nn.Dense(E, use_bias=False, name='router')(h)
    return LinenExperts(boxed=self.boxed, name='experts')(h)


LINEN_EXPECTED = {
    'params/embed/embedding': 'backbone',
    'params/mlp_in/kernel': 'backbone',
    'params/ln0/scale': 'backbone', 'params/ln0/bias': 'backbone',
    'params/ln1/scale': 'backbone', 'params/ln1/bias': 'backbone',
    'params/router/kernel': 'router',
    'params/experts/w1': 'experts', 'params/experts/w3': 'experts',
}


def _z(*shape):
  return jnp.zeros(shape)


MAXTEXT_TREE = {'params': {
    'token_embedder': {'embedding': _z(V, D)},
    'decoder': {
        'layers_0': {'mlp': {'wi_0': {'kernel': _z(D, F)}, 'wi_1': {'kernel': _z(D, F)},
                             'wo': {'kernel': _z(F, D)}},
                     'pre_self_attention_layer_norm': {'scale': _z(D)}},
        'layers_1': {'MoeBlock_0': {'gate': {'kernel': _z(D, E)}, 'wi_0': _z(E, D, F),
                                    'wi_1': _z(E, D, F), 'wo': _z(E, F, D)}},
        'decoder_norm': {'scale': _z(D)},
    }}}
MAXTEXT_EXPECTED = {
    'params/token_embedder/embedding': 'backbone',
    'params/decoder/layers_0/mlp/wi_0/kernel': 'backbone',
    'params/decoder/layers_0/mlp/wi_1/kernel': 'backbone',
    'params/decoder/layers_0/mlp/wo/kernel': 'backbone',
    'params/decoder/layers_0/pre_self_attention_layer_norm/scale': 'backbone',
    'params/decoder/layers_1/MoeBlock_0/gate/kernel': 'router',
    'params/decoder/layers_1/MoeBlock_0/wi_0': 'experts',
    'params/decoder/layers_1/MoeBlock_0/wi_1': 'experts',
    'params/decoder/layers_1/MoeBlock_0/wo': 'experts',
    'params/decoder/decoder_norm/scale': 'backbone',
}

FLAXFORMER_TREE = {'decoder': {'layers_1': {'mlp': {
    'router': {'router_weights': {'w': {'kernel': _z(D, E)}}},
    'expert': {'wi': {'kernel': _z(E, D, F)}, 'wo': {'kernel': _z(E, F, D)}}}}}}
FLAXFORMER_EXPECTED = {
    'decoder/layers_1/mlp/router/router_weights/w/kernel': 'router',
    'decoder/layers_1/mlp/expert/wi/kernel': 'experts',
    'decoder/layers_1/mlp/expert/wo/kernel': 'experts',
}

HF_TREE = {'model': {'layers': [
    {'mlp': {'gate_proj': {'weight': _z(F, D)}, 'up_proj': {'weight': _z(F, D)},
             'down_proj': {'weight': _z(D, F)}}},
    {'block_sparse_moe': {'gate': {'weight': _z(E, D)},
                          'experts': [{'w1': {'weight': _z(F, D)}, 'w2': {'weight': _z(F, D)},
                                       'w3': {'weight': _z(D, F)}}]}},
    {'mlp': {'gate': {'weight': _z(E, D)},
             'experts': {'gate_proj': _z(E, F, D), 'down_proj': _z(E, D, F)},
             'shared_experts': {'gate_proj': {'weight': _z(F, D)}}}},
]}}
HF_EXPECTED = {
    'model/layers/0/mlp/gate_proj/weight': 'backbone',
    'model/layers/0/mlp/up_proj/weight': 'backbone',
    'model/layers/0/mlp/down_proj/weight': 'backbone',
    'model/layers/1/block_sparse_moe/gate/weight': 'router',
    'model/layers/1/block_sparse_moe/experts/0/w1/weight': 'experts',
    'model/layers/1/block_sparse_moe/experts/0/w2/weight': 'experts',
    'model/layers/1/block_sparse_moe/experts/0/w3/weight': 'experts',
    'model/layers/2/mlp/gate/weight': 'router',
    'model/layers/2/mlp/experts/gate_proj': 'experts',
    'model/layers/2/mlp/experts/down_proj': 'experts',
    'model/layers/2/mlp/shared_experts/gate_proj/weight': 'backbone',
}
