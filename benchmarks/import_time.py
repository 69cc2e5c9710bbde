"""What `import skewadam_jax` adds to `import jax, optax`, each sample a fresh process.

Every sample is a new Python interpreter (a subprocess) that times one statement:
`import jax, optax` (the baseline) or `import jax, optax, skewadam_jax`, in wall-clock
time (`time.perf_counter`) and in the process's CPU time (`time.process_time`).
Interpreter start-up is outside the timed statement. The two are interleaved (the order
alternates from round to round), and the reported cost is the median over rounds of the
difference between the two samples of the same round, so that load from other processes
hits both alike; the medians of each are reported too. On a loaded machine the CPU time
is the figure to read: wall-clock time stretches with the load (a process that gets a
fifth of a core takes five times as long), CPU time much less.

Bytecode: by default every module is imported from its cached bytecode (`.pyc`), as an
installed package is. The samples write their caches under a temporary
`PYTHONPYCACHEPREFIX` (nothing is written into the repository), filled by an untimed
first import of each statement. `--no-bytecode` sets `PYTHONDONTWRITEBYTECODE` and an
empty cache prefix instead, so that the library's ~7,000 lines are compiled from source
at every import (what a checkout run with `PYTHONDONTWRITEBYTECODE=1` pays; jax and
optax are then compiled from source too).

Also reported: which heavy optional packages (Flax, Orbax, matplotlib, equinox, Pallas)
`import skewadam_jax` loads, and the modules with the largest self time in
`python -X importtime` that the library's import adds.

  python benchmarks/import_time.py                      # 15 rounds
  python benchmarks/import_time.py --rounds 31 --no-bytecode

Writes results/import_time.{json,md,png} under benchmarks/ (`--out` to change).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
from typing import Any

import _common  # also puts the repo root on sys.path
from _common import RESULTS
import numpy as np

BASELINE = 'import jax, optax'
WITH_LIBRARY = 'import jax, optax, skewadam_jax'
# Optional packages the library must not import on `import skewadam_jax`: it detects
# Flax's boxed params only when Flax is already loaded, Orbax is the examples', and
# matplotlib the reports' plots (imported when a plot is drawn).
HEAVY = ('flax', 'orbax', 'matplotlib', 'equinox', 'jax._src.pallas', 'tensorflow', 'torch')

_CHILD = '''
import time
t, c = time.perf_counter(), time.process_time()
{stmt}
print(time.perf_counter() - t, time.process_time() - c)
'''


def _env(cache: str | None) -> dict[str, str]:
  """The samples' environment: the repository importable, bytecode cached under
  `cache` (or not written at all when None)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(_common.ROOT),
                                                    env.get('PYTHONPATH', '')]))
  if cache is None:
    env['PYTHONDONTWRITEBYTECODE'] = '1'
    env['PYTHONPYCACHEPREFIX'] = tempfile.mkdtemp(prefix='import_time_empty_')
  else:
    env.pop('PYTHONDONTWRITEBYTECODE', None)
    env['PYTHONPYCACHEPREFIX'] = cache
  return env


def sample(stmt: str, env: dict[str, str]) -> tuple[float, float]:
  """(wall-clock, CPU) seconds that `stmt` takes in a fresh interpreter."""
  out = subprocess.run([sys.executable, '-c', _CHILD.format(stmt=stmt)], env=env,
                       check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
  wall, cpu = out.stdout.strip().splitlines()[-1].split()
  return float(wall), float(cpu)


def heavy_modules(env: dict[str, str]) -> dict[str, bool]:
  """Which of `HEAVY` are in `sys.modules` after `import skewadam_jax` (alone)."""
  code = ('import json, sys; import skewadam_jax; '
          f'print(json.dumps({{m: any(k == m or k.startswith(m + ".") for k in sys.modules) '
          f'for m in {HEAVY!r}}}))')
  out = subprocess.run([sys.executable, '-c', code], env=env, check=True,
                       capture_output=True, text=True, cwd=tempfile.gettempdir())
  return json.loads(out.stdout.strip().splitlines()[-1])


def top_self_times(env: dict[str, str], n: int = 12) -> list[tuple[str, float]]:
  """The `n` modules with the largest self time (ms) among those that
  `import skewadam_jax` adds after `import jax, optax` (`python -X importtime`)."""
  out = subprocess.run([sys.executable, '-X', 'importtime', '-c',
                        f'{BASELINE}; import skewadam_jax'], env=env, check=True,
                       capture_output=True, text=True, cwd=tempfile.gettempdir())
  rows = []
  for line in out.stderr.splitlines():
    parts = line.split('|')
    if len(parts) != 3 or not parts[0].startswith('import time:'):
      continue
    try:
      rows.append((parts[2].rstrip(), int(parts[0].split(':')[1])))
    except ValueError:  # the header line
      continue
  # The library's import starts after the last top-level module of the baseline.
  start = max(i for i, (name, _) in enumerate(rows) if name == ' optax') + 1
  added = [(name.strip(), us / 1e3) for name, us in rows[start:]]
  return sorted(added, key=lambda r: -r[1])[:n]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument('--rounds', type=int, default=15, help='interleaved pairs of samples')
  ap.add_argument('--no-bytecode', action='store_true',
                  help='compile every module from source (PYTHONDONTWRITEBYTECODE=1)')
  ap.add_argument('--out', default=str(RESULTS / 'import_time'),
                  help='output path without suffix')
  args = ap.parse_args()

  with tempfile.TemporaryDirectory(prefix='import_time_pyc_') as cache:
    env = _env(None if args.no_bytecode else cache)
    load_before = _common.load_average()
    for stmt in (BASELINE, WITH_LIBRARY):  # untimed: fills the bytecode cache
      sample(stmt, env)
    base, lib = [], []
    for r in range(args.rounds):
      order = [(BASELINE, base), (WITH_LIBRARY, lib)]
      for stmt, into in (order if r % 2 == 0 else order[::-1]):
        into.append(sample(stmt, env))
      print(f'round {r + 1}/{args.rounds}: wall {base[-1][0]:.3f} s, {lib[-1][0]:.3f} s; '
            f'CPU {base[-1][1]:.3f} s, {lib[-1][1]:.3f} s', flush=True)
    heavy = heavy_modules(env)
    top = top_self_times(env)
    load = _common.load_average()

  b, w = np.asarray(base), np.asarray(lib)  # [rounds, (wall, cpu)]
  stats = {}
  for k, clock in enumerate(('wall', 'cpu')):
    diff = w[:, k] - b[:, k]
    stats[clock] = {'baseline_median_s': float(np.median(b[:, k])),
                    'with_library_median_s': float(np.median(w[:, k])),
                    'added_median_s': float(np.median(diff)),
                    'added_iqr_s': [float(np.percentile(diff, q)) for q in (25, 75)]}
  mode = 'compiled from source' if args.no_bytecode else 'cached bytecode'

  def added(clock: str) -> str:
    st = stats[clock]
    return (f"**{st['added_median_s']:+.3f}** (IQR {st['added_iqr_s'][0]:+.3f} to "
            f"{st['added_iqr_s'][1]:+.3f})")

  rows = [[f'`{BASELINE}`', f"{stats['wall']['baseline_median_s']:.3f}", '—',
           f"{stats['cpu']['baseline_median_s']:.3f}", '—'],
          [f'`{WITH_LIBRARY}`', f"{stats['wall']['with_library_median_s']:.3f}",
           added('wall'), f"{stats['cpu']['with_library_median_s']:.3f}", added('cpu')]]
  table = _common.markdown_table(
      ['statement', 'wall, median (s)', 'added by skewadam_jax, wall (s)', 'CPU, median (s)',
       'added by skewadam_jax, CPU (s)'], rows)
  loaded = [m for m, on in heavy.items() if on]
  m = _common.machine()
  text = '\n'.join([
      table, '',
      f'{args.rounds} interleaved rounds, a fresh process per sample, {mode}; added = the '
      'median over rounds of the difference of the two samples of a round; CPU = the '
      "process's CPU time (`time.process_time`).",
      f'Heavy optional packages loaded by `import skewadam_jax`: '
      f'{", ".join(loaded) if loaded else "none"} (checked: {", ".join(HEAVY)}).', '',
      'Largest self times among the modules the library adds (one `python -X importtime` '
      'run, ms): ' + ', '.join(f'{name} {ms:.1f}' for name, ms in top[:8]) + '.', '',
      f'{_common.machine_line(m)}; load average before / after {load_before[0]:.1f} / '
      f'{load[0]:.1f} (a shared machine: single samples vary several-fold, the paired '
      'median much less)', '', f'`{_common.command()}`', ''])
  print(text)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  _common.write_json(out.with_suffix('.json'), {
      'command': _common.command(), 'machine': m, 'bytecode': not args.no_bytecode,
      'load_average_before': load_before, 'load_average_after': load,
      'baseline': BASELINE, 'with_library': WITH_LIBRARY,
      'baseline_wall_cpu_s': base, 'with_library_wall_cpu_s': lib, **stats,
      'heavy_modules_loaded': heavy, 'top_self_times_ms': top})
  out.with_suffix('.md').write_text(text)
  _plot(b, w, stats, mode, out.with_suffix('.png'))


def _plot(base: np.ndarray, lib: np.ndarray, stats: dict[str, Any], mode: str,
          path: Any) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (ax, *bxs) = plt.subplots(1, 3, figsize=(15, 3.8))
  rounds = np.arange(1, len(base) + 1)
  for k, (clock, style) in enumerate((('wall', 'o-'), ('CPU', 's--'))):
    ax.plot(rounds, base[:, k], style, color='0.5', label=f'{BASELINE} ({clock})')
    ax.plot(rounds, lib[:, k], style, color='C0', label=f'{WITH_LIBRARY} ({clock})')
  ax.set_xlabel('round')
  ax.set_ylabel('import time (s)')
  ax.set_title(f'each sample a fresh process ({mode})', fontsize=10)
  ax.legend(fontsize=7)
  # One panel per clock: on a loaded machine the wall-clock differences are seconds wide,
  # and would hide the CPU ones.
  for k, (bx, clock, color) in enumerate(zip(bxs, ('wall', 'cpu'), ('C1', 'C0'))):
    added = stats[clock]['added_median_s']
    bx.plot(rounds, lib[:, k] - base[:, k], 'o', color=color)
    bx.axhline(added, color=color, lw=1, label=f'median {added:+.3f} s')
    bx.axhline(0.1, color='C3', lw=1, ls='--', label='goal +0.1 s')
    bx.axhline(0.0, color='0.5', lw=0.8)
    bx.set_xlabel('round')
    bx.set_ylabel('with skewadam_jax - without (s)')
    bx.set_title(f'added by import skewadam_jax, {clock} time', fontsize=10)
    bx.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == '__main__':
  main()
