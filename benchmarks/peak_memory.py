"""Peak memory of a whole training step: forward, backward and optimizer update.

The step is `examples/moe_lm`'s MoE LM: `value_and_grad` of `loss_fn` (router noise
on), then `tx.update` and `optax.apply_updates`, jitted with params and optimizer state
donated. Weights are bf16 (norms and router fp32), gradients stay in the weights' dtype
and optimizer state is float32 (optax baselines are initialised on a float32 copy of the
parameters, as in `memory.py`; SkewAdam's state is float32 by construction). Micro-batch
8 x 128 tokens.

XLA's prediction is `argument + output + temp - alias` from
`jax.jit(step, donate_argnums=(0, 1)).lower(abstract args).compile().memory_analysis()`
(nothing allocated). `peak_memory_in_bytes` is not used: on XLA:CPU it is
max(arguments + outputs - aliases, temp), not their sum (docs/xla-notes.md).

Two configurations:

* `paper-6.78b`: compiled only (it needs no allocation). XLA:CPU has no bf16 matmul:
  it converts each bf16 expert bank `[128, 4096, 4096]` to float32 for the forward and
  backward einsums and keeps float32 weight gradients and transposes, so its temp is not
  what a GPU step needs. The script lists the largest temporaries, and gives beside it
  the floor every backend needs: weights + gradients (bf16) + optimizer state.
* `w8`: the same model with every width divided by 8 (128.7M parameters), which runs
  here: beside the prediction, the measured growth of peak RSS (VmHWM, reset through
  /proc/self/clear_refs) over one step, from before its inputs were allocated.

Each (configuration, optimizer) runs in a fresh subprocess.

  python benchmarks/peak_memory.py                      # both configurations
  python benchmarks/peak_memory.py --configs w8 --optimizers skewadam adamw
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from _common import GIB, RESULTS

from examples import _cli

OPTIMIZERS = ('adamw', 'adafactor', 'skewadam', 'adampm')
# Further presets that other scripts (gpu_compile.py, run_gpu.sh) plan or run the step
# of; not run here by default.
MORE_OPTIMIZERS = ('skewadam-muon', 'skewadam-muon-coded', 'muon')
LABELS = {'adamw': 'AdamW (fp32 m, v)', 'adafactor': 'Adafactor (optax default)',
          'skewadam': 'SkewAdam (published tiers)', 'adampm': 'AdamPM (s = 8, fp32 m, nu)',
          'skewadam-muon': 'SkewAdam (MUON_TIERS)',
          'skewadam-muon-coded': 'SkewAdam (MUON_CODED_TIERS)',
          'muon': 'optax.contrib.muon (bf16 momentum)'}
PUBLISHED_PEAK_GIB = {'skewadam': 31.3, 'adamw': 81.4, 'adafactor': 29.6}
CONFIGS = {'paper-6.78b': {'run': False}, 'w8': {'run': True}}
BATCH, SEQ = 8, 128


# ----------------------------------------------------------------------------- worker


def _config(name: str):
  from examples.moe_lm.model import get_config
  if name == 'w8':
    return get_config('paper-6.78b', d_model=512, n_heads=32, n_kv_heads=8, head_dim=16,
                      d_ff=512, d_expert=512)
  return get_config(name)


def _optimizer(name: str):
  import optax
  from optax import contrib
  import skewadam_jax as sj
  lr, wd = 3e-4, 0.1
  return {'adamw': lambda: optax.adamw(lr, weight_decay=wd),
          'adafactor': lambda: optax.adafactor(lr),
          'skewadam': lambda: sj.skewadam(lr, weight_decay=wd),
          'adampm': lambda: sj.adampm(lr, weight_decay=wd, group_size=8),
          'skewadam-muon': lambda: sj.skewadam(lr, weight_decay=wd, tiers=sj.MUON_TIERS),
          'skewadam-muon-coded': lambda: sj.skewadam(lr, weight_decay=wd,
                                                     tiers=sj.MUON_CODED_TIERS),
          'muon': lambda: contrib.muon(lr, weight_decay=wd,
                                       muon_weight_dimension_numbers=_common.muon_dims),
          }[name]()


def _rss_kib(field: str) -> int:
  status = Path('/proc/self/status').read_text()
  return int(re.search(rf'{field}:\s+(\d+)', status).group(1))


def _reset_peak_rss() -> bool:
  try:
    Path('/proc/self/clear_refs').write_text('5')
    return True
  except OSError:
    return False


def _largest_temps(dump_dir: str, top: int = 8) -> list[dict[str, Any]]:
  """The largest values in XLA's preallocated temp buffer (from its buffer assignment)."""
  files = sorted(Path(dump_dir).glob('*jit_step*after_optimizations-buffer-assignment.txt'))
  if not files:
    return []
  for block in files[-1].read_text().split('\nallocation ')[1:]:
    if 'preallocated-temp' not in block.split('\n', 1)[0]:
      continue
    vals = re.findall(r'value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)', block)
    vals = sorted(vals, key=lambda v: -int(v[1]))[:top]
    return [{'op': v[0], 'bytes': int(v[1]), 'offset': int(v[2]), 'shape': v[3]}
            for v in vals]
  return []


def _optimizer_alone(tx: Any, a_params: Any, a_state: Any) -> dict[str, Any]:
  """XLA's figures for the optimizer update + apply alone (bf16 gradients), donated."""
  import jax
  import optax

  def update(params, grads, opt_state):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  ma = jax.jit(update, donate_argnums=(0, 2)).lower(
      a_params, a_params, a_state).compile().memory_analysis()
  return {'optimizer_alone_temp_bytes': ma.temp_size_in_bytes,
          'optimizer_alone_predicted_bytes': (ma.argument_size_in_bytes
                                              + ma.output_size_in_bytes
                                              + ma.temp_size_in_bytes
                                              - ma.alias_size_in_bytes)}


def abstract_step(config: str, opt: str, sharding: Any = None
                  ) -> tuple[Any, tuple[Any, ...], Any]:
  """The training step of `config` with optimizer `opt`, and its abstract arguments.

  Args:
    config: a key of `CONFIGS`.
    opt: a key of `OPTIMIZERS` or `MORE_OPTIMIZERS`.
    sharding: placed on every abstract argument (e.g. a compile-only GPU device's);
      None for the default device.

  Returns:
    `(step, (params, opt_state, rest, batch, key), tx)`: `step` is not jitted; the
    arguments are `jax.ShapeDtypeStruct`s.
  """
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import optax
  from examples.moe_lm import model as model_lib

  cfg = _config(config)
  tx = _optimizer(opt)
  abstract_model = nnx.eval_shape(lambda: model_lib.MoELM(cfg, rngs=nnx.Rngs(0)))
  graphdef, a_params, a_rest = nnx.split(abstract_model, nnx.Param, ...)
  a_state = jax.eval_shape(_init(opt, tx), a_params)
  a_batch = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
  a_key = jax.eval_shape(lambda: jax.random.key(0))
  args = (a_params, a_state, a_rest, a_batch, a_key)
  if sharding is not None:
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        args)

  def step(params, opt_state, rest, batch, key):
    def loss(p):
      return model_lib.loss_fn(nnx.merge(graphdef, p, rest), batch, True, key)
    (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, args, tx


def _init(opt: str, tx: Any) -> Any:
  """`tx.init`; AdamW, Adafactor and AdamPM on a float32 view of the parameters
  (float32 state for bf16 weights, as published); SkewAdam's state is float32 anyway, and
  `optax.contrib.muon` keeps its own (its momentum in the weights' dtype, as step_time.py
  runs it)."""
  return (_common.init_on_float32(tx) if opt in ('adamw', 'adafactor', 'adampm')
          else tx.init)


def compile_step(config: str, opt: str, sharding: Any = None
                 ) -> tuple[Any, dict[str, Any], tuple[Any, ...], Any]:
  """Compiles `abstract_step` (params and state donated) and reads XLA's memory figures.

  Returns:
    `(compiled, figures, abstract args, tx)`; `figures` holds the `memory_analysis()`
    fields, the predicted peak `argument + output + temp - alias`, the state bytes and
    the floor `weights + gradients (weights' dtype) + state`.
  """
  import jax
  import skewadam_jax as sj

  step, args, tx = abstract_step(config, opt, sharding)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  a_params, a_state = args[:2]
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(a_params))
  state_bytes = sj.state_bytes(a_state)
  figures = {
      'config': config, 'optimizer': opt, 'compile_s': compile_s,
      'params': sum(x.size for x in jax.tree.leaves(a_params)),
      'param_bytes': param_bytes, 'state_bytes': state_bytes,
      'argument_bytes': ma.argument_size_in_bytes, 'output_bytes': ma.output_size_in_bytes,
      'alias_bytes': ma.alias_size_in_bytes, 'temp_bytes': ma.temp_size_in_bytes,
      'xla_peak_memory_in_bytes': getattr(ma, 'peak_memory_in_bytes', None),
      'predicted_bytes': (ma.argument_size_in_bytes + ma.output_size_in_bytes
                          + ma.temp_size_in_bytes - ma.alias_size_in_bytes),
      'floor_bytes': 2 * param_bytes + state_bytes,
  }
  return compiled, figures, args, tx


def worker(config: str, opt: str, run: bool, explain: bool, opt_alone: bool = True
           ) -> dict[str, Any]:
  """Compile (and for `run`, execute once) the step; returns the figures as a dict."""
  dump = None
  if explain:
    dump = tempfile.mkdtemp(prefix='peak_dump_')
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_dump_to={dump}').strip()
  from flax import nnx
  import jax
  import jax.numpy as jnp
  from examples.moe_lm import model as model_lib

  compiled, out, (a_params, a_state, a_rest, _, _), tx = compile_step(config, opt)
  ma = compiled.memory_analysis()
  if dump:
    out['largest_temps'] = _largest_temps(dump)
  # On a GPU the published configuration fits and runs too.
  if run or jax.default_backend() == 'gpu':
    device = jax.devices()[0]
    on_cpu = device.platform == 'cpu'
    rss0 = _rss_kib('VmRSS') * 1024
    model = model_lib.MoELM(_config(config), rngs=nnx.Rngs(0))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    # The float32 copy that the optax baselines are initialised on lives only inside
    # this jit (their init reads shapes only), so it adds nothing to the peak.
    state = jax.jit(_init(opt, tx))(params)
    batch = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
    key = jax.random.key(0)
    jax.block_until_ready((params, state, batch))
    if on_cpu:
      rss1 = _rss_kib('VmRSS') * 1024
      reset = _reset_peak_rss()
    else:
      in_use = device.memory_stats()['bytes_in_use']
    result = compiled(params, state, rest, batch, key)
    jax.block_until_ready(result)
    if on_cpu:
      growth = _rss_kib('VmHWM') * 1024 - rss1
      measured = {'measured_by': 'RSS', 'measured_input_bytes': rss1 - rss0,
                  'peak_reset_ok': reset}
    else:
      # The allocator's peak over the whole process (inputs, init and step); inputs are
      # allocated first and the init needs less than the step, so this is the step's.
      peak = device.memory_stats()['peak_bytes_in_use']
      growth = peak - in_use
      measured = {'measured_by': 'device allocator', 'measured_input_bytes': in_use,
                  'measured_peak_bytes': peak}
    out.update({
        **measured,
        # What the step itself adds on top of its resident inputs, against XLA's
        # `output + temp - alias` (the donated outputs reuse the inputs' buffers).
        'measured_step_growth_bytes': growth,
        'predicted_step_growth_bytes': (ma.output_size_in_bytes + ma.temp_size_in_bytes
                                        - ma.alias_size_in_bytes),
        'loss': float(result[2]),
    })
  if opt_alone:
    out.update(_optimizer_alone(tx, a_params, a_state))
  if dump:
    shutil.rmtree(dump, ignore_errors=True)
  return out


# ----------------------------------------------------------------------------- driver


def run_one(config: str, opt: str, explain: bool) -> dict[str, Any]:
  cmd = [sys.executable, __file__, '--worker', config, opt]
  if explain:
    cmd.append('--explain')
  env = dict(os.environ, PYTHONPATH=str(_common.ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{')]
  if proc.returncode or not lines:
    raise RuntimeError(f'{config}/{opt} failed:\n{proc.stderr[-3000:]}')
  return json.loads(lines[-1])


def gib(x: float | None) -> str:
  return '-' if x is None else f'{x / GIB:.2f}'


def markdown(rows: list[dict[str, Any]]) -> str:
  parts = []
  for config in dict.fromkeys(r['config'] for r in rows):
    mine = [r for r in rows if r['config'] == config]
    first = mine[0]
    parts += [f"### {config}: {first['params']:,} parameters "
              f"({gib(first['param_bytes'])} GiB of weights), micro-batch {BATCH} x {SEQ}",
              '']
    header = ['optimizer', 'state GiB', 'argument', 'output', 'alias', 'temp',
              'predicted peak (arg+out+temp-alias)', 'weights+grads+state floor']
    header += ['optimizer alone: temp (MiB)']
    runs = 'measured_step_growth_bytes' in first
    if runs:
      header += ['step growth predicted (out+temp-alias)',
                 f"step growth measured ({first.get('measured_by', 'RSS')})",
                 'measured - predicted (MiB)']
    if config == 'paper-6.78b':
      header += ['published peak (H200)']
    table = []
    for r in mine:
      row = [LABELS[r['optimizer']], gib(r['state_bytes']), gib(r['argument_bytes']),
             gib(r['output_bytes']), gib(r['alias_bytes']), gib(r['temp_bytes']),
             gib(r['predicted_bytes']), gib(r['floor_bytes']),
             f"{r.get('optimizer_alone_temp_bytes', float('nan')) / 2**20:.1f}"]
      if runs:
        diff = r['measured_step_growth_bytes'] - r['predicted_step_growth_bytes']
        row += [gib(r['predicted_step_growth_bytes']), gib(r['measured_step_growth_bytes']),
                f'{diff / 2**20:+.0f}']
      if config == 'paper-6.78b':
        pub = PUBLISHED_PEAK_GIB.get(r['optimizer'])
        row.append(f'{pub} GiB' if pub else '-')
      table.append(row)
    parts += [_common.markdown_table(header, table), '',
              'All figures GiB (2^30 B) unless marked. Compile times: ' +
              ', '.join(f"{r['optimizer']} {r['compile_s']:.1f} s" for r in mine) + '.', '']
    temps = [r for r in mine if r.get('largest_temps')]
    if temps:
      r = temps[0]
      parts += [f"Largest values in XLA's temp buffer ({r['optimizer']}; offsets overlap "
                'where lifetimes do not):', '']
      parts += [f"* `{t['op']}` {t['shape']}: {t['bytes'] / GIB:.2f} GiB"
                for t in r['largest_temps']]
      parts.append('')
  return '\n'.join(parts)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  configs = list(dict.fromkeys(r['config'] for r in rows))
  fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.2), squeeze=False)
  for ax, config in zip(axes[0], configs):
    mine = [r for r in rows if r['config'] == config]
    x = np.arange(len(mine))
    series = [('predicted (XLA memory_analysis)', 'predicted_bytes'), ('floor: weights+grads+state',
                                                          'floor_bytes')]
    if 'measured_peak_bytes' in mine[0]:  # a device allocator's own peak
      series.append(('measured peak (device allocator)', 'measured_peak_bytes'))
    elif 'measured_step_growth_bytes' in mine[0]:
      for r in mine:  # inputs as XLA counts them + what the step added to RSS
        r['_measured_total'] = r['argument_bytes'] + r['measured_step_growth_bytes']
      series.append(('arguments + measured RSS growth of the step', '_measured_total'))
    w = 0.8 / (len(series) + (config == 'paper-6.78b'))
    for j, (label, key) in enumerate(series):
      ax.bar(x + j * w, [r[key] / GIB for r in mine], w, label=label)
    if config == 'paper-6.78b':
      ax.bar(x + len(series) * w,
             [PUBLISHED_PEAK_GIB.get(r['optimizer'], 0) for r in mine], w,
             label='published (H200)')
    ax.set_xticks(x + 0.4 - w / 2, [r['optimizer'] for r in mine])
    ax.set_ylabel('GiB')
    ax.set_title(f'{config}: peak memory of one training step', fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  """The command line (`--worker` and `--explain` are internal: one subprocess each)."""
  ap = _cli.parser(__doc__.split('\n\n')[0])
  _cli.option(ap, '--configs', nargs='*', default=list(CONFIGS), choices=list(CONFIGS),
              help='model configurations (w8 is also run; paper-6.78b is compiled only)')
  _cli.option(ap, '--optimizers', nargs='*', default=list(OPTIMIZERS),
              choices=OPTIMIZERS + MORE_OPTIMIZERS, help='optimizers to compile')
  _cli.option(ap, '--out', default=str(RESULTS), help='directory for the JSON, markdown, PNG')
  _cli.option(ap, '--worker', nargs=2, metavar=('CONFIG', 'OPT'), help=argparse.SUPPRESS)
  _cli.option(ap, '--explain', action='store_true', help=argparse.SUPPRESS)
  return ap


def main() -> None:
  args = build_parser().parse_args()
  if args.worker:
    config, opt = args.worker
    print(json.dumps(worker(config, opt, CONFIGS[config]['run'], args.explain)))
    return

  from tqdm import tqdm
  jobs = [(c, o) for c in args.configs for o in args.optimizers]
  rows = []
  out = Path(args.out)
  payload = {'command': _common.command(), 'machine': _common.machine(), 'rows': rows}
  for c, o in tqdm(jobs, desc='compile / run'):
    # The buffer-assignment dump of the first 6.78B compile explains its temp.
    explain = c == 'paper-6.78b' and not any(r['config'] == c for r in rows)
    rows.append(run_one(c, o, explain))
    # Written after every row: a run stopped part-way (a device lease running out)
    # keeps the rows it finished.
    _common.write_json_atomic(out / 'peak_memory.json',
                              {**payload, 'complete': len(rows) == len(jobs)})
  backend = 'XLA:' + payload['machine']['backend'].upper()
  md = '\n'.join([f'## Peak memory of one training step ({backend} memory_analysis)', '',
                  f"`{payload['command']}`", '', _common.machine_line(payload['machine']),
                  '', markdown(rows)])
  (out / 'peak_memory.md').write_text(md)
  plot(rows, out / 'peak_memory.png')
  print(md)


if __name__ == '__main__':
  main()
