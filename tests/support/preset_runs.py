"""Updates of every exported optimizer preset on the MoE trees of `trees`, saved as .npz.

Run as a script (`python tests/support/preset_runs.py OUT.npz`) with the package to test first
on PYTHONPATH: `test_extension.test_presets_update_bitwise_as_the_reference` runs it
with the reference commit's package and with this one's and compares every array.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import skewadam_jax as sj
import trees

STEPS = 3


def optimizers() -> dict:
  """name -> optax optimizer: each exported preset, AdamPM and an AdamW-like tier."""
  out = {}
  for name in ('PUBLISHED_TIERS', 'ADAM_EPS_TIERS', 'ADAM_ROUTER_TIERS', 'MUON_TIERS',
               'MUON_CODED_TIERS'):
    out[name] = sj.skewadam(1e-2, weight_decay=0.1, tiers=getattr(sj, name))
  grouped = sj.Tier(second_moment='grouped', group_size=4, clip_threshold=None)
  out['grouped_tiers'] = sj.skewadam(1e-2, tiers={'backbone': grouped, 'experts': grouped,
                                                  'router': grouped})
  out['adampm'] = sj.adampm(1e-2, weight_decay=0.1, group_size=4)
  adamw_like = sj.Tier(second_moment='exact', clip_threshold=None, eps_mode='adam')
  out['adamw_like'] = optax.chain(sj.scale_by_tiered_adam(tier=adamw_like),
                                  optax.add_decayed_weights(0.1), optax.scale(-1e-2))
  return out


def tree_cases() -> dict:
  """name -> (leaves as in `trees.MOE_LEAVES`, dtype)."""
  scanned = {f'layers/{k}': ((3,) + shape, s) for k, (shape, s) in trees.MOE_LEAVES.items()
             if len(shape) >= 1}
  return {'moe_f32': (trees.MOE_LEAVES, jnp.float32),
          'moe_bf16': (trees.MOE_LEAVES, jnp.bfloat16),
          'scanned_f32': (scanned, jnp.float32)}


def reports(tx, params) -> dict:
  """What the reports say of `tx` on `params`, as text: the label table (for the
  optimizers with tiers), the memory report, the state's shardings on a 'data' axis and
  the checkpoint description."""
  from jax.sharding import PartitionSpec as P
  out = {'memory': sj.memory_report(tx, params).format()}
  try:
    out['labels'] = sj.label_table(tx, params).format()
  except ValueError as e:  # no skewadam in `tx`
    out['labels'] = str(e)
  specs = jax.tree.map(lambda p: P(*(('data',) + (None,) * (p.ndim - 1))[:p.ndim]), params)
  out['shardings'] = str(sj.state_shardings(tx, params, specs))
  out['description'] = str(sj.describe_state(tx, params))
  return out


def run(out_path: str) -> None:
  arrays = {}
  for tname, (leaves, dtype) in tree_cases().items():
    params0 = trees.init_params(0, leaves)
    grads_fn = trees.make_grads_fn(1, leaves)
    for oname, tx in optimizers().items():
      abstract = trees.nest({k: jax.ShapeDtypeStruct(v.shape, dtype)
                             for k, v in params0.items()})
      for k, v in reports(tx, abstract).items():
        arrays[f'{tname}|{oname}|report|{k}'] = np.asarray(v)
      params, state = trees.run_optax(tx, params0, grads_fn, STEPS, dtype=dtype)
      for k, v in params.items():
        arrays[f'{tname}|{oname}|param|{k}'] = v
      for i, leaf in enumerate(jax.tree.leaves(state)):
        arrays[f'{tname}|{oname}|state|{i}'] = np.asarray(
            leaf.astype(jnp.float32) if leaf.dtype == jnp.bfloat16 else leaf)
  np.savez(out_path, **arrays)


if __name__ == '__main__':
  run(sys.argv[1])
