"""The published 6.78B MoE configuration as abstract parameters (bf16 weights, fp32
norms and router): the tree memory accounting is checked on."""

import jax
import jax.numpy as jnp

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
D, H, E, VOCAB, POS = 4096, 4096, 128, 50304, 256


def _block(moe: bool) -> dict:
  ln = {'scale': S((D,), F32), 'bias': S((D,), F32)}
  block = {'attn': {'q_proj': {'kernel': S((D, D), BF16)}, 'k_proj': {'kernel': S((D, 1024), BF16)},
                    'v_proj': {'kernel': S((D, 1024), BF16)},
                    'o_proj': {'kernel': S((D, D), BF16)}},
           'ln1': dict(ln), 'ln2': dict(ln)}
  if moe:
    block['moe'] = {'router': {'kernel': S((D, E), F32)},
                    'experts': {'w1': S((E, D, H), BF16), 'w2': S((E, D, H), BF16),
                                'w3': S((E, H, D), BF16)}}
  else:
    block['mlp'] = {n: {'kernel': S((D, D), BF16)} for n in ('w1', 'w2', 'w3')}
  return block


def paper_params() -> dict:
  """The published 6.78B MoE: bf16 weights, fp32 norms and router (abstract)."""
  return {'embed': {'embedding': S((VOCAB, D), BF16)}, 'pos_embed': S((POS, D), BF16),
          'blocks': {'0': _block(False), '1': _block(True)},
          'final_norm': {'scale': S((D,), F32), 'bias': S((D,), F32)}}
