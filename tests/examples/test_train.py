"""Tests of the MoE example's training script (`examples/moe_lm/train.py`) and optimizers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import skewadam_jax as sj  # noqa: E402

from examples.moe_lm import model as model_lib  # noqa: E402
from examples.moe_lm import optimizers as opt_lib  # noqa: E402
from examples.moe_lm import train as train_lib  # noqa: E402

# Example runs: the slow tier (`pytest -m slow`).
pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory):
  out = tmp_path_factory.mktemp('run')
  result = train_lib.main([
      '--optimizer', 'skewadam', '--preset', 'tiny', '--steps', '30', '--batch-size', '8',
      '--lr', '3e-3', '--warmup', '3', '--eval-every', '15', '--eval-batches', '2',
      '--out', str(out)])
  return result, out


def test_short_run_lowers_the_loss(tiny_run):
  result, _ = tiny_run
  ce = result['history']['ce']
  assert len(ce) == 30
  # Starts near uniform over 256 bytes, ends at least 1 nat/byte lower.
  assert abs(ce[0] - math.log(256)) < 0.1
  assert np.mean(ce[-5:]) < ce[0] - 1.0
  evals = result['evals']
  assert [e['step'] for e in evals] == [15, 30]
  assert evals[-1]['loss'] < evals[0]['loss'] < math.log(256) - 0.5
  assert result['final']['bpb'] == pytest.approx(evals[-1]['loss'] / math.log(2))
  assert result['final']['ppl'] == pytest.approx(math.exp(evals[-1]['loss']))


def test_router_stats_are_fractions_with_the_switch_floor(tiny_run):
  result, _ = tiny_run
  cfg = model_lib.get_config('tiny')
  frac = np.asarray(result['router']['token_frac'])
  assert frac.shape == (cfg.n_moe_blocks, cfg.n_experts)
  np.testing.assert_allclose(frac.sum(-1), 1.0, atol=1e-3)
  assert result['router']['aux_floor'] == pytest.approx(cfg.aux_loss_coef * cfg.n_moe_blocks)
  # The Switch loss never goes below its floor by more than rounding.
  assert result['router']['aux_over_floor'] > 0.99


def test_json_has_router_health_per_layer_at_every_eval(tiny_run):
  _, out = tiny_run
  saved = json.loads((out / 'skewadam.json').read_text())
  cfg = model_lib.get_config('tiny')
  layers = cfg.n_moe_blocks
  for record in [saved['router'], *saved['evals']]:
    for key in train_lib.ROUTER_HEALTH:
      assert len(record[key]) == layers, key
    assert record['n_experts'] == cfg.n_experts
    frac = np.asarray(record['token_frac'])
    # The health figures are those of the recorded assignment shares.
    health = model_lib.load_health(frac)
    for key, value in health.items():
      np.testing.assert_allclose(record[key], value, rtol=1e-6, err_msg=key)
    assert all(1 / cfg.n_experts - 1e-6 <= p <= 1 for p in record['top1_prob'])
    assert all(n >= 0 for n in record['router_norm'])
  # The router starts at zero and moves: its norm is recorded at every eval.
  assert [e['step'] for e in saved['evals']] == [15, 30]
  assert saved['evals'][-1]['router_norm'][0] > 0
  # Training drops (evaluation is dropless); `tiny` has no capacity limit.
  assert saved['history']['drop_frac'] == [0.0] * 30
  assert saved['evals'][-1]['train_drop_frac'] == 0.0


def test_report_labels_the_aux_loss_and_has_no_eval_drop_line(tiny_run):
  _, out = tiny_run
  md = (out / 'skewadam.md').read_text()
  assert 'Switch aux loss / floor (1 = uniform probabilities; blind to collapse)' in md
  assert 'dead experts' in md and 'load entropy / log E' in md
  assert 'Dropped assignments: none by construction' in md
  assert (out / 'skewadam-router.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_run_writes_table_png_and_json(tiny_run):
  result, out = tiny_run
  saved = json.loads((out / 'skewadam.json').read_text())
  assert saved['final'] == pytest.approx(result['final'])
  assert (out / 'skewadam.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  md = (out / 'skewadam.md').read_text()
  for tier in ('backbone', 'experts', 'router'):
    assert f'| {tier} |' in md


def test_expert_state_is_factored_statistics_only(tiny_run):
  # SkewAdam's experts keep only row + column statistics (fp32) per expert matrix.
  result, _ = tiny_run
  params = model_lib.abstract_params(model_lib.get_config('tiny'))
  expected = sum(4 * int(np.prod(x.shape[:-2])) * (x.shape[-2] + x.shape[-1])
                 for path, x in model_lib._param_leaves(params) if '/experts/' in path)
  tiers = {t['tier']: t['state_bytes'] for t in result['memory']['tiers']}
  assert tiers['experts'] == expected
  assert tiers['router'] == 4 * model_lib.param_counts(params)['router']


@pytest.fixture(scope='module')
def tiny_model():
  cfg = model_lib.get_config('tiny')
  graphdef, params, rest = train_lib.init_model(cfg, 0)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, cfg.max_len + 1)),
                      jnp.int32)

  @jax.jit
  def loss_and_grad(p):
    def loss(p):
      return model_lib.loss_fn(nnx.merge(graphdef, p, rest), batch, False)[0]
    return jax.value_and_grad(loss)(p)

  return params, loss_and_grad


@pytest.mark.parametrize('name', opt_lib.OPTIMIZERS)
def test_every_optimizer_takes_a_descent_step(tiny_model, name):
  params, loss_and_grad = tiny_model
  tx, info = opt_lib.make_optimizer(name, total_steps=10, warmup_steps=0)
  assert info['lr'] == opt_lib.default_lr(name)
  state = tx.init(params)
  loss0, grads = loss_and_grad(params)
  updates, state = tx.update(grads, state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
  new = optax.apply_updates(params, updates)
  loss1, _ = loss_and_grad(new)
  assert float(loss1) < float(loss0)


def test_ablations_change_exactly_their_tiers():
  pub = opt_lib.skewadam_tiers('skewadam')
  mom = opt_lib.skewadam_tiers('skewadam-expert-momentum')
  assert mom['experts'].momentum and mom['backbone'] == pub['backbone']
  assert mom['router'] == pub['router']
  fac = opt_lib.skewadam_tiers('skewadam-factored-all')
  assert all(t.momentum and t.second_moment == 'factored' for t in fac.values())
  assert not fac['router'].apply_weight_decay
  eps = opt_lib.skewadam_tiers('skewadam-adam-eps')
  assert {k: t.replace(eps_mode='floor') for k, t in eps.items()} == pub
  assert all(t.eps_mode == 'adam' for t in eps.values())
  rec = opt_lib.skewadam_tiers('skewadam-adam-eps-router-momentum')
  assert rec == dict(sj.ADAM_EPS_TIERS)
  assert rec == dict(eps, router=eps['router'].replace(momentum=True))
  bf16 = opt_lib.skewadam_tiers('skewadam-adam-eps-router-momentum-expert-momentum-bf16')
  assert bf16['experts'] == rec['experts'].replace(momentum=True, mu_dtype=jnp.bfloat16)
  exact = opt_lib.skewadam_tiers('skewadam-adam-eps-router-momentum-exact-backbone')
  assert exact == dict(rec, backbone=rec['backbone'].replace(second_moment='exact'))
  floor = opt_lib.skewadam_tiers('skewadam-floor-backbone-router-momentum')
  assert floor == dict(rec, backbone=pub['backbone'])
  fast = opt_lib.skewadam_tiers('skewadam-router-adam-eps-momentum')
  assert fast == dict(pub, router=pub['router'].replace(eps_mode='adam', momentum=True))
  add = opt_lib.skewadam_tiers('skewadam-router-adam-eps')
  assert add == dict(pub, router=pub['router'].replace(eps_mode='adam'))


def test_adampm_input_axis_pools_along_the_second_to_last_axis(tiny_model):
  params, _ = tiny_model
  shapes = {}
  for name in ('adampm', 'adampm-input-axis'):
    tx, info = opt_lib.make_optimizer(name, total_steps=10, warmup_steps=0)
    assert info['axis'] == (-2 if name == 'adampm-input-axis' else -1)
    state = jax.eval_shape(tx.init, params)
    shapes[name] = [x.shape for x in jax.tree.leaves(state) if getattr(x, 'ndim', 0) >= 2]
  kernels = [p.shape for p in jax.tree.leaves(params) if p.ndim == 2]
  rows, cols = kernels[0]
  assert (-(-rows // 8), cols) in shapes['adampm-input-axis']
  assert (rows, -(-cols // 8)) in shapes['adampm']
  assert (-(-rows // 8), cols) not in shapes['adampm'] or rows == cols


def test_muon_orthogonalises_matrices_and_experts_only():
  params = model_lib.abstract_params(model_lib.get_config('tiny'))
  dims = opt_lib.muon_dimension_numbers(params)
  leaves = dict(model_lib._param_leaves(params))
  chosen = {path: d for (path, _), d in zip(
      model_lib._param_leaves(params),
      jax.tree.leaves(dims, is_leaf=lambda x: x is None or isinstance(
          x, optax.contrib.MuonDimensionNumbers)))}
  assert set(chosen) == set(leaves)
  for path, d in chosen.items():
    if '/experts/' in path:
      assert d == optax.contrib.MuonDimensionNumbers(1, 2)
    elif 'embed' in path or 'router' in path or leaves[path].ndim < 2:
      assert d is None, path
    else:
      assert d == optax.contrib.MuonDimensionNumbers(), path


def test_zero_steps_evaluates_the_initial_model(tmp_path, capsys):
  result = train_lib.main(['--optimizer', 'skewadam', '--preset', 'tiny', '--steps', '0',
                           '--batch-size', '4', '--eval-batches', '1', '--out', str(tmp_path)])
  assert result['history']['ce'] == []
  assert [e['step'] for e in result['evals']] == [0]
  # The untrained model is near uniform over 256 bytes.
  assert result['final']['loss'] == pytest.approx(math.log(256), abs=0.1)
  assert result['best'] == result['final']['loss']
  assert result['timing']['tokens_per_s'] is None
  saved = json.loads((tmp_path / 'skewadam.json').read_text())  # strict JSON: no NaN
  assert saved['final'] == pytest.approx(result['final'])
  row = f'| skewadam | {opt_lib.default_lr("skewadam"):g} | {result["final"]["loss"]:.4f} |'
  assert row in capsys.readouterr().out
  assert 'nan' not in train_lib.report(result).lower()


def _fake_run(steps: int = 200) -> dict:
  """A run record as `train` returns it, with a train curve falling from ln 256."""
  ce = list(1.5 + (math.log(256) - 1.5) * np.exp(-np.arange(steps) / 20.0))
  return {
      'optimizer': {'optimizer': 'skewadam', 'lr': 3e-4},
      'history': {'step': list(range(steps)), 'loss': ce, 'ce': ce},
      'evals': [{'step': 100, 'loss': 1.62}, {'step': 200, 'loss': 1.55}],
  }


def test_plot_shows_the_whole_train_curve_and_says_val_has_no_router_noise(
    tmp_path, monkeypatch):
  import matplotlib.figure
  figures = []
  savefig = matplotlib.figure.Figure.savefig

  def keep(fig, *args, **kwargs):
    figures.append(fig)
    return savefig(fig, *args, **kwargs)

  monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', keep)
  run = _fake_run()
  train_lib.plot_losses([run], tmp_path / 'loss.png')
  assert (tmp_path / 'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  (ax,) = figures[0].axes
  lo, hi = ax.get_ylim()
  ce = run['history']['ce']
  assert lo <= min(ce) and hi >= max(ce)
  train_line = next(line for line in ax.get_lines() if 'train' in line.get_label())
  x, y = train_line.get_data()
  assert x[0] == 1 and y[0] == pytest.approx(ce[0], rel=1e-6)  # the first step is drawn
  texts = [t.get_text() for t in ax.get_legend().get_texts()] + [ax.get_title()]
  assert any('no router noise' in t for t in texts)


# ----------------------------------------------------------------- several optimizers


def test_default_trains_the_recommended_policy_and_the_baseline_at_their_lrs():
  configs = train_lib.parse_args([])
  assert [c.optimizer for c in configs] == [opt_lib.RECOMMENDED, opt_lib.BASELINE]
  assert opt_lib.RECOMMENDED in opt_lib.OPTIMIZERS and opt_lib.BASELINE == 'adamw'
  assert all(c.lr is None for c in configs)  # each at its default_lr
  # The runs differ in their optimizer only.
  assert dataclasses.replace(configs[1], optimizer=configs[0].optimizer) == configs[0]
  assert train_lib.TrainConfig().optimizer == opt_lib.RECOMMENDED


def test_one_optimizer_and_the_optimizer_list_parse():
  (one,) = train_lib.parse_args(['--optimizer', 'adamw', '--lr', '1e-3'])
  assert (one.optimizer, one.lr) == ('adamw', 1e-3)
  names = ['skewadam', 'skewadam-muon', 'adamw']
  assert [c.optimizer for c in train_lib.parse_args(['--optimizers', *names])] == names
  for bad in (['--optimizer', 'adamw', '--optimizers', 'adamw', 'skewadam'],
              ['--optimizers', 'adamw', 'adamw'], ['--optimizers', 'nope'],
              ['--optimizers']):
    with pytest.raises(SystemExit):
      train_lib.parse_args(bad)


def test_several_optimizers_checkpoint_to_one_subdirectory_each(tmp_path):
  configs = train_lib.parse_args(['--ckpt-dir', str(tmp_path)])
  assert [c.ckpt_dir for c in configs] == [str(tmp_path / c.optimizer) for c in configs]
  (one,) = train_lib.parse_args(['--optimizer', 'skewadam', '--ckpt-dir', str(tmp_path)])
  assert one.ckpt_dir == str(tmp_path)  # one optimizer: the directory itself, as before


@pytest.fixture(scope='module')
def pair_run(tmp_path_factory):
  """The default pair on `tiny`, 4 steps, checkpointed; stdout kept."""
  out, ckpt = tmp_path_factory.mktemp('pair'), tmp_path_factory.mktemp('pair_ckpt')
  argv = ['--preset', 'tiny', '--steps', '4', '--batch-size', '4', '--warmup', '1',
          '--eval-every', '2', '--eval-batches', '1', '--out', str(out), '--ckpt-dir',
          str(ckpt), '--ckpt-every', '2', '--sync-ckpt']
  return argv, out, ckpt


def test_two_optimizers_from_one_init_end_with_one_table_and_one_plot(pair_run, capsys,
                                                                      monkeypatch):
  argv, out, ckpt = pair_run
  plotted = []
  plot = train_lib.plot_losses
  monkeypatch.setattr(train_lib, 'plot_losses',
                      lambda rs, *a, **k: (plotted.append([r['label'] for r in rs]),
                                           plot(rs, *a, **k))[1])
  results = train_lib.main(argv)
  names = [opt_lib.RECOMMENDED, opt_lib.BASELINE]
  assert list(results) == names
  runs = [results[n] for n in names]
  # The same initial weights and first batch: the same loss before any update.
  assert runs[0]['history']['ce'][0] == pytest.approx(runs[1]['history']['ce'][0], rel=1e-6)
  assert [r['optimizer']['lr'] for r in runs] == [opt_lib.default_lr(n) for n in names]
  printed = capsys.readouterr().out.rstrip().splitlines()
  # The output ends with the table (then one line under it).
  rows = [line for line in printed[-len(names) - 2:] if line.startswith('| ')]
  assert [row.split(' | ')[0] for row in rows] == [f'| {n}' for n in names]
  header = printed[-len(names) - 4]
  for column in ('final val loss', 'vs adamw', 'state B, backbone', 'state B, experts',
                 'state B, router', 'state B, total', 'dead experts', 'tokens/s'):
    assert column in header, column
  for row, r in zip(rows, runs):
    cells = row.strip('| ').split(' | ')
    assert cells[2] == f'{r["final"]["loss"]:.4f}'
    tiers = train_lib.tier_bytes(r)
    assert cells[4:7] == [f'{tiers[t]:,}' for t in ('backbone', 'experts', 'router')]
    assert cells[7].startswith(f'{r["memory"]["total_state_bytes"]:,} (')
    assert cells[8] == f'{r["router"]["dead_experts"][0]} of {r["router"]["n_experts"]}'
  assert rows[1].split(' | ')[3] == '+0.00%'  # AdamW against itself
  # The plot's legend names each optimizer's state bytes, as the table does.
  assert plotted == [[f'{n} (lr {r["optimizer"]["lr"]:g}, state '
                      f'{r["memory"]["total_state_bytes"]:,} B)' for n, r in zip(names, runs)]]
  stem = f'{names[0]}-vs-{names[1]}'
  assert (out / f'{stem}.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  md = (out / f'{stem}.md').read_text()
  assert train_lib.comparison_table(runs) in md and '### Router health' in md
  assert sorted(p.name for p in out.glob('*.png')) == [f'{stem}.png']  # one plot
  for n in names:
    assert json.loads((out / f'{n}.json').read_text())['final'] == pytest.approx(
        results[n]['final'])
  assert sorted(p.name for p in ckpt.iterdir()) == sorted(names)
  # The same command again resumes both runs at their last checkpoint: nothing retrains.
  again = train_lib.main(argv)
  for n in names:
    assert again[n]['history'] == results[n]['history']
    assert again[n]['final'] == results[n]['final']


def test_comparison_table_without_the_baseline_has_no_gap_column(tiny_run):
  result, _ = tiny_run
  table = train_lib.comparison_table([result])
  assert 'vs adamw' not in table and '(100.0%)' not in table
  assert f'| skewadam | {result["optimizer"]["lr"]:g} | {result["final"]["loss"]:.4f} |' in table


def test_swept_lrs_are_the_sweep_reports_best():
  """The main job's lrs are the quality sweep's verdict, not a second copy of it."""
  report = json.loads((Path(__file__).resolve().parents[2] / 'benchmarks' / 'results'
                       / 'quality_sweep' / 'report_steps2000.json').read_text())
  best = {row['optimizer']: row['best_lr'] for row in report['rows']}
  for name, lr in opt_lib.SWEPT_LR.items():
    assert name in best, f'{name} has no row in the sweep report'
    assert math.isclose(lr, best[name]), (name, lr, best[name])
