"""A decoder-only Mixture-of-Experts transformer in Flax NNX (the SkewAdam paper's model).

The architecture follows the published 6.78B model: pre-LayerNorm blocks (with bias),
grouped-query causal attention, learned absolute positions, a token embedding tied to
the output head, dense SwiGLU blocks alternating with MoE blocks (block 0 dense), no
biases in linear layers. The MoE layer routes each token to its top-k experts with a
noisy fp32 router (softmax -> top-k -> renormalise) and adds the Switch load-balancing
loss and the router z-loss.

Parameter paths (`nnx.state(model, nnx.Param)`) look like::

  embed/embedding                 pos_embed                 final_norm/{scale,bias}
  blocks/0/attn/q_proj/kernel     blocks/0/mlp/w1/kernel    blocks/0/attn_norm/scale
  blocks/1/moe/router/kernel      blocks/1/moe/experts/w1   blocks/1/ffn_norm/bias

so `skewadam_jax.moe_param_labels` finds the three tiers (backbone, experts, router).

Experts are computed with a capacity-based gather dispatch: every expert processes a
fixed number `C` of token slots (`[E, C, d]`, one batched matmul), which keeps shapes
static and costs `k / E * capacity_factor` of a dense all-experts evaluation. Tokens
beyond an expert's capacity are dropped (their MoE output is zero, the residual carries
them); `capacity_factor=None` sets `C = T`, so nothing is ever dropped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Union

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

RngLike = Union[nnx.Rngs, nnx.RngStream, jax.Array, None]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shapes and hyperparameters of `MoELM`.

  Attributes:
    vocab_size: number of token ids (256 for bytes).
    max_len: number of learned positions (the longest sequence).
    d_model: width of the residual stream.
    n_heads: number of query heads.
    n_kv_heads: number of key/value heads (grouped-query attention); divides `n_heads`.
    head_dim: width of one attention head.
    d_ff: hidden width of the dense SwiGLU MLP.
    n_layers: number of transformer blocks.
    moe_every: block `i` is an MoE block when `(i + 1) % moe_every == 0`, so with the
      default 2 dense and MoE blocks alternate, starting with a dense block 0.
    n_experts: number of experts per MoE block.
    top_k: experts per token.
    d_expert: hidden width of one SwiGLU expert.
    capacity_factor: expert capacity as a multiple of the balanced load
      `T * top_k / n_experts`; None means capacity `T` (no token is ever dropped).
    router_noise_std: std of the Gaussian noise added to router logits in training.
    aux_loss_coef: coefficient of the Switch load-balancing loss (per MoE block).
    z_loss_coef: coefficient of the router z-loss (per MoE block).
    param_dtype: dtype of all weights except LayerNorms and the router (always fp32).
    dtype: compute dtype of the matmuls; None means `param_dtype`.
    init_std: std of the normal init of embeddings and input projections.
    out_init_std: std of the normal init of output projections (o_proj, w3).
    ln_eps: LayerNorm epsilon.
  """

  vocab_size: int = 256
  max_len: int = 128
  d_model: int = 128
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 512
  n_layers: int = 4
  moe_every: int = 2
  n_experts: int = 8
  top_k: int = 2
  d_expert: int = 256
  capacity_factor: float | None = 2.0
  router_noise_std: float = 0.5
  aux_loss_coef: float = 0.05
  z_loss_coef: float = 1e-4
  param_dtype: str = 'float32'
  dtype: str | None = None
  init_std: float = 0.02
  out_init_std: float = 0.01
  ln_eps: float = 1e-5

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f'`n_heads`={self.n_heads} must be a multiple of `n_kv_heads`={self.n_kv_heads}.')
    if not 1 <= self.top_k <= self.n_experts:
      raise ValueError(f'`top_k`={self.top_k} must be in [1, n_experts={self.n_experts}].')
    if self.moe_every < 1:
      raise ValueError(f'`moe_every` must be >= 1, got {self.moe_every}.')
    if self.capacity_factor is not None and self.capacity_factor <= 0:
      raise ValueError(f'`capacity_factor` must be > 0 or None, got {self.capacity_factor}.')

  def is_moe_block(self, i: int) -> bool:
    """Whether block `i` holds an MoE layer (otherwise a dense SwiGLU MLP)."""
    return (i + 1) % self.moe_every == 0

  @property
  def n_moe_blocks(self) -> int:
    """Number of MoE blocks."""
    return sum(self.is_moe_block(i) for i in range(self.n_layers))

  @property
  def weight_dtype(self) -> jnp.dtype:
    """dtype of the bf16-able weights."""
    return jnp.dtype(self.param_dtype)

  @property
  def compute_dtype(self) -> jnp.dtype:
    """dtype of activations and matmuls."""
    return jnp.dtype(self.dtype or self.param_dtype)


PRESETS: dict[str, MoEConfig] = {
    # The published 6.78B model: 341,352,448 backbone + 6,442,450,944 expert
    # + 524,288 router parameters. Only ever instantiated abstractly on CPU.
    'paper-6.78b': MoEConfig(
        vocab_size=50304, max_len=256, d_model=4096, n_heads=32, n_kv_heads=8,
        head_dim=128, d_ff=4096, n_layers=2, moe_every=2, n_experts=128, top_k=2,
        d_expert=4096, capacity_factor=2.0, param_dtype='bfloat16'),
    # Unit tests: trains in seconds; capacity T, so no token is ever dropped.
    'tiny': MoEConfig(
        vocab_size=256, max_len=32, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
        d_ff=64, n_layers=2, n_experts=4, top_k=2, d_expert=64, capacity_factor=None),
    # Default of the CPU demo: the paper's model scaled down with its ratios (one dense
    # and one MoE block, d_ff = d_expert = d_model, experts ~90% of the parameters);
    # 1.77M parameters.
    'small': MoEConfig(
        vocab_size=256, max_len=128, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
        d_ff=128, n_layers=2, n_experts=32, top_k=2, d_expert=128, capacity_factor=1.5),
    # Longer CPU runs: four blocks (two MoE), 7.8M parameters, 91% of them in experts.
    'base': MoEConfig(
        vocab_size=256, max_len=128, d_model=192, n_heads=6, n_kv_heads=2, head_dim=32,
        d_ff=192, n_layers=4, n_experts=32, top_k=2, d_expert=192, capacity_factor=1.5),
}


def get_config(name: str, **overrides: Any) -> MoEConfig:
  """Returns a preset from `PRESETS` with some fields replaced.

  Args:
    name: a key of `PRESETS`.
    **overrides: `MoEConfig` fields to replace, e.g. `n_layers=2`.

  Returns:
    The configuration.
  """
  if name not in PRESETS:
    raise KeyError(f'Unknown preset {name!r}; choose one of {sorted(PRESETS)}.')
  return dataclasses.replace(PRESETS[name], **overrides)


# ----------------------------------------------------------------------------- routing


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Softmax -> top-k -> renormalise.

  Args:
    logits: router logits `[T, E]` (fp32).
    top_k: experts per token.

  Returns:
    `(weights, indices, probs)`: combine weights `[T, k]` that sum to 1 per token,
    distinct expert indices `[T, k]` (best first) and the full softmax `[T, E]`.
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_probs, indices = jax.lax.top_k(probs, top_k)
  weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
  return weights, indices, probs


def token_fractions(indices: jax.Array, n_experts: int) -> jax.Array:
  """Fraction of the `T * k` routing assignments that go to each expert, `[E]`."""
  counts = jnp.sum(jax.nn.one_hot(indices, n_experts, dtype=jnp.float32), axis=(0, 1))
  return counts / indices.size


DEAD_BELOW = 0.1  # an expert is dead when its share is under this fraction of uniform


def load_health(token_frac: Any, dead_below: float = DEAD_BELOW) -> dict[str, np.ndarray]:
  """How evenly the assignments spread over the experts, per MoE layer (numpy, host side).

  The Switch aux loss cannot tell a collapsed router from a balanced one when the
  router's probabilities are near uniform (it is then ~`coef` whatever the assignments);
  these figures are computed from the assignments themselves.

  Args:
    token_frac: each expert's share of the token assignments, `[..., E]` (rows sum to 1),
      e.g. `token_fractions(indices, E)` or the stacked `token_frac` `[L, E]`.
    dead_below: an expert whose share is below `dead_below / E` counts as dead.

  Returns:
    Arrays of shape `token_frac.shape[:-1]`: `load_max_x_uniform` and
    `load_min_x_uniform` (largest and smallest share over the uniform share `1 / E`),
    `dead_experts` (int) and `load_entropy_ratio` (entropy of the shares over `log E`:
    1 for a uniform load, 0 when one expert takes everything).
  """
  frac = np.asarray(token_frac, np.float64)
  n_experts = frac.shape[-1]
  safe = np.where(frac > 0, frac, 1.0)
  entropy = -np.sum(np.where(frac > 0, frac * np.log(safe), 0.0), axis=-1)
  # One expert is always "uniform": its entropy ratio is 1 by convention.
  max_entropy = math.log(n_experts) if n_experts > 1 else 1.0
  return {
      'load_max_x_uniform': frac.max(axis=-1) * n_experts,
      'load_min_x_uniform': frac.min(axis=-1) * n_experts,
      'dead_experts': np.sum(frac * n_experts < dead_below, axis=-1),
      'load_entropy_ratio': entropy / max_entropy if n_experts > 1 else entropy + 1.0,
  }


def load_balance_loss(probs: jax.Array, indices: jax.Array, coef: float) -> jax.Array:
  """Switch aux loss `coef * E * sum_i mean_prob_i * token_frac_i`.

  Uniform router probabilities give exactly `coef` whatever the assignments, the
  floor that a balanced router approaches.

  Args:
    probs: router softmax `[T, E]`.
    indices: chosen experts `[T, k]`.
    coef: loss coefficient (0.05 in the paper).

  Returns:
    A scalar.
  """
  n_experts = probs.shape[-1]
  mean_prob = jnp.mean(probs, axis=0)
  # token_frac is piecewise constant in the logits: gradients flow through mean_prob.
  frac = jax.lax.stop_gradient(token_fractions(indices, n_experts))
  return coef * n_experts * jnp.sum(mean_prob * frac)


def router_z_loss(logits: jax.Array, coef: float) -> jax.Array:
  """Router z-loss `coef * mean(logsumexp(logits)^2)` (keeps logits small)."""
  z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return coef * jnp.mean(z**2)


def expert_capacity(n_tokens: int, n_experts: int, top_k: int,
                    capacity_factor: float | None) -> int:
  """Token slots per expert: `ceil(factor * T * k / E)`, at most `T` (None: `T`)."""
  if capacity_factor is None:
    return n_tokens
  return max(1, min(n_tokens, math.ceil(capacity_factor * n_tokens * top_k / n_experts)))


def dispatch_slots(indices: jax.Array, n_experts: int,
                   capacity: int) -> tuple[jax.Array, jax.Array]:
  """Assigns each (choice, token) pair a slot `e * C + position` in its expert's buffer.

  Assignments are ordered choice-major (all first choices, then all second choices),
  so when an expert overflows it drops second choices before first choices.

  Args:
    indices: chosen experts `[T, k]`.
    n_experts: E.
    capacity: slots per expert, C.

  Returns:
    `(slot, keep)`, both `[k * T]` in choice-major order; dropped assignments get the
    out-of-range slot `E * C`.
  """
  flat_expert = indices.T.reshape(-1)
  onehot = jax.nn.one_hot(flat_expert, n_experts, dtype=jnp.int32)
  position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1
  keep = position < capacity
  slot = jnp.where(keep, flat_expert * capacity + position, n_experts * capacity)
  return slot, keep


# ----------------------------------------------------------------------------- modules


def _normal(std: float) -> nnx.Initializer:
  return nnx.initializers.normal(stddev=std)


def _linear(cfg: MoEConfig, d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
  """A bias-free linear layer with a normal init, in the configured dtypes."""
  return nnx.Linear(
      d_in, d_out, use_bias=False, kernel_init=_normal(std),
      param_dtype=cfg.weight_dtype, dtype=cfg.compute_dtype, rngs=rngs)


def _layer_norm(cfg: MoEConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """LayerNorm with scale and bias, kept in fp32 whatever `param_dtype` is."""
  return nnx.LayerNorm(
      cfg.d_model, epsilon=cfg.ln_eps, param_dtype=jnp.float32, dtype=cfg.compute_dtype,
      rngs=rngs)


class Attention(nnx.Module):
  """Causal grouped-query self-attention without biases."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    self.n_heads = cfg.n_heads
    self.n_kv_heads = cfg.n_kv_heads
    self.head_dim = cfg.head_dim
    self.q_proj = _linear(cfg, cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.init_std, rngs)
    self.k_proj = _linear(cfg, cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.init_std, rngs)
    self.v_proj = _linear(cfg, cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.init_std, rngs)
    self.o_proj = _linear(cfg, cfg.n_heads * cfg.head_dim, cfg.d_model, cfg.out_init_std, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Attends causally over `x` `[B, S, d]`; returns `[B, S, d]`."""
    b, s, _ = x.shape
    q = self.q_proj(x).reshape(b, s, self.n_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, s, self.n_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, s, self.n_kv_heads, self.head_dim)
    # Handles GQA (K heads shared by N / K query heads) and does the softmax in fp32.
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim))


class MLP(nnx.Module):
  """Dense SwiGLU MLP: `w3(silu(w1 x) * w2 x)`."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    self.w1 = _linear(cfg, cfg.d_model, cfg.d_ff, cfg.init_std, rngs)
    self.w2 = _linear(cfg, cfg.d_model, cfg.d_ff, cfg.init_std, rngs)
    self.w3 = _linear(cfg, cfg.d_ff, cfg.d_model, cfg.out_init_std, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.w3(jax.nn.silu(self.w1(x)) * self.w2(x))


class Experts(nnx.Module):
  """A bank of E SwiGLU experts stored as stacked weights `[E, in, out]`."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    e, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
    wdt = cfg.weight_dtype
    self.dtype = cfg.compute_dtype
    self.w1 = nnx.Param(_normal(cfg.init_std)(rngs.params(), (e, d, f), wdt))
    self.w2 = nnx.Param(_normal(cfg.init_std)(rngs.params(), (e, d, f), wdt))
    self.w3 = nnx.Param(_normal(cfg.out_init_std)(rngs.params(), (e, f, d), wdt))

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies expert `e` to its token slots: `[E, C, d] -> [E, C, d]`."""
    x = x.astype(self.dtype)
    w1, w2, w3 = (w[...].astype(self.dtype) for w in (self.w1, self.w2, self.w3))
    h = jax.nn.silu(jnp.einsum('ecd,edf->ecf', x, w1)) * jnp.einsum('ecd,edf->ecf', x, w2)
    return jnp.einsum('ecf,efd->ecd', h, w3)


class MoE(nnx.Module):
  """Top-k routed SwiGLU experts with a noisy fp32 router and Switch/z auxiliary losses.

  The routing probabilities (and so the aux loss and `mean_prob`) come from the noisy
  logits in training, as the routing itself does; the z-loss uses the clean logits.
  """

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # The router stays fp32 (param and compute) even for bf16 models, and starts at
    # zero so that initial routing is decided by the noise alone.
    self.router = nnx.Linear(
        cfg.d_model, cfg.n_experts, use_bias=False, kernel_init=nnx.initializers.zeros,
        param_dtype=jnp.float32, dtype=jnp.float32, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)
    # Like nnx.Dropout: the layer keeps a forked stream for the router noise.
    self.rngs = _router_stream(rngs).fork()

  def __call__(self, x: jax.Array, *, train: bool = False,
               rngs: RngLike = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routes the tokens of `x` `[B, S, d]` to their top-k experts.

    Args:
      x: input activations.
      train: add router noise (N(0, router_noise_std^2)) to the logits and apply the
        expert capacity (tokens over it are dropped); evaluation is dropless.
      rngs: key, stream or `nnx.Rngs` for the noise; default: the layer's own stream.

    Returns:
      `(y, stats)`: output `[B, S, d]` and a dict of scalars / `[E]` vectors
      (`aux_loss`, `z_loss`, `token_frac`, `mean_prob`, `top1_prob` (mean over tokens
      of the largest router probability), `router_norm` (Frobenius norm of the router
      kernel), `drop_frac`).
    """
    cfg = self.cfg
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    n_tokens = tokens.shape[0]
    logits = self.router(tokens.astype(jnp.float32))
    noisy = logits
    if train and cfg.router_noise_std > 0:
      key = _noise_key(rngs if rngs is not None else self.rngs)
      noisy = logits + cfg.router_noise_std * jax.random.normal(key, logits.shape, jnp.float32)
    weights, indices, probs = route(noisy, cfg.top_k)

    # Capacity (and so token dropping) applies in training only: evaluation is dropless,
    # so that validation loss measures the model rather than the overflow of a few
    # experts that the noise-free top-k choice favours.
    capacity_factor = cfg.capacity_factor if train else None
    capacity = expert_capacity(n_tokens, cfg.n_experts, cfg.top_k, capacity_factor)
    slot, keep = dispatch_slots(indices, cfg.n_experts, capacity)
    token_of_assignment = jnp.tile(jnp.arange(n_tokens, dtype=jnp.int32), cfg.top_k)
    # Empty slots point at an extra all-zero token row.
    token_of_slot = jnp.full((cfg.n_experts * capacity,), n_tokens, jnp.int32)
    token_of_slot = token_of_slot.at[slot].set(token_of_assignment, mode='drop')
    padded = jnp.concatenate([tokens, jnp.zeros((1, d), tokens.dtype)])
    expert_in = padded[token_of_slot].reshape(cfg.n_experts, capacity, d)
    expert_out = self.experts(expert_in).reshape(cfg.n_experts * capacity, d)
    # Dropped assignments read an extra all-zero output row.
    expert_out = jnp.concatenate([expert_out, jnp.zeros((1, d), expert_out.dtype)])
    combine = (weights.T.reshape(-1) * keep).astype(expert_out.dtype)
    y = (expert_out[slot] * combine[:, None]).reshape(cfg.top_k, n_tokens, d).sum(axis=0)

    stats = {
        'aux_loss': load_balance_loss(probs, indices, cfg.aux_loss_coef),
        'z_loss': router_z_loss(logits, cfg.z_loss_coef),
        'token_frac': token_fractions(indices, cfg.n_experts),
        'mean_prob': jnp.mean(probs, axis=0),
        'top1_prob': jnp.mean(jnp.max(probs, axis=-1)),
        'router_norm': jnp.sqrt(jnp.sum(jnp.square(self.router.kernel[...]))),
        'drop_frac': 1.0 - jnp.mean(keep.astype(jnp.float32)),
    }
    return y.reshape(b, s, d).astype(x.dtype), stats


def _router_stream(rngs: nnx.Rngs) -> nnx.RngStream:
  """The 'router' stream of `rngs`, else its 'default' one, else 'params'."""
  if 'router' in rngs or 'default' in rngs:
    return rngs['router']
  return rngs['params']


def _noise_key(rngs: RngLike) -> jax.Array:
  """A fresh PRNG key from a key, an `nnx.RngStream` or an `nnx.Rngs`."""
  if isinstance(rngs, nnx.Rngs):
    return _router_stream(rngs)()
  if isinstance(rngs, nnx.RngStream):
    return rngs()
  if isinstance(rngs, jax.Array):
    return rngs
  raise TypeError(f'Router noise needs a key, RngStream or Rngs, got {type(rngs)}.')


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: attention, then a dense MLP or an MoE layer."""

  def __init__(self, cfg: MoEConfig, layer: int, *, rngs: nnx.Rngs):
    self.is_moe = cfg.is_moe_block(layer)
    self.attn_norm = _layer_norm(cfg, rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.ffn_norm = _layer_norm(cfg, rngs)
    if self.is_moe:
      self.moe = MoE(cfg, rngs=rngs)
    else:
      self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, *, train: bool = False,
               rngs: RngLike = None) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """Returns the new residual stream and the MoE stats (None for dense blocks)."""
    x = x + self.attn(self.attn_norm(x))
    h = self.ffn_norm(x)
    if self.is_moe:
      h, stats = self.moe(h, train=train, rngs=rngs)
      return x + h, stats
    return x + self.mlp(h), None


class MoELM(nnx.Module):
  """Decoder-only MoE language model with tied input/output embeddings."""

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(
        cfg.vocab_size, cfg.d_model, embedding_init=_normal(cfg.init_std),
        param_dtype=cfg.weight_dtype, dtype=cfg.compute_dtype, rngs=rngs)
    self.pos_embed = nnx.Param(
        _normal(cfg.init_std)(rngs.params(), (cfg.max_len, cfg.d_model), cfg.weight_dtype))
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)])
    self.final_norm = _layer_norm(cfg, rngs)

  def __call__(self, tokens: jax.Array, *, train: bool = False,
               rngs: RngLike = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token logits for `tokens`.

    Args:
      tokens: int token ids `[B, S]` with `S <= max_len`.
      train: training mode (router noise on).
      rngs: optional key / stream / `nnx.Rngs` for the router noise; a key is split
        across MoE layers. Default: each MoE layer's own stream.

    Returns:
      `(logits, aux)`: fp32 logits `[B, S, vocab]` and a dict with the summed
      `aux_loss` and `z_loss`, `aux_floor` (`aux_loss_coef` per MoE layer) and per-layer
      `layer_aux_loss` `[L]`, `token_frac` `[L, E]`, `mean_prob` `[L, E]`,
      `top1_prob` `[L]`, `router_norm` `[L]`, `drop_frac` `[L]`, where L is the number
      of MoE layers.
    """
    cfg = self.cfg
    s = tokens.shape[1]
    if s > cfg.max_len:
      raise ValueError(f'Sequence length {s} exceeds max_len={cfg.max_len}.')
    x = self.embed(tokens) + self.pos_embed[:s].astype(cfg.compute_dtype)
    layer_keys = None
    if train and isinstance(rngs, jax.Array):
      layer_keys = jax.random.split(rngs, max(cfg.n_moe_blocks, 1))
    stats = []
    for block in self.blocks:
      layer_rngs = rngs if layer_keys is None else layer_keys[len(stats)]
      x, block_stats = block(x, train=train, rngs=layer_rngs)
      if block_stats is not None:
        stats.append(block_stats)
    x = self.final_norm(x)
    logits = self.embed.attend(x).astype(jnp.float32)
    return logits, _collect_stats(stats, cfg)


def _collect_stats(stats: list[dict[str, jax.Array]], cfg: MoEConfig) -> dict[str, jax.Array]:
  """Stacks per-layer MoE stats and sums the losses."""
  zero = jnp.zeros((), jnp.float32)
  if not stats:
    return {'aux_loss': zero, 'z_loss': zero, 'aux_floor': zero}
  stacked = {k: jnp.stack([st[k] for st in stats]) for k in stats[0]}
  return {
      'aux_loss': jnp.sum(stacked['aux_loss']),
      'z_loss': jnp.sum(stacked['z_loss']),
      'aux_floor': jnp.asarray(cfg.aux_loss_coef * len(stats), jnp.float32),
      'layer_aux_loss': stacked['aux_loss'],
      'token_frac': stacked['token_frac'],
      'mean_prob': stacked['mean_prob'],
      'top1_prob': stacked['top1_prob'],
      'router_norm': stacked['router_norm'],
      'drop_frac': stacked['drop_frac'],
  }


# ----------------------------------------------------------------------------- helpers


def loss_fn(model: MoELM, batch: jax.Array, train: bool = True,
            rngs: RngLike = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy plus the router losses.

  Args:
    model: the model.
    batch: int tokens `[B, S + 1]`; inputs are `batch[:, :-1]`, targets `batch[:, 1:]`.
    train: training mode (router noise on).
    rngs: optional router-noise randomness, see `MoELM.__call__`.

  Returns:
    `(loss, metrics)` with `loss = ce + aux + z` and metrics `loss`, `ce`, `aux`, `z`,
    `aux_floor`, plus the per-layer router stats of `MoELM.__call__` when there are
    MoE layers.
  """
  logits, aux = model(batch[:, :-1], train=train, rngs=rngs)
  ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))
  loss = ce + aux['aux_loss'] + aux['z_loss']
  metrics = {'loss': loss, 'ce': ce, 'aux': aux['aux_loss'], 'z': aux['z_loss']}
  metrics.update({k: v for k, v in aux.items() if k not in ('aux_loss', 'z_loss')})
  return loss, metrics


def abstract_params(cfg: MoEConfig) -> nnx.State:
  """The model's parameters as `jax.ShapeDtypeStruct`s, without allocating them.

  Args:
    cfg: the configuration (e.g. `PRESETS['paper-6.78b']`).

  Returns:
    `nnx.State` of `nnx.Param` variables holding `ShapeDtypeStruct`s.
  """
  model = nnx.eval_shape(lambda: MoELM(cfg, rngs=nnx.Rngs(0)))
  return nnx.state(model, nnx.Param)


def _size(x: Any) -> int:
  return int(np.prod(x.shape, dtype=np.int64))


def _param_leaves(model_or_state: Any) -> list[tuple[str, Any]]:
  """`(path, leaf)` pairs of a module's params, a State or any pytree of arrays."""
  tree = model_or_state
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree, nnx.Param)
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  out = []
  for path, leaf in leaves:
    keys = [_key_name(k) for k in path]
    # nnx.state paths end in a `value` attribute; the array paths of an optimizer don't.
    if keys and keys[-1] == 'value':
      keys = keys[:-1]
    out.append(('/'.join(keys), leaf))
  return out


def _key_name(key: Any) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def count_params(model_or_state: Any) -> int:
  """Number of parameters of an `nnx.Module`, an `nnx.State` or a pytree of arrays.

  Works on `jax.ShapeDtypeStruct` leaves too (e.g. `abstract_params(cfg)`).
  """
  return sum(_size(leaf) for _, leaf in _param_leaves(model_or_state))


def param_counts(model_or_state: Any) -> dict[str, int]:
  """Parameters per tier by path: `experts`, `router` and the rest (`backbone`)."""
  counts = {'backbone': 0, 'experts': 0, 'router': 0}
  for path, leaf in _param_leaves(model_or_state):
    parts = path.split('/')
    tier = 'experts' if 'experts' in parts else 'router' if 'router' in parts else 'backbone'
    counts[tier] += _size(leaf)
  return counts
