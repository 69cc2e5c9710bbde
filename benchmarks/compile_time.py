"""Compile time of a whole training step, each optimizer against `optax.adamw`.

Two steps, each lowered from abstract arguments (`jax.ShapeDtypeStruct`s: nothing is
allocated) and compiled with the jit of a fresh function every time, so that no
compilation cache is hit:

* `model`: the example MoE language model's training step (examples/moe_lm: forward,
  backward, optimizer update, apply), preset `small` by default;
* `tree32`: a 32-layer MoE-shaped parameter tree (Mixtral-like: attention, two norms,
  a router and 8 stacked SwiGLU experts per layer, embedding and head), whose step is
  the optimizer update and apply on given gradients: what the optimizer adds to a
  large model's compile.

Each sample runs in a fresh Python process (this script with `--one`), so that it
measures what a user's first step costs: no tracing cache, no compilation cache, no
jaxpr of an earlier optimizer to reuse. The process imports everything, compiles a
trivial function (backend start-up) and traces the model's abstract init first (all
common to every optimizer, and no part of what the optimizer costs), then times the
optimizer's `init` trace and the step's trace + lower and its XLA compile. Rounds are
interleaved (each round runs every optimizer once, in a rotating order), and the
reported ratio is the median over rounds of `time(opt) / time(adamw)` of the same
round, so that load from other processes hits all optimizers alike. Also reported: the
same with the process's CPU time (`time.process_time`, every thread) instead of
wall-clock time, which other processes on a loaded machine disturb less, and the
optimised HLO's instruction count and, on XLA:CPU, its kernel count. Last, on XLA:CPU,
one more fresh process per optimizer with `XLA_FLAGS=--xla_dump_to=DIR` counts what code
generation compiled for the step: its LLVM modules (one per distinct kernel: leaves of
one shape share theirs) and the bytes of their optimised LLVM IR. Most of XLA:CPU's
compile time is that code generation, with a fixed cost per module (about 20-30 ms on
2 cores, however small the kernel), and these counts carry none of the timing noise
(`--no-generated-code` skips them).

  python benchmarks/compile_time.py                     # both steps, 3 rounds
  python benchmarks/compile_time.py --steps model --rounds 5
  python benchmarks/compile_time.py --steps model --optimizers skewadam-muon-tiers
  python benchmarks/compile_time.py --kernel-cost       # compile time per kernel, by op
  python benchmarks/compile_time.py --steps model --rounds 5 --phases
                                                        # XLA's phases, by its own timers
  python benchmarks/compile_time.py --steps model --rounds 5 --out \
      benchmarks/results/compile_time_coded_tiers --optimizers skewadam-muon-coded-tiers \
      skewadam-muon-coded-fp32 skewadam-muon-coded-fp32-hidden \
      skewadam-muon-coded-fp32-experts skewadam-muon-coded-fp32-backbone
                                                        # MUON_CODED_TIERS' codes, by tier

Writes results/compile_time.{json,md,png} under benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import _common  # also puts the repo root on sys.path
from _common import RESULTS

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import skewadam_jax as sj

LR = 1e-3
WD = 0.1

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    'adamw': lambda: optax.adamw(LR, weight_decay=WD),
    'skewadam': lambda: sj.skewadam(LR, weight_decay=WD),
    'skewadam-adam-eps-tiers': lambda: sj.skewadam(LR, weight_decay=WD, tiers=sj.ADAM_EPS_TIERS),
    'skewadam-muon-tiers': lambda: sj.skewadam(LR, weight_decay=WD, tiers=sj.MUON_TIERS),
    'skewadam-muon-coded-tiers': lambda: sj.skewadam(LR, weight_decay=WD,
                                                     tiers=sj.MUON_CODED_TIERS),
    'adampm': lambda: sj.adampm(LR, weight_decay=WD, group_size=8),
    # Where MUON_CODED_TIERS' compile goes: the same policy with one tier's codes (or
    # every tier's) replaced by fp32 momentum.
    'skewadam-muon-coded-fp32': lambda: _coded_without('backbone', 'hidden', 'experts'),
    'skewadam-muon-coded-fp32-hidden': lambda: _coded_without('hidden'),
    'skewadam-muon-coded-fp32-experts': lambda: _coded_without('experts'),
    'skewadam-muon-coded-fp32-backbone': lambda: _coded_without('backbone'),
}
# The optimizers a run compiles unless told (`--optimizers`): the policies.
DEFAULT = ('adamw', 'skewadam', 'skewadam-adam-eps-tiers', 'skewadam-muon-tiers',
           'skewadam-muon-coded-tiers', 'adampm')
LABELS = {
    'adamw': 'optax.adamw',
    'skewadam': 'SkewAdam (published tiers)',
    'skewadam-adam-eps-tiers': 'SkewAdam (ADAM_EPS_TIERS)',
    'skewadam-muon-tiers': 'SkewAdam (MUON_TIERS)',
    'skewadam-muon-coded-tiers': 'SkewAdam (MUON_CODED_TIERS)',
    'adampm': 'AdamPM (s = 8)',
    'skewadam-muon-coded-fp32': 'MUON_CODED_TIERS, fp32 momentum',
    'skewadam-muon-coded-fp32-hidden': "MUON_CODED_TIERS, hidden tier's momentum fp32",
    'skewadam-muon-coded-fp32-experts': "MUON_CODED_TIERS, experts' momentum fp32",
    'skewadam-muon-coded-fp32-backbone': "MUON_CODED_TIERS, backbone's momentum fp32",
}


def _coded_without(*names: str) -> optax.GradientTransformation:
  """`MUON_CODED_TIERS` with the momentum of the tiers `names` in fp32 (no codec)."""
  return sj.skewadam(LR, weight_decay=WD, tiers=_common.uncoded(sj.MUON_CODED_TIERS, names))


def tree32(layers: int = 32, d: int = 256, f: int = 512, experts: int = 8,
           vocab: int = 1024, heads: int = 8, kv_heads: int = 2, head_dim: int = 32
           ) -> dict[str, Any]:
  """Abstract params of a Mixtral-like MoE with `layers` unscanned layers."""
  S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params: dict[str, Any] = {'embed': {'embedding': S(vocab, d)},
                            'final_norm': {'scale': S(d)}, 'lm_head': {'kernel': S(d, vocab)}}
  for i in range(layers):
    params[f'layers_{i}'] = {
        'attn': {'q_proj': {'kernel': S(d, heads * head_dim)},
                 'k_proj': {'kernel': S(d, kv_heads * head_dim)},
                 'v_proj': {'kernel': S(d, kv_heads * head_dim)},
                 'o_proj': {'kernel': S(heads * head_dim, d)}},
        'input_norm': {'scale': S(d)},
        'post_attn_norm': {'scale': S(d)},
        'moe': {'router': {'kernel': S(d, experts)},
                'experts': {'w1': S(experts, d, f), 'w3': S(experts, d, f),
                            'w2': S(experts, f, d)}},
    }
  return params


def tree_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
  """`(params, opt_state, grads) -> (params, opt_state)`, donated: update and apply."""

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def tree_args(tx: optax.GradientTransformation) -> tuple[Any, ...]:
  params = tree32()
  return params, jax.eval_shape(tx.init, params), params


def model_parts(preset: str) -> tuple[Any, Any, Any, Any, Any]:
  """What the example's step needs besides the optimizer: its graph, abstract params and
  other variables, a batch and a key. Built before the clock starts: importing Flax
  (and the example's Orbax helpers) and tracing the model's init are no part of what
  the optimizer adds to a step's compile, and counting them would shrink every ratio."""
  from flax import nnx

  from examples.moe_lm import model as model_lib
  from examples.moe_lm import train as train_lib

  cfg = model_lib.get_config(preset)
  graphdef, params, rest = nnx.eval_shape(lambda: train_lib.init_model(cfg, 0))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rest)
  batch = jax.ShapeDtypeStruct((16, cfg.max_len + 1), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  return graphdef, params, rest, batch, key


def model_step(tx: optax.GradientTransformation, parts: tuple[Any, ...]
               ) -> tuple[Callable, tuple]:
  """The example's jitted training step and its abstract arguments (`parts` from
  `model_parts`); the optimizer's `init` is traced here, as a user's first step runs it."""
  from examples.moe_lm import train as train_lib

  graphdef, params, rest, batch, key = parts
  state = jax.eval_shape(tx.init, params)
  step = train_lib.make_train_step(graphdef, tx, False)
  return step, (params, state, rest, batch, key)


def kernels(hlo: str) -> int:
  """Top-level fusions and other kernels of an optimised HLO module's entry."""
  entry = hlo[hlo.index('ENTRY'):]
  return len(re.findall(r'= [^ ]+ (fusion|custom-call|reduce|copy|sort|dot)\(', entry))


def compile_once(name: str, which: str, preset: str) -> dict[str, float]:
  """Lowers and compiles one fresh jit of `which` with optimizer `name`."""
  jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile()  # backend start-up, untimed
  parts = model_parts(preset) if which == 'model' else None  # untimed: no optimizer in it
  tx = OPTIMIZERS[name]()
  t0, c0 = time.perf_counter(), time.process_time()
  if which == 'tree32':
    fn, args = jax.jit(tree_step(tx), donate_argnums=(0, 1)), tree_args(tx)
  else:
    fn, args = model_step(tx, parts)
  lowered = fn.lower(*args)
  t1, c1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  hlo = compiled.as_text()
  return {'lower_s': t1 - t0, 'compile_s': t2 - t1, 'total_s': t2 - t0,
          'lower_cpu_s': c1 - c0, 'compile_cpu_s': c2 - c1, 'total_cpu_s': c2 - c0,
          'hlo_instructions': hlo.count('\n  '), 'kernels': kernels(hlo)}


def compile_in_fresh_process(name: str, which: str, preset: str) -> dict[str, float]:
  """`compile_once` in a new Python process (this script with `--one`)."""
  out = subprocess.run([sys.executable, __file__, '--one', which, name, '--preset', preset],
                       check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def generated_code(name: str, which: str, preset: str) -> dict[str, Optional[float]]:
  """The step's LLVM modules and optimised LLVM IR (KB) on XLA:CPU, from the dump of a
  fresh process (`--xla_dump_to`); None for both on a backend that dumps no LLVM IR."""
  with tempfile.TemporaryDirectory() as d:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={d}".strip()
    subprocess.run([sys.executable, __file__, '--one', which, name, '--preset', preset],
                   check=True, capture_output=True, text=True,
                   env=dict(os.environ, XLA_FLAGS=flags))
    # The step is `jit(step)` for both steps; the start-up compile is another module.
    files = list(Path(d).glob('*.jit_step.*ir-with-opt.ll'))
    if not files:
      return {'llvm_modules': None, 'llvm_ir_kb': None}
    return {'llvm_modules': float(len(files)),
            'llvm_ir_kb': sum(f.stat().st_size for f in files) / 1000}


# XLA:CPU's own timers, printed at VLOG level 1 by the files below, each line
# `<what> time: <t> (<us> us) (cumulative: ...)` when its scope ends. Only these files
# log (`TF_CPP_VMODULE`): at `TF_CPP_MAX_VLOG_LEVEL=1` every file does, and the dataflow
# analysis that copy insertion runs writes a line per HLO value (33 MB for 80 coded
# leaves), which more than doubled the compile being timed and made copy insertion look
# like the largest HLO pass (415 ms where it takes 23).
TIMER_FILES = ('hlo_pass_pipeline', 'cpu_compiler', 'ir_compiler', 'fusion_compiler')
_TIMER = re.compile(r'\] (.*?) time: [^(]*\((\d+) us\)')
_LOGGED_FILE = re.compile(r'^[IWE]\d{4} [\d:.]+ +\d+ ([\w.]+)\.cc:\d+\]', re.M)
PHASES = {  # column -> what the timer's name starts with (the step's module: jit_step)
    'hlo_passes_ms': 'Running HLO passes on [jit_step]',
    'copy_insertion_ms': 'HLO pass: copy-insertion',
    'kernels_ms': 'Compiled ',  # each kernel's LLVM (and MLIR) module, summed
    'backend_ms': 'Compiling [jit_step]',
}


def timer_env() -> dict[str, str]:
  """The environment in which XLA:CPU prints its compile timers and little else."""
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0', TF_CPP_MAX_VLOG_LEVEL='0',
              TF_CPP_VMODULE=','.join(f'{f}=1' for f in TIMER_FILES))


def xla_phases(name: str, which: str, preset: str) -> dict[str, float]:
  """Where XLA:CPU's compile of the step spends its time, by its own timers, from a
  fresh process: HLO passes (of which copy insertion), the kernels' module compiles
  (summed over kernels: threads overlap), the whole backend (code generation); and the
  step's compile CPU time in that process (`compile_cpu_s`: the timers' logging costs
  little). Only the step's compile is counted: every timer line after the start-up
  compile's last. `other_lines`: the log lines of files other than `TIMER_FILES` (a
  few INFO lines; hundreds of thousands when every file logs at VLOG level 1)."""
  proc = subprocess.run([sys.executable, __file__, '--one', which, name, '--preset', preset],
                        check=True, capture_output=True, text=True, env=timer_env())
  err = proc.stderr
  timers = [(m.group(1), int(m.group(2)) / 1000) for m in _TIMER.finditer(err)]
  done = [i for i, (what, _) in enumerate(timers)
          if what.startswith('Compiling [') and '[jit_step]' not in what]
  step = timers[done[-1] + 1:] if done else timers
  out = {key: sum(ms for what, ms in step if what.startswith(prefix))
         for key, prefix in PHASES.items()}
  if not out['backend_ms']:
    raise RuntimeError('No XLA:CPU compile timers in the output of this jaxlib with '
                       f'TF_CPP_VMODULE={timer_env()["TF_CPP_VMODULE"]}: --phases needs '
                       'them.')
  out['compile_cpu_s'] = json.loads(proc.stdout.strip().splitlines()[-1])['compile_cpu_s']
  out['other_lines'] = sum(1 for f in _LOGGED_FILE.findall(err) if f not in TIMER_FILES)
  return out


# Kernels of `--kernel-cost`: one elementwise expression each, on a float32 array.
KERNEL_OPS: dict[str, Callable[[jax.Array], jax.Array]] = {
    'x * 2 + 1': lambda x: x * 2.0 + 1.0,
    '3 / x': lambda x: 3.0 / x,
    'sqrt(x)': jnp.sqrt,
    'rsqrt(x)': jax.lax.rsqrt,  # also what XLA makes of `a / sqrt(x)`
    'x ** -0.5': lambda x: x ** -0.5,
}


def kernel_cost(counts: tuple[int, ...] = (10, 80), op: str = 'x * 2 + 1'
                ) -> list[tuple[int, float]]:
  """The compile CPU time of one jit holding `n` distinct small kernels (`op`, a key of
  `KERNEL_OPS`, on `n` shapes [17 + i, 33]), for each `n`: what each kernel costs however
  little it computes (XLA:CPU compiles one LLVM module per distinct kernel)."""
  jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile()  # backend start-up
  fn = KERNEL_OPS[op]
  out = []
  for n in counts:
    args = [jax.ShapeDtypeStruct((17 + i, 33), jnp.float32) for i in range(n)]
    # The floor keeps the roots' operands positive, as an optimizer's `max(v, eps)` does.
    lowered = jax.jit(lambda xs: [fn(jnp.maximum(x, 1e-8)) for x in xs]).lower(args)
    c0 = time.process_time()
    lowered.compile()
    out.append((n, time.process_time() - c0))
  return out


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == '--one':  # a sample, in its own process
    one = argparse.ArgumentParser()
    one.add_argument('--one', nargs=2, metavar=('STEP', 'OPTIMIZER'))
    one.add_argument('--preset', default='small')
    a = one.parse_args()
    print(json.dumps(compile_once(a.one[1], a.one[0], a.preset)))
    return
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument('--steps', nargs='+', default=['model', 'tree32'],
                  choices=('model', 'tree32'), help='which training steps to compile')
  ap.add_argument('--optimizers', nargs='+', default=list(DEFAULT),
                  choices=list(OPTIMIZERS), help='adamw is always included')
  ap.add_argument('--rounds', type=int, default=3, help='interleaved rounds')
  ap.add_argument('--preset', default='small', help='example model preset')
  ap.add_argument('--out', default=str(RESULTS / 'compile_time'),
                  help='output path without suffix')
  ap.add_argument('--no-generated-code', dest='generated_code', action='store_false',
                  help="skip counting the step's LLVM modules and IR (XLA:CPU)")
  ap.add_argument('--kernel-cost', action='store_true',
                  help="only measure XLA's compile CPU time per distinct kernel and exit")
  ap.add_argument('--phases', action='store_true',
                  help="only measure, by XLA:CPU's own timers, where each step's compile "
                  'spends its time (HLO passes, kernels, backend) and exit')
  args = ap.parse_args()
  if args.phases:
    _phases(args)
    return
  if args.kernel_cost:
    print('| kernel | distinct kernels | compile CPU (s) | ms per kernel |\n|---|---:|---:|---:|')
    for op in KERNEL_OPS:
      for n, seconds in kernel_cost(op=op):
        print(f'| `{op}` | {n} | {seconds:.2f} | {1000 * seconds / n:.1f} |', flush=True)
    return
  names = ['adamw'] + [n for n in args.optimizers if n != 'adamw']

  load_before = _common.load_average()
  runs = interleaved(names, args.steps, args.rounds, args.preset,
                     compile_in_fresh_process, 'compiling')
  code: dict[str, dict[str, dict[str, Optional[float]]]] = {w: {} for w in args.steps}
  if args.generated_code:
    for which in args.steps:
      for name in tqdm(names, desc=f'generated code, {which}'):
        code[which][name] = generated_code(name, which, args.preset)

  rows, results = [], {}
  for which in args.steps:
    base = runs[which]['adamw']
    for name in names:
      mine = runs[which][name]
      ratio = float(np.median([m['total_s'] / b['total_s'] for m, b in zip(mine, base)]))
      cpu_ratios = [m['total_cpu_s'] / b['total_cpu_s'] for m, b in zip(mine, base)]
      cpu_ratio = float(np.median(cpu_ratios))
      # The spread of the rounds: on a shared machine a single round's ratio moves by
      # +-0.1, so a median near a goal needs its quartiles beside it.
      cpu_iqr = [float(q) for q in np.percentile(cpu_ratios, [25, 75])]
      med = {k: float(np.median([m[k] for m in mine])) for k in mine[0]}
      gen = code[which].get(name, {'llvm_modules': None, 'llvm_ir_kb': None})
      base_ir = code[which].get('adamw', {}).get('llvm_ir_kb')
      ir_ratio = (gen['llvm_ir_kb'] / base_ir if gen['llvm_ir_kb'] is not None and base_ir
                  else None)
      results.setdefault(which, {})[name] = dict(med, ratio_vs_adamw=ratio,
                                                 cpu_ratio_vs_adamw=cpu_ratio,
                                                 cpu_ratio_iqr=cpu_iqr, **gen,
                                                 llvm_ir_ratio_vs_adamw=ir_ratio, rounds=mine)
      rows.append([which, LABELS[name], f"{med['lower_s']:.2f}", f"{med['compile_s']:.2f}",
                   f"{med['total_s']:.2f}", f'{ratio:.2f}x', f"{med['lower_cpu_s']:.2f}",
                   f"{med['compile_cpu_s']:.2f}",
                   f'{cpu_ratio:.2f}x [{cpu_iqr[0]:.2f}-{cpu_iqr[1]:.2f}]',
                   int(med['hlo_instructions']), int(med['kernels']),
                   '-' if gen['llvm_modules'] is None else int(gen['llvm_modules']),
                   '-' if ir_ratio is None else f"{gen['llvm_ir_kb']:.0f} ({ir_ratio:.2f}x)"])
  header = ['step', 'optimizer', 'trace + lower (s)', 'compile (s)', 'total (s)',
            'vs adamw', 'trace + lower, CPU (s)', 'compile, CPU (s)',
            'vs adamw, CPU [quartiles of rounds]',
            'HLO instructions', 'kernels', 'LLVM modules', 'LLVM IR, KB (vs adamw)']
  table = _common.markdown_table(header, rows)
  m = _common.machine()
  load = _common.load_average()
  text = (f'{table}\n\nmedian of {args.rounds} interleaved rounds, a fresh process per '
          f'sample; {_common.machine_line(m)}; load average before / after '
          f'{load_before[0]:.1f} / {load[0]:.1f}\n\n`{_common.command()}`\n')
  print(text)
  out = _common.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  _common.write_json(out.with_suffix('.json'),
                     {'command': _common.command(), 'machine': m, 'fresh_process': True,
                      'load_average_before': load_before, 'load_average_after': load,
                      'results': results})
  out.with_suffix('.md').write_text(text)
  _plot(results, out.with_suffix('.png'))


def interleaved(names: list[str], steps: list[str], rounds: int, preset: str,
                sample: Callable[[str, str, str], dict[str, float]], desc: str
                ) -> dict[str, dict[str, list[dict[str, float]]]]:
  """`sample(name, step, preset)` for every step and name, `rounds` times: each round
  runs every name once, in an order rotated by one per round, so that load from other
  processes hits all of them alike. Returns step -> name -> samples."""
  runs: dict[str, dict[str, list[dict[str, float]]]] = {
      w: {n: [] for n in names} for w in steps}
  with tqdm(total=len(steps) * rounds * len(names), desc=desc) as bar:
    for r in range(rounds):
      for which in steps:
        for name in names[r % len(names):] + names[:r % len(names)]:
          bar.set_postfix_str(f'{which}/{name}')
          runs[which][name].append(sample(name, which, preset))
          bar.update()
  return runs


def _phases(args: argparse.Namespace) -> None:
  """`--phases`: the median of each phase of XLA's compile over `args.rounds`
  interleaved fresh processes, per step and optimizer; a table, and JSON, Markdown and a
  plot next to `args.out` (suffix `_phases`)."""
  names = ['adamw'] + [n for n in args.optimizers if n != 'adamw']
  runs = interleaved(names, args.steps, args.rounds, args.preset, xla_phases,
                     'XLA phases')
  rows, results = [], {}
  keys = tuple(PHASES) + ('compile_cpu_s',)
  for which in args.steps:
    for name in names:
      med = {k: float(np.median([d[k] for d in runs[which][name]])) for k in keys}
      results.setdefault(which, {})[name] = dict(med, rounds=runs[which][name])
      rows.append([which, LABELS[name]] + [f'{med[k]:.0f}' for k in PHASES]
                  + [f"{med['compile_cpu_s']:.2f}"])
  header = ['step', 'optimizer', 'HLO passes (ms)', 'of which copy insertion (ms)',
            'kernel modules, summed (ms)', 'backend (ms)', 'compile, CPU (s)']
  files = ', '.join(f'{f}.cc' for f in TIMER_FILES)
  text = (f'{_common.markdown_table(header, rows)}\n\nmedian of {args.rounds} interleaved '
          "rounds, a fresh process per sample, XLA:CPU's timers (VLOG level 1 in "
          f'{files} only: wall-clock time of each scope; kernel modules compile on '
          'several threads; the last column is the compile of the same process); '
          f'{_common.machine_line(_common.machine())}\n\n`{_common.command()}`\n')
  print(text)
  out = Path(f'{args.out}_phases')
  out.parent.mkdir(parents=True, exist_ok=True)
  _common.write_json(out.with_suffix('.json'), {'command': _common.command(),
                                                'machine': _common.machine(),
                                                'results': results})
  out.with_suffix('.md').write_text(text)
  _phases_plot(results, out.with_suffix('.png'))


def _phases_plot(results: dict[str, Any], path: Any) -> None:
  """Per step: each optimizer's HLO passes (copy insertion marked) and backend, the
  medians of `--phases`, in seconds."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  steps = list(results)
  fig, axes = plt.subplots(1, len(steps), figsize=(7 * len(steps), 4.2), squeeze=False)
  for ax, which in zip(axes[0], steps):
    names = list(results[which])
    sec = {k: np.array([results[which][n][k] for n in names]) / 1000 for k in PHASES}
    x = np.arange(len(names))
    ax.bar(x, sec['hlo_passes_ms'], color='C0', label='HLO passes')
    ax.bar(x, sec['copy_insertion_ms'], color='C9', width=0.4,
           label='of which copy insertion')
    ax.bar(x, sec['backend_ms'], bottom=sec['hlo_passes_ms'], color='C1',
           label='backend (code generation)')
    ax.set_xticks(x, [LABELS[n] for n in names])
    ax.set_ylabel('s (median of rounds, wall clock)')
    ax.set_title(f"{which}: XLA:CPU's compile phases", fontsize=10)
    ax.legend(fontsize=7, loc='upper left')
    ax.tick_params(axis='x', labelsize=7, labelrotation=20)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _plot(results: dict[str, Any], path: Any) -> None:
  """Per step: each optimizer's compile-time ratio to AdamW (bars: the median over rounds
  of CPU-time ratios, as the table; whiskers: their quartiles) and its generated LLVM IR's
  ratio (dots)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  steps = list(results)
  fig, axes = plt.subplots(1, len(steps), figsize=(7 * len(steps), 4.2), squeeze=False)
  for ax, which in zip(axes[0], steps):
    names = list(results[which])
    ratios = [results[which][n]['cpu_ratio_vs_adamw'] for n in names]
    ir = [results[which][n].get('llvm_ir_ratio_vs_adamw') for n in names]
    x = np.arange(len(names))
    iqr = np.array([results[which][n].get('cpu_ratio_iqr', [r, r])
                    for n, r in zip(names, ratios)])
    ax.bar(x, ratios, color=(['0.5'] + [f'C{i}' for i in range(len(names) - 1)]),
           label='trace + lower + compile, CPU time')
    ax.errorbar(x, ratios, yerr=[np.subtract(ratios, iqr[:, 0]), iqr[:, 1] - ratios],
                fmt='none', ecolor='k', capsize=4, lw=1, label='quartiles of the rounds')
    if any(r is not None for r in ir):
      ax.plot([i for i, r in zip(x, ir) if r is not None], [r for r in ir if r is not None],
              'kD', ms=5, label='generated LLVM IR')
    ax.axhline(1.2, color='k', ls='--', lw=1, label='goal: 1.2x')
    for i in range(len(names)):
      label = f'{ratios[i]:.2f}x' + ('' if ir[i] is None else f'\nIR {ir[i]:.2f}x')
      ax.text(i, 0.5, label, ha='center', va='center', fontsize=9, color='white')
    ax.set_xticks(x, [LABELS[n] for n in names])
    ax.set_ylabel('x optax.adamw (median of rounds)')
    ax.set_title(f'{which}: first-step compile vs optax.adamw', fontsize=10)
    ax.set_ylim(0, max(list(iqr[:, 1]) + [r for r in ir if r is not None]) + 0.25)
    ax.legend(fontsize=7, loc='upper left', ncol=3)
    ax.tick_params(axis='x', labelsize=7, labelrotation=20)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == '__main__':
  main()
