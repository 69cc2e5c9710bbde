"""Quickstart: what SkewAdam and AdamPM save, then SkewAdam training a Flax NNX MoE.

1. The optimizer-state memory of AdamW, AdamPM and SkewAdam for the published 6.78B
   MoE, from abstract shapes (`jax.eval_shape`): nothing is allocated.
2. A few hundred steps of a small Flax NNX MoE language model on bytes of the Python
   standard library, trained with `skewadam` through `nnx.Optimizer`, as in the README's
   Quickstart: `tiers=sj.ADAM_EPS_TIERS` at AdamW's learning rate, 3e-4.

Run: python examples/quickstart.py [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import skewadam_jax as sj  # noqa: E402
from examples import _cli  # noqa: E402
from examples.moe_lm import data as data_lib  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402


def memory_table() -> None:
  """Prints state bytes per tier for the published 6.78B configuration."""
  params = model_lib.abstract_params(model_lib.get_config('paper-6.78b'))
  print(f'Published 6.78B MoE: {model_lib.count_params(params):,} parameters (abstract)\n')
  # The published AdamW kept fp32 m and v (8 B per parameter): account it on fp32 copies.
  fp32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
  rows = [
      ('AdamW (fp32 m, v)', sj.memory_report(optax.adamw(3e-4), fp32)),
      ('AdamPM s=8 (fp32 m, nu)', sj.memory_report(sj.adampm(3e-4, group_size=8), fp32)),
      ('SkewAdam (published tiers)', sj.memory_report(sj.skewadam(3e-4), params)),
  ]
  print('| optimizer | backbone | experts | router | total state | GiB |')
  print('|---|---:|---:|---:|---:|---:|')
  for name, report in rows:
    by_tier = {t.tier: t.state_bytes for t in report.tiers}
    print(f'| {name} | {by_tier["backbone"]:,} | {by_tier["experts"]:,} | '
          f'{by_tier["router"]:,} | {report.total_state_bytes:,} | '
          f'{report.total_state_bytes / 2**30:.2f} |')
  print()


def train(steps: int, batch_size: int, lr: float) -> None:
  """Trains the `small` preset with SkewAdam (`sj.ADAM_EPS_TIERS`) and prints the loss."""
  cfg = model_lib.get_config('small')
  data = data_lib.ByteDataset.load(seq_len=cfg.max_len, batch_size=batch_size, seed=0)
  print(data.summary())
  model = model_lib.MoELM(cfg, rngs=nnx.Rngs(0))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps)
  # Adam's additive eps on every tier, so that AdamW's learning rate works; the default
  # (published) tiers need about 3x it (README, Quickstart).
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   sj.skewadam(schedule, weight_decay=0.1, tiers=sj.ADAM_EPS_TIERS))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  state = nnx.state(model, nnx.Param)
  print(sj.label_table(tx, state).format().splitlines()[-1])

  @nnx.jit
  def train_step(model, optimizer, batch, key):
    grad_fn = nnx.value_and_grad(model_lib.loss_fn, has_aux=True)
    (loss, _), grads = grad_fn(model, batch, True, key)
    optimizer.update(model, grads)
    return loss

  key = jax.random.key(0)
  start = time.perf_counter()
  for step in range(steps):
    key, sub = jax.random.split(key)
    loss = train_step(model, optimizer, jnp.asarray(data.train_batch(step)), sub)
    if step % max(steps // 10, 1) == 0 or step == steps - 1:
      print(f'step {step:4d}  loss {float(loss):.3f}  '
            f'({time.perf_counter() - start:.1f} s)')
  val = [float(model_lib.loss_fn(model, jnp.asarray(b), False)[1]['ce'])
         for b in data.val_batches(4)]
  print(f'validation cross-entropy {sum(val) / len(val):.3f} nats/byte '
        f'(uniform over 256 bytes: {jnp.log(256.0):.3f})')


def build_parser() -> argparse.ArgumentParser:
  """The command line (`--batch_size` is accepted for `--batch-size`)."""
  parser = _cli.parser(__doc__.splitlines()[0])
  _cli.option(parser, '--steps', type=int, default=200, help='training steps')
  _cli.option(parser, '--batch-size', type=int, default=16, help='sequences per step')
  _cli.option(parser, '--lr', type=float, default=3e-4,
              help="peak learning rate (AdamW's, as in the README's Quickstart)")
  return parser


def main(argv: list[str] | None = None) -> None:
  """Prints the memory table, then trains (`argv`: the flags, default `sys.argv`)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error(f'--steps must be >= 1, not {args.steps}')
  memory_table()
  train(args.steps, args.batch_size, args.lr)


if __name__ == '__main__':
  main()
