"""Drop-in for `optax.adamw`: what a user swaps in behaves as AdamW does at the API.

The calling conventions (which argument is wrong when `update`'s are swapped), the
dtype of the updates and the parameter trees accepted are AdamW's, checked against
`optax.adamw` itself on the same inputs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import skewadam_jax as sj

PARAMS = {'embed': jnp.ones((6, 4)),
          'moe': {'router': jnp.ones((4, 3)), 'experts': {'w1': jnp.ones((3, 4, 5))}}}

# Every public transform a user calls `update` on.
TRANSFORMS = {
    'skewadam': lambda: sj.skewadam(1e-3),
    'adampm': lambda: sj.adampm(1e-3),
    'scale_by_tiers': lambda: sj.scale_by_tiers(None, None),
    'scale_by_tiered_adam': sj.scale_by_tiered_adam,
    'scale_by_grouped_second_moment': sj.scale_by_grouped_second_moment,
}


# ---------------------------------------------------------------------------------------
# `update`'s arguments in the wrong order.


@pytest.mark.parametrize('jit', [False, True])
@pytest.mark.parametrize('name', tuple(TRANSFORMS))
def test_swapped_state_and_params_name_both_and_the_right_order(name, jit):
  tx = TRANSFORMS[name]()
  state = tx.init(PARAMS)
  update = jax.jit(tx.update) if jit else tx.update
  right = re.escape('The order is `tx.update(updates, state, params)`')
  with pytest.raises(TypeError, match=rf'sj.{name}: .*`state` and `params` are swapped.*'
                                      + right):
    update(PARAMS, PARAMS, state)
  with pytest.raises(TypeError, match=r'`state` is missing.*' + right):
    update(PARAMS, PARAMS)  # the params given as the state
  updates, _ = update(PARAMS, state, PARAMS)  # the right order still runs
  assert jax.tree.structure(updates) == jax.tree.structure(PARAMS)
