"""Memory accounting from abstract shapes, on the published 6.78B configuration."""

import jax
import jax.numpy as jnp
import optax

import skewadam_jax as sj
from skewadam_jax.reports import memory as _memory

from paper_moe import D, E, F32, H, S, paper_params


def test_paper_parameter_split():
  report = sj.memory_report(sj.skewadam(3e-4), paper_params())
  by_tier = {t.tier: t.params for t in report.tiers}
  assert by_tier == {'backbone': 341_352_448, 'experts': 6_442_450_944, 'router': 524_288}
  assert report.total_params == 6_784_327_680


def test_skewadam_state_is_exactly_published():
  params = paper_params()
  assert sj.optimizer_state_bytes(sj.skewadam(3e-4, weight_decay=0.1), params) == 1_380_800_000
  report = sj.memory_report(sj.skewadam(3e-4), params)
  by_tier = {t.tier: t.state_bytes for t in report.tiers}
  assert by_tier['experts'] == 4 * 128 * 3 * (D + H)
  assert by_tier['router'] == 4 * D * E
  assert report.total_state_bytes == 1_380_800_000
  # Every state leaf is float32 here; the tiers' int32 step counts are set apart.
  state = jax.eval_shape(sj.skewadam(3e-4).init, params)
  assert report.counter_bytes == 4 * sum(x.ndim == 0 for x in jax.tree.leaves(state)) > 0


def test_muon_tiers_state_on_the_published_moe():
  """`MUON_TIERS`: the hidden matrices' factored statistics and every expert statistic
  dropped (orthogonalised, stateless), the router's momentum added."""
  params = paper_params()
  report = sj.memory_report(sj.skewadam(3e-4, tiers=sj.MUON_TIERS), params)
  by_tier = {t.tier: t.state_bytes for t in report.tiers}
  assert by_tier['experts'] == 0
  assert by_tier['router'] == 2 * 4 * D * E
  assert report.total_state_bytes == 1_370_002_944


def test_adamw_state_is_eight_bytes_per_parameter():
  # The published AdamW keeps fp32 m and v: 8 B per parameter.
  params32 = jax.tree.map(lambda x: S(x.shape, F32), paper_params())
  assert sj.optimizer_state_bytes(optax.adamw(3e-4), params32) == 54_274_621_440


def test_adampm_stores_ceil_n_over_8_per_row():
  params = {'w': S((5461, 2048), F32), 'v': S((2048, 5461), F32), 'b': S((5461,), F32)}
  state = jax.eval_shape(sj.adampm(1e-3).init, params)[0]
  assert state.nu['w'].shape == (5461, 256)
  assert state.nu['v'].shape == (2048, 683)
  assert state.nu['b'].shape == (683,)
  m_and_v = sj.state_bytes(state)
  assert m_and_v == 4 * (5461 * 2048 * 2 + 5461 + 5461 * 256 + 2048 * 683 + 683)


def test_per_tier_attribution_of_any_optimizer():
  params = {'moe': {'router': S((8, 4), F32), 'experts': {'w1': S((4, 8, 16), F32)}},
            'embed': S((32, 8), F32)}
  report = sj.memory_report(optax.adamw(1e-3), params)
  by_tier = {t.tier: t.state_bytes for t in report.tiers}
  assert by_tier == {'router': 2 * 4 * 32, 'experts': 2 * 4 * 512, 'backbone': 2 * 4 * 256}
  text = report.format('adamw')
  assert '| experts |' in text and '**total**' in text


def test_state_bytes_set_step_counters_apart():
  state = sj.skewadam(1e-3).init({'w': jnp.zeros((3, 4))})
  assert sj.state_bytes(state) == 4 * (12 + 3 + 4)
  # One int32 step count for every tier (a partition of tiers kept one per tier).
  assert sj.state_bytes(state, counters=True) == 4 * (12 + 3 + 4) + 4
  assert _memory.tree_bytes(state, floating_only=False) == 4 * (12 + 3 + 4) + 4


def test_python_float_leaves_count_as_0d_float32_arrays():
  """State bytes, the memory report and the label table take a Python float leaf as a
  0-d float32 array (as optax does): 4 bytes of parameter, its state like jnp.asarray's."""
  w = jnp.ones((4, 4))
  scalar, array = {'w': w, 's': 1.0}, {'w': w, 's': jnp.asarray(1.0)}
  for tx in (sj.skewadam(1e-3), sj.adampm(1e-3), optax.adamw(1e-3)):
    assert sj.optimizer_state_bytes(tx, scalar) == sj.optimizer_state_bytes(tx, array)
    report, ref = sj.memory_report(tx, scalar), sj.memory_report(tx, array)
    assert report == ref and report.total_params == 17 and report.total_param_bytes == 68
  rows = sj.label_table(sj.skewadam(1e-3), scalar)
  assert [(r.path, r.shape, r.dtype, r.param_bytes) for r in rows] == [
      ('s', (), 'float32', 4), ('w', (4, 4), 'float32', 64)]
  assert rows == sj.label_table(sj.skewadam(1e-3), array)
  assert _memory.leaf_bytes(1.0) == 4 and _memory.leaf_bytes('text') == 0


def test_policy_state_figures_of_docs_update_rules_on_the_published_moe():
  # docs/update-rules.md's figures, each an exact count of the state's bytes.
  params = paper_params()

  def total(tiers):
    return sj.memory_report(sj.skewadam(3e-4, tiers=tiers), params).total_state_bytes

  # One copy of the router kernel more than the published tiers (+0.15%).
  assert total(sj.ADAM_EPS_TIERS) == total(sj.ADAM_ROUTER_TIERS) == 1_382_897_152
  assert 1_382_897_152 - 1_380_800_000 == 4 * D * E
  # MUON_TIERS with the published factored expert tier instead.
  factored_experts = dict(sj.MUON_TIERS, experts=sj.PUBLISHED_TIERS['experts'])
  assert total(factored_experts) == 1_382_585_856
  coded = sj.MUON_CODED_TIERS
  # The same policy with fp32 momentum: 50.0% of AdamW's.
  assert total({k: t.replace(mu_codec=None) for k, t in coded.items()}) == 27_139_806_720
  # The first MUON_CODED_TIERS: 4-bit expert codes in blocks of 64, 8-bit hidden codes,
  # fp32 backbone momentum: 8.5% of AdamW's.
  first = {**coded, 'backbone': coded['backbone'].replace(mu_codec=None),
           'hidden': coded['hidden'].replace(
               mu_codec=sj.Blockwise(8, 256, 'linear', fit='nearest')),
           'experts': coded['experts'].replace(
               mu_codec=sj.Blockwise(4, 64, 'linear', fit='nearest', rounding='stochastic'))}
  assert total(first) == 4_593_325_568
  assert round(100 * 4_593_325_568 / 54_274_621_440, 1) == 8.5
  assert round(100 * 27_139_806_720 / 54_274_621_440, 1) == 50.0
