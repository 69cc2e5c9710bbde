"""The tier policies: which `Tier` each group of parameters gets.

`PUBLISHED_TIERS` is the policy of the SkewAdam paper: the dense backbone keeps
momentum and a factored second moment, the expert bank only a factored second moment
per expert, the router an exact one. The others are ours. `ADAM_EPS_TIERS`: the same
tiers with Adam's additive eps and an fp32 router momentum, which train well at AdamW's
own learning rate (the published floor wants a larger one) for one more copy of the
router kernel.
`ADAM_ROUTER_TIERS`: the published backbone and experts with that router alone, at the
published tiers' learning rate. `MUON_TIERS`: Muon's orthogonalised momentum on the
hidden matrices; `MUON_CODED_TIERS`: the same with Muon's per-expert Nesterov momentum on
the experts, stored as 6-bit blockwise codes, as is the hidden tier's, and the backbone's
momentum as 8-bit codes (leaves under 4096 elements in fp32).

Each policy is a read-only mapping (`FrozenTiers`): every default that reads it sees the
policy defined here. A variant is a new mapping under a new name, e.g.
`dict(sj.MUON_TIERS, experts=...)` or `{**sj.PUBLISHED_TIERS, 'router': ...}`, passed as
`tiers=`; every argument that takes tiers takes a plain dict as well.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, NoReturn


from skewadam_jax.estimators import codec as _codec
from skewadam_jax.estimators import factored as _factored
from skewadam_jax.estimators import orthogonal as _orthogonal
from skewadam_jax.structure import warning as _warning
from skewadam_jax.structure.vocabulary import BACKBONE
from skewadam_jax.structure.vocabulary import EXPERTS
from skewadam_jax.structure.vocabulary import HIDDEN
from skewadam_jax.structure.vocabulary import ROUTER
from skewadam_jax.transforms.tier import Tier


class FrozenTiers(Mapping[str, Tier]):
  """A read-only mapping from tier name to `Tier`: the type of the policies here.

  It reads as a dict (`[]`, `in`, `len`, iteration, `.items()`, `==` with any mapping
  of the same items) and refuses every change with a TypeError, since a preset changed
  in place would change the default of every later optimizer. `dict(preset)` is a
  mutable copy; `preset | {...}` a new dict. Its hash is that of its items where every
  `Tier` is hashable (a `Tier` holding an unhashable estimator makes it unhashable, as a
  tuple holding one is).

  Args:
    tiers: the mapping (or iterable of pairs) to copy, as `dict(tiers)` takes it.

  Example:
    >>> import skewadam_jax as sj
    >>> sj.PUBLISHED_TIERS['router'] = sj.Tier()
    Traceback (most recent call last):
    ...
    TypeError: PUBLISHED_TIERS is read-only (item assignment): copy it with \
dict(sj.PUBLISHED_TIERS), change the copy and pass it as tiers=...
    >>> variant = dict(sj.PUBLISHED_TIERS, router=sj.Tier(momentum=False))
    >>> sj.PUBLISHED_TIERS['router'].momentum, variant['router'].momentum
    (False, False)
  """

  __slots__ = ('_tiers', '_name')

  def __init__(self, tiers: Any = (), *, name: str = 'this tier mapping'):
    object.__setattr__(self, '_tiers', dict(tiers))
    object.__setattr__(self, '_name', name)

  def __getitem__(self, name: str) -> Tier:
    return self._tiers[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._tiers)

  def __len__(self) -> int:
    return len(self._tiers)

  def __contains__(self, name: object) -> bool:
    return name in self._tiers

  def __eq__(self, other: object) -> bool:
    if isinstance(other, Mapping):
      return self._tiers == dict(other.items())
    return NotImplemented

  def __hash__(self) -> int:
    return hash(frozenset(self._tiers.items()))

  def __or__(self, other: Any) -> dict[str, Tier]:
    if isinstance(other, Mapping):
      return {**self._tiers, **other}
    return NotImplemented

  def __ror__(self, other: Any) -> dict[str, Tier]:
    if isinstance(other, Mapping):
      return {**other, **self._tiers}
    return NotImplemented

  def __repr__(self) -> str:
    return f'FrozenTiers({self._tiers!r})'

  def __reduce__(self) -> Any:
    return (_frozen, (self._tiers, self._name))

  def _refuse(self, what: str) -> NoReturn:
    copy = f'dict(sj.{self._name})' if self._name.isidentifier() else 'dict(...)'
    raise TypeError(f'{self._name} is read-only ({what}): copy it with {copy}, change the '
                    'copy and pass it as tiers=...')

  def __setitem__(self, name: str, tier: Tier) -> NoReturn:
    self._refuse('item assignment')

  def __delitem__(self, name: str) -> NoReturn:
    self._refuse('item deletion')

  def __ior__(self, other: Any) -> NoReturn:
    self._refuse('|=')

  def __setattr__(self, attr: str, value: Any) -> NoReturn:
    self._refuse(f'attribute {attr!r}')

  # dict's in-place methods, which a reader of `preset.update(...)` means as a change.
  def update(self, *args: Any, **kwargs: Any) -> NoReturn:
    self._refuse('update')

  def pop(self, *args: Any) -> NoReturn:
    self._refuse('pop')

  def popitem(self) -> NoReturn:
    self._refuse('popitem')

  def setdefault(self, *args: Any) -> NoReturn:
    self._refuse('setdefault')

  def clear(self) -> NoReturn:
    self._refuse('clear')


def _frozen(tiers: dict[str, Tier], name: str) -> FrozenTiers:
  """Unpickles a `FrozenTiers`."""
  return FrozenTiers(tiers, name=name)


PUBLISHED_TIERS: FrozenTiers = FrozenTiers(name='PUBLISHED_TIERS', tiers={
    BACKBONE: Tier(momentum=True, second_moment='factored'),
    EXPERTS: Tier(momentum=False, second_moment='factored'),
    ROUTER: Tier(momentum=False, second_moment='exact', apply_weight_decay=False),
})

# Beyond the paper: with tiny expert and router gradients (RMS ~1e-5 at init) the
# published eps floor sets their denominators and damps their updates, so the published
# tiers want a larger lr than Adam's, and a router without momentum learns slowly.
# Additive eps and an fp32 router momentum (a [d, E] kernel: a few KB) make AdamW's lr
# work; the tiers and their state are otherwise the published ones.
ADAM_EPS_TIERS: FrozenTiers = FrozenTiers(name='ADAM_EPS_TIERS', tiers={
    BACKBONE: Tier(momentum=True, second_moment='factored', eps_mode='adam'),
    EXPERTS: Tier(momentum=False, second_moment='factored', eps_mode='adam'),
    ROUTER: Tier(momentum=True, second_moment='exact', eps_mode='adam',
                 apply_weight_decay=False),
})

# The published floor slows the router most: its gradients are the smallest, and while
# the router weights are small, noise-free top-k leaves many experts without tokens. An
# Adam router (additive eps, fp32 momentum) on the published backbone and experts keeps
# the published lr and ends that dead-expert phase sooner, for one router-sized buffer.
ADAM_ROUTER_TIERS: FrozenTiers = FrozenTiers(name='ADAM_ROUTER_TIERS', tiers={
    BACKBONE: PUBLISHED_TIERS[BACKBONE],
    EXPERTS: PUBLISHED_TIERS[EXPERTS],
    ROUTER: PUBLISHED_TIERS[ROUTER].replace(momentum=True, eps_mode='adam'),
})


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
MUON_TIERS: FrozenTiers = FrozenTiers(name='MUON_TIERS', tiers={
    BACKBONE: PUBLISHED_TIERS[BACKBONE],
    HIDDEN: Tier(momentum=True, nesterov=True, b1=0.95, second_moment='orthogonal',
                 clip_threshold=None),
    EXPERTS: Tier(momentum=False,
                  second_moment=_orthogonal.Orthogonal(fallback=_factored.FACTORED),
                  clip_threshold=None),
    ROUTER: ADAM_ROUTER_TIERS[ROUTER],
})

# MUON_TIERS with Muon's per-expert momentum back, in low-bit codes. The experts
# orthogonalise their own Nesterov momentum (b1 = 0.95), each expert on its own, as Muon
# does, instead of their gradient; the 5-seed sweep put that (with fp32 momentum) ahead
# of Muon, at half of AdamW's state, because the expert bank is most of an MoE's
# parameters. Under a tenth of AdamW's state that momentum gets at most about 6 bits per
# parameter, so it is stored as 6-bit linear absmax codes in blocks of 256, as is the
# hidden tier's; the backbone's Adam momentum (embeddings, norms) as 8-bit codes in blocks
# of 256. Every code is rounded to nearest:
# stochastic rounding re-draws each code's error at every step and the momentum sums
# them (a variance of about 10 steps' errors at b1 = 0.95), where round-to-nearest keeps
# each error within half a level; it drops a step's change below half a level (s / 62 at
# 6 bits), which 0.05 g rarely is. In the quality sweep it matched the same policy with
# fp32 momentum within the seeds' spread (the figures: see benchmarks/RESULTS.md).
# `fit='nearest'`: a width that 256 does not divide (DeepSeek-MoE's 10944, 1408) gets the
# nearest block size that fits instead of an error. Every tier runs at the one lr
# (`lr_scale=1`): scaling the Adam-like tiers down ended worse in the sweep.
# `min_size=4096` (bitsandbytes' `min_8bit_size`): a leaf under 4096 elements (a norm's
# gain, a bias) keeps an fp32 momentum; its codes would save a few KB and cost the first
# step kernels compiled for its shape alone (benchmarks/compile_time.py).
MUON_CODED_TIERS: FrozenTiers = FrozenTiers(name='MUON_CODED_TIERS', tiers={
    BACKBONE: PUBLISHED_TIERS[BACKBONE].replace(
        mu_codec=_codec.Blockwise(8, 256, 'linear', fit='nearest', min_size=4096)),
    HIDDEN: MUON_TIERS[HIDDEN].replace(
        mu_codec=_codec.Blockwise(6, 256, 'linear', fit='nearest', min_size=4096)),
    EXPERTS: Tier(momentum=True, nesterov=True, b1=0.95,
                  second_moment=_orthogonal.Orthogonal(fallback=_factored.FACTORED),
                  clip_threshold=None,
                  mu_codec=_codec.Blockwise(6, 256, 'linear', fit='nearest', min_size=4096)),
    ROUTER: ADAM_ROUTER_TIERS[ROUTER],
})


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


# The presets' public names, to print a user's policy as they wrote it.
_PRESETS = ('PUBLISHED_TIERS', 'ADAM_EPS_TIERS', 'ADAM_ROUTER_TIERS', 'MUON_TIERS',
            'MUON_CODED_TIERS')


def tiers_argument(tiers: Any) -> str:
  """`tiers=...` as the user's own call has it: a preset by its public name (`tiers=
  sj.MUON_CODED_TIERS, `), `tiers=<your tiers>, ` for a policy of their own, nothing for
  the default (None, or `PUBLISHED_TIERS` itself or a copy of it)."""
  if tiers is None:
    return ''
  presets = {name: globals()[name] for name in _PRESETS}
  # The preset itself, else a copy of one (dict(sj.MUON_TIERS) is that preset).
  name = next((name for name, preset in presets.items() if tiers is preset), None)
  if name is None:
    try:
      name = next((name for name, preset in presets.items() if dict(tiers) == preset), None)
    except (TypeError, ValueError):
      name = None
  if name is None:
    return 'tiers=<your tiers>, '
  return '' if name == 'PUBLISHED_TIERS' else f'tiers=sj.{name}, '


def policy_of(tiers: Any) -> _warning.Policy:
  """The user's `tiers` argument as the `UnsureLabelWarning`'s fix prints it."""
  try:
    hidden = tiers is not None and HIDDEN in tiers
  except TypeError:
    hidden = False
  return _warning.Policy(tiers_argument(tiers), hidden)
