"""SkewAdam on a small Flax Linen MoE language model, trained with optax directly.

Run:  .venv/bin/python tools/recipes/linen_skewadam.py
"""
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import skewadam_jax as sj

VOCAB, D, F, E, K, LAYERS = 64, 32, 64, 4, 2, 2


class MoE(nn.Module):
  """Top-k routed experts, stored stacked: w_in [E, D, F], w_out [E, F, D]."""

  @nn.compact
  def __call__(self, x):                                      # x [B, T, D]
    logits = nn.Dense(E, use_bias=False, name='router')(x)    # router kernel [D, E]
    top_v, top_i = jax.lax.top_k(logits, K)
    gates = jnp.sum(jax.nn.softmax(top_v, -1)[..., None] * jax.nn.one_hot(top_i, E), -2)
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    w_in = self.param('w_in', init, (E, D, F))
    w_out = self.param('w_out', init, (E, F, D))
    h = jax.nn.gelu(jnp.einsum('btd,edf->btef', x, w_in))     # dense dispatch: fine at this size
    y = jnp.einsum('btef,efd->bted', h, w_out)
    return jnp.einsum('bted,bte->btd', y, gates)


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm(name='attn_norm')(x)
    x = x + nn.SelfAttention(num_heads=4, name='attn')(h, mask=nn.make_causal_mask(h[..., 0]))
    return x + MoE(name='moe')(nn.RMSNorm(name='moe_norm')(x))


class MoELM(nn.Module):

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, D, name='embed')
    x = embed(tokens)
    for i in range(LAYERS):
      x = Block(name=f'layers_{i}')(x)
    return embed.attend(nn.RMSNorm(name='final_norm')(x))


model = MoELM()
tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, VOCAB)
inputs, targets = tokens[:, :-1], tokens[:, 1:]
params = model.init(jax.random.key(0), inputs)['params']

tx = optax.chain(optax.clip_by_global_norm(1.0), sj.skewadam(3e-3, weight_decay=0.1))

print(sj.label_table(tx, params).format())
print()
print(sj.memory_report(tx, params).format('SkewAdam'))
print()
print(sj.memory_report(optax.adamw(3e-3, weight_decay=0.1), params).format('AdamW'))
print()


def loss_fn(params):
  logits = model.apply({'params': params}, inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@jax.jit
def train_step(params, opt_state):
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


opt_state = tx.init(params)
for step in range(30):
  params, opt_state, loss = train_step(params, opt_state)
  if step % 5 == 0 or step == 29:
    print(f'step {step:2d}  loss {float(loss):.4f}')
