"""Random MoE forward programs with ground truth, for the "right or loud" property.

`programs()` is a hypothesis strategy drawing a `Spec` (which building blocks, how
they are stored and named) and `build(spec)` turns it into a `Program`: abstract
parameters (`jax.ShapeDtypeStruct`s, so nothing is initialised), a forward function,
abstract inputs and the truth per leaf (tier and batch axes). The building blocks are
the ones real MoE code uses:

* routers: softmax or sigmoid scores, an optional per-expert selection bias `[E]`
  (added for the choice only, the weights read from the unbiased scores), optional
  jitter from a typed (`jax.random.key`) or legacy (`jax.random.PRNGKey`) key passed
  as an input (or a typed key taken through `key_data` and `wrap_key_data`),
  group-limited selection (scores reshaped to groups, each group scored by the sum of
  its top 2, the best group kept, the others masked, reshaped back), renormalised
  top-k weights, expert choice (each expert's top-C tokens);
* dispatch and combine: one-hot einsum, scatter-built combine weights, a mask of
  `ids == arange(E)` on the output of every expert computed densely, capacity-limited
  one-hot dispatch (cumsum positions), weights gathered by expert id, `segment_sum`
  combine, tokens sorted by `argsort` and taken then `ragged_dot`, sorted tokens with
  gathered weights and a `segment_sum` combine, per-expert outputs computed in a Python
  loop and joined with `jnp.stack` or `jnp.concatenate`, a weighted loop over units;
* banks: stacked `[E, d, f]` / `[E, f, d]` (plain or SwiGLU), fused gate-up
  `[E, d, 2f]`, per-expert biases `[E, f]`, `[E, d]` and scales `[E]`, one module
  (dict) per expert;
* around them: an embedding `[V, d]` gathered by token ids, norm gains `[d]`,
  attention-like dense weights `[d, d]`, a shared expert, a dense MLP beside the MoE
  block, an output head or a tied embedding, layers applied once, in a Python loop,
  by `lax.scan`, `lax.map` or `jax.vmap`, `jax.checkpoint`, `with_sharding_constraint`
  and `shard_map` over a 1-device mesh with axes `data, fsdp, expert, model, tensor`,
  and Flax `nn.Partitioned` boxes carrying those axis names.

Every dict key is a random token (`names='random'`), a conventional name (`router`,
`experts`, `w1`, `wq`, `embed`, ...; `names='conventional'`), or either (`'mixed'`).
Dimensions are small and pairwise distinct (E, d, f, T, V, L, C, heads, head_dim, the
patch and channel sizes) so that no length means two things by accident, except the
deliberate coincidences drawn as blocks (`dims:hd=E`, `dims:H=E`, `dims:f=V`, `dims:E=L`).

The truth follows the conventions of `structure_models`: a router kernel and its
selection bias are `router`; a stacked bank, its per-expert biases and scales are
`experts` with the expert axis as a batch axis; one module per expert is `experts`
with no expert axis; everything else is `backbone`; a stacked layer axis (scan, map,
vmap) is a batch axis of every leaf it stacks.

`python tests/support/moe_programs.py --n 1000` prints, per route, how many leaves are right,
undecided and loud, undecided without a warning, silently wrong, or hidden by a crash
(see `check_traced`, `check_default`), and which blocks the failing programs use;
`--exclude-known traced` (or `default`, `quiet`) switches off `KNOWN_FAILING`'s blocks,
`--names conventional` draws conventional names only, and `--blocks` checks each block
alone on a one-layer baseline.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fnmatch
import functools
import re
import sys
import time
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if __name__ == '__main__':  # run as a script: this checkout's package, not an installed one
  sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2]))

import skewadam_jax as sj  # noqa: E402
from skewadam_jax.estimators import orthogonal as _orthogonal  # noqa: E402
from skewadam_jax.structure import paths as _paths  # noqa: E402

ROUTER_SCORES = ('softmax', 'sigmoid')
NOISE = ('none', 'typed', 'legacy', 'typed_data')
STACKED_DISPATCH = ('onehot', 'scatter', 'mask', 'capacity', 'gather', 'segment',
                    'sorted_ragged', 'sorted_segment', 'stack', 'concat', 'expert_choice',
                    'gshard', 'group_choice', 'index')
# Gates that choose for themselves (no selection bias, groups, renormalisation, argmax).
OWN_GATES = ('expert_choice', 'gshard', 'group_choice')
TOKENS = ('ids', 'vit')
# Deliberate size coincidences: none, head_dim == E, heads == E, f == V, E == L.
COINCIDENCES = ('none', 'hd=E', 'H=E', 'f=V', 'E=L')
UNIT_DISPATCH = ('onehot', 'scatter', 'mask', 'stack', 'concat', 'units_loop')
BANKS = ('plain', 'swiglu', 'fused', 'units')
STACKING = ('single', 'loop', 'scan', 'map', 'vmap')
SHARDING = ('none', 'constraint', 'shard_map', 'boxed')
NAMES = ('random', 'mixed', 'conventional')
LAYOUTS = ('nested', 'flat')
DTYPES = ('float32', 'bfloat16')
MESH_AXES = ('data', 'fsdp', 'expert', 'model', 'tensor')

# Building blocks (tags of `Spec.blocks`; `a&b`: both together) shown, each alone on a
# one-layer baseline (`python tests/support/moe_programs.py --blocks`), to make a route wrong
# without a word (or crash) today. `specs(exclude=...)` switches them off so that the
# property is checked on every other block while the fixes land; the tests that draw
# every block are expected failures until then. 'quiet' lists the blocks on which the
# default route warns although every name is conventional.
KNOWN_FAILING: dict[str, frozenset[str]] = {
    # None: every block is right on the traced route (ViT tokens, DenseGeneral kernels,
    # index dispatch, GShard and group-limited expert choice and every coincidence too).
    'traced': frozenset(),
    # None: every block is right or loud on the default route (size coincidences are
    # reported as unsure where names and shapes cannot tell; 0 silently wrong leaves in
    # `python tests/support/moe_programs.py --n 1000`).
    'default': frozenset(),
    # A flat layer with DenseGeneral kernels whose head count equals E: `wo [E, hd, d]`
    # beside `w1 [E, d, f]` is reported although every name is conventional (`wo` is
    # also what MoE banks are called, so its name does not settle it).
    'quiet': frozenset({'dims:H=E&layout:flat'}),
}

_CONSONANTS = 'bcdfghjklmnpqrstvwxz'
_TOKEN_BANNED = ('mlp', 'ffn', 'ffw', 'wq', 'wk', 'wv')  # conventional names


# ---------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True)
class Dims:
  """Small, pairwise distinct lengths: experts, width, hidden, vocabulary, tokens..."""
  E: int
  d: int
  f: int
  V: int
  B: int
  S: int
  L: int
  K: int  # choices per token
  G: int  # expert groups (group-limited routing)
  H: int = 15  # attention heads (DenseGeneral kernels [d, H, hd], the MAP head)
  hd: int = 9  # head_dim

  @property
  def T(self) -> int:
    return self.B * self.S

  @property
  def C(self) -> int:  # slots per expert (capacity, expert choice)
    return self.S


@dataclasses.dataclass(frozen=True)
class Spec:
  """One drawn program: which building blocks, how stored, how named."""
  dims: Dims
  scores: str  # 'softmax' | 'sigmoid'
  select_bias: bool
  noise: str  # 'none' | 'typed' | 'legacy'
  grouped: bool
  renorm: bool
  bank: str  # 'plain' | 'swiglu' | 'fused' | 'units'
  expert_bias: bool
  expert_scale: bool
  dispatch: str
  shared: bool
  dense_mlp: bool
  attention: bool
  tied: bool
  stacking: str
  remat: bool
  sharding: str
  names: str
  seed: int  # names and axis names
  layout: str = 'nested'  # 'nested' modules, or every leaf of a layer in one 'flat' dict
  argmax: bool = False  # top-1 by argmax instead of top_k (K = 1)
  aux_loss: bool = False  # a load-balancing and a z-loss term added to the output
  dtype: str = 'float32'  # of the params; 'bfloat16': the router computed in float32
  tokens: str = 'ids'  # 'ids': a table [V, d] gathered; 'vit': patches, class token, MAP head
  dense_general: bool = False  # attention kernels [d, H, hd] and [H, hd, d] (needs attention)
  moe_norm: bool = False  # a norm gain inside the MoE block, on the router's and experts' input
  pre_logits: bool = False  # a dense [d, d] + tanh before the output layer
  coincide: str = 'none'  # a deliberate size coincidence (COINCIDENCES)

  @property
  def blocks(self) -> frozenset[str]:
    """The building blocks this program uses, as short tags."""
    tags = {f'scores:{self.scores}', f'bank:{self.bank}', f'dispatch:{self.dispatch}',
            f'stacking:{self.stacking}', f'sharding:{self.sharding}', f'names:{self.names}',
            f'layout:{self.layout}', f'dtype:{self.dtype}'}
    if self.dispatch in OWN_GATES:
      tags.add(f'router:{self.dispatch}')
    else:
      tags |= {t for t, on in (('router:select_bias', self.select_bias),
                               ('router:grouped', self.grouped),
                               ('router:renorm', self.renorm),
                               ('router:argmax', self.argmax),
                               ('router:aux_loss', self.aux_loss)) if on}
    if self.noise != 'none':
      tags.add(f'noise:{self.noise}')
    tags |= {t for t, on in (('bank:expert_bias', self.expert_bias and self.bank != 'units'),
                             ('bank:expert_scale', self.expert_scale and self.bank != 'units'),
                             ('shared', self.shared), ('dense_mlp', self.dense_mlp),
                             ('attention', self.attention),
                             ('tied', self.tied and self.tokens == 'ids'),
                             ('remat', self.remat), ('moe_norm', self.moe_norm),
                             ('pre_logits', self.pre_logits),
                             ('attention:dense_general', self.attention and self.dense_general),
                             ) if on}
    if self.tokens != 'ids':
      tags.add(f'tokens:{self.tokens}')
    if self.coincide != 'none':
      tags.add(f'dims:{self.coincide}')
    return frozenset(tags)


def spec_from_seed(seed: int, exclude: frozenset[str] = frozenset(),
                   names: Optional[str] = None) -> Spec:
  """A `Spec` whose every choice is uniform from `seed`, with the `exclude`d blocks
  switched off (see `_without`); `names` fixes the naming."""
  rng = np.random.default_rng(seed)
  pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
  coin = lambda: bool(rng.integers(2))  # noqa: E731
  dims = Dims(E=pick([4, 6]), d=8, f=pick([12, 20]), V=pick([11, 13]), B=2, S=pick([5, 7]),
              L=pick([2, 3]), K=pick([1, 2]), G=2, H=pick([15, 16]), hd=pick([9, 10]))
  bank = pick(BANKS)
  # Drawn after the original choices, so that a seed's other blocks stay as they were.
  tokens, dense_general, moe_norm, pre_logits = pick(TOKENS), coin(), coin(), coin()
  coincide = pick(COINCIDENCES)
  spec = Spec(
      dims=dims, scores=pick(ROUTER_SCORES), select_bias=coin(), noise=pick(NOISE),
      grouped=coin(), renorm=coin(), bank=bank,
      expert_bias=coin(), expert_scale=coin(),
      dispatch=pick(UNIT_DISPATCH if bank == 'units' else STACKED_DISPATCH), shared=coin(),
      dense_mlp=coin(), attention=coin(), tied=coin(), stacking=pick(STACKING), remat=coin(),
      sharding=pick(SHARDING), names=names or pick(NAMES), seed=int(rng.integers(2**31)),
      layout=pick(LAYOUTS), argmax=coin() and coin(), aux_loss=coin(),
      dtype=pick(DTYPES))
  spec = dataclasses.replace(spec, tokens=tokens, dense_general=dense_general,
                             moe_norm=moe_norm, pre_logits=pre_logits, coincide=coincide)
  spec = _coincide(spec)
  if spec.argmax:
    spec = dataclasses.replace(spec, dims=dataclasses.replace(dims, K=1))
  return _without(spec, exclude)


def _coincide(spec: Spec) -> Spec:
  """`spec` with its dims made to coincide as `spec.coincide` says (a coincidence that
  the program cannot hold is dropped: heads == E needs attention, head_dim == E the
  DenseGeneral kernels or the MAP head)."""
  n, c = spec.dims, spec.coincide
  heads = spec.tokens == 'vit' or (spec.attention and spec.dense_general)
  if c in ('hd=E', 'H=E') and not heads:
    return dataclasses.replace(spec, coincide='none')
  change = {'hd=E': {'hd': n.E}, 'H=E': {'H': n.E}, 'f=V': {'f': n.V},
            'E=L': {'L': n.E}}.get(c, {})
  return dataclasses.replace(spec, dims=dataclasses.replace(n, **change))


def specs(exclude: frozenset[str] = frozenset(), names: Optional[str] = None
          ) -> st.SearchStrategy[Spec]:
  """Hypothesis strategy of `Spec`s: hypothesis draws a seed, every choice is uniform
  from it (hypothesis' own choices favour the first options and would leave blocks out
  of a 50-program run)."""
  return st.integers(0, 2**32 - 1).map(lambda seed: spec_from_seed(seed, exclude, names))


def excluded(blocks: frozenset[str], exclude: frozenset[str]) -> list[str]:
  """The entries of `exclude` that `blocks` match: an entry is a block tag, or tags
  joined by `&` (matched when all are used: `bank:units&names:random`)."""
  return sorted(e for e in exclude if set(e.split('&')) <= blocks)


def _without(spec: Spec, exclude: frozenset[str]) -> Spec:
  """`spec` with the first block of each matched `exclude` entry switched off (or to a
  plain alternative), until none matches. Replacing rather than filtering keeps the
  search fast; the plain alternatives are the baseline's blocks."""
  off = {'router:select_bias': 'select_bias', 'router:grouped': 'grouped',
         'router:renorm': 'renorm', 'bank:expert_bias': 'expert_bias',
         'bank:expert_scale': 'expert_scale', 'shared': 'shared', 'dense_mlp': 'dense_mlp',
         'attention': 'attention', 'tied': 'tied', 'remat': 'remat', 'router:argmax': 'argmax',
         'router:aux_loss': 'aux_loss', 'moe_norm': 'moe_norm', 'pre_logits': 'pre_logits',
         'attention:dense_general': 'dense_general'}
  plain = {'dispatch': 'onehot', 'stacking': 'single', 'sharding': 'none',
           'scores': 'softmax', 'bank': 'plain', 'noise': 'none', 'names': 'conventional',
           'layout': 'nested', 'dtype': 'float32', 'tokens': 'ids'}
  for entry in excluded(spec.blocks, exclude):
    parts = entry.split('&')
    tag = next((t for t in parts if not t.startswith('names:')), parts[0])
    kind = tag.partition(':')[0]
    if tag in off:
      spec = dataclasses.replace(spec, **{off[tag]: False})
    elif kind == 'router':  # a gate of its own
      spec = dataclasses.replace(spec, dispatch='onehot')
    elif kind == 'dims':  # the coincidence undone: the drawn sizes come back
      undo = {'hd=E': {'hd': 9}, 'H=E': {'H': 15}, 'f=V': {'f': 12}, 'E=L': {'L': 2}}
      spec = dataclasses.replace(spec, coincide='none', dims=dataclasses.replace(
          spec.dims, **undo[spec.coincide]))
    else:
      spec = dataclasses.replace(spec, **{kind: plain[kind]})
    if spec.bank == 'units' and spec.dispatch not in UNIT_DISPATCH:
      spec = dataclasses.replace(spec, dispatch='onehot')
    return _without(spec, exclude)
  return spec


def programs(exclude: frozenset[str] = frozenset(), names: Optional[str] = None
             ) -> st.SearchStrategy[Program]:
  """Hypothesis strategy of built `Program`s (see `specs`)."""
  return specs(exclude=exclude, names=names).map(build)


# ---------------------------------------------------------------------------- truth


@dataclasses.dataclass(frozen=True)
class Truth:
  """What one leaf is: its tier, batch axes, and whether it is a hidden matrix (a
  backbone matrix contracted with activations on both sides: what Muon orthogonalises;
  never an input layer, an output layer, a norm, a bias or a table)."""
  tier: str
  axes: tuple[int, ...]
  hidden: bool = False


@dataclasses.dataclass
class Program:
  """A generated program: abstract params, forward, abstract inputs, truth per leaf."""
  spec: Spec
  params: Any
  fn: Callable[..., jax.Array]
  args: tuple[Any, ...]
  truth: list[Truth]  # in the params' flattening order
  paths: list[str]  # normalised paths, same order

  @property
  def blocks(self) -> frozenset[str]:
    return self.spec.blocks


def _leaf(shape: tuple[int, ...], tier: str, axes: tuple[int, ...], hidden: bool = False
          ) -> tuple[Any, Truth]:
  return jax.ShapeDtypeStruct(shape, jnp.float32), Truth(tier, axes, hidden)


def _hid(*shape: int) -> tuple[Any, Truth]:
  """A hidden backbone matrix."""
  return _leaf(shape, 'backbone', (), True)


def _attention_tree(spec: Spec) -> dict[str, Any]:
  """Attention kernels: [d, d] each, or DenseGeneral [d, H, hd] and [H, hd, d]."""
  n = spec.dims
  if spec.dense_general:
    return {**{k: _hid(n.d, n.H, n.hd) for k in ('wq', 'wk', 'wv')},
            'wo': _hid(n.H, n.hd, n.d)}
  return {k: _hid(n.d, n.d) for k in ('wq', 'wk', 'wv', 'wo')}


def _layer_tree(spec: Spec) -> dict[str, Any]:
  """One layer's leaves, conventional names, (ShapeDtypeStruct, Truth) pairs."""
  n = spec.dims
  E, d, f = n.E, n.d, n.f
  bb = lambda *shape: _leaf(shape, 'backbone', ())  # noqa: E731
  layer: dict[str, Any] = {'pre_norm': {'scale': bb(d)}, 'post_norm': {'scale': bb(d)}}
  if spec.attention:
    layer['attn'] = _attention_tree(spec)
  router: dict[str, Any] = {'kernel': _leaf((d, E), 'router', ())}
  if spec.select_bias and spec.dispatch not in OWN_GATES:
    router['bias'] = _leaf((E,), 'router', ())
  if spec.bank == 'units':
    unit = lambda: {'w1': _leaf((d, f), 'experts', ()),  # noqa: E731
                    'w2': _leaf((f, d), 'experts', ())}
    experts: Any = [unit() for _ in range(E)]
  else:
    ex = lambda *shape: _leaf(shape, 'experts', (0,))  # noqa: E731
    if spec.bank == 'fused':
      experts = {'w13': ex(E, d, 2 * f), 'w2': ex(E, f, d)}
    elif spec.bank == 'swiglu':
      experts = {'w1': ex(E, d, f), 'w3': ex(E, d, f), 'w2': ex(E, f, d)}
    else:
      experts = {'w1': ex(E, d, f), 'w2': ex(E, f, d)}
    if spec.expert_bias:
      experts.update(b1=ex(E, f), b2=ex(E, d))
    if spec.expert_scale:
      experts['scale'] = ex(E)
  moe: dict[str, Any] = {'router': router, 'experts': experts}
  if spec.moe_norm:
    moe['norm'] = {'scale': bb(d)}
  if spec.shared:
    moe['shared_experts'] = {'w1': _hid(d, f), 'w2': _hid(f, d)}
  layer['moe'] = moe
  if spec.dense_mlp:
    layer['mlp'] = {'w1': _hid(d, f), 'w2': _hid(f, d)}
  return layer


def _is_pair(x: Any) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], Truth)


def _stack(tree: Any, L: int) -> Any:
  """Every leaf of a layer stacked over L layers at axis 0 (batch axes shifted)."""
  def one(pair: tuple[Any, Truth]) -> tuple[Any, Truth]:
    sds, truth = pair
    return (jax.ShapeDtypeStruct((L, *sds.shape), sds.dtype),
            Truth(truth.tier, (0, *(a + 1 for a in truth.axes)), truth.hidden))
  return jax.tree.map(one, tree, is_leaf=_is_pair)


# ViT's patches: PATCH x PATCH pixels of CHANNELS channels each.
PATCH, CHANNELS = 14, 17  # no other length of a program (no accidental coincidence)


def _conventional_tree(spec: Spec) -> dict[str, Any]:
  n = spec.dims
  bb = lambda *shape: _leaf(shape, 'backbone', ())  # noqa: E731
  if spec.tokens == 'vit':  # big_vision's names: the input layer is a patch convolution
    tree: dict[str, Any] = {'embedding': {'kernel': bb(PATCH, PATCH, CHANNELS, n.d),
                                          'bias': bb(n.d)},
                            'cls': bb(1, 1, n.d), 'pos_embedding': bb(1, n.S, n.d)}
  else:
    tree = {'embed': {'embedding': bb(n.V, n.d)}}
  layer = _layer_tree(spec)
  if spec.stacking == 'single':
    tree['layer'] = layer
  elif spec.stacking == 'loop':
    tree['layers'] = [_layer_tree(spec) for _ in range(n.L)]
  else:
    tree['layers'] = _stack(layer, n.L)
  tree['final_norm'] = {'scale': bb(n.d)}
  if spec.tokens == 'vit':  # multihead attention pooling: a probe queries the tokens
    tree['map_head'] = {
        'probe': bb(1, 1, n.d),
        'attention': {'query': {'kernel': _hid(n.d, n.H, n.hd), 'bias': bb(n.H, n.hd)},
                      'key': {'kernel': _hid(n.d, n.H, n.hd), 'bias': bb(n.H, n.hd)},
                      'value': {'kernel': _hid(n.d, n.H, n.hd), 'bias': bb(n.H, n.hd)},
                      'out': {'kernel': _hid(n.H, n.hd, n.d), 'bias': bb(n.d)}}}
  if spec.pre_logits:
    tree['pre_logits'] = {'kernel': _hid(n.d, n.d), 'bias': bb(n.d)}
  if spec.tokens == 'vit':
    tree['head'] = {'kernel': bb(n.d, n.V)}
  elif not spec.tied:
    tree['lm_head'] = {'kernel': bb(n.d, n.V)}
  return tree


class _Names:
  """Renames dict keys (conventional -> random tokens), deterministically per path; the
  elements of a list (layers in a loop, one module per expert) share their names, as
  instances of one module do."""

  def __init__(self, spec: Spec):
    self.mode = spec.names
    self.rng = np.random.default_rng(spec.seed)
    self.forward: dict[tuple[str, ...], str] = {}

  def _token(self, taken: set[str]) -> str:
    while True:
      size = int(self.rng.integers(2, 6))
      tok = ''.join(self.rng.choice(list(_CONSONANTS), size))
      if tok not in taken and not any(b in tok for b in _TOKEN_BANNED):
        return tok

  def rename(self, tree: Any, where: tuple[str, ...] = ()) -> Any:
    if isinstance(tree, dict):
      out, taken = {}, set(tree) | {self.forward.get((*where, k), k) for k in tree}
      for key in tree:
        if (*where, key) not in self.forward:
          new = key
          if self.mode == 'random' or (self.mode == 'mixed' and self.rng.random() < 0.5):
            new = self._token(taken)
            taken.add(new)
          self.forward[(*where, key)] = new
        out[self.forward[(*where, key)]] = self.rename(tree[key], (*where, key))
      return out
    if isinstance(tree, list):
      return [self.rename(x, (*where, '*')) for x in tree]
    return tree

  def restore(self, tree: Any, where: tuple[str, ...] = ()) -> Any:
    """The inverse of `rename` on a tree of the renamed structure (any leaves)."""
    if isinstance(tree, dict):
      back = {self.forward[(*where, k)]: k for k in self._keys(where)}
      return {back[k]: self.restore(v, (*where, back[k])) for k, v in tree.items()}
    if isinstance(tree, list):
      return [self.restore(x, (*where, '*')) for x in tree]
    return tree

  def _keys(self, where: tuple[str, ...]) -> list[str]:
    return [k[-1] for k in self.forward if k[:-1] == where]


# ---------------------------------------------------------------------------- sharding


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def _axis_names(rng: np.random.Generator, truth: Truth, ndim: int, stacked: bool
                ) -> tuple[Optional[str], ...]:
  """Random mesh axis names for one leaf (each used once); a bank's expert axis is
  mostly named `expert`, every other axis anything (`expert` included)."""
  pool = list(MESH_AXES)
  names: list[Optional[str]] = [None] * ndim
  expert_axis = None
  if truth.tier == 'experts' and truth.axes:
    expert_axis = truth.axes[-1] if len(truth.axes) > int(stacked) else None
  if expert_axis is not None and rng.random() < 0.8:
    names[expert_axis] = 'expert'
    pool.remove('expert')
  for a in range(ndim):
    if names[a] is None and not (stacked and a == 0) and rng.random() < 0.6 and pool:
      names[a] = pool.pop(int(rng.integers(len(pool))))
  return tuple(names)


def _constrain(x: jax.Array, names: Optional[tuple[Optional[str], ...]]) -> jax.Array:
  if names is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(_mesh(), P(*names)))


# ---------------------------------------------------------------------------- forward


def _rms(x: jax.Array, g: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _attention(h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  if p['wq'].ndim == 3:  # DenseGeneral: heads and head_dim kept apart
    q, k, v = (jnp.einsum('td,dhk->thk', h, p[m]) for m in ('wq', 'wk', 'wv'))
    a = jax.nn.softmax(jnp.einsum('thk,shk->hts', q, k) / np.sqrt(q.shape[-1]), -1)
    return jnp.einsum('thk,hkd->td', jnp.einsum('hts,shk->thk', a, v), p['wo'])
  q, k, v = h @ p['wq'], h @ p['wk'], h @ p['wv']
  a = jax.nn.softmax(q @ k.T / np.sqrt(h.shape[-1]), -1)
  return (a @ v) @ p['wo']


def _map_head(x: jax.Array, p: dict[str, Any]) -> jax.Array:
  """Multihead attention pooling: a learned probe [1, 1, d] queries each image's tokens
  [B, S, d] (query, key and value kernels [d, H, hd] with biases [H, hd], out [H, hd, d])."""
  a = p['attention']
  proj = lambda v, m: (jnp.einsum('bsd,dhk->bshk', v, a[m]['kernel'])  # noqa: E731
                       + a[m]['bias'])
  q = proj(jnp.broadcast_to(p['probe'], (x.shape[0], 1, x.shape[-1])), 'query')
  k, v = proj(x, 'key'), proj(x, 'value')
  w = jax.nn.softmax(jnp.einsum('bqhk,bshk->bhqs', q, k) / np.sqrt(q.shape[-1]), -1)
  o = jnp.einsum('bhqs,bshk->bqhk', w, v)
  return (jnp.einsum('bqhk,hkd->bqd', o, a['out']['kernel']) + a['out']['bias'])[:, 0]


def _patches(images: jax.Array, p: dict[str, Any]) -> jax.Array:
  """ViT's tokens [B, S, d]: a patch convolution (stride = patch), the class token first,
  the position table [1, S, d] added."""
  x = jax.lax.conv_general_dilated(images, p['embedding']['kernel'], (PATCH, PATCH),
                                   'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  x = x.reshape(x.shape[0], -1, x.shape[-1]) + p['embedding']['bias']
  cls = jnp.broadcast_to(p['cls'], (x.shape[0], 1, x.shape[-1]))
  return jnp.concatenate([cls, x], axis=1) + p['pos_embedding']


def _mlp(h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  return jax.nn.gelu(h @ p['w1']) @ p['w2']


def _ffn(spec: Spec, x: Any, first: Callable, second: Callable, bias: Callable) -> Any:
  """An expert FFN in some layout: `first`/`second` apply a bank matrix by name,
  `bias(name)` gives a per-expert vector broadcast to that layout."""
  if spec.bank == 'fused':
    g, u = jnp.split(first(x, 'w13'), 2, axis=-1)
    h = jax.nn.silu(g) * u
  elif spec.bank == 'swiglu':
    h = jax.nn.silu(first(x, 'w1')) * first(x, 'w3')
  else:
    h = jax.nn.gelu(first(x, 'w1'))
  if spec.expert_bias:
    h = h + bias('b1')
  out = second(h, 'w2')
  if spec.expert_bias:
    out = out + bias('b2')
  if spec.expert_scale:
    out = out * bias('scale')[..., None]
  return out


def _route(spec: Spec, h: jax.Array, router: dict[str, jax.Array], key: Any
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Token choice: expert ids [T, K], combine weights [T, K], auxiliary loss []."""
  n = spec.dims
  logits = h.astype(jnp.float32) @ router['kernel'].astype(jnp.float32)
  if key is not None:
    k1, _ = jax.random.split(key)
    if spec.noise == 'typed_data':  # through raw key data, as some rng plumbing does
      k1 = jax.random.wrap_key_data(jax.random.key_data(jax.random.split(k1, 2))[0])
    logits = logits + 1e-2 * jax.random.normal(k1, logits.shape)
  scores = jax.nn.softmax(logits, -1) if spec.scores == 'softmax' else jax.nn.sigmoid(logits)
  sel = scores + router['bias'] if 'bias' in router else scores
  if spec.grouped:
    per = n.E // n.G
    grouped = sel.reshape(n.T, n.G, per)
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
    _, keep = jax.lax.top_k(group_score, 1)  # [T, 1]
    mask = jax.nn.one_hot(keep, n.G).sum(1)  # [T, G]
    sel = jnp.where(mask[..., None] > 0, grouped, -jnp.inf).reshape(n.T, n.E)
  if spec.argmax:
    ids = jnp.argmax(sel, axis=-1)[:, None]
  else:
    _, ids = jax.lax.top_k(sel, n.K)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if spec.renorm:
    weights = weights / jnp.sum(weights, -1, keepdims=True)
  aux = jnp.zeros(())
  if spec.aux_loss:  # Switch load balancing (fraction routed x mean probability), z-loss
    routed = jnp.mean(jax.nn.one_hot(ids, n.E).sum(1), axis=0)
    aux = n.E * jnp.sum(routed * jnp.mean(scores, axis=0))
    aux = aux + 1e-3 * jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
  return ids, weights.astype(h.dtype), aux


def _moe(spec: Spec, h: jax.Array, p: dict[str, Any], key: Any) -> jax.Array:
  C, d = spec.dims.C, spec.dims.d
  bank = p['experts']
  use_shard_map = spec.sharding == 'shard_map'
  if 'norm' in p:  # a norm of the block's own: its gain scales the router's input and
    h = _rms(h, p['norm']['scale'])  # the experts' alike (not a router parameter)

  if spec.dispatch == 'expert_choice':
    scores = jax.nn.softmax(h @ p['router']['kernel'], axis=0)  # over the tokens
    g, idx = jax.lax.top_k(scores.T, C)  # [E, C] token positions
    out = _slots(spec, h[idx], bank, use_shard_map) * g[..., None]
    return jnp.zeros_like(h).at[idx.reshape(-1)].add(out.reshape(-1, d))
  if spec.dispatch == 'group_choice':
    return _group_choice(spec, h, p, use_shard_map)
  if spec.dispatch == 'gshard':
    combine = gshard_combine(h @ p['router']['kernel'], C)  # [T, E, C]
    dispatch = combine.astype(bool).astype(h.dtype)
    out = _slots(spec, jnp.einsum('tec,td->ecd', dispatch, h), bank, use_shard_map)
    return jnp.einsum('tec,ecd->td', combine.astype(h.dtype), out)

  ids, w, aux = _route(spec, h, p['router'], key)
  return _dispatch(spec, h, bank, ids, w, use_shard_map) + aux.astype(h.dtype)


def gshard_combine(logits: jax.Array, C: int) -> jax.Array:
  """GShard's top-2 gate: argmax, the first choice masked out, argmax again; positions in
  each expert's buffer by cumsum, tokens past capacity `C` dropped; the combine weights
  [T, E, C] (renormalised over the two)."""
  E = logits.shape[-1]
  gates = jax.nn.softmax(logits, axis=-1)
  mask_1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), E, dtype=jnp.int32)
  gate_1 = jnp.sum(gates * mask_1, axis=-1)
  second = jnp.argmax(jnp.where(mask_1 > 0, -jnp.inf, logits), axis=-1)
  mask_2 = jax.nn.one_hot(second, E, dtype=jnp.int32)
  gate_2 = jnp.sum(gates * mask_2, axis=-1)
  pos_1 = jnp.cumsum(mask_1, axis=0) - mask_1
  mask_1 = mask_1 * (pos_1 < C)
  pos_2 = jnp.cumsum(mask_2, axis=0) - mask_2 + jnp.sum(mask_1, axis=0, keepdims=True)
  mask_2 = mask_2 * (pos_2 < C)
  loc_1, loc_2 = jnp.sum(pos_1 * mask_1, axis=-1), jnp.sum(pos_2 * mask_2, axis=-1)
  denom = gate_1 + gate_2 + 1e-9
  return ((gate_1 / denom)[:, None, None] * mask_1[:, :, None]
          * jax.nn.one_hot(loc_1, C)[:, None, :]
          + (gate_2 / denom)[:, None, None] * mask_2[:, :, None]
          * jax.nn.one_hot(loc_2, C)[:, None, :])


def _group_choice(spec: Spec, h: jax.Array, p: dict[str, Any], use_shard_map: bool
                  ) -> jax.Array:
  """Expert choice within token groups (one group per sequence): each expert takes its
  top-c tokens of every group; the experts run on [E, groups x c, d]; the weighted
  outputs are scattered back onto each group's tokens."""
  n = spec.dims
  c = 2
  groups = h.reshape(n.B, n.S, n.d)
  scores = jax.nn.softmax(jnp.einsum('gsd,de->gse', groups, p['router']['kernel']), -1)
  g, idx = jax.lax.top_k(scores.transpose(0, 2, 1), c)  # [G, E, c] token positions
  x = jax.vmap(lambda v, i: v[i])(groups, idx)  # [G, E, c, d]
  x = x.transpose(1, 0, 2, 3).reshape(n.E, n.B * c, n.d)
  out = _slots(spec, x, p['experts'], use_shard_map).reshape(n.E, n.B, c, n.d)
  out = out.transpose(1, 0, 2, 3) * g[..., None]
  back = jax.vmap(lambda o, i: jnp.zeros((n.S, n.d), h.dtype).at[i.reshape(-1)].add(
      o.reshape(-1, n.d)))(out, idx)
  return back.reshape(n.T, n.d)


def _index_dispatch(spec: Spec, h: jax.Array, bank: Any, ids: jax.Array, w: jax.Array,
                    use_shard_map: bool) -> jax.Array:
  """Tokens dispatched by computed indices: each (token, choice) written at row
  `expert * capacity + position` of a buffer (one spare row for the dropped), the
  experts run on it as [E, capacity, d], their rows gathered back and scattered onto
  the tokens."""
  n = spec.dims
  E, C, d = n.E, n.C, n.d
  flat = ids.reshape(-1)
  onehot = jax.nn.one_hot(flat, E, dtype=jnp.int32)
  pos = jnp.take_along_axis(jnp.cumsum(onehot, 0) - onehot, flat[:, None], 1)[:, 0]
  keep = pos < C
  slot = jnp.where(keep, flat * C + pos, E * C)
  tok = jnp.repeat(jnp.arange(h.shape[0]), ids.shape[-1])
  buf = jnp.zeros((E * C + 1, d), h.dtype).at[slot].set(h[tok])[:-1].reshape(E, C, d)
  out = _slots(spec, buf, bank, use_shard_map).reshape(-1, d)
  out = jnp.concatenate([out, jnp.zeros((1, d), out.dtype)])[slot]
  out = out * (w.reshape(-1) * keep)[:, None].astype(out.dtype)
  return jnp.zeros_like(h).at[tok].add(out)


def _dispatch(spec: Spec, h: jax.Array, bank: Any, ids: jax.Array, w: jax.Array,
              use_shard_map: bool) -> jax.Array:
  """Tokens to their experts and back, by `spec.dispatch`."""
  n = spec.dims
  E, T, K, C, d = n.E, n.T, n.K, n.C, n.d
  if spec.dispatch in ('onehot', 'scatter', 'mask', 'stack', 'concat', 'units_loop'):
    if spec.dispatch == 'scatter':
      comb = jnp.zeros((T, E), h.dtype).at[jnp.arange(T)[:, None], ids].set(w)
    elif spec.dispatch == 'mask':
      hit = ids[..., None] == jnp.arange(E)  # [T, K, E]
      comb = jnp.sum(jnp.where(hit, w[..., None], 0.0), axis=1)
    else:
      comb = jnp.einsum('tke,tk->te', jax.nn.one_hot(ids, E), w)
    if spec.bank == 'units':
      outs = [_ffn(dataclasses.replace(spec, expert_bias=False, expert_scale=False), h,
                   lambda x, m, u=u: x @ u[m], lambda x, m, u=u: x @ u[m], None)
              for u in bank]
      if spec.dispatch not in ('stack', 'concat'):  # each unit's output times its weight
        y = jnp.zeros_like(h)
        for e, o in enumerate(outs):
          if spec.dispatch == 'units_loop':
            y = y + o * jnp.sum(w * (ids == e), axis=-1)[:, None]
          else:
            y = y + o * comb[:, e:e + 1]
        return y
    elif spec.dispatch in ('stack', 'concat'):
      outs = [_ffn(spec, h, lambda x, m, e=e: x @ bank[m][e],
                   lambda x, m, e=e: x @ bank[m][e], lambda m, e=e: bank[m][e])
              for e in range(E)]
    else:
      every = _all(spec, h, bank, use_shard_map)  # [T, E, d]
      return jnp.einsum('ted,te->td', every, comb)
    if spec.dispatch == 'concat':
      every = jnp.concatenate([o[:, None] for o in outs], axis=1)
    else:
      every = jnp.stack(outs, axis=1)
    return jnp.einsum('ted,te->td', every, comb)

  if spec.dispatch == 'capacity':
    hot = jax.nn.one_hot(ids, E)  # [T, K, E]
    flat = hot.transpose(1, 0, 2).reshape(-1, E)
    pos = ((jnp.cumsum(flat, axis=0) - 1) * flat).reshape(K, T, E).transpose(1, 0, 2)
    slot = jax.nn.one_hot(jnp.sum(pos, -1).astype(jnp.int32), C)  # [T, K, C]
    dispatch = jnp.einsum('tke,tkc->tec', hot, slot)
    combine = jnp.einsum('tke,tkc,tk->tec', hot, slot, w)
    out = _slots(spec, jnp.einsum('tec,td->ecd', dispatch, h), bank, use_shard_map)
    return jnp.einsum('tec,ecd->td', combine, out)

  if spec.dispatch == 'index':
    return _index_dispatch(spec, h, bank, ids, w, use_shard_map)

  flat = ids.reshape(-1)  # [T K]
  rows = jnp.repeat(h, K, axis=0)
  token = jnp.repeat(jnp.arange(T), K)
  wf = w.reshape(-1)
  if spec.dispatch in ('gather', 'segment'):
    out = _rows(spec, rows, bank, flat)
    if spec.dispatch == 'gather':
      return (out.reshape(T, K, d) * w[..., None]).sum(1)
    return jax.ops.segment_sum(out * wf[:, None], token, num_segments=T)
  order = jnp.argsort(flat)
  srows, sids = jnp.take(rows, order, axis=0), flat[order]
  if spec.dispatch == 'sorted_ragged':
    sizes = jnp.bincount(flat, length=E)
    out = _ffn(spec, srows, lambda x, m: jax.lax.ragged_dot(x, bank[m], sizes),
               lambda x, m: jax.lax.ragged_dot(x, bank[m], sizes), lambda m: bank[m][sids])
  else:  # sorted_segment
    out = _rows(spec, srows, bank, sids)
  return jax.ops.segment_sum(out * wf[order][:, None], token[order], num_segments=T)


def _all(spec: Spec, h: jax.Array, bank: dict[str, jax.Array], use_shard_map: bool
         ) -> jax.Array:
  """Every expert on every token: [T, d] -> [T, E, d]."""
  def run(x: jax.Array, b: dict[str, jax.Array]) -> jax.Array:
    return _ffn(spec, x, lambda v, m: jnp.einsum('td,edf->tef', v, b[m]),
                lambda v, m: jnp.einsum('tef,efd->ted', v, b[m]), lambda m: b[m][None])
  if use_shard_map:
    run = jax.shard_map(run, mesh=_mesh(), in_specs=(P(), P('expert')),
                        out_specs=P(None, 'expert'))
  return run(h, bank)


def _slots(spec: Spec, x: jax.Array, bank: dict[str, jax.Array], use_shard_map: bool
           ) -> jax.Array:
  """Each expert on its slots: [E, C, d] -> [E, C, d]."""
  def run(v: jax.Array, b: dict[str, jax.Array]) -> jax.Array:
    return _ffn(spec, v, lambda u, m: jnp.einsum('ecd,edf->ecf', u, b[m]),
                lambda u, m: jnp.einsum('ecf,efd->ecd', u, b[m]), lambda m: b[m][:, None])
  if use_shard_map:
    run = jax.shard_map(run, mesh=_mesh(), in_specs=(P('expert'), P('expert')),
                        out_specs=P('expert'))
  return run(x, bank)


def _rows(spec: Spec, x: jax.Array, bank: dict[str, jax.Array], ids: jax.Array) -> jax.Array:
  """Each row times its expert's matrices, gathered by id: [N, d] -> [N, d]."""
  return _ffn(spec, x, lambda v, m: jnp.einsum('nd,ndf->nf', v, bank[m][ids]),
              lambda v, m: jnp.einsum('nf,nfd->nd', v, bank[m][ids]),
              lambda m: bank[m][ids])


def _layer(spec: Spec, x: jax.Array, p: dict[str, Any], key: Any,
           names: dict[str, Any]) -> jax.Array:
  """One block: norm, attention, norm, MoE (+ shared expert, + dense MLP)."""
  dtype = x.dtype
  p = _constrained(p, names)
  h = _rms(x, p['pre_norm']['scale'])
  if spec.attention:
    x = x + _attention(h, p['attn'])
    h = _rms(x, p['post_norm']['scale'])
  else:
    h = h * p['post_norm']['scale']
  if spec.sharding != 'none':
    h = _constrain(h, ('data', None))
  y = _moe(spec, h, p['moe'], key)
  if spec.shared:
    y = y + _mlp(h, p['moe']['shared_experts'])
  if spec.dense_mlp:
    y = y + _mlp(h, p['mlp'])
  return (x + y).astype(dtype)


def _constrained(tree: Any, names: dict[str, Any], where: str = '') -> Any:
  """`with_sharding_constraint` on every leaf that has axis names (by conventional path)."""
  if isinstance(tree, dict):
    return {k: _constrained(v, names, f'{where}/{k}' if where else k) for k, v in tree.items()}
  if isinstance(tree, list):
    return [_constrained(v, names, f'{where}/{i}' if where else str(i))
            for i, v in enumerate(tree)]
  return _constrain(tree, names.get(where))


# A flat layer's keys (conventional names), by the leaf's path in the nested layer.
_FLAT = {'pre_norm/scale': 'pre_norm', 'post_norm/scale': 'post_norm',
         'moe/norm/scale': 'moe_norm',
         'moe/router/kernel': 'router', 'moe/router/bias': 'router_bias',
         'moe/experts/scale': 'per_expert_scale', 'moe/experts': 'experts'}
_FLAT_PREFIX = {'attn/': '', 'moe/experts/': '', 'moe/shared_experts/': 'shared_mlp_',
                'mlp/': 'mlp_'}


def _flat_key(path: str) -> str:
  if path in _FLAT:
    return _FLAT[path]
  for prefix, short in _FLAT_PREFIX.items():
    if path.startswith(prefix):
      return short + path[len(prefix):]
  raise KeyError(path)


def _flatten_layer(layer: dict[str, Any]) -> dict[str, Any]:
  """Every leaf of a nested layer in one dict (a list of expert modules kept whole)."""
  out = {}
  def walk(tree: Any, where: str) -> None:
    if isinstance(tree, dict):
      for k, v in tree.items():
        walk(v, f'{where}/{k}' if where else k)
    else:
      out[_flat_key(where)] = tree
  walk(layer, '')
  return out


def _nest_layer(flat: dict[str, Any]) -> dict[str, Any]:
  """The inverse of `_flatten_layer`."""
  paths = {}
  for path in ('pre_norm/scale', 'post_norm/scale', 'moe/norm/scale', 'moe/router/kernel',
               'moe/router/bias',
               'moe/experts/scale', 'moe/experts', 'attn/wq', 'attn/wk', 'attn/wv',
               'attn/wo', 'moe/shared_experts/w1', 'moe/shared_experts/w2', 'mlp/w1',
               'mlp/w2', *(f'moe/experts/{m}' for m in ('w1', 'w2', 'w3', 'w13', 'b1', 'b2'))):
    paths[_flat_key(path)] = path
  out: dict[str, Any] = {}
  for key, value in flat.items():
    *parents, last = paths[key].split('/')
    node = out
    for seg in parents:
      node = node.setdefault(seg, {})
    node[last] = value
  return out


def _store(tree: dict[str, Any], layout: str, inverse: bool = False) -> dict[str, Any]:
  """The model tree as stored (`layout` 'flat': each layer one dict), or back."""
  if layout == 'nested':
    return tree
  one = _nest_layer if inverse else _flatten_layer
  out = dict(tree)
  if 'layer' in tree:
    out['layer'] = one(tree['layer'])
  elif isinstance(tree['layers'], list):
    out['layers'] = [one(x) for x in tree['layers']]
  else:
    out['layers'] = one(tree['layers'])
  return out


def build(spec: Spec) -> Program:
  """The program `spec` describes: params, forward, inputs and truth."""
  n = spec.dims
  conventional = _conventional_tree(spec)
  namer = _Names(spec)
  renamed = namer.rename(_store(conventional, spec.layout))
  truth = [pair[1] for pair in jax.tree.leaves(renamed, is_leaf=_is_pair)]
  dtype = jnp.dtype(spec.dtype)
  params = jax.tree.map(lambda pair: jax.ShapeDtypeStruct(pair[0].shape, dtype), renamed,
                        is_leaf=_is_pair)
  stacked = spec.stacking in ('scan', 'map', 'vmap')

  # Mesh axis names per leaf, by conventional path (layer-relative inside the layer).
  rng = np.random.default_rng(spec.seed + 1)
  names: dict[str, Any] = {}
  layer_names: dict[str, Any] = {}
  chosen: dict[int, Any] = {}  # id of the leaf's (ShapeDtypeStruct, Truth) pair -> names
  if spec.sharding in ('constraint', 'boxed'):
    for path, pair in jax.tree_util.tree_flatten_with_path(conventional, is_leaf=_is_pair)[0]:
      segs = list(_paths.path_segments(path))
      sds, t = pair
      in_layer = segs[0] in ('layer', 'layers')
      chosen[id(pair)] = _axis_names(rng, t, len(sds.shape), in_layer and stacked)
      names['/'.join(segs)] = chosen[id(pair)]
      if in_layer:
        # inside the layer function a stacked leaf has lost its layer axis
        inner = '/'.join(segs[2 if spec.stacking == 'loop' else 1:])
        layer_names.setdefault(inner, chosen[id(pair)][1:] if stacked else chosen[id(pair)])
  if spec.sharding == 'boxed':
    params = jax.tree.map(
        lambda pair: nn.Partitioned(jax.ShapeDtypeStruct(pair[0].shape, dtype),
                                    names=chosen[id(pair)]), renamed, is_leaf=_is_pair)

  if spec.tokens == 'vit':
    tokens = jax.ShapeDtypeStruct((n.B, (n.S - 1) * PATCH, PATCH, CHANNELS), jnp.float32)
  else:
    tokens = jax.ShapeDtypeStruct((n.B, n.S), jnp.int32)
  args: tuple[Any, ...] = (tokens,)
  if spec.noise in ('typed', 'typed_data'):
    args += (jax.ShapeDtypeStruct((), jax.random.key(0).dtype),)
  elif spec.noise == 'legacy':
    args += (jax.ShapeDtypeStruct((2,), jnp.uint32),)

  def fn(p: Any, toks: jax.Array, key: Any = None) -> jax.Array:
    if spec.sharding == 'boxed':
      p = nn.meta.unbox(p)
    p = _store(namer.restore(p), spec.layout, inverse=True)
    top = {k: v for k, v in p.items() if k not in ('layer', 'layers')}
    p = {**p, **_constrained(top, names)}
    if spec.tokens == 'vit':
      x = _patches(toks.astype(dtype), p).reshape(n.T, n.d)
    else:
      x = p['embed']['embedding'][toks.reshape(-1)]
    step = functools.partial(_layer, spec, names=layer_names)
    if spec.remat:
      step = jax.checkpoint(step)
    if spec.stacking == 'single':
      x = step(x, p['layer'], key)
    elif spec.stacking == 'loop':
      keys = [None] * n.L if key is None else list(jax.random.split(key, n.L))
      for lp, k in zip(p['layers'], keys):
        x = step(x, lp, k)
    else:
      keys = None if key is None else jax.random.split(key, n.L)
      if spec.stacking == 'scan':
        x, _ = jax.lax.scan(lambda c, xs: (step(c, xs[0], xs[1]), None), x,
                            (p['layers'], keys))
      elif spec.stacking == 'map':
        x = jnp.mean(jax.lax.map(lambda xs: step(x, xs[0], xs[1]), (p['layers'], keys)), 0)
      else:
        x = jnp.mean(jax.vmap(lambda lp, k: step(x, lp, k))(p['layers'], keys), 0)
    x = _rms(x, p['final_norm']['scale'])
    if spec.tokens == 'vit':
      x = _map_head(x.reshape(n.B, n.S, n.d), p['map_head'])
    if spec.pre_logits:
      x = jnp.tanh(x @ p['pre_logits']['kernel'] + p['pre_logits']['bias'])
    if spec.tokens == 'vit':
      return x @ p['head']['kernel']
    head = p['embed']['embedding'].T if spec.tied else p['lm_head']['kernel']
    return x @ head

  paths = [_paths.path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert len(paths) == len(truth)
  return Program(spec, params, fn, args, truth, paths)


# ---------------------------------------------------------------------------- checks

# Outcomes per leaf. The property: only RIGHT and LOUD. QUIET (marked undecided in the
# Structure but no warning raised) and CRASHED (the route raised: the user gets no labels
# at all) are failures too; QUIET and SILENT together are the "silently wrong" leaves.
RIGHT, LOUD, QUIET, SILENT, CRASHED = ('right', 'undecided and loud',
                                       'undecided, no warning', 'silently wrong', 'crashed')
OUTCOMES = (RIGHT, LOUD, QUIET, SILENT, CRASHED)
FAILURES = (QUIET, SILENT, CRASHED)


@dataclasses.dataclass
class Verdict:
  """Per-leaf outcome of one route on one program."""
  route: str
  outcome: list[str]  # one of OUTCOMES per leaf
  got: list[Truth]
  undecided: list[bool]  # the route marked the leaf undecided (traced) or named it
  warned: bool  # some warning was raised
  error: Optional[str] = None  # the route raised

  @property
  def failed(self) -> bool:
    return any(o in FAILURES for o in self.outcome)

  def failures(self, program: Program) -> list[str]:
    """One line per leaf that is not right or loud."""
    if self.error:
      return [f'{self.route} route raised {self.error}']
    show = lambda x: f"{x.tier}{' hidden' if x.hidden else ''} {x.axes}"  # noqa: E731
    return [f'{p}: got {show(g)}, truth {show(t)} ({o})'
            for p, g, t, o in zip(program.paths, self.got, program.truth, self.outcome)
            if o in FAILURES]


def _names_leaf(message: str, path: str) -> bool:
  """Whether a warning's text names the leaf at `path` (its path, a glob over it, or a
  module above it given as `module/**` or `module:`)."""
  for token in re.findall(r"[\w./*\[\]-]+", message):
    token = token.strip("'.,")
    if not token:
      continue
    if token == path:
      return True
    if '*' in token and fnmatch.fnmatchcase(path, token.replace('**', '*')):
      return True
    if path.startswith(token + '/') and (f'{token}/**' in message or f'{token}:' in message):
      return True
  return False


def check_traced(program: Program) -> Verdict:
  """`sj.trace_structure` against the truth."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    try:
      result = sj.trace_structure(program.fn, program.params, *program.args)
    except Exception as exc:  # noqa: BLE001  (a crash is silent for every leaf it hides)
      n = len(program.truth)
      return Verdict('traced', [CRASHED] * n, [Truth('?', ())] * n, [False] * n,
                     bool(caught), error=f'{type(exc).__name__}: {exc}'[:300])
  got = [Truth(leaf.tier, tuple(leaf.batch_axes),
                leaf.tier == 'backbone' and leaf.role == 'hidden matrix'
                and _orthogonal.has_matrix(leaf.shape, leaf.batch_axes))
         for leaf in result.leaves]
  assert [leaf.path for leaf in result.leaves] == program.paths
  undecided = [leaf.path in result.undecided for leaf in result.leaves]
  # Loud: an `sj.UnsureLabelWarning` (`trace_structure` raises its `TraceWarning`), not
  # any warning at all (a deprecation from JAX says nothing about the labels).
  warned = any(issubclass(w.category, sj.UnsureLabelWarning) for w in caught)
  outcome = [RIGHT if g == t else (LOUD if warned else QUIET) if u else SILENT
             for g, t, u in zip(got, program.truth, undecided)]
  return Verdict('traced', outcome, got, undecided, warned)


def check_default(program: Program) -> Verdict:
  """`sj.hidden_param_labels` (`sj.moe_param_labels` with the hidden matrices apart) and
  `sj.moe_batch_axes` (names and shapes) against the truth."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    labels = sj.hidden_param_labels(program.params)
    axes = sj.moe_batch_axes(program.params)
  is_tier = lambda x: isinstance(x, str)  # noqa: E731
  tiers = jax.tree_util.tree_leaves(labels, is_leaf=is_tier)
  batch = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  got = [Truth('backbone' if t == 'hidden' else t, tuple(a), t == 'hidden')
         for t, a in zip(tiers, batch)]
  assert len(got) == len(program.truth)
  texts = [str(w.message) for w in caught if issubclass(w.category, sj.UnsureLabelWarning)]
  named = [any(_names_leaf(t, p) for t in texts) for p in program.paths]
  outcome = [RIGHT if g == t else (LOUD if u else SILENT)
             for g, t, u in zip(got, program.truth, named)]
  return Verdict('default', outcome, got, named, bool(texts))


ROUTES: dict[str, Callable[[Program], Verdict]] = {'traced': check_traced,
                                                   'default': check_default}


# ---------------------------------------------------------------------------- report


BASELINE = Spec(dims=Dims(E=4, d=8, f=12, V=11, B=2, S=5, L=3, K=2, G=2), scores='softmax',
                select_bias=False, noise='none', grouped=False, renorm=False, bank='plain',
                expert_bias=False, expert_scale=False, dispatch='onehot', shared=False,
                dense_mlp=False, attention=False, tied=False, stacking='single', remat=False,
                sharding='none', names='conventional', seed=0)


def single_block_specs(names: str = 'conventional') -> dict[str, Spec]:
  """`BASELINE` (one layer, softmax top-2, a plain bank, one-hot dispatch) with one block
  changed, per block tag: a failure here is that block's alone."""
  base = dataclasses.replace(BASELINE, names=names)
  out = {'baseline': base}
  flags = {'router:select_bias': 'select_bias', 'router:grouped': 'grouped',
           'router:renorm': 'renorm', 'bank:expert_bias': 'expert_bias',
           'bank:expert_scale': 'expert_scale', 'shared': 'shared', 'dense_mlp': 'dense_mlp',
           'attention': 'attention', 'tied': 'tied', 'remat': 'remat'}
  for tag, field in flags.items():
    out[tag] = dataclasses.replace(base, **{field: True})
  out['scores:sigmoid'] = dataclasses.replace(base, scores='sigmoid')
  for noise in NOISE[1:]:
    out[f'noise:{noise}'] = dataclasses.replace(base, noise=noise)
  for bank in BANKS[1:]:
    out[f'bank:{bank}'] = dataclasses.replace(base, bank=bank)
  for dispatch in STACKED_DISPATCH[1:]:
    out[f'dispatch:{dispatch}'] = dataclasses.replace(base, dispatch=dispatch)
  for dispatch in UNIT_DISPATCH:
    out[f'bank:units+dispatch:{dispatch}'] = dataclasses.replace(base, bank='units',
                                                                  dispatch=dispatch)
  for stacking in STACKING[1:]:
    out[f'stacking:{stacking}'] = dataclasses.replace(base, stacking=stacking)
  out['layout:flat'] = dataclasses.replace(base, layout='flat')
  out['router:argmax'] = dataclasses.replace(
      base, argmax=True, dims=dataclasses.replace(base.dims, K=1))
  out['router:aux_loss'] = dataclasses.replace(base, aux_loss=True)
  out['dtype:bfloat16'] = dataclasses.replace(base, dtype='bfloat16')
  for stacking in STACKING[1:]:
    out[f'layout:flat+stacking:{stacking}'] = dataclasses.replace(base, layout='flat',
                                                                  stacking=stacking)
  for sharding in SHARDING[1:]:
    out[f'sharding:{sharding}'] = dataclasses.replace(base, sharding=sharding)
  out['tokens:vit'] = dataclasses.replace(base, tokens='vit')
  general = dataclasses.replace(base, attention=True, dense_general=True)
  out['attention:dense_general'] = general
  out['moe_norm'] = dataclasses.replace(base, moe_norm=True)
  out['moe_norm+router:expert_choice+stacking:scan'] = dataclasses.replace(
      base, moe_norm=True, dispatch='expert_choice', stacking='scan')
  out['pre_logits'] = dataclasses.replace(base, pre_logits=True)
  out['dispatch:index+bank:expert_bias+stacking:scan'] = dataclasses.replace(
      base, dispatch='index', expert_bias=True, stacking='scan')
  for coincide, spec in (('hd=E', general), ('H=E', general), ('f=V', base),
                         ('E=L', dataclasses.replace(base, stacking='scan'))):
    out[f'dims:{coincide}'] = _coincide(dataclasses.replace(spec, coincide=coincide))
  for coincide in ('hd=E', 'H=E'):
    out[f'dims:{coincide}+layout:flat'] = _coincide(dataclasses.replace(
        general, coincide=coincide, layout='flat'))
  return out


def single_block_report() -> list[str]:
  """One line per (names, block, route) whose program is not all right or loud."""
  lines = []
  for names in ('conventional', 'random'):
    for tag, spec in single_block_specs(names).items():
      program = build(spec)
      for route, check in ROUTES.items():
        verdict = check(program)
        if verdict.failed:
          first = verdict.failures(program)
          lines.append(f'{names:<13}{tag:<34}{route:<8} {len(first)} leaves, e.g. {first[0]}')
        elif route == 'default' and names == 'conventional' and verdict.warned:
          lines.append(f'{names:<13}{tag:<34}{route:<8} warns on conventional names')
  return lines



def tally(n: int, seed: int = 0, exclude: frozenset[str] = frozenset(),
          names: Optional[str] = None, verbose: bool = False) -> dict[str, Any]:
  """Counts per route over `n` programs drawn from `specs` with hypothesis' random
  source seeded by `seed` (the same `seed` draws the same programs)."""
  from hypothesis import given, HealthCheck, seed as hseed, settings  # noqa: PLC0415
  counts = {r: collections.Counter() for r in ROUTES}
  per_block = {r: collections.Counter() for r in ROUTES}
  # (route, block) -> outcome counts over the leaves of the programs using the block
  leaves_by_block: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
      collections.Counter)
  block_seen: collections.Counter = collections.Counter()
  examples: dict[str, list[str]] = {r: [] for r in ROUTES}
  warned_conventional = [0, 0]
  errors: collections.Counter = collections.Counter()
  done = [0]

  @hseed(seed)
  @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
            phases=[__import__('hypothesis').Phase.generate])
  @given(spec=specs(exclude=exclude, names=names))
  def run(spec: Spec) -> None:
    program = build(spec)
    block_seen.update(program.blocks)
    done[0] += 1
    for route, check in ROUTES.items():
      verdict = check(program)
      counts[route].update(verdict.outcome)
      for tag in program.blocks:
        leaves_by_block[(route, tag)].update(verdict.outcome)
      if verdict.error:
        errors[f'{route}: {verdict.error.splitlines()[0][:120]}'] += 1
      if verdict.failed:
        per_block[route].update(program.blocks)
        if verbose and len(examples[route]) < 5:
          examples[route].append(f'{sorted(program.blocks)}\n    ' +
                                 '\n    '.join(verdict.failures(program)[:6]))
      if route == 'default' and spec.names == 'conventional':
        warned_conventional[0] += 1
        warned_conventional[1] += int(verdict.warned)

  run()
  return {'programs': done[0], 'counts': counts, 'per_block': per_block,
          'leaves_by_block': leaves_by_block,
          'block_seen': block_seen, 'examples': examples, 'errors': errors,
          'warned_conventional': warned_conventional}


def _print(report: dict[str, Any], seconds: float) -> None:
  print(f"{report['programs']} programs in {seconds:.0f} s")
  print(f"{'route':<9}{'leaves':>8}" + ''.join(f'{o:>{len(o) + 3}}' for o in OUTCOMES))
  for route, c in report['counts'].items():
    print(f'{route:<9}{sum(c.values()):>8}' + ''.join(f'{c[o]:>{len(o) + 3}}'
                                                      for o in OUTCOMES))
  w = report['warned_conventional']
  print(f'default route, conventional names: {w[1]} of {w[0]} programs warned')
  for route, blocks in report['per_block'].items():
    if not blocks:
      continue
    print(f'{route}: programs with a failing leaf, by block (of programs using it):')
    seen = report['block_seen']
    for tag, k in sorted(blocks.items(), key=lambda kv: -kv[1] / seen[kv[0]]):
      print(f'  {tag:<28}{k:>5} / {seen[tag]:<5}')
  for err, k in report['errors'].most_common():
    print(f'error x{k}: {err}')
  for route, items in report['examples'].items():
    for item in items:
      print(f'{route} example: {item}')


def block_table(report: dict[str, Any], seconds: float, argv: list[str]) -> str:
  """A markdown table: per building block and route, the leaves of the programs using
  it that are right, undecided and loud (the safe rule), and silently wrong (quiet,
  wrong or crashed)."""
  lines = [f"`python tests/support/moe_programs.py {' '.join(argv)}`: {report['programs']} "
           f'programs in {seconds:.0f} s.', '',
           '| route | leaves | right | undecided, safe and loud | silently wrong |',
           '|---|---:|---:|---:|---:|']
  for route, c in report['counts'].items():
    wrong = sum(c[o] for o in FAILURES)
    lines.append(f'| {route} | {sum(c.values())} | {c[RIGHT]} | {c[LOUD]} | {wrong} |')
  lines += ['', 'Per building block (leaves of the programs that use it):', '',
            '| block | programs | traced right | traced undecided | traced wrong '
            '| default right | default undecided | default wrong |',
            '|---|---:|---:|---:|---:|---:|---:|---:|']
  for tag in sorted(report['block_seen']):
    row = [tag, str(report['block_seen'][tag])]
    for route in ROUTES:
      c = report['leaves_by_block'][(route, tag)]
      row += [str(c[RIGHT]), str(c[LOUD]), str(sum(c[o] for o in FAILURES))]
    lines.append('| ' + ' | '.join(row) + ' |')
  return '\n'.join(lines) + '\n'


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--n', type=int, default=100, help='programs to draw')
  parser.add_argument('--names', choices=NAMES, default=None)
  parser.add_argument('--exclude', default='',
                      help='comma-separated block tags (a&b: both together) to switch off')
  parser.add_argument('--exclude-known', choices=sorted(KNOWN_FAILING), action='append',
                      default=[], help="switch off KNOWN_FAILING[...]'s blocks")
  parser.add_argument('--verbose', action='store_true')
  parser.add_argument('--blocks', action='store_true',
                      help='check each building block alone on a one-layer baseline')
  parser.add_argument('--table', default=None,
                      help='also write the per-block markdown table to this file')
  args = parser.parse_args(argv)
  if args.blocks:
    print('\n'.join(single_block_report()))
    return
  exclude = frozenset(t for t in args.exclude.split(',') if t)
  for route in args.exclude_known:
    exclude |= KNOWN_FAILING[route]
  start = time.time()
  report = tally(args.n, exclude=exclude, names=args.names, verbose=args.verbose)
  seconds = time.time() - start
  _print(report, seconds)
  if args.table:
    with open(args.table, 'w') as f:
      f.write(block_table(report, seconds, sys.argv[1:] if argv is None else argv))


if __name__ == '__main__':
  main()
