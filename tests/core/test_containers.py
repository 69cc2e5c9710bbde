"""Any params container: Equinox modules, NNX states, Linen boxes, lists, custom nodes.

A params tree may be callable (an Equinox module's `__call__` is its forward pass); it
is still a tree, never a labeler. Labels and batch axes exist for every array leaf, and
`init`, `update`, `label_table`, `memory_report` and `state_shardings` work on it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import skewadam_jax as sj
from skewadam_jax.structure import paths as _paths
from skewadam_jax.core import tree as _tree

eqx = pytest.importorskip('equinox')  # in the test extra; absent from the min-versions venv

D, E, F = 8, 4, 16


class Minimal(eqx.Module):
  """The smallest failing case: one array field, and a forward pass."""
  w: jax.Array

  def __call__(self, x):
    return x


class MoE(eqx.Module):
  """An Equinox MoE block with static (non-array) fields, as models have them."""
  router: jax.Array  # [d, E]
  w_in: jax.Array  # [E, d, f]
  w_out: jax.Array  # [E, f, d]
  norm: jax.Array  # [d]
  act: Callable = eqx.field(static=True)
  top_k: int = 2  # a plain (non-static) int field: not an array, so not a parameter

  def __call__(self, x):  # x: [n, d]
    gates = jax.nn.softmax(x @ self.router)  # [n, E]
    h = self.act(jnp.einsum('nd,edf->nef', x * self.norm, self.w_in))
    return jnp.einsum('nef,efd,ne->nd', h, self.w_out, gates)


def _moe(key: jax.Array) -> MoE:
  k1, k2, k3 = jax.random.split(key, 3)
  return MoE(router=0.1 * jax.random.normal(k1, (D, E)),
             w_in=0.1 * jax.random.normal(k2, (E, D, F)),
             w_out=0.1 * jax.random.normal(k3, (E, F, D)), norm=jnp.ones(D), act=jax.nn.gelu)


def _quiet(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    return fn(*args, **kwargs)


@pytest.mark.parametrize('make', [sj.skewadam, sj.adampm], ids=['skewadam', 'adampm'])
def test_a_callable_module_is_params_not_a_labeler(make):
  params = Minimal(jnp.ones((4, 8, 16)))
  calls = []

  class Spy(Minimal):
    def __call__(self, x):
      calls.append(x)
      return x

  spy = Spy(params.w)
  tx = make(1e-3)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', sj.UnsureLabelWarning)  # a lone rank-3 leaf
    state = tx.init(spy)
    updates, state = tx.update(jax.tree.map(jnp.ones_like, spy), state, spy)
  assert calls == []  # its forward pass never ran
  assert isinstance(updates, Spy) and updates.w.shape == (4, 8, 16)


def test_the_minimal_module_reports_and_labels():
  params = Minimal(jnp.ones((4, 8, 16)))
  with pytest.warns(sj.UnsureLabelWarning, match='w \\[4, 8, 16\\]'):
    rows = sj.label_table(sj.skewadam(1e-3), params)
  assert [(r.path, r.tier, r.batch_axes) for r in rows] == [('w', 'backbone', (0,))]
  with pytest.warns(sj.UnsureLabelWarning):
    report = sj.memory_report(sj.skewadam(1e-3), params)
  assert report.total_state_bytes > 0
  labels = sj.make_labeler([('w', 'backbone')])(params)
  assert isinstance(labels, Minimal) and labels.w == 'backbone'


def test_equinox_moe_labels_axes_and_reports():
  model = _moe(jax.random.key(0))
  params = eqx.filter(model, eqx.is_array)  # what Equinox trainers pass to `tx.init`
  labels = _quiet(sj.moe_param_labels, params)
  assert (labels.router, labels.w_in, labels.w_out, labels.norm) == (
      'router', 'experts', 'experts', 'backbone')
  # The unfiltered model too: its int field is static, labelled but no parameter.
  assert _quiet(sj.moe_param_labels, model).w_in == 'experts'
  axes = _quiet(sj.moe_batch_axes, params)
  assert (axes.w_in, axes.w_out, axes.router) == ((0,), (0,), ())
  tx = sj.skewadam(1e-3)
  rows = {r.path: r for r in _quiet(sj.label_table, tx, params)}
  assert set(rows) == {'router', 'w_in', 'w_out', 'norm'}
  assert rows['w_in'].second_moment.startswith('factored')
  report = _quiet(sj.memory_report, tx, params)
  adamw = sj.memory_report(optax.adamw(1e-3), params)
  assert 0 < report.total_state_bytes < adamw.total_state_bytes
  specs = P(None), P(None, None), P(None, None, None), P(None, None, None)
  shardings = _quiet(sj.state_shardings, tx, params, MoE(
      router=specs[1], w_in=specs[2], w_out=specs[3], norm=specs[0], act=jax.nn.gelu,
      top_k=None))
  abstract = jax.eval_shape(tx.init, params)
  assert jax.tree.structure(shardings, is_leaf=lambda x: isinstance(x, P)) == (
      jax.tree.structure(abstract))


@pytest.mark.parametrize('name', ['skewadam', 'adampm'])
def test_equinox_model_trains_under_filter_jit(name):
  model = _moe(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (32, D))
  y = jnp.roll(x, 1, axis=-1)
  tx = {'skewadam': sj.skewadam(3e-2), 'adampm': sj.adampm(3e-2)}[name]
  opt_state = _quiet(tx.init, eqx.filter(model, eqx.is_array))

  def loss_fn(m, x, y):
    return jnp.mean((jax.vmap(lambda r: m(r[None])[0])(x) - y) ** 2)

  @eqx.filter_jit
  def step(m, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(m, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(m, eqx.is_array))
    return eqx.apply_updates(m, updates), opt_state, loss

  losses = []
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    for _ in range(30):
      model, opt_state, loss = step(model, opt_state, x, y)
      losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.8 * losses[0]
  assert model.act is jax.nn.gelu and model.top_k == 2  # static fields untouched


def test_label_and_axes_trees_that_are_modules_are_trees():
  params = eqx.filter(_moe(jax.random.key(0)), eqx.is_array)
  labels = dataclasses.replace(params, router='router', w_in='experts', w_out='experts',
                               norm='backbone')
  axes = dataclasses.replace(params, router=(), w_in=(0,), w_out=(0,), norm=())
  tx = sj.skewadam(1e-3, param_labels=labels, batch_axes=axes)
  state = tx.init(params)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  assert updates.w_in.shape == (E, D, F)
  got = sj.label_table(tx, params)
  assert [(r.path, r.tier, r.batch_axes) for r in got] == [
      ('router', 'router', ()), ('w_in', 'experts', (0,)), ('w_out', 'experts', (0,)),
      ('norm', 'backbone', ())]


def test_functions_are_still_called():
  params = {'moe': {'w': jnp.zeros((E, D, F)), 'r': jnp.zeros((D, E))}}
  fn = lambda p: jax.tree.map(lambda _: 'backbone', p)  # noqa: E731
  assert _tree.is_function(fn) and _tree.is_function(sj.make_labeler())
  assert _tree.is_function(jax.tree_util.Partial(fn))
  assert not _tree.is_function(Minimal(jnp.zeros(3)))
  assert not _tree.is_function(params)
  rows = sj.label_table(sj.skewadam(1e-3, param_labels=fn), params)
  assert [r.tier for r in rows] == ['backbone', 'backbone']


@jax.tree_util.register_pytree_with_keys_class
class Pair:
  """A custom pytree node that is callable."""

  def __init__(self, a, b):
    self.a, self.b = a, b

  def __call__(self, x):
    raise AssertionError('a params tree must never be called')

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey('a'), self.a), (jax.tree_util.GetAttrKey('b'), self.b)
            ), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)


def _bank() -> dict[str, Any]:
  return {'router': jnp.zeros((D, E)), 'experts': {'w1': jnp.ones((E, D, F))}}


@pytest.mark.parametrize('kind', ['dict', 'list', 'custom', 'nnx_state', 'nnx_variables',
                                  'linen_boxes'])
def test_every_container_labels_initialises_and_updates(kind):
  bank = _bank()
  if kind == 'dict':
    params = {'moe': bank}
  elif kind == 'list':
    params = [bank, [jnp.ones((D,))]]
  elif kind == 'custom':
    params = Pair(bank, jnp.ones((D,)))
  elif kind == 'nnx_state':
    params = nnx.State({'moe': jax.tree.map(nnx.Param, bank)})
  elif kind == 'nnx_variables':
    params = {'moe': jax.tree.map(nnx.Param, bank)}
  else:
    params = {'moe': jax.tree.map(lambda x: nn.Partitioned(x, (None,) * x.ndim), bank)}
  labels = _quiet(sj.moe_param_labels, params)
  flat = {_paths.path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(labels)[0]}
  expected = {k: 'experts' if 'experts' in k else 'router' if 'router' in k else 'backbone'
              for k in flat}
  assert flat == expected
  assert sorted(set(flat.values())) == (['backbone'] if kind in ('list', 'custom') else []
                                        ) + ['experts', 'router']
  tx = sj.skewadam(1e-3)
  _quiet(tx.init, params)  # boxes at init, as nnx.Optimizer and Linen trainers have them
  pure = _unboxed(params)  # the pure arrays of `update`
  grads = jax.tree.map(jnp.ones_like, pure)
  updates, _ = _quiet(tx.update, grads, _quiet(tx.init, pure), pure)
  assert jax.tree.structure(updates) == jax.tree.structure(grads)
  rows = _quiet(sj.label_table, tx, params)
  assert len(rows) == len(jax.tree_util.tree_leaves(_unboxed(params)))
  assert _quiet(sj.memory_report, tx, params).total_state_bytes > 0


def _unboxed(params: Any) -> Any:
  """The pure arrays of a tree of Flax boxes (what `update` sees)."""
  boxes = (nnx.Variable, nn.Partitioned)

  def value(x: Any) -> Any:  # an NNX Variable's `.value` is deprecated: `get_value()`
    if isinstance(x, nnx.Variable):
      return x.get_value()
    return x.value if isinstance(x, nn.Partitioned) else x

  return jax.tree.map(value, params, is_leaf=lambda x: isinstance(x, boxes))


def test_batch_axes_function_sees_the_given_labels():
  """The documented form: a `batch_axes` function calling `moe_batch_axes` with rules
  warns nothing about leaves that `param_labels` labels, and uses those labels."""
  params = {'blk': {'sel': jnp.zeros((D, 3)),  # no router by shape: E is 4, not 3
                    'bank': {'w': jnp.ones((E, D, F)), 'b': jnp.ones((E, F))}}}
  my_labels = {'blk': {'sel': 'router', 'bank': {'w': 'experts', 'b': 'experts'}}}
  with pytest.warns(sj.UnsureLabelWarning, match='blk/bank/w'):
    sj.moe_batch_axes(params)  # alone, the default labeler is unsure of the bank
  seen = []

  def batch_axes(q, param_labels):  # skewadam passes its labels to this argument
    seen.append(sj.moe_batch_axes(q, param_labels, rules=[('blk/sel', ())]))
    return seen[-1]

  tx = sj.skewadam(1e-3, param_labels=my_labels, batch_axes=batch_axes)
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    state = tx.init(params)
    tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    rows = {r.path: r for r in sj.label_table(tx, params)}
  # The per-expert bias is banked with its kernel because the labels say experts.
  assert seen[0]['blk']['bank'] == {'w': (0,), 'b': (0,)}
  assert rows['blk/bank/b'].batch_axes == (0,)
