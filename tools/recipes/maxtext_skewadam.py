"""SkewAdam in MaxText through its optimizer factory (tiny scanned Mixtral, CPU).

Run with the MaxText venv:
  $VENVS/maxtext/bin/python tools/recipes/maxtext_skewadam.py          # labels, bytes, steps
  $VENVS/maxtext/bin/python tools/recipes/maxtext_skewadam.py --train  # its train.main,
                                                                            # 10 steps

MaxText builds its optimizer in maxtext.optimizers.optimizers.get_optimizer(config,
learning_rate_schedule, model=None, mesh=None), dispatching on config.opt_type (a validated
enum: adamw / adam_pax / sgd / muon). Its trainers reach it as `optimizers.get_optimizer(...)`
(utils/train_utils.py: create_training_optimizer, called by setup_train_loop, which then
builds nnx.Optimizer(model, tx, wrt=nnx.Param)). Rebinding that module attribute before the
trainer runs is the least invasive hook: no MaxText file is edited, every other config key
(learning-rate schedule, adam_b1/adam_b2/adam_eps/adam_weight_decay) keeps working.
"""
import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import jax
import jax.numpy as jnp
import optax
import skewadam_jax as sj
from flax import nnx
from maxtext.optimizers import optimizers

_maxtext_get_optimizer = optimizers.get_optimizer


def skewadam_get_optimizer(config, learning_rate_schedule, model=None, mesh=None):
  """Drop-in for optimizers.get_optimizer: SkewAdam with MaxText's adam_* hyperparameters."""
  return sj.skewadam(learning_rate_schedule, b1=config.adam_b1, b2=config.adam_b2,
                     eps=config.adam_eps, weight_decay=config.adam_weight_decay)


optimizers.get_optimizer = skewadam_get_optimizer  # the hook

# Tiny scanned Mixtral: the `mixtral_scan` entry of tools/real_trees/record.py.
TINY = ['model_name=mixtral-8x7b', 'scan_layers=True', 'attention=dot_product',
        'skip_jax_distributed_system=True', 'override_model_config=True',
        'base_emb_dim=32', 'base_num_query_heads=4', 'base_num_kv_heads=2', 'head_dim=8',
        'base_mlp_dim=40', 'base_moe_mlp_dim=40', 'vocab_size=128', 'num_experts=4',
        'num_experts_per_tok=2', 'max_target_length=16', 'per_device_batch_size=1',
        'base_num_decoder_layers=3',
        # MaxText's schedule warms up over warmup_steps_fraction * steps from 0: keep it short.
        'steps=10', 'learning_rate=3e-3', 'warmup_steps_fraction=0.1']


def main():
  from maxtext.configs import pyconfig
  from maxtext.utils import maxtext_utils, model_creation_utils, train_utils
  from maxtext.utils.globals import MAXTEXT_PKG_DIR

  config = pyconfig.initialize(
      [None, os.path.join(MAXTEXT_PKG_DIR, 'configs', 'base.yml')] + TINY)
  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
  create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)

  # What setup_train_loop calls: now returns SkewAdam.
  schedule, tx = train_utils.create_training_optimizer(config, abstract_model, mesh=mesh)
  abstract_params = nnx.state(abstract_model, nnx.Param)  # what nnx.Optimizer hands tx.init

  print(sj.label_table(tx, abstract_params).format())
  print()
  print(sj.memory_report(tx, abstract_params).format('SkewAdam'))
  print()
  adamw = _maxtext_get_optimizer(config, schedule, abstract_model, mesh=mesh)  # opt_type=adamw
  print(sj.memory_report(adamw, abstract_params).format("AdamW (MaxText's own, opt_type=adamw)"))
  print()

  # A concrete model and a few jitted steps on random tokens.
  with mesh, nn_partitioning_rules(config):
    model = create_model()
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, config.vocab_size)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = jnp.broadcast_to(jnp.arange(16), inputs.shape)
  segments = jnp.ones_like(inputs)

  def loss_fn(model):
    logits = model(inputs, positions, segments, enable_dropout=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @nnx.jit
  def train_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  with mesh, nn_partitioning_rules(config):
    for step in range(5):
      print(f'step {step}  loss {float(train_step(model, optimizer)):.4f}')


def nn_partitioning_rules(config):
  from flax.linen import partitioning
  return partitioning.axis_rules(config.logical_axis_rules)


if __name__ == '__main__':
  if '--train' in sys.argv:
    # MaxText's own trainer, with the hook installed above (synthetic data).
    from maxtext.trainers.pre_train import train
    from maxtext.utils.globals import MAXTEXT_PKG_DIR
    # Outputs under the repository's runs/ (ignored by git).
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'runs',
                       'maxtext_skewadam')
    train.main([None, os.path.join(MAXTEXT_PKG_DIR, 'configs', 'base.yml')] + TINY + [
        'dataset_type=synthetic', 'enable_checkpointing=False',
        f'base_output_directory={os.path.normpath(out)}', 'run_name=skewadam'])
    raise SystemExit(0)
  main()
