"""Reports read the optimizer that was built: `label_table(tx, params)`,
`memory_report(tx, params)`, `state_shardings`, from one trace of `tx.init`; the state
walk they share (`_walk`), on today's layout, a layout with `None` in absent slots and
optax's own states."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import skewadam_jax as sj
from skewadam_jax.reports import walk as _walk

S = jax.ShapeDtypeStruct
F32 = jnp.float32
PARAMS = {'embed': S((16, 8), F32), 'norm': S((8,), F32),
          'moe': {'router': S((8, 4), F32), 'experts': {'w1': S((4, 8, 16), F32)}}}


def _summary(table: Any) -> list[tuple[Any, ...]]:
  return [(r.path, r.tier, r.second_moment, r.batch_axes, r.state_bytes, r.note)
          for r in table]


# ------------------------------------------------------------------ label_table(tx, params)


def test_label_table_reads_the_tiers_labels_and_batch_axes_of_the_optimizer():
  """The old trap: `label_table(params)` without repeating `tiers`, `param_labels` and
  `batch_axes` showed the published tiers; from the optimizer it cannot."""
  labels = {'embed': 'router', 'norm': 'backbone', 'moe': 'experts'}
  axes = {'embed': (), 'norm': (), 'moe': {'router': (0,), 'experts': {'w1': (0,)}}}
  tx = sj.skewadam(1e-3, tiers=sj.ADAM_EPS_TIERS, param_labels=labels, batch_axes=axes)
  rows = {r.path: r for r in sj.label_table(tx, PARAMS)}
  assert {p: r.tier for p, r in rows.items()} == {
      'embed': 'router', 'norm': 'backbone', 'moe/router': 'experts',
      'moe/experts/w1': 'experts'}
  assert rows['moe/router'].batch_axes == (0,)  # given, not the default (none for 2-D)
  assert rows['moe/router'].second_moment == 'exact'  # one matrix axis left: exact
  assert rows['embed'].second_moment == 'exact' and rows['embed'].state_bytes == 4 * 2 * 128
  # The published tiers would have said otherwise.
  published = {r.path: r.tier for r in sj.label_table(sj.skewadam(1e-3), PARAMS)}
  assert published['embed'] == 'backbone' and published['moe/router'] == 'router'


def test_label_table_of_muon_tiers_shows_the_hidden_tier():
  params = {'embed': S((64, 8), F32), 'mlp': S((8, 32), F32), 'norm': S((8,), F32)}
  rows = {r.path: r for r in sj.label_table(sj.skewadam(1e-3, tiers=sj.MUON_TIERS), params)}
  assert rows['mlp'].tier == 'hidden' and rows['mlp'].second_moment == 'orthogonal'
  assert rows['embed'].tier == 'backbone'


@pytest.mark.parametrize('wrap', ['chain', 'inject', 'multisteps', 'apply_if_finite',
                                  'masked'])
def test_label_table_finds_the_skewadam_inside_optax_wrappers(wrap):
  plain = sj.label_table(sj.skewadam(1e-3), PARAMS)
  tx = {'chain': lambda: optax.chain(optax.clip_by_global_norm(1.0), sj.skewadam(1e-3)),
        'inject': lambda: optax.inject_hyperparams(sj.skewadam)(learning_rate=1e-3),
        'multisteps': lambda: optax.MultiSteps(sj.skewadam(1e-3), 2),
        'apply_if_finite': lambda: optax.apply_if_finite(sj.skewadam(1e-3), 3),
        'masked': lambda: optax.masked(sj.skewadam(1e-3),
                                       {'embed': False, 'norm': True, 'moe': True}),
        }[wrap]()
  table = sj.label_table(tx, PARAMS)
  rows, ref = {r.path: r for r in table}, {r.path: r for r in plain}
  assert list(rows) == list(ref)
  for path, r in rows.items():
    if wrap == 'masked' and path == 'embed':
      assert (r.tier, r.second_moment, r.state_bytes) == ('-', '-', 0)
      continue
    want = ref[path]
    assert (r.tier, r.second_moment, r.batch_axes, r.note) == (
        want.tier, want.second_moment, want.batch_axes, want.note)
    # MultiSteps keeps an accumulated gradient per parameter: its bytes are the leaf's.
    accumulated = r.param_bytes if wrap == 'multisteps' else 0
    assert r.state_bytes == want.state_bytes + accumulated, path


def test_label_table_of_an_optimizer_without_skewadam_names_tx():
  with pytest.raises(ValueError, match=r'`tx` contains no sj.skewadam.*sj.memory_report'):
    sj.label_table(optax.adamw(1e-3), PARAMS)
  with pytest.raises(TypeError, match=r'`tx` must be the optimizer.*swapped.*'
                     r'sj.label_table\(tx, params\)'):
    sj.label_table(PARAMS, sj.skewadam(1e-3))
  with pytest.raises(TypeError, match=r'`tx` must be an optax.GradientTransformation'):
    sj.label_table(PARAMS, PARAMS)
  # The tiers, labels and batch axes are the skewadam's, never the report's.
  with pytest.raises(TypeError, match=r'positional argument'):
    sj.label_table(sj.skewadam(1e-3), PARAMS, sj.MUON_TIERS)
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'tiers'"):
    sj.label_table(PARAMS, tiers=sj.MUON_TIERS)


def test_label_table_is_an_object_with_format_and_its_rows():
  table = sj.label_table(sj.skewadam(1e-3), PARAMS)
  assert isinstance(table, sj.LabelTable) and len(table) == 4
  assert table[0].path == 'embed' and [r.path for r in table][-1] == 'norm'
  assert table.total_state_bytes == sum(r.state_bytes for r in table.rows)
  text = table.format('SkewAdam')
  assert text.startswith('### SkewAdam\npath') and 'batch axes' in text
  assert text.splitlines()[-1].startswith(f'4 leaves, {table.total_state_bytes:,} B')


def test_removed_spellings_raise_naming_the_new_form():
  # The params-first forms and `format_label_table` are removed: each is an error now.
  tx = sj.skewadam(1e-3, tiers=sj.ADAM_EPS_TIERS)
  assert not hasattr(sj, 'format_label_table')
  with pytest.raises(TypeError, match=r'swapped\. Call sj.memory_report\(tx, params\)'):
    sj.memory_report(PARAMS, tx)
  with pytest.raises(TypeError, match=r'swapped\. Call sj.memory_report\(tx, params\)'):
    sj.memory_report(PARAMS, tx, param_labels=sj.moe_param_labels)
  with pytest.raises(TypeError, match=r'missing 1 required positional argument'):
    sj.label_table(PARAMS)


def test_memory_report_groups_every_optimizer_by_the_same_labels():
  params = {'embed': S((64, 8), F32), 'mlp': S((8, 32), F32), 'norm': S((8,), F32)}
  tx = sj.skewadam(1e-3, tiers=sj.MUON_TIERS)
  report = sj.memory_report(tx, params)  # moe_param_labels, as for AdamW: comparable
  assert [t.tier for t in report.tiers] == [t.tier for t in
                                            sj.memory_report(optax.adamw(1e-3), params).tiers]
  hidden = sj.memory_report(tx, params, param_labels=sj.hidden_param_labels)
  by_tier = {t.tier: t for t in hidden.tiers}
  assert set(by_tier) == {'backbone', 'hidden'} and by_tier['hidden'].params == 8 * 32
  assert hidden.total_state_bytes == report.total_state_bytes
  table = sj.label_table(tx, params)  # the skewadam's own tiers
  assert sum(r.state_bytes for r in table if r.tier == 'hidden') == by_tier['hidden'].state_bytes


# ------------------------------------------------------------------ quantized statistics


@dataclasses.dataclass(frozen=True)
class EightBit(sj.SecondMoment):
  """An 8-bit second moment: uint8 codes times a float32 scale per row (2-D leaves)."""

  name = '8-bit'

  def for_leaf(self, shape, batch_axes=None):
    return self if len(shape) == 2 else sj.Exact().for_leaf(shape, batch_axes)

  def init(self, param, path):
    return {'v': {'code': jnp.zeros(param.shape, jnp.uint8),
                  'scale': jnp.zeros(param.shape[:1], jnp.float32)}}

  def update(self, g, stats, x, step):
    v = stats['v']['code'].astype(jnp.float32) / 255.0 * stats['v']['scale'][:, None]
    g32 = g.astype(jnp.float32)
    v = step.b2 * v + (1.0 - step.b2) * g32 * g32
    scale = jnp.max(v, axis=1)
    code = jnp.round(v / jnp.maximum(scale, 1e-30)[:, None] * 255.0).astype(jnp.uint8)
    u = x.astype(jnp.float32) * step.num_scale / jnp.sqrt(jnp.maximum(v, step.eps))
    return u, {'v': {'code': code, 'scale': scale}}

  def specs(self, spec, shape, mesh, path):
    return {'v': {'code': P(*spec), 'scale': P(spec[0])}}


QUANT = {'w': S((16, 8), F32), 'b': S((8,), F32)}
QUANT_TIERS = {'backbone': sj.Tier(momentum=False, second_moment=EightBit())}


def test_state_shardings_keep_the_specs_of_a_pytree_statistic():
  tx = sj.skewadam(1e-3, tiers=QUANT_TIERS, param_labels=lambda p: 'backbone')
  shardings = sj.state_shardings(tx, QUANT, {'w': P('model', None), 'b': P()})
  v = shardings[0].v
  assert v['w'] == {'code': P('model', None), 'scale': P('model')}
  assert v['b'] == P()


def test_quantized_state_is_counted():
  tx = sj.skewadam(1e-3, tiers=QUANT_TIERS, param_labels=lambda p: 'backbone')
  stats = 16 * 8 * 1 + 16 * 4 + 8 * 4  # uint8 codes, float32 row scales, the bias's v
  assert sj.optimizer_state_bytes(tx, QUANT) == stats
  assert sj.state_bytes(jax.eval_shape(tx.init, QUANT)) == stats
  report = sj.memory_report(tx, QUANT)
  assert report.total_state_bytes == stats and report.counter_bytes > 0
  assert {r.path: r.state_bytes for r in sj.label_table(tx, QUANT)} == {
      'b': 8 * 4, 'w': 16 * 8 + 16 * 4}
  # The estimator trains (its statistics keep their dtypes step to step).
  params = {k: jnp.ones(s.shape) for k, s in QUANT.items()}
  _, state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  assert state[0].v['w']['code'].dtype == jnp.uint8
  # Quantized optax states count as well: int8 moments are not free.
  int8 = optax.GradientTransformation(
      lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.int8), p),
      optax.identity().update)
  assert sj.optimizer_state_bytes(int8, QUANT) == 16 * 8 + 8


def test_step_counters_are_listed_apart():
  params = {'w': jnp.zeros((3, 4))}
  tx = optax.MultiSteps(sj.skewadam(1e-3), 2)
  state = jax.eval_shape(tx.init, params)
  counters = sum(x.dtype.itemsize for x in jax.tree.leaves(state)
                 if x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer))
  assert counters >= 4 * 3  # MultiSteps' mini_step and gradient_step, the tiers' counts
  report = sj.memory_report(tx, params)
  assert report.counter_bytes == counters
  assert report.total_state_bytes == sj.state_bytes(state) == 4 * (12 + 3 + 4 + 12)
  assert sj.state_bytes(state, counters=True) == report.total_state_bytes + counters


# ------------------------------------------------------------------ one state walk


class TieredState(NamedTuple):
  """The layout of one state for every tier: params-shaped fields, `None` where absent."""
  count: Any
  mu: Any
  v_row: Any
  v_col: Any
  v: Any


def _new_layout(params: Any) -> TieredState:
  """A hand-built state in that layout: backbone 'embed' (momentum, factored), experts
  'w1' (factored, no momentum), router (exact), 'norm' (momentum, exact)."""
  z = lambda *shape: jnp.zeros(shape, jnp.float32)
  return TieredState(
      count=jnp.zeros([], jnp.int32),
      mu={'embed': z(16, 8), 'norm': z(8), 'moe': {'router': None, 'experts': {'w1': None}}},
      v_row={'embed': z(16), 'norm': None, 'moe': {'router': None,
                                                   'experts': {'w1': z(4, 8)}}},
      v_col={'embed': z(8), 'norm': None, 'moe': {'router': None,
                                                  'experts': {'w1': z(4, 16)}}},
      v={'embed': None, 'norm': z(8), 'moe': {'router': z(8, 4), 'experts': {'w1': None}}})


def test_walker_on_a_state_with_none_in_absent_slots():
  state = jax.eval_shape(_new_layout, PARAMS)
  paths = ['embed', 'moe/experts/w1', 'moe/router', 'norm']  # flattening order
  got = [None if i is None else paths[i] for i in _walk.param_of_leaves(state, PARAMS)]
  assert got == [None, 'embed', 'norm', 'embed', 'moe/experts/w1', 'embed',
                 'moe/experts/w1', 'moe/router', 'norm']
  tx = optax.GradientTransformation(_new_layout, optax.identity().update)
  by_tier = {t.tier: t.state_bytes for t in sj.memory_report(tx, PARAMS).tiers}
  assert by_tier == {'backbone': 4 * (128 + 16 + 8 + 8 + 8), 'experts': 4 * (32 + 64),
                     'router': 4 * 32}
  specs = {'embed': P(None, 'data'), 'norm': P(),
           'moe': {'router': P(), 'experts': {'w1': P('expert', None, 'data')}}}
  shardings = sj.state_shardings(tx, PARAMS, specs)
  assert shardings.mu['moe']['router'] is None and shardings.count == P()
  assert shardings.mu['embed'] == P(None, 'data')
  assert shardings.v_row['moe']['experts']['w1'] == P('expert', None)
  assert shardings.v_col['moe']['experts']['w1'] == P('expert', 'data')


def test_walker_on_optax_states():
  params = {'b': S((6,), F32), 'w': S((6, 4), F32)}
  adamw = jax.eval_shape(optax.adamw(1e-3).init, params)
  assert _walk.param_of_leaves(adamw, params) == [None, 0, 1, 0, 1]
  # Adafactor's factored state does not follow the params' shapes; it follows its tree.
  adafactor = jax.eval_shape(optax.adafactor(1e-3).init, params)
  owners = _walk.param_of_leaves(adafactor, params)
  shapes = [tuple(x.shape) for x in jax.tree.leaves(adafactor)]
  assert [(o, s) for o, s in zip(owners, shapes) if o is not None] and all(
      s == () for o, s in zip(owners, shapes) if o is None)
  # A params tuple is not mistaken for an optax.chain state of the same length.
  pair = (S((3,), F32), S((5,), F32))
  chained = jax.eval_shape(optax.chain(optax.scale_by_adam(), optax.scale(-1.0)).init, pair)
  assert _walk.param_of_leaves(chained, pair) == [None, 0, 1, 0, 1]
  # A lone-array params tree: only lone arrays follow it.
  lone = jax.eval_shape(optax.adam(1e-3).init, S((3,), F32))
  assert _walk.param_of_leaves(lone, S((3,), F32)) == [0, 0, 0]
