"""AdamPM fidelity: how close AdamPM's update is to Adam's, step by step, in real training.

Trains the example MoE LM with Adam(W) and, from the same (clipped) gradients, computes
AdamPM's update in shadow for group sizes s in {1, 2, 4, 8, 16, 64}. Because pooling and
the EMA are both linear, AdamPM's second moment on the same gradients is exactly
`groupmean_s(v_Adam)`, so for every s

  u_Adam  = m_hat / (sqrt(v / bc2) + eps)
  u_PM(s) = m_hat / (sqrt(expand_s(groupmean_s(v)) / bc2) + eps)

pooled along `--axes`: -1 (the last axis, the output axis of an `[in, out]` kernel, as
`skewadam_jax.adampm`'s default) and/or -2 (the input axis; `[E, in, out]` expert banks
pool along `in` too). 1-D leaves always pool along their only axis, 0-d leaves are not
pooled. Every axis is computed in the same run from the same Adam moments. The script
checks the identity against `skewadam_jax.scale_by_grouped_second_moment(axis=...)` run on
the same gradients (s = 8, one per axis) and reports the per-step cosine similarity of
u_PM(s) and u_Adam, over the whole model and per leaf: median and 10th percentile over
steps, a markdown table, JSON and a plot.
Published (LLaMA 1.3B, s = 8): cosine similarity above 0.993 on most steps.

`--widths` runs a width series instead: the preset with d_model = d_ff = d_expert = width
and head_dim = width // n_heads, everything else equal (seed, batches, lr, steps), and
writes `adampm_fidelity_widths.{md,json,png}` (median cosine against width, per axis).

  python benchmarks/adampm_fidelity.py            # ~5 min on 2 shared CPU cores
  python benchmarks/adampm_fidelity.py --steps 1000 --preset base
  python benchmarks/adampm_fidelity.py --widths 64 128 256 512 --axes -1 -2 --steps 100
      # 10-18 min on one shared CPU core (widths 64-512: 0.46M-27.7M parameters)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import skewadam_jax as sj  # noqa: E402
from examples import _cli  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402
from examples.moe_lm import optimizers as opt_lib  # noqa: E402
from examples.moe_lm import train as train_lib  # noqa: E402

GROUP_SIZES = (1, 2, 4, 8, 16, 64)
AXES = (-1, -2)  # the output and the input axis of an [..., in, out] kernel
IDENTITY_S = 8  # group size of the identity check against the library transform
PUBLISHED = 0.993  # LLaMA 1.3B, s = 8
B1, B2, EPS = 0.9, 0.999, 1e-8
# XLA options of the jitted step (none: XLA's defaults). The tests set
# {'xla_backend_optimization_level': 0}, which halves the compile time of a tiny model.
COMPILER_OPTIONS: dict[str, Any] = {}


def pool_axis(ndim: int, axis: int) -> Optional[int]:
  """The non-negative axis a leaf of `ndim` dimensions is pooled along (None for 0-d).

  As `sj.scale_by_grouped_second_moment`: 1-D leaves pool along their only axis.
  """
  if ndim == 0:
    return None
  return 0 if ndim == 1 else axis % ndim


def _groupmean(x: jax.Array, s: int, axis: Optional[int]) -> jax.Array:
  """`sj.groupmean` as one reshape and mean where `s` divides the axis (quicker to compile)."""
  if axis is None or s == 1 or x.shape[axis] % s:
    return sj.groupmean(x, s, axis)
  return jnp.mean(x.reshape(x.shape[:axis] + (x.shape[axis] // s, s) + x.shape[axis + 1:]),
                  axis=axis + 1)


def pooled_update(mu: jax.Array, nu: jax.Array, count: jax.Array, s: int, axis: int = -1
                  ) -> jax.Array:
  """AdamPM's update from Adam's moments: nu pooled over groups of `s` along `axis`."""
  t = count.astype(jnp.float32)
  bc1, bc2 = 1 - B1**t, 1 - B2**t
  ax = pool_axis(nu.ndim, axis)
  n = nu.shape[ax] if ax is not None else 1
  pooled = sj.expand_groups(_groupmean(nu, s, ax), s, ax, n)
  return (mu / bc1) / (jnp.sqrt(pooled / bc2) + EPS)


def cosine(dot: jax.Array, sq_a: jax.Array, sq_b: jax.Array) -> jax.Array:
  """The cosine from a dot product and the two squared norms."""
  return dot / jnp.maximum(jnp.sqrt(sq_a * sq_b), 1e-30)


def make_step(graphdef: Any, tx: optax.GradientTransformation,
              shadows: dict[int, optax.GradientTransformation],
              group_sizes: Sequence[int] = GROUP_SIZES):
  """Adam step plus, from its state, AdamPM's update for every axis and s, and the cosines.

  `shadows` maps each pooling axis to the library's AdamPM transform (s = IDENTITY_S)
  run on the same clipped gradients, for the identity check.
  """
  clip = optax.clip_by_global_norm(1.0)

  def step(params, opt_state, shadow_states, rest, batch, key):
    def loss(p):
      return model_lib.loss_fn(nnx.merge(graphdef, p, rest), batch, True, key)

    (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    adam = opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    mus, nus = jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)
    u_adam = [pooled_update(m, v, adam.count, 1) for m, v in zip(mus, nus)]
    sq_adam = jnp.stack([jnp.sum(jnp.square(u)) for u in u_adam])
    clipped, _ = clip.update(grads, clip.init(params))
    whole, per_leaf, ident, new_shadow = {}, {}, {}, {}
    for axis, shadow in shadows.items():
      whole[axis], per_leaf[axis] = {}, {}
      for s in group_sizes:
        u_pm = [pooled_update(m, v, adam.count, s, axis) for m, v in zip(mus, nus)]
        # Cosines from per-leaf dot products and squared norms: the whole model's is
        # sum(dots) / sqrt(sum(|a|^2) sum(|b|^2)), without concatenating the leaves.
        dots = jnp.stack([jnp.vdot(a, b) for a, b in zip(u_pm, u_adam)])
        sq_pm = jnp.stack([jnp.sum(jnp.square(u)) for u in u_pm])
        whole[axis][s] = cosine(jnp.sum(dots), jnp.sum(sq_pm), jnp.sum(sq_adam))
        per_leaf[axis][s] = cosine(dots, sq_pm, sq_adam)
      # The identity check: AdamPM's own transform on the same clipped gradients.
      u_ref, new_shadow[axis] = shadow.update(clipped, shadow_states[axis], params)
      u_pm = [pooled_update(m, v, adam.count, IDENTITY_S, axis) for m, v in zip(mus, nus)]
      ident[axis] = jnp.max(jnp.stack([
          jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)
          for a, b in zip(u_pm, jax.tree.leaves(u_ref))]))
    params = optax.apply_updates(params, updates)
    return params, opt_state, new_shadow, value, whole, per_leaf, ident

  return jax.jit(step, donate_argnums=(0, 1, 2), compiler_options=COMPILER_OPTIONS or None)


def build_parser() -> argparse.ArgumentParser:
  """The command line (`--batch_size` is accepted for `--batch-size`)."""
  p = _cli.parser(__doc__.splitlines()[0])
  _cli.option(p, '--preset', default='small', choices=sorted(model_lib.PRESETS),
              help='model size (the base of every width with --widths)')
  _cli.option(p, '--widths', type=int, nargs='+', default=None,
              help='a width series: the preset with d_model = d_ff = d_expert = width, '
                   'head_dim = width // n_heads (default: the preset as it is)')
  _cli.option(p, '--axes', type=int, nargs='+', default=[-1], choices=AXES,
              help='shadow pooling axes: -1 output axis, -2 input axis')
  _cli.option(p, '--group-sizes', type=int, nargs='+', default=list(GROUP_SIZES),
              help='shadow group sizes s (must include 8, the published one)')
  _cli.option(p, '--steps', type=int, default=150, help='training steps')
  _cli.option(p, '--batch-size', type=int, default=16, help='sequences per step')
  _cli.option(p, '--lr', type=float, default=3e-4, help='peak learning rate')
  _cli.option(p, '--seed', type=int, default=0, help='weights and batches')
  _cli.option(p, '--out', default='runs/adampm_fidelity', help='output directory')
  return p


def width_config(preset: str, width: Optional[int]) -> model_lib.MoEConfig:
  """The preset (float32), or the preset at `width` with the rest unchanged."""
  if width is None:
    return model_lib.get_config(preset, param_dtype='float32')
  n_heads = model_lib.PRESETS[preset].n_heads
  if width % n_heads:
    raise ValueError(f'width {width} is not a multiple of n_heads = {n_heads}.')
  return model_lib.get_config(preset, param_dtype='float32', d_model=width, d_ff=width,
                              d_expert=width, head_dim=width // n_heads)


def run(cfg: model_lib.MoEConfig, args: argparse.Namespace, axes: Sequence[int],
        desc: str = 'adam + shadow adampm') -> dict[str, Any]:
  """Trains `cfg` with AdamW for `args.steps` and measures AdamPM in shadow per axis."""
  tc = train_lib.TrainConfig(preset=args.preset, batch_size=args.batch_size, seed=args.seed)
  data = train_lib.load_data(tc, cfg)
  graphdef, params, rest = train_lib.init_model(cfg, args.seed)
  paths = ['/'.join(train_lib.opt_lib._path_names(path)).removesuffix('/value')
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  n_params = int(sum(x.size for x in jax.tree.leaves(params)))
  shapes = {path: list(x.shape) for path, x in zip(paths, jax.tree.leaves(params))}
  schedule = opt_lib.warmup_cosine(args.lr, args.steps // 10, args.steps)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b1=B1, b2=B2, eps=EPS, weight_decay=0.1))
  shadows = {a: sj.scale_by_grouped_second_moment(B1, B2, EPS, group_size=IDENTITY_S,
                                                  axis=a)
             for a in axes}
  opt_state = tx.init(params)
  shadow_states = {a: sh.init(params) for a, sh in shadows.items()}
  sizes = tuple(args.group_sizes)
  step_fn = make_step(graphdef, tx, shadows, sizes)

  whole = {a: {s: [] for s in sizes} for a in axes}
  per_leaf = {a: {s: [] for s in sizes} for a in axes}
  idents = {a: [] for a in axes}
  losses = []
  key = jax.random.key(args.seed)
  start = time.perf_counter()
  for step in tqdm(range(args.steps), desc=desc, mininterval=1.0, leave=False):
    batch = jnp.asarray(data.train_batch(step))
    params, opt_state, shadow_states, loss, w, pl, ident = step_fn(
        params, opt_state, shadow_states, rest, batch, jax.random.fold_in(key, step))
    w, pl, loss, ident = jax.device_get((w, pl, loss, ident))
    losses.append(float(loss))
    for a in axes:
      idents[a].append(float(ident[a]))
      for s in sizes:
        whole[a][s].append(float(w[a][s]))
        per_leaf[a][s].append(np.asarray(pl[a][s]))
  wall = time.perf_counter() - start

  by_axis = {}
  for a in axes:
    rows = []
    for s in sizes:
      c = np.asarray(whole[a][s])
      leaf = np.stack(per_leaf[a][s])  # [steps, leaves]
      leaf_median = np.median(leaf, axis=0)
      worst = int(np.argmin(leaf_median))
      rows.append({
          's': s, 'median': float(np.median(c)), 'p10': float(np.percentile(c, 10)),
          'min': float(c.min()), 'frac_above_0.993': float(np.mean(c > PUBLISHED)),
          'median_after_warmup': float(np.median(c[args.steps // 10:])),
          'median_last_30pct': float(np.median(c[(7 * args.steps) // 10:])),
          'leaf_median_of_medians': float(np.median(leaf_median)),
          'worst_leaf': paths[worst], 'worst_leaf_median': float(leaf_median[worst]),
          'per_leaf_median': dict(zip(paths, leaf_median.round(5).tolist())),
      })
    by_axis[a] = {'rows': rows, 'identity_max_rel_err': max(idents[a]),
                  'whole_model_cosine': {str(s): whole[a][s] for s in sizes}}
  return {'model': dataclasses.asdict(cfg), 'params': n_params, 'wall_s': wall,
          'seq_len': data.seq_len, 'shapes': shapes, 'loss': losses, 'by_axis': by_axis}


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = build_parser().parse_args(argv)
  args.axes = list(dict.fromkeys(args.axes))  # unique, in the order given
  args.group_sizes = sorted(set(args.group_sizes))
  if 8 not in args.group_sizes or min(args.group_sizes) < 1:
    raise SystemExit('--group-sizes must be positive and include 8 (the published s).')
  command = ' '.join(['python'] + (sys.argv if argv is None else [sys.argv[0], *argv]))
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.widths:
    series(args, command, out)
  else:
    single(args, command, out)


def single(args: argparse.Namespace, command: str, out: Path) -> None:
  """One model (the preset): `adampm_fidelity.{md,json,png}`."""
  cfg = width_config(args.preset, None)
  res = run(cfg, args, args.axes)
  wall = res['wall_s']
  machine = train_lib.machine_info()
  md = [f'## AdamPM fidelity: cosine(AdamPM update, Adam update) per step, `{args.preset}` '
        f'MoE LM, {args.steps} Adam steps (lr {args.lr:g}, batch {args.batch_size} x '
        f'{res["seq_len"]})', '', f'Command: `{command}`  ',
        f'Machine: {machine["cpu_count"]} CPU cores, jax {machine["jax"]}; wall {wall:.0f} s. '
        + ' '.join(f'Identity check{_axis_note(a, args.axes)}: max relative '
                   f'|u_shadow - u_scale_by_grouped_second_moment| (s={IDENTITY_S}) = '
                   f'{res["by_axis"][a]["identity_max_rel_err"]:.2e}.' for a in args.axes)]
  for a in args.axes:
    if args.axes != [-1]:
      md += ['', f'### Pooled along axis {a} ({_axis_name(a)})']
    md += ['', '| s | median | 10th pct | min | steps > 0.993 | median after warmup '
           '| median leaf (median over steps) | worst leaf (its median) |',
           '|---:|---:|---:|---:|---:|---:|---:|---|']
    for r in res['by_axis'][a]['rows']:
      md.append(f'| {r["s"]} | {r["median"]:.5f} | {r["p10"]:.5f} | {r["min"]:.5f} | '
                f'{100 * r["frac_above_0.993"]:.0f}% | {r["median_after_warmup"]:.5f} | '
                f'{r["leaf_median_of_medians"]:.5f} | `{r["worst_leaf"]}` '
                f'({r["worst_leaf_median"]:.4f}) |')
  md += ['', 'Published (LLaMA 1.3B on C4, s = 8): above 0.993 on most steps.']
  text = '\n'.join(md)
  print(text)
  first = res['by_axis'][args.axes[0]]
  (out / 'adampm_fidelity.md').write_text(text + '\n')
  (out / 'adampm_fidelity.json').write_text(json.dumps({
      'command': command, 'args': vars(args), 'model': res['model'], 'params': res['params'],
      'machine': machine, 'wall_s': wall, 'rows': first['rows'], 'loss': res['loss'],
      'identity_max_rel_err': first['identity_max_rel_err'],
      'whole_model_cosine': first['whole_model_cosine'],
      'by_axis': {str(a): v for a, v in res['by_axis'].items()}}, indent=1))
  plot(res['by_axis'], out / 'adampm_fidelity.png', args)


def _row(res: dict[str, Any], axis: int, s: int) -> dict[str, Any]:
  """The summary row of group size `s` on `axis` in a `run` result."""
  return next(r for r in res['by_axis'][axis]['rows'] if r['s'] == s)


def _axis_name(axis: int) -> str:
  return {-1: 'output axis', -2: 'input axis'}[axis]


def _axis_note(axis: int, axes: Sequence[int]) -> str:
  return '' if list(axes) == [-1] else f' (axis {axis})'


def series(args: argparse.Namespace, command: str, out: Path) -> None:
  """A width series: `adampm_fidelity_widths.{md,json,png}`."""
  runs = {}
  start = time.perf_counter()
  for w in tqdm(args.widths, desc='widths'):
    runs[w] = run(width_config(args.preset, w), args, args.axes, desc=f'width {w}')
    s8 = {a: _row(runs[w], a, 8)['median'] for a in args.axes}
    tqdm.write(f'width {w}: {runs[w]["params"]:,} params, {runs[w]["wall_s"]:.0f} s, '
               + ', '.join(f'axis {a} median cos(s=8) {c:.4f}' for a, c in s8.items()))
  total = time.perf_counter() - start
  machine = train_lib.machine_info()
  shown = [s for s in args.group_sizes if s != 1]
  seq_len = next(iter(runs.values()))['seq_len']
  ident = {a: max(r['by_axis'][a]['identity_max_rel_err'] for r in runs.values())
           for a in args.axes}
  md = [f'## AdamPM fidelity over width: median cosine(AdamPM update, Adam update), '
        f'`{args.preset}` MoE LM at d_model = d_ff = d_expert = width, {args.steps} Adam '
        f'steps (lr {args.lr:g}, batch {args.batch_size} x {seq_len})', '',
        f'Command: `{command}`  ',
        f'Machine: {machine["cpu_count"]} CPU cores, jax {machine["jax"]}; wall {total:.0f} s '
        '(' + ', '.join(f'width {w}: {r["wall_s"]:.0f} s' for w, r in runs.items()) + ').  ',
        'Identity check (max relative |u_shadow - u_scale_by_grouped_second_moment|, '
        f's={IDENTITY_S}, over all steps, leaves and widths): '
        + ', '.join(f'axis {a}: {e:.2e}' for a, e in ident.items()) + '.', '',
        '| width | params | axis | ' + ' | '.join(f's={s}' for s in shown)
        + ' | 10th pct (s=8) | steps > 0.993 (s=8) | s=8, last 30% of steps '
        '| worst leaf (s=8, its median) |',
        '|---:|---:|---|' + '---:|' * (len(shown) + 3) + '---|']
  for w, r in runs.items():
    for a in args.axes:
      r8 = _row(r, a, 8)
      md.append(f'| {w} | {r["params"]:,} | {a} ({_axis_name(a).split()[0]}) | '
                + ' | '.join(f'{_row(r, a, s)["median"]:.4f}' for s in shown)
                + f' | {r8["p10"]:.4f} | {100 * r8["frac_above_0.993"]:.0f}% | '
                f'{r8["median_last_30pct"]:.4f} | '
                f'`{r8["worst_leaf"]}` ({r8["worst_leaf_median"]:.3f}) |')
  md += ['', 'Medians over steps of the whole-model cosine (all steps; "last 30%": the '
         'steps from 70% of the run on); s=1 is Adam itself (1.0). '
         f'Published (LLaMA 1.3B on C4, s = 8): above {PUBLISHED} on most steps.']
  md += ['', '### Per leaf: median over steps of the leaf\'s cosine at s=8', '',
         f'Shape at width {max(runs)}; 1-D leaves pool along their only axis on both axes.', '',
         '| leaf | shape | ' + ' | '.join(f'{w}, axis {a}' for w in runs for a in args.axes)
         + ' |', '|---|---|' + '---:|' * (len(runs) * len(args.axes))]
  for path, shape in runs[max(runs)]['shapes'].items():
    md.append(f'| `{path}` | {shape} | ' + ' | '.join(
        f'{_row(r, a, 8)["per_leaf_median"][path]:.4f}' for r in runs.values()
        for a in args.axes) + ' |')
  text = '\n'.join(md)
  print(text)
  (out / 'adampm_fidelity_widths.md').write_text(text + '\n')
  (out / 'adampm_fidelity_widths.json').write_text(json.dumps({
      'command': command, 'args': vars(args), 'machine': machine, 'wall_s': total,
      'runs': [{'width': w, **{k: v for k, v in r.items() if k != 'by_axis'},
                'by_axis': {str(a): v for a, v in r['by_axis'].items()}}
               for w, r in runs.items()]}, indent=1))
  plot_widths(runs, out / 'adampm_fidelity_widths.png', args)


def plot(by_axis: dict[int, dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for j, (axis, res) in enumerate(by_axis.items()):
    whole = res['whole_model_cosine']
    note = '' if list(by_axis) == [-1] else f', axis {axis}'
    for i, s in enumerate(s for s in args.group_sizes if s != 1):
      ax.plot(np.arange(1, len(whole[str(s)]) + 1), whole[str(s)], lw=1, color=f'C{i}',
              ls=('-', ':')[j % 2], label=f's={s}{note}')
  ax.axhline(PUBLISHED, color='k', ls='--', lw=0.8, label='0.993 (published, s=8)')
  ax.set_xlabel('step')
  ax.set_ylabel('cosine(AdamPM update, Adam update)')
  ax.set_title(f'AdamPM vs Adam, whole model, {args.preset} MoE LM')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, ncol=2 if len(by_axis) > 1 else 1)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_widths(runs: dict[int, dict[str, Any]], path: Path, args: argparse.Namespace
                ) -> None:
  """Median cosine at s = 2, 8, 16 (and s = 8 late in the run) against width (log x)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  widths = list(runs)
  fig, ax = plt.subplots(figsize=(9.5, 4.5))
  for j, axis in enumerate(args.axes):
    for s, ls, marker in ((2, ':', 's'), (8, '-', 'o'), (16, '-.', '^')):
      if s not in args.group_sizes:
        continue
      med = [_row(runs[w], axis, s)['median'] for w in widths]
      ax.plot(widths, med, color=f'C{j}', ls=ls, marker=marker, lw=1.8 if s == 8 else 1,
              label=f'axis {axis} ({_axis_name(axis)}), s={s}')
    late = [_row(runs[w], axis, 8)['median_last_30pct'] for w in widths]
    ax.plot(widths, late, color=f'C{j}', ls='--', marker='o', mfc='none', lw=1, alpha=0.7,
            label=f'axis {axis}, s=8, last 30% of steps')
  ax.axhline(PUBLISHED, color='k', ls='--', lw=0.9, label='0.993 (published, s=8, 1.3B)')
  ax.set_xscale('log', base=2)
  ax.set_xticks(widths)
  ax.set_xticklabels([str(w) for w in widths])
  ax.set_xlabel('width (d_model = d_ff = d_expert)')
  ax.set_ylabel('median cosine(AdamPM update, Adam update)')
  ax.set_title(f'AdamPM vs Adam over width, {args.preset} MoE LM, {args.steps} steps')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == '__main__':
  main()
