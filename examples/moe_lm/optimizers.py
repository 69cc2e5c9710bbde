"""The optimizers the MoE example compares, built the same way for every one of them.

`make_optimizer(name, ...)` returns `clip_by_global_norm(clip) -> <optimizer>` with a
warmup + cosine learning-rate schedule. Names:

* `skewadam`: the published tiers (backbone: momentum + factored v; experts: factored v
  only; router: exact v, no weight decay).
* `skewadam-expert-momentum`: the experts get fp32 momentum too (tier ablation).
* `skewadam-factored-all`: momentum + factored second moment on every tier, router
  included (the router keeps its no-decay rule).
* `skewadam-adam-eps`: the published tiers with Adam's additive eps
  (`eps_mode='adam'`) instead of the floor.
* `skewadam-adam-eps-router-momentum`: the same, and the router keeps an fp32 momentum
  (`sj.ADAM_EPS_TIERS`).
* `skewadam-adam-eps-noclip`: the same as `skewadam-adam-eps` without the RMS clip.
* `skewadam-adam-eps-router-momentum-expert-momentum-bf16`: router momentum as above,
  and the experts keep a bfloat16 momentum.
* `skewadam-adam-eps-router-momentum-exact-backbone`: router momentum as above, and the
  backbone keeps an exact (unfactored) second moment.
* `skewadam-floor-backbone-router-momentum`: router momentum, Adam's additive eps on the
  experts and the router only; the backbone keeps the published floor.
* `skewadam-router-adam-eps`: the published backbone and experts (eps floor); the
  router alone takes Adam's additive eps.
* `skewadam-router-adam-eps-momentum`: the same, and the router keeps an fp32 momentum
  (`sj.ADAM_ROUTER_TIERS`).
* `skewadam-muon`: Muon's orthogonalised Nesterov momentum (b1 0.95, update RMS
  matched to Adam's) on the backbone's hidden matrices, the published tiers on
  embeddings, norms and experts, an Adam router; one learning rate for all.
* `skewadam-muon-orthogonal-experts`: `sj.MUON_TIERS`: the same, and each expert's
  gradient is orthogonalised too (no momentum, no expert state; a per-expert vector
  would get the factored tier's exact second moment).
* `skewadam-muon-expert-momentum`: a diagnostic of the gap to Muon: `sj.MUON_TIERS` with
  the experts as Muon treats them (fp32 Nesterov momentum, b1 0.95, orthogonalised per
  expert), for an fp32 momentum of every expert matrix (above 1/10 of AdamW's state).
* `skewadam-muon-coded-6bit-8bit-backbone-nearest-min4096`: `sj.MUON_CODED_TIERS`: the
  same expert momentum, stored as 6-bit linear blockwise codes (blocks of 256,
  round-to-nearest), as is the hidden tier's momentum; the backbone's momentum as 8-bit
  codes (blocks of 256); leaves under 4096 elements (norms, biases) keep an fp32 momentum.
* `skewadam-muon-coded-6bit-8bit-backbone-nearest`: the same with every leaf coded (the
  previous `sj.MUON_CODED_TIERS`).
* `skewadam-muon-coded-6bit-8bit-backbone`: that with stochastic rounding.
* `skewadam-muon-coded-4bit-experts-stochastic`: `CODED_4BIT_TIERS`, the first shipped
  `sj.MUON_CODED_TIERS`: the expert momentum as 4-bit codes (blocks of 64, stochastic
  rounding), the hidden tier's as 8-bit codes (blocks of 256, round-to-nearest), the
  backbone's in fp32. The names below vary it:
* `skewadam-muon-coded-4bit-experts`: the same with round-to-nearest 4-bit codes.
* `skewadam-muon-coded-8bit`: the same with 8-bit codes (blocks of 256) on both.
* `skewadam-muon-coded-4bit`: the same with 4-bit codes (blocks of 64) on both.
* `skewadam-muon-coded-4bit-experts-dynamic`: the same with the dynamic-exponent map
  for the experts' 4-bit codes (round-to-nearest).
* `skewadam-muon-coded-4bit32-experts-stochastic`: blocks of 32 instead of 64 for the
  experts' 4-bit codes (a scale per 32 elements).
* `skewadam-muon-coded-4bit32-stochastic`: the same with stochastic rounding of the
  hidden tier's 8-bit codes too.
* `skewadam-muon-coded-5bit-experts-stochastic`, `skewadam-muon-coded-6bit-experts-stochastic`:
  the experts' codes at 5 or 6 bits (bit planes) in blocks of 256, stochastic rounding.
* `skewadam-muon-coded-6bit-experts-5bit-rest`: the experts' codes at 6 bits and the
  backbone's and hidden tier's momentum at 5 bits (blocks of 256, stochastic rounding).
* `skewadam-muon-coded-4bit-rank1-experts`: the experts' 4-bit codes normalised by row
  and column maxima (`Rank1Codes`, a codec written against `sj.StateCodec` outside the
  library).
* `skewadam-muon-coded-4bit-experts-fp32-hidden`: the hidden tier's momentum in fp32 (a
  diagnostic: what the hidden tier's codes cost).
* `skewadam-muon-coded-6bit-8bit-backbone-nearest-min4096-ns-float32` and `-ns-bfloat16`:
  `sj.MUON_CODED_TIERS` with every Newton-Schulz iteration in that dtype
  (`sj.Orthogonal(ns_dtype=...)`; the preset's 'auto' is float32 on CPU, bfloat16 on GPU
  and TPU).
* any of the Muon policies with `-adam0.3` or `-adam0.1` appended: its Adam-like tiers
  (embeddings, norms, router: `backbone`, `router`) at that fraction of the lr.
* `adamw`, `adampm` (group size 8 along the last axis), `adampm-input-axis` (the same,
  pooled along the second-to-last axis: the input axis of `[in, out]` kernels and
  `[E, in, out]` expert banks; 1-D leaves along their only axis), `adafactor`
  (`optax.adafactor` without momentum and without parameter scaling, so that its step
  size is Adam-like), `adafactor-momentum` (the same with its `momentum=0.9` option, a
  float32 first moment), `lion` (`optax.lion`), `muon` (`optax.contrib.muon` on the
  matrices of attention, dense MLPs and experts (per expert); Adam on embeddings,
  norms and the router).

`RECOMMENDED` is the policy `train.py` trains by default, beside `BASELINE` (AdamW),
each at its best learning rate in `benchmarks/quality.py`'s sweep (`SWEPT_LR`).

Default learning rates (`DEFAULT_LR`): the published 3e-4 for the Adam family
(SkewAdam and its ablations, AdamW, AdamPM, both Adafactors); Lion conventionally 3-10x
smaller (1e-4, with weight decay 3x larger so that lr * wd matches); Muon its
conventional 0.02 for the orthogonalised matrices and 3e-4 (Adam) for the rest.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from optax import contrib

import skewadam_jax as sj
from skewadam_jax.estimators import blocks as _blocks  # the codes' packing and dither


@dataclasses.dataclass(frozen=True)
class Rank1Codes(sj.StateCodec):
  """A state codec written outside the library (`sj.StateCodec`): each matrix of a
  `[..., R, C]` leaf stored as `bits`-bit codes of `x / min(r_i, c_j)`, `r` the rows'
  and `c` the columns' absolute maxima (Li et al. 2023's rank-1 normalisation, there for
  the second moment), linear map, stochastic rounding; R + C float32 scales per matrix.

  Where a matrix's columns (or rows) differ in magnitude, each element keeps a precision
  relative to its own row and column, where a block's absmax is set by its largest
  element. In the sweep it ended level with blocks of 64 (+0.1% on seeds 0-1), so the
  library does not ship it; its scales are replicated (no `specs`).
  """
  bits: int = 4
  shape: Optional[tuple[int, ...]] = None

  @property
  def name(self) -> str:  # type: ignore[override]
    return f'{self.bits}-bit rank-1'

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> Rank1Codes:
    if len(shape) < 2:
      raise ValueError(f'Rank1Codes needs [..., R, C] leaves, got shape {tuple(shape)}.')
    return dataclasses.replace(self, shape=tuple(shape))

  @property
  def needs_seed(self) -> bool:
    return True

  def init(self, param: Any, path: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = 2**(self.bits - 1) - 1
    codes = jnp.full(param.shape, q, jnp.uint8)
    return (_blocks.pack_codes(codes, param.ndim - 1, self.bits),
            jnp.zeros(param.shape[:-1] + (1,), jnp.float32),
            jnp.zeros(param.shape[:-2] + (1, param.shape[-1]), jnp.float32))

  def encode(self, x: jax.Array, seed: Optional[jax.Array] = None
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = 2**(self.bits - 1) - 1
    a = jnp.abs(x)
    r = jnp.max(a, axis=-1, keepdims=True)
    c = jnp.max(a, axis=-2, keepdims=True)
    s = jnp.minimum(r, c)  # |x_ij| <= min(r_i, c_j), so |y| <= 1
    y = x / jnp.where(s > 0, s, 1.0)
    u = _blocks.dither(tuple(x.shape), jnp.asarray(seed, jnp.uint32))
    codes = (jnp.floor(y * q + u) + q).astype(jnp.uint8)
    return (_blocks.pack_codes(codes, x.ndim - 1, self.bits), r, c)

  def decode(self, stored: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    q = 2**(self.bits - 1) - 1
    codes, r, c = stored
    codes = _blocks.unpack_codes(codes, len(self.shape) - 1, self.shape[-1], self.bits)
    return (codes.astype(jnp.float32) - q) * (jnp.minimum(r, c) / q)

ADAM_LR = 3e-4
# The policy `train.py` trains by default, beside `BASELINE`, each at its `SWEPT_LR`.
# This is the one place that names it: the README's first command and its table follow.
RECOMMENDED = 'skewadam-muon-coded-6bit-8bit-backbone-nearest-min4096'  # sj.MUON_CODED_TIERS
BASELINE = 'adamw'
OPTIMIZERS = (
    'skewadam', 'adampm', 'adampm-input-axis', 'adamw', 'adafactor', 'adafactor-momentum',
    'lion', 'muon',
    'skewadam-expert-momentum', 'skewadam-factored-all', 'skewadam-adam-eps',
    'skewadam-adam-eps-router-momentum', 'skewadam-adam-eps-noclip',
    'skewadam-adam-eps-router-momentum-expert-momentum-bf16',
    'skewadam-adam-eps-router-momentum-exact-backbone',
    'skewadam-floor-backbone-router-momentum', 'skewadam-router-adam-eps',
    'skewadam-router-adam-eps-momentum', 'skewadam-muon', 'skewadam-muon-orthogonal-experts',
    'skewadam-muon-expert-momentum', 'skewadam-muon-coded-8bit', 'skewadam-muon-coded-4bit',
    'skewadam-muon-coded-4bit-experts', 'skewadam-muon-coded-4bit-experts-dynamic',
    'skewadam-muon-coded-4bit-experts-stochastic',
    'skewadam-muon-coded-4bit32-experts-stochastic', 'skewadam-muon-coded-4bit32-stochastic',
    'skewadam-muon-coded-4bit-experts-fp32-hidden',
    'skewadam-muon-coded-5bit-experts-stochastic', 'skewadam-muon-coded-6bit-experts-stochastic',
    'skewadam-muon-coded-4bit-rank1-experts', 'skewadam-muon-coded-6bit-experts-5bit-rest',
    'skewadam-muon-coded-6bit-8bit-backbone', 'skewadam-muon-coded-6bit-8bit-backbone-nearest',
    'skewadam-muon-coded-6bit-8bit-backbone-nearest-min4096',
)
# The Adam-like tiers (embeddings, norms, router) at a fraction of the one lr: the name
# of a Muon policy with `-adam<scale>` appended sets `lr_scale=<scale>` on its
# `backbone` and `router` tiers (the orthogonalised tiers keep the lr).
ADAM_SCALES = (0.3, 0.1)
_SCALABLE = ('skewadam-muon-orthogonal-experts', 'skewadam-muon-expert-momentum',
             'skewadam-muon-coded-8bit', 'skewadam-muon-coded-4bit',
             'skewadam-muon-coded-4bit-experts')
OPTIMIZERS += tuple(f'{b}-adam{s}' for b in _SCALABLE for s in ADAM_SCALES)
# The recommended policy with its Newton-Schulz dtype named (`-ns-<dtype>`).
NS_DTYPES = ('float32', 'bfloat16')
OPTIMIZERS += tuple(f'{RECOMMENDED}-ns-{d}' for d in NS_DTYPES)
DEFAULT_LR = {
    'skewadam': ADAM_LR, 'adampm': ADAM_LR, 'adampm-input-axis': ADAM_LR, 'adamw': ADAM_LR,
    'adafactor': ADAM_LR,
    'adafactor-momentum': ADAM_LR, 'lion': 1e-4, 'muon': 0.02, 'skewadam-expert-momentum': ADAM_LR,
    'skewadam-factored-all': ADAM_LR, 'skewadam-adam-eps': ADAM_LR,
    'skewadam-adam-eps-router-momentum': ADAM_LR, 'skewadam-adam-eps-noclip': ADAM_LR,
    'skewadam-adam-eps-router-momentum-expert-momentum-bf16': ADAM_LR,
    'skewadam-adam-eps-router-momentum-exact-backbone': ADAM_LR,
    'skewadam-floor-backbone-router-momentum': ADAM_LR,
    'skewadam-router-adam-eps': ADAM_LR, 'skewadam-router-adam-eps-momentum': ADAM_LR,
    'skewadam-muon': ADAM_LR, 'skewadam-muon-orthogonal-experts': ADAM_LR,
    'skewadam-muon-expert-momentum': ADAM_LR, 'skewadam-muon-coded-8bit': ADAM_LR,
    'skewadam-muon-coded-4bit': ADAM_LR, 'skewadam-muon-coded-4bit-experts': ADAM_LR,
}
DEFAULT_LR.update({n: ADAM_LR for n in OPTIMIZERS if n not in DEFAULT_LR})
# The best peak lr of the main job's two optimizers in `benchmarks/quality.py`'s
# 2000-step sweep (the same lr grid, refinement and seeds for every optimizer; its
# report, benchmarks/results/quality_sweep/report_steps2000.json, is checked against
# this in tests/examples/test_train.py). `default_lr` falls back to `DEFAULT_LR` elsewhere.
SWEPT_LR = {RECOMMENDED: 1e-2, BASELINE: 1.7e-3}


def default_lr(name: str) -> float:
  """The peak lr `name` trains at unless told: its swept best, else `DEFAULT_LR`."""
  return SWEPT_LR.get(name, DEFAULT_LR[name])


# The first shipped `sj.MUON_CODED_TIERS`, which the sweep's earlier coded policies
# vary: the backbone's momentum in fp32, the hidden tier's in 8-bit codes (blocks of 256,
# round-to-nearest), the experts' in 4-bit codes (blocks of 64, stochastic rounding);
# 8.5% of AdamW's state at 6.78B.
CODED_4BIT_TIERS = dict(
    sj.MUON_CODED_TIERS, backbone=sj.PUBLISHED_TIERS['backbone'],
    hidden=sj.MUON_CODED_TIERS['hidden'].replace(
        mu_codec=sj.Blockwise(8, 256, 'linear', fit='nearest')),
    experts=sj.MUON_CODED_TIERS['experts'].replace(
        mu_codec=sj.Blockwise(4, 64, 'linear', fit='nearest', rounding='stochastic')))


def with_ns_dtype(tier: sj.Tier, ns_dtype: str) -> sj.Tier:
  """`tier` with its orthogonal estimator (and none other) iterating in `ns_dtype`."""
  est = tier.estimator
  if not isinstance(est, sj.Orthogonal):
    return tier
  return tier.replace(second_moment=dataclasses.replace(est, ns_dtype=ns_dtype))


def skewadam_tiers(name: str) -> dict[str, sj.Tier]:
  """The tier policy of `skewadam` or one of its ablations."""
  ns = re.fullmatch(r'(.+)-ns-(float32|bfloat16)', name)
  if ns:
    return {k: with_ns_dtype(t, ns.group(2)) for k, t in skewadam_tiers(ns.group(1)).items()}
  scaled = re.fullmatch(r'(.+)-adam([0-9.]+)', name)
  if scaled:
    base, scale = skewadam_tiers(scaled.group(1)), float(scaled.group(2))
    return dict(base, **{k: base[k].replace(lr_scale=scale) for k in ('backbone', 'router')})
  pub = dict(sj.PUBLISHED_TIERS)
  if name == 'skewadam':
    return pub
  if name == 'skewadam-expert-momentum':
    return dict(pub, experts=pub['experts'].replace(momentum=True))
  if name == 'skewadam-factored-all':
    return {k: t.replace(momentum=True, second_moment='factored') for k, t in pub.items()}
  if name == 'skewadam-adam-eps':
    return {k: t.replace(eps_mode='adam') for k, t in pub.items()}
  # The published floor slows the router most (its gradients are the smallest), so these
  # keep the published backbone and experts and change the router alone.
  if name == 'skewadam-router-adam-eps':
    return dict(pub, router=pub['router'].replace(eps_mode='adam'))
  if name == 'skewadam-router-adam-eps-momentum':  # the shipped `sj.ADAM_ROUTER_TIERS`
    return dict(sj.ADAM_ROUTER_TIERS)
  if name == 'skewadam-muon':  # `sj.MUON_TIERS` with the published expert tier
    return dict(sj.MUON_TIERS, experts=pub['experts'])
  if name == 'skewadam-muon-orthogonal-experts':  # the shipped `sj.MUON_TIERS`
    return dict(sj.MUON_TIERS)
  if name == 'skewadam-muon-expert-momentum':  # the experts as Muon treats them
    return dict(sj.MUON_TIERS, experts=sj.MUON_TIERS['hidden'].replace(
        second_moment=sj.Orthogonal(fallback=sj.Factored())))
  if name == 'skewadam-muon-coded-6bit-8bit-backbone-nearest-min4096':  # the shipped one
    return dict(sj.MUON_CODED_TIERS)
  if name == 'skewadam-muon-coded-6bit-8bit-backbone-nearest':  # every leaf coded
    return {k: t if t.mu_codec is None else t.replace(
        mu_codec=dataclasses.replace(t.mu_codec, min_size=0))
            for k, t in sj.MUON_CODED_TIERS.items()}
  if name == 'skewadam-muon-coded-6bit-8bit-backbone':  # the same, stochastic rounding
    return {k: t if t.mu_codec is None else t.replace(
        mu_codec=dataclasses.replace(t.mu_codec, min_size=0, rounding='stochastic'))
            for k, t in sj.MUON_CODED_TIERS.items()}
  if name == 'skewadam-muon-coded-6bit-experts-5bit-rest':
    # Under a tenth of AdamW's state with the experts at 6 bits: every other momentum
    # (the backbone's: embeddings, norms; the hidden tier's) in 5-bit codes.
    five = sj.Blockwise(5, 256, 'linear', fit='nearest', rounding='stochastic')
    return dict(CODED_4BIT_TIERS, backbone=CODED_4BIT_TIERS['backbone'].replace(
        mu_codec=five), hidden=CODED_4BIT_TIERS['hidden'].replace(mu_codec=five),
                experts=CODED_4BIT_TIERS['experts'].replace(
                    mu_codec=dataclasses.replace(five, bits=6)))
  if name.startswith('skewadam-muon-coded'):
    # `-4bit-experts-stochastic` is `CODED_4BIT_TIERS`; the others change the codes of
    # its hidden tier's and experts' momentum.
    nearest8 = sj.Blockwise(8, 256, 'linear', fit='nearest')
    nearest4 = sj.Blockwise(4, 64, 'linear', fit='nearest')
    codecs = {
        'skewadam-muon-coded-4bit-experts-stochastic': (nearest8, dataclasses.replace(
            nearest4, rounding='stochastic')),
        'skewadam-muon-coded-4bit-experts': (nearest8, nearest4),
        'skewadam-muon-coded-4bit-experts-dynamic': (nearest8, dataclasses.replace(
            nearest4, mapping='dynamic')),
        'skewadam-muon-coded-8bit': (nearest8, nearest8),
        'skewadam-muon-coded-4bit': (nearest4, nearest4),
        'skewadam-muon-coded-4bit32-experts-stochastic': (nearest8, dataclasses.replace(
            nearest4, block_size=32, rounding='stochastic')),
        'skewadam-muon-coded-4bit-experts-fp32-hidden': (None, dataclasses.replace(
            nearest4, rounding='stochastic')),
        'skewadam-muon-coded-5bit-experts-stochastic': (nearest8, dataclasses.replace(
            nearest8, bits=5, rounding='stochastic')),
        'skewadam-muon-coded-6bit-experts-stochastic': (nearest8, dataclasses.replace(
            nearest8, bits=6, rounding='stochastic')),
        'skewadam-muon-coded-4bit-rank1-experts': (nearest8, Rank1Codes(4)),
        'skewadam-muon-coded-4bit32-stochastic': (
            dataclasses.replace(nearest8, rounding='stochastic'),
            dataclasses.replace(nearest4, block_size=32, rounding='stochastic')),
    }[name]
    return dict(CODED_4BIT_TIERS, **{k: CODED_4BIT_TIERS[k].replace(mu_codec=c)
                                     for k, c in zip(('hidden', 'experts'), codecs)})
  # The shipped `sj.ADAM_EPS_TIERS`: additive eps on every tier and a router momentum.
  router_momentum = dict(sj.ADAM_EPS_TIERS)
  if name == 'skewadam-adam-eps-router-momentum':
    return router_momentum
  if name == 'skewadam-adam-eps-router-momentum-expert-momentum-bf16':
    return dict(router_momentum, experts=router_momentum['experts'].replace(
        momentum=True, mu_dtype=jnp.bfloat16))
  if name == 'skewadam-adam-eps-router-momentum-exact-backbone':
    return dict(router_momentum,
                backbone=router_momentum['backbone'].replace(second_moment='exact'))
  if name == 'skewadam-floor-backbone-router-momentum':
    return dict(router_momentum, backbone=pub['backbone'])
  if name == 'skewadam-adam-eps-noclip':
    return {k: t.replace(eps_mode='adam', clip_threshold=None) for k, t in pub.items()}
  raise KeyError(f'Not a SkewAdam variant: {name!r}.')


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
  """0 -> `peak` linearly over `warmup_steps`, then cosine to 0 at `total_steps`."""
  warmup_steps = max(0, min(warmup_steps, total_steps - 1))
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps, max(total_steps, 1),
                                            end_value=0.0)


def _path_names(path: tuple[Any, ...]) -> list[str]:
  names = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
    else:
      names.append(str(k))
  return names


def muon_dimension_numbers(params: Any) -> Any:
  """Which leaves Muon orthogonalises: dense matrices and (per expert) expert weights.

  Embeddings (tied with the output head), positions, norms and the router return None,
  i.e. they are trained by Muon's Adam branch, as is conventional.
  """
  # optax's muon also calls this on the sub-tree of the leaves it orthogonalises, which
  # holds no router: a rule names this model's expert bank, so that its labels do not
  # hang on the router's presence (without it they are a guess, and say so).
  labels = sj.moe_param_labels(params, [('moe/experts', 'experts')])
  flat_labels = jax.tree_util.tree_structure(params).flatten_up_to(labels)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  out = []
  for (path, p), label in zip(leaves, flat_labels):
    names = _path_names(path)
    if label == 'experts' and p.ndim == 3:
      out.append(contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2))
    elif label == 'backbone' and p.ndim == 2 and not any('embed' in n for n in names):
      out.append(contrib.MuonDimensionNumbers())
    else:
      out.append(None)
  return treedef.unflatten(out)


def make_optimizer(name: str, learning_rate: Optional[float] = None, *,
                   total_steps: int, warmup_steps: int, weight_decay: float = 0.1,
                   clip_norm: Optional[float] = 1.0, group_size: int = 8,
                   muon_adam_lr: Optional[float] = None
                   ) -> tuple[optax.GradientTransformation, dict[str, Any]]:
  """Global-norm clip, then optimizer `name` with a warmup + cosine schedule.

  Args:
    name: one of `OPTIMIZERS`.
    learning_rate: peak learning rate; None means `default_lr(name)`.
    total_steps: length of the schedule (cosine reaches 0 here).
    warmup_steps: linear warmup steps.
    weight_decay: decoupled weight decay (Lion: 3x, so that lr * wd matches Adam's at
      its default lr; Muon: scaled so that lr * wd matches too; Adafactor: none).
    clip_norm: global gradient-norm clip, None for none.
    group_size: AdamPM group size.
    muon_adam_lr: peak lr of Muon's Adam branch (embeddings, norms, router); None
      means `ADAM_LR`. Muon's weight decay is scaled so that lr * wd matches it.

  Returns:
    `(tx, info)`: the transformation and a dict of the hyperparameters used.
  """
  if name not in OPTIMIZERS:
    raise KeyError(f'Unknown optimizer {name!r}; choose one of {OPTIMIZERS}.')
  lr = default_lr(name) if learning_rate is None else float(learning_rate)
  schedule = warmup_cosine(lr, warmup_steps, total_steps)
  info: dict[str, Any] = {'optimizer': name, 'lr': lr, 'warmup_steps': warmup_steps,
                          'total_steps': total_steps, 'clip_norm': clip_norm}
  if name.startswith('skewadam'):
    tx = sj.skewadam(schedule, weight_decay=weight_decay, tiers=skewadam_tiers(name))
    info['weight_decay'] = weight_decay
  elif name == 'adamw':
    tx = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    info['weight_decay'] = weight_decay
  elif name in ('adampm', 'adampm-input-axis'):
    axis = -2 if name == 'adampm-input-axis' else -1
    tx = sj.adampm(schedule, weight_decay=weight_decay, group_size=group_size, axis=axis)
    info.update(weight_decay=weight_decay, group_size=group_size, axis=axis)
  elif name in ('adafactor', 'adafactor-momentum'):
    momentum = 0.9 if name == 'adafactor-momentum' else None
    tx = optax.adafactor(schedule, multiply_by_parameter_scale=False, clipping_threshold=1.0,
                         momentum=momentum)
    info.update(weight_decay=0.0, momentum=momentum)
  elif name == 'lion':
    tx = optax.lion(schedule, b1=0.9, b2=0.99, weight_decay=3 * weight_decay)
    info['weight_decay'] = 3 * weight_decay
  else:  # muon
    adam_lr = ADAM_LR if muon_adam_lr is None else float(muon_adam_lr)
    muon_wd = weight_decay * adam_lr / lr
    tx = contrib.muon(
        schedule, weight_decay=muon_wd, adam_weight_decay=weight_decay,
        adam_learning_rate=warmup_cosine(adam_lr, warmup_steps, total_steps),
        muon_weight_dimension_numbers=muon_dimension_numbers)
    info.update(weight_decay=muon_wd, adam_lr=adam_lr, adam_weight_decay=weight_decay)
  if clip_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
  return tx, info
