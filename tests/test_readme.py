"""The README's Python, run as printed: the Quickstart trains, and its advice holds."""

from __future__ import annotations

from pathlib import Path
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import skewadam_jax as sj
import moe_models

README = (Path(__file__).resolve().parents[1] / 'README.md').read_text()
BLOCKS = re.findall(r'```python\n(.*?)```', README, re.S)


def _params_and_loss():
  model = moe_models.NNXMoELM(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  batch = moe_models.copy_task_batch()

  def loss_fn(p, tokens):
    return moe_models.nnx_lm_loss(nnx.merge(graphdef, p), tokens)

  return jax.tree.map(jnp.asarray, nnx.to_pure_dict(params)), loss_fn, batch


def test_commands_and_quickstart_come_first():
  head = README.splitlines()[:40]
  commands = [line for line in head if line.startswith('python3 -m pip install')]
  assert commands == [
      'python3 -m pip install -e ".[examples]" && python3 examples/moe_lm/train.py',
      'python3 -m pip install -e ".[test]" && python3 -m pytest -q']
  assert any(line.startswith('## Quickstart') for line in head)
  assert len(README.encode()) < 12_000


def test_readme_recommends_one_policy():
  recommended = re.findall(r'\*\*Use `sj\.(\w+)`\*\*', README)
  assert recommended == ['MUON_CODED_TIERS']
  assert f'tiers=sj.{recommended[0]}' in BLOCKS[0]


def test_quickstart_runs_as_printed_and_lowers_the_loss():
  params, loss_fn, batch = _params_and_loss()
  namespace = {'params': params}
  grad = jax.jit(jax.grad(loss_fn))
  namespace['grads'] = grad(params, batch)
  exec(BLOCKS[0], namespace)  # noqa: S102 - the README's own code
  tx, state, params = namespace['tx'], namespace['state'], namespace['params']
  step = jax.jit(tx.update)
  first = float(loss_fn(params, batch))
  for _ in range(30):
    updates, state = step(grad(params, batch), state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  assert np.isfinite(first) and float(loss_fn(params, batch)) < first


def test_trace_advice_gives_the_hidden_tier_and_the_traced_tiers():
  params, loss_fn, batch = _params_and_loss()
  advice = re.search(r'`(trace = sj\.trace_structure\([^`]*)`, then\s+`([^`]*)`', README, re.S)
  assert advice, 'the README no longer shows how to use traced labels with its policy'
  namespace = {'sj': sj, 'params': params, 'loss_fn': loss_fn, 'batch': batch, 'lr': 1e-2}
  exec(advice.group(1) + '\ntx = ' + advice.group(2), namespace)  # noqa: S102
  rows = {r.path: r.tier for r in sj.label_table(namespace['tx'], params)}
  assert rows['blocks/1/router/kernel'] == 'router'
  assert rows['blocks/1/experts/w1'] == 'experts'
  assert rows['blocks/0/gate_proj/kernel'] == 'hidden'
  assert rows['embed/embedding'] == 'backbone'

