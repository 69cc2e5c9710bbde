"""Tests of `sj.trace_structure`: tiers and batch axes read from the traced computation."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import skewadam_jax as sj
import moe_models
import structure_models

D, E, F, T = 8, 4, 12, 10
X = jax.ShapeDtypeStruct((T, D), jnp.float32)


def _tiers(result):
  return {leaf.path: leaf.tier for leaf in result.leaves}


def _axes(result):
  return {leaf.path: leaf.batch_axes for leaf in result.leaves}


def _routed(x, logits, pick='top_k'):
  """Routing weights [T, E]: one-hot of the chosen experts times their probabilities."""
  probs = jax.nn.softmax(logits)
  if pick == 'top_k':
    top, idx = jax.lax.top_k(probs, 2)
    return jnp.einsum('tke,tk->te', jax.nn.one_hot(idx, E), top)
  return jax.nn.one_hot(jnp.argmax(logits, -1), E) * probs


# ---------------------------------------------------------------------------- models


@pytest.fixture(scope='module',
                params=sorted(structure_models.CASES) + sorted(structure_models.PATTERNS))
def case(request):
  return {**structure_models.CASES, **structure_models.PATTERNS}[request.param]()


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_model_paths_are_uninformative(case):
  for path in case.tiers:
    assert not any(word in path.lower() for word in structure_models.FORBIDDEN), path


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_model_tiers_and_batch_axes_match_the_truth(case):
  result = sj.trace_structure(case.fn, case.params, *case.args)
  assert set(_tiers(result)) == set(case.tiers)
  wrong_tiers = {p: t for p, t in _tiers(result).items() if t != case.tiers[p]}
  wrong_axes = {p: a for p, a in _axes(result).items() if a != case.axes[p]}
  assert wrong_tiers == {} and wrong_axes == {}, result.format()
  assert result.undecided == {}
  assert len(result.decisions) == 1 and result.decisions[0].num_experts == E


@pytest.mark.slow
def test_model_trains_with_skewadam_under_jit(case):
  result = sj.trace_structure(case.fn, case.params, *case.args)
  params = case.params
  is_eqx = isinstance(params, eqx.Module)
  trainable = eqx.filter(params, eqx.is_array) if is_eqx else params
  tx = sj.skewadam(1e-2, param_labels=result.labels, batch_axes=result.batch_axes)

  def loss(p):
    model = eqx.combine(p, params) if is_eqx else p
    out = case.fn(model, *case.args)
    return jnp.mean(jnp.square(out - 1.0))

  @jax.jit
  def step(p, state):
    value, grads = jax.value_and_grad(loss)(p)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  state = tx.init(trainable)
  p, losses = trainable, []
  for _ in range(3):
    p, state, value = step(p, state)
    losses.append(float(value))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.slow
def test_each_decision_lists_only_the_banks_it_dispatches():
  # Two routings in sequence over the same E: the second unit's tokens depend on both
  # decisions, but only the last one dispatched them.
  case = structure_models.two_decisions_case()
  assert not any(w in p for p in case.tiers for w in structure_models.FORBIDDEN)
  result = sj.trace_structure(case.fn, case.params, *case.args)
  assert _tiers(result) == case.tiers and _axes(result) == case.axes, result.format()
  assert result.undecided == {}
  assert [d.routers for d in result.decisions] == [('one/q',), ('two/q',)]
  assert [d.experts for d in result.decisions] == [('one/u', 'one/v'), ('two/u', 'two/v')]


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_result_is_accepted_by_label_table_and_memory_report():
  case = structure_models.nested_case()
  result = sj.trace_structure(case.fn, case.params, *case.args)
  tx = sj.skewadam(1e-3, param_labels=result.labels, batch_axes=result.batch_axes)
  rows = sj.label_table(tx, case.params)
  assert {r.path: r.tier for r in rows} == case.tiers
  assert {r.path: r.batch_axes for r in rows} == case.axes
  report = sj.memory_report(tx, case.params, param_labels=result.labels)
  assert {t.tier for t in report.tiers} == {'backbone', 'experts', 'router'}


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_format_shows_every_leaf_with_its_evidence():
  case = structure_models.ragged_case()
  text = sj.trace_structure(case.fn, case.params, *case.args).format()
  for path in case.tiers:
    assert path in text
  assert 'group axis of a ragged_dot' in text and 'scanned over axis 0' in text
  assert 'top_k over E=4' in text


# ---------------------------------------------------------------------------- the repo's models


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_example_moe_lm_matches_the_name_based_labels():
  from examples.moe_lm import model as lm  # noqa: PLC0415
  model = lm.MoELM(lm.get_config('tiny'), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def fn(p, tokens):
    return lm.loss_fn(nnx.merge(graphdef, p, rest), tokens, train=True,
                      rngs=jax.random.key(0))[0]

  result = sj.trace_structure(fn, params, jax.ShapeDtypeStruct((2, 9), jnp.int32))
  names = sj.moe_param_labels(params)
  assert jax.tree.leaves(result.labels) == jax.tree.leaves(names)
  assert _axes(result)['blocks/1/moe/experts/w1'] == (0,)
  assert [d.routers for d in result.decisions] == [('blocks/1/moe/router/kernel',)]
  assert result.undecided == {}


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_nnx_test_model_matches_the_name_based_labels():
  model = moe_models.NNXMoELM(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  fn = lambda p, t: moe_models.nnx_lm_loss(nnx.merge(graphdef, p), t)  # noqa: E731
  result = sj.trace_structure(fn, params, moe_models.copy_task_batch())
  assert _tiers(result) == moe_models.NNX_EXPECTED


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_linen_test_model_without_routing_is_all_backbone():
  # LinenMoELM computes router logits but never routes with them (its `experts` see
  # every token): from the computation, nothing is a router or an expert bank.
  model = moe_models.LinenMoELM()
  tokens = moe_models.copy_task_batch()
  params = model.init(jax.random.key(0), tokens)
  result = sj.trace_structure(lambda p, t: model.apply(p, t), params, tokens)
  assert set(_tiers(result).values()) == {'backbone'}
  assert result.decisions == ()
  assert sj.moe_param_labels(params)['params']['router']['kernel'] == 'router'


# ---------------------------------------------------------------------------- primitives


def test_router_and_bank_with_one_hot_einsum():
  def fn(p, x):
    w = _routed(x, x @ p['a'])
    hid = jnp.einsum('td,edf->tef', x, p['b'])
    return jnp.einsum('tef,te->tf', hid, w)

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert result.batch_axes == {'a': (), 'b': (0,)}


def test_decision_that_dispatches_nothing_makes_no_router():
  def fn(p, x):
    logits = jnp.einsum('td,ed->te', x, p['a']) + p['ab']
    return jnp.einsum('tdf,te->tf', jnp.einsum('td,edf->tdf', x, p['b']),
                      _routed(x, logits))

  p = {'a': jnp.zeros((E, D)), 'ab': jnp.zeros((E,)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'backbone', 'ab': 'backbone', 'b': 'backbone'}
  # `b`'s expert axis is contracted away against x, never aligned with the routing:
  # nothing is dispatched, so the decision makes no router and is reported.
  assert result.decisions == ()
  assert set(result.undecided) == {'a', 'ab'}


def test_argmax_router_with_gather_by_expert_id():
  def fn(p, x):
    choice = jnp.argmax(x @ p['a'], axis=-1)
    return jnp.einsum('td,tdf->tf', x, p['b'][choice])

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert 'gathered by expert id' in result.by_path['b'].evidence
  assert result.decisions[0].primitive == 'argmax'


def test_argsort_of_logits_is_a_routing_decision():
  def fn(p, x):
    best = jnp.argsort(-(x @ p['a']), axis=-1)[:, 0]
    return jnp.einsum('td,tdf->tf', x, p['b'][best])

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert result.decisions[0].primitive == 'sort'


def test_approx_max_k_router():
  def fn(p, x):
    _, idx = jax.lax.approx_max_k(x @ p['a'], 1)
    return jnp.einsum('td,tdf->tf', x, p['b'][idx[:, 0]])

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  assert sj.trace_structure(fn, p, X).labels == {'a': 'router', 'b': 'experts'}


def test_expert_choice_selects_tokens_and_the_router_axis_indexes_experts():
  def fn(p, x):
    weight, idx = jax.lax.top_k((x @ p['a']).T, 3)  # each of the E units picks 3 tokens
    out = jnp.einsum('ecd,edf->ecf', x[idx], p['b']) * weight[..., None]
    return jnp.zeros((T, F)).at[idx.reshape(-1)].add(out.reshape(-1, F))

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert result.batch_axes == {'a': (), 'b': (0,)}
  assert result.decisions[0].num_experts == E  # not T, the length of the selected axis


@pytest.mark.parametrize('pick', ['argmax', 'argsort', 'per_sequence'])
def test_expert_choice_by_argmax_argsort_or_per_sequence(pick):
  def fn(p, x):
    scores = x @ p['a']  # [T, E]
    if pick == 'argmax':  # each unit's one token
      return jnp.einsum('ed,edf->ef', x[jnp.argmax(scores, axis=0)], p['b'])
    if pick == 'argsort':
      return jnp.einsum('ecd,edf->ecf', x[jnp.argsort(-scores.T, axis=1)[:, :3]], p['b'])
    xs = x.reshape(2, T // 2, D)  # each unit picks 3 tokens of each sequence
    _, idx = jax.lax.top_k(jnp.einsum('bsd,de->bes', xs, p['a']), 3)  # [B, E, 3]
    picked = jnp.take_along_axis(xs[:, None], idx[..., None], axis=2)  # [B, E, 3, D]
    return jnp.einsum('becd,edf->becf', picked, p['b'])

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert result.batch_axes == {'a': (), 'b': (0,)}
  assert result.decisions[0].num_experts == E


def test_expert_choice_whose_expert_axis_cannot_be_told_is_reported():
  def fn(p, x):
    scores = jnp.einsum('td,gde->get', x, p['a'])  # [G, E, T]: two parameter axes
    _, idx = jax.lax.top_k(scores, 3)  # token positions [G, E, 3]
    return jnp.einsum('gecd,edf->gecf', x[idx], p['b'])

  p = {'a': jnp.zeros((2, D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'backbone', 'b': 'backbone'}
  assert result.decisions == ()
  assert set(result.undecided) == {'a', 'b'}
  assert all('cannot be told' in why for why in result.undecided.values())


def test_units_in_a_list_masked_by_expert_id():
  def fn(p, x):
    ids = jnp.argmax(x @ p['a'], -1)
    y = sum(jnp.where((ids == e)[:, None], x @ w, 0.0) for e, w in enumerate(p['w']))
    y = y + sum(jnp.where((ids != e)[:, None], 0.0, x @ w) for e, w in enumerate(p['n']))
    outs = [x @ w for w in p['s']]  # case e of a select by the ids
    return y + jax.lax.select_n(jnp.broadcast_to(ids[:, None], outs[0].shape), *outs)

  units = [jnp.zeros((D, F)) for _ in range(E)]
  p = {'a': jnp.zeros((D, E)), 'w': units, 'n': units, 's': units}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', **{k: ['experts'] * E for k in 'wns'}}
  assert result.batch_axes == {'a': (), **{k: [()] * E for k in 'wns'}}
  assert set(result.decisions[0].experts) == {f'{k}/{e}' for k in 'wns' for e in range(E)}
  assert result.undecided == {}
  assert 'id is 2' in result.by_path['w/2'].evidence
  assert 'id is 2' in result.by_path['n/2'].evidence
  assert 'id is 2' in result.by_path['s/2'].evidence


def test_units_masked_by_a_one_hot_column_and_in_a_loop_over_a_stack():
  def fn(p, x):
    weights, idx = jax.lax.top_k(jax.nn.softmax(x @ p['a']), 2)
    hot = jnp.einsum('tke,tk->te', jax.nn.one_hot(idx, E), weights)
    y = sum((x @ w) * hot[:, e:e + 1] for e, w in enumerate(p['w']))
    ids = idx[:, 0]

    def body(e, acc):  # the stacked bank, one unit per step
      unit = jax.lax.dynamic_index_in_dim(p['s'], e, keepdims=False)
      return acc + jnp.where((ids == e)[:, None], x @ unit, 0.0)

    return jax.lax.fori_loop(0, E, body, y)

  p = {'a': jnp.zeros((D, E)), 'w': [jnp.zeros((D, F)) for _ in range(E)],
       's': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'w': ['experts'] * E, 's': 'experts'}
  assert result.batch_axes == {'a': (), 'w': [()] * E, 's': (0,)}


def test_a_matrix_masked_for_every_unit_is_reported():
  def fn(p, x):
    ids = jnp.argmax(x @ p['a'], -1)
    own = sum(jnp.where((ids == e)[:, None], x @ w, 0.0) for e, w in enumerate(p['w']))
    return own + sum(jnp.where((ids == e)[:, None], x @ p['c'], 0.0) for e in range(E))

  p = {'a': jnp.zeros((D, E)), 'w': [jnp.zeros((D, F)) for _ in range(E)],
       'c': jnp.zeros((D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'w': ['experts'] * E, 'c': 'backbone'}
  assert 'ids 0, 1, 2, 3' in result.undecided['c']


def test_dynamic_slice_by_expert_id():
  def fn(p, x):
    e = jnp.argmax(jnp.sum(x @ p['a'], 0))  # one expert for the whole batch
    return x @ jax.lax.dynamic_index_in_dim(p['b'], e, keepdims=False)

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert result.batch_axes['b'] == (0,)


def test_ragged_dot_group_axis():
  def fn(p, x):
    _, idx = jax.lax.top_k(x @ p['a'], 1)
    order = jnp.argsort(idx[:, 0])
    sizes = jnp.bincount(idx[:, 0], length=E)
    return jax.lax.ragged_dot(x[order], p['b'], sizes)

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert result.batch_axes['b'] == (0,)


def test_bank_at_axis_two_through_transpose():
  def fn(p, x):
    w = jnp.transpose(p['b'], (2, 0, 1))  # stored [D, F, E]
    return jnp.einsum('tef,te->tf', jnp.einsum('td,edf->tef', x, w), _routed(x, x @ p['a']))

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((D, F, E))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels['b'] == 'experts' and result.batch_axes['b'] == (2,)


def test_scanned_axis_through_reshape_and_slice():
  def fn(p, x):
    stack = p['w'].reshape(D, 3, 2 * D)[:, :, :D]  # [D, L, D]
    stack = jnp.moveaxis(stack, 1, 0)
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, stack)[0]

  result = sj.trace_structure(fn, {'w': jnp.zeros((D, 3 * 2 * D))}, X)
  # The layer axis is merged into the stored axis 1 (3 * 2D): it survives as no axis
  # of its own, so the leaf gets no batch axis rather than a wrong one.
  assert result.batch_axes == {'w': ()}
  result = sj.trace_structure(fn, {'w': jnp.zeros((D, 3, 2 * D))}, X)
  assert result.batch_axes == {'w': (1,)}


def test_stacked_pieces_are_batch_axes_only_when_every_piece_is_taken():
  def fn(p, x):
    pair = (x @ p['w'][0]) * (x @ p['w'][1])  # both pieces of a stored pair
    one = x @ p['t'][3]  # one row of a table
    rows = [x @ r for r in jnp.split(p['s'], 3, axis=1)]  # width-1 pieces by split
    return pair.sum(-1) + one + sum(r[:, 0] for r in rows)

  params = {'w': jnp.zeros((2, D, F)), 't': jnp.zeros((5, D)), 's': jnp.zeros((D, 3))}
  result = sj.trace_structure(fn, params, X)
  assert result.batch_axes == {'w': (0,), 't': (), 's': (1,)}, result.format()
  assert result.labels == {'w': 'backbone', 't': 'backbone', 's': 'backbone'}


def test_scan_over_inputs_is_not_a_layer_axis():
  def fn(p, xs):  # an RNN over time: the scanned axis is the sequence
    pos = xs + p['pos']
    return jax.lax.scan(lambda c, x: (jnp.tanh(c @ p['w'] + x), None), xs[0], pos)[0]

  p = {'pos': jnp.zeros((T, D)), 'w': jnp.zeros((D, D))}
  assert sj.trace_structure(fn, p, X).batch_axes == {'pos': (), 'w': ()}


def test_broadcast_params_of_a_scan_are_not_stacked():
  def fn(p, x):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ p['w']), None), x, None, length=3)[0]

  assert sj.trace_structure(fn, {'w': jnp.zeros((D, D))}, X).batch_axes == {'w': ()}


def test_sees_through_cond_while_remat_custom_jvp_and_jit():
  @jax.custom_jvp
  def act(v):
    return jnp.tanh(v)

  act.defjvp(lambda primals, tangents: (act(primals[0]), tangents[0]))

  @jax.jit
  @jax.checkpoint
  def fn(p, x, flag):
    def body(i, c):
      logits = jax.lax.cond(flag > 0, lambda h: h @ p['a'], lambda h: -(h @ p['a']), c)
      w = _routed(c, logits, pick='argmax')
      return act(jnp.einsum('tef,te->tf', jnp.einsum('td,efd->tef', c, p['b']), w))
    return jax.lax.fori_loop(0, 2, body, x)

  p = {'a': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, D))}
  result = sj.trace_structure(fn, p, X, jnp.ones((), jnp.int32))
  assert result.labels == {'a': 'router', 'b': 'experts'}
  assert result.batch_axes == {'a': (), 'b': (0,)}


def test_argmax_metric_is_not_a_router():
  def fn(p, x, labels):
    logits = jnp.tanh(x @ p['w']) @ p['head']
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() + accuracy

  p = {'w': jnp.zeros((D, D)), 'head': jnp.zeros((D, 5))}
  result = sj.trace_structure(fn, p, X, jnp.zeros((T,), jnp.int32))
  assert result.labels == {'w': 'backbone', 'head': 'backbone'}
  assert result.decisions == ()
  assert 'dispatches no parameter' in result.undecided['head']


def test_unread_and_opaque_leaves_are_undecided():
  def fn(p, x):
    y = jax.pure_callback(lambda a: np.zeros((3,), np.float32),
                          jax.ShapeDtypeStruct((3,), jnp.float32), x @ p['w'])
    return y.sum()

  p = {'w': jnp.zeros((D, D)), 'spare': jnp.zeros((D,))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'w': 'backbone', 'spare': 'backbone'}
  assert 'never reads' in result.undecided['spare']
  assert 'pure_callback' in result.undecided['w']


def test_shape_dtype_struct_params_and_static_leaves():
  def fn(p, x, *, scale):
    w = _routed(x, x @ p['a'])
    return p['act'](jnp.einsum('tef,te->tf', jnp.einsum('td,edf->tef', x, p['b']), w)) * scale

  p = {'a': jax.ShapeDtypeStruct((D, E), jnp.float32), 'act': jax.nn.relu,
       'b': jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16)}
  result = sj.trace_structure(fn, p, X, scale=2.0)
  assert result.labels == {'a': 'router', 'act': None, 'b': 'experts'}
  assert [leaf.path for leaf in result.leaves] == ['a', 'b']


def test_bad_arguments_raise():
  with pytest.raises(TypeError, match='`fn`'):
    sj.trace_structure('forward', {'w': jnp.zeros(2)})
  with pytest.raises(TypeError, match='`params`'):
    sj.trace_structure(lambda p: p, {'w': 'not an array'})


# ---------------------------------------------------------------------------- issue 31


def _dense_experts(p, x, combine):
  """Every expert on every token ([E, T, D]), combined by weights [T, E]."""
  hid = jax.nn.relu(jnp.einsum('td,edf->etf', x, p['w1']))
  return jnp.einsum('etd,te->td', jnp.einsum('etf,efd->etd', hid, p['w2']), combine)


def _bank_params():
  return {'r': jnp.zeros((D, E)), 'w1': jnp.zeros((E, D, F)), 'w2': jnp.zeros((E, F, D))}


@pytest.mark.parametrize('grouped', ['one_hot', 'scatter', 'round_trip'])
def test_grouped_routing_and_a_reshape_round_trip_keep_the_decision(grouped):
  groups = 2

  def fn(p, x):
    scores = jax.nn.sigmoid(x @ p['r'])  # [T, E]
    biased = (scores + p['bias']).reshape(T, groups, E // groups)  # [T, G, E/G]
    if grouped != 'round_trip':  # each group scored by the sum of its top 2; best kept
      best = jax.lax.top_k(jax.lax.top_k(biased, 2)[0].sum(-1), 1)[1]  # [T, 1]
      if grouped == 'one_hot':
        keep = jax.nn.one_hot(best[:, 0], groups)[..., None] > 0  # [T, G, 1]
        biased = jnp.where(keep, biased, -jnp.inf)
      else:  # a group mask placed by a scatter, broadcast over the group and merged
        keep = jnp.zeros((T, groups)).at[jnp.arange(T)[:, None], best].set(1.0)
        keep = jnp.broadcast_to(keep[..., None], biased.shape).reshape(T, E)
        biased = jnp.where(keep.reshape(biased.shape) > 0, biased, 0.0)
    _, ids = jax.lax.top_k(biased.reshape(T, E), 2)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if grouped == 'scatter':
      combine = jnp.zeros((T, E)).at[jnp.arange(T)[:, None], ids].add(weights)
    else:
      combine = jnp.einsum('tke,tk->te', jax.nn.one_hot(ids, E), weights)
    return _dense_experts(p, x, combine)

  p = {**_bank_params(), 'bias': jnp.zeros((E,))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'r': 'router', 'bias': 'router', 'w1': 'experts',
                           'w2': 'experts'}, result.format()
  assert result.batch_axes == {'r': (), 'bias': (), 'w1': (0,), 'w2': (0,)}
  assert len(result.decisions) == 1 and result.decisions[0].num_experts == E
  assert result.undecided == {}


def test_combine_weights_built_by_a_scatter():
  def fn(p, x):
    weights, ids = jax.lax.top_k(jax.nn.softmax(x @ p['r']), 2)
    combine = jnp.zeros((T, E)).at[jnp.arange(T)[:, None], ids].set(weights)
    return _dense_experts(p, x, combine)

  result = sj.trace_structure(fn, _bank_params(), X)
  assert result.labels == {'r': 'router', 'w1': 'experts', 'w2': 'experts'}, result.format()
  assert result.batch_axes == {'r': (), 'w1': (0,), 'w2': (0,)}
  assert result.undecided == {}


@pytest.mark.parametrize('key', ['legacy', 'legacy_arg', 'typed_unwrapped', 'typed_arg',
                                 'typed_arg_unwrapped'])
def test_random_keys_legacy_and_typed(key):
  def fn(p, x, k=None):
    if key == 'legacy':
      k = jax.random.PRNGKey(0)
    elif key == 'typed_unwrapped':  # a batch of typed keys, unwrapped and wrapped again
      k = jax.random.wrap_key_data(jax.random.key_data(jax.random.split(jax.random.key(0),
                                                                        3))[1])
    elif key == 'typed_arg_unwrapped':
      k = jax.random.fold_in(jax.random.wrap_key_data(
          jax.random.key_data(jax.random.split(k, 4))[2]), 7)
    jitter, drop = jax.random.split(k)
    logits = x @ p['r'] * jax.random.uniform(jitter, (T, E), minval=0.9, maxval=1.1)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), 2)
    combine = jnp.einsum('tke,tk->te', jax.nn.one_hot(ids, E), weights)
    x = jnp.where(jax.random.bernoulli(drop, 0.9, x.shape), x, 0.0)
    return _dense_experts(p, x, combine)

  args = {'legacy_arg': (jax.random.PRNGKey(1),), 'typed_arg': (jax.random.key(1),),
          'typed_arg_unwrapped': (jax.random.key(1),)}
  result = sj.trace_structure(fn, _bank_params(), X, *args.get(key, ()))
  assert result.labels == {'r': 'router', 'w1': 'experts', 'w2': 'experts'}, result.format()
  assert result.undecided == {}


@pytest.mark.parametrize('how', ['stack', 'concatenate'])
def test_stacked_per_expert_outputs_of_banks_sliced_in_a_loop(how):
  def fn(p, x):
    weights, ids = jax.lax.top_k(jax.nn.softmax(x @ p['r']), 2)
    combine = jnp.einsum('tke,tk->te', jax.nn.one_hot(ids, E), weights)
    hid = jnp.stack([jax.nn.relu(x @ p['w1'][e]) for e in range(E)])  # [E, T, F]
    outs = [hid[e] @ p['w2'][e] for e in range(E)]
    if how == 'stack':
      out = jnp.stack(outs, axis=1)  # [T, E, D]
    else:
      out = jnp.concatenate([o[:, None] for o in outs], axis=1)
    return jnp.einsum('ted,te->td', out, combine)

  result = sj.trace_structure(fn, _bank_params(), X)
  assert result.labels == {'r': 'router', 'w1': 'experts', 'w2': 'experts'}, result.format()
  assert result.batch_axes == {'r': (), 'w1': (0,), 'w2': (0,)}
  assert result.undecided == {}


def test_stack_of_parameter_paths_is_decided():
  def fn(p, x):
    return jnp.stack([x @ p['a'], x @ p['b']]).sum(0) @ p['c']

  p = {'a': jnp.zeros((D, F)), 'b': jnp.zeros((D, F)), 'c': jnp.zeros((F, D))}
  result = sj.trace_structure(fn, p, X)
  assert result.labels == {'a': 'backbone', 'b': 'backbone', 'c': 'backbone'}
  assert result.undecided == {}


def test_a_primitive_without_a_rule_is_undecided_and_named_at_the_callers_line():
  def fn(p, x):
    return jnp.cumsum(x @ p['w'], axis=0).sum() + jnp.abs(jnp.fft.fft(x @ p['v'])).sum()

  p = {'w': jnp.zeros((D, D)), 'v': jnp.zeros((D, D))}
  with pytest.warns(sj.UnsureLabelWarning, match=r'fft.*test_structure\.py') as record:
    result = sj.trace_structure(fn, p, X)
  assert 'fft' in result.undecided['v'] and 'w' not in result.undecided
  assert len([w for w in record if 'fft' in str(w.message)]) == 1


def test_a_selection_of_parameter_values_that_decides_nothing_is_loud():
  def fn(p, x):
    h = x @ p['w']  # [T, D]: top_k over the tokens of a single feature
    return jax.lax.top_k(h[:, 0], 3)[0].sum()

  p = {'w': jnp.zeros((D, D))}
  with pytest.warns(sj.UnsureLabelWarning, match=r'top_k.*test_structure\.py'):
    result = sj.trace_structure(fn, p, X)
  assert 'top_k' in result.undecided['w']


def test_combine_weights_at_flat_positions_are_undecided_not_silently_backbone():
  def fn(p, x):  # positions t * E + id of a flat [T * E] buffer: the expert axis is lost
    weights, ids = jax.lax.top_k(jax.nn.softmax(x @ p['r']), 2)
    flat = (jnp.arange(T)[:, None] * E + ids).reshape(-1)
    combine = jnp.zeros((T * E,)).at[flat].add(weights.reshape(-1)).reshape(T, E)
    return _dense_experts(p, x, combine)

  with pytest.warns(sj.UnsureLabelWarning, match='undecided'):
    result = sj.trace_structure(fn, _bank_params(), X)
  assert set(result.undecided) == {'r', 'w1', 'w2'}
  assert 'lost' in result.undecided['w1']


def _small_lm(p, tokens):
  """A language model whose names say nothing: table, attention, MoE, MLP, head."""
  n = tokens.shape[0]
  h = p['tab'][tokens] + p['pos'][jnp.arange(n)]
  h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * p['g']
  q = jnp.einsum('td,dhk->thk', h, p['a']) + p['qb']  # a 2-D bias [heads, head_dim]
  k = jnp.einsum('td,dhk->thk', h, p['b'])
  rel = p['rel'][jnp.abs(jnp.arange(n)[:, None] - jnp.arange(n)[None, :])]  # [T, T, H]
  att = jax.nn.softmax(jnp.einsum('thk,shk->hts', q, k) + rel.transpose(2, 0, 1), -1)
  h = h + jnp.einsum('hts,shk,hkd->td', att, k, p['c'])
  w, ids = jax.lax.top_k(jax.nn.softmax(h @ p['r']), 2)
  h = h + _dense_experts(p, h, jnp.einsum('tke,tk->te', jax.nn.one_hot(ids, E), w))
  h = h + jax.nn.gelu(h @ p['u']) @ p['v']
  logits = h @ p['o']
  return -jax.nn.log_softmax(logits)[jnp.arange(n), tokens].mean()


def test_roles_from_the_computation_and_the_hidden_tier_they_give():
  vocab, heads = 50, 2
  p = {**_bank_params(), 'tab': jnp.zeros((vocab, D)), 'pos': jnp.zeros((T, D)),
       'g': jnp.zeros((D,)), 'a': jnp.zeros((D, heads, 4)), 'b': jnp.zeros((D, heads, 4)),
       'qb': jnp.zeros((heads, 4)), 'rel': jnp.zeros((T, heads)), 'c': jnp.zeros((heads, 4, D)),
       'u': jnp.zeros((D, F)), 'v': jnp.zeros((F, D)), 'o': jnp.zeros((D, vocab))}
  result = sj.trace_structure(_small_lm, p, jax.ShapeDtypeStruct((T,), jnp.int32))
  assert result.roles == {
      'tab': 'embedding', 'pos': 'embedding', 'rel': 'embedding', 'g': 'bias/gain',
      'qb': 'bias/gain', 'a': 'hidden matrix', 'b': 'hidden matrix', 'c': 'hidden matrix',
      'u': 'hidden matrix', 'v': 'hidden matrix', 'o': 'output layer', 'r': 'router',
      'w1': 'expert bank', 'w2': 'expert bank'}, result.format()
  assert 'test_structure.py' in result.by_path['tab'].role_evidence
  hidden = {'a', 'b', 'c', 'u', 'v'}
  labels = result.labels_for(sj.MUON_TIERS)
  assert {k for k, t in labels.items() if t == 'hidden'} == hidden
  assert result.labels_for(sj.PUBLISHED_TIERS) == result.labels
  tx = sj.skewadam(1e-3, tiers=sj.MUON_TIERS, param_labels=result)
  tx.init(p)
  table = {row.path: row.tier for row in sj.label_table(tx, p).rows}
  assert {k for k, t in table.items() if t == 'hidden'} == hidden
  assert table['w1'] == 'experts' and table['r'] == 'router'


def test_a_gate_with_one_column_is_a_hidden_matrix_but_not_orthogonalised():
  """A shared expert's output gate `[d, 1]` is contracted with activations (its role), but
  its matrix is a vector: Muon's update would only normalise it, so it stays backbone."""

  def fn(p, x):
    h = x @ p['w']
    return jnp.mean((jax.nn.sigmoid(h @ p['gate']) * (h @ p['v'])) @ p['o'])

  p = {'w': jnp.zeros((D, D)), 'gate': jnp.zeros((D, 1)), 'v': jnp.zeros((D, D)),
       'o': jnp.zeros((D, D))}
  result = sj.trace_structure(fn, p, jax.ShapeDtypeStruct((T, D), jnp.float32))
  assert result.roles['gate'] == 'hidden matrix'
  assert result.labels_for(sj.MUON_TIERS) == {'w': 'hidden', 'gate': 'backbone', 'v': 'hidden',
                                              'o': 'backbone'}


def test_triangular_solve_keeps_batch_axes_and_other_linear_algebra_is_read():
  def fn(p, x):  # a chunked delta rule's solve, per expert: [E, T, T] \ [E, T, F]
    k = x @ p['k']
    a = jnp.tril(k @ k.T, -1) + jnp.eye(T)
    hid = jnp.einsum('td,edf->etf', x, p['b'])
    u = jax.scipy.linalg.solve_triangular(jnp.broadcast_to(a, (E, T, T)), hid, lower=True)
    v = jax.scipy.linalg.solve_triangular(a, x @ p['v'], lower=True, trans=1)
    y = jnp.einsum('etf,te->tf', u, _routed(x, x @ p['r'])) + v
    s = p['s'] @ jnp.swapaxes(p['s'], 1, 2) + jnp.eye(D)
    extra = (jnp.linalg.cholesky(s).sum() + jnp.linalg.eigh(s)[0].sum()
             + jnp.linalg.svd(s)[1].sum() + jnp.linalg.qr(s)[1].sum()
             + jnp.linalg.solve(s, x.T[None]).sum())
    return y.sum() + extra

  p = {'k': jnp.zeros((D, D)), 'b': jnp.zeros((E, D, F)), 'v': jnp.zeros((D, F)),
       'r': jnp.zeros((D, E)), 's': jnp.zeros((3, D, D))}
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    result = sj.trace_structure(fn, p, X)
  assert result.labels == {'k': 'backbone', 'b': 'experts', 'v': 'backbone', 'r': 'router',
                           's': 'backbone'}
  assert result.batch_axes['b'] == (0,) and result.undecided == {}


def _hi_einsum(spec, *args, fail=False):
  """`jnp.einsum` as a hijax primitive (`call_hi_primitive`), as jax 0.12 has one."""
  hijax = pytest.importorskip('jax._src.hijax')
  base = getattr(hijax, 'HiPrim', None) or getattr(hijax, 'VJPHiPrimitive', None)
  if base is None:
    pytest.skip('this jax has no hijax primitives')

  class Einsum(base):
    def __init__(self, *avals):
      self.in_avals = avals
      out = jax.eval_shape(lambda *a: jnp.einsum(spec, *a), *avals)
      self.out_aval = jax.core.ShapedArray(out.shape, out.dtype)
      self.params = {'spec': spec, 'fail': fail}
      super().__init__()

    def expand(self, *operands):
      if fail:
        raise NotImplementedError('no expansion')
      return jnp.einsum(spec, *operands)

  return Einsum(*[jax.core.ShapedArray(a.shape, a.dtype) for a in args])(*args)


@pytest.mark.parametrize('fail', [False, True])
def test_a_hijax_primitive_is_entered_through_its_expansion(fail):
  def fn(p, x):
    hid = _hi_einsum('td,edf->tef', x, p['b'], fail=fail)
    return jnp.einsum('tef,te->tf', hid, _routed(x, x @ p['r']))

  p = {'r': jnp.zeros((D, E)), 'b': jnp.zeros((E, D, F))}
  if not fail:
    with warnings.catch_warnings():
      warnings.simplefilter('error', sj.UnsureLabelWarning)
      result = sj.trace_structure(fn, p, X)
    assert result.labels == {'r': 'router', 'b': 'experts'}
    assert result.batch_axes == {'r': (), 'b': (0,)} and result.undecided == {}
    return
  with pytest.warns(sj.UnsureLabelWarning,
                    match=r'call_hi_primitive \(Einsum: its expansion could not be traced'
                          r'.*test_structure\.py'):
    result = sj.trace_structure(fn, p, X)
  assert result.labels['b'] == 'backbone' and 'call_hi_primitive' in result.undecided['b']


def test_layers_applied_by_vmap_are_batched_along_the_decisions_per_slice():
  def ffn(w, x, comb):
    return jnp.einsum('te,tef->tf', comb, jnp.einsum('td,edf->tef', x, w))

  def fn(p, x):
    def layer(q):  # one router per layer: the logits [L, T, E] of the lowered vmap
      return ffn(q['w'], x * q['g'], _routed(x, x @ q['r']))
    return jax.vmap(layer)(p).sum(0)

  p = {'g': jnp.zeros((3, D)), 'r': jnp.zeros((3, D, E)), 'w': jnp.zeros((3, E, D, F))}
  result = sj.trace_structure(fn, p, X)
  # the top_k over E is made per slice of the logits' other parameter axis (L): that
  # axis is a batch axis of the router and of every leaf whose axis runs along it
  assert result.labels == {'g': 'backbone', 'r': 'router', 'w': 'experts'}, result.format()
  assert result.batch_axes == {'g': (0,), 'r': (0,), 'w': (0, 1)}
  assert result.undecided == {}
  assert 'per slice' in result.by_path['g'].evidence


def test_expert_choice_applied_by_vmap_tells_the_layer_axis_from_the_expert_axis():
  def fn(p, x):
    def layer(q):
      h = x * q['g']
      scores = jax.nn.softmax(h @ q['r'], axis=0).T  # [E, T] per layer
      g, idx = jax.lax.top_k(scores, 3)  # token positions [E, 3]
      out = jnp.einsum('ecd,edf->ecf', h[idx], q['w']) * g[..., None]
      return jnp.zeros((T, F)).at[idx.reshape(-1)].add(out.reshape(-1, F))
    return jax.vmap(layer)(p).sum(0)

  p = {'g': jnp.zeros((3, D)), 'r': jnp.zeros((3, D, E)), 'w': jnp.zeros((3, E, D, F))}
  result = sj.trace_structure(fn, p, X)
  # scores [L, E, T]: L is a batch dimension of the contraction making them (the
  # router's input runs along it too), E the router's own output axis
  assert result.labels == {'g': 'backbone', 'r': 'router', 'w': 'experts'}, result.format()
  assert result.batch_axes == {'g': (0,), 'r': (0,), 'w': (0, 1)}
  assert result.decisions[0].num_experts == E


def _units_params():
  return {'r': jnp.zeros((D, E)),
          'u': [{'a': jnp.zeros((D, F)), 'b': jnp.zeros((F, D))} for _ in range(E)]}


def _unit_outputs(p, x):
  """One module per expert, each applied to every token: E outputs [T, D]."""
  return [jax.nn.gelu(x @ u['a']) @ u['b'] for u in p['u']]


@pytest.mark.parametrize('how', ['stack', 'concatenate', 'product', 'take', 'index'])
def test_units_joined_by_a_stack_against_the_expert_axis(how):
  def fn(p, x):
    weights, ids = jax.lax.top_k(jax.nn.softmax(x @ p['r']), 2)
    combine = jnp.einsum('tke,tk->te', jax.nn.one_hot(ids, E), weights)
    outs = _unit_outputs(p, x)
    if how == 'index':  # [E, T, D] read at (first id, token)
      return jnp.stack(outs)[ids[:, 0], jnp.arange(T)] * weights[:, :1]
    if how == 'concatenate':
      return jnp.einsum('ted,te->td', jnp.concatenate([o[:, None] for o in outs], 1),
                        combine)
    every = jnp.stack(outs, axis=1)  # [T, E, D]
    if how == 'product':
      return (every * combine[..., None]).sum(1)
    if how == 'take':
      return (jnp.take_along_axis(every, ids[..., None], 1) * weights[..., None]).sum(1)
    return jnp.einsum('ted,te->td', every, combine)

  result = sj.trace_structure(fn, _units_params(), X)
  unit = {'a': 'experts', 'b': 'experts'}
  assert result.labels == {'r': 'router', 'u': [unit] * E}, result.format()
  assert result.batch_axes == {'r': (), 'u': [{'a': (), 'b': ()}] * E}
  assert result.undecided == {}
  assert 'position 2' in result.by_path['u/2/a'].evidence


@pytest.mark.parametrize('move', ['flip', 'cumsum', 'roll'])
def test_units_whose_positions_may_move_before_the_expert_axis_are_loud(move):
  moves = {'flip': lambda v: jnp.flip(v, 1), 'cumsum': lambda v: jnp.cumsum(v, 1),
           'roll': lambda v: jnp.roll(v, 1, 1)}

  def fn(p, x):
    combine = _routed(x, x @ p['r'])
    every = moves[move](jnp.stack(_unit_outputs(p, x), axis=1))
    return jnp.einsum('ted,te->td', every, combine)

  with pytest.warns(sj.UnsureLabelWarning, match='undecided'):
    result = sj.trace_structure(fn, _units_params(), X)
  assert all(f'u/{e}/{m}' in result.undecided for e in range(E) for m in 'ab')
  assert 'moved' in result.undecided['u/0/a']
