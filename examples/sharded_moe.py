"""Trains the MoE LM on a (data, expert) device mesh with `jax.jit` and `NamedSharding`.

Expert stacks `[E, in, out]` are sharded `P('expert', None, 'data')` (each device holds
`E / n_expert` experts, their hidden width split over `data`), the batch is sharded
over `data`, the rest of the model is replicated. The optimizer state is placed with
`skewadam_jax.state_shardings`, which derives every state leaf's sharding from its
parameter's (the factored row/column statistics drop the reduced axis), so nothing is
gathered, and the step donates params and state.

On a machine without 8 accelerators it simulates 8 CPU devices (set below, before JAX
is imported). Run from the repository root::

  python examples/sharded_moe.py                       # skewadam, 2 x 4 mesh
  python examples/sharded_moe.py --optimizer adampm --steps 50 --preset small
  python examples/sharded_moe.py --ckpt-dir /tmp/moe_ckpt --save-at 10
  python examples/sharded_moe.py --ckpt-dir /tmp/moe_ckpt --resume 10 --mesh 4,2
  python examples/sharded_moe.py --ckpt-dir /tmp/moe_run --ckpt-every 5 --steps 40

With `--ckpt-dir` and no `--resume`, a run resumes from the newest intact checkpoint in
the directory (a damaged or incomplete newest step is skipped and moved aside), so the
last command, rerun after a crash, ends bitwise where an uninterrupted run ends: the
batches and the router noise are functions of `(seed, step)`.

(Underscore spellings such as `--ckpt_dir` and `--save_at` work too.)

It prints the loss, then the optimizer-state bytes held by each device next to what
AdamW would hold under the same shardings (computed abstractly, nothing allocated).
"""

from __future__ import annotations

import os
import sys

# Must happen before JAX is imported: a CPU-only machine pretends to have 8 devices.
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                             + ' --xla_force_host_platform_device_count=8').strip()

import argparse  # noqa: E402
import collections  # noqa: E402
from pathlib import Path  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

from flax import nnx  # noqa: E402
import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from examples import _cli  # noqa: E402
from examples import checkpointing  # noqa: E402
from examples.moe_lm import data as data_lib  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402
import skewadam_jax as sj  # noqa: E402

EXPERT_SPEC = P('expert', None, 'data')
BATCH_SPEC = P('data')


# ----------------------------------------------------------------------------- config


def build_parser() -> argparse.ArgumentParser:
  """The command line (hyphenated flags; `--batch_size` etc. are accepted too)."""
  parser = _cli.parser(__doc__.split('\n\n')[0])
  _cli.option(parser, '--optimizer', default='skewadam', choices=('skewadam', 'adampm', 'adamw'),
              help='optimizer')
  _cli.option(parser, '--preset', default='tiny', choices=sorted(model_lib.PRESETS),
              help='model size')
  _cli.option(parser, '--mesh', default='2,4', help='data,expert mesh shape')
  _cli.option(parser, '--steps', type=int, default=20,
              help='train up to this step (also after --resume)')
  _cli.option(parser, '--batch-size', type=int, default=8, help='global batch (sequences)')
  _cli.option(parser, '--seq-len', type=int, default=32, help='tokens per sequence')
  _cli.option(parser, '--lr', type=float, default=3e-3, help='learning rate')
  _cli.option(parser, '--weight-decay', type=float, default=0.1, help='decoupled weight decay')
  _cli.option(parser, '--group-size', type=int, default=8, help='AdamPM group size')
  _cli.option(parser, '--data-dir', default=None, help='text directory; unset: the stdlib')
  _cli.option(parser, '--ckpt-dir', default=None,
              help='checkpoint directory (one subdirectory per step); a run resumes from '
                   'its newest intact step unless --resume names one')
  _cli.option(parser, '--save-at', type=int, default=None, help='save after this step')
  checkpointing.add_resume_options(parser, every=None, keep=3)
  _cli.option(parser, '--resume', type=int, default=None,
              help='restore this step from --ckpt-dir, then train to --steps')
  _cli.option(parser, '--seed', type=int, default=0, help='weights, batches and router noise')
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The flags, checked together (exits with a usage error, as argparse does)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  for flag, value in (('--resume', args.resume), ('--save-at', args.save_at),
                      ('--ckpt-every', args.ckpt_every)):
    if value is not None and args.ckpt_dir is None:
      parser.error(f'{flag} needs --ckpt-dir, the directory of the checkpoints')
  for flag, value in (('--ckpt-every', args.ckpt_every), ('--ckpt-keep', args.ckpt_keep)):
    if value is not None and value < 1:
      parser.error(f'{flag} must be >= 1, not {value}')
  start = args.resume or 0
  if not 0 <= start <= args.steps:
    parser.error(f'--resume {start} is outside 0..--steps ({args.steps})')
  if args.save_at is not None and not start < args.save_at <= args.steps:
    parser.error(f'--save-at {args.save_at} is never reached: this run trains steps '
                 f'{start + 1}..{args.steps}')
  return args


def make_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
  """A (data, expert) mesh with Auto axes: XLA propagates shardings through the model.

  (With Explicit axes, `jax.make_mesh`'s default, every op of the model would need its
  output sharding spelled out; the optimizer alone works either way.)
  """
  return jax.make_mesh(shape, ('data', 'expert'), axis_types=(AxisType.Auto,) * 2)


def make_optimizer(name: str, lr: float, weight_decay: float, group_size: int
                   ) -> optax.GradientTransformation:
  if name == 'skewadam':
    return sj.skewadam(lr, weight_decay=weight_decay)
  if name == 'adampm':
    return sj.adampm(lr, weight_decay=weight_decay, group_size=group_size)
  return optax.adamw(lr, weight_decay=weight_decay)


def param_specs(params: Any) -> Any:
  """`P('expert', None, 'data')` for stacked expert weights, replicated otherwise."""
  labels = sj.moe_param_labels(params)
  return jax.tree.map(lambda p, label: EXPERT_SPEC if label == 'experts' and p.ndim == 3
                      else P(), params, labels)


# ----------------------------------------------------------------------------- step


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, param_sh: Any,
                    state_sh: Any, rest_sh: Any, batch_sh: Any) -> Callable[..., Any]:
  """The jitted, donating step `(params, opt_state, rest, batch, key) -> (..., loss)`."""
  replicated = NamedSharding(batch_sh.mesh, P())

  def loss(params, rest, batch, key):
    model = nnx.merge(graphdef, params, rest)
    return model_lib.loss_fn(model, batch, train=True, rngs=key)

  def step(params, opt_state, rest, batch, key):
    (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(
      step, in_shardings=(param_sh, state_sh, rest_sh, batch_sh, replicated),
      out_shardings=(param_sh, state_sh, replicated), donate_argnums=(0, 1))


# ----------------------------------------------------------------------------- report


def device_bytes(tree: Any) -> dict[Any, int]:
  """Bytes of `tree`'s arrays held by each device (its addressable shards)."""
  out: dict[Any, int] = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] += shard.data.nbytes
  return out


def abstract_device_bytes(abstract: Any, shardings: Any) -> dict[Any, int]:
  """Bytes per device of an abstract tree placed with `shardings` (nothing allocated)."""
  out: dict[Any, int] = collections.Counter()
  for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    shard_bytes = int(np.prod(s.shard_shape(a.shape), dtype=np.int64)) * a.dtype.itemsize
    for device in s.device_set:
      out[device] += shard_bytes
  return out


def report_state_bytes(name: str, opt_state: Any, abstract_params: Any, param_sh: Any,
                       args: argparse.Namespace) -> None:
  """Prints per-device state bytes of the run's optimizer against AdamW's."""
  adamw = optax.adamw(args.lr, weight_decay=args.weight_decay)
  adamw_bytes = abstract_device_bytes(jax.eval_shape(adamw.init, abstract_params),
                                      sj.state_shardings(adamw, abstract_params, param_sh))
  ours = device_bytes(opt_state)
  print(f'\n| device | {name} state (B) | AdamW state (B) | ratio |')
  print('|---|---:|---:|---:|')
  for device in sorted(adamw_bytes, key=lambda d: d.id):
    print(f'| {device.id} | {ours[device]:,} | {adamw_bytes[device]:,} | '
          f'{ours[device] / adamw_bytes[device]:.3f} |')
  total, total_adamw = sum(ours.values()), sum(adamw_bytes.values())
  print(f'| all | {total:,} | {total_adamw:,} | {total / total_adamw:.3f} |')


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  shape = tuple(int(x) for x in args.mesh.split(','))
  mesh = make_mesh(shape)
  print(f'{len(jax.devices())} devices ({jax.devices()[0].platform}), mesh {dict(mesh.shape)}')

  cfg = model_lib.get_config(args.preset, max_len=max(args.seq_len, 32))
  data = data_lib.ByteDataset.load(args.data_dir, seq_len=args.seq_len,
                                   batch_size=args.batch_size, seed=args.seed)
  model = model_lib.MoELM(cfg, rngs=nnx.Rngs(args.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = make_optimizer(args.optimizer, args.lr, args.weight_decay, args.group_size)

  # Shardings: params from the rule above, state derived from them, batch on `data`.
  abstract_params = jax.eval_shape(lambda: params)
  param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params))
  state_sh = sj.state_shardings(tx, abstract_params, param_sh)
  rest_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), rest)
  batch_sh = NamedSharding(mesh, BATCH_SPEC)

  params = jax.device_put(params, param_sh)
  rest = jax.device_put(rest, rest_sh)
  opt_state = jax.jit(tx.init, out_shardings=state_sh)(params)
  start, ckpt = 0, None
  if args.ckpt_dir is not None:
    ckpt = checkpointing.TrainCheckpointer(
        args.ckpt_dir, every=args.ckpt_every or args.steps + 1, keep=args.ckpt_keep,
        use_async=not args.sync_ckpt, show_fingerprints=args.ckpt_fingerprints,
        log=lambda line: print(line, flush=True),
        description=sj.describe_state(tx, abstract_params))
    target = checkpointing.abstract_target(tx, abstract_params, param_sh)
    restored = ckpt.restore(target, step=args.resume)
    if restored is not None:
      start, state, _ = restored
      params, opt_state = state['params'], state['opt_state']  # it printed the step

  step = make_train_step(graphdef, tx, param_sh, state_sh, rest_sh, batch_sh)
  key = jax.random.key(args.seed)
  t0 = time.perf_counter()
  for i in range(start, args.steps):
    batch = jax.device_put(data.train_batch(i), batch_sh)
    params, opt_state, loss = step(params, opt_state, rest, batch, jax.random.fold_in(key, i))
    if i == start or (i + 1) % 10 == 0 or i + 1 == args.steps:
      print(f'step {i + 1:5d}  loss {float(loss):.4f}  ({time.perf_counter() - t0:.1f} s)')
    if ckpt is not None and (i + 1 == args.save_at or args.ckpt_every is not None and (
        (i + 1) % args.ckpt_every == 0 or i + 1 == args.steps)):
      ckpt.save(i + 1, {'params': params, 'opt_state': opt_state}, force=True)
  if ckpt is not None:
    ckpt.close()  # the last save complete, manifest included

  print('\nstate of the expert stacks (path, shape, sharding):')
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    if 'experts' in jax.tree_util.keystr(path) and leaf.ndim >= 2:
      print(f'  {jax.tree_util.keystr(path)[-48:]:48s} {leaf.shape} {leaf.sharding.spec}')
  report_state_bytes(args.optimizer, opt_state, abstract_params, param_sh, args)


if __name__ == '__main__':
  main()
