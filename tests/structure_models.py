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


CASES: dict[str, Callable[[], Case]] = {
    'nnx': nnx_case, 'linen': linen_case, 'ragged': ragged_case, 'nested': nested_case,
    'eqx': eqx_case}
