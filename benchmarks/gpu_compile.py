"""What XLA:GPU makes of our steps on an H200, from a compile-only (deviceless) target.

No GPU is needed: JAX's CUDA plugin can compile for a GPU described by a target config
(`gpu_specs/h200.txtpb`) without a device or driver. The compiled executable cannot
run, but its buffer assignment and its optimised HLO are exactly what XLA:GPU would
execute on that GPU, so two of the step's figures can be read off it:

* **Peak memory of a whole training step** (`peak_memory.py`'s step: forward, backward,
  optimizer, params and state donated; bf16 weights, micro-batch 8 x 128) for the
  published 6.78B configuration and its w8 scale-down: `argument + output + temp -
  alias` from `memory_analysis()`. This is XLA's own plan, not a measurement on a device:
  a real run adds the CUDA context, the allocator's fragmentation and library
  workspaces that XLA does not assign.
* **The optimizer step's memory traffic** (`step_time.py`'s update + apply, donated, on
  its 128.7M-parameter MoE tree in float32 and in bf16, and on the published 6.78B
  model with its bf16 weights; AdamW's and AdamPM's state float32 as published, with
  `step_time.py --state-dtype float32`): the bytes every kernel of the optimised
  module reads and writes, per parameter (`_common.hlo_kernel_bytes`; on the CPU it
  agrees with XLA's `cost_analysis()`, which a compile-only GPU executable does not
  provide), the number of kernels and XLA's temp. A memory-bound step's time follows
  its bytes only if every kernel streams at the same bandwidth, so the ratio to AdamW's
  bytes is what the step would take at equal bandwidth, not a timing.
* **A roofline estimate of the update** from those counts (`hlo_costs`: loops counted
  once per trip, the dots' flops): max(bytes / HBM bandwidth, dot flops / bf16 peak) +
  kernels x launch cost (`HBM_BYTES_PER_S`, `BF16_FLOPS_PER_S`, `LAUNCH_S`), beside
  `step_time.py`'s measured time on an H200 where `results/gpu/` holds one.

Every preset: optax.adamw, optax.adafactor, SkewAdam's published tiers, `MUON_TIERS`,
`MUON_CODED_TIERS`, AdamPM and `optax.contrib.muon` (the Muon peer). The presets'
Newton-Schulz dtype is 'auto', which the trace decides from `jax.default_backend()`:
here the CPU host's, so the `MUON_TIERS` and `MUON_CODED_TIERS` rows plan the float32
iteration, where a GPU would run bfloat16. `MUON_CODED_TIERS` is also planned with the
dtype named (`skewadam-muon-coded-ns-bfloat16`, what it runs on a GPU, and
`-ns-float32`). The markdown ends
with the goals on the plans: the published tiers' update kernels at 128.7M within 1.2x
AdamW's, and `MUON_CODED_TIERS`' 6.78B step peak at most the paper's SkewAdam peak.

Setup (once; a separate environment keeps the CPU one free of CUDA wheels):

  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  python -m pip install -e ".[examples]" && python -m pip install "jax[cuda12]==$(
      python -c 'import jax; print(jax.__version__)')"       # the plugin of that jax
  python benchmarks/gpu_compile.py          # H200, every part: ~4.5 min on 2 cores

Writes results/gpu_compile_<target>.{json,md,png} under benchmarks/ (`--stem` names them
otherwise; `--before` adds an earlier run's update rows beside this one's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

# Before jax loads the CUDA plugin: there is no driver whose versions it could check.
os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')

import _common  # noqa: E402
from _common import GIB, RESULTS  # noqa: E402

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import peak_memory  # noqa: E402
import step_time  # noqa: E402
from examples import _cli  # noqa: E402
from examples.moe_lm.model import abstract_params, get_config  # noqa: E402

TARGETS = sorted(p.stem for p in _common.GPU_SPECS.glob('*.txtpb'))
STEP_NAMES = ('copy', 'adamw', 'adafactor', 'skewadam', 'adampm', 'skewadam-muon',
              'skewadam-muon-coded', 'skewadam-muon-coded-ns-bfloat16',
              'skewadam-muon-coded-ns-float32', 'muon')
PEAK_OPTIMIZERS = peak_memory.OPTIMIZERS + peak_memory.MORE_OPTIMIZERS

# The roofline's constants, an H200 SXM's datasheet figures: HBM3e bandwidth, dense bf16
# tensor-core peak (no sparsity), and a kernel's launch and tail cost, about what the
# measured 128.7M steps lose per extra kernel (RESULTS.md, section GPU). The estimate
# is max(bytes / bandwidth, flops / peak) + kernels x launch: bandwidth and tensor cores
# overlap within a kernel, launches do not overlap with the kernels they start.
HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS_PER_S = 989e12
LAUNCH_S = 5e-6
# The measured update times (step_time.py on an H200) beside the plans of the same tree.
MEASURED = {'float32': _common.RESULTS / 'gpu' / 'step_time_gpu_float32.json',
            'bfloat16': _common.RESULTS / 'gpu' / 'step_time_gpu_bfloat16_f32state.json'}

_CALLED = _common.HLO_CALLED
_TRIP = _common.HLO_TRIP
_DIMS = re.compile(r'(?:bf16|f16|f32|f64|s8|u8|s32|u32|pred)\[([\d,]*)\]')


def _dims(type_text: str) -> list[int]:
  m = _DIMS.search(type_text)
  return [int(d) for d in m.group(1).split(',') if d] if m else []


def _dot_flops(out_type: str, rest: str, shapes: dict[str, list[int]]) -> int:
  """2 x output elements x contracted size of one dot (HLO `dot` or a cuBLAS call)."""
  m = (re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest)
       or re.search(r'"lhs_contracting_dimensions":\[([\d",]*)\]', rest))
  operands = re.findall(r'%([\w.\-]+)', rest.split('), ', 1)[0])
  if not m or not operands or operands[0] not in shapes:
    return 0
  lhs = shapes[operands[0]]
  k = 1
  for d in re.findall(r'\d+', m.group(1)):
    k *= lhs[int(d)]
  n = 1
  for d in _dims(out_type):
    n *= d
  return 2 * n * k


def hlo_costs(hlo_text: str) -> dict[str, int]:
  """Bytes, kernels and dot flops of a compiled module, its loops unrolled.

  As `_common.hlo_kernel_bytes` (every non-free instruction of the ENTRY computation is a
  kernel that reads its operands and writes its result once), but a `while` counts its
  body and condition `known_trip_count` times (`optax.contrib.muon` runs Newton-Schulz
  in a loop), a `call` its callee, and a fusion that updates a slice of a buffer in
  place (`dynamic-update-slice` at its root) writes that slice alone. Flops are those
  of the dots alone (HLO `dot`, inside fusions too, and cuBLAS custom calls): a
  compile-only GPU executable has no `cost_analysis()`, and the elementwise arithmetic
  is bounded by the bytes anyway.

  Returns:
    `{'bytes', 'kernels', 'flops'}`.
  """
  comps, entry = _common.hlo_computations(hlo_text)
  parse = lambda name: comps.get(name, [])  # noqa: E731

  flops_memo: dict[str, int] = {}

  def inner_flops(name: str) -> int:
    """Dot flops of a fused (or applied) computation, once."""
    if name not in flops_memo:
      shapes, total = {}, 0
      for iname, type_text, opcode, rest in parse(name):
        shapes[iname] = _dims(type_text)
        if opcode == 'dot':
          total += _dot_flops(type_text, rest, shapes)
        for _, callee in _CALLED.findall(rest):
          if callee != name:
            total += inner_flops(callee)
      flops_memo[name] = total
    return flops_memo[name]

  def run(name: str) -> tuple[int, int, int]:
    """(bytes, kernels, flops) of executing computation `name` once."""
    sizes: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    total = kernels = flops = 0
    for iname, type_text, opcode, rest in parse(name):
      sizes[iname] = _common._hlo_type_bytes(type_text)
      shapes[iname] = _dims(type_text)
      if opcode in _common._HLO_FREE:
        continue
      called = dict(_CALLED.findall(rest))
      if opcode == 'while':
        trip = _TRIP.search(rest)
        n = int(trip.group(1)) if trip else 1
        for part in ('body', 'condition'):
          b, k, f = run(called[part])
          total, kernels, flops = total + n * b, kernels + n * k, flops + n * f
        continue
      if opcode == 'call':
        b, k, f = run(called['to_apply'])
        total, kernels, flops = total + b, kernels + k, flops + f
        continue
      total += _common.hlo_instruction_bytes(comps, sizes, iname, rest)
      kernels += 1
      if opcode == 'dot' or (opcode == 'custom-call'
                             and re.search(r'gemm|matmul', rest, re.IGNORECASE)):
        flops += _dot_flops(type_text, rest, shapes)
      elif 'calls' in called:
        flops += inner_flops(called['calls'])
    return total, kernels, flops

  b, k, f = run(entry)
  return {'bytes': b, 'kernels': k, 'flops': f}


def roofline_s(bytes_: float, flops: float, kernels: int) -> float:
  """The roofline estimate of a step's time in seconds (constants above)."""
  return max(bytes_ / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S) + kernels * LAUNCH_S


def measured_ms(dtype: str) -> dict[str, float]:
  """`step_time.py`'s median update times on an H200 (ms) for the 128.7M tree."""
  path = MEASURED.get(dtype)
  if path is None or not path.exists():
    return {}
  return {k: v['median_ms'] for k, v in json.loads(path.read_text())['results'].items()}


def peak_rows(device: Any, configs: list[str], optimizers: list[str]) -> list[dict[str, Any]]:
  """Compiles each training step for `device`; XLA's memory figures per step."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  rows = []
  for config in configs:
    for opt in tqdm(optimizers, desc=f'training step, {config}', leave=False):
      rows.append(peak_memory.compile_step(config, opt, sharding)[1])
  return rows


def _compile_update(name: str, params: Any, sharding: Any, tier: str | None = None) -> Any:
  put = lambda t: jax.tree.map(  # noqa: E731
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), t)
  if name == 'copy':  # the same streaming reference as step_time.py
    fn = jax.jit(lambda p: jax.tree.map(jax.numpy.negative, p), donate_argnums=0)
    return fn.lower(put(params)).compile()
  tx = step_time.optimizer(name, tier)

  def step(p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  # AdamW's and AdamPM's state in float32 whatever the parameters' dtype, as
  # `step_time.py --state-dtype float32` (the published AdamW keeps float32 m and v).
  state = jax.eval_shape(step_time.init_fn(name, tx, f32_state=True), params)
  return jax.jit(step, donate_argnums=(0, 2)).lower(
      put(params), put(params), put(state)).compile()


def update_rows(device: Any, names: list[str], tree_name: str, dtype: str
                ) -> list[dict[str, Any]]:
  """Compiles the optimizer update + apply on one parameter tree (and per tier).

  `tree_name` 'w8' is step_time.py's 128.7M tree in `dtype`; 'paper-6.78b' is the
  published model as peak_memory.py builds it (bf16 weights, float32 norms and router).
  """
  sharding = jax.sharding.SingleDeviceSharding(device)
  cfg = (get_config('paper-6.78b') if tree_name == 'paper-6.78b'
         else step_time.moe_config(dtype))
  tree = nnx.to_pure_dict(abstract_params(cfg))
  trees = {'all': tree, 'experts': step_time.subtree(tree, 'experts'),
           'backbone': step_time.subtree(tree, 'backbone')}
  measured = measured_ms(dtype)
  jobs = [('all', n) for n in names]
  jobs += [(leaves, n) for leaves in ('experts', 'backbone') for n in ('adamw', 'skewadam')
           if n in names]
  rows = []
  for leaves, name in tqdm(jobs, desc='optimizer update', leave=False):
    params = trees[leaves]
    compiled = _compile_update(name, params, sharding,
                               None if leaves == 'all' else leaves)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    costs = hlo_costs(compiled.as_text())
    try:  # a compile-only GPU executable has none (jax 0.10); kept where one exists
      xla_cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - any failure means "not available"
      xla_cost = None
    temp = compiled.memory_analysis().temp_size_in_bytes
    estimate = roofline_s(costs['bytes'], costs['flops'], costs['kernels'])
    row = {'tree': tree_name, 'dtype': dtype, 'leaves': leaves, 'step': name,
           'params': n_params,
           'kernel_bytes': costs['bytes'], 'bytes_per_param': costs['bytes'] / n_params,
           'kernels': costs['kernels'], 'dot_flops': costs['flops'],
           'xla_cost_analysis': ({k: xla_cost[k] for k in ('flops', 'bytes accessed')
                                  if k in xla_cost} if xla_cost else None),
           'temp_bytes': temp, 'temp_fraction_of_params': temp / param_bytes,
           'roofline_ms': 1e3 * estimate,
           'roofline_bytes_ms': 1e3 * costs['bytes'] / HBM_BYTES_PER_S,
           'roofline_flops_ms': 1e3 * costs['flops'] / BF16_FLOPS_PER_S,
           'roofline_launch_ms': 1e3 * costs['kernels'] * LAUNCH_S}
    if leaves == 'all' and tree_name == 'w8' and name in measured:
      row['measured_ms'] = measured[name]
    rows.append(row)
  for row in rows:
    base = [r for r in rows if r['leaves'] == row['leaves'] and r['step'] == 'adamw']
    if base:
      row['bytes_vs_adamw'] = row['kernel_bytes'] / base[0]['kernel_bytes']
      row['kernels_vs_adamw'] = row['kernels'] / base[0]['kernels']
      row['roofline_vs_adamw'] = row['roofline_ms'] / base[0]['roofline_ms']
  return rows


def _measured_when() -> str:
  """When the H200 timings were last written: they time the code of that commit, which
  may be older than the plans beside them."""
  import subprocess  # noqa: PLC0415
  files = sorted((RESULTS / 'gpu').glob('step_time_gpu_*.json'))
  if not files:
    return ''
  log = subprocess.run(['git', 'log', '-1', '--format=%h %cs', '--', *map(str, files)],
                       cwd=RESULTS, capture_output=True, text=True).stdout.strip()
  return (f' (timed on the code of {log}, which may predate these plans: compare a '
          'measured time with its plan only where the code is the same)') if log else ''


def markdown(target: str, peak: list[dict[str, Any]], update: list[dict[str, Any]]) -> str:
  parts = []
  for config in dict.fromkeys(r['config'] for r in peak):
    mine = [r for r in peak if r['config'] == config]
    parts += [f"### Peak memory of one training step, {config} ({mine[0]['params']:,} "
              f"parameters, bf16 weights, micro-batch {peak_memory.BATCH} x "
              f"{peak_memory.SEQ}), XLA:GPU for {target}", '']
    header = ['optimizer', 'state', 'argument', 'output', 'alias', 'temp',
              'predicted peak (arg+out+temp-alias)', 'weights+grads+state']
    published = config == 'paper-6.78b'
    if published:
      header.append('published peak (H200)')
    table = []
    for r in mine:
      row = [peak_memory.LABELS[r['optimizer']]] + [
          peak_memory.gib(r[k]) for k in ('state_bytes', 'argument_bytes', 'output_bytes',
                                         'alias_bytes', 'temp_bytes', 'predicted_bytes',
                                         'floor_bytes')]
      if published:
        pub = peak_memory.PUBLISHED_PEAK_GIB.get(r['optimizer'])
        row.append(f'{pub}' if pub else '-')
      table.append(row)
    parts += [_common.markdown_table(header, table), '',
              'GiB (2^30 B). Compile times: ' +
              ', '.join(f"{r['optimizer']} {r['compile_s']:.0f} s" for r in mine) + '.', '']
  for tree, dtype in dict.fromkeys((r['tree'], r['dtype']) for r in update):
    mine = [r for r in update if (r['tree'], r['dtype']) == (tree, dtype)]
    parts += [f"### Optimizer update + apply, {tree} ({mine[0]['params']:,} parameters), "
              f'{dtype} params and gradients, float32 AdamW/AdamPM state, donated; '
              f'XLA:GPU for {target}',
              '']
    header = ['leaves', 'step', 'kernel bytes / param', 'x adamw bytes', 'kernels',
              'x adamw kernels', 'dot GFLOP', 'roofline ms (traffic or dots + launches)',
              'x adamw roofline', 'measured ms (H200)', 'XLA temp']
    table = [[r['leaves'], step_time.LABELS.get(r['step'], r['step']),
              f"{r['bytes_per_param']:.1f}", _ratio(r, 'bytes_vs_adamw'), r['kernels'],
              _ratio(r, 'kernels_vs_adamw'), f"{r['dot_flops'] / 1e9:,.1f}",
              _roofline_text(r), _ratio(r, 'roofline_vs_adamw'),
              f"{r['measured_ms']:.2f}" if 'measured_ms' in r else '-',
              f"{r['temp_bytes'] / 2**20:.2f} MiB"] for r in mine]
    parts += [_common.markdown_table(header, table, align='ll' + 'r' * 9), '']
  parts += [f'Roofline: max(bytes / {HBM_BYTES_PER_S / 1e12:.1f} TB/s, dot flops / '
            f'{BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s) + kernels x {LAUNCH_S * 1e6:.0f} us '
            "(in parentheses: the larger of the first two, then the launches). 'measured': "
            "step_time.py's median on an H200 (results/gpu/), where a run exists"
            f'{_measured_when()}.', '']
  parts += goals(peak, update)
  return '\n'.join(parts)


def _roofline_text(r: dict[str, Any]) -> str:
  body = max(r['roofline_bytes_ms'], r['roofline_flops_ms'])
  return f"{r['roofline_ms']:.2f} ({body:.2f} + {r['roofline_launch_ms']:.2f})"


def _ratio(row: dict[str, Any], key: str) -> str:
  return f'{row[key]:.2f}' if key in row else '-'


# The issue's goals on the plans: (the published tiers' update kernels at 128.7M against
# AdamW's, bound), (MUON_CODED_TIERS' 6.78B step peak, bound in GiB: the paper's SkewAdam).
KERNEL_GOAL = 1.2
PEAK_GOAL_GIB = peak_memory.PUBLISHED_PEAK_GIB['skewadam']


def goals(peak: list[dict[str, Any]], update: list[dict[str, Any]]) -> list[str]:
  """The goals' lines, each with its figure and verdict, from the rows at hand."""
  lines = ['### Goals on the plans', '']
  for r in update:
    if (r['tree'], r['leaves'], r['step']) == ('w8', 'all', 'skewadam') and \
        'kernels_vs_adamw' in r:
      ok = r['kernels_vs_adamw'] <= KERNEL_GOAL
      lines.append(f"- Published tiers' update kernels at 128.7M ({r['dtype']}): "
                   f"{r['kernels']} = {r['kernels_vs_adamw']:.2f}x AdamW's (goal <= "
                   f"{KERNEL_GOAL}x): **{'met' if ok else 'not met'}**.")
  # The recommended policy as a GPU runs it (its 'auto' Newton-Schulz dtype is bfloat16
  # there) against optax.contrib.muon on the same tree, bf16 weights.
  for r in update:
    if r['leaves'] == 'all' and r['step'] == 'skewadam-muon-coded-ns-bfloat16' and \
        r['dtype'] != 'float32':
      peer = [m for m in update if (m['tree'], m['dtype'], m['leaves'], m['step'])
              == (r['tree'], r['dtype'], 'all', 'muon')]
      if peer:
        ok = r['roofline_ms'] <= peer[0]['roofline_ms']
        size = '128.7M' if r['tree'] == 'w8' else '6.78B'
        lines.append(f"- MUON_CODED_TIERS (bfloat16 Newton-Schulz) at {size}, "
                     f"{r['dtype']}: {r['roofline_ms']:.2f} ms of roofline against "
                     f"optax.contrib.muon's {peer[0]['roofline_ms']:.2f} (goal: at or "
                     f"below): **{'met' if ok else 'not met'}**.")
  for r in peak:
    if (r['config'], r['optimizer']) == ('paper-6.78b', 'skewadam-muon-coded'):
      gib = r['predicted_bytes'] / GIB
      ok = gib <= PEAK_GOAL_GIB
      lines.append(f"- MUON_CODED_TIERS' 6.78B step peak: {gib:.2f} GiB planned (goal <= "
                   f"{PEAK_GOAL_GIB} GiB): **{'met' if ok else 'not met'}** (a plan; a "
                   'device adds its context and allocator slack).')
  return lines + ['']


def plot(target: str, peak: list[dict[str, Any]], update: list[dict[str, Any]],
         path: Path, before: list[dict[str, Any]] = ()) -> None:
  """Three panels: the 6.78B step's peak (or, without peak rows, the update's kernels
  before and after against `before`'s rows), the update's bytes against AdamW's, and
  the roofline estimate of the 128.7M update beside its measured time."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(18, 5))
  old = {(r['tree'], r['dtype'], r['leaves'], r['step']): r for r in before}
  pairs = [(old[k], r) for r in update
           if (k := (r['tree'], r['dtype'], r['leaves'], r['step'])) in old]
  if not peak and pairs:
    x = np.arange(len(pairs))
    ax0.bar(x - 0.2, [b['kernels'] for b, _ in pairs], 0.4, label='before')
    ax0.bar(x + 0.2, [r['kernels'] for _, r in pairs], 0.4, label='after')
    ax0.set_xticks(x, [f"{r['step']}, {r['leaves']}, {r['dtype']}" for _, r in pairs],
                   rotation=35, ha='right', fontsize=6)
    ax0.set_ylabel('kernels of the update + apply')
    ax0.set_title(f'kernels before and after (XLA:GPU plan, {target})', fontsize=9)
    ax0.legend(fontsize=7)
  mine = [r for r in peak if r['config'] == 'paper-6.78b']
  if mine:
    x = np.arange(len(mine))
    w = 0.27
    ax0.bar(x, [r['predicted_bytes'] / GIB for r in mine], w,
            label=f'XLA:GPU plan ({target}, compile only)')
    ax0.bar(x + w, [r['floor_bytes'] / GIB for r in mine], w,
            label='weights + grads + state')
    ax0.bar(x + 2 * w, [peak_memory.PUBLISHED_PEAK_GIB.get(r['optimizer'], 0) for r in mine],
            w, label='published (H200)')
    ax0.axhline(PEAK_GOAL_GIB, color='red', lw=0.8, ls='--',
                label=f"goal for MUON_CODED_TIERS: <= {PEAK_GOAL_GIB} GiB")
    ax0.set_xticks(x + w, [r['optimizer'] for r in mine], rotation=30, ha='right',
                   fontsize=7)
    ax0.set_ylabel('GiB')
    ax0.set_title('paper-6.78b: peak memory of one training step', fontsize=9)
    ax0.legend(fontsize=7)
  groups = list(dict.fromkeys((r['tree'], r['dtype']) for r in update))
  for j, (tree, dtype) in enumerate(groups):
    rows = [r for r in update if r['leaves'] == 'all' and (r['tree'], r['dtype']) == (tree, dtype)]
    x = np.arange(len(rows))
    w = 0.8 / len(groups)
    ax1.bar(x + j * w, [r.get('bytes_vs_adamw', 0) for r in rows], w, label=f'{tree}, {dtype}')
    ax1.set_xticks(x + 0.4 - w / 2, [r['step'] for r in rows], rotation=30, ha='right',
                   fontsize=7)
  if update:
    ax1.axhline(1.0, color='gray', lw=0.8)
    ax1.legend(fontsize=7)
    ax1.set_ylabel("kernel bytes / optax.adamw's")
    ax1.set_title(f'optimizer update + apply: memory traffic (XLA:GPU plan, {target})',
                  fontsize=9)
  w8 = [(tree, dtype) for tree, dtype in groups if tree == 'w8']
  for j, (tree, dtype) in enumerate(w8):
    rows = [r for r in update if r['leaves'] == 'all' and (r['tree'], r['dtype']) == (tree, dtype)]
    x = np.arange(len(rows))
    w = 0.8 / (2 * len(w8))
    ax2.bar(x + 2 * j * w, [r['roofline_ms'] for r in rows], w,
            label=f'roofline, {dtype}')
    ax2.bar(x + (2 * j + 1) * w, [r.get('measured_ms', 0) for r in rows], w,
            label=f'measured on an H200, {dtype}', hatch='//')
    ax2.set_xticks(x + 0.4 - w / 2, [r['step'] for r in rows], rotation=30, ha='right',
                   fontsize=7)
  if w8:
    ax2.set_yscale('log')
    ax2.set_ylabel('ms per update + apply')
    ax2.set_title('128.7M tree: roofline estimate against measured time', fontsize=9)
    ax2.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  """The command line."""
  ap = _cli.parser(__doc__.split('\n\n')[0])
  _cli.option(ap, '--target', default='h200', choices=TARGETS,
              help='GPU whose spec (gpu_specs/<target>.txtpb) XLA compiles for')
  _cli.option(ap, '--configs', nargs='*', default=list(peak_memory.CONFIGS),
              choices=list(peak_memory.CONFIGS), help='models of the peak-memory rows')
  _cli.option(ap, '--optimizers', nargs='*', default=list(PEAK_OPTIMIZERS),
              choices=PEAK_OPTIMIZERS, help='optimizers of the peak-memory rows')
  _cli.option(ap, '--steps', nargs='*', default=list(STEP_NAMES), choices=STEP_NAMES,
              help='optimizer steps whose update traffic is compiled')
  _cli.option(ap, '--dtypes', nargs='*', default=['float32', 'bfloat16'],
              choices=['float32', 'bfloat16'],
              help="parameter and gradient dtypes of the update's tree")
  _cli.option(ap, '--out', default=str(RESULTS), help='directory for the JSON, markdown, PNG')
  _cli.option(ap, '--stem', default=None,
              help='name of the JSON, markdown and PNG files (default gpu_compile_<target>)')
  _cli.option(ap, '--note', default='', help='a line said under the title (what was run)')
  _cli.option(ap, '--before', default=None,
              help="JSON of an earlier run (e.g. of the package before a change): its "
                   "update rows' kernels, bytes per parameter and temp beside this run's")
  return ap


def before_after(before: dict[str, Any], update: list[dict[str, Any]]) -> list[str]:
  """The table of the update rows of `before` (an earlier run's payload) and this run's
  that have the same tree, dtype, leaves and step."""
  key = lambda r: (r['tree'], r['dtype'], r['leaves'], r['step'])  # noqa: E731
  old = {key(r): r for r in before['update']}
  table = []
  for r in update:
    b = old.get(key(r))
    if b is None:
      continue
    table.append([f"{r['tree']}, {r['dtype']}", r['leaves'],
                  step_time.LABELS.get(r['step'], r['step']),
                  b['kernels'], r['kernels'], _ratio(b, 'kernels_vs_adamw'),
                  _ratio(r, 'kernels_vs_adamw'), f"{b['bytes_per_param']:.2f}",
                  f"{r['bytes_per_param']:.2f}", f"{b['temp_bytes'] / 2**20:.2f}",
                  f"{r['temp_bytes'] / 2**20:.2f}", f"{b['roofline_ms']:.2f}",
                  f"{r['roofline_ms']:.2f}"])
  header = ['tree, dtype', 'leaves', 'step', 'kernels before', 'kernels after',
            'x adamw before', 'x adamw after', 'bytes/param before', 'bytes/param after',
            'temp MiB before', 'temp MiB after', 'roofline ms before', 'roofline ms after']
  note = f"{before['note']} " if before.get('note') else ''
  return ['### Before and after', '', f"Before: {note}`{before['command']}`", '',
          _common.markdown_table(header, table, align='lll' + 'r' * 10), '']


def main() -> None:
  args = build_parser().parse_args()

  device = _common.compile_only_device(args.target)
  peak = peak_rows(device, args.configs, args.optimizers)
  update = [row for dtype in args.dtypes
            for row in update_rows(device, args.steps, 'w8', dtype)]
  if 'paper-6.78b' in args.configs:
    update += update_rows(device, args.steps, 'paper-6.78b',
                          'bfloat16 (norms and router float32)')
  payload = {'command': _common.command(), 'machine': _common.machine(),
             'target': args.target, 'device': str(device),
             'target_config': (_common.GPU_SPECS / f'{args.target}.txtpb').read_text(),
             'peak': peak, 'update': update}
  if args.note:
    payload['note'] = args.note
  out = Path(args.out)
  stem = args.stem or f'gpu_compile_{args.target}'
  compared = []
  if args.before:
    # The H200 measurements (results/gpu/) are of the package before: not this run's.
    for r in update:
      r.pop('measured_ms', None)
    before = json.loads(Path(args.before).read_text())
    payload['before'] = {k: before.get(k) for k in ('command', 'note', 'update')}
    compared = before_after(before, update)
  _common.write_json(out / f'{stem}.json', payload)
  md = '\n'.join([f'## XLA:GPU compile-only figures for {args.target} (no device)', '',
                  f"`{payload['command']}`", '']
                  + ([args.note, ''] if args.note else [])
                  + [_common.machine_line(payload['machine'])
                     + f"; compiled for {device.device_kind} "
                     f"(`gpu_specs/{args.target}.txtpb`)", '']
                  + compared + [markdown(args.target, peak, update)])
  (out / f'{stem}.md').write_text(md)
  plot(args.target, peak, update, out / f'{stem}.png',
       payload['before']['update'] if args.before else ())
  print(md)


if __name__ == '__main__':
  main()
