"""Train the example MoE language model on bytes of local text, with any optimizer.

One command trains the `small` preset (1.8M parameters, 86% in experts) on the CPython
standard library's sources with the recommended SkewAdam policy and with AdamW, from the
same initial weights on the same batches, each at its best learning rate in the
quality sweep (`optimizers.RECOMMENDED`, `optimizers.BASELINE`, `optimizers.SWEPT_LR`), and ends
with one table and one plot comparing them:

  python examples/moe_lm/train.py                       # recommended vs AdamW, ~3 min
  python examples/moe_lm/train.py --optimizer skewadam  # one optimizer alone
  python examples/moe_lm/train.py --optimizers skewadam skewadam-muon adamw
  python examples/moe_lm/train.py --bf16                # bf16 weights, stochastic rounding
  python examples/moe_lm/train.py --data-dir ~/notes --suffixes .md .txt

Flow: config -> data -> model -> optimizer -> jitted step -> loop -> report, once per
optimizer, then the comparison.

* Schedule: linear warmup then cosine to 0 (`optax.warmup_cosine_decay_schedule`);
  global gradient-norm clip 1.0; optimizers by `--optimizers` or `--optimizer` (see
  `optimizers.py`), each at `--lr` if given, else at its default learning rate.
* The step is a pure function of `(params, opt_state, batch, key)` built with
  `nnx.split` / `nnx.merge` and `jax.jit(donate_argnums=(0, 1))`, so parameters and
  optimizer state are updated in place. With `--bf16` the weights (not norms and router)
  are bfloat16, gradients are cast to float32, optimizer state is float32 and the update
  is applied with `skewadam_jax.apply_updates_stochastic` (unbiased rounding).
* Every `--eval-every` steps: validation loss, bits per byte and perplexity (per byte),
  and router health per MoE layer on the validation batches without router noise (see
  `router_stats`): each expert's share of the assignments over the uniform share (max,
  min), dead experts, the load entropy over log E, the mean top-1 router probability
  and the router weight norm. The Switch aux loss over its floor is kept but it is
  blind to collapse: it is ~1 whenever the router's probabilities are near uniform,
  whatever the assignments.
* With `--ckpt-dir DIR`: params, optimizer state and the history are checkpointed every
  `--ckpt-every` steps and after the last (Orbax, asynchronously unless `--sync-ckpt`),
  and the same command rerun after a crash resumes from the newest intact checkpoint
  (`examples/checkpointing.py`'s `TrainCheckpointer`): batches, router noise and
  rounding keys are functions of `(seed, step)`, so it ends bitwise where an
  uninterrupted run ends. With several optimizers each checkpoints to its own
  subdirectory, `DIR/<optimizer>`; one finished before a crash resumes at its end.
* At the end, with several optimizers: one table (per optimizer: final validation loss,
  optimizer state bytes per tier and in total, dead experts, tokens/s), one PNG with
  every loss curve, a markdown file with the table and each run's full report (router
  health over training), and a JSON per run, under `--out` (default `runs/moe_lm/`,
  named `<a>-vs-<b>`). With one optimizer: its markdown report (state bytes per tier,
  router health), a loss-curve PNG, a PNG of each expert's load over training and a
  JSON of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import textwrap
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
from examples import checkpointing  # noqa: E402
from examples.moe_lm import data as data_lib  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402
from examples.moe_lm import optimizers as opt_lib  # noqa: E402

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass
class TrainConfig:
  """Everything one optimizer's run depends on (the command-line flags)."""
  optimizer: str = opt_lib.RECOMMENDED
  preset: str = 'small'
  # Two optimizers by default: 400 steps each keep the first command at a few minutes.
  steps: int = 400
  batch_size: int = 16
  seq_len: Optional[int] = None  # None: the preset's max_len
  lr: Optional[float] = None  # None: optimizers.default_lr(optimizer)
  muon_adam_lr: Optional[float] = None  # Muon's Adam branch; None: optimizers.ADAM_LR
  warmup: int = 40
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  eval_every: int = 100
  eval_batches: int = 8
  seed: int = 0
  bf16: bool = False
  data_dir: Optional[str] = None  # None: the Python standard library
  suffixes: tuple[str, ...] = ('.py',)
  out: str = 'runs/moe_lm'
  ckpt_dir: Optional[str] = None  # None: no checkpoints
  ckpt_every: int = 100
  ckpt_keep: int = 3
  sync_ckpt: bool = False
  ckpt_fingerprints: bool = False


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
    for k in ('ce', 'aux', 'z', 'aux_floor', 'token_frac', 'top1_prob', 'router_norm'):
      if k in m:
        sums[k] = sums.get(k, 0.0) + np.asarray(m[k], np.float64)
  mean = {k: v / len(batches) for k, v in sums.items()}
  ce = float(mean['ce'])
  out = {'loss': ce, 'bpb': ce / LN2, 'ppl': math.exp(ce)}
  out.update(router_stats(mean))
  return out


ROUTER_HEALTH = ('load_max_x_uniform', 'load_min_x_uniform', 'dead_experts',
                 'load_entropy_ratio', 'top1_prob', 'router_norm')


def router_stats(m: dict[str, Any]) -> dict[str, Any]:
  """Router health per MoE layer (lists of length L) from mean validation metrics.

  `token_frac` `[L][E]` is each expert's share of the assignments; `ROUTER_HEALTH`
  are the figures of `model.load_health` plus the mean top-1 router probability and
  the router kernel's Frobenius norm. `aux_over_floor` is the Switch aux loss over its
  floor: 1 means uniform router *probabilities*, which a collapsed assignment can
  have too, so it is kept for reference only.
  """
  if 'token_frac' not in m:
    return {}
  frac = np.asarray(m['token_frac'], np.float64)
  health = model_lib.load_health(frac)
  out: dict[str, Any] = {
      'aux': float(m['aux']), 'aux_floor': float(m['aux_floor']),
      'aux_over_floor': float(m['aux']) / float(m['aux_floor']),
      'n_experts': int(frac.shape[-1]),
      'token_frac': frac.round(5).tolist(),
  }
  out.update({k: np.asarray(v).tolist() for k, v in health.items()})
  out['top1_prob'] = np.asarray(m['top1_prob'], np.float64).tolist()
  out['router_norm'] = np.asarray(m['router_norm'], np.float64).tolist()
  return out


def _layers(values: Any, spec: str) -> str:
  """Per-layer values as `'a, b'` (one MoE layer: just `'a'`)."""
  return ', '.join(format(v, spec) for v in np.atleast_1d(values))


def health_line(ev: dict[str, Any]) -> str:
  """One line of router health for the progress log (per MoE layer, comma-separated)."""
  if 'token_frac' not in ev:
    return 'no MoE layer'
  return (f'load max/uniform {_layers(ev["load_max_x_uniform"], ".2f")} '
          f'min/uniform {_layers(ev["load_min_x_uniform"], ".2f")} '
          f'dead {_layers(ev["dead_experts"], "d")}/{ev["n_experts"]} '
          f'entropy/logE {_layers(ev["load_entropy_ratio"], ".3f")} '
          f'top-1 p {_layers(ev["top1_prob"], ".3f")} '
          f'|W_router| {_layers(ev["router_norm"], ".2f")}')


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
      weight_decay=tc.weight_decay, clip_norm=tc.clip_norm, muon_adam_lr=tc.muon_adam_lr)
  # Optimizer state is float32 whatever the weights are (as in the published runs).
  abstract = as_float32(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  opt_state = tx.init(as_float32(params))
  memory = sj.memory_report(tx, abstract)
  train_step = make_train_step(graphdef, tx, tc.bf16)
  eval_step = make_eval_step(graphdef)
  val_batches = data.val_batches(tc.eval_batches)
  base_key = jax.random.key(tc.seed)
  tokens_per_step = tc.batch_size * data.seq_len

  history: dict[str, list] = {'step': [], 'loss': [], 'ce': [], 'aux': [], 'grad_norm': []}
  if cfg.n_moe_blocks:
    history['drop_frac'] = []  # training only: evaluation is dropless
  evals: list[dict[str, Any]] = []
  ckpt, first = None, 0
  if tc.ckpt_dir is not None:
    ckpt, resumed = resume(tc, params, opt_state, sj.describe_state(tx, params))
    if resumed is not None:
      first, state, record = resumed
      params, opt_state = state['params'], state['opt_state']
      history, evals = record['history'], record['evals']
  step_times: list[float] = []
  bar = tqdm(range(first, tc.steps), desc=desc or tc.optimizer, disable=not progress,
             dynamic_ncols=True, mininterval=1.0, initial=first, total=tc.steps)
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
    if step == first:
      jax.block_until_ready(metrics['loss'])
      compile_s = time.perf_counter() - t0
    else:
      step_times.append(time.perf_counter() - t0)
    if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
      _record(history, *pending)
      pending = None
      ev = evaluate(eval_step, params, rest, val_batches)
      ev['step'] = step + 1
      if 'drop_frac' in history:
        since = evals[-1]['step'] if evals else 0
        ev['train_drop_frac'] = float(np.mean(history['drop_frac'][since:]))
      evals.append(ev)
      bar.write(f'[{tc.optimizer}] step {step + 1}: val loss {ev["loss"]:.4f} '
                f'bpb {ev["bpb"]:.3f} ppl {ev["ppl"]:.2f} | {health_line(ev)}')
    if ckpt is not None and ((step + 1) % tc.ckpt_every == 0 or step + 1 == tc.steps):
      if pending is not None:  # the history saved with step s ends at step s
        _record(history, *pending)
        pending = None
      ckpt.save(step + 1, {'params': params, 'opt_state': opt_state},
                {'history': history, 'evals': evals}, force=True)
    if step % 10 == 0 and history['loss']:
      rate = tokens_per_step / np.median(step_times[-20:]) if step_times else 0.0
      bar.set_postfix(loss=f'{history["loss"][-1]:.3f}', tok_s=f'{rate:,.0f}')
  if pending is not None:
    _record(history, *pending)
  if ckpt is not None:
    ckpt.close()  # the last save complete, manifest included
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


def resume(tc: TrainConfig, params: Any, opt_state: Any, description: Any = None
           ) -> tuple[checkpointing.TrainCheckpointer, Optional[tuple[int, Any, Any]]]:
  """The run's checkpointer, and `(step, state, record)` of its newest intact step.

  The restore target is the freshly built params and state, so a checkpoint of another
  optimizer, tier policy or state dtype is refused with a message naming what differs.
  """
  ckpt = checkpointing.TrainCheckpointer(
      tc.ckpt_dir, every=tc.ckpt_every, keep=tc.ckpt_keep, use_async=not tc.sync_ckpt,
      show_fingerprints=tc.ckpt_fingerprints, log=lambda line: print(line, flush=True),
      description=description)  # sj.describe_state: a step of another codec is refused
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        {'params': params, 'opt_state': opt_state})
  return ckpt, ckpt.restore(target)


def _record(history: dict[str, list], step: int, metrics: dict[str, Any]) -> None:
  m = jax.device_get({k: metrics[k] for k in history if k != 'step'})
  history['step'].append(step)
  for k, v in m.items():
    history[k].append(float(np.mean(v)))  # drop_frac: mean over MoE layers


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
  """Markdown: final/best validation loss, bpb, ppl, state bytes, router health, speed.

  Router columns are per MoE layer (comma-separated), on validation without noise.
  """
  lines = ['| optimizer | lr | final val loss | best val loss | bits/byte | perplexity '
           '| state bytes | dead experts | max share / uniform | load entropy / log E '
           '| Switch aux / floor (blind to collapse) | tokens/s |',
           '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for r in results:
    f, rt = r['final'], r['router']
    dead = (f'{_layers(rt["dead_experts"], "d")} of {rt["n_experts"]}'
            if 'dead_experts' in rt else 'n/a')
    lines.append(
        f'| {r.get("label", r["optimizer"]["optimizer"])} | {r["optimizer"]["lr"]:g} | '
        f'{f["loss"]:.4f} | {r["best"]:.4f} | {f["bpb"]:.4f} | {f["ppl"]:.3f} | '
        f'{r["memory"]["total_state_bytes"]:,} | {dead} | '
        f'{_layers(rt.get("load_max_x_uniform", float("nan")), ".2f")} | '
        f'{_layers(rt.get("load_entropy_ratio", float("nan")), ".3f")} | '
        f'{rt.get("aux_over_floor", float("nan")):.4f} | '
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
  # Below the axes: long policy names would otherwise cover the curves' start.
  ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.14))
  ax.set_title('\n'.join(textwrap.fill(line, 90) for line in
                         (title or 'MoE byte-level LM').split('\n')), fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches='tight')
  plt.close(fig)


LOAD_CLIP = 4.0  # the load heat map's colours saturate at 2^-4 and 2^4 times uniform


def expert_load(record: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
  """`(steps [N], share / uniform [L, E, N])` of a run's evaluations."""
  evals = [e for e in record['evals'] if 'token_frac' in e]
  steps = np.asarray([e['step'] for e in evals], np.float64)
  frac = np.stack([np.asarray(e['token_frac'], np.float64) for e in evals], axis=-1)
  return steps, frac * frac.shape[1]


def _edges(steps: np.ndarray) -> np.ndarray:
  """Cell edges: each eval's column spans (previous eval, this eval], the first from 0."""
  return np.concatenate([[0.0 if steps[0] > 0 else -1.0], steps])


def draw_expert_load(ax: Any, record: dict[str, Any], title: str) -> Any:
  """Heat map of log2(share / uniform) per expert (rows) and eval step (columns).

  Experts are sorted by their final share within each MoE layer (most loaded on top),
  layers are stacked top to bottom, and dead experts (share 0) saturate at the blue
  end. Returns the mesh (for a colour bar).
  """
  steps, load = expert_load(record)
  n_layers, n_experts, _ = load.shape
  rows = [layer[np.argsort(layer[:, -1])] for layer in load[::-1]]
  img = np.log2(np.clip(np.concatenate(rows), 2**-LOAD_CLIP, 2**LOAD_CLIP))
  mesh = ax.pcolormesh(_edges(steps), np.arange(n_layers * n_experts + 1), img,
                       cmap='RdBu_r', vmin=-LOAD_CLIP, vmax=LOAD_CLIP, shading='flat')
  for i in range(1, n_layers):
    ax.axhline(i * n_experts, color='k', lw=1)
  ax.set_yticks([(n_layers - 1 - i + 0.5) * n_experts for i in range(n_layers)])
  ax.set_yticklabels([f'MoE layer {i}' for i in range(n_layers)], rotation=90,
                     va='center', fontsize=8)
  ax.set_xlabel('step (each column ends at its evaluation)')
  ax.set_title(title, fontsize=9)
  return mesh


def _load_colorbar(fig: Any, mesh: Any, axes: Any) -> None:
  ticks = np.arange(-LOAD_CLIP, LOAD_CLIP + 1, 2)
  bar = fig.colorbar(mesh, ax=axes, ticks=ticks, fraction=0.05, pad=0.02)
  bar.ax.set_yticklabels([f'{2.0**t:g}x' if t >= 0 else f'1/{2.0**-t:g}x' for t in ticks])
  bar.set_label('share / uniform (val, no noise)')


def plot_router(records: list[tuple[str, dict[str, Any]]], path: Path,
                title: str = '') -> None:
  """Per-expert load over training, one heat-map panel per `(label, record)`.

  With a single record a second panel shows the router health over training: dead
  experts / E, load entropy / log E, and the router weight norm (right axis).
  """
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  records = [(label, r) for label, r in records if any('token_frac' in e for e in r['evals'])]
  if not records:
    return
  single = len(records) == 1
  n = 2 if single else len(records)
  cols = n if n <= 4 else math.ceil(n / 2)
  rows = math.ceil(n / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols + 1.6, 3.8 * rows),
                           squeeze=False, constrained_layout=True)
  fig.get_layout_engine().set(wspace=0.12)  # room for the colour bar's label
  flat = list(axes.ravel())
  heat_axes = flat[:1] if single else flat[:len(records)]
  mesh = None
  for ax, (label, r) in zip(heat_axes, records):
    mesh = draw_expert_load(ax, r, f'{label}: expert load (sorted by final share)')
  _load_colorbar(fig, mesh, heat_axes)
  if single:
    _draw_health(flat[1], records[0][1])
  for ax in flat[n:]:
    ax.axis('off')
  fig.suptitle(title or 'router health over training', fontsize=10)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _draw_health(ax: Any, record: dict[str, Any]) -> None:
  """Dead experts / E, entropy / log E (left axis) and router norm (right), per layer."""
  evals = [e for e in record['evals'] if 'token_frac' in e]
  steps = [e['step'] for e in evals]
  n_layers = len(evals[0]['token_frac'])
  twin = ax.twinx()
  for i in range(n_layers):
    suffix = f' (layer {i})' if n_layers > 1 else ''
    ax.plot(steps, [e['dead_experts'][i] / e['n_experts'] for e in evals], 'o-', ms=5,
            lw=2.5, color='C3', alpha=1 - 0.3 * i, label='dead experts / E' + suffix)
    ax.plot(steps, [e['load_entropy_ratio'][i] for e in evals], 's:', ms=3,
            color='C0', alpha=1 - 0.3 * i, label='load entropy / log E' + suffix)
    twin.plot(steps, [e['router_norm'][i] for e in evals], '^--', ms=3, color='C2',
              alpha=1 - 0.3 * i, label='router weight norm' + suffix)
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel('step')
  ax.set_ylabel('fraction')
  twin.set_ylabel('router kernel Frobenius norm')
  twin.set_ylim(bottom=0)
  lines = ax.get_lines() + twin.get_lines()
  ax.legend(lines, [line.get_label() for line in lines], fontsize=7, ncol=3,
            loc='upper center', bbox_to_anchor=(0.5, -0.16))
  ax.grid(alpha=0.3)
  ax.set_title('router health (validation, no router noise)', fontsize=9)


def write_outputs(result: dict[str, Any], out: str | os.PathLike[str]) -> dict[str, Path]:
  """Writes `<optimizer>.json`, `.png` (loss), `-router.png` (expert load) and `.md`."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  stem = result['optimizer']['optimizer'] + ('-bf16' if result['config']['bf16'] else '')
  paths = {'json': out / f'{stem}.json', 'png': out / f'{stem}.png',
           'router_png': out / f'{stem}-router.png', 'md': out / f'{stem}.md'}
  paths['json'].write_text(json.dumps(result, indent=1, default=str))
  title = f'{stem} on {result["config"]["preset"]}'
  plot_losses([result], paths['png'], title=title)
  plot_router([(stem, result)], paths['router_png'], title=f'{title}: router health')
  if not paths['router_png'].exists():  # no MoE layer
    del paths['router_png']
  paths['md'].write_text(report(result) + '\n')
  return paths


def router_report(r: dict[str, Any]) -> list[str]:
  """Markdown lines: router health at the end, over training, and each expert's load."""
  rt = r['router']
  if 'token_frac' not in rt:
    return []
  e = rt['n_experts']
  share = np.asarray(rt['token_frac']) * e
  cf = r['model']['capacity_factor']
  drop = r['evals'][-1].get('train_drop_frac')
  lines = [
      '### Router health (validation, no router noise; dropless)', '',
      f'Per MoE layer: expert share of the token assignments over the uniform share '
      f'1/E = 1/{e}; dead = share below {model_lib.DEAD_BELOW:g} x uniform.', '',
      '| MoE layer | max share / uniform | min share / uniform | dead experts '
      '| load entropy / log E | mean top-1 router prob | router weight norm |',
      '|---|---:|---:|---:|---:|---:|---:|']
  for i in range(len(share)):
    lines.append(
        f'| {i} | {rt["load_max_x_uniform"][i]:.2f} | {rt["load_min_x_uniform"][i]:.2f} | '
        f'{rt["dead_experts"][i]} of {e} | {rt["load_entropy_ratio"][i]:.3f} | '
        f'{rt["top1_prob"][i]:.3f} (uniform {1 / e:.3f}) | {rt["router_norm"][i]:.3f} |')
  lines += [
      '', f'Switch aux loss / floor (1 = uniform probabilities; blind to collapse): '
      f'{rt["aux_over_floor"]:.4f} (aux {rt["aux"]:.5f}, floor {rt["aux_floor"]:.5f}).']
  if cf is None:
    lines.append('Dropped assignments: none by construction (capacity_factor None).')
  elif drop is not None:
    lines.append(f'Dropped assignments in training (noisy router, capacity factor {cf:g}), '
                 f'mean over the last {r["config"]["eval_every"]} steps: '
                 f'{100 * drop:.2f}%.')
  lines += ['', 'Over training (per MoE layer, comma-separated):', '',
            '| step | val loss | max / uniform | min / uniform | dead | entropy / log E '
            '| top-1 prob | router norm |', '|---:|---:|---:|---:|---:|---:|---:|---:|']
  for ev in r['evals']:
    lines.append(
        f'| {ev["step"]} | {ev["loss"]:.4f} | {_layers(ev["load_max_x_uniform"], ".2f")} | '
        f'{_layers(ev["load_min_x_uniform"], ".2f")} | {_layers(ev["dead_experts"], "d")} | '
        f'{_layers(ev["load_entropy_ratio"], ".3f")} | {_layers(ev["top1_prob"], ".3f")} | '
        f'{_layers(ev["router_norm"], ".3f")} |')
  lines += ['', '| MoE layer | share / uniform per expert (final) |', '|---|---|']
  for i, row in enumerate(share):
    lines.append(f'| {i} | {" ".join(f"{x:.2f}" for x in row)} |')
  return lines


def report(result: dict[str, Any]) -> str:
  """The closing markdown: results, optimizer state per tier, router balance."""
  r = result
  lines = [
      f'## {r["optimizer"]["optimizer"]} on `{r["config"]["preset"]}` '
      f'({r["params"]:,} parameters; {r["config"]["steps"]} steps x '
      f'{r["timing"]["tokens_per_step"]:,} tokens)', '',
      summary_table([r]), '',
      '### Optimizer state per tier (float32 state; `skewadam_jax.memory_report`)', '',
      r['memory']['table'], '',
  ]
  lines += router_report(r)
  t = r['timing']
  step_ms = None if t['median_step_s'] is None else 1e3 * t['median_step_s']
  lines += ['', f'{_num(t["tokens_per_s"], ",.0f")} tokens/s (median step '
            f'{_num(step_ms, ".0f")} ms), compile {_num(t["compile_s"], ".1f")} s, wall '
            f'{t["wall_s"]:.1f} s on {r["machine"]["cpu_count"]} CPU cores '
            f'({r["machine"]["backend"]}).']
  return '\n'.join(lines)


def tier_bytes(result: dict[str, Any]) -> dict[str, int]:
  """`{tier: optimizer state bytes}` of a run record, in `memory_report`'s order."""
  return {t['tier']: t['state_bytes'] for t in result['memory']['tiers']}


def comparison_table(results: list[dict[str, Any]]) -> str:
  """Markdown, one row per run: final validation loss, state bytes per tier, health, speed.

  Columns: optimizer, peak lr, final validation loss (no router noise) and its gap to
  `optimizers.BASELINE` when that ran, optimizer state bytes per tier (the union of the
  runs' tiers; `-` where a run has no such tier) and in total (with its share of the
  baseline's), dead experts per MoE layer, and training tokens/s.
  """
  tiers: list[str] = []
  for r in results:
    tiers += [t for t in tier_bytes(r) if t not in tiers]
  base = next((r for r in results if r['optimizer']['optimizer'] == opt_lib.BASELINE), None)
  header = ['optimizer', 'lr', 'final val loss']
  if base is not None:
    header.append(f'vs {opt_lib.BASELINE}')
  header += [f'state B, {t}' for t in tiers] + ['state B, total', 'dead experts', 'tokens/s']
  lines = ['| ' + ' | '.join(header) + ' |', '|---|' + '---:|' * (len(header) - 1)]
  for r in results:
    loss, total, by_tier = r['final']['loss'], r['memory']['total_state_bytes'], tier_bytes(r)
    rt = r['router']
    row = [r['optimizer']['optimizer'], f'{r["optimizer"]["lr"]:g}', f'{loss:.4f}']
    if base is not None:
      row.append(f'{100 * (loss / base["final"]["loss"] - 1):+.2f}%')
    row += [f'{by_tier[t]:,}' if t in by_tier else '-' for t in tiers]
    share = ('' if base is None or not base['memory']['total_state_bytes'] else
             f' ({100 * total / base["memory"]["total_state_bytes"]:.1f}%)')
    row += [f'{total:,}{share}',
            (f'{_layers(rt["dead_experts"], "d")} of {rt["n_experts"]}'
             if 'dead_experts' in rt else 'n/a'),
            _num(r['timing']['tokens_per_s'], ',.0f')]
    lines.append('| ' + ' | '.join(row) + ' |')
  return '\n'.join(lines)


def comparison_report(results: list[dict[str, Any]]) -> str:
  """The closing markdown of a run of several optimizers: a heading and one table."""
  r0 = results[0]
  names = ', '.join(r['optimizer']['optimizer'] for r in results)
  cores = r0['machine']['cpu_count']
  wall = sum(r['timing']['wall_s'] for r in results)
  return '\n'.join([
      f'## {names} on `{r0["config"]["preset"]}` ({r0["params"]:,} parameters; '
      f'{r0["config"]["steps"]} steps x {r0["timing"]["tokens_per_step"]:,} tokens each, '
      'the same initial weights and batches)', '',
      comparison_table(results), '',
      f'Validation without router noise, {r0["config"]["eval_batches"]} batches; dead '
      f'experts: below {model_lib.DEAD_BELOW:g} x the uniform share, per MoE layer; float32 '
      f'optimizer state (`skewadam_jax.memory_report`). Training wall {wall:.0f} s on '
      f'{cores} CPU cores.'])


def comparison_stem(results: list[dict[str, Any]]) -> str:
  """`<a>-vs-<b>[-bf16]`: the file stem of a comparison's outputs."""
  stem = '-vs-'.join(r['optimizer']['optimizer'] for r in results)
  return stem + ('-bf16' if results[0]['config']['bf16'] else '')


def write_comparison(results: list[dict[str, Any]], out: str | os.PathLike[str]
                     ) -> dict[str, Path]:
  """Writes a JSON per run, then one loss PNG and one markdown file of the comparison.

  The markdown has `comparison_report`'s table, then each run's `report` (state per
  tier, router health over training and each expert's final load).
  """
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  paths = {}
  for r in results:
    name = r['optimizer']['optimizer'] + ('-bf16' if r['config']['bf16'] else '')
    paths[f'json:{name}'] = out / f'{name}.json'
    paths[f'json:{name}'].write_text(json.dumps(r, indent=1, default=str))
  stem = comparison_stem(results)
  paths['png'], paths['md'] = out / f'{stem}.png', out / f'{stem}.md'
  names = [f'{r["optimizer"]["optimizer"]} (lr {r["optimizer"]["lr"]:g})' for r in results]
  # The legend names each optimizer's state bytes: the comparison is quality per byte.
  labelled = [dict(r, label=f'{r["optimizer"]["optimizer"]} (lr {r["optimizer"]["lr"]:g}, '
                            f'state {r["memory"]["total_state_bytes"]:,} B)') for r in results]
  plot_losses(labelled, paths['png'],
              title=f'{" vs ".join(names)}\n'
                    f'on {results[0]["config"]["preset"]}: same init, same batches')
  paths['md'].write_text('\n\n'.join([comparison_report(results), *map(report, results)])
                         + '\n')
  return paths


def build_parser() -> argparse.ArgumentParser:
  """The command line (flags are `TrainConfig`'s fields; underscores accepted too)."""
  d = TrainConfig()
  p = _cli.parser(__doc__.splitlines()[0])
  which = p.add_mutually_exclusive_group()
  _cli.option(which, '--optimizers', nargs='+', choices=opt_lib.OPTIMIZERS,
              default=[opt_lib.RECOMMENDED, opt_lib.BASELINE],
              help='optimizers to train one after the other from the same initial weights '
                   'on the same batches, then compare in one table and one plot (see '
                   'optimizers.py; the default: its RECOMMENDED policy and its BASELINE)')
  _cli.option(which, '--optimizer', choices=opt_lib.OPTIMIZERS,
              help='train this one optimizer alone (the same as --optimizers NAME)')
  _cli.option(p, '--preset', default=d.preset, choices=sorted(model_lib.PRESETS),
              help='model size')
  _cli.option(p, '--steps', type=int, default=d.steps,
              help='training steps (0: evaluate the initial model only)')
  _cli.option(p, '--batch-size', type=int, default=d.batch_size, help='sequences per step')
  _cli.option(p, '--seq-len', type=int, default=d.seq_len,
              help="tokens per sequence; unset: the preset's max_len")
  _cli.option(p, '--lr', type=float, default=d.lr,
              help='peak learning rate of every optimizer trained; unset: each its own '
                   '(default_lr in optimizers.py: the swept best, else DEFAULT_LR)')
  _cli.option(p, '--muon-adam-lr', type=float, default=d.muon_adam_lr,
              help="peak lr of Muon's Adam branch (embeddings, norms, router); unset: "
                   f'{opt_lib.ADAM_LR:g}')
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
  _cli.option(p, '--out', default=d.out, help='directory for the JSON, PNGs and markdown')
  _cli.option(p, '--ckpt-dir', default=d.ckpt_dir,
              help='checkpoint directory: save there, and resume from its newest intact '
                   'step when rerun with the same command (a damaged newest step is '
                   'skipped and moved to DIR/damaged/); with several optimizers, one '
                   'subdirectory DIR/<optimizer> each; unset: no checkpoints')
  checkpointing.add_resume_options(p, every=d.ckpt_every, keep=d.ckpt_keep)
  return p


def parse_args(argv: Optional[list[str]] = None) -> list[TrainConfig]:
  """One `TrainConfig` per optimizer to train, from the command line.

  Args:
    argv: the flags; None means `sys.argv[1:]`.

  Returns:
    The configurations, in the order of `--optimizers` (`--optimizer NAME`: one). They
    differ in `optimizer` only, and in `ckpt_dir` with several optimizers and a
    `--ckpt-dir DIR`: each then checkpoints to `DIR/<optimizer>`.
  """
  p = build_parser()
  a = p.parse_args(argv)
  for flag, value in (('--steps', a.steps), ('--warmup', a.warmup)):
    if value < 0:
      p.error(f'{flag} must be >= 0, not {value}')
  for flag, value in (('--batch-size', a.batch_size), ('--eval-every', a.eval_every),
                      ('--eval-batches', a.eval_batches), ('--ckpt-every', a.ckpt_every),
                      ('--ckpt-keep', a.ckpt_keep)):
    if value < 1:
      p.error(f'{flag} must be >= 1, not {value}')
  names = [a.optimizer] if a.optimizer is not None else list(a.optimizers)
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    p.error(f'--optimizers names {", ".join(repeated)} more than once')
  base = TrainConfig(
      optimizer=names[0], preset=a.preset, steps=a.steps, batch_size=a.batch_size,
      seq_len=a.seq_len, lr=a.lr, muon_adam_lr=a.muon_adam_lr, warmup=a.warmup,
      weight_decay=a.weight_decay, eval_every=a.eval_every, eval_batches=a.eval_batches,
      seed=a.seed, bf16=a.bf16, data_dir=a.data_dir, suffixes=tuple(a.suffixes), out=a.out,
      ckpt_dir=a.ckpt_dir, ckpt_every=a.ckpt_every, ckpt_keep=a.ckpt_keep,
      sync_ckpt=a.sync_ckpt, ckpt_fingerprints=a.ckpt_fingerprints)
  if len(names) == 1:
    return [base]
  # Several runs in one directory would restore each other's state: one each.
  return [dataclasses.replace(
      base, optimizer=n, ckpt_dir=None if a.ckpt_dir is None else str(Path(a.ckpt_dir) / n))
          for n in names]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  """Trains from the command line, writes the outputs and returns what was trained.

  Returns:
    With one optimizer, its run record (see `train`); with several, `{optimizer: run
    record}` in the order they were trained.
  """
  configs = parse_args(argv)
  tc = configs[0]
  cfg = model_config(tc)
  data = load_data(tc, cfg)
  print(data.summary())
  print(f'{tc.preset}: {model_lib.param_counts(model_lib.abstract_params(cfg))}')
  if len(configs) == 1:
    result = train(tc, data)
    paths = write_outputs(result, tc.out)
    print()
    print(report(result))
    print(f'\nwrote {", ".join(str(p) for p in paths.values())}')
    return result
  lrs = [opt_lib.default_lr(c.optimizer) if c.lr is None else c.lr for c in configs]
  print(f'training {", ".join(f"{c.optimizer} (lr {lr:g})" for c, lr in zip(configs, lrs))}'
        f', {tc.steps} steps each, from the same initial weights on the same batches')
  results = [train(c, data) for c in configs]
  paths = write_comparison(results, tc.out)
  print(f'\nwrote {", ".join(str(p) for p in paths.values())}\n')
  print(comparison_report(results))
  return {r['optimizer']['optimizer']: r for r in results}


if __name__ == '__main__':
  main()
