"""Does the README's Quickstart train? Its snippet against alternatives and AdamW, at 3e-4.

The README's first snippet swaps `optax.adamw(schedule, weight_decay=0.1)` for a
SkewAdam call with the same schedule (peak 3e-4) behind a global-norm clip of 1.0. A
newcomer copies it into their model with AdamW's learning rate; this checks what that
gives on the example MoE LM (`small` preset, std-0.02 init) against the alternatives:

* `skewadam`: the snippet's `sj.skewadam(schedule, weight_decay=0.1)` (published tiers);
* `skewadam-muon`: `tiers=dict(sj.MUON_TIERS, experts=sj.PUBLISHED_TIERS['experts'])`
  (the Muon tiers with the published factored experts);
* `skewadam-adam-eps-router-momentum`: `tiers=sj.ADAM_EPS_TIERS`;
* `skewadam-router-adam-eps-momentum`: `tiers=sj.ADAM_ROUTER_TIERS`;
* `adamw`: `optax.adamw(schedule, weight_decay=0.1)`, the line the snippet replaces.

Each is built by `examples/moe_lm/optimizers.py`'s `make_optimizer` (exactly the
snippet's chain: `clip_by_global_norm(1.0)`, then the optimizer with weight decay 0.1)
and trained by `examples/moe_lm/train.py`'s `train`: the same initial weights, the same
batches in the same order, the same router noise, and the same schedule (linear warmup
over the first `--warmup` steps to the peak `--lr`, cosine to 0 at `--steps`). A
candidate may carry its own peak lr as `name@lr` (e.g. `skewadam@1e-3`).

Prints a markdown table (train loss at the first step and at step `--early`, final
validation loss, its gap to AdamW, optimizer state bytes, dead experts, tokens/s) and
writes it with every run's record to `--out` (`.md` and `.json`).

  taskset -c 0 python benchmarks/quickstart_check.py                 # ~5 runs of 300 steps
  python benchmarks/quickstart_check.py --preset tiny --steps 20 --warmup 2 \\
      --eval-batches 1 --out /tmp/qs      # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import _common  # noqa: E402
from examples import _cli  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402
from examples.moe_lm import optimizers as opt_lib  # noqa: E402
from examples.moe_lm import train as train_lib  # noqa: E402

CANDIDATES = ('skewadam', 'skewadam-muon', 'skewadam-adam-eps-router-momentum',
              'skewadam-router-adam-eps-momentum', 'adamw')
# What each candidate is in the README's snippet.
SNIPPET = {
    'skewadam': 'sj.skewadam(schedule, weight_decay=0.1)  (the README snippet as is)',
    'skewadam-muon': "sj.skewadam(schedule, weight_decay=0.1, tiers=dict(sj.MUON_TIERS, "
                     "experts=sj.PUBLISHED_TIERS['experts']))",
    'skewadam-adam-eps-router-momentum':
        'sj.skewadam(schedule, weight_decay=0.1, tiers=sj.ADAM_EPS_TIERS)',
    'skewadam-router-adam-eps-momentum':
        'sj.skewadam(schedule, weight_decay=0.1, tiers=sj.ADAM_ROUTER_TIERS)',
    'adamw': 'optax.adamw(schedule, weight_decay=0.1)',
}
BASELINE = 'adamw'


def parse_candidate(text: str, default_lr: float) -> tuple[str, float]:
  """`'name'` or `'name@lr'` -> `(name, lr)`; a ValueError for an unknown name or lr."""
  name, _, lr = text.partition('@')
  if name not in opt_lib.OPTIMIZERS:
    raise ValueError(f'candidate {text!r}: optimizer must be one of {opt_lib.OPTIMIZERS}.')
  try:
    value = float(lr) if lr else default_lr
  except ValueError:
    raise ValueError(f'candidate {text!r}: the lr after "@" must be a number.') from None
  if not value > 0:
    raise ValueError(f'candidate {text!r}: the lr must be > 0, not {value}.')
  return name, value


def label(name: str, lr: float) -> str:
  return f'{name} @ {lr:g}'


def summarise(runs: Sequence[tuple[str, float, dict[str, Any]]], early: int
              ) -> list[dict[str, Any]]:
  """One row per run: losses, gap to the baseline at the first lr it ran, state, router."""
  base = next((r for name, _, r in runs if name == BASELINE), None)
  rows = []
  for name, lr, r in runs:
    ce = r['history']['ce']
    dead = r['router'].get('dead_experts')
    rows.append({
        'candidate': label(name, lr), 'optimizer': name, 'lr': lr,
        'snippet': SNIPPET.get(name, name),
        'train_ce_first': ce[0] if ce else None,
        'train_ce_early': ce[early - 1] if len(ce) >= early else None,
        'final_val_loss': r['final']['loss'],
        'vs_baseline_pct': (None if base is None else
                            100 * (r['final']['loss'] / base['final']['loss'] - 1)),
        'state_bytes': r['memory']['total_state_bytes'],
        'dead_experts': None if dead is None else sum(dead),
        'n_experts': r['router'].get('n_experts'),
        'tokens_per_s': r['timing']['tokens_per_s'],
    })
  return rows


def _fmt(x: Optional[float], spec: str) -> str:
  return 'n/a' if x is None else format(x, spec)


def table(rows: Sequence[dict[str, Any]], early: int) -> str:
  """The markdown table of `summarise`'s rows."""
  return _common.markdown_table(
      ['candidate', 'in the snippet', 'train CE, step 1', f'train CE, step {early}',
       'final val loss', f'vs {BASELINE}', 'state bytes', 'dead experts', 'tokens/s'],
      [[r['candidate'], f'`{r["snippet"]}`', _fmt(r['train_ce_first'], '.4f'),
        _fmt(r['train_ce_early'], '.4f'), f'{r["final_val_loss"]:.4f}',
        _fmt(r['vs_baseline_pct'], '+.2f') + ('%' if r['vs_baseline_pct'] is not None else ''),
        f'{r["state_bytes"]:,}',
        'n/a' if r['dead_experts'] is None else f'{r["dead_experts"]} of {r["n_experts"]}',
        _fmt(r['tokens_per_s'], ',.0f')] for r in rows],
      align='ll' + 'r' * 7)


def _relative(path: Path) -> str:
  """`path` relative to the repository when inside it (no machine path in the JSON)."""
  try:
    return str(path.resolve().relative_to(ROOT))
  except ValueError:
    return path.name


def build_parser() -> argparse.ArgumentParser:
  """The command line (underscore spellings accepted too)."""
  p = _cli.parser(__doc__.splitlines()[0])
  _cli.option(p, '--candidates', nargs='+', default=list(CANDIDATES),
              help='optimizers of examples/moe_lm/optimizers.py, each `name` or `name@lr`')
  _cli.option(p, '--lr', type=float, default=3e-4,
              help="peak lr of every candidate without its own (AdamW's in the snippet)")
  _cli.option(p, '--preset', default='small', choices=sorted(model_lib.PRESETS),
              help='model size')
  _cli.option(p, '--steps', type=int, default=300, help='training steps')
  _cli.option(p, '--warmup', type=int, default=30, help='linear warmup steps')
  _cli.option(p, '--early', type=int, default=30,
              help='also report the train loss at this step')
  _cli.option(p, '--batch-size', type=int, default=16, help='sequences per step')
  _cli.option(p, '--eval-batches', type=int, default=8,
              help='validation batches for the final loss')
  _cli.option(p, '--seed', type=int, default=0, help='weights, batches and router noise')
  _cli.option(p, '--out', default=str(_common.RESULTS / 'quickstart_check'),
              help='output stem: writes OUT.md and OUT.json')
  return p


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
  """Trains every candidate, prints the table and writes the `.md` and `.json`."""
  p = build_parser()
  a = p.parse_args(argv)
  for flag, value in (('--steps', a.steps), ('--early', a.early),
                      ('--batch-size', a.batch_size), ('--eval-batches', a.eval_batches)):
    if value < 1:
      p.error(f'{flag} must be >= 1, not {value}')
  if not 0 <= a.warmup < a.steps:
    p.error(f'--warmup must be in [0, --steps), not {a.warmup}')
  try:
    candidates = [parse_candidate(c, a.lr) for c in a.candidates]
  except ValueError as e:
    p.error(str(e))
  runs = []
  data = None
  start = time.perf_counter()
  for name, lr in candidates:
    tc = train_lib.TrainConfig(
        optimizer=name, preset=a.preset, steps=a.steps, batch_size=a.batch_size, lr=lr,
        warmup=a.warmup, eval_every=a.steps, eval_batches=a.eval_batches, seed=a.seed)
    data = data or train_lib.load_data(tc, train_lib.model_config(tc))
    record = train_lib.train(tc, data, desc=label(name, lr))
    runs.append((name, lr, record))
  rows = summarise(runs, a.early)
  text = '\n'.join([
      f'## The Quickstart snippet at lr {a.lr:g}: `{a.preset}` preset, {a.steps} steps '
      f'(warmup {a.warmup}, cosine to 0), batch {a.batch_size}, seed {a.seed}', '',
      'Same initial weights, batches and router noise for every candidate; clip 1.0, '
      'weight decay 0.1. Final val loss: mean over '
      f'{a.eval_batches} validation batches, no router noise.', '',
      table(rows, a.early), '',
      f'Command: `{_common.command()}`; wall {time.perf_counter() - start:.0f} s.',
      _common.machine_line(_common.machine())])
  print('\n' + text)
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix('.md').write_text(text + '\n')
  _common.write_json(out.with_suffix('.json'), {
      'config': dict(vars(a), out=_relative(out)), 'rows': rows, 'command': _common.command(),
      'machine': _common.machine(),
      'runs': [{'candidate': label(n, lr), 'history': r['history'], 'evals': r['evals'],
                'memory': r['memory'], 'timing': r['timing']} for n, lr, r in runs]})
  print(f'wrote {out.with_suffix(".md")}, {out.with_suffix(".json")}')
  return rows


if __name__ == '__main__':
  main()
