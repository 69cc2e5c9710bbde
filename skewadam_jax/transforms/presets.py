"""The tier policies: which `Tier` each group of parameters gets.

`PUBLISHED_TIERS` is the policy of the SkewAdam paper: the dense backbone keeps
momentum and a factored second moment, the expert bank only a factored second moment
per expert, the router an exact one. The others are ours. `ADAM_EPS_TIERS`: the same
tiers with Adam's additive eps and an fp32 router momentum, which train well at AdamW's
own learning rate (the published floor wants a larger one) for 2% more state.
`ADAM_ROUTER_TIERS`: the published backbone and experts with that router alone, at the
published tiers' learning rate. `MUON_TIERS`: Muon's orthogonalised momentum on the
hidden matrices; `MUON_CODED_TIERS`: the same with Muon's per-expert Nesterov momentum on
the experts, stored as 6-bit blockwise codes, as is the hidden tier's, and the backbone's
momentum as 8-bit codes (leaves under 4096 elements in fp32).
"""

from __future__ import annotations

from typing import Any, Mapping


from skewadam_jax.estimators import codec as _codec
from skewadam_jax.estimators import factored as _factored
from skewadam_jax.estimators import orthogonal as _orthogonal

from skewadam_jax.transforms.tier import Tier

PUBLISHED_TIERS: Mapping[str, Tier] = {
    'backbone': Tier(momentum=True, second_moment='factored'),
    'experts': Tier(momentum=False, second_moment='factored'),
    'router': Tier(momentum=False, second_moment='exact', apply_weight_decay=False),
}

# Beyond the paper: with tiny expert and router gradients (RMS ~1e-5 at init) the
# published eps floor sets their denominators and damps their updates, so the published
# tiers want a larger lr than Adam's, and a router without momentum learns slowly.
# Additive eps and an fp32 router momentum (a [d, E] kernel: a few KB) make AdamW's lr
# work; the tiers and their state are otherwise the published ones.
ADAM_EPS_TIERS: Mapping[str, Tier] = {
    'backbone': Tier(momentum=True, second_moment='factored', eps_mode='adam'),
    'experts': Tier(momentum=False, second_moment='factored', eps_mode='adam'),
    'router': Tier(momentum=True, second_moment='exact', eps_mode='adam',
                   apply_weight_decay=False),
}

# The published floor slows the router most: its gradients are the smallest, and while
# the router weights are small, noise-free top-k leaves many experts without tokens. An
# Adam router (additive eps, fp32 momentum) on the published backbone and experts keeps
# the published lr and ends that dead-expert phase sooner, for one router-sized buffer.
ADAM_ROUTER_TIERS: Mapping[str, Tier] = {
    'backbone': PUBLISHED_TIERS['backbone'],
    'experts': PUBLISHED_TIERS['experts'],
    'router': PUBLISHED_TIERS['router'].replace(momentum=True, eps_mode='adam'),
}


# Muon (Jordan et al. 2024) on the backbone's hidden matrices: the fp32 momentum the
# published backbone already keeps is exactly Muon's state, and orthogonalising it
# replaces the factored second moment (no statistics). Nesterov and b1 = 0.95 as in
# Muon; the update RMS is matched to Adam's (0.2), so one learning rate serves every
# tier. The experts keep no state at all: each expert's gradient is orthogonalised on
# its own (per batch slice), which beat the published factored expert tier in the
# quality sweep (benchmarks/quality.py, 2000 steps, each at its best lr); a per-expert
# vector with no matrix to orthogonalise gets the factored tier's exact estimate.
# Embeddings, heads and norms keep the published backbone tier, the router the Adam
# router of ADAM_ROUTER_TIERS. The tier names: `hidden_param_labels` labels the hidden
# matrices `hidden`, and `skewadam` uses it when the tiers have a `hidden` tier.
MUON_TIERS: Mapping[str, Tier] = {
    'backbone': PUBLISHED_TIERS['backbone'],
    'hidden': Tier(momentum=True, nesterov=True, b1=0.95, second_moment='orthogonal',
                   clip_threshold=None),
    'experts': Tier(momentum=False,
                    second_moment=_orthogonal.Orthogonal(fallback=_factored.FACTORED),
                    clip_threshold=None),
    'router': ADAM_ROUTER_TIERS['router'],
}

# MUON_TIERS with Muon's per-expert momentum back, in low-bit codes. The experts
# orthogonalise their own Nesterov momentum (b1 = 0.95), each expert on its own, as Muon
# does, instead of their gradient; the 5-seed sweep put that (with fp32 momentum) ahead
# of Muon, at half of AdamW's state, because the expert bank is most of an MoE's
# parameters. Under a tenth of AdamW's state that momentum gets at most about 6 bits per
# parameter, so it is stored as 6-bit linear absmax codes in blocks of 256 (0.766 B per
# parameter instead of 4), as is the hidden tier's; the backbone's Adam momentum
# (embeddings, norms) as 8-bit codes in blocks of 256. Every code is rounded to nearest:
# stochastic rounding re-draws each code's error at every step and the momentum sums
# them (a variance of about 10 steps' errors at b1 = 0.95), where round-to-nearest keeps
# each error within half a level; it drops a step's change below half a level (s / 62 at
# 6 bits), which 0.05 g rarely is. Measured in the quality sweep (2000 steps, 5 seeds, at
# 1e-2 as the fp32 form; docs/policies.md): within the seeds' spread of the same policy
# with fp32 momentum (+0.3% ± 0.4%), 4.0% below Muon's loss, 1.4% below the first 4-bit
# expert codes (stochastic, blocks of 64; 8.5% of AdamW's state), level with every leaf
# coded (+0.0% ± 0.3%), which was 1.2% below the same widths rounded stochastically (4
# seeds).
# `fit='nearest'`: a width that 256 does not divide (DeepSeek-MoE's 10944, 1408) gets the
# nearest block size that fits instead of an error. On the published 6.78B
# configuration: 9.7% of AdamW's state (benchmarks/memory.py). Every tier runs at the
# one lr (`lr_scale=1`): in the sweep (2000 steps, 3e-2) scaling the Adam-like tiers
# (embeddings, norms, router) by 0.3 or 0.1 ended worse (1.2815, 1.3654 against 1.2604).
# `min_size=4096` (bitsandbytes' `min_8bit_size`): a leaf under 4096 elements (a norm's
# gain, a bias) keeps an fp32 momentum; its codes would save a few KB and cost the first
# step kernels compiled for its shape alone (benchmarks/compile_time.py).
MUON_CODED_TIERS: Mapping[str, Tier] = {
    'backbone': PUBLISHED_TIERS['backbone'].replace(
        mu_codec=_codec.Blockwise(8, 256, 'linear', fit='nearest', min_size=4096)),
    'hidden': MUON_TIERS['hidden'].replace(
        mu_codec=_codec.Blockwise(6, 256, 'linear', fit='nearest', min_size=4096)),
    'experts': Tier(momentum=True, nesterov=True, b1=0.95,
                    second_moment=_orthogonal.Orthogonal(fallback=_factored.FACTORED),
                    clip_threshold=None,
                    mu_codec=_codec.Blockwise(6, 256, 'linear', fit='nearest', min_size=4096)),
    'router': ADAM_ROUTER_TIERS['router'],
}


def check_tiers(tiers: Any) -> dict[str, Tier]:
  """`tiers` as a dict (None: `PUBLISHED_TIERS`); raises unless it maps names to Tiers."""
  if tiers is None:
    return dict(PUBLISHED_TIERS)
  if not isinstance(tiers, Mapping) or not tiers:
    raise TypeError('`tiers` must be a non-empty mapping from tier name (a str) to '
                    'skewadam_jax.Tier, e.g. sj.PUBLISHED_TIERS or {\'backbone\': sj.Tier(), '
                    f'...}}, or None for sj.PUBLISHED_TIERS; got {type(tiers).__name__} '
                    f'{tiers!r}.')
  for name, tier in tiers.items():
    if not isinstance(name, str):
      raise TypeError(f'`tiers` keys must be strings (tier names), got {name!r}.')
    if not isinstance(tier, Tier):
      raise TypeError(f'`tiers[{name!r}]` must be a skewadam_jax.Tier, got '
                      f'{type(tier).__name__}.')
  return dict(tiers)
