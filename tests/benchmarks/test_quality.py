"""The resumable optimizer sweep (`benchmarks/quality.py`): plan, resume, report."""

from __future__ import annotations

import json
from pathlib import Path
import sys

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / 'benchmarks'):
  if str(p) not in sys.path:
    sys.path.insert(0, str(p))

import quality  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402

PNG = b'\x89PNG\r\n\x1a\n'


def test_plan_is_seed_major_and_muon_has_its_own_grid():
  args = quality.parse_args(['--optimizers', 'adamw', 'muon', '--lrs', '1e-3', '3e-3',
                             '--muon-lrs', '0.02', '--seeds', '0', '1', '--steps', '50'])
  assert [r.name for r in quality.plan(args)] == [
      'adamw_lr0.001_seed0_steps50', 'muon_lr0.02_seed0_steps50',
      'adamw_lr0.003_seed0_steps50',
      'adamw_lr0.001_seed1_steps50', 'muon_lr0.02_seed1_steps50',
      'adamw_lr0.003_seed1_steps50']
  muon = quality.train_config(args, quality.Run('muon', 0.02, 1, 50))
  adamw = quality.train_config(args, quality.Run('adamw', 1e-3, 1, 50))
  assert (muon.muon_adam_lr, adamw.muon_adam_lr) == (quality.MUON_ADAM_LR, None)
  # Same schedule, evaluation and batches for every optimizer of a seed.
  assert (muon.warmup, muon.seed, muon.batch_size) == (adamw.warmup, 1, adamw.batch_size) == (
      5, 1, 16)


def test_default_sweep_covers_the_requested_optimizers():
  args = quality.parse_args([])
  assert args.optimizers == ['adamw', 'adafactor', 'adafactor-momentum', 'muon', 'adampm',
                             'skewadam', 'skewadam-adam-eps',
                             'skewadam-adam-eps-router-momentum',
                             'skewadam-router-adam-eps-momentum', 'skewadam-muon',
                             'skewadam-muon-orthogonal-experts']
  assert (args.lrs, args.steps) == ([3e-4, 1e-3, 3e-3], 2000)


def test_run_status_reruns_partial_files_and_refuses_other_settings(tmp_path):
  args = quality.parse_args(['--preset', 'tiny', '--steps', '4'])
  tc = quality.train_config(args, quality.Run('adamw', 1e-3, 0, 4))
  path = tmp_path / 'run.json'
  assert quality.run_status(path, tc)[0] == 'missing'
  path.write_text('{"config": {')  # a write cut short
  assert quality.run_status(path, tc)[0] == 'partial'
  config = quality._comparable(tc)
  path.write_text(json.dumps({'config': config}))
  assert quality.run_status(path, tc)[0] == 'partial'
  path.write_text(json.dumps({'config': config, 'complete': True}))
  assert quality.run_status(path, tc) == ('done', '')
  path.write_text(json.dumps({'config': dict(config, eval_every=7), 'complete': True}))
  status, why = quality.run_status(path, tc)
  assert status == 'mismatch' and 'eval_every' in why


TINY = ['--preset', 'tiny', '--steps', '4', '--lrs', '1e-3', '--seeds', '0',
        '--optimizers', 'adamw', 'skewadam', '--batch-size', '4', '--eval-every', '2',
        '--eval-batches', '1']


@pytest.mark.slow
def test_sweep_writes_one_json_per_run_skips_them_next_time_and_reports(tmp_path, capsys):
  argv = TINY + ['--out', str(tmp_path)]
  quality.main(argv)
  runs = sorted((tmp_path / 'runs').glob('*.json'))
  assert [p.name for p in runs] == ['adamw_lr0.001_seed0_steps4.json',
                                    'skewadam_lr0.001_seed0_steps4.json']
  record = json.loads(runs[0].read_text())
  assert record['complete'] is True
  assert record['sweep'] == {'optimizer': 'adamw', 'lr': 1e-3, 'seed': 0, 'steps': 4}
  assert 'load_entropy_ratio' in record['router'] and 'router_norm' in record['evals'][0]
  mtimes = [p.stat().st_mtime_ns for p in runs]
  capsys.readouterr()

  text = quality.main(argv)  # the second invocation trains nothing
  assert '2 runs planned: 2 complete (skipped), 0 to run' in capsys.readouterr().out
  assert [p.stat().st_mtime_ns for p in runs] == mtimes
  assert '| adamw | 0.001 |' in text and '| skewadam | 0.001 |' in text
  assert '### Dead experts over training' in text and '| step 4 |' in text
  for name in ('curves_steps4.png', 'memory_steps4.png', 'router_steps4.png',
               'dead_steps4.png'):
    assert (tmp_path / name).read_bytes()[:8] == PNG, name
  summary = json.loads((tmp_path / 'report_steps4.json').read_text())
  assert [r['optimizer'] for r in summary['rows']] == ['adamw', 'skewadam']

  with pytest.raises(SystemExit, match='other settings'):
    quality.main(TINY + ['--out', str(tmp_path), '--eval-every', '4'])


def _fake_record(optimizer: str, lr: float, seed: int, loss: float, steps: int = 100,
                 n_experts: int = 4) -> dict:
  """A complete run JSON as `quality.sweep` writes it, with made-up numbers."""
  frac = np.full((1, n_experts), 1 / n_experts)
  health = {k: v.tolist() for k, v in model_lib.load_health(frac).items()}
  router = dict(health, n_experts=n_experts, token_frac=frac.tolist(), top1_prob=[0.3],
                router_norm=[1.0 + seed], aux=0.05, aux_floor=0.05, aux_over_floor=1.0)
  evals = [dict(router, step=s, loss=loss + 1.0 - s / steps) for s in (50, 100)]
  return {
      'complete': True,
      'sweep': {'optimizer': optimizer, 'lr': lr, 'seed': seed, 'steps': steps},
      'config': {'preset': 'tiny', 'steps': steps, 'warmup': 10, 'weight_decay': 0.1,
                 'eval_every': 50, 'eval_batches': 2},
      'optimizer': {'optimizer': optimizer, 'lr': lr},
      'final': {'loss': loss}, 'evals': evals, 'router': router,
      'memory': {'total_state_bytes': {'adamw': 1000, 'skewadam': 100,
                                         'adampm': 500}[optimizer]},
      'timing': {'wall_s': 10.0, 'tokens_per_s': 5000.0 + seed, 'tokens_per_step': 256},
      'machine': {'cpu_count': 2, 'platform': 'test', 'jax': '0', 'optax': '0', 'flax': '0'},
      'data': 'fake',
  }


def test_report_picks_the_best_lr_by_the_mean_over_seeds(tmp_path):
  losses = {('adamw', 1e-3): (2.0, 2.2), ('adamw', 3e-3): (2.05, 2.07),
            ('skewadam', 1e-3): (1.9, 1.95), ('skewadam', 3e-3): (2.5, 2.6),
            ('adampm', 1e-3): (2.1, 2.2)}
  for (name, lr), pair in losses.items():
    for seed, loss in enumerate(pair):
      r = _fake_record(name, lr, seed, loss)
      path = tmp_path / 'runs' / f'{quality.Run(**r["sweep"]).name}.json'
      path.parent.mkdir(exist_ok=True)
      path.write_text(json.dumps(r))
  # An unfinished run is not reported.
  (tmp_path / 'runs' / 'adamw_lr0.01_seed0_steps100.json').write_text(
      json.dumps(dict(_fake_record('adamw', 1e-2, 0, 0.5), complete=False)))
  text = quality.main(['--report-only', '--preset', 'tiny', '--steps', '100',
                       '--out', str(tmp_path)])
  rows = {r['optimizer']: r for r in json.loads(
      (tmp_path / 'report_steps100.json').read_text())['rows']}
  # AdamW: 3e-3 has the lower mean (2.06 < 2.1) although 1e-3 has the lowest single run.
  assert rows['adamw']['best_lr'] == 3e-3 and rows['adamw']['best_at_edge']
  assert rows['adamw']['loss_mean'] == pytest.approx(2.06)
  assert rows['adamw']['loss_std'] == pytest.approx(np.std([2.05, 2.07], ddof=1))
  assert rows['skewadam']['best_lr'] == 1e-3
  assert rows['skewadam']['gap_vs_baseline'] == pytest.approx(1.925 - 2.06)
  assert rows['skewadam']['router']['router_norm'] == [1.5]  # mean over the seeds
  assert rows['skewadam']['router']['dead_experts'] == [0.0]
  assert set(rows['adamw']['per_lr']) == {'0.001', '0.003'}
  # At AdamW's best lr (3e-3) SkewAdam's mean is 2.55: the same-hyperparameter table.
  assert rows['skewadam']['at_baseline_lr']['gap'] == pytest.approx(2.55 - 2.06)
  assert "### At adamw's best lr (0.003)" in text and '+0.4900 (+23.79%)' in text
  # Paired by seed: (1.9 - 2.05) and (1.95 - 2.07), in % of AdamW's mean 2.06.
  gaps = 100 * np.array([1.9 - 2.05, 1.95 - 2.07]) / 2.06
  pg = rows['skewadam']['paired_gap']
  assert pg['pct'] == pytest.approx(gaps) and pg['seeds'] == [0, 1]
  assert pg['se_pct'] == pytest.approx(np.std(gaps, ddof=1) / np.sqrt(2))
  assert rows['adamw']['paired_gap'] is None
  assert ('| skewadam | 0.001 | 1.9250 ± 0.0354 (2) | -0.1350 (-6.55%) | '
          f'{gaps.mean():+.2f}% ± {pg["se_pct"]:.2f}% (2) | 100 |') in text
  assert 'yes: extend the grid' in text
  # One lr is no sweep: its best is not called "not at the edge".
  assert not rows['adampm']['best_at_edge']
  assert '| adampm | **0.001: 2.1500 ± 0.0707 (2)** | one lr only: not swept |' in text
  assert (tmp_path / 'memory_steps100.png').read_bytes()[:8] == PNG


def test_archived_runs_report_as_their_jsons_and_are_not_rerun(tmp_path):
  """`--archive` packs the run JSONs into one `runs.json.gz` (history thinned) and
  deletes them: the report is the same, and the sweep counts archived runs as done."""
  args = quality.parse_args(['--preset', 'tiny', '--steps', '100'])
  for i, (name, lr, seed, loss) in enumerate([('adamw', 1e-3, 0, 2.0), ('adamw', 3e-3, 0, 2.1),
                                              ('skewadam', 1e-3, 0, 1.9)]):
    r = _fake_record(name, lr, seed, loss)
    r['config'] = quality._comparable(quality.train_config(args, quality.Run(name, lr, seed,
                                                                             100)))
    r['history'] = {'step': list(range(100)), 'loss': [float(i + s) for s in range(100)]}
    path = tmp_path / 'runs' / f'{quality.Run(**r["sweep"]).name}.json'
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(r))
  partial = tmp_path / 'runs' / 'adamw_lr0.01_seed0_steps100.json'
  partial.write_text('{"config": {')
  argv = ['--preset', 'tiny', '--steps', '100', '--out', str(tmp_path)]
  before = quality.main(argv + ['--report-only'])
  rows = (tmp_path / 'report_steps100.json').read_text()

  after = quality.main(argv + ['--archive'])
  assert sorted(p.name for p in (tmp_path / 'runs').iterdir()) == [partial.name]
  assert json.loads((tmp_path / 'report_steps100.json').read_text())['rows'] == \
      json.loads(rows)['rows']
  assert after.split('\n')[3:] == before.split('\n')[3:]  # all but the "runs under" line
  archived = quality.read_archive(tmp_path / 'runs')
  history = archived['adamw_lr0.001_seed0_steps100']['history']
  assert history['step'] == list(range(0, 100, quality.HISTORY_EVERY)) + [99]
  for name in archived:
    tc = quality.train_config(args, quality.Run(**archived[name]['sweep']))
    assert quality.run_status(tmp_path / 'runs' / f'{name}.json', tc, archived) == ('done', '')
  # A JSON written after the archive wins over the archived run of its name.
  r = dict(archived['skewadam_lr0.001_seed0_steps100'], final={'loss': 1.5})
  (tmp_path / 'runs' / 'skewadam_lr0.001_seed0_steps100.json').write_text(json.dumps(r))
  losses = {x['sweep']['optimizer']: x['final']['loss']
            for x in quality.load_runs(tmp_path / 'runs', 'tiny', 100) if x['sweep']['lr'] == 1e-3}
  assert losses == {'adamw': 2.0, 'skewadam': 1.5}


def test_best_lr_is_picked_on_the_seeds_every_lr_has_run():
  # Seed 0 ran at both lrs and prefers 3e-3; seeds 1 and 2 ran at 1e-3 only. The 3-seed
  # mean at 1e-3 (1.90) is below 3e-3's single run (1.97), but the choice is made on
  # seed 0 (2.00 against 1.97), as the protocol made it.
  per_lr = {1e-3: {'mean': 1.9, 'losses': [2.0, 1.85, 1.85], 'seeds': [0, 1, 2]},
            3e-3: {'mean': 1.97, 'losses': [1.97], 'seeds': [0]}}
  assert quality._pick_best_lr(per_lr) == 3e-3
  # Without a seed in common the means decide.
  per_lr[3e-3]['seeds'] = [5]
  assert quality._pick_best_lr(per_lr) == 1e-3


def test_lrs_rerun_with_three_seeds_decide_on_the_seeds_they_share():
  # Seed 0 nominates 3e-3 (1.48 against 1.49), but with seeds 0-2 at both lrs 1.7e-3 is
  # lower (1.475 against 1.4865 on the shared seeds; 3e-3's seeds 3-4 do not count).
  per_lr = {1.7e-3: {'mean': 1.475, 'losses': [1.49, 1.47, 1.465], 'seeds': [0, 1, 2]},
            3e-3: {'mean': 1.4933, 'losses': [1.48, 1.498, 1.482, 1.503, 1.504],
                   'seeds': [0, 1, 2, 3, 4]},
            # Two seeds, one of them excellent: too few to compete.
            1e-2: {'mean': 1.475, 'losses': [1.55, 1.40], 'seeds': [0, 1]},
            1e-3: {'mean': 1.52, 'losses': [1.52], 'seeds': [0]}}
  assert quality.BEST_LR_SEEDS == 3
  assert quality._pick_best_lr(per_lr) == 1.7e-3
  # A nominee with a single seed stays the pick until it is rerun.
  per_lr[1e-3] = {'mean': 1.40, 'losses': [1.40], 'seeds': [0]}
  assert quality._pick_best_lr(per_lr) == 1e-3


def test_refined_lr_splits_the_best_and_its_better_neighbour_once():
  def grid(**losses):
    return {float(k[2:].replace('_', '.')): {'mean': v, 'losses': [v], 'seeds': [0]}
            for k, v in losses.items()}

  # Best 3e-3; 1e-3 beats 1e-2: halfway between 1e-3 and 3e-3.
  per_lr = grid(lr0_001=1.52, lr0_003=1.48, lr0_01=1.59)
  assert quality.refined_lr(per_lr) == 0.0017
  # The better neighbour above: between 3e-3 and 1e-2.
  per_lr = grid(lr0_001=1.59, lr0_003=1.51, lr0_01=1.58)
  assert quality.refined_lr(per_lr) == 0.0055
  # Muon's factor-2 grid is split too.
  assert quality.refined_lr(grid(lr0_01=1.2393, lr0_02=1.2392, lr0_04=1.43)) == 0.014
  # Once refined, nothing more: 1.7e-3 is best, its neighbours are under 1.9x away.
  per_lr = grid(lr0_001=1.52, lr0_0017=1.47, lr0_003=1.48, lr0_01=1.59)
  assert quality.refined_lr(per_lr) is None
  # A single lr has no neighbour.
  assert quality.refined_lr(grid(lr0_001=1.5)) is None


def test_refine_plans_one_run_per_optimizer_at_the_first_seed(tmp_path):
  for (name, lr), loss in {('adamw', 1e-3): 2.2, ('adamw', 3e-3): 2.0,
                           ('adamw', 1e-2): 2.4, ('skewadam', 1e-3): 1.9,
                           ('skewadam', 3e-3): 2.5}.items():
    r = _fake_record(name, lr, 0, loss)
    path = tmp_path / f'{quality.Run(**r["sweep"]).name}.json'
    path.write_text(json.dumps(r))
  args = quality.parse_args(['--refine', '--seeds', '3', '1', '--steps', '100',
                             '--preset', 'tiny', '--optimizers', 'skewadam', 'adamw', 'muon'])
  runs = quality.refinement_plan(args, quality.load_runs(tmp_path, 'tiny', 100))
  assert runs == [quality.Run('skewadam', 0.0017, 3, 100), quality.Run('adamw', 0.0017, 3, 100)]


def test_pareto_front_keeps_only_rows_no_smaller_state_beats():
  def row(name, state, loss):
    return {'optimizer': name, 'state_bytes': state, 'loss_mean': loss}

  rows = [row('adamw', 100, 1.47), row('adafactor', 2, 1.46), row('skewadam', 6, 1.46),
          row('tie', 6, 1.46), row('worse-small', 1, 1.60), row('muon', 50, 1.24),
          row('muon-tier', 7, 1.23), row('same-bytes-better', 6, 1.40)]
  front = [r['optimizer'] for r in quality.pareto_front(rows)]
  # By increasing bytes; each step strictly lowers the loss. 'skewadam' and 'tie' lose to
  # 'same-bytes-better' (same bytes, lower loss), 'adamw' to everything cheaper, 'muon'
  # to the cheaper 'muon-tier'.
  assert front == ['worse-small', 'adafactor', 'same-bytes-better', 'muon-tier']
  assert quality.pareto_front([]) == []
  # Equal bytes and loss: the first in row order stays, once.
  assert [r['optimizer'] for r in quality.pareto_front(
      [row('a', 5, 1.0), row('b', 5, 1.0)])] == ['a']


def test_report_marks_the_pareto_front_and_lists_quality_per_byte():
  rows = [{'optimizer': name, 'state_bytes': b, 'loss_mean': loss, 'loss_std': None,
           'n_seeds': 1, 'paired_gap': None, 'on_pareto_front': f}
          for name, b, loss, f in [('adamw', 100, 1.5, False), ('skewadam-muon', 7, 1.3, True)]]
  lines = quality.quality_per_byte_markdown(rows, rows[0], 2000)
  text = '\n'.join(lines)
  assert '### Quality per byte' in text and 'memory_steps2000.png' in text
  # Sorted by bytes: the Muon tier (7 B, 7.0% of AdamW's) first, on the front.
  table = [ln for ln in text.splitlines()
           if ln.startswith('| skewadam-muon') or ln.startswith('| adamw')]
  assert table[0].startswith('| skewadam-muon | 7 | 7.0% | 1.3000 (1) |')
  assert table[0].rstrip().endswith('| yes |') and not table[1].rstrip().endswith('yes |')

