"""Compile time of a real library's MoE training step, each optimizer against optax.adamw.

Run inside the virtualenv of ONE library (see README.md beside this file), from the
repository root, after `<venv>/bin/pip install --no-deps -e .`:

    $VENVS/easydel/bin/python tools/real_trees/compile_time.py --library easydel
    $VENVS/maxtext/bin/python tools/real_trees/compile_time.py --library maxtext
    python tools/real_trees/compile_time.py --merge       # one table from all JSONs in --out

Options: --models a,b (record.py names), --steps train,update (or '' for none),
--rounds 3, --cold-rounds 3, --tag T (writes <library>-T.json), --out DIR.

The models are the tiny configurations of `record.py` (its config tables, built the same
way: EasyDeL `lazy_init`, MaxText `create_nnx_abstract_model`; nothing is allocated).
Two steps per model, both `jax.jit(step, donate_argnums=(0, 1))` of a fresh function
for a fresh optimizer every time (no tracing or compilation cache hit; JAX's persistent
compilation cache is switched off, MaxText's config would otherwise turn it on):

* `train`: the library model's own `__call__` (merged from its NNX graphdef and the
  abstract params inside the step) on a random token batch, next-token cross-entropy,
  `jax.grad` w.r.t. the `nnx.Param` state (the tree the library's trainer hands to
  `tx.init`), `tx.update` and `optax.apply_updates`;
* `update`: `tx.update` and `optax.apply_updates` on given gradients of that same tree,
  i.e. what the optimizer alone adds.

`jit(step).lower(*abstract_args)` and `.compile()` are timed separately (the optimizer
state's `jax.eval_shape(tx.init, params)` is outside both and reported as `init_s`).
One untimed warm-up round, then `--rounds` interleaved rounds (each compiles every
optimizer once, the order rotating), so load from other processes hits all optimizers
alike; reported: medians, and the median of the per-round ratios to adamw.

After one warm-up the library's own tracing caches (its inner jitted / checkpointed
layer functions) are hot, so the warm `train` rows mostly time XLA. A user's first
step is cold: `--cold-rounds` (default 3) rounds also time the train step as the first
compile of a fresh process per optimizer (model built untimed first, order rotating).

`kernels` is the number of `fusion`, `custom-call` and `reduce` instructions in the
optimised HLO's ENTRY computation (a scanned model's layer loop is one `while` there:
its body is not counted); `entry_kernels_all` in the JSON counts every non-free ENTRY
instruction (as `benchmarks/_common.hlo_kernel_bytes`).

Also checked once per model: `sj.label_table(sj.skewadam(lr), params)` against record.py's hand
judgement (`easydel_judge` / `maxtext_judge`) of every leaf's tier.

Writes `<out>/<library>.json` and `<out>/<library>.md` (default out: `runs/real_compile_time`
under the repository, which git ignores).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any, Callable, Optional

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(REPO, 'runs', 'real_compile_time')

LR = 1e-3
WD = 0.1
BATCH, SEQ = 2, 32

LIB_MODELS = {'easydel': ['mixtral'], 'maxtext': ['mixtral_scan', 'mixtral_noscan']}
OPT_NAMES = ['adamw', 'skewadam', 'adampm']


def optimizers() -> dict[str, Callable[[], Any]]:
  import optax

  import skewadam_jax as sj
  return {
      'adamw': lambda: optax.adamw(LR, weight_decay=WD),
      'skewadam': lambda: sj.skewadam(LR, weight_decay=WD),
      'adampm': lambda: sj.adampm(LR, weight_decay=WD),
  }


# ------------------------------------------------------------------------- HLO counts

_INSTR = re.compile(r'\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$')
_FREE = frozenset({'parameter', 'tuple', 'get-tuple-element', 'bitcast', 'constant',
                   'after-all', 'partition-id', 'replica-id', 'opt-barrier'})


def entry_counts(hlo: str) -> dict[str, int]:
  start = hlo.index('\nENTRY')
  entry = hlo[start:hlo.index('\n}', start)]
  ops: dict[str, int] = {}
  for line in entry.split('\n')[1:]:
    m = _INSTR.match(line)
    if m:
      ops[m.group(3)] = ops.get(m.group(3), 0) + 1
  return {
      'kernels': sum(ops.get(k, 0) for k in ('fusion', 'custom-call', 'reduce')),
      'entry_kernels_all': sum(n for k, n in ops.items() if k not in _FREE),
      'entry_while': ops.get('while', 0),
      'hlo_instructions': hlo.count('\n  '),
  }


# ------------------------------------------------------------------------- models


class Model:
  """A built abstract model: params (the optimizer's tree) and a loss of them."""

  def __init__(self, name: str, params: Any, rest: Any, loss: Callable[..., Any],
               context: Callable[[], Any], leaves: list[dict], judge: Callable[[dict], Any],
               config: dict):
    self.name, self.params, self.rest, self.loss = name, params, rest, loss
    self.context, self.leaves, self.judge, self.config = context, leaves, judge, config


def _xent(logits, targets):
  import jax.numpy as jnp
  import optax
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def build_easydel(name: str) -> Model:
  import jax.numpy as jnp
  from flax import nnx

  import record

  spec = record.EASYDEL_MODELS[name]
  mod = importlib.import_module(f'easydel.modules.{spec["module"]}')
  cfg_values = {**record.ED_COMMON, **spec['config']}
  cfg = getattr(mod, spec['config_cls'])(**cfg_values)
  model = getattr(mod, spec['model_cls']).lazy_init(
      config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, precision=None,
      rngs=nnx.Rngs(0))
  # EasyDeLState.create(model=..., tx=...) calls tx.init(graphstate).
  graphdef, graphstate, graphother = model.split_module()
  mesh = model.mesh

  def loss(params, rest, tokens):
    m = nnx.merge(graphdef, params, rest)
    out = m(input_ids=tokens[:, :-1])
    return _xent(out.logits, tokens[:, 1:])

  return Model(f'easydel/{name}', graphstate, graphother, loss, lambda: mesh,
               record.nnx_param_leaves(graphstate),
               lambda leaf: record.easydel_judge(leaf, spec)[0],
               {**cfg_values, 'model_class': spec['model_cls'], 'dtype': 'bfloat16'})


def build_maxtext(name: str) -> Model:
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from flax.core.spmd import logical_axis_rules
  from maxtext.configs import pyconfig
  from maxtext.utils import maxtext_utils, model_creation_utils
  from maxtext.utils.globals import MAXTEXT_PKG_DIR

  import record

  spec = record.MAXTEXT_MODELS[name]
  overrides = {**record.MT_COMMON, **spec['config']}
  argv = [None, os.path.join(MAXTEXT_PKG_DIR, 'configs', 'base.yml'),
          f'model_name={spec["model_name"]}', f'scan_layers={spec["scan"]}',
          'attention=dot_product', 'skip_jax_distributed_system=True',
          'override_model_config=True',
          'jax_cache_dir=',  # MaxText's default turns on JAX's persistent cache
          ] + [f'{k}={v}' for k, v in overrides.items()]
  config = pyconfig.initialize(argv)
  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
  _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  # nnx.Optimizer(model, tx, wrt=nnx.Param) calls tx.init(nnx.state(model, nnx.Param)).
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rules = config.logical_axis_rules

  def loss(params, rest, tokens):
    # copy=True as MaxText's train_step does: the non-differentiated `rest` (RNG
    # counters) comes from the outer jit trace, and the unscanned decoder updates it.
    m = nnx.merge(graphdef, params, rest, copy=True)
    b, t = tokens.shape[0], tokens.shape[1] - 1
    logits = m(decoder_input_tokens=tokens[:, :-1],
               decoder_positions=jnp.broadcast_to(jnp.arange(t), (b, t)),
               decoder_segment_ids=jnp.ones((b, t), jnp.int32), enable_dropout=False)
    return _xent(logits, tokens[:, 1:])

  @contextlib.contextmanager
  def context():
    with jax.set_mesh(mesh), logical_axis_rules(rules):
      yield

  return Model(f'maxtext/{name}', params, rest, loss, context,
               record.nnx_param_leaves(params),
               lambda leaf: record.maxtext_judge(leaf, spec, config.num_experts)[0],
               {'model_name': spec['model_name'], 'scan_layers': spec['scan'],
                'weight_dtype': str(config.weight_dtype), **overrides})


BUILDERS = {'easydel': build_easydel, 'maxtext': build_maxtext}


# ------------------------------------------------------------------------- steps


def make_step(kind: str, model: Model, tx: Any) -> tuple[Callable[..., Any], tuple]:
  """A fresh step function and its abstract arguments (params, opt_state first)."""
  import jax
  import jax.numpy as jnp
  import optax

  params = model.params
  t0 = time.perf_counter()
  opt_state = jax.eval_shape(tx.init, params)
  init_s = time.perf_counter() - t0
  if kind == 'train':
    loss = model.loss

    def step(params, opt_state, rest, tokens):
      value, grads = jax.value_and_grad(loss)(params, rest, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
    return step, (params, opt_state, model.rest, tokens), init_s

  def step(params, opt_state, grads):  # noqa: F811
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step, (params, opt_state, params), init_s


def compile_once(kind: str, model: Model, opt: str) -> dict[str, Any]:
  import jax

  tx = optimizers()[opt]()
  step, args, init_s = make_step(kind, model, tx)
  with model.context():
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
  row = {'lower_s': t1 - t0, 'compile_s': t2 - t1, 'total_s': t2 - t0, 'init_s': init_s}
  row.update(entry_counts(compiled.as_text()))
  return row


# ------------------------------------------------------------------------- labels


def label_check(model: Model) -> dict[str, Any]:
  import skewadam_jax as sj

  rows = sj.label_table(sj.skewadam(1e-3), model.params)
  by_path = {r.path: r for r in rows}
  leaves = []
  for leaf in model.leaves:
    path = '/'.join(leaf['segs'])
    r = by_path.get(path)
    leaves.append({'path': path, 'shape': leaf['shape'], 'dtype': leaf['dtype'],
                   'expected': model.judge(leaf), 'got': None if r is None else r.tier,
                   'second_moment': None if r is None else r.second_moment,
                   'state_bytes': None if r is None else r.state_bytes,
                   'param_bytes': None if r is None else r.param_bytes})
  wrong = [x for x in leaves if x['expected'] != x['got']]
  counts: dict[str, dict[str, int]] = {}
  for x in leaves:
    counts.setdefault(x['expected'], {}).setdefault(str(x['got']), 0)
    counts[x['expected']][str(x['got'])] += 1
  return {'leaves': leaves, 'mismatches': wrong, 'expected_vs_got': counts,
          'table': rows.format()}


# ------------------------------------------------------------------------- report


def _median(xs):
  xs = sorted(xs)
  n = len(xs)
  return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def summarise(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
  out: dict[str, dict[str, dict]] = {}
  for key, per_opt in runs.items():
    base = per_opt['adamw']
    for opt, mine in per_opt.items():
      med = {k: _median([m[k] for m in mine]) for k in mine[0]
             if isinstance(mine[0][k], (int, float))}
      med['ratio_vs_adamw'] = _median([m['total_s'] / b['total_s'] for m, b in zip(mine, base)])
      med['compile_ratio_vs_adamw'] = _median(
          [m['compile_s'] / b['compile_s'] for m, b in zip(mine, base)])
      med['rounds'] = mine
      out.setdefault(key, {})[opt] = med
  return out


def table(results: dict[str, dict[str, dict]]) -> str:
  header = ['model / step', 'optimizer', 'lower s', 'compile s', 'total s',
            'ratio vs adamw (total)', 'ratio (compile only)', 'kernels']
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for key, per_opt in results.items():
    for opt, r in per_opt.items():
      lines.append('| ' + ' | '.join([
          key, opt, f"{r['lower_s']:.2f}", f"{r['compile_s']:.2f}", f"{r['total_s']:.2f}",
          f"{r['ratio_vs_adamw']:.2f}x", f"{r['compile_ratio_vs_adamw']:.2f}x",
          str(int(r['kernels']))]) + ' |')
  return '\n'.join(lines)


def source_fingerprint() -> dict[str, Any]:
  pkg = os.path.join(REPO, 'skewadam_jax')
  h = hashlib.sha256()
  for f in sorted(os.listdir(pkg)):
    if f.endswith('.py'):
      with open(os.path.join(pkg, f), 'rb') as fh:
        h.update(f.encode() + b'\0' + fh.read())
  git = lambda *a: subprocess.run(['git', '-C', REPO, *a], capture_output=True,
                                  text=True).stdout.strip()
  return {'skewadam_jax_sha256': h.hexdigest(), 'git_head': git('rev-parse', 'HEAD'),
          'git_dirty': git('status', '--short', '--', 'skewadam_jax').splitlines()}


def versions(library: str) -> dict[str, str]:
  out = {}
  for p in ('jax', 'jaxlib', 'optax', 'flax', library, 'eformer'):
    try:
      out[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def merge(out_dir: str) -> None:
  for f in sorted(os.listdir(out_dir)):
    if f.endswith('.json'):
      with open(os.path.join(out_dir, f)) as fh:
        d = json.load(fh)
      print(f"### {f} ({', '.join(f'{k} {v}' for k, v in d['versions'].items())})"
            f", {d['rounds']} rounds, {d.get('cold_rounds', 0)} cold rounds\n")
      print(table(d['results']) + '\n')


def main(argv: Optional[list[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--library', choices=sorted(LIB_MODELS))
  p.add_argument('--models', default='', help='comma-separated subset of record.py models')
  p.add_argument('--steps', default='train,update')
  p.add_argument('--optimizers', default=','.join(OPT_NAMES), help='adamw always included')
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--out', default=DEFAULT_OUT)
  p.add_argument('--cold-rounds', type=int, default=3,
                 help='rounds of the cold train step: each optimizer\'s first compile in a '
                      'fresh process (what a user sees as the first step\'s compile)')
  p.add_argument('--tag', default='', help='suffix of the output file names')
  p.add_argument('--single', default='', help=argparse.SUPPRESS)  # internal: one cold compile
  p.add_argument('--merge', action='store_true', help='print the tables of all JSONs in --out')
  args = p.parse_args(argv)
  if args.merge:
    merge(args.out)
    return 0
  if not args.library:
    p.error('--library is required (or --merge)')

  sys.path.insert(0, HERE)  # record.py
  import jax
  jax.config.update('jax_enable_compilation_cache', False)

  names = [m for m in args.models.split(',') if m] or LIB_MODELS[args.library]
  if args.single:  # a fresh process: build, then time the train step's first compile
    sha = source_fingerprint()['skewadam_jax_sha256']
    m = BUILDERS[args.library](names[0])
    row = compile_once('train', m, args.single)
    row['skewadam_jax_sha256'] = sha
    print('COLD_JSON ' + json.dumps(row), flush=True)
    return 0
  fingerprint = source_fingerprint()
  steps = [s for s in args.steps.split(',') if s]
  opts = ['adamw'] + [o for o in args.optimizers.split(',') if o and o != 'adamw']
  os.makedirs(args.out, exist_ok=True)

  models: dict[str, Model] = {}
  labels: dict[str, Any] = {}
  for name in names:
    t0 = time.perf_counter()
    m = BUILDERS[args.library](name)
    models[name] = m
    labels[m.name] = label_check(m)
    lc = labels[m.name]
    print(f'built {m.name} in {time.perf_counter() - t0:.1f}s: {len(m.leaves)} leaves; '
          f'label_table vs record.py judgement: {len(lc["mismatches"])} mismatches '
          f'{lc["expected_vs_got"]}', flush=True)
    for x in lc['mismatches']:
      print(f"  MISMATCH {x['path']} {x['shape']}: expected {x['expected']}, got {x['got']}")

  keys = [(name, kind) for name in names for kind in steps]
  runs = {f'{models[n].name} {k}': {o: [] for o in opts} for n, k in keys}
  for name, kind in keys:  # warm-up round (untimed): imports, the library's own caches
    for opt in opts:
      t0 = time.perf_counter()
      compile_once(kind, models[name], opt)
      print(f'warm-up {models[name].name} {kind} {opt}: {time.perf_counter() - t0:.1f}s',
            flush=True)
  for r in range(args.rounds):
    order = opts[r % len(opts):] + opts[:r % len(opts)]
    for name, kind in keys:
      for opt in order:
        row = compile_once(kind, models[name], opt)
        runs[f'{models[name].name} {kind}'][opt].append(row)
        print(f'round {r} {models[name].name} {kind} {opt}: lower {row["lower_s"]:.2f}s '
              f'compile {row["compile_s"]:.2f}s kernels {row["kernels"]}', flush=True)

  for r in range(args.cold_rounds):
    order = opts[r % len(opts):] + opts[:r % len(opts)]
    for name in names:
      key = f'{models[name].name} train (cold: first compile in a fresh process)'
      runs.setdefault(key, {o: [] for o in opts})
      for opt in order:
        cmd = [sys.executable, os.path.abspath(__file__), '--library', args.library,
               '--models', name, '--single', opt]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('COLD_JSON ')]
        if proc.returncode or not lines:
          print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
          raise RuntimeError(f'cold compile failed: {cmd}')
        row = json.loads(lines[-1][len('COLD_JSON '):])
        runs[key][opt].append(row)
        print(f'cold round {r} {models[name].name} train {opt}: lower {row["lower_s"]:.2f}s '
              f'compile {row["compile_s"]:.2f}s kernels {row["kernels"]}', flush=True)

  results = summarise(runs)
  vers = versions(args.library)
  after = source_fingerprint()
  text = (f'{table(results)}\n\nmedians of {args.rounds} interleaved rounds (after 1 warm-up; '
          f'cold: {args.cold_rounds} rounds, no warm-up); '
          f'ratio = median of per-round ratios to adamw; batch {BATCH} x {SEQ} tokens; '
          f'{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), '
          f'{platform.python_version()}; '
          + ', '.join(f'{k} {v}' for k, v in vers.items()) + '\n')
  if after['skewadam_jax_sha256'] != fingerprint['skewadam_jax_sha256']:
    text += ('\nWARNING: skewadam_jax sources changed on disk during the run (the run used '
             'the version imported at start).\n')
  print('\n' + text)
  payload = {'library': args.library, 'command': ' '.join([sys.executable] + sys.argv),
             'versions': vers, 'python': platform.python_version(), 'rounds': args.rounds,
             'cold_rounds': args.cold_rounds,
             'batch': [BATCH, SEQ], 'source': fingerprint, 'source_after': after,
             'configs': {m.name: m.config for m in models.values()},
             'results': results,
             'labels': {k: {kk: vv for kk, vv in v.items() if kk != 'table'}
                        for k, v in labels.items()},
             'label_tables': {k: v['table'] for k, v in labels.items()}}
  stem = os.path.join(args.out, args.library + (f'-{args.tag}' if args.tag else ''))
  with open(stem + '.json', 'w') as f:
    json.dump(payload, f, indent=1, default=str)
  with open(stem + '.md', 'w') as f:
    f.write(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
