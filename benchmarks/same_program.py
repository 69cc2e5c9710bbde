"""Whether a change kept every preset's compiled optimizer step: here against a baseline.

A refactor that must change no result should also change no program: if the optimised
XLA module of `jit(update + apply)` is the same before and after, the step's time and
memory are the same by construction, and no timing noise can hide a regression. For
each preset this compiles the donated update + apply on the example MoE model's
parameters (`examples/moe_lm`, preset `small` by default; abstract arguments, nothing
allocated) once with this checkout's package and once with the baseline's, each in a
fresh process, and compares:

* the optimised HLO module, with its metadata (source lines, op names) and the module's
  name removed, by sha256: `same` when equal;
* the lowered (StableHLO) module, without source locations: what XLA is given, so
  `same` means the same compile work (and the optimised program's `same` the same step);
* its kernel count (the entry computation's instructions that launch work: fusions,
  custom calls, copies and the like; parameters, constants, tuples and bitcasts are
  free);
* XLA's temp buffer (`memory_analysis()`) and the state's bytes (`eval_shape(init)`);
* the CPU seconds of tracing + lowering and of XLA's compile: medians over `--rounds`
  fresh processes per side, the sides alternating (`compile_time.py` times a whole
  training step against AdamW).

  git worktree add /tmp/baseline <commit>        # the checkout to compare against
  python benchmarks/same_program.py --baseline /tmp/baseline

Writes results/same_program.{json,md} under benchmarks/ (`--out`; `--report-only` re-renders
the markdown of a saved JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
import re
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ('adamw', 'skewadam', 'skewadam-adam-eps-tiers', 'skewadam-muon-tiers',
           'skewadam-muon-coded-tiers', 'adampm')  # keys of compile_time.OPTIMIZERS
# Entry-computation instructions that launch no kernel.
FREE = ('parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast')


def _optimizer(name: str):
  """`compile_time.py`'s optimizer of that name. Imported once this process's package is
  on `sys.path` (`--one`: the checkout measured first, this repository after it), so that
  `_common` finds the repository on the path and leaves the order as it is."""
  import compile_time  # noqa: PLC0415
  return compile_time.OPTIMIZERS[name]()


# Sections of the module's text that only say where each instruction came from.
SOURCE_SECTIONS = ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames')


def normalised_hlo(text: str) -> str:
  """The optimised module's text without what names where it came from (the module's
  name, each instruction's metadata, the source tables of its stack frames, the
  counters in its names)."""
  kept, skipping = [], False
  for line in text.splitlines():
    if line.strip() in SOURCE_SECTIONS:
      skipping = True
    elif skipping and not line.strip():
      skipping = False
    elif not skipping:
      kept.append(line)
  text = '\n'.join(kept)
  text = re.sub(r',?\s*metadata=\{[^}]*\}', '', text)
  text = re.sub(r',?\s*stack_frame_id=\d+', '', text)
  text = re.sub(r'^HloModule \S+', 'HloModule m', text, flags=re.M)
  # Instruction and computation names carry counters that follow the order in which
  # the program was built (`add.51` in one, `add.44` in the other): numbered by first
  # use, so that only what the program does is compared.
  # Parameters are named bare in a computation's header (`(param_0.12: f32[8]) -> ...`)
  # and with '%' where used.
  names: dict[str, str] = {}

  def number(m: re.Match) -> str:
    name = m.group(0) if m.group(0).startswith('%') else '%' + m.group(0)
    return names.setdefault(name, f'%v{len(names)}')

  return re.sub(r'%[\w.-]+|(?<=[(, ])[A-Za-z_][\w.-]*(?=: )', number, text)


def kernel_count(text: str) -> int:
  entry = text[text.index('ENTRY'):]
  entry = entry[:entry.index('\n}')]
  ops = re.findall(r'=\s*\S+\s+([a-z][\w-]*)\(', entry)
  return sum(op not in FREE for op in ops)


def measure(preset: str, model_preset: str) -> dict[str, Any]:
  """One preset's compiled step, with whichever `skewadam_jax` this process imports."""
  from flax import nnx  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415
  import skewadam_jax  # noqa: PLC0415
  from examples.moe_lm.model import abstract_params, get_config  # noqa: PLC0415

  params = nnx.to_pure_dict(abstract_params(get_config(model_preset)))
  tx = _optimizer(preset)
  state = jax.eval_shape(tx.init, params)

  def step(p, g, s):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  t0 = time.process_time()
  lowered = jax.jit(step, donate_argnums=(0, 2)).lower(params, params, state)
  t1 = time.process_time()
  compiled = lowered.compile()
  t2 = time.process_time()
  text = compiled.as_text()
  mem = compiled.memory_analysis()
  lowered_text = re.sub(r'loc\([^)]*\)|#loc\d*( = .*)?', '', lowered.as_text())
  return {
      'package': str(Path(skewadam_jax.__file__).resolve().parents[1]),
      'sha256': hashlib.sha256(normalised_hlo(text).encode()).hexdigest(),
      'lowered_sha256': hashlib.sha256(lowered_text.encode()).hexdigest(),
      'kernels': kernel_count(text),
      'temp_bytes': int(mem.temp_size_in_bytes) if mem is not None else None,
      'state_bytes': int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))),
      'lower_cpu_s': t1 - t0, 'compile_cpu_s': t2 - t1,
  }


def _sample(checkout: Path, preset: str, model_preset: str) -> dict[str, Any]:
  env = dict(os.environ, PYTHONPATH=str(checkout), JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, __file__, '--one', preset, '--model', model_preset],
                        env=env, cwd=ROOT, capture_output=True, text=True, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(xs: list[float]) -> float:
  xs = sorted(xs)
  return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _merge(samples: list[dict[str, Any]]) -> dict[str, Any]:
  """One side's samples: the program (the same in every fresh process) and the median
  CPU seconds."""
  first = samples[0]
  assert all(s['sha256'] == first['sha256'] for s in samples), 'a program changed between runs'
  return dict(first, lower_cpu_s=_median([s['lower_cpu_s'] for s in samples]),
              compile_cpu_s=_median([s['compile_cpu_s'] for s in samples]),
              samples=len(samples))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--baseline', type=Path, help='root of the checkout to compare against')
  ap.add_argument('--presets', nargs='*', default=list(PRESETS), choices=PRESETS)
  ap.add_argument('--model', default='small', help='examples/moe_lm preset')
  ap.add_argument('--rounds', type=int, default=5,
                  help='fresh processes per side and preset (medians of the CPU seconds)')
  ap.add_argument('--one', help=argparse.SUPPRESS)
  ap.add_argument('--report-only', action='store_true',
                  help='re-render the markdown of the JSON at --out')
  ap.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'same_program'))
  a = ap.parse_args()
  if a.one:
    # The package comes from PYTHONPATH (the checkout measured); the example model from
    # this checkout, after it, so that both sides compile the same model.
    sys.path.append(str(ROOT))
    print(json.dumps(measure(a.one, a.model)))
    return
  if a.report_only:
    out = Path(a.out)
    out.with_suffix('.md').write_text(render(json.loads(out.with_suffix('.json').read_text())))
    return
  if a.baseline is None:
    ap.error('--baseline is required')
  from tqdm import tqdm  # noqa: PLC0415
  checkouts = {'baseline': a.baseline.resolve(), 'here': ROOT}
  samples: dict[str, dict[str, list]] = {s: {p: [] for p in a.presets} for s in checkouts}
  jobs = [(r, p) for r in range(a.rounds) for p in a.presets]
  for r, p in tqdm(jobs, desc='fresh processes (pairs)'):
    # Alternate which side goes first, so that drifting load hits both alike.
    for side in (('baseline', 'here') if r % 2 == 0 else ('here', 'baseline')):
      samples[side][p].append(_sample(checkouts[side], p, a.model))
  sides = {s: {p: _merge(v) for p, v in by.items()} for s, by in samples.items()}
  base_commit = subprocess.run(['git', '-C', str(a.baseline), 'rev-parse', '--short', 'HEAD'],
                               capture_output=True, text=True).stdout.strip()
  here_commit = subprocess.run(['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD'],
                               capture_output=True, text=True).stdout.strip()
  rows = []
  for p in a.presets:
    b, h = sides['baseline'][p], sides['here'][p]
    rows.append({'preset': p, 'same': b['sha256'] == h['sha256'],
                 'same_lowered': b.get('lowered_sha256') == h.get('lowered_sha256'),
                 'baseline': b, 'here': h})
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  result = {'baseline': base_commit, 'here': here_commit, 'model': a.model, 'rows': rows}
  out.with_suffix('.json').write_text(json.dumps(result, indent=1))
  text = render(result)
  print(text)
  out.with_suffix('.md').write_text(text)


def _same(flag: Optional[bool]) -> str:
  return '-' if flag is None else ('same' if flag else 'differs')


def render(result: dict[str, Any]) -> str:
  """The markdown table of a comparison (`--report-only` re-renders a saved one)."""
  lines = [f"## The compiled optimizer step at {result['here']} against {result['baseline']}",
           '', f"`python benchmarks/same_program.py --baseline <checkout of "
           f"{result['baseline']}>`; update + apply, donated, on the `{result['model']}` "
           'example model (XLA:CPU). CPU seconds: medians over '
           f"{result['rows'][0]['here'].get('samples', 1)} fresh processes per side, the "
           'sides alternating.', '',
           '| preset | optimised program | lowered program | kernels | temp B | state B '
           '| trace + lower CPU s | compile CPU s |', '|---|---|---|---|---|---|---|---|']

  def pair(b, h, fmt):
    return f'{fmt.format(b)} -> {fmt.format(h)}'

  for row in result['rows']:
    b, h = row['baseline'], row['here']
    lines.append(
        f"| {row['preset']} | {'same' if row['same'] else 'differs'} "
        f"| {_same(row.get('same_lowered'))} "
        f"| {pair(b['kernels'], h['kernels'], '{}')} "
        f"| {pair(b['temp_bytes'], h['temp_bytes'], '{:,}')} "
        f"| {pair(b['state_bytes'], h['state_bytes'], '{:,}')} "
        f"| {pair(b['lower_cpu_s'], h['lower_cpu_s'], '{:.2f}')} "
        f"| {pair(b['compile_cpu_s'], h['compile_cpu_s'], '{:.2f}')} |")
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  main()
