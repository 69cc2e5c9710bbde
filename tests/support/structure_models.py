"""MoE models in several styles whose parameter names say nothing about their role.

No path contains `expert`, `router`, `gate`, `moe`, `layer`, `scan`, `stack`, `block`,
`stage` or `repeat`: the tiers and batch axes of these models can only come from the
computation (`sj.trace_structure`) or, without it, from shapes. Each
`Case` holds the params, the forward function, example inputs and the hand-written
truth: every leaf's tier and batch axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import equinox as eqx
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

D, E, F, V = 8, 4, 12, 16  # width, routed count, hidden width, vocabulary
B, S = 2, 5  # tokens: T = 10 (no length equals E by accident)
C = 6  # slots per routed unit in capacity dispatch
FORBIDDEN = ('expert', 'router', 'gate', 'moe', 'layer', 'scan', 'stack', 'block', 'stage',
             'repeat')


@dataclasses.dataclass
class Case:
  """A model, how to call it, and the truth about its leaves (by normalised path)."""
  name: str
  params: Any
  fn: Callable[..., jax.Array]  # fn(params, *args) -> output array
  args: tuple[Any, ...]
  tiers: dict[str, str]
  axes: dict[str, tuple[int, ...]]


def _normal(key: jax.Array, shape: tuple[int, ...], std: float = 0.3) -> jax.Array:
  return std * jax.random.normal(key, shape, jnp.float32)


def _keys(seed: int, n: int) -> list[jax.Array]:
  return list(jax.random.split(jax.random.key(seed), n))


def _tokens(seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, S)), jnp.int32)


def _onehot_dispatch(x: jax.Array, idx: jax.Array, weights: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """GShard-style dispatch and combine tensors [T, E, C] from top-k choices [T, k]."""
  mask = jax.nn.one_hot(idx, E)  # [T, k, E]
  flat = mask.transpose(1, 0, 2).reshape(-1, E)  # choice-major
  pos = (jnp.cumsum(flat, axis=0) - 1) * flat
  pos = pos.reshape(idx.shape[1], x.shape[0], E).transpose(1, 0, 2)  # [T, k, E]
  slot = jax.nn.one_hot(jnp.sum(pos, -1).astype(jnp.int32), C)  # [T, k, C]
  dispatch = jnp.einsum('tke,tkc->tec', mask, slot)
  combine = jnp.einsum('tke,tkc,tk->tec', mask, slot, weights)
  return dispatch, combine


# ---------------------------------------------------------------------------- NNX


class NNXUnit(nnx.Module):
  """One block: norm, a routed SwiGLU bank (one-hot einsum dispatch), a common branch."""

  def __init__(self, rngs: nnx.Rngs):
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.pick = nnx.Linear(D, E, use_bias=False, rngs=rngs)
    self.bank_a = nnx.Param(_normal(rngs.params(), (E, D, F)))
    self.bank_b = nnx.Param(_normal(rngs.params(), (E, F, D)))
    self.common_a = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.common_b = nnx.Linear(F, D, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.ln(x)
    probs = jax.nn.softmax(self.pick(h))
    weights, idx = jax.lax.top_k(probs, 2)
    dispatch, combine = _onehot_dispatch(h, idx, weights)
    routed_in = jnp.einsum('tec,td->ecd', dispatch, h)
    mid = jax.nn.gelu(jnp.einsum('ecd,edf->ecf', routed_in, self.bank_a[...]))
    routed_out = jnp.einsum('ecf,efd->ecd', mid, self.bank_b[...])
    common = self.common_b(jax.nn.gelu(self.common_a(h)))
    return x + jnp.einsum('tec,ecd->td', combine, routed_out) + common


class NNXNet(nnx.Module):
  """Embedding, a stack of 3 `NNXUnit`s (nnx.vmap-created, nnx.scan-applied), a head."""

  def __init__(self, rngs: nnx.Rngs):
    self.tab = nnx.Embed(V, D, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> NNXUnit:
      return NNXUnit(rngs)

    self.body = create(rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.tab(tokens).reshape(-1, D)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x: jax.Array, unit: NNXUnit) -> jax.Array:
      return unit(x)

    return self.head(run(x, self.body))


def nnx_case() -> Case:
  model = NNXNet(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def fn(p: Any, tokens: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, p, rest)(tokens)

  tiers = {'tab/embedding': 'backbone', 'head/kernel': 'backbone', 'head/bias': 'backbone',
           'body/ln/scale': 'backbone', 'body/ln/bias': 'backbone',
           'body/pick/kernel': 'router', 'body/bank_a': 'experts',
           'body/bank_b': 'experts', 'body/common_a/kernel': 'backbone',
           'body/common_b/kernel': 'backbone'}
  axes = {p: () for p in tiers if not p.startswith('body/')}
  axes.update({p: (0,) for p in tiers if p.startswith('body/')})
  axes.update({'body/bank_a': (0, 1), 'body/bank_b': (0, 1)})
  return Case('nnx_vmap_scan_onehot_top_k_common', params, fn, (_tokens(),), tiers, axes)


# ---------------------------------------------------------------------------- Linen


class LinenUnit(nn.Module):
  """Top-1 argmax routing with sort/gather dispatch into [E, C, d] slots; no common branch."""

  @nn.compact
  def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
    h = nn.RMSNorm(name='nrm')(x)
    logits = nn.Dense(E, use_bias=False, name='sel')(h)
    choice = jnp.argmax(logits, axis=-1)  # [T]
    score = jnp.max(jax.nn.softmax(logits), axis=-1)
    order = jnp.argsort(choice)  # tokens sorted by their unit
    counts = jnp.bincount(choice, length=E)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(choice.shape[0]) - starts[choice[order]]
    slot = jnp.where(rank < C, choice[order] * C + rank, E * C)
    token_of_slot = jnp.full((E * C,), x.shape[0]).at[slot].set(order, mode='drop')
    padded = jnp.concatenate([h, jnp.zeros((1, D), h.dtype)])
    grouped = padded[token_of_slot].reshape(E, C, D)
    w_in = self.param('w_in', nn.initializers.normal(0.3), (E, D, F))
    w_out = self.param('w_out', nn.initializers.normal(0.3), (E, F, D))
    y = jnp.einsum('ecf,efd->ecd', jax.nn.relu(jnp.einsum('ecd,edf->ecf', grouped, w_in)),
                   w_out).reshape(E * C, D)
    back = jnp.zeros((x.shape[0] + 1, D)).at[token_of_slot].add(y)[:-1]
    return x + back * score[:, None], None


class LinenNet(nn.Module):
  """Embed -> 3 `LinenUnit`s by `nn.scan` with the stacked axis at position 1 -> head."""

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(V, D, name='tab')(tokens).reshape(-1, D)
    trunk = nn.scan(LinenUnit, variable_axes={'params': 1}, split_rngs={'params': True},
                    length=3)
    x, _ = trunk(name='trunk')(x, None)
    return nn.Dense(V, name='head')(x)


def linen_case() -> Case:
  model = LinenNet()
  tokens = _tokens(1)
  params = model.init(jax.random.key(1), tokens)
  fn = lambda p, t: model.apply(p, t)  # noqa: E731
  tiers = {'params/tab/embedding': 'backbone', 'params/head/kernel': 'backbone',
           'params/head/bias': 'backbone', 'params/trunk/nrm/scale': 'backbone',
           'params/trunk/sel/kernel': 'router', 'params/trunk/w_in': 'experts',
           'params/trunk/w_out': 'experts'}
  axes = {'params/tab/embedding': (), 'params/head/kernel': (), 'params/head/bias': (),
          'params/trunk/nrm/scale': (1,), 'params/trunk/sel/kernel': (1,),
          'params/trunk/w_in': (0, 1), 'params/trunk/w_out': (0, 1)}
  return Case('linen_scan_axis1_argmax_sort_gather', params, fn, (tokens,), tiers, axes)


# ---------------------------------------------------------------------------- plain JAX


@jax.custom_vjp
def _proj(x: jax.Array, w: jax.Array) -> jax.Array:
  """A projection with a hand-written backward pass."""
  return x @ w


def _proj_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, Any]:
  return x @ w, (x, w)


def _proj_bwd(res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  x, w = res
  return g @ w.T, x.T @ g


_proj.defvjp(_proj_fwd, _proj_bwd)


def _ragged_unit(x: jax.Array, p: dict[str, Any], flag: jax.Array) -> jax.Array:
  """Top-2 routing (logits + bias), tokens sorted by choice, `ragged_dot` per group."""
  h = x * p['s']
  logits = h @ p['q'] + p['qb']
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits), 2)  # [T, 2]
  flat = idx.reshape(-1)
  order = jnp.argsort(flat)
  sizes = jnp.bincount(flat, length=E)
  rows = jnp.repeat(h, 2, axis=0)[order]
  mid = jax.nn.silu(jax.lax.ragged_dot(rows, p['u'], sizes))
  mid = jax.lax.cond(flag > 0, jnp.tanh, lambda a: a, mid)
  out = jax.lax.ragged_dot(mid, p['v'], sizes)
  unsorted = jnp.zeros_like(out).at[order].set(out)
  y = (unsorted.reshape(-1, 2, D) * weights[..., None]).sum(1)
  return x + y + _proj(h, p['m'])


def ragged_case() -> Case:
  k = _keys(2, 8)
  n = 2
  params = {'tab': _normal(k[0], (V, D)),
            'body': {'s': jnp.ones((n, D)), 'q': _normal(k[1], (n, D, E)),
                      'qb': jnp.zeros((n, E)), 'u': _normal(k[2], (n, E, D, F)),
                      'v': _normal(k[3], (n, E, F, D)), 'm': _normal(k[4], (n, D, D))},
            'out': _normal(k[5], (D, V))}

  def fn(p: Any, tokens: jax.Array, flag: jax.Array) -> jax.Array:
    x = p['tab'][tokens].reshape(-1, D)
    step = jax.checkpoint(lambda c, sp: (_ragged_unit(c, sp, flag), None))
    x, _ = jax.lax.scan(step, x, p['body'])
    return x @ p['out']

  tiers = {'tab': 'backbone', 'out': 'backbone', 'body/s': 'backbone',
           'body/q': 'router', 'body/qb': 'router', 'body/u': 'experts',
           'body/v': 'experts', 'body/m': 'backbone'}
  axes = {'tab': (), 'out': (), 'body/s': (0,), 'body/q': (0,), 'body/qb': (0,),
          'body/u': (0, 1), 'body/v': (0, 1), 'body/m': (0,)}
  return Case('dict_scan_ragged_dot_remat_cond_custom_vjp', params, fn,
              (_tokens(2), jnp.ones((), jnp.int32)), tiers, axes)


def _nested_unit(x: jax.Array, p: dict[str, Any], mesh: Mesh) -> jax.Array:
  """Top-1 one-hot routing; the routed bank runs under `shard_map`; a common branch."""
  h = x * p['g0']
  probs = jax.nn.softmax(h @ p['a'])
  weights, idx = jax.lax.top_k(probs, 1)
  dispatch, combine = _onehot_dispatch(h, idx, weights)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
  def bank(inp: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    return jnp.einsum('ecf,efd->ecd', jax.nn.relu(jnp.einsum('ecd,edf->ecf', inp, w1)), w2)

  routed = bank(jnp.einsum('tec,td->ecd', dispatch, h), p['b1'], p['b2'])
  common = jax.nn.relu(h @ p['c1']) @ p['c2']
  return x + jnp.einsum('tec,ecd->td', combine, routed) + common


def nested_case() -> Case:
  k = _keys(3, 8)
  g, s = 2, 3  # outer and inner stacks
  # `c1` is stored [D, G, S, F] (the stacked axes at 1 and 2) and moved in front to scan.
  params = {'tab': _normal(k[0], (V, D)),
            'grp': {'g0': jnp.ones((g, s, D)), 'a': _normal(k[1], (g, s, D, E)),
                    'b1': _normal(k[2], (g, s, E, D, F)), 'b2': _normal(k[3], (g, s, E, F, D)),
                    'c1': _normal(k[4], (D, g, s, F)), 'c2': _normal(k[5], (g, s, F, D))},
            'out': _normal(k[6], (D, V))}
  mesh = Mesh(np.array(jax.devices()[:1]), ('data',))

  def fn(p: Any, tokens: jax.Array) -> jax.Array:
    x = p['tab'][tokens].reshape(-1, D)
    grp = dict(p['grp'], c1=jnp.moveaxis(p['grp']['c1'], 0, 2))

    def outer(c: jax.Array, gp: Any) -> tuple[jax.Array, None]:
      inner = lambda c2, sp: (_nested_unit(c2, sp, mesh), None)  # noqa: E731
      return jax.lax.scan(inner, c, gp)[0], None

    return jax.lax.scan(outer, x, grp)[0] @ p['out']

  tiers = {'tab': 'backbone', 'out': 'backbone', 'grp/g0': 'backbone', 'grp/a': 'router',
           'grp/b1': 'experts', 'grp/b2': 'experts', 'grp/c1': 'backbone',
           'grp/c2': 'backbone'}
  axes = {'tab': (), 'out': (), 'grp/g0': (0, 1), 'grp/a': (0, 1), 'grp/b1': (0, 1, 2),
          'grp/b2': (0, 1, 2), 'grp/c1': (1, 2), 'grp/c2': (0, 1)}
  return Case('dict_nested_scan_shard_map_onehot_common', params, fn, (_tokens(3),), tiers,
              axes)


# ---------------------------------------------------------------------------- Equinox


class EqxUnit(eqx.Module):
  """argmax routing; each token gathers its unit's weights by id; a common branch."""
  sel: eqx.nn.Linear
  w_in: jax.Array
  w_out: jax.Array
  common_a: eqx.nn.Linear
  common_b: eqx.nn.Linear
  act: Callable[[jax.Array], jax.Array]

  def __init__(self, key: jax.Array):
    k = jax.random.split(key, 5)
    self.sel = eqx.nn.Linear(D, E, use_bias=False, key=k[0])
    self.w_in = _normal(k[1], (E, D, F))
    self.w_out = _normal(k[2], (E, F, D))
    self.common_a = eqx.nn.Linear(D, F, key=k[3])
    self.common_b = eqx.nn.Linear(F, D, key=k[4])
    self.act = jax.nn.gelu

  def __call__(self, x: jax.Array) -> jax.Array:
    logits = jax.vmap(self.sel)(x)
    choice = jnp.argmax(logits, axis=-1)
    score = jnp.max(jax.nn.softmax(logits), axis=-1)
    mid = self.act(jnp.einsum('td,tdf->tf', x, self.w_in[choice]))
    y = jnp.einsum('tf,tfd->td', mid, self.w_out[choice])
    common = jax.vmap(self.common_b)(self.act(jax.vmap(self.common_a)(x)))
    return x + y * score[:, None] + common


class EqxNet(eqx.Module):
  """Embedding, 2 `EqxUnit`s stacked by `eqx.filter_vmap` and applied by `lax.scan`."""
  tab: eqx.nn.Embedding
  body: EqxUnit
  out: eqx.nn.Linear

  def __init__(self, key: jax.Array):
    k = jax.random.split(key, 3)
    self.tab = eqx.nn.Embedding(V, D, key=k[0])
    self.body = eqx.filter_vmap(EqxUnit)(jax.random.split(k[1], 2))
    self.out = eqx.nn.Linear(D, V, key=k[2])

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = jax.vmap(self.tab)(tokens.reshape(-1))
    dynamic, static = eqx.partition(self.body, eqx.is_array)

    def body(c: jax.Array, d: Any) -> tuple[jax.Array, None]:
      return eqx.combine(d, static)(c), None

    x, _ = jax.lax.scan(body, x, dynamic)
    return jax.vmap(self.out)(x)


def eqx_case() -> Case:
  model = EqxNet(jax.random.key(4))
  tiers = {'tab/weight': 'backbone', 'out/weight': 'backbone', 'out/bias': 'backbone',
           'body/sel/weight': 'router', 'body/w_in': 'experts', 'body/w_out': 'experts',
           'body/common_a/weight': 'backbone', 'body/common_a/bias': 'backbone',
           'body/common_b/weight': 'backbone', 'body/common_b/bias': 'backbone'}
  axes = {p: ((0,) if p.startswith('body/') else ()) for p in tiers}
  axes.update({'body/w_in': (0, 1), 'body/w_out': (0, 1)})
  return Case('eqx_filter_vmap_scan_argmax_gather_common', model, lambda m, t: m(t),
              (_tokens(4),), tiers, axes)


# ---------------------------------------------------------------------------- patterns
#
# Small plain-JAX models, each a stack of `N` units applied by `lax.scan`, that isolate one
# pattern of real MoE code: the whole model is right only if that pattern is recognised.

N, K = 2, 2  # stacked units, choices per token


def _route(h: jax.Array, logits: jax.Array
           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Top-K routing, rows sorted by choice: (rows, group sizes, order, weights)."""
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits), K)
  flat = idx.reshape(-1)
  order = jnp.argsort(flat)
  return jnp.repeat(h, K, axis=0)[order], jnp.bincount(flat, length=E), order, weights


def _unroute(out: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
  """Back to token order, weighted sum over the K choices."""
  unsorted = jnp.zeros_like(out).at[order].set(out)
  return (unsorted.reshape(-1, K, out.shape[-1]) * weights[..., None]).sum(1)


def _plain_case(name: str, seed: int, body: dict[str, Any], tiers: dict[str, str],
                axes: dict[str, tuple[int, ...]],
                unit: Callable[[jax.Array, Any], jax.Array]) -> Case:
  """Embedding, `body` (each leaf stacked over N units) scanned by `unit`, a head."""
  k = _keys(seed, 2)
  params = {'tab': _normal(k[0], (V, D)), 'body': body, 'out': _normal(k[1], (D, V))}

  def fn(p: Any, tokens: jax.Array) -> jax.Array:
    x = p['tab'][tokens].reshape(-1, D)
    x, _ = jax.lax.scan(lambda c, sp: (unit(c, sp), None), x, p['body'])
    return x @ p['out']

  return Case(name, params, fn, (_tokens(seed),),
              {'tab': 'backbone', 'out': 'backbone',
               **{f'body/{p}': t for p, t in tiers.items()}},
              {'tab': (), 'out': (), **{f'body/{p}': a for p, a in axes.items()}})


def _ragged_ffn(rows: jax.Array, sizes: jax.Array, p: dict[str, Any]) -> jax.Array:
  return jax.lax.ragged_dot(jax.nn.silu(jax.lax.ragged_dot(rows, p['u'], sizes)), p['v'],
                            sizes)


def _bank_leaves(k: list[jax.Array]) -> dict[str, jax.Array]:
  return {'q': _normal(k[0], (N, D, E)), 'u': _normal(k[1], (N, E, D, F)),
          'v': _normal(k[2], (N, E, F, D))}


_BANK_TIERS = {'q': 'router', 'u': 'experts', 'v': 'experts'}
_BANK_AXES = {'q': (0,), 'u': (0, 1), 'v': (0, 1)}


def consts_case() -> Case:
  """A scan with a closed-over constant and two carries (jax >= 0.12 names them `ft_in`)."""
  k = _keys(5, 4)
  body = {**_bank_leaves(k), 's': jnp.ones((N, D))}
  shared = _normal(k[3], (D, D))

  def fn(p: Any, tokens: jax.Array) -> jax.Array:
    x = p['tab'][tokens].reshape(-1, D)

    def step(carry: tuple[jax.Array, jax.Array], sp: Any) -> tuple[Any, None]:
      x, acc = carry
      h = (x * sp['s']) @ p['mix']  # `mix` is a const of the scan, not stacked
      rows, sizes, order, weights = _route(h, h @ sp['q'])
      x = x + _unroute(_ragged_ffn(rows, sizes, sp), order, weights)
      return (x, acc + x.mean()), None

    (x, acc), _ = jax.lax.scan(step, (x, jnp.zeros(())), p['body'])
    return x @ p['out'] + acc

  case = _plain_case('dict_scan_consts_two_carries_ragged_dot', 5, body,
                     {**_BANK_TIERS, 's': 'backbone'}, {**_BANK_AXES, 's': (0,)},
                     lambda x, sp: x)
  case.params['mix'] = shared
  case.tiers['mix'], case.axes['mix'] = 'backbone', ()
  case.fn = fn
  return case


def _grouped_kernel(ids_ref: Any, x_ref: Any, w_ref: Any, o_ref: Any) -> None:
  """One program per group: adds the rows of group `i` times that group's matrix."""
  i = pl.program_id(0)

  @pl.when(i == 0)
  def _() -> None:
    o_ref[...] = jnp.zeros_like(o_ref)

  hit = (ids_ref[...] == i)[:, None]
  o_ref[...] += jnp.where(hit, jnp.dot(x_ref[...], w_ref[0]), 0.0)


def _grouped_reference(ids: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.einsum('td,tdf->tf', x, w[ids])


@jax.custom_vjp
def _grouped(ids: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
  """Row t times w[ids[t]], as a Pallas kernel (interpreted) the analysis cannot enter."""
  return pl.pallas_call(
      _grouped_kernel, grid=(w.shape[0],),
      in_specs=[pl.BlockSpec(ids.shape, lambda i: (0,)),
                pl.BlockSpec(x.shape, lambda i: (0, 0)),
                pl.BlockSpec((1,) + w.shape[1:], lambda i: (i, 0, 0))],
      out_specs=pl.BlockSpec((x.shape[0], w.shape[2]), lambda i: (0, 0)),
      out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), x.dtype),
      interpret=True)(ids, x, w)


def _grouped_fwd(ids: jax.Array, x: jax.Array, w: jax.Array) -> tuple[jax.Array, Any]:
  return _grouped(ids, x, w), (ids, x, w)


def _grouped_bwd(res: Any, g: jax.Array) -> tuple[Any, jax.Array, jax.Array]:
  ids, x, w = res
  _, vjp = jax.vjp(lambda a, b: _grouped_reference(ids, a, b), x, w)
  return (None, *vjp(g))


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def kernel_case() -> Case:
  """Top-1 routing; the routed bank runs in a Pallas kernel fed the chosen ids."""

  def unit(x: jax.Array, p: Any) -> jax.Array:
    logits = x @ p['q']
    weight, idx = jax.lax.top_k(jax.nn.softmax(logits), 1)
    ids = idx[:, 0].astype(jnp.int32)
    mid = jax.nn.silu(_grouped(ids, x, p['u']))
    return x + _grouped(ids, mid, p['v']) * weight

  return _plain_case('dict_scan_pallas_grouped_matmul', 6, _bank_leaves(_keys(6, 3)),
                     _BANK_TIERS, _BANK_AXES, unit)


def ids_case() -> Case:
  """Per-group biases indexed by `jnp.repeat(arange(E), group sizes)` (named ids)."""
  k = _keys(7, 5)
  body = {**_bank_leaves(k), 'c': _normal(k[3], (N, E, F)), 'd': _normal(k[4], (N, E, D))}

  def unit(x: jax.Array, p: Any) -> jax.Array:
    rows, sizes, order, weights = _route(x, x @ p['q'])
    ids = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=rows.shape[0])
    ids = checkpoint_name(ids, 'ids')
    mid = jax.nn.silu(jax.lax.ragged_dot(rows, p['u'], sizes) + p['c'][ids])
    out = jax.lax.ragged_dot(mid, p['v'], sizes) + p['d'][ids]
    return x + _unroute(out, order, weights)

  return _plain_case('dict_scan_repeat_ids_bias', 7, body,
                     {**_BANK_TIERS, 'c': 'experts', 'd': 'experts'},
                     {**_BANK_AXES, 'c': (0, 1), 'd': (0, 1)}, unit)


def scaled_case() -> Case:
  """The logits are computed from the normalised input times a vector of their own."""
  k = _keys(8, 3)
  body = {**_bank_leaves(k), 'r': jnp.ones((N, D)), 's': jnp.ones((N, D))}

  def unit(x: jax.Array, p: Any) -> jax.Array:
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p['s']
    rows, sizes, order, weights = _route(h, (h * D ** -0.5 * p['r']) @ p['q'])
    return x + _unroute(_ragged_ffn(rows, sizes, p), order, weights)

  return _plain_case('dict_scan_scaled_logits_input', 8, body,
                     {**_BANK_TIERS, 'r': 'router', 's': 'backbone'},
                     {**_BANK_AXES, 'r': (0,), 's': (0,)}, unit)


def pairs_case() -> Case:
  """Two projections stored as one leaf: taken apart by `unstack`, or merged with the
  other axis for a `ragged_dot` and split back into [rows, 2, F] and indexed."""
  k = _keys(9, 5)
  body = {'q': _normal(k[0], (N, D, E)), 'u': _normal(k[1], (N, E, 2, D, F)),
          'v': _normal(k[2], (N, E, F, D)), 'w': _normal(k[3], (N, 2, D, F)),
          'wo': _normal(k[4], (N, F, D))}

  def unit(x: jax.Array, p: Any) -> jax.Array:
    a, b = jnp.unstack(jnp.einsum('td,pdf->ptf', x, p['w']))
    common = (a * jax.nn.silu(b)) @ p['wo']
    rows, sizes, order, weights = _route(x, x @ p['q'])
    both = p['u'].transpose(0, 2, 1, 3).reshape(E, D, 2 * F)
    mid = jax.lax.ragged_dot(rows, both, sizes).reshape(-1, 2, F)
    out = jax.lax.ragged_dot(jax.nn.silu(mid[:, 0]) * mid[:, 1], p['v'], sizes)
    return x + _unroute(out, order, weights) + common

  return _plain_case('dict_scan_stacked_pairs', 9, body,
                     {**_BANK_TIERS, 'w': 'backbone', 'wo': 'backbone'},
                     {**_BANK_AXES, 'u': (0, 1, 2), 'w': (0, 1), 'wo': (0,)}, unit)


def split_case() -> Case:
  """A projection whose output `jnp.split` halves, and a depthwise convolution."""
  k = _keys(10, 6)
  body = {**_bank_leaves(k), 'h': _normal(k[3], (N, D, 2 * D)),
          'cv': _normal(k[4], (N, D, 1, 3))}

  def unit(x: jax.Array, p: Any) -> jax.Array:
    a, b = jnp.split(x @ p['h'], 2, axis=-1)
    y = jax.lax.conv_general_dilated((a * jax.nn.silu(b)).T[None], p['cv'], (1,), 'SAME',
                                     feature_group_count=D)[0].T
    rows, sizes, order, weights = _route(y, y @ p['q'])
    return x + y + _unroute(_ragged_ffn(rows, sizes, p), order, weights)

  return _plain_case('dict_scan_split_conv', 10, body,
                     {**_BANK_TIERS, 'h': 'backbone', 'cv': 'backbone'},
                     {**_BANK_AXES, 'h': (0,), 'cv': (0,)}, unit)


def two_decisions_case() -> Case:
  """Two units applied one after the other (no scan), each with its own routing."""
  k = _keys(11, 7)
  one = {'q': _normal(k[0], (D, E)), 'u': _normal(k[1], (E, D, F)),
         'v': _normal(k[2], (E, F, D))}
  two = {'q': _normal(k[3], (D, E)), 'u': _normal(k[4], (E, D, F)),
         'v': _normal(k[5], (E, F, D))}
  params = {'tab': _normal(k[6], (V, D)), 'one': one, 'two': two}

  def fn(p: Any, tokens: jax.Array) -> jax.Array:
    x = p['tab'][tokens].reshape(-1, D)
    for unit in (p['one'], p['two']):
      rows, sizes, order, weights = _route(x, x @ unit['q'])
      x = x + _unroute(_ragged_ffn(rows, sizes, unit), order, weights)
    return x @ p['tab'].T

  tiers = {'tab': 'backbone', **{f'{u}/{n}': t for u in ('one', 'two')
                                 for n, t in _BANK_TIERS.items()}}
  axes = {p: (() if t != 'experts' else (0,)) for p, t in tiers.items()}
  return Case('dict_two_routings_in_sequence', params, fn, (_tokens(11),), tiers, axes)


def choice_case() -> Case:
  """Expert choice: each unit picks its best C tokens (scores softmaxed over the tokens),
  gathers them into [E, C, d] and adds its outputs back at their positions; a table of
  positions is added to the embedding (a parameter axis on the token axis)."""
  k = _keys(12, 4)
  body = _bank_leaves(k)

  def unit(x: jax.Array, p: Any) -> jax.Array:
    scores = jax.nn.softmax(x @ p['q'], axis=0)  # [T, E]
    weight, idx = jax.lax.top_k(scores.T, C)  # [E, C] token positions
    mid = jax.nn.gelu(jnp.einsum('ecd,edf->ecf', x[idx], p['u']))
    out = jnp.einsum('ecf,efd->ecd', mid, p['v']) * weight[..., None]
    return x + jnp.zeros_like(x).at[idx.reshape(-1)].add(out.reshape(-1, D))

  case = _plain_case('dict_scan_expert_choice_gather', 12, body, _BANK_TIERS, _BANK_AXES,
                     unit)
  case.params['pos'] = _normal(k[3], (B * S, D))
  case.tiers['pos'], case.axes['pos'] = 'backbone', ()

  def fn(p: Any, tokens: jax.Array) -> jax.Array:
    x = p['tab'][tokens].reshape(-1, D) + p['pos']
    x, _ = jax.lax.scan(lambda c, sp: (unit(c, sp), None), x, p['body'])
    return x @ p['out']

  case.fn = fn
  return case


def capacity_case() -> Case:
  """Expert choice with a capacity factor (C = 2.5 T / E slots per unit, neither E nor
  T), written with one-hot dispatch and combine tensors [E, C, T]; the bank is stored
  with its unit axis in the middle."""
  k = _keys(13, 3)
  body = {'q': _normal(k[0], (N, D, E)), 'u': _normal(k[1], (N, D, E, F)),
          'v': _normal(k[2], (N, E, F, D))}

  def unit(x: jax.Array, p: Any) -> jax.Array:
    cap = int(2.5 * x.shape[0] / E)
    scores = jax.nn.softmax(x @ p['q'])  # over the units, as the paper writes it
    weight, idx = jax.lax.top_k(scores.T, cap)
    pick = jax.nn.one_hot(idx, x.shape[0])  # [E, C, T]
    mid = jax.nn.relu(jnp.einsum('ect,td,def->ecf', pick, x, p['u']))
    out = jnp.einsum('ecf,efd->ecd', mid, p['v'])
    return x + jnp.einsum('ect,ec,ecd->td', pick, weight, out)

  return _plain_case('dict_scan_expert_choice_capacity_onehot', 13, body, _BANK_TIERS,
                     {**_BANK_AXES, 'u': (0, 2)}, unit)


def _units_case(name: str, seed: int, top: int) -> Case:
  """A bank stored as a Python list of separate matrices per unit (ports of a module
  list), each unit's output kept for the tokens whose chosen id is its index."""
  k = _keys(seed, 2 * E + 3)
  params = {'tab': _normal(k[0], (V, D)), 'q': _normal(k[1], (D, E)),
            'u': [_normal(k[2 + e], (D, F)) for e in range(E)],
            'v': [_normal(k[2 + E + e], (F, D)) for e in range(E)],
            'out': _normal(k[-1], (D, V))}

  def fn(p: Any, tokens: jax.Array) -> jax.Array:
    x = p['tab'][tokens].reshape(-1, D)
    logits = x @ p['q']
    y = jnp.zeros_like(x)
    if top == 1:  # argmax; the unit's output where the id matches, zero elsewhere
      ids = jnp.argmax(logits, -1)
      score = jnp.max(jax.nn.softmax(logits), -1)
      for e in range(E):
        y = y + jnp.where((ids == e)[:, None], jax.nn.gelu(x @ p['u'][e]) @ p['v'][e], 0.0)
      return (x + y * score[:, None]) @ p['out']
    weights, idx = jax.lax.top_k(jax.nn.softmax(logits), top)  # [T, top]
    for e in range(E):  # the weight of unit e per token: zero unless it was chosen
      w = jnp.sum(weights * (idx == e), axis=-1)
      y = y + (jax.nn.silu(x @ p['u'][e]) @ p['v'][e]) * w[:, None]
    return (x + y) @ p['out']

  units = {f'{n}/{e}': 'experts' for n in ('u', 'v') for e in range(E)}
  tiers = {'tab': 'backbone', 'q': 'router', 'out': 'backbone', **units}
  return Case(name, params, fn, (_tokens(seed),), tiers, {p: () for p in tiers})


def units_case() -> Case:
  return _units_case('dict_list_of_units_argmax_where', 14, 1)


def units_top_case() -> Case:
  return _units_case('dict_list_of_units_top_k_weighted', 15, K)


CASES: dict[str, Callable[[], Case]] = {
    'nnx': nnx_case, 'linen': linen_case, 'ragged': ragged_case, 'nested': nested_case,
    'eqx': eqx_case}
# One pattern of real MoE code each (one routing decision, like `CASES`).
PATTERNS: dict[str, Callable[[], Case]] = {
    'consts': consts_case, 'kernel': kernel_case, 'ids': ids_case, 'scaled': scaled_case,
    'pairs': pairs_case, 'split': split_case, 'choice': choice_case,
    'capacity': capacity_case, 'units': units_case, 'units_top': units_top_case}
