"""Train the example MoE language model on bytes of local text, with any optimizer.

One command trains the `small` preset (1.8M parameters, 86% in experts) on the CPython
standard library's sources with SkewAdam and reports what matters for the paper's claim:

  python examples/moe_lm/train.py                       # SkewAdam, ~2-3 min on 2 CPU cores
  python examples/moe_lm/train.py --optimizer adamw     # the baseline
  python examples/moe_lm/train.py --bf16                # bf16 weights, stochastic rounding
  python examples/moe_lm/train.py --data-dir ~/notes --suffixes .md .txt

Flow: config -> data -> model -> optimizer -> jitted step -> loop -> report.

* Schedule: linear warmup then cosine to 0 (`optax.warmup_cosine_decay_schedule`);
  global gradient-norm clip 1.0; optimizer by `--optimizer` (see `optimizers.py`).
* The step is a pure function of `(params, opt_state, batch, key)` built with
  `nnx.split` / `nnx.merge` and `jax.jit(donate_argnums=(0, 1))`, so parameters and
  optimizer state are updated in place. With `--bf16` the weights (not norms and router)
  are bfloat16, gradients are cast to float32, optimizer state is float32 and the update
  is applied with `skewadam_jax.apply_updates_stochastic` (unbiased rounding).
* Every `--eval-every` steps: validation loss, bits per byte and perplexity (per byte),
  and router statistics: the token fraction per expert and the Switch aux loss against
  its floor (the value a perfectly balanced router reaches).
* At the end: a markdown table of optimizer state bytes per tier, a loss-curve PNG and a
  JSON of the run under `--out` (default `runs/moe_lm/`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

if __package__ in (None, ''):
  sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import skewadam_jax as sj  # noqa: E402
from examples import _cli  # noqa: E402
from examples.moe_lm import data as data_lib  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402
from examples.moe_lm import optimizers as opt_lib  # noqa: E402

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass
class TrainConfig:
  """Everything a run depends on (the command-line flags)."""
  optimizer: str = 'skewadam'
  preset: str = 'small'
  steps: int = 600
  batch_size: int = 16
  seq_len: Optional[int] = None  # None: the preset's max_len
  lr: Optional[float] = None  # None: optimizers.DEFAULT_LR[optimizer]
  warmup: int = 60
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  eval_every: int = 100
  eval_batches: int = 8
  seed: int = 0
  bf16: bool = False
  data_dir: Optional[str] = None  # None: the Python standard library
  suffixes: tuple[str, ...] = ('.py',)
  out: str = 'runs/moe_lm'


def model_config(tc: TrainConfig) -> model_lib.MoEConfig:
  """The preset, in bf16 weights when asked (norms and router stay fp32)."""
  return model_lib.get_config(tc.preset, param_dtype='bfloat16' if tc.bf16 else 'float32')


def load_data(tc: TrainConfig, cfg: model_lib.MoEConfig) -> data_lib.ByteDataset:
  """The byte dataset of `--data-dir` (default: the standard library)."""
  return data_lib.ByteDataset.load(
      tc.data_dir, seq_len=tc.seq_len or cfg.max_len, batch_size=tc.batch_size,
      seed=tc.seed, suffixes=tuple(tc.suffixes))


def init_model(cfg: model_lib.MoEConfig, seed: int) -> tuple[Any, nnx.State, nnx.State]:
  """`(graphdef, params, rest)` of a freshly initialised model (same seed, same weights)."""
  model = model_lib.MoELM(cfg, rngs=nnx.Rngs(seed))
  return nnx.split(model, nnx.Param, ...)


def as_float32(tree: Any) -> Any:
  """Float leaves cast to float32 (arrays or ShapeDtypeStructs)."""
  def cast(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, jnp.float32)
      return x.astype(jnp.float32)
    return x
  return jax.tree.map(cast, tree)


# ----------------------------------------------------------------------------- steps


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, bf16: bool
                    ) -> Callable[..., Any]:
  """A jitted `(params, opt_state, rest, batch, key) -> (params, opt_state, metrics)`.

  Params and optimizer state are donated. Gradients are float32; bf16 weights take the
  update with unbiased stochastic rounding.
  """

  def step(params, opt_state, rest, batch, key):
    noise_key, round_key = jax.random.split(key)

    def loss(p):
      return model_lib.loss_fn(nnx.merge(graphdef, p, rest), batch, True, noise_key)

    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    grads = as_float32(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    if bf16:
      params = sj.apply_updates_stochastic(params, updates, round_key)
    else:
      params = optax.apply_updates(params, updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(graphdef: Any) -> Callable[..., Any]:
  """A jitted `(params, rest, batch) -> metrics` without router noise."""

  def step(params, rest, batch):
    return model_lib.loss_fn(nnx.merge(graphdef, params, rest), batch, False)[1]

  return jax.jit(step)


def evaluate(eval_step, params, rest, batches: list[np.ndarray]) -> dict[str, Any]:
  """Mean validation metrics: loss (nats/byte), bits per byte, perplexity, router stats."""
  sums: dict[str, Any] = {}
  for b in batches:
    m = jax.device_get(eval_step(params, rest, jnp.asarray(b)))
    for k in ('ce', 'aux', 'z', 'aux_floor', 'token_frac', 'drop_frac'):
      if k in m:
        sums[k] = sums.get(k, 0.0) + np.asarray(m[k], np.float64)
  mean = {k: v / len(batches) for k, v in sums.items()}
  ce = float(mean['ce'])
  out = {'loss': ce, 'bpb': ce / LN2, 'ppl': math.exp(ce)}
  out.update(router_stats(mean))
  return out


def router_stats(m: dict[str, Any]) -> dict[str, Any]:
  """Aux loss against its floor and the per-expert token fractions `[L][E]`."""
  if 'token_frac' not in m:
    return {}
  frac = np.asarray(m['token_frac'])
  return {
      'aux': float(m['aux']), 'aux_floor': float(m['aux_floor']),
      'aux_over_floor': float(m['aux']) / float(m['aux_floor']),
      'token_frac': frac.round(4).tolist(),
      'max_token_frac_x_E': float(frac.max() * frac.shape[-1]),
      'drop_frac': float(np.mean(m.get('drop_frac', 0.0))),
  }


# ----------------------------------------------------------------------------- loop


def train(tc: TrainConfig, data: Optional[data_lib.ByteDataset] = None, *,
          progress: bool = True, desc: Optional[str] = None) -> dict[str, Any]:
  """Trains one model and returns the run record (history, final metrics, memory).

  Every run with the same `preset`, `seed` and `batch_size` starts from the same
  weights and sees the same batches in the same order (and the same router noise),
  whatever the optimizer.
  """
  from tqdm.auto import tqdm

  cfg = model_config(tc)
  data = data or load_data(tc, cfg)
  graphdef, params, rest = init_model(cfg, tc.seed)
  tx, opt_info = opt_lib.make_optimizer(
      tc.optimizer, tc.lr, total_steps=tc.steps, warmup_steps=tc.warmup,
      weight_decay=tc.weight_decay, clip_norm=tc.clip_norm)
  # Optimizer state is float32 whatever the weights are (as in the published runs).
  abstract = as_float32(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  opt_state = tx.init(as_float32(params))
  memory = sj.memory_report(abstract, tx)
  train_step = make_train_step(graphdef, tx, tc.bf16)
  eval_step = make_eval_step(graphdef)
  val_batches = data.val_batches(tc.eval_batches)
  base_key = jax.random.key(tc.seed)
  tokens_per_step = tc.batch_size * data.seq_len

  history: dict[str, list] = {'step': [], 'loss': [], 'ce': [], 'aux': [], 'grad_norm': []}
  evals: list[dict[str, Any]] = []
  step_times: list[float] = []
  bar = tqdm(range(tc.steps), desc=desc or tc.optimizer, disable=not progress,
             dynamic_ncols=True, mininterval=1.0)
  start = time.perf_counter()
  compile_s: Optional[float] = None  # stays None when no step runs
  pending = None
  for step in bar:
    t0 = time.perf_counter()
    batch = jnp.asarray(data.train_batch(step))
    params, opt_state, metrics = train_step(
        params, opt_state, rest, batch, jax.random.fold_in(base_key, step))
    # Fetch the previous step's scalars while this one runs (no sync per step).
    if pending is not None:
      _record(history, *pending)
    pending = (step, metrics)
    if step == 0:
      jax.block_until_ready(metrics['loss'])
      compile_s = time.perf_counter() - t0
    else:
      step_times.append(time.perf_counter() - t0)
    if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
      _record(history, *pending)
      pending = None
      ev = evaluate(eval_step, params, rest, val_batches)
      ev['step'] = step + 1
      evals.append(ev)
      bar.write(f'[{tc.optimizer}] step {step + 1}: val loss {ev["loss"]:.4f} '
                f'bpb {ev["bpb"]:.3f} ppl {ev["ppl"]:.2f} | aux/floor '
                f'{ev.get("aux_over_floor", float("nan")):.4f} '
                f'max expert share x E {ev.get("max_token_frac_x_E", float("nan")):.2f}')
    if step % 10 == 0 and history['loss']:
      rate = tokens_per_step / np.median(step_times[-20:]) if step_times else 0.0
      bar.set_postfix(loss=f'{history["loss"][-1]:.3f}', tok_s=f'{rate:,.0f}')
  if pending is not None:
    _record(history, *pending)
  if not evals:  # `--steps 0`: the initial model, so that the report still has numbers
    ev = evaluate(eval_step, params, rest, val_batches)
    ev['step'] = 0
    evals.append(ev)
  jax.block_until_ready(params)
  wall = time.perf_counter() - start
  # The first step is compile time: with fewer than two steps there is no step time
  # (None, not NaN, so that the JSON stays valid).
  step_s = float(np.median(step_times)) if step_times else None

  final = evals[-1]
  return {
      'config': dataclasses.asdict(tc),
      'model': dataclasses.asdict(cfg),
      'optimizer': opt_info,
      'data': data.summary(),
      'params': model_lib.count_params(params),
      'param_counts': model_lib.param_counts(params),
      'history': history,
      'evals': evals,
      'final': {k: final[k] for k in ('loss', 'bpb', 'ppl')},
      'best': min(evals, key=lambda e: e['loss'])['loss'],
      'router': {k: v for k, v in final.items() if k not in ('loss', 'bpb', 'ppl', 'step')},
      'memory': {
          'total_state_bytes': memory.total_state_bytes,
          'tiers': [dataclasses.asdict(t) for t in memory.tiers],
          'table': memory.format(),
      },
      'timing': {
          'wall_s': wall, 'compile_s': compile_s, 'median_step_s': step_s,
          'tokens_per_s': tokens_per_step / step_s if step_s else None,
          'tokens_per_step': tokens_per_step,
      },
      'machine': machine_info(),
  }


def _record(history: dict[str, list], step: int, metrics: dict[str, Any]) -> None:
  m = jax.device_get({k: metrics[k] for k in ('loss', 'ce', 'aux', 'grad_norm')})
  history['step'].append(step)
  for k, v in m.items():
    history[k].append(float(v))


def machine_info() -> dict[str, Any]:
  """Where the numbers come from."""
  import flax
  return {
      'platform': platform.platform(), 'processor': platform.processor(),
      'cpu_count': os.cpu_count(), 'backend': jax.default_backend(),
      'devices': [str(d) for d in jax.devices()], 'python': platform.python_version(),
      'jax': jax.__version__, 'optax': optax.__version__, 'flax': flax.__version__,
      'skewadam_jax': sj.__version__,
      'load_avg': os.getloadavg() if hasattr(os, 'getloadavg') else None,
  }


# ----------------------------------------------------------------------------- report


def _num(x: Optional[float], spec: str) -> str:
  """`format(x, spec)`, or `n/a` for a figure the run could not measure."""
  return 'n/a' if x is None or math.isnan(x) else format(x, spec)


def summary_table(results: list[dict[str, Any]]) -> str:
  """Markdown: final/best validation loss, bpb, ppl, state bytes, router balance, speed."""
  lines = ['| optimizer | lr | final val loss | best val loss | bits/byte | perplexity '
           '| state bytes | aux / floor | tokens/s |',
           '|---|---:|---:|---:|---:|---:|---:|---:|---:|']
  for r in results:
    f = r['final']
    lines.append(
        f'| {r.get("label", r["optimizer"]["optimizer"])} | {r["optimizer"]["lr"]:g} | '
        f'{f["loss"]:.4f} | {r["best"]:.4f} | {f["bpb"]:.4f} | {f["ppl"]:.3f} | '
        f'{r["memory"]["total_state_bytes"]:,} | '
        f'{r["router"].get("aux_over_floor", float("nan")):.4f} | '
        f'{_num(r["timing"]["tokens_per_s"], ",.0f")} |')
  return '\n'.join(lines)


def running_mean(x: list[float], k: int) -> np.ndarray:
  """Trailing mean over up to `k` points; the first points average what exists so far.

  Unlike `np.convolve(..., mode='valid')` it keeps the first points (the steep start of
  the curve) instead of starting the curve `k - 1` steps late.
  """
  c = np.cumsum(np.asarray(x, np.float64))
  n = np.arange(1, len(c) + 1)
  lag = np.concatenate([np.zeros(1), c])[np.maximum(n - k, 0)]
  return (c - lag) / np.minimum(n, k)


def plot_losses(results: list[dict[str, Any]], path: Path, title: str = '') -> None:
  """Training loss (running mean, thin) and validation loss (markers) against step.

  The y axis is logarithmic with limits spanning every plotted point, so that both the
  steep start near ln 256 and the small differences at the end stay visible.
  """
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from matplotlib.ticker import LogLocator, MaxNLocator, ScalarFormatter

  fig, ax = plt.subplots(figsize=(8, 5))
  shown: list[float] = []
  for i, r in enumerate(results):
    color = f'C{i % 10}'
    label = r.get('label', r['optimizer']['optimizer'])
    h = r['history']
    if h['ce'] and len(results) <= 2:  # more train curves would hide the val points
      k = max(1, len(h['ce']) // 50)
      smooth = running_mean(h['ce'], k)
      ax.plot(np.asarray(h['step']) + 1, smooth, color=color, alpha=0.45, lw=1,
              label=f'{label} train CE (router noise on'
                    + (f', mean of {k} steps)' if k > 1 else ')'))
      shown += [float(smooth.min()), float(smooth.max())]
    vals = [e['loss'] for e in r['evals']]
    ax.plot([e['step'] for e in r['evals']], vals, 'o-', color=color, ms=3,
            label=f'{label} val (no router noise)')
    shown += vals
  ax.set_xlabel('step')
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_ylabel('cross-entropy (nats / byte, log scale)')
  if shown:
    ax.set_yscale('log')
    ax.set_ylim(min(shown) * 0.97, max(shown) * 1.03)
    # Plain numbers on minor ticks every 0.5 x 10^n too: the range is under a decade,
    # so the 10^n major ticks alone would leave the axis unlabelled.
    ax.yaxis.set_minor_locator(LogLocator(subs=np.arange(1.0, 10.0, 0.5)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
  ax.grid(alpha=0.3, which='both')
  ax.legend(fontsize=7)
  ax.set_title(title or 'MoE byte-level LM')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_outputs(result: dict[str, Any], out: str | os.PathLike[str]) -> dict[str, Path]:
  """Writes `<optimizer>.json`, `<optimizer>.png` and `<optimizer>.md` under `out`."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  stem = result['optimizer']['optimizer'] + ('-bf16' if result['config']['bf16'] else '')
  paths = {'json': out / f'{stem}.json', 'png': out / f'{stem}.png', 'md': out / f'{stem}.md'}
  paths['json'].write_text(json.dumps(result, indent=1, default=str))
  plot_losses([result], paths['png'], title=f'{stem} on {result["config"]["preset"]}')
  paths['md'].write_text(report(result) + '\n')
  return paths


def report(result: dict[str, Any]) -> str:
  """The closing markdown: results, optimizer state per tier, router balance."""
  r = result
  frac = np.asarray(r['router'].get('token_frac', []))
  lines = [
      f'## {r["optimizer"]["optimizer"]} on `{r["config"]["preset"]}` '
      f'({r["params"]:,} parameters; {r["config"]["steps"]} steps x '
      f'{r["timing"]["tokens_per_step"]:,} tokens)', '',
      summary_table([r]), '',
      '### Optimizer state per tier (float32 state; `skewadam_jax.memory_report`)', '',
      r['memory']['table'], '',
  ]
  if frac.size:
    lines += ['### Router (validation, no noise)', '',
              f'aux loss {r["router"]["aux"]:.5f} vs floor {r["router"]["aux_floor"]:.5f} '
              f'(ratio {r["router"]["aux_over_floor"]:.4f}); dropped assignments '
              f'{100 * r["router"]["drop_frac"]:.2f}%', '',
              '| MoE layer | token fraction per expert (uniform = '
              f'{1 / frac.shape[-1]:.4f}) |', '|---|---|']
    for i, row in enumerate(frac):
      lines.append(f'| {i} | {" ".join(f"{x:.3f}" for x in row)} |')
  t = r['timing']
  step_ms = None if t['median_step_s'] is None else 1e3 * t['median_step_s']
  lines += ['', f'{_num(t["tokens_per_s"], ",.0f")} tokens/s (median step '
            f'{_num(step_ms, ".0f")} ms), compile {_num(t["compile_s"], ".1f")} s, wall '
            f'{t["wall_s"]:.1f} s on {r["machine"]["cpu_count"]} CPU cores '
            f'({r["machine"]["backend"]}).']
  return '\n'.join(lines)


def build_parser() -> argparse.ArgumentParser:
  """The command line (flags are `TrainConfig`'s fields; underscores accepted too)."""
  d = TrainConfig()
  p = _cli.parser(__doc__.splitlines()[0])
  _cli.option(p, '--optimizer', default=d.optimizer, choices=opt_lib.OPTIMIZERS,
              help='optimizer (see optimizers.py)')
  _cli.option(p, '--preset', default=d.preset, choices=sorted(model_lib.PRESETS),
              help='model size')
  _cli.option(p, '--steps', type=int, default=d.steps,
              help='training steps (0: evaluate the initial model only)')
  _cli.option(p, '--batch-size', type=int, default=d.batch_size, help='sequences per step')
  _cli.option(p, '--seq-len', type=int, default=d.seq_len,
              help="tokens per sequence; unset: the preset's max_len")
  _cli.option(p, '--lr', type=float, default=d.lr,
              help='peak learning rate; unset: per optimizer, see optimizers.py')
  _cli.option(p, '--warmup', type=int, default=d.warmup, help='linear warmup steps')
  _cli.option(p, '--weight-decay', type=float, default=d.weight_decay,
              help='decoupled weight decay')
  _cli.option(p, '--eval-every', type=int, default=d.eval_every,
              help='validate every this many steps (and after the last)')
  _cli.option(p, '--eval-batches', type=int, default=d.eval_batches,
              help='validation batches per evaluation')
  _cli.option(p, '--seed', type=int, default=d.seed, help='weights, batches and router noise')
  _cli.option(p, '--bf16', action='store_true',
              help='bf16 weights (norms, router fp32), stochastic rounding')
  _cli.option(p, '--data-dir', default=d.data_dir,
              help='any local directory of text files; unset: the Python stdlib')
  _cli.option(p, '--suffixes', nargs='+', default=list(d.suffixes),
              help='file name endings to read under --data-dir')
  _cli.option(p, '--out', default=d.out, help='directory for the JSON, PNG and markdown')
  return p


def parse_args(argv: Optional[list[str]] = None) -> TrainConfig:
  """`TrainConfig` from the command line (`sys.argv[1:]` when `argv` is None)."""
  p = build_parser()
  a = p.parse_args(argv)
  for flag, value in (('--steps', a.steps), ('--warmup', a.warmup)):
    if value < 0:
      p.error(f'{flag} must be >= 0, not {value}')
  for flag, value in (('--batch-size', a.batch_size), ('--eval-every', a.eval_every),
                      ('--eval-batches', a.eval_batches)):
    if value < 1:
      p.error(f'{flag} must be >= 1, not {value}')
  return TrainConfig(
      optimizer=a.optimizer, preset=a.preset, steps=a.steps, batch_size=a.batch_size,
      seq_len=a.seq_len, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay,
      eval_every=a.eval_every, eval_batches=a.eval_batches, seed=a.seed, bf16=a.bf16,
      data_dir=a.data_dir, suffixes=tuple(a.suffixes), out=a.out)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  """Trains from the command line, writes the outputs and returns the run record."""
  tc = parse_args(argv)
  cfg = model_config(tc)
  data = load_data(tc, cfg)
  print(data.summary())
  print(f'{tc.preset}: {model_lib.param_counts(model_lib.abstract_params(cfg))}')
  result = train(tc, data)
  paths = write_outputs(result, tc.out)
  print()
  print(report(result))
  print(f'\nwrote {", ".join(str(p) for p in paths.values())}')
  return result


if __name__ == '__main__':
  main()
