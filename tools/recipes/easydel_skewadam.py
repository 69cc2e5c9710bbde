"""SkewAdam on an EasyDeL Mixtral (tiny config, CPU): labels, state bytes, a few steps.

Run with the EasyDeL venv:  $VENVS/easydel/bin/python tools/recipes/easydel_skewadam.py
"""
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import types

import easydel as ed
import jax
import jax.numpy as jnp
import optax
import skewadam_jax as sj
from easydel.modules.mixtral import MixtralConfig, MixtralForCausalLM
from easydel.trainers.trainer_protocol import TrainerConfigureModelOutput
from flax import nnx

# The tiny config that tools/real_trees/record.py records (ED_COMMON + its mixtral entry).
cfg = MixtralConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                    intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)
model = MixtralForCausalLM(config=cfg, dtype=jnp.float32, param_dtype=jnp.float32,
                           precision=None, rngs=nnx.Rngs(0))

tx = optax.chain(optax.clip_by_global_norm(1.0), sj.skewadam(3e-3, weight_decay=0.1))

# EasyDeLState.create(..., init_opt_state=True) calls tx.init(graphstate), where
# graphstate = nnx.split(model, nnx.Param, ...)[1]: that is the tree SkewAdam labels.
state = ed.EasyDeLState.create(model=model, tx=tx, init_opt_state=True)
params = state.graphstate

print(sj.label_table(tx, params).format())
print()
print(sj.memory_report(tx, params).format('SkewAdam'))
print()
print(sj.memory_report(optax.adamw(3e-3, weight_decay=0.1), params).format('AdamW'))
print()

# A few jitted steps on random tokens (next-token loss), through EasyDeLState.apply_gradients.
tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.vocab_size)
inputs, targets = tokens[:, :-1], tokens[:, 1:]


def loss_fn(graphstate, graphdef, graphother):
  m = nnx.merge(graphdef, graphstate, graphother)
  logits = m(input_ids=inputs).logits
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@jax.jit
def train_step(state):
  loss, grads = jax.value_and_grad(loss_fn)(state.graphstate, state.graphdef, state.graphother)
  return state.apply_gradients(grads=grads), loss


with model.mesh:
  for step in range(8):
    state, loss = train_step(state)
    print(f'step {step}  loss {float(loss):.4f}')


# The trainer hook: BaseTrainer.configure_model() builds `tx` with
# self.arguments.get_optimizer_and_scheduler(...) (eformer's OptimizerFactory) and returns a
# TrainerConfigureModelOutput; _configure_state() then calls model_state.init_tx(self.tx).
# Overriding configure_model is the least invasive way to hand the trainer SkewAdam.
class SkewAdamTrainer(ed.Trainer):

  def configure_model(self):
    steps = self.max_training_steps
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, max(1, steps // 20), steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0), sj.skewadam(schedule, weight_decay=0.1))
    return TrainerConfigureModelOutput(model=self.model, tx=tx, scheduler=schedule,
                                       config=self.model.config)


# Only the override itself is exercised here (no dataset, no trainer.train()):
out = SkewAdamTrainer.configure_model(types.SimpleNamespace(model=model, max_training_steps=1000))
opt_state = jax.eval_shape(out.tx.init, params)
print('\nSkewAdamTrainer.configure_model ->', type(out).__name__,
      '| its tx.init state bytes:', sj.state_bytes(opt_state))
