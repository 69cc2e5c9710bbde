"""Resumable learning-rate x seed sweep of optimizers on the example MoE LM (stdlib bytes).

All runs of one seed start from the same initial weights and see the same batches in
the same order (and the same router noise), whatever the optimizer; every run gets the
same budget (steps x batch), the same schedule (linear warmup over `--warmup-frac` of
the steps, then cosine to 0), global-norm clip 1.0 and weight decay 0.1 (see
`examples/moe_lm/optimizers.py` for each optimizer's exact settings).

Optimizers (default): AdamW, Adafactor (`optax.adafactor`, no momentum) and Adafactor
with its `momentum=0.9` option, Muon (`optax.contrib.muon`), AdamPM (s = 8), SkewAdam
(published tiers), SkewAdam with Adam's additive eps on every tier
(`skewadam-adam-eps`), `sj.ADAM_EPS_TIERS` (`skewadam-adam-eps-router-momentum`) and
`sj.ADAM_ROUTER_TIERS` (`skewadam-router-adam-eps-momentum`), and the Muon tiers:
`skewadam-muon` (Muon's orthogonalised momentum on the backbone's hidden matrices, the
published tiers elsewhere, an Adam router) and `sj.MUON_TIERS`, the same with each
expert's gradient orthogonalised and no expert state
(`skewadam-muon-orthogonal-experts`); these run on the Adam grid `--lrs` (their update
RMS is matched to Adam's).
Each runs at every `--lrs` and every `--seeds`; Muon runs at every `--muon-lrs` instead
(the lr of its orthogonalised matrices lives on another scale), its Adam branch
(embeddings, norms, router) at `--muon-adam-lr`.

The protocol, the same for every optimizer: the grid at the first seed (extended where
the best is at an edge); one `--refine` step (the geometric midpoint of the best lr and
its better neighbour, first seed); then the best lr again with more seeds.

One JSON per run, `<out>/runs/<optimizer>_lr<lr>_seed<seed>_steps<steps>.json`,
written atomically when the run ends. A run whose JSON exists and is complete is
skipped, so an interrupted sweep resumes where it stopped, whenever it is run
again; a JSON made with other settings (preset, batch, schedule, evaluation) stops the
sweep instead of being mixed in. `--archive` packs the complete run JSONs into one
`<out>/runs.json.gz` and deletes them: every field the report reads is kept, the
per-step training history is thinned to every `HISTORY_EVERY`-th step (a 2000-step run's
JSON is 200 kB, the archive of the 121 committed runs 1.2 MB). The sweep and the report read
an archived run as they read its JSON (a JSON under `runs/` wins over the archived run of
the same name). After the runs (or alone, with `--report-only`) every complete run of
this `--preset` and `--steps` under `--out` is read back into:

* `report_steps<N>.md` and `.json`: per optimizer its best lr (the first seed
  nominates it; lrs with 3 or more seeds compete on the seeds they share), the final
  validation loss at that lr as mean and std over seeds, the gap to AdamW at its own
  best lr (also paired by seed: the same seed means the same init and batches), state
  bytes, tokens/s and router health (per MoE layer, validation without router noise; see
  examples/moe_lm/train.py);
  and the final loss at every lr, flagging a best lr at the edge of the grid; dead
  experts and router norm over training at each best lr, and the dead experts of every
  evaluation binned by the router's weight norm.
* `curves_steps<N>.png`: validation loss against step at each optimizer's best lr
  (mean over seeds, band from min to max), with a zoom on the second half.
* `memory_steps<N>.png`: quality per byte: best-lr validation loss against optimizer
  state bytes (log scale), every optimizer and policy, with the Pareto front (the
  optimizers no other beats with as little state or less); the report's "Quality per
  byte" table lists the same.
* `lr_steps<N>.png`: final validation loss against peak lr of AdamW, Muon and the Muon
  tiers (mean over the seeds of each lr), AdamW's best as a line.
* `router_steps<N>.png`: each expert's load over training at the best lr (first seed),
  one panel per optimizer.
* `dead_steps<N>.png`: dead experts against router weight norm, per layer, for every
  evaluation of every run.

  python benchmarks/quality.py                    # the full sweep (hours; resumable)
  python benchmarks/quality.py --seeds 0          # seed 0 of every (optimizer, lr) first
  python benchmarks/quality.py --refine --seeds 0  # one midpoint lr per optimizer
  python benchmarks/quality.py --report-only      # report what has finished so far
  python benchmarks/quality.py --archive          # pack the runs into runs.json.gz, report
  python benchmarks/quality.py --preset tiny --steps 20 --lrs 1e-3 --seeds 0 \\
      --optimizers adamw skewadam --eval-every 10 --out /tmp/quality   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import _common  # noqa: E402
from examples import _cli  # noqa: E402
from examples.moe_lm import data as data_lib  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402
from examples.moe_lm import optimizers as opt_lib  # noqa: E402
from examples.moe_lm import train as train_lib  # noqa: E402

SWEEP_OPTIMIZERS = ('adamw', 'adafactor', 'adafactor-momentum', 'muon', 'adampm',
                    'skewadam', 'skewadam-adam-eps', 'skewadam-adam-eps-router-momentum',
                    'skewadam-router-adam-eps-momentum', 'skewadam-muon',
                    'skewadam-muon-orthogonal-experts')
LRS = (3e-4, 1e-3, 3e-3)
# Muon's conventional 0.02 in the middle; a factor 2 either side.
MUON_LRS = (0.01, 0.02, 0.04)
# Optimizers whose learning rate is on another scale than Adam's.
OWN_LR_SCALE = ('muon', 'lion')
# AdamW's best lr in the earlier 300- and 2000-step comparisons on this model.
MUON_ADAM_LR = 1e-3
SEEDS = (0, 1, 2)
# Lrs with this many seeds or more compete on their shared seeds (see _pick_best_lr).
BEST_LR_SEEDS = 3
# `--refine` splits a pair of neighbouring lrs at least this far apart (see refined_lr).
REFINE_ABOVE = 1.9
STEPS = 2000
BASELINE = 'adamw'
# Pairs (a, b) the report compares seed by seed beside the baseline, each at its best
# lr: the shipped coded policy (`sj.MUON_CODED_TIERS`) with its Newton-Schulz in bfloat16
# against float32, against Muon, against the same
# policy in fp32, with every leaf coded and against the first shipped codes, and the
# front's other points (bits, blocks and rounding, under and over 10% of AdamW's state)
# against the fp32 form or the first shipped codes.
SHIPPED = 'skewadam-muon-coded-6bit-8bit-backbone-nearest-min4096'
ALL_CODED = 'skewadam-muon-coded-6bit-8bit-backbone-nearest'  # the norms coded too
FIRST = 'skewadam-muon-coded-4bit-experts-stochastic'  # the example's CODED_4BIT_TIERS
FP32 = 'skewadam-muon-expert-momentum'
PAIRS = ((f'{SHIPPED}-ns-bfloat16', f'{SHIPPED}-ns-float32'),  # Newton-Schulz dtype
         (SHIPPED, 'muon'), (SHIPPED, FP32), (SHIPPED, ALL_CODED), (SHIPPED, FIRST),
         (ALL_CODED, 'muon'), (ALL_CODED, FP32), (ALL_CODED, FIRST),
         (ALL_CODED, 'skewadam-muon-coded-6bit-8bit-backbone'),
         ('skewadam-muon-coded-6bit-8bit-backbone', FP32),
         (FIRST, 'muon'), (FIRST, FP32), (FP32, 'muon'),
         ('skewadam-muon-orthogonal-experts', 'muon'),
         ('skewadam-muon-coded-4bit32-experts-stochastic', FP32),
         ('skewadam-muon-coded-4bit32-experts-stochastic', FIRST),
         ('skewadam-muon-coded-5bit-experts-stochastic', FP32),
         ('skewadam-muon-coded-5bit-experts-stochastic', FIRST),
         ('skewadam-muon-coded-6bit-experts-5bit-rest', FP32),
         ('skewadam-muon-coded-6bit-experts-stochastic', FP32),
         ('skewadam-muon-coded-8bit', FP32),
         ('skewadam-muon-coded-4bit-rank1-experts', FIRST))


@dataclasses.dataclass(frozen=True)
class Run:
  """One point of the sweep; its name is its JSON's file name."""
  optimizer: str
  lr: float
  seed: int
  steps: int

  @property
  def name(self) -> str:
    return f'{self.optimizer}_lr{self.lr:g}_seed{self.seed}_steps{self.steps}'


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
  """The command line (hyphenated flags; `--batch_size` etc. are accepted too)."""
  p = _cli.parser(__doc__.splitlines()[0])
  _cli.option(p, '--optimizers', nargs='+', default=list(SWEEP_OPTIMIZERS),
              choices=opt_lib.OPTIMIZERS, metavar='NAME',
              help=f'optimizers to run (any of {", ".join(opt_lib.OPTIMIZERS)})')
  _cli.option(p, '--lrs', nargs='+', type=float, default=list(LRS),
              help='peak learning rates of every optimizer but Muon')
  _cli.option(p, '--muon-lrs', nargs='+', type=float, default=list(MUON_LRS),
              help="peak learning rates of Muon's orthogonalised matrices")
  _cli.option(p, '--muon-adam-lr', type=float, default=MUON_ADAM_LR,
              help="peak lr of Muon's Adam branch (embeddings, norms, router)")
  _cli.option(p, '--seeds', nargs='+', type=int, default=list(SEEDS),
              help='seeds (weights, batch order, router noise), one run each')
  _cli.option(p, '--steps', type=int, default=STEPS, help='training steps per run')
  _cli.option(p, '--preset', default='small', choices=sorted(model_lib.PRESETS),
              help='model size (examples/moe_lm/model.py)')
  _cli.option(p, '--batch-size', type=int, default=16, help='sequences per step')
  _cli.option(p, '--warmup-frac', type=float, default=0.1,
              help='linear warmup, as a fraction of the steps (then cosine to 0)')
  _cli.option(p, '--eval-every', type=int, default=100, help='validate every this many steps')
  _cli.option(p, '--eval-batches', type=int, default=8, help='validation batches per evaluation')
  _cli.option(p, '--out', default='runs/quality',
              help='output directory (run JSONs under <out>/runs, the report beside them)')
  _cli.option(p, '--report-only', action='store_true',
              help='train nothing: report the complete run JSONs already under --out')
  _cli.option(p, '--archive', action='store_true',
              help=f'train nothing: pack the complete run JSONs under <out>/runs into '
                   f'<out>/{ARCHIVE} (history every {HISTORY_EVERY}th step), delete them, '
                   'and report')
  _cli.option(p, '--refine', action='store_true',
              help='instead of the grid, run each optimizer once (first of --seeds) at the '
                   'geometric midpoint of its best lr so far and the better neighbour')
  return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The flags of `argv` (default `sys.argv[1:]`), checked."""
  p = build_parser()
  a = p.parse_args(argv)
  for flag, value in (('--steps', a.steps), ('--batch-size', a.batch_size),
                      ('--eval-every', a.eval_every), ('--eval-batches', a.eval_batches)):
    if value < 1:
      p.error(f'{flag} must be >= 1, not {value}')
  if not 0 <= a.warmup_frac < 1:
    p.error(f'--warmup-frac must be in [0, 1), not {a.warmup_frac}')
  if any(lr <= 0 for lr in a.lrs + a.muon_lrs + [a.muon_adam_lr]):
    p.error('learning rates must be > 0')
  return a


# ----------------------------------------------------------------------------- sweep


def plan(args: argparse.Namespace) -> list[Run]:
  """Every run, seed-major: a sweep stopped early has each (optimizer, lr) at seed 0."""
  runs = []
  for seed in dict.fromkeys(args.seeds):
    for i in range(max(len(args.lrs), len(args.muon_lrs))):
      for name in dict.fromkeys(args.optimizers):
        grid = list(dict.fromkeys(args.muon_lrs if name == 'muon' else args.lrs))
        if i < len(grid):
          runs.append(Run(name, float(grid[i]), seed, args.steps))
  return runs


def refined_lr(per_lr: dict[float, dict[str, Any]]) -> Optional[float]:
  """The lr halfway (geometrically, 2 significant digits) between the best lr and the
  better of its neighbours, or None once the two are less than `REFINE_ABOVE` apart.

  The grid's steps (about 3x; Muon's 2x) are coarser than the differences between
  optimizers; one refinement step, the same rule for every optimizer, finds where
  between two grid points the best lies. A refined pair is under 1.8x apart, so a
  second `--refine` proposes nothing: no optimizer is tuned further than the others.
  """
  lrs = sorted(per_lr)
  if len(lrs) < 2:
    return None
  best = _pick_best_lr(per_lr)
  i = lrs.index(best)
  neighbours = [lrs[j] for j in (i - 1, i + 1) if 0 <= j < len(lrs)]
  other = _pick_best_lr({lr: per_lr[lr] for lr in neighbours})
  if max(best, other) / min(best, other) < REFINE_ABOVE:
    return None
  return float(f'{math.sqrt(best * other):.2g}')


def refinement_plan(args: argparse.Namespace, records: list[dict[str, Any]]) -> list[Run]:
  """One run per optimizer of `--optimizers` at its `refined_lr`, first of `--seeds`."""
  rows = {row['optimizer']: row for row in summarize(records)}
  runs = []
  for name in dict.fromkeys(args.optimizers):
    if name not in rows:
      continue
    per_lr = {float(lr): v for lr, v in rows[name]['per_lr'].items()}
    lr = refined_lr(per_lr)
    if lr is not None:
      runs.append(Run(name, lr, args.seeds[0], args.steps))
  return runs


def train_config(args: argparse.Namespace, run: Run) -> train_lib.TrainConfig:
  """The `TrainConfig` of one run (everything but optimizer, lr and seed is shared)."""
  return train_lib.TrainConfig(
      optimizer=run.optimizer, preset=args.preset, steps=run.steps,
      batch_size=args.batch_size, lr=run.lr,
      muon_adam_lr=args.muon_adam_lr if run.optimizer == 'muon' else None,
      warmup=int(round(args.warmup_frac * run.steps)), eval_every=args.eval_every,
      eval_batches=args.eval_batches, seed=run.seed)


def _comparable(tc: train_lib.TrainConfig) -> dict[str, Any]:
  """The config as a run JSON stores it, less the output directory."""
  d = json.loads(json.dumps(dataclasses.asdict(tc), default=str))
  d.pop('out', None)
  return d


def run_status(path: Path, tc: train_lib.TrainConfig,
               archived: Optional[dict[str, dict[str, Any]]] = None) -> tuple[str, str]:
  """`('done' | 'missing' | 'partial' | 'mismatch', why)` of a run's JSON.

  Partial (unreadable, or not marked complete) runs are rerun; a complete run made
  with other settings is a mismatch, which the sweep refuses to overwrite or mix in.
  A run without a JSON is looked up in `archived` (`read_archive`'s, by run name).
  """
  if not path.exists():
    if archived is None or path.stem not in archived:
      return 'missing', ''
    record = archived[path.stem]
  else:
    try:
      record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
      return 'partial', f'unreadable ({e})'
  if record.get('complete') is not True:
    return 'partial', 'not marked complete'
  saved = dict(record.get('config', {}))
  saved.pop('out', None)
  want = _comparable(tc)
  diff = sorted(k for k in set(saved) | set(want) if saved.get(k) != want.get(k))
  if diff:
    return 'mismatch', ', '.join(f'{k}: {saved.get(k)!r} there, {want.get(k)!r} here'
                                 for k in diff)
  return 'done', ''


def sweep(args: argparse.Namespace, run_dir: Path) -> None:
  """Trains every planned run whose JSON is not complete yet, writing one JSON each."""
  runs = (refinement_plan(args, load_runs(run_dir, args.preset, args.steps))
          if args.refine else plan(args))
  todo = []
  archived = read_archive(run_dir)
  for run in runs:
    tc = train_config(args, run)
    path = run_dir / f'{run.name}.json'
    status, why = run_status(path, tc, archived)
    if status == 'mismatch':
      raise SystemExit(f'{path} was made with other settings ({why}); use another --out '
                       'or the settings it was made with.')
    if status == 'partial':
      print(f'{path.name}: {why}; it will be rerun')
    if status != 'done':
      todo.append((run, tc, path))
  print(f'{len(runs)} runs planned: {len(runs) - len(todo)} complete (skipped), '
        f'{len(todo)} to run', flush=True)
  if not todo:
    return
  # One read of the corpus; the seed only changes the order of the training batches.
  data = train_lib.load_data(todo[0][1], train_lib.model_config(todo[0][1]))
  print(data.summary())
  command = _common.command()
  walls: list[float] = []
  for i, (run, tc, path) in enumerate(todo):
    record = train_lib.train(tc, dataclasses.replace(data, seed=run.seed),
                             desc=f'[{i + 1}/{len(todo)}] {run.name}')
    del record['history']['aux']  # keep the JSON small; loss/ce/grad_norm/drops stay
    record.update(sweep=dataclasses.asdict(run), command=command, complete=True)
    _common.write_json_atomic(path, record)
    walls.append(record['timing']['wall_s'])
    left = len(todo) - i - 1
    print(f'{run.name}: final val loss {record["final"]["loss"]:.4f} '
          f'({walls[-1]:.0f} s); {left} left, about {left * np.mean(walls) / 60:.0f} min',
          flush=True)


# ----------------------------------------------------------------------------- report


ARCHIVE = 'runs.json.gz'  # beside the `runs/` directory: `{run name: record}`
HISTORY_EVERY = 10  # steps between the archived history's entries (the report reads none)


def archive_path(run_dir: Path) -> Path:
  return run_dir.parent / ARCHIVE


def read_archive(run_dir: Path) -> dict[str, dict[str, Any]]:
  """The archived run records (`--archive`) beside `run_dir`, by run name; {} if none."""
  path = archive_path(run_dir)
  if not path.exists():
    return {}
  with gzip.open(path, 'rt') as f:
    return json.load(f)


def thin_history(record: dict[str, Any], every: int = HISTORY_EVERY) -> dict[str, Any]:
  """`record` with its per-step history kept at every `every`-th step and the last."""
  history = record.get('history')
  if not history:
    return record
  n = len(history['step'])
  keep = sorted(set(range(0, n, every)) | {n - 1})
  return dict(record, history={k: [v[i] for i in keep] for k, v in history.items()},
              history_every=every)


def archive_runs(run_dir: Path) -> list[Path]:
  """Packs the complete run JSONs under `run_dir` into `archive_path(run_dir)` (merged
  with what it holds, a JSON replacing the archived run of its name), thinning each
  history, then deletes the packed JSONs; returns them. Partial runs stay."""
  archived = read_archive(run_dir)
  packed = []
  for path in sorted(run_dir.glob('*.json')):
    try:
      r = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
      continue
    if r.get('complete') is True:
      archived[path.stem] = thin_history(r)
      packed.append(path)
  if not packed:
    return []
  out = archive_path(run_dir)
  tmp = out.with_name(out.name + '.tmp')
  # mtime=0: the same runs give the same bytes (no timestamp in the gzip header).
  with open(tmp, 'wb') as raw, gzip.GzipFile(fileobj=raw, mode='wb', mtime=0) as f:
    f.write(json.dumps(dict(sorted(archived.items())), separators=(',', ':')).encode())
  os.replace(tmp, out)  # readers see the old archive or the whole new one
  for path in packed:
    path.unlink()
  return packed


def load_runs(run_dir: Path, preset: str, steps: int) -> list[dict[str, Any]]:
  """The complete runs of `preset` at `steps`: the JSONs under `run_dir` and the
  archived runs beside it (a JSON wins over the archived run of its name), by name."""
  by_name = read_archive(run_dir)
  for path in sorted(run_dir.glob('*.json')):
    try:
      by_name[path.stem] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
      continue
  records = []
  for name in sorted(by_name, key=lambda n: f'{n}.json'):  # the order of the files
    r = by_name[name]
    if (r.get('complete') is True and r['config']['preset'] == preset
        and r['config']['steps'] == steps):
      records.append(r)
  return records


def _order(name: str) -> tuple[int, str]:
  return (SWEEP_OPTIMIZERS.index(name) if name in SWEEP_OPTIMIZERS else 99, name)


def _mean_std(x: Sequence[float]) -> tuple[float, Optional[float]]:
  """Mean and sample std (None for a single value)."""
  a = np.asarray(x, np.float64)
  return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else None)


def _pick_best_lr(per_lr: dict[float, dict[str, Any]]) -> float:
  """The best lr: the first seed nominates, lrs rerun with more seeds decide.

  The protocol picks the lr on a first seed and reruns only that lr with more seeds;
  comparing a 3-seed mean with 1-seed losses would let the seed draw move the choice,
  so the nominee is the lowest mean over the seeds that every lr has run (without a
  seed in common, the means over all seeds). Where the nominee and other lrs have
  `BEST_LR_SEEDS` or more seeds each, the lowest mean over the seeds those lrs share
  wins instead: one seed's pick between two close lrs is not the last word.
  """
  nominee = _best_on_common_seeds(per_lr)
  rerun = {lr: v for lr, v in per_lr.items() if len(v['seeds']) >= BEST_LR_SEEDS}
  return _best_on_common_seeds(rerun) if nominee in rerun else nominee


def _best_on_common_seeds(per_lr: dict[float, dict[str, Any]]) -> float:
  common = set.intersection(*(set(v['seeds']) for v in per_lr.values()))

  def score(lr: float) -> float:
    v = per_lr[lr]
    losses = [x for x, seed in zip(v['losses'], v['seeds']) if seed in common]
    return float(np.mean(losses)) if losses else v['mean']

  return min(per_lr, key=score)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per optimizer: loss at every lr, the best lr and its seeds' figures."""
  by: dict[str, dict[float, list[dict[str, Any]]]] = {}
  for r in records:
    by.setdefault(r['sweep']['optimizer'], {}).setdefault(r['sweep']['lr'], []).append(r)
  rows = []
  for name in sorted(by, key=_order):
    per_lr = {}
    for lr, rs in sorted(by[name].items()):
      rs.sort(key=lambda r: r['sweep']['seed'])
      losses = [r['final']['loss'] for r in rs]
      mean, std = _mean_std(losses)
      per_lr[lr] = {'mean': mean, 'std': std, 'n': len(rs), 'losses': losses,
                    'seeds': [r['sweep']['seed'] for r in rs]}
    best_lr = _pick_best_lr(per_lr)
    best = by[name][best_lr]
    lrs = sorted(per_lr)
    speeds = [r['timing']['tokens_per_s'] for r in best if r['timing']['tokens_per_s']]
    router: dict[str, Any] = {}
    if 'token_frac' in best[0]['router']:
      for k in (*train_lib.ROUTER_HEALTH, 'aux_over_floor'):
        router[k] = np.mean([np.asarray(r['router'][k], np.float64) for r in best],
                            axis=0).tolist()
      router['n_experts'] = best[0]['router']['n_experts']
    rows.append({
        'optimizer': name, 'best_lr': best_lr, 'loss_mean': per_lr[best_lr]['mean'],
        'loss_std': per_lr[best_lr]['std'], 'n_seeds': per_lr[best_lr]['n'],
        'best_at_edge': len(lrs) > 1 and best_lr in (lrs[0], lrs[-1]),
        'per_lr': {f'{lr:g}': v for lr, v in per_lr.items()},
        'state_bytes': best[0]['memory']['total_state_bytes'],
        'tokens_per_s': float(np.median(speeds)) if speeds else None,
        'router': router, 'best_runs': [Run(**r['sweep']).name for r in best],
        'hyperparameters': best[0]['optimizer'],
    })
  front = {r['optimizer'] for r in pareto_front(rows)}
  for row in rows:
    row['on_pareto_front'] = row['optimizer'] in front
  base = next((r for r in rows if r['optimizer'] == BASELINE), None)
  for row in rows:
    row['gap_vs_baseline'] = None if base is None else row['loss_mean'] - base['loss_mean']
    row['paired_gap'] = None if base is None or row is base else _paired_gap(
        row['per_lr'][f'{row["best_lr"]:g}'], base['per_lr'][f'{base["best_lr"]:g}'],
        base['loss_mean'])
    # "Same hyperparameters as Adam": each optimizer at the baseline's best lr, where
    # its lr means the same thing (not Muon's or Lion's).
    same = (None if base is None or row['optimizer'] in OWN_LR_SCALE
            else row['per_lr'].get(f'{base["best_lr"]:g}'))
    row['at_baseline_lr'] = None if same is None else dict(
        same, gap=same['mean'] - base['loss_mean'],
        paired_gap=_paired_gap(same, base['per_lr'][f'{base["best_lr"]:g}'],
                               base['loss_mean']))
  return rows


def pareto_front(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The rows no other row beats on both state bytes and loss, by increasing bytes.

  A row is on the front when its mean best-lr loss is strictly lower than that of
  every row with as few or fewer state bytes (of rows with equal bytes and loss, the
  first in `rows` order stays). Reading the front left to right: each step buys a
  lower loss with more optimizer state.
  """
  order = sorted(enumerate(rows), key=lambda ir: (ir[1]['state_bytes'],
                                                  ir[1]['loss_mean'], ir[0]))
  front, best = [], math.inf
  for _, row in order:
    if row['loss_mean'] < best:
      front.append(row)
      best = row['loss_mean']
  return front


def _paired_gap(v: dict[str, Any], base: dict[str, Any], base_mean: float
                ) -> Optional[dict[str, Any]]:
  """The gap to the baseline seed by seed, in % of the baseline's mean loss.

  A seed fixes the init and the batch order for every optimizer, so the per-seed
  differences cancel the seed's own luck, which the difference of two means keeps.
  Mean, sample std and standard error of the mean over the seeds both have run.
  """
  b = dict(zip(base['seeds'], base['losses']))
  gaps = [100 * (x - b[seed]) / base_mean for x, seed in zip(v['losses'], v['seeds'])
          if seed in b]
  if not gaps:
    return None
  mean, std = _mean_std(gaps)
  return {'pct': gaps, 'seeds': [s for s in v['seeds'] if s in b], 'mean_pct': mean,
          'std_pct': std, 'se_pct': None if std is None else std / math.sqrt(len(gaps))}


def paired_comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """`PAIRS` whose optimizers both ran: a's loss against b's, seed by seed, each at its
  best lr, in % of b's mean (negative: a is better)."""
  by_name = {row['optimizer']: row for row in rows}
  out = []
  for a, b in PAIRS:
    if a in by_name and b in by_name:
      ra, rb = by_name[a], by_name[b]
      gap = _paired_gap(ra['per_lr'][f'{ra["best_lr"]:g}'], rb['per_lr'][f'{rb["best_lr"]:g}'],
                        rb['loss_mean'])
      out.append({'a': a, 'b': b, 'a_lr': ra['best_lr'], 'b_lr': rb['best_lr'],
                  'paired_gap': gap})
  return out


def pairs_markdown(pairs: list[dict[str, Any]]) -> list[str]:
  if not pairs:
    return []
  body = [[p['a'], f'{p["a_lr"]:g}', p['b'], f'{p["b_lr"]:g}', _paired_text(p['paired_gap']),
           ', '.join(f'{x:+.2f}%' for x in (p['paired_gap'] or {}).get('pct', []))]
          for p in pairs]
  return ['### Paired comparisons', '',
          'a against b, each at its best lr, seed by seed (the same init and batches): the '
          "mean of (a's loss - b's loss) in % of b's mean loss, ± its standard error "
          '(seeds both ran); negative: a is better.', '',
          _common.markdown_table(['a', 'lr', 'b', 'lr', 'a vs b, paired (± s.e.)',
                                  'per seed'], body), '']


def _paired_text(pg: Optional[dict[str, Any]]) -> str:
  if pg is None:
    return '—'
  se = '' if pg['se_pct'] is None else f' ± {pg["se_pct"]:.2f}%'
  return f'{pg["mean_pct"]:+.2f}%{se} ({len(pg["pct"])})'


def _pm(mean: float, std: Optional[float], n: int) -> str:
  return f'{mean:.4f} ± {std:.4f} ({n})' if std is not None else f'{mean:.4f} (1)'


def _per_layer(values: Any, spec: str) -> str:
  return ', '.join(format(v, spec) for v in np.atleast_1d(values))


def report_markdown(rows: list[dict[str, Any]], records: list[dict[str, Any]],
                    args: argparse.Namespace) -> str:
  """The sweep's tables and how to read them."""
  r0 = records[0]
  m = r0['machine']
  wall = sum(r['timing']['wall_s'] for r in records)
  base = next((r for r in rows if r['optimizer'] == BASELINE), None)
  lines = [
      f'## Optimizer sweep: `{args.preset}` MoE LM, {args.steps} steps x '
      f'{r0["timing"]["tokens_per_step"]:,} tokens', '',
      f'{len(records)} complete runs (JSONs under `{args.out}/runs`, or archived in '
      f'`{args.out}/{ARCHIVE}`); {wall / 60:.1f} min of '
      f'training in all; data: {data_lib.portable_summary(r0["data"])}  ',
      f'Schedule: {r0["config"]["warmup"]} warmup steps then cosine to 0, clip 1.0, '
      f'weight decay {r0["config"]["weight_decay"]}; validation every '
      f'{r0["config"]["eval_every"]} steps on {r0["config"]["eval_batches"]} fixed '
      'batches, without router noise and dropless.  ',
      f'Machine: {m["cpu_count"]} CPU cores, {m["platform"]}, jax {m["jax"]}, optax '
      f'{m["optax"]}, flax {m["flax"]} (tokens/s depend on the load from other '
      'processes: indicative only).', '',
      'Best lr: the lowest mean final validation loss over the seeds that every lr of '
      'the optimizer has run (the first seed nominates the lr, which gets more seeds); '
      f'where other lrs have {BEST_LR_SEEDS} or more seeds too, the lowest mean over the '
      'seeds they share. '
      'Loss: nats/byte, mean ± '
      'sample std over seeds (number of seeds). Paired by seed: the mean over seeds of '
      f'(loss - {BASELINE}\'s loss at the same seed, which has the same init and batches), '
      f'in % of {BASELINE}\'s mean, ± its standard error (seeds). Router health at the '
      'end of the best-lr '
      'runs, mean over seeds, per MoE layer (comma-separated); dead = share below '
      f'{model_lib.DEAD_BELOW:g} x uniform. The Switch aux loss / floor is 1 for uniform '
      'router probabilities whatever the assignments, so it is blind to collapse.', '',
  ]
  header = ['optimizer', 'best lr', 'final val loss', f'vs {BASELINE} (best lr each)',
            'paired by seed (± s.e.)', 'state bytes', 'tokens/s', 'dead experts',
            'max share / uniform', 'min share / uniform', 'load entropy / log E',
            'top-1 router prob', 'router weight norm', 'Switch aux / floor']
  body = []
  for row in rows:
    rt = row['router']
    gap = row['gap_vs_baseline']
    gap_text = ('—' if gap is None or row is base else
                f'{gap:+.4f} ({100 * gap / base["loss_mean"]:+.2f}%)')
    health = (['n/a'] * 7 if not rt else [
        f'{_per_layer(rt["dead_experts"], ".3g")} of {rt["n_experts"]}',
        _per_layer(rt['load_max_x_uniform'], '.2f'),
        _per_layer(rt['load_min_x_uniform'], '.2f'),
        _per_layer(rt['load_entropy_ratio'], '.3f'),
        _per_layer(rt['top1_prob'], '.3f'), _per_layer(rt['router_norm'], '.3g'),
        f'{rt["aux_over_floor"]:.4f}'])
    speed = 'n/a' if row['tokens_per_s'] is None else f'{row["tokens_per_s"]:,.0f}'
    paired = _paired_text(row.get('paired_gap'))
    body.append([row['optimizer'], f'{row["best_lr"]:g}',
                 _pm(row['loss_mean'], row['loss_std'], row['n_seeds']), gap_text, paired,
                 f'{row["state_bytes"]:,}', speed, *health])
  lines += [_common.markdown_table(header, body), '']
  lines += quality_per_byte_markdown(rows, base, args.steps)
  muon = next((r for r in rows if r['optimizer'] == 'muon'), None)
  if muon:
    lines += [f'Muon: the lr is that of its orthogonalised matrices (attention, dense MLP, '
              f'experts); its Adam branch (embeddings, norms, router) ran at peak lr '
              f'{muon["hyperparameters"].get("adam_lr")}.', '']
  names = ', '.join(f'`{r["optimizer"]}`' for r in rows)
  lines += [f'SkewAdam policies: `skewadam` is `sj.PUBLISHED_TIERS`, '
            '`skewadam-adam-eps-router-momentum` is `sj.ADAM_EPS_TIERS`, '
            '`skewadam-router-adam-eps-momentum` is `sj.ADAM_ROUTER_TIERS`, '
            '`skewadam-muon-orthogonal-experts` is `sj.MUON_TIERS`, '
            f'`{SHIPPED}` is `sj.MUON_CODED_TIERS` (`{ALL_CODED}` the same with every leaf '
            f'coded, `{FIRST}` the first one); every name '
            f'({names}) is defined in examples/moe_lm/optimizers.py.', '']
  lines += ['### Final validation loss at every lr (mean ± std over seeds)', '']
  body = []
  for row in rows:
    cells = []
    for lr, v in row['per_lr'].items():
      text = f'{lr}: {_pm(v["mean"], v["std"], v["n"])}'
      cells.append(f'**{text}**' if float(lr) == row['best_lr'] else text)
    edge = ('yes: extend the grid' if row['best_at_edge'] else
            'no' if len(row['per_lr']) > 1 else 'one lr only: not swept')
    body.append([row['optimizer'], ' · '.join(cells), edge])
  lines.append(_common.markdown_table(['optimizer', 'lr: loss (seeds)', 'best at the edge'],
                                      body, align='llr'))
  same = [row for row in rows if row is not base and row.get('at_baseline_lr')]
  if base and same:
    lr = f'{base["best_lr"]:g}'
    lines += ['', f'### At {BASELINE}\'s best lr ({lr}), the same hyperparameters', '',
              _common.markdown_table(
                  ['optimizer', f'final val loss at {lr}', f'vs {BASELINE} at {lr}',
                   'paired by seed (± s.e.)'],
                  [[row['optimizer'], _pm(v['mean'], v['std'], v['n']),
                    f'{v["gap"]:+.4f} ({100 * v["gap"] / base["loss_mean"]:+.2f}%)',
                    _paired_text(v['paired_gap'])]
                   for row in same for v in [row['at_baseline_lr']]])]
  return '\n'.join(lines)


def quality_per_byte_markdown(rows: list[dict[str, Any]], base: Optional[dict[str, Any]],
                              steps: int) -> list[str]:
  """Every optimizer by increasing state bytes, with its loss and the Pareto front."""
  body = []
  for row in sorted(rows, key=lambda r: (r['state_bytes'], r['loss_mean'])):
    share = ('—' if base is None else
             f'{100 * row["state_bytes"] / base["state_bytes"]:.1f}%')
    body.append([row['optimizer'], f'{row["state_bytes"]:,}', share,
                 _pm(row['loss_mean'], row['loss_std'], row['n_seeds']),
                 _paired_text(row.get('paired_gap')),
                 'yes' if row['on_pareto_front'] else ''])
  return ['### Quality per byte', '',
          'Every optimizer at its best lr, by increasing optimizer state; on the Pareto '
          'front: no optimizer with as little state or less has a lower mean loss '
          f'(`memory_steps{steps}.png` draws it).', '',
          _common.markdown_table(['optimizer', 'state bytes', f'of {BASELINE}\'s',
                                  'final val loss', f'vs {BASELINE}, paired (± s.e.)',
                                  'Pareto front'], body), '']


def _best_records(rows: list[dict[str, Any]], records: list[dict[str, Any]]
                  ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
  by_name = {Run(**r['sweep']).name: r for r in records}
  return [(row, [by_name[n] for n in row['best_runs']]) for row in rows]


# Where in the schedule the dead-expert table looks (fractions of the steps).
DEAD_AT = (0.05, 0.15, 0.3, 0.5, 1.0)


def _router_over_training(rs: list[dict[str, Any]], steps: int
                          ) -> list[tuple[int, float, float]]:
  """`(step, dead experts summed over layers, mean router norm)` at `DEAD_AT`, means
  over the runs `rs` (seeds); the eval nearest each fraction of the schedule."""
  out = []
  for frac in DEAD_AT:
    dead, norm, at = [], [], 0
    for r in rs:
      evals = [e for e in r['evals'] if 'dead_experts' in e]
      if not evals:
        return []
      e = min(evals, key=lambda e: abs(e['step'] - frac * steps))
      at = e['step']
      dead.append(float(np.sum(e['dead_experts'])))
      norm.append(float(np.mean(e['router_norm'])))
    # A short run evaluates less often than DEAD_AT asks: one column per evaluation.
    if not out or out[-1][0] != at:
      out.append((at, float(np.mean(dead)), float(np.mean(norm))))
  return out


def dead_experts_markdown(rows: list[dict[str, Any]], records: list[dict[str, Any]],
                          steps: int) -> list[str]:
  """Dead experts and router norm over training at each best lr, and how the two go
  together over every run and evaluation of the sweep."""
  best = [(row, _router_over_training(rs, steps)) for row, rs in _best_records(rows, records)]
  best = [(row, points) for row, points in best if points]
  if not best:
    return []
  n_layers = len(next(r for r in records if r['evals'])['evals'][-1].get('dead_experts', [0]))
  n_experts = best[0][0]['router'].get('n_experts', '?')
  header = ['optimizer (best lr)'] + [f'step {at}' for at, _, _ in best[0][1]]
  body = [[f'{row["optimizer"]} ({row["best_lr"]:g})']
          + [f'{dead:.3g} / {norm:.2f}' for _, dead, norm in points] for row, points in best]
  lines = ['### Dead experts over training', '',
           f'Dead experts summed over the {n_layers} MoE layer(s) ({n_experts} experts each) '
           '/ router weight norm (mean over layers), at the best lr, mean over seeds; '
           'validation without router noise.', '',
           _common.markdown_table(header, body), '']
  # Every evaluation of every run: does a dead expert come with a small router?
  dead, norm = _all_dead_and_norm(records)
  if len(dead):
    edges = [0.0, 0.25, 0.5, 1.0, 2.0, np.inf]
    cells = []
    for lo, hi in zip(edges[:-1], edges[1:]):
      sel = (norm >= lo) & (norm < hi)
      if sel.any():
        label = f'{lo:g}-{hi:g}' if np.isfinite(hi) else f'>= {lo:g}'
        cells.append([label, f'{int(sel.sum())}', f'{dead[sel].mean():.2f}',
                      f'{100 * np.mean(dead[sel] > 0):.0f}%'])
    lines += [f'All {len(dead)} (run, evaluation, layer) points of the sweep, by the '
              'router weight norm of the layer:', '',
              _common.markdown_table(['router norm', 'points', 'mean dead experts',
                                      'with a dead expert'], cells), '']
  return lines


def _all_dead_and_norm(records: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
  """Dead experts and router norm per (run, evaluation, layer), flattened."""
  dead: list[float] = []
  norm: list[float] = []
  for r in records:
    for e in r['evals']:
      if 'dead_experts' in e:
        dead += np.atleast_1d(e['dead_experts']).astype(float).tolist()
        norm += np.atleast_1d(e['router_norm']).astype(float).tolist()
  return np.asarray(dead), np.asarray(norm)


def plot_dead_experts(records: list[dict[str, Any]], path: Path, title: str) -> None:
  """Dead experts against the router weight norm, per layer, every evaluation of
  every run, one colour per optimizer."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  names = sorted({r['sweep']['optimizer'] for r in records}, key=_order)
  fig, ax = plt.subplots(figsize=(7.5, 5))
  rng = np.random.default_rng(0)
  for i, name in enumerate(names):
    dead, norm = _all_dead_and_norm([r for r in records if r['sweep']['optimizer'] == name])
    if len(dead):
      # Dead counts are integers: a little vertical jitter keeps the points apart.
      ax.scatter(norm, dead + rng.uniform(-0.15, 0.15, len(dead)), s=7, alpha=0.5,
                 color=f'C{i % 10}', label=name)
  _finish_log_x(fig, ax, 'router weight norm of the layer',
                'dead experts in the layer (validation, no router noise)', title, path)


def plot_curves(rows: list[dict[str, Any]], records: list[dict[str, Any]], steps: int,
                path: Path, title: str) -> None:
  """Validation loss against step at each optimizer's best lr; right: the second half,
  where the differences that decide the comparison are too small for the full range."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  half = steps / 2
  tail: list[float] = []
  for i, (row, rs) in enumerate(_best_records(rows, records)):
    n = min(len(r['evals']) for r in rs)
    x = np.asarray([e['step'] for e in rs[0]['evals'][:n]])
    losses = np.asarray([[e['loss'] for e in r['evals'][:n]] for r in rs])
    seeds = f'{len(rs)} seed' + ('s' if len(rs) > 1 else '')
    for ax in axes:
      ax.plot(x, losses.mean(0), 'o-', ms=2.5, color=f'C{i % 10}',
              label=f'{row["optimizer"]} lr {row["best_lr"]:g} ({seeds})')
      if len(rs) > 1:
        ax.fill_between(x, losses.min(0), losses.max(0), color=f'C{i % 10}', alpha=0.2)
    tail += losses[:, x >= half].ravel().tolist()
  for ax in axes:
    ax.set_xlabel('step')
    ax.set_ylabel('validation cross-entropy (nats / byte, no router noise)')
    ax.grid(alpha=0.3)
  axes[0].set_title('best lr of each optimizer (band: min..max over seeds)', fontsize=9)
  axes[1].set_title('second half', fontsize=9)
  if tail:
    lo, hi = min(tail), max(tail)
    pad = 0.05 * (hi - lo or 1.0)
    axes[1].set_xlim(left=half)
    axes[1].set_ylim(lo - pad, hi + pad)
  axes[0].legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_memory(rows: list[dict[str, Any]], path: Path, title: str) -> None:
  """Quality per byte: best-lr final validation loss (error bar: std over seeds)
  against state bytes, every optimizer, the Pareto front as a staircase and rings."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(12, 6))
  front = pareto_front(rows)
  if front:
    # The best loss reachable with at most x bytes: a staircase through the front.
    xs = [r['state_bytes'] for r in front]
    ys = [r['loss_mean'] for r in front]
    right = max(r['state_bytes'] for r in rows) * 1.5
    ax.step(xs + [right], ys + [ys[-1]], where='post', color='k', lw=1, alpha=0.6,
            label='Pareto front (best loss at this state or less)', zorder=1)
    ax.scatter(xs, ys, s=160, facecolors='none', edgecolors='k', lw=1, zorder=3)
  on_front = {id(r) for r in front}
  for i, row in enumerate(rows):
    # tab10 colours, a new marker every ten optimizers: every point has its legend entry.
    ax.errorbar(row['state_bytes'], row['loss_mean'], yerr=row['loss_std'] or 0.0,
                fmt='os^Dv'[(i // 10) % 5], ms=6, capsize=3, color=f'C{i % 10}',
                label=f'{row["optimizer"]} (lr {row["best_lr"]:g})')
    # Points that share an x (SkewAdam's variants) are told apart by the legend; the
    # front's points and lone points are named on the plot too.
    crowded = sum(abs(math.log(r['state_bytes'] / row['state_bytes'])) < 0.03
                  for r in rows) > 1
    if id(row) in on_front or not crowded:
      ax.annotate(row['optimizer'], (row['state_bytes'], row['loss_mean']),
                  textcoords='offset points', xytext=(8, 4), fontsize=8)
  # The legend beside the axes: inside, it would cover points wherever the front lies.
  _finish_log_x(fig, ax, 'optimizer state bytes (float32 state)',
                'final validation loss at the best lr (nats / byte)', title, path,
                legend_outside=True)


# The optimizers whose loss against lr `lr_{stem}.png` draws (those that ran).
LR_PLOT = ('adamw', 'muon', 'skewadam-muon-orthogonal-experts', 'skewadam-muon-expert-momentum',
           'skewadam-muon-coded-4bit-experts', 'skewadam-muon-coded-4bit-experts-stochastic',
           ALL_CODED, SHIPPED)


def plot_lr(rows: list[dict[str, Any]], path: Path, title: str) -> None:
  """Final validation loss against peak lr (mean over the seeds of each lr; the error
  bar their std), one line per optimizer of `LR_PLOT`, AdamW's best as a dashed line:
  where each is best and how far above it the loss runs away."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(10, 5.5))
  by_name = {row['optimizer']: row for row in rows}
  for i, name in enumerate(n for n in LR_PLOT if n in by_name):
    row = by_name[name]
    lrs = sorted(row['per_lr'], key=float)
    ax.errorbar([float(lr) for lr in lrs], [row['per_lr'][lr]['mean'] for lr in lrs],
                yerr=[row['per_lr'][lr]['std'] or 0.0 for lr in lrs], marker='o', ms=4,
                capsize=3, color=f'C{i}', label=f'{name} (best {row["best_lr"]:g})')
  if BASELINE in by_name:
    ax.axhline(by_name[BASELINE]['loss_mean'], color='k', ls='--', lw=1,
               label=f'{BASELINE} at its best lr')
  _finish_log_x(fig, ax, 'peak learning rate', 'final validation loss (nats / byte)', title,
                path, legend_outside=True)


def _finish_log_x(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str,
                  path: Path, legend_outside: bool = False) -> None:
  """Log x axis, labels, grid, legend and title; saves and closes the figure."""
  import matplotlib.pyplot as plt

  ax.set_xscale('log')
  ax.set_xlabel(f'{xlabel} (log scale)')
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3, which='both')
  if legend_outside:
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  else:
    ax.legend(fontsize=7)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def report(args: argparse.Namespace, out: Path) -> str:
  """Reads every complete run JSON of `--preset` at `--steps`, writes and returns the
  markdown report (and its JSON and plots)."""
  records = load_runs(out / 'runs', args.preset, args.steps)
  if not records:
    return (f'No complete run of `{args.preset}` at {args.steps} steps under {out / "runs"} '
            f'or in {out / ARCHIVE}.')
  rows = summarize(records)
  pairs = paired_comparisons(rows)
  text = '\n'.join([report_markdown(rows, records, args), '', *pairs_markdown(pairs),
                    *dead_experts_markdown(rows, records, args.steps)]).rstrip()
  stem = f'steps{args.steps}'
  what = f'{args.preset} MoE LM, {args.steps} steps'
  paths = {'md': out / f'report_{stem}.md', 'json': out / f'report_{stem}.json',
           'curves': out / f'curves_{stem}.png', 'memory': out / f'memory_{stem}.png',
           'router': out / f'router_{stem}.png', 'dead': out / f'dead_{stem}.png',
           'lr': out / f'lr_{stem}.png'}
  paths['md'].write_text(text + '\n')
  _common.write_json_atomic(paths['json'], {
      'command': _common.command(), 'preset': args.preset, 'steps': args.steps,
      'machine': records[0]['machine'], 'rows': rows, 'pairs': pairs,
      'runs': sorted(Run(**r['sweep']).name for r in records)})
  plot_curves(rows, records, args.steps, paths['curves'], f'validation loss, {what}')
  plot_memory(rows, paths['memory'], f'quality per byte of optimizer state, {what}')
  plot_lr(rows, paths['lr'], f'final validation loss against peak lr, {what}')
  train_lib.plot_router(
      [(f'{row["optimizer"]} lr {row["best_lr"]:g} seed {rs[0]["sweep"]["seed"]}', rs[0])
       for row, rs in _best_records(rows, records)],
      paths['router'], title=f'expert load over training at the best lr, {what}')
  plot_dead_experts(records, paths['dead'],
                    f'dead experts against router norm, every run and evaluation, {what}')
  return text + '\n\nwrote ' + ', '.join(str(p) for p in paths.values() if p.exists())


def main(argv: Optional[Sequence[str]] = None) -> str:
  """Runs the missing runs of the sweep (unless `--report-only`), then the report."""
  args = parse_args(argv)
  out = Path(args.out)
  start = time.perf_counter()
  if args.archive:
    packed = archive_runs(out / 'runs')
    print(f'archived {len(packed)} run JSONs into {archive_path(out / "runs")}')
  elif not args.report_only:
    sweep(args, out / 'runs')
  text = report(args, out)
  print(text)
  if not (args.report_only or args.archive):
    print(f'({(time.perf_counter() - start) / 60:.1f} min in this invocation)')
  return text


if __name__ == '__main__':
  main()
