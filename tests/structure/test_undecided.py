"""Undecided leaves are safe under every policy, and the warnings' fixes run as printed.

* the safe rule: a leaf `sj.trace_structure` leaves undecided gets the tier
  `'undecided'` under every preset (`transforms.tier.undecided_tier`): scaling one slice
  of any axis of its gradient by 1000 moves nothing else of its update;
* a GShard-style top-2 gate in a scanned stack (issue: the router and banks once went
  undecided and were orthogonalised): one expert's gradient never moves another's
  update under `MUON_CODED_TIERS`;
* the `UnsureLabelWarning`'s fix keeps the user's `tiers`, and a cause is warned once
  per process under Python's default filter;
* `trace_structure` of a Flax NNX model with a loss of the model, and of its
  `nnx.State` with a function of the state; a State with a loss of the model is a
  TypeError naming both.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, HealthCheck, settings, strategies as st

import moe_programs as mp
import skewadam_jax as sj
from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import warning as _warning

PRESETS = ('PUBLISHED_TIERS', 'ADAM_EPS_TIERS', 'ADAM_ROUTER_TIERS', 'MUON_TIERS',
           'MUON_CODED_TIERS')
# float32: an update element that depends on nothing scaled is computed by the same
# operations on the same inputs, so it is equal up to XLA's fusion choices: 4 ulp.
ULP = 4


def _updates(tx, params, grads, steps=2):
  """The last of `steps` updates of `tx` with the same gradients (momentum in play)."""
  state = tx.init(params)
  for _ in range(steps):
    updates, state = tx.update(grads, state, params)
  return updates


def _moved_outside(before, after, axis, index):
  """Whether any element outside slice `index` of `axis` changed beyond `ULP` ulp."""
  before, after = np.asarray(before, np.float32), np.asarray(after, np.float32)
  keep = np.ones(before.shape, bool)
  np.moveaxis(keep, axis, 0)[index] = False
  tol = ULP * np.spacing(np.maximum(np.abs(before), np.abs(after)))
  return bool(np.any(np.abs(before - after)[keep] > tol[keep]))


def _slice_independent(structure, params, tiers, path, rng):
  """For each axis of the leaf at `path`: one random slice of its gradient scaled by
  1000 moves nothing else of its update under `tiers` with the trace's labels."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  k = [_paths.path_str(p) for p, _ in leaves].index(path)
  arrays = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for _, x in leaves]
  grads = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for _, x in leaves]
  tx = sj.skewadam(1e-3, tiers=tiers, param_labels=structure)
  p = treedef.unflatten(arrays)
  rows = {r.path: r.tier for r in sj.label_table(tx, p)}
  assert rows[path] == 'undecided', (path, rows[path])
  base = jax.tree_util.tree_leaves(_updates(tx, p, treedef.unflatten(grads)))[k]
  for axis, n in enumerate(arrays[k].shape):
    if n < 2:
      continue
    index = int(rng.integers(n))
    scaled = list(grads)
    g = np.array(grads[k])
    np.moveaxis(g, axis, 0)[index] *= 1000.0
    scaled[k] = jnp.asarray(g)
    after = jax.tree_util.tree_leaves(_updates(tx, p, treedef.unflatten(scaled)))[k]
    assert not _moved_outside(base, after, axis, index), (path, axis, index)


def _obscured_fn(program, hide):
  """`program.fn` with the leaves `hide` read through an FFT round trip (a primitive
  with no rule): the same function, with those leaves undecided."""
  treedef = jax.tree_util.tree_structure(program.params)

  def fn(p, *args):
    flat = treedef.flatten_up_to(p)
    for i in hide:
      x = flat[i]
      flat[i] = jnp.real(jnp.fft.ifft(jnp.fft.fft(x))).astype(x.dtype)
    return program.fn(treedef.unflatten(flat), *args)

  return fn


def _undecided_are_slice_independent(program, data, max_hide, every):
  """Some leaves of `program` made undecided (at most `max_hide`): under every preset,
  one slice of any axis of an undecided leaf's gradient (one drawn, or `every` one)
  moves nothing else of it."""
  n = len(program.paths)
  hide = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=max_hide,
                            unique=True))
  fn = _obscured_fn(program, hide)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', sj.UnsureLabelWarning)
    structure = sj.trace_structure(fn, program.params, *program.args)
  # (a leaf the program reads through a box of its own may keep its structure)
  assume(structure.undecided)
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  paths = sorted(structure.undecided)
  if not every:
    paths = [data.draw(st.sampled_from(paths))]
  plain = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                 program.params)
  for path in paths:
    for preset in PRESETS:
      with warnings.catch_warnings():
        warnings.simplefilter('ignore', sj.UnsureLabelWarning)
        _slice_independent(structure, plain, getattr(sj, preset), path, rng)


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(program=mp.programs(exclude=mp.KNOWN_FAILING['traced']), data=st.data())
def test_undecided_leaves_are_slice_independent_under_every_preset(program, data):
  """Every generated program, some of its leaves made undecided: under every preset,
  one slice of any axis of an undecided leaf's gradient moves nothing else of it."""
  _undecided_are_slice_independent(program, data, max_hide=2, every=False)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(program=mp.programs(), data=st.data())
def test_every_undecided_leaf_is_slice_independent_slow(program, data):
  """As above, on more programs of the grown generator (ViT tokens, DenseGeneral kernels,
  index dispatch, GShard, size coincidences), for every undecided leaf, not one."""
  _undecided_are_slice_independent(program, data, max_hide=3, every=True)


# ---------------------------------------------------------------------------- GShard top-2

L, D, E, F, T, V, C = 2, 8, 8, 12, 10, 11, 3


def _gshard_layer(h, p):
  """GShard's top-2 gate: argmax, the first masked out, argmax again, capacity by
  cumsum; dispatch and combine tensors [T, E, C]."""
  logits = jnp.einsum('td,de->te', h, p['router'])
  combine = mp.gshard_combine(logits, C)
  dispatch = combine.astype(bool).astype(h.dtype)
  xin = jnp.einsum('tec,td->ecd', dispatch, h)
  hid = jax.nn.gelu(jnp.einsum('ecd,edf->ecf', xin, p['wi']))
  return h + jnp.einsum('tec,ecd->td', combine, jnp.einsum('ecf,efd->ecd', hid, p['wo']))


def _gshard(p, toks):
  h = p['embed'][toks]
  h, _ = jax.lax.scan(lambda c, lp: (_gshard_layer(c, lp), None), h, p['layers'])
  return h @ p['head']


def _gshard_params(rng):
  draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  return {'embed': draw(V, D), 'head': draw(D, V),
          'layers': {'router': draw(L, D, E), 'wi': draw(L, E, D, F), 'wo': draw(L, E, F, D)}}


def test_gshard_top2_in_a_scan_keeps_experts_apart_under_muon_coded_tiers():
  """Router [L, d, E] and banks [L, E, d, f]: right (router; experts with batch axes
  (0, 1)) or undecided under the safe rule; either way one expert's gradient scaled by
  1000 moves no other expert's update under MUON_CODED_TIERS, and the router is never
  orthogonalised."""
  rng = np.random.default_rng(0)
  params = _gshard_params(rng)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', sj.UnsureLabelWarning)
    trace = sj.trace_structure(_gshard, params, jax.ShapeDtypeStruct((T,), jnp.int32))
  leaves = trace.by_path
  for path in ('layers/router', 'layers/wi', 'layers/wo'):
    assert path in trace.undecided or leaves[path].tier != 'backbone', trace.format()
  assert leaves['layers/router'].tier == 'router' or 'layers/router' in trace.undecided
  tx = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS, param_labels=trace)
  rows = {r.path: r for r in sj.label_table(tx, params)}
  assert rows['layers/router'].tier in ('router', 'undecided')
  grads = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape),
                                                       jnp.float32), params)
  base = _updates(tx, params, grads)
  for bank in ('wi', 'wo'):
    for e in (0, E - 1):
      g = np.array(grads['layers'][bank])
      g[:, e] *= 1000.0
      scaled = {**grads, 'layers': {**grads['layers'], bank: jnp.asarray(g)}}
      after = _updates(tx, params, scaled)
      assert not _moved_outside(base['layers'][bank], after['layers'][bank], 1, e), (
          bank, e, rows[f'layers/{bank}'])


def test_undecided_leaves_are_never_orthogonalised():
  """A hidden matrix made undecided gets the tier 'undecided' (an exact second moment),
  not 'hidden', under both Muon presets; the others keep their roles."""
  params = {'a': jnp.ones((11, 8)), 'b': jnp.ones((8, 8)), 'c': jnp.ones((8, 8)),
            'z': jnp.ones((8, 11))}

  def loss_fn(p, ids):
    b = jnp.real(jnp.fft.ifft(jnp.fft.fft(p['b'])))  # no rule reads an FFT
    return jnp.mean((p['a'][ids] @ b @ p['c'] @ p['z']) ** 2)

  with pytest.warns(sj.UnsureLabelWarning, match='undecided'):
    trace = sj.trace_structure(loss_fn, params, jnp.zeros((4,), jnp.int32))
  assert set(trace.undecided) == {'b'}
  for preset in ('MUON_TIERS', 'MUON_CODED_TIERS', 'PUBLISHED_TIERS'):
    tiers = getattr(sj, preset)
    rows = {r.path: r.tier for r in sj.label_table(
        sj.skewadam(1e-3, tiers=tiers, param_labels=trace), params)}
    hidden = 'hidden' if 'hidden' in tiers else 'backbone'
    assert rows == {'a': 'backbone', 'b': 'undecided', 'c': hidden, 'z': 'backbone'}
  assert trace.labels['b'] == 'backbone'  # the label tree itself is unchanged


# ---------------------------------------------------------------------------- the warning


def _unsure_params():
  return {'a': jnp.ones((32, 8)), 'b': {'c': jnp.ones((8, 8))}, 'z': jnp.ones((8, 32))}


def _loss(p, ids):
  return jnp.mean((p['a'][ids] @ p['b']['c'] @ p['z']) ** 2)


@pytest.mark.parametrize('preset', PRESETS + (None, 'custom'))
def test_the_fix_keeps_the_users_tiers(preset):
  """The printed `skewadam` call names the preset by its public name, nothing for the
  default, `tiers=<your tiers>` for a policy of one's own; pasted, it keeps the policy."""
  if preset == 'custom':
    tiers = {**sj.MUON_TIERS, 'extra': sj.Tier()}
  else:
    tiers = None if preset is None else getattr(sj, preset)
  # A rank-3 leaf the labeler leaves in the default tier: unsure under every policy.
  params = {**_unsure_params(), 'w': jnp.ones((4, 8, 12))}
  with pytest.warns(sj.UnsureLabelWarning) as record:
    sj.label_table(sj.skewadam(1e-3, tiers=tiers), params)
  message = str(record[0].message)
  code = message.split('\n\n')[1]
  shown = {'custom': 'tiers=<your tiers>, ', None: '', 'PUBLISHED_TIERS': ''}.get(
      preset, f'tiers=sj.{preset}, ')
  assert f'sj.skewadam(learning_rate, {shown}param_labels=trace)' in code
  rules = message.split('\n\n')[3]
  assert f'sj.skewadam(learning_rate, {shown}param_labels=' in rules
  assert ('hidden_param_labels' in rules) == ('hidden' in (tiers or {}))
  assert 'the rule its line above gives' in message
  if preset in PRESETS:  # pasted as printed, with the user's loss, params and batch
    namespace = {'sj': sj, 'loss_fn': _loss, 'params': _unsure_params(),
                 'batch': jnp.zeros((4,), jnp.int32), 'learning_rate': 1e-3}
    exec('\n'.join(line[4:] for line in code.splitlines()), namespace)  # noqa: S102
    rows = {r.path: r.tier for r in sj.label_table(namespace['tx'], _unsure_params())}
    hidden = 'hidden' if 'hidden' in tiers else 'backbone'
    assert rows == {'a': 'backbone', 'b/c': hidden, 'z': 'backbone'}


def test_a_cause_is_warned_once_per_process_under_the_default_filter():
  """Under Python's default filter, label_table, init, update and a jit trace of one
  unsure tree warn once; a new cause warns again; 'always' shows every call."""
  params = {'w': jnp.ones((4, 8, 12)), 'v': jnp.ones((3, 5, 7))}
  _warning._WARNED.clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('default')
    tx = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS)
    sj.label_table(tx, params)
    state = tx.init(params)
    jax.jit(tx.update)(params, state, params)
    tx.update(params, state, params)
    sj.label_table(tx, {'w': params['w']})  # a subset: no new cause
  unsure = [w for w in caught if issubclass(w.category, sj.UnsureLabelWarning)]
  assert len(unsure) == 1, [str(w.message)[:200] for w in unsure]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('default')
    sj.label_table(tx, {**params, 'u': jnp.ones((2, 9, 6))})  # a new leaf, a new cause
  unsure = [str(w.message) for w in caught if issubclass(w.category, sj.UnsureLabelWarning)]
  assert len(unsure) == 1 and 'u [2, 9, 6]' in unsure[0] and 'w [4, 8, 12]' not in unsure[0]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    sj.label_table(tx, params)
    tx.init(params)
  assert sum(issubclass(w.category, sj.UnsureLabelWarning) for w in caught) == 2


# ---------------------------------------------------------------------------- Flax NNX


def _nnx_model():
  nnx = pytest.importorskip('flax.nnx')

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(11, 8, rngs=rngs)
      self.hidden = nnx.Linear(8, 8, rngs=rngs)
      self.head = nnx.Linear(8, 11, rngs=rngs)

    def __call__(self, ids):
      return self.head(jax.nn.relu(self.hidden(self.embed(ids))))

  return nnx, Model(nnx.Rngs(0))


def _nnx_loss(model, ids):
  return jnp.mean(model(ids) ** 2)


def test_trace_structure_of_an_nnx_model_and_of_its_state():
  """The model with a loss of the model, and its State with a function of the state,
  give the same labels, which an `nnx.Optimizer` over the Params uses."""
  nnx, model = _nnx_model()
  batch = jnp.zeros((4,), jnp.int32)
  of_model = sj.trace_structure(_nnx_loss, model, batch)
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  of_state = sj.trace_structure(
      lambda s, b: _nnx_loss(nnx.merge(graphdef, s, rest), b), state, batch)
  want = {'embed/embedding': 'embedding', 'hidden/kernel': 'hidden matrix',
          'head/kernel': 'output layer'}
  for trace in (of_model, of_state):
    assert {k: trace.roles[k] for k in want} == want
  tx = sj.skewadam(1e-3, tiers=sj.MUON_TIERS, param_labels=of_model)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.grad(_nnx_loss)(model, batch)
  optimizer.update(model, grads)
  rows = {r.path: r.tier for r in sj.label_table(tx, nnx.state(model, nnx.Param))}
  assert rows['hidden/kernel'] == 'hidden' and rows['embed/embedding'] == 'backbone'


def test_an_nnx_state_with_a_loss_of_the_model_names_both_forms():
  nnx, model = _nnx_model()
  with pytest.raises(TypeError, match=r'sj\.trace_structure\(loss_fn, model, batch\)'):
    sj.trace_structure(_nnx_loss, nnx.state(model, nnx.Param), jnp.zeros((4,), jnp.int32))


# ---------------------------------------------------------------------------- index dispatch

_E, _CAP, _K = 4, 6, 2


def _index_layer(h, p):
  """Tokens dispatched by computed indices: scattered into [E, capacity, d] at
  `expert * capacity + position`, each expert with a bias [E, f] and [E, d], gathered
  back and scattered onto the tokens."""
  t, d = h.shape
  w, ids = jax.lax.top_k(jax.nn.softmax(h @ p['router']), _K)
  flat = ids.reshape(-1)
  onehot = jax.nn.one_hot(flat, _E, dtype=jnp.int32)
  pos = jnp.take_along_axis(jnp.cumsum(onehot, 0) - onehot, flat[:, None], 1)[:, 0]
  keep = pos < _CAP
  slot = jnp.where(keep, flat * _CAP + pos, _E * _CAP)
  tok = jnp.repeat(jnp.arange(t), _K)
  buf = jnp.zeros((_E * _CAP + 1, d)).at[slot].set(h[tok])[:-1].reshape(_E, _CAP, d)
  hid = jax.nn.relu(jnp.einsum('ecd,edf->ecf', buf, p['wi']) + p['bi'][:, None, :])
  out = (jnp.einsum('ecf,efd->ecd', hid, p['wo']) + p['bo'][:, None, :]).reshape(-1, d)
  out = jnp.concatenate([out, jnp.zeros((1, d))])[slot] * (w.reshape(-1) * keep)[:, None]
  return h + jnp.zeros((t, d)).at[tok].add(out)


@pytest.mark.parametrize('scanned', [False, True])
def test_per_expert_biases_under_index_dispatch_are_the_banks(scanned):
  """The biases [E, f] beside kernels [E, d, f] of tokens dispatched by computed indices
  are experts with the expert axis a batch axis; in a scanned stack ([L, E, f]) with the
  layer axis too."""
  d, f, v, n_layers = 8, 12, 11, 3
  moe = {'router': (d, _E), 'wi': (_E, d, f), 'bi': (_E, f), 'wo': (_E, f, d),
         'bo': (_E, d)}
  lead = (n_layers,) if scanned else ()
  params = {'embed': jax.ShapeDtypeStruct((v, d), jnp.float32),
            'head': jax.ShapeDtypeStruct((d, v), jnp.float32),
            'moe': {k: jax.ShapeDtypeStruct(lead + s, jnp.float32) for k, s in moe.items()}}

  def forward(p, toks):
    h = p['embed'][toks]
    if scanned:
      h, _ = jax.lax.scan(lambda c, lp: (_index_layer(c, lp), None), h, p['moe'])
    else:
      h = _index_layer(h, p['moe'])
    return h @ p['head']

  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    trace = sj.trace_structure(forward, params, jax.ShapeDtypeStruct((10,), jnp.int32))
  got = {x.path: (x.tier, x.batch_axes) for x in trace.leaves}
  layer = (0,) if scanned else ()
  expert = tuple(a + len(lead) for a in (0,))
  want = {'embed': ('backbone', ()), 'head': ('backbone', ()),
          'moe/router': ('router', layer)}
  want.update({f'moe/{k}': ('experts', layer + expert) for k in ('wi', 'bi', 'wo', 'bo')})
  assert got == want, trace.format()
