"""Cost of `sj.trace_structure` on a recorded real model, against tracing its loss once.

Run inside the virtualenv of the model's library (see README.md beside this file), from
the repository root:

    $VENVS/maxtext/bin/python tools/real_trees/trace_cost.py --library maxtext --model llama4

Each measurement runs in a fresh process, built as `trace_check.py` builds the model
(abstract params, nothing allocated): `jax.make_jaxpr(fn)(params, *args)` once, and
`sj.trace_structure(fn, params, *args)` once (which traces the same function to a
jaxpr and then analyses it). Reported: wall time, CPU time, the peak of Python's heap
while it ran (`tracemalloc`) and the growth of the process's peak RSS. Prints a
markdown table and writes `benchmarks/results/real_trees_traced/cost_<library>_<model>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _measure(library: str, model: str, what: str, overrides: tuple[str, ...]) -> dict:
  sys.path[:0] = [REPO, HERE]
  import jax  # noqa: PLC0415 - the library's venv decides which jax
  import skewadam_jax as sj  # noqa: PLC0415
  import trace_check  # noqa: PLC0415
  case = trace_check.CASES[library](model, *([overrides] if overrides else []))
  rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  tracemalloc.start()
  wall, cpu = time.perf_counter(), time.process_time()
  with case.context:
    if what == 'make_jaxpr':
      jaxpr = jax.make_jaxpr(case.fn)(case.params, *case.args)
      size = len(jaxpr.eqns)
    else:
      size = len(sj.trace_structure(case.fn, case.params, *case.args).by_path)
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  peak = tracemalloc.get_traced_memory()[1]
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
  return {'what': what, 'wall_s': round(wall, 3), 'cpu_s': round(cpu, 3),
          'python_heap_peak_mib': round(peak / 2**20, 1),
          'peak_rss_growth_mib': round(rss / 1024, 1), 'size': size}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--library', required=True, choices=['gemma', 'easydel', 'maxtext'])
  parser.add_argument('--model', required=True)
  parser.add_argument('--override', action='append', default=[])
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--one', choices=['make_jaxpr', 'trace_structure'], help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(_measure(args.library, args.model, args.one, tuple(args.override))))
    return 0
  rows = []
  for _ in range(args.rounds):  # interleaved, a fresh process each
    for what in ('make_jaxpr', 'trace_structure'):
      cmd = [sys.executable, __file__, '--library', args.library, '--model', args.model,
             '--one', what] + [f'--override={o}' for o in args.override]
      out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
      rows.append(json.loads(out.strip().splitlines()[-1]))
  best = {}
  for row in rows:
    if row['what'] not in best or row['wall_s'] < best[row['what']]['wall_s']:
      best[row['what']] = row
  base = best['make_jaxpr']
  print(f'{args.library}_{args.model}, best of {args.rounds} fresh processes each:\n')
  print('| | wall s | CPU s | Python heap peak MiB | peak RSS growth MiB |')
  print('|---|---:|---:|---:|---:|')
  for what in ('make_jaxpr', 'trace_structure'):
    r = best[what]
    print(f'| `{what}` | {r["wall_s"]} ({r["wall_s"] / base["wall_s"]:.2f}x) | {r["cpu_s"]} | '
          f'{r["python_heap_peak_mib"]} | {r["peak_rss_growth_mib"]} |')
  out = os.path.join(REPO, 'benchmarks', 'results', 'real_trees_traced',
                     f'cost_{args.library}_{args.model}.json')
  with open(out, 'w') as f:
    json.dump({'command': ' '.join(['python', 'tools/real_trees/trace_cost.py'] + (argv or
               sys.argv[1:])), 'rounds': rows, 'best': best}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
