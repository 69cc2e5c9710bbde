"""Side-by-side optimizer comparison on real text: the example MoE LM on stdlib bytes.

Every run starts from the same initial weights and sees the same batches in the same
order (and the same router noise); all get the same budget (steps x batch), the same
warmup + cosine schedule, global-norm clip 1.0 and weight decay 0.1 (see
`examples/moe_lm/optimizers.py` for each optimizer's exact settings).

Learning rates, and why (tuning effort):
  * SkewAdam and its ablations, AdamW, AdamPM, Adafactor: the published 3e-4.
  * AdamW is also swept over {1e-4, 3e-4, 1e-3} (the baseline gets a sweep, as in the
    paper's "AdamW after an lr sweep"); SkewAdam gets one extra run at 1e-3 so that the
    sweep is not one-sided. No other optimizer is tuned.
  * Lion: 1e-4 (the conventional 3-10x below Adam's) with 3x the weight decay.
  * Muon: its conventional 0.02 on matrices, Adam at 3e-4 on embeddings/norms/router.

  python benchmarks/quality.py                # 12 runs x 300 steps (about 25 min on 2 cores)
  python benchmarks/quality.py --scale 4      # 4x the steps
  python benchmarks/quality.py --long         # SkewAdam, AdamW (3e-4, best), AdamPM, ~45 min
  python benchmarks/quality.py --only skewadam adamw@0.0003

Writes `quality.json`, `quality.png` (validation loss against step) and `quality.md`
under `--out` (default `runs/quality/`); the JSON is rewritten after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples import _cli  # noqa: E402
from examples.moe_lm import optimizers as opt_lib  # noqa: E402
from examples.moe_lm import train as train_lib  # noqa: E402

ADAMW_SWEEP = (1e-4, 3e-4, 1e-3)
# (label, optimizer, lr); None means the optimizer's default (optimizers.DEFAULT_LR).
DEFAULT_RUNS = (
    ('skewadam', 'skewadam', None),
    ('adamw@0.0003', 'adamw', 3e-4),
    ('adampm-s8', 'adampm', None),
    ('adamw@0.001', 'adamw', 1e-3),
    ('adamw@0.0001', 'adamw', 1e-4),
    ('adafactor', 'adafactor', None),
    ('lion', 'lion', None),
    ('muon', 'muon', None),
    ('skewadam-expert-momentum', 'skewadam-expert-momentum', None),
    ('skewadam-factored-all', 'skewadam-factored-all', None),
    ('skewadam-adam-eps', 'skewadam-adam-eps', None),
    ('skewadam@0.001', 'skewadam', 1e-3),
)
LONG_RUNS = (
    ('skewadam', 'skewadam', None),
    ('adamw@0.0003', 'adamw', 3e-4),
    ('adampm-s8', 'adampm', None),
    ('adamw@0.001', 'adamw', 1e-3),
)


def build_parser() -> argparse.ArgumentParser:
  """The command line (hyphenated flags; `--batch_size` etc. are accepted too)."""
  p = _cli.parser(__doc__.splitlines()[0])
  _cli.option(p, '--preset', default='small', help='model size (examples/moe_lm/model.py)')
  _cli.option(p, '--steps', type=int, default=300, help='training steps per run')
  _cli.option(p, '--batch-size', type=int, default=16, help='sequences per step')
  _cli.option(p, '--warmup-frac', type=float, default=0.1,
              help='linear warmup, as a fraction of the steps')
  _cli.option(p, '--eval-every', type=int, default=50, help='validate every this many steps')
  _cli.option(p, '--eval-batches', type=int, default=8, help='validation batches per evaluation')
  _cli.option(p, '--scale', type=float, default=1.0, help='multiply steps (and eval spacing)')
  _cli.option(p, '--long', action='store_true',
              help='SkewAdam, AdamW (3e-4 and 1e-3), AdamPM for 2000 steps (~45 min)')
  _cli.option(p, '--only', nargs='+', default=None, help='run labels to keep')
  _cli.option(p, '--seed', type=int, default=0, help='weights, batches and router noise')
  _cli.option(p, '--out', default='runs/quality', help='output directory')
  return p


def parse_args() -> argparse.Namespace:
  """The flags of `sys.argv`."""
  return build_parser().parse_args()


def main() -> None:
  args = parse_args()
  runs = LONG_RUNS if args.long else DEFAULT_RUNS
  steps, eval_every = args.steps, args.eval_every
  if args.long:
    steps, eval_every = 2000, 125
  steps = int(round(steps * args.scale))
  eval_every = max(1, int(round(eval_every * args.scale)))
  if args.only:
    runs = tuple(r for r in runs if r[0] in args.only)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = ' '.join(['python'] + sys.argv)

  base = train_lib.TrainConfig(
      preset=args.preset, steps=steps, batch_size=args.batch_size,
      warmup=int(round(args.warmup_frac * steps)), eval_every=eval_every,
      eval_batches=args.eval_batches, seed=args.seed)
  data = train_lib.load_data(base, train_lib.model_config(base))
  print(data.summary())
  print(f'{len(runs)} runs x {steps} steps x {args.batch_size * data.seq_len:,} tokens')

  results: list[dict[str, Any]] = []
  start = time.perf_counter()
  for i, (label, name, lr) in enumerate(runs):
    tc = dataclasses.replace(base, optimizer=name, lr=lr)
    r = train_lib.train(tc, data, desc=f'[{i + 1}/{len(runs)}] {label}')
    r['label'] = label
    del r['history']['aux']  # keep the JSON small; loss/ce/grad_norm stay
    results.append(r)
    write(results, out, command, time.perf_counter() - start, args.long)
    print(f'{label}: final val loss {r["final"]["loss"]:.4f} '
          f'({r["timing"]["wall_s"]:.0f} s)', flush=True)
  print(write(results, out, command, time.perf_counter() - start, args.long))


def best_adamw(results: list[dict[str, Any]]) -> dict[str, Any] | None:
  sweep = [r for r in results if r['optimizer']['optimizer'] == 'adamw']
  return min(sweep, key=lambda r: r['final']['loss']) if sweep else None


def readout(results: list[dict[str, Any]]) -> list[str]:
  """The comparisons the paper's claims turn on, as sentences with numbers."""
  by = {r['label']: r for r in results}
  lines = []
  sk = by.get('skewadam')
  same = by.get('adamw@0.0003')
  best = best_adamw(results)
  if sk and same:
    gap = sk['final']['loss'] - same['final']['loss']
    lines.append(f'SkewAdam {sk["final"]["loss"]:.4f} vs AdamW (same lr 3e-4) '
                 f'{same["final"]["loss"]:.4f}: gap {gap:+.4f} nats/byte '
                 f'({100 * gap / same["final"]["loss"]:+.2f}%).')
  if sk and best:
    gap = sk['final']['loss'] - best['final']['loss']
    lines.append(f'SkewAdam vs AdamW at its best lr {best["optimizer"]["lr"]:g} '
                 f'({best["final"]["loss"]:.4f}): gap {gap:+.4f} nats/byte '
                 f'({100 * gap / best["final"]["loss"]:+.2f}%).')
  pm = by.get('adampm-s8')
  if pm and same:
    rel = pm['final']['loss'] / same['final']['loss'] - 1
    lines.append(f'AdamPM (s=8) {pm["final"]["loss"]:.4f} vs Adam(W) same lr '
                 f'{same["final"]["loss"]:.4f}: {100 * rel:+.2f}% '
                 f'({"within" if abs(rel) <= 0.01 else "outside"} 1%).')
  return lines


def write(results: list[dict[str, Any]], out: Path, command: str, wall: float,
          long: bool) -> str:
  """Writes JSON, PNG and markdown; returns the markdown."""
  stem = 'quality_long' if long else 'quality'
  machine = results[0]['machine']
  cfg = results[0]['config']
  md = [f'## Optimizer comparison: `{cfg["preset"]}` MoE LM, {cfg["steps"]} steps x '
        f'{results[0]["timing"]["tokens_per_step"]:,} tokens', '',
        f'Command: `{command}`  ', f'Data: {results[0]["data"]}  ',
        f'Machine: {machine["cpu_count"]} CPU cores, {machine["platform"]}, jax '
        f'{machine["jax"]}, optax {machine["optax"]}, flax {machine["flax"]}; total wall '
        f'{wall / 60:.1f} min (shared machine, load average {machine["load_avg"]}).', '',
        train_lib.summary_table(results), '',
        'aux / floor: the validation Switch aux loss over the value a perfectly balanced '
        'router gives (1.0 = at the floor). State bytes: float32 optimizer state.', '']
  md += [f'* {line}' for line in readout(results)]
  text = '\n'.join(md)
  payload = {'command': command, 'wall_s': wall, 'machine': machine, 'results': results,
             'readout': readout(results)}
  (out / f'{stem}.json').write_text(json.dumps(payload, indent=1, default=str))
  (out / f'{stem}.md').write_text(text + '\n')
  train_lib.plot_losses(results, out / f'{stem}.png',
                        title=f'validation loss, {cfg["preset"]} MoE LM, {cfg["steps"]} steps')
  return text


if __name__ == '__main__':
  assert set(opt_lib.OPTIMIZERS) >= {r[1] for r in DEFAULT_RUNS}
  main()
