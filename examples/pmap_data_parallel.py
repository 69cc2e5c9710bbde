"""Data-parallel training of the MoE LM with `jax.pmap` and `lax.pmean` of gradients.

Every device holds a full copy of the params and of the optimizer state, takes its
slice of the global batch, and averages the gradients with `jax.lax.pmean` before the
(identical) optimizer update, so all copies stay equal. The optimizer needs nothing
special: SkewAdam's and AdamPM's updates are per leaf, so they run unchanged inside
`pmap` (or `jax.shard_map`, the modern form).

The losses are means over tokens, so the mean of the per-device means equals the mean
over the concatenated batch, and with `--check` the script verifies that this run
matches single-device training on the whole batch. The router's load-balancing and
z-losses are computed per device here, as in most data-parallel MoE setups; with them
(or with router noise) the per-device losses are not a decomposition of the global one,
so `--check` switches them off.

On a machine without 8 accelerators it simulates 8 CPU devices. From the repo root::

  python examples/pmap_data_parallel.py --steps 20
  python examples/pmap_data_parallel.py --optimizer adampm --check
"""

from __future__ import annotations

import os
import sys

# Must happen before JAX is imported: a CPU-only machine pretends to have 8 devices.
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                             + ' --xla_force_host_platform_device_count=8').strip()

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

from flax import nnx  # noqa: E402
import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from examples import _cli  # noqa: E402
from examples.moe_lm import data as data_lib  # noqa: E402
from examples.moe_lm import model as model_lib  # noqa: E402
import skewadam_jax as sj  # noqa: E402

AXIS = 'batch'
LossFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


def build_parser() -> argparse.ArgumentParser:
  """The command line (hyphenated flags; `--batch_size` etc. are accepted too)."""
  parser = _cli.parser(__doc__.split('\n\n')[0])
  _cli.option(parser, '--optimizer', default='skewadam', choices=('skewadam', 'adampm', 'adamw'),
              help='optimizer')
  _cli.option(parser, '--preset', default='tiny', choices=sorted(model_lib.PRESETS),
              help='model size')
  _cli.option(parser, '--steps', type=int, default=20, help='training steps')
  _cli.option(parser, '--batch-size', type=int, default=16,
              help='global batch, split over the devices')
  _cli.option(parser, '--seq-len', type=int, default=32, help='tokens per sequence')
  _cli.option(parser, '--lr', type=float, default=3e-3, help='learning rate')
  _cli.option(parser, '--weight-decay', type=float, default=0.1, help='decoupled weight decay')
  _cli.option(parser, '--data-dir', default=None, help='text directory; unset: the stdlib')
  _cli.option(parser, '--check', action='store_true',
              help='compare with single-device training on the whole batch')
  _cli.option(parser, '--seed', type=int, default=0, help='weights, batches and router noise')
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The flags (`sys.argv[1:]` when `argv` is None)."""
  return build_parser().parse_args(argv)


def make_optimizer(name: str, lr: float, weight_decay: float) -> optax.GradientTransformation:
  if name == 'skewadam':
    return sj.skewadam(lr, weight_decay=weight_decay)
  if name == 'adampm':
    return sj.adampm(lr, weight_decay=weight_decay)
  return optax.adamw(lr, weight_decay=weight_decay)


def make_loss(graphdef: Any, rest: Any) -> LossFn:
  """`loss(params, batch, key)` of the model split as `(graphdef, params, rest)`."""

  def loss(params, batch, key):
    model = nnx.merge(graphdef, params, rest)
    return model_lib.loss_fn(model, batch, train=True, rngs=key)[0]

  return loss


def make_pmap_step(loss: LossFn, tx: optax.GradientTransformation) -> Callable[..., Any]:
  """The data-parallel step: per-device gradients, `pmean`, identical updates.

  Args:
    loss: `loss(params, batch, key) -> scalar`, a mean over the batch.
    tx: the optimizer.

  Returns:
    `step(params, opt_state, batch, key) -> (params, opt_state, loss)`, pmapped over
    the leading axis of every argument (params and state replicated, batch split,
    keys per device), donating params and state.
  """

  def step(params, opt_state, batch, key):
    value, grads = jax.value_and_grad(loss)(params, batch, key)
    grads = jax.lax.pmean(grads, AXIS)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(value, AXIS)

  return jax.pmap(step, axis_name=AXIS, donate_argnums=(0, 1))


def make_single_step(loss: LossFn, tx: optax.GradientTransformation) -> Callable[..., Any]:
  """The same step on one device, for the whole batch."""

  def step(params, opt_state, batch, key):
    value, grads = jax.value_and_grad(loss)(params, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1))


def replicate(tree: Any, n: int) -> Any:
  """One copy of every leaf per device, stacked on a leading axis (what `pmap` takes).

  Placed with the sharding that `pmap` gives its outputs, so that the step compiles
  once, not again at the second step when it gets its own outputs back.
  """
  sharding = NamedSharding(Mesh(np.array(jax.local_devices()[:n]), (AXIS,)), P(AXIS))
  stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n,) + np.shape(x)), tree)
  return jax.device_put(stacked, sharding)


def split_batch(batch: np.ndarray, n: int) -> np.ndarray:
  """`[B, ...] -> [n, B / n, ...]`: one slice of the global batch per device."""
  if batch.shape[0] % n:
    raise ValueError(f'Global batch {batch.shape[0]} is not divisible by {n} devices.')
  return batch.reshape((n, batch.shape[0] // n) + batch.shape[1:])


def train_pmap(loss: LossFn, tx: optax.GradientTransformation, params: Any,
               batches: list[np.ndarray], key: jax.Array, n_devices: int,
               log: Callable[[int, float], None] | None = None) -> Any:
  """Data-parallel training over `batches`; returns device 0's params as host arrays."""
  params = replicate(params, n_devices)
  opt_state = jax.pmap(tx.init, axis_name=AXIS)(params)  # one replica per device
  step = make_pmap_step(loss, tx)
  for i, batch in enumerate(batches):
    keys = jax.random.split(jax.random.fold_in(key, i), n_devices)
    params, opt_state, value = step(params, opt_state, split_batch(batch, n_devices), keys)
    if log is not None:
      log(i, float(value[0]))
  return jax.tree.map(lambda x: x[0], jax.device_get(params))


def train_single(loss: LossFn, tx: optax.GradientTransformation, params: Any,
                 batches: list[np.ndarray], key: jax.Array) -> Any:
  """The same training on one device with the concatenated batches (host arrays out)."""
  params = jax.device_put(params, jax.devices()[0])  # a copy: the step donates it
  opt_state = jax.device_put(jax.jit(tx.init)(params), jax.devices()[0])
  step = make_single_step(loss, tx)
  for i, batch in enumerate(batches):
    params, opt_state, _ = step(params, opt_state, batch, jax.random.fold_in(key, i))
  return jax.device_get(params)


def max_abs_diff(a: Any, b: Any) -> float:
  """Largest elementwise difference between two trees of arrays (on the host)."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  n = jax.local_device_count()
  print(f'{n} devices ({jax.devices()[0].platform}), global batch {args.batch_size}')
  overrides = {'max_len': max(args.seq_len, 32)}
  if args.check:  # per-token losses only, so that they decompose over devices
    overrides.update(router_noise_std=0.0, aux_loss_coef=0.0, z_loss_coef=0.0,
                     capacity_factor=None)
  cfg = model_lib.get_config(args.preset, **overrides)
  data = data_lib.ByteDataset.load(args.data_dir, seq_len=args.seq_len,
                                   batch_size=args.batch_size, seed=args.seed)
  graphdef, params, rest = nnx.split(model_lib.MoELM(cfg, rngs=nnx.Rngs(args.seed)),
                                     nnx.Param, ...)
  tx = make_optimizer(args.optimizer, args.lr, args.weight_decay)
  loss = make_loss(graphdef, rest)
  batches = [data.train_batch(i) for i in range(args.steps)]
  key = jax.random.key(args.seed)

  t0 = time.perf_counter()

  def log(i: int, value: float) -> None:
    if i == 0 or (i + 1) % 10 == 0 or i + 1 == args.steps:
      print(f'step {i + 1:5d}  loss {value:.4f}  ({time.perf_counter() - t0:.1f} s)')

  trained = train_pmap(loss, tx, params, batches, key, n, log)
  if args.check:
    # Router noise is off, so the keys do not matter: the single-device run uses its own.
    reference = train_single(loss, tx, params, batches, key)
    print(f'max |pmap - single device| over all params: {max_abs_diff(trained, reference):.2e}')


if __name__ == '__main__':
  main()
