"""Optimizer step time: update + apply, jitted with params and state donated.

Every optimizer runs on the same MoE-shaped parameter tree, in interleaved rounds in
one process (round r times each optimizer once, in a rotating order, each timed call
right after an untimed call of the same step), so that load from other processes hits
all of them alike; the reported ratio is the median over rounds of
`time(opt) / time(optax.adamw)` in the same round. An optimizer step is
memory-bound, so beside the time we report XLA's own bytes accessed per parameter
(`compiled.cost_analysis()`), the achieved bandwidth (those bytes / median time)
against a plain copy kernel timed in the same rounds, and XLA's temporary buffer
(`compiled.memory_analysis().temp_size_in_bytes`).

The tree is the published 6.78B model (examples/moe_lm, `paper-6.78b`) with every
width divided by 8 (d_model, d_ff, d_expert 512; 32 query / 8 KV heads of 16) and
everything else kept (vocabulary 50,304, 128 experts, one dense and one MoE block):
128.7M parameters, 78% of them in the expert bank. Gradients are random normals.

  python benchmarks/step_time.py                 # all cores, float32, 15 rounds
  taskset -c 0 python benchmarks/step_time.py    # pinned to one core
  python benchmarks/step_time.py --dtype bfloat16 --rounds 25
  # the published precision: bf16 weights and gradients, float32 optimizer state
  python benchmarks/step_time.py --dtype bfloat16 --state-dtype float32

Writes results/step_time_<N>core_<dtype>[_f32state].{json,md,png} under benchmarks/.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any, Callable

import _common  # also puts the repo root on sys.path
from _common import RESULTS

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import contrib
from tqdm import tqdm

import skewadam_jax as sj
from examples import _cli
from examples.moe_lm.model import abstract_params, get_config
from examples.moe_lm.optimizers import with_ns_dtype

LR = 1e-3
WD = 0.1

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    'adamw': lambda: optax.adamw(LR, weight_decay=WD),
    'adafactor': lambda: optax.adafactor(LR),
    'skewadam': lambda: sj.skewadam(LR, weight_decay=WD),
    'adampm': lambda: sj.adampm(LR, weight_decay=WD, group_size=8),
    'skewadam-muon': lambda: sj.skewadam(LR, weight_decay=WD, tiers=sj.MUON_TIERS),
    # MUON_CODED_TIERS and the same policy with fp32 momentum: the codec's cost.
    'skewadam-muon-coded': lambda: sj.skewadam(LR, weight_decay=WD,
                                               tiers=sj.MUON_CODED_TIERS),
    'skewadam-muon-expert-momentum': lambda: sj.skewadam(
        LR, weight_decay=WD, tiers=_common.uncoded(sj.MUON_CODED_TIERS)),
    'muon': lambda: contrib.muon(LR, weight_decay=WD,
                                 muon_weight_dimension_numbers=_common.muon_dims),
    # MUON_CODED_TIERS with its Newton-Schulz dtype named: the preset's 'auto' is
    # bfloat16 on a GPU, float32 on the CPU, and a compile-only GPU plan traced on a
    # CPU host (gpu_compile.py) would get float32; these say which iteration runs.
    'skewadam-muon-coded-ns-float32': lambda: _muon_coded_ns('float32'),
    'skewadam-muon-coded-ns-bfloat16': lambda: _muon_coded_ns('bfloat16'),
}
# Timed unless `--only` says otherwise: the named Newton-Schulz dtypes only on request.
DEFAULT_ONLY = [n for n in OPTIMIZERS if '-ns-' not in n]
def _muon_coded_ns(ns_dtype: str) -> optax.GradientTransformation:
  """`sj.MUON_CODED_TIERS` with every Newton-Schulz iteration in `ns_dtype`."""
  tiers = {k: with_ns_dtype(t, ns_dtype) for k, t in sj.MUON_CODED_TIERS.items()}
  return sj.skewadam(LR, weight_decay=WD, tiers=tiers)


# With --state-dtype float32, the optimizers whose state is initialised on a float32
# view of the parameters; their state then stays float32 through updates with bf16
# gradients (as the published AdamW baseline keeps fp32 m and v). SkewAdam's state is
# float32 by construction; optax.adafactor casts its factored statistics back to the
# gradients' dtype on update, so it keeps its own.
F32_STATE_INIT = ('adamw', 'adampm')
LABELS = {
    'copy': 'copy kernel (p -> -p, donated)',
    'adamw': 'optax.adamw',
    'adafactor': 'optax.adafactor',
    'skewadam': 'SkewAdam (published tiers)',
    'adampm': 'AdamPM (s = 8)',
    'skewadam-muon': 'SkewAdam (MUON_TIERS)',
    'skewadam-muon-coded': 'SkewAdam (MUON_CODED_TIERS: 6-bit experts and hidden, 8-bit backbone)',
    'skewadam-muon-expert-momentum': 'SkewAdam (MUON_CODED_TIERS with fp32 momentum)',
    'muon': 'optax.contrib.muon (experts per expert)',
    'skewadam-muon-coded-ns-float32': 'SkewAdam (MUON_CODED_TIERS, float32 Newton-Schulz)',
    'skewadam-muon-coded-ns-bfloat16': 'SkewAdam (MUON_CODED_TIERS, bfloat16 Newton-Schulz)',
}


def moe_config(dtype: str, width: int = 512):
  """The 6.78B configuration with every width `width` (512: divided by 8, 128.7M
  parameters; 32 query and 8 KV heads of `width / 32`)."""
  return get_config('paper-6.78b', d_model=width, n_heads=32, n_kv_heads=8,
                    head_dim=width // 32, d_ff=width, d_expert=width, param_dtype=dtype)


def make_tree(dtype: str, seed: int, width: int = 512) -> tuple[Any, Any]:
  """Concrete (params, grads) of the MoE-shaped tree as plain nested dicts."""
  abstract = nnx.to_pure_dict(abstract_params(moe_config(dtype, width)))
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(seed), 2 * len(leaves))
  params = [(0.02 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
            for k, a in zip(keys[::2], leaves)]
  grads = [(1e-3 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
           for k, a in zip(keys[1::2], leaves)]
  return treedef.unflatten(params), treedef.unflatten(grads)


def cpu_seconds() -> float:
  """CPU time of this process (all threads), user + system."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def subtree(tree: Any, tier: str) -> Any:
  """The leaves of `tree` in one SkewAdam tier ('experts' or 'backbone'), same nesting."""
  labels = sj.moe_param_labels(tree)

  def keep(node, lab):
    if isinstance(node, dict):
      out = {k: keep(node[k], lab[k]) for k in node}
      return {k: v for k, v in out.items() if v is not None}
    return node if lab == tier else None
  return keep(tree, labels)


def optimizer(opt: str, tier: str | None = None) -> optax.GradientTransformation:
  """`OPTIMIZERS[opt]()`; SkewAdam on the sub-tree of one `tier` with that tier said
  outright (a sub-tree without the router would leave the labeler to guess)."""
  if tier is not None and opt == 'skewadam':
    return sj.skewadam(LR, weight_decay=WD,
                       param_labels=lambda tree: jax.tree.map(lambda _: tier, tree))
  return OPTIMIZERS[opt]()


def init_fn(opt: str, tx: optax.GradientTransformation, f32_state: bool) -> Callable:
  """`tx.init`, or with `f32_state` for `F32_STATE_INIT` on a float32 view of the params."""
  return _common.init_on_float32(tx) if f32_state and opt in F32_STATE_INIT else tx.init


class Runner:
  """A compiled, donated step and the buffers it cycles through."""

  def __init__(self, name: str, params: Any, grads: Any, opt: str | None = None,
               f32_state: bool = False, tier: str | None = None):
    self.name = name
    opt = opt or name
    copy_of = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    if name == 'copy':
      # A streaming read + write of every parameter into its own (donated) buffer: the
      # bandwidth reference. Negation, because XLA removes a plain copy or `x * 1`.
      fn = jax.jit(lambda p: jax.tree.map(jnp.negative, p), donate_argnums=0)
      self.args = [copy_of(params)]
      self.compiled = fn.lower(*self.args).compile()

      def call():
        self.args[0] = self.compiled(*self.args)
        return self.args[0]
      self.call = call
    else:
      tx = optimizer(opt, tier)

      def step(p, g, s):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

      p = copy_of(params)
      s = jax.jit(init_fn(opt, tx, f32_state))(p)
      self.args = [p, grads, s]
      self.compiled = jax.jit(step, donate_argnums=(0, 2)).lower(*self.args).compile()

      def call():
        p, s = self.compiled(*self.args)
        self.args[0], self.args[2] = p, s
        return p, s
      self.call = call
      self.state_bytes = sj.state_bytes(s)
    ma = self.compiled.memory_analysis()
    ca = self.compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    accessed = (ca or {}).get('bytes accessed')
    if accessed is None:  # not every backend reports it: count the kernels' own bytes
      accessed = _common.hlo_kernel_bytes(self.compiled.as_text())[0]
    self.bytes_accessed = float(accessed)
    self.temp_bytes = int(ma.temp_size_in_bytes)
    self.wall: list[float] = []
    self.cpu: list[float] = []

  def time_once(self) -> None:
    c0, t0 = cpu_seconds(), time.perf_counter()
    jax.block_until_ready(self.call())
    self.wall.append(time.perf_counter() - t0)
    self.cpu.append(cpu_seconds() - c0)


def run(names: list[str], dtype: str, rounds: int, warmup: int, by_tier: bool,
        f32_state: bool = False, width: int = 512) -> dict[str, Any]:
  params, grads = make_tree(dtype, seed=0, width=width)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  runners = {}
  for name in tqdm(['copy'] + names, desc='compile', leave=False):
    runners[name] = Runner(name, params, grads, f32_state=f32_state)
  tier_runners = {}
  if by_tier:  # AdamW and SkewAdam on the expert leaves alone and on the backbone alone
    for tier in ('experts', 'backbone'):
      p, g = subtree(params, tier), subtree(grads, tier)
      for opt in ('adamw', 'skewadam'):
        tier_runners[f'{opt}|{tier}'] = Runner(f'{opt}|{tier}', p, g, opt=opt,
                                               f32_state=f32_state, tier=tier)
  # Each runner holds its own copy of the weights: at the published size one copy less.
  del params
  all_runners = {**runners, **tier_runners}
  for _ in range(warmup):
    for r in all_runners.values():
      jax.block_until_ready(r.call())
  order = list(all_runners)
  for i in tqdm(range(rounds), desc='interleaved rounds'):
    shift = i % len(order)
    for name in order[shift:] + order[:shift]:
      # An untimed call of the same step first, so that no timed call directly follows
      # another step's allocations (optax.adafactor frees ~1 GiB of temporaries per
      # step, which otherwise slows down whichever step runs next).
      jax.block_until_ready(all_runners[name].call())
      all_runners[name].time_once()

  base = runners['adamw'] if 'adamw' in runners else None
  copy = runners['copy']
  copy_bw = copy.bytes_accessed / np.median(copy.wall)
  rows = {}
  for name, r in runners.items():
    med = float(np.median(r.wall))
    row = {
        'label': LABELS.get(name, name),
        'median_ms': 1e3 * med,
        'min_ms': 1e3 * float(np.min(r.wall)),
        'cpu_median_ms': 1e3 * float(np.median(r.cpu)),
        'bytes_accessed': r.bytes_accessed,
        'bytes_per_param': r.bytes_accessed / n_params,
        'gb_per_s': r.bytes_accessed / med / 1e9,
        'fraction_of_copy_bw': r.bytes_accessed / med / copy_bw,
        'temp_bytes': r.temp_bytes,
        'temp_fraction_of_params': r.temp_bytes / param_bytes,
        'state_bytes': getattr(r, 'state_bytes', 0),
        'wall_s': r.wall,
        'cpu_s': r.cpu,
    }
    if base is not None:
      ratios = np.asarray(r.wall) / np.asarray(base.wall)
      cratios = np.asarray(r.cpu) / np.maximum(np.asarray(base.cpu), 1e-9)
      row['ratio_vs_adamw'] = float(np.median(ratios))
      row['ratio_vs_adamw_q25_q75'] = [float(np.quantile(ratios, 0.25)),
                                       float(np.quantile(ratios, 0.75))]
      row['cpu_ratio_vs_adamw'] = float(np.median(cratios))
    rows[name] = row
  tiers = {}
  for tier in ('experts', 'backbone'):
    if f'adamw|{tier}' not in tier_runners:
      continue
    a, b = tier_runners[f'adamw|{tier}'], tier_runners[f'skewadam|{tier}']
    n = sum(x.size for x in jax.tree.leaves(a.args[0]))
    tiers[tier] = {
        'params': n,
        'adamw_median_ms': 1e3 * float(np.median(a.wall)),
        'skewadam_median_ms': 1e3 * float(np.median(b.wall)),
        'ratio': float(np.median(np.asarray(b.wall) / np.asarray(a.wall))),
        'adamw_bytes_per_param': a.bytes_accessed / n,
        'skewadam_bytes_per_param': b.bytes_accessed / n,
        'skewadam_temp_bytes': b.temp_bytes,
    }
  return {'n_params': n_params, 'param_bytes': param_bytes, 'dtype': dtype,
          'state_dtype': ('float32 for ' + ', '.join(F32_STATE_INIT) if f32_state
                          else "each optimizer's default"),
          'rounds': rounds, 'warmup': warmup, 'copy_gb_per_s': copy_bw / 1e9,
          'results': rows, 'by_tier': tiers}


def table(res: dict[str, Any]) -> str:
  header = ['step', 'median ms', 'x adamw (median of rounds) [IQR]', 'x adamw CPU time',
            'XLA bytes/param', 'GB/s', '% of copy GB/s', 'XLA temp', 'temp % of params']
  rows = []
  for r in res['results'].values():
    ratio = (f"{r['ratio_vs_adamw']:.2f} [{r['ratio_vs_adamw_q25_q75'][0]:.2f}-"
             f"{r['ratio_vs_adamw_q25_q75'][1]:.2f}]" if 'ratio_vs_adamw' in r else '')
    rows.append([r['label'], f"{r['median_ms']:.1f}", ratio,
                 f"{r.get('cpu_ratio_vs_adamw', float('nan')):.2f}",
                 f"{r['bytes_per_param']:.1f}", f"{r['gb_per_s']:.1f}",
                 f"{100 * r['fraction_of_copy_bw']:.0f}%",
                 f"{r['temp_bytes'] / 2**20:.2f} MiB",
                 f"{100 * r['temp_fraction_of_params']:.3f}%"])
  return _common.markdown_table(header, rows)


def tier_table(res: dict[str, Any]) -> str:
  if not res.get('by_tier'):
    return ''
  header = ['leaves', 'params', 'adamw ms', 'SkewAdam ms', 'SkewAdam / adamw (median of rounds)',
            'XLA bytes/param adamw', 'XLA bytes/param SkewAdam', 'SkewAdam temp']
  rows = [[f'{tier} only', f"{t['params'] / 1e6:.1f}M", f"{t['adamw_median_ms']:.1f}",
           f"{t['skewadam_median_ms']:.1f}", f"{t['ratio']:.2f}",
           f"{t['adamw_bytes_per_param']:.1f}", f"{t['skewadam_bytes_per_param']:.1f}",
           f"{t['skewadam_temp_bytes'] / 2**20:.2f} MiB"]
          for tier, t in res['by_tier'].items()]
  return ('Per tier (the same step on the sub-tree of one tier, timed in the same rounds):\n\n'
          + _common.markdown_table(header, rows) + '\n')


def plot(res: dict[str, Any], path, title: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  import textwrap

  names = [n for n in res['results'] if n != 'copy']
  # Long policy names wrapped, so that the tick labels stay under their axes.
  labels = [textwrap.fill(res['results'][n]['label'], 28) for n in names]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.5))
  meds = [res['results'][n]['median_ms'] for n in names]
  ax1.bar(range(len(names)), meds, color='tab:blue')
  ax1.axhline(res['results']['copy']['median_ms'], color='gray', ls='--',
              label='copy kernel')
  ax1.set_xticks(range(len(names)), labels, rotation=30, ha='right', fontsize=7)
  ax1.set_ylabel('median step time (ms)')
  ax1.legend(fontsize=8)
  if 'adamw' in res['results']:
    data = [np.asarray(res['results'][n]['wall_s']) / np.asarray(
        res['results']['adamw']['wall_s']) for n in names]
    ax2.boxplot(data)
    ax2.set_xticks(range(1, len(names) + 1), labels, rotation=30, ha='right', fontsize=7)
    ax2.axhline(1.0, color='gray', ls='--')
    ax2.set_yscale('log')
    ax2.set_ylabel('x optax.adamw (same round)')
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  """The command line (hyphenated flags; `--state_dtype` etc. are accepted too)."""
  ap = _cli.parser(__doc__.split('\n\n')[0])
  _cli.option(ap, '--dtype', default='float32', choices=['float32', 'bfloat16'],
              help='dtype of the parameters and gradients')
  _cli.option(ap, '--state-dtype', default=None, choices=['float32'],
              help='float32: AdamW and AdamPM states in float32 whatever --dtype; '
                   "unset: each optimizer's own, i.e. the parameters' dtype")
  _cli.option(ap, '--rounds', type=int, default=15, help='interleaved timing rounds')
  _cli.option(ap, '--warmup', type=int, default=2, help='untimed rounds first')
  _cli.option(ap, '--only', nargs='*', default=DEFAULT_ONLY, choices=list(OPTIMIZERS),
              help='optimizers to time (AdamW always, as the reference)')
  _cli.option(ap, '--no-by-tier', dest='by_tier', action='store_false',
              # `(default: True)` would read as if the flag were on by default.
              help='skip AdamW vs SkewAdam on the expert and backbone leaves alone '
                   '(timing them when not given: %(default)s)')
  _cli.option(ap, '--width', type=int, default=512,
              help='d_model = d_ff = d_expert (512: 128.7M parameters; a multiple of 32)')
  _cli.option(ap, '--out', default=str(RESULTS), help='directory for the JSON, markdown, PNG')
  return ap


def main() -> None:
  args = build_parser().parse_args()
  names = ['adamw'] + [n for n in args.only if n != 'adamw']

  f32_state = args.state_dtype == 'float32'
  res = run(names, args.dtype, args.rounds, args.warmup, args.by_tier, f32_state, args.width)
  cores = len(os.sched_getaffinity(0))
  res.update(command=_common.command(), machine=_common.machine(), cores_used=cores)
  if jax.default_backend() == 'cpu':
    tag, where = f'step_time_{cores}core_{args.dtype}', f'{cores} core(s)'
  else:
    device = jax.devices()[0]
    tag = f'step_time_{device.platform}_{args.dtype}'
    where = device.device_kind
  if args.width != 512:
    tag += f'_w{args.width}'
  if f32_state:
    tag += '_f32state'
    where += ', float32 AdamW/AdamPM state'
  out = _common.Path(args.out)
  _common.write_json(out / f'{tag}.json', res)
  title = (f"{res['n_params'] / 1e6:.1f}M-parameter MoE tree, {args.dtype}, "
           f"{where}, {args.rounds} interleaved rounds")
  md = '\n'.join([
      f'## Step time: {title}', '',
      f"`{res['command']}`", '',
      _common.machine_line(res['machine']), '',
      f"Copy kernel: {res['copy_gb_per_s']:.1f} GB/s (XLA bytes accessed / median time).",
      '', table(res), '', tier_table(res)])
  (out / f'{tag}.md').write_text(md)
  plot(res, out / f'{tag}.png', title)
  print(md)


if __name__ == '__main__':
  main()
