"""Small leaves of one shape updated by one stacked, vmapped estimator call.

`SecondMoment.stacks` (transforms/stacking.py): where the step is lowered for a GPU (or
any platform but the CPU), the tier stacks the arrays of small leaves with equal shapes,
dtypes and options and runs one vmapped update per group; on the CPU each leaf runs
alone. The CPU's results are therefore bitwise those of the leaf-by-leaf update, and
the stacked path (forced here on the CPU) is within a few ulp of it: the same
operations per item, a reduction's terms perhaps added in another order. The state
keeps one entry per leaf; a user's estimator gets it by declaring it.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj
from skewadam_jax.transforms import stacking as _stacking
from ulp import assert_within_ulp

FUZZ = settings(max_examples=4, deadline=None, derandomize=True, database=None)


def _is_shape(x) -> bool:
  return isinstance(x, tuple)


def _tree(shapes: dict, seed: int, dtype) -> dict:
  """Arrays of `shapes` (a nested dict of shape tuples), at gradient scales from 1e-6 to
  1 so that the eps floor and the clip both engage."""
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
  rng = np.random.default_rng(seed)
  scales = (1e-6, 1e-3, 1.0)
  return treedef.unflatten([jnp.asarray(scales[i % 3] * rng.standard_normal(s), dtype)
                            for i, s in enumerate(leaves)])


def _run(tx, shapes: dict, dtype, steps: int = 3) -> tuple:
  params = _tree(shapes, 0, dtype)
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for i in range(steps):
    params, state = step(params, state, _tree(shapes, i + 1, dtype))
  return params, state


def _count(jaxpr, name: str) -> int:
  """Calls of the jitted function `name` in `jaxpr` and its sub-jaxprs (cond branches)."""
  total = 0
  for e in jaxpr.eqns:
    total += e.params.get('name') == name
    for v in e.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns') and e.params.get('name') != name:
          total += _count(inner, name)
  return total


def _stacked_calls(tx, shapes: dict) -> int:
  params = jax.tree.map(jnp.zeros, shapes, is_leaf=_is_shape)
  jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, tx.init(params))
  return _count(jaxpr.jaxpr, '_stacked_update')


def _forced(patch) -> None:
  """The stacked path on the CPU too."""
  patch.setattr(_stacking, 'by_platform', lambda *a, cpu, default: default(*a))


def _compare(got, want, within_ulp: bool = False):
  """Bitwise equal, or `within_ulp` (tests/support/ulp.py's bounds: 8 float32 ulp, 2 bfloat16)."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    if within_ulp:
      assert_within_ulp(a, b, a.dtype)
    else:
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


TIERS = {
    'published': sj.PUBLISHED_TIERS,
    'adam eps': sj.ADAM_EPS_TIERS,
    'grouped': {'backbone': sj.Tier(second_moment='grouped', group_size=4),
                'experts': sj.Tier(second_moment='grouped', group_size=4, momentum=False),
                'router': sj.Tier(second_moment='exact', mu_dtype=jnp.bfloat16)},
}


def _model(rows: int, cols: int, copies: int, experts: int) -> dict:
  return {'blocks': {str(i): {
      'attn': {'q_proj': {'kernel': (rows, cols)}}, 'ln': {'scale': (cols,)},
      'moe': {'experts': {'w1': (experts, rows, cols)},
              'router': {'kernel': (cols, experts)}}} for i in range(copies)}}


@pytest.mark.parametrize('tiers', list(TIERS))
def test_stacked_updates_equal_leaf_by_leaf(tiers):
  # Groups of equal matrices, vectors, expert banks and router kernels in each tier,
  # three steps. On the CPU: bitwise the leaf-by-leaf results. Stacked (forced):
  # within a few ulp of them (a reduction's terms in another order: tests/support/ulp.py's
  # bounds, those between two CPUs).
  shapes = _model(9, 7, 3, 2)
  tx = sj.skewadam(1e-2, weight_decay=0.1, tiers=TIERS[tiers])
  assert _stacked_calls(tx, shapes) >= 3
  cpu = _run(tx, shapes, jnp.float32)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_stacking, 'MAX_STACKED_SIZE', 0)  # every leaf alone
    assert _stacked_calls(tx, shapes) == 0
    alone = _run(tx, shapes, jnp.float32)
  _compare(cpu, alone)
  with pytest.MonkeyPatch.context() as patch:
    _forced(patch)
    _compare(_run(tx, shapes, jnp.float32), alone, within_ulp=True)


@pytest.mark.slow
@pytest.mark.parametrize('tiers', list(TIERS))
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@FUZZ
@given(rows=st.integers(1, 81), cols=st.integers(1, 81), copies=st.integers(2, 3),
       experts=st.integers(1, 3))
def test_stacked_updates_are_within_a_few_ulp_of_leaf_by_leaf(tiers, dtype, rows, cols,
                                                               copies, experts):
  shapes = _model(rows, cols, copies, experts)
  tx = sj.skewadam(1e-2, weight_decay=0.1, tiers=TIERS[tiers])
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_stacking, 'MAX_STACKED_SIZE', 0)
    alone = _run(tx, shapes, dtype)
  with pytest.MonkeyPatch.context() as patch:
    _forced(patch)
    _compare(_run(tx, shapes, dtype), alone, within_ulp=True)


def test_only_small_leaves_of_one_shape_and_tier_stack():
  # Three equal matrices stack (one call), two vectors too; a matrix of a third shape
  # and two above the size budget update alone.
  big = int(np.sqrt(_stacking.MAX_STACKED_SIZE)) + 1
  shapes = {'a': (6, 5), 'b': (6, 5), 'c': (6, 5), 'd': (5,), 'e': (5,), 'f': (3, 4),
            'g': (big, big), 'h': (big, big)}
  assert _stacked_calls(sj.scale_by_tiered_adam(), shapes) == 2
  labels = {k: 'backbone' if k in ('a', 'b') else 'experts' for k in shapes}
  tx = sj.scale_by_tiers(sj.PUBLISHED_TIERS, labels)
  assert _stacked_calls(tx, shapes) == 2  # {a, b} and {d, e}; c's tier differs


@dataclasses.dataclass(frozen=True)
class _Rms(sj.SecondMoment):
  """One statistic per matrix: v <- b2 v + (1 - b2) mean(g^2)."""
  name = 'rms'
  per_shape = True

  def init(self, param, path):
    return {'v': jnp.zeros((), jnp.float32)}

  def update(self, g, stats, x, step):
    v = step.b2 * stats['v'] + (1.0 - step.b2) * jnp.mean(jnp.square(g.astype(jnp.float32)))
    return x.astype(jnp.float32) * step.num_scale / jnp.sqrt(jnp.maximum(v, step.eps)), {
        'v': v}


class _StackedRms(_Rms):
  stacks = True


def test_a_user_estimator_stacks_by_declaring_it():
  # By the protocol, not the type: the same estimator stacks once it declares `stacks`,
  # with the leaf-by-leaf results and one state entry per leaf.
  shapes = {'a': (4, 6), 'b': (4, 6), 'c': (4, 6)}
  got = {}
  for name, est in (('alone', _Rms()), ('stacked', _StackedRms())):
    tx = sj.scale_by_tiered_adam(tier=sj.Tier(second_moment=est))
    with pytest.MonkeyPatch.context() as patch:
      _forced(patch)
      got[name] = (_stacked_calls(tx, shapes), _run(tx, shapes, jnp.float32))
  assert got['alone'][0] == 0 and got['stacked'][0] == 1
  _compare(got['stacked'][1], got['alone'][1], within_ulp=True)
  assert set(got['stacked'][1][1].v) == set(shapes)


class _BrokenStats(_StackedRms):
  def update(self, g, stats, x, step):
    u, _ = super().update(g, stats, x, step)
    return u, {'v': jnp.zeros((2,), jnp.float32)}


def test_a_stacking_estimator_that_breaks_its_state_is_named_per_leaf():
  params = {'a': jnp.zeros((4, 6)), 'b': jnp.zeros((4, 6))}
  tx = sj.scale_by_tiered_adam(tier=sj.Tier(second_moment=_BrokenStats()))
  with pytest.raises(ValueError, match=r'\ba\b'):
    tx.update(params, tx.init(params))


@pytest.mark.parametrize('spell', [np.float32, np.asarray, jnp.asarray],
                         ids=['numpy scalar', 'numpy array', 'jax array'])
def test_hyperparameters_given_as_arrays_step_equal_leaves_as_leaf_by_leaf(spell):
  # A hyperparameter given as an array (a NumPy array is concrete but unhashable, so it
  # cannot key a group) updates: on the CPU bitwise as the leaf-by-leaf update.
  shapes = _model(9, 7, 3, 2)
  tx = sj.skewadam(1e-2, b1=spell(0.9), b2=spell(0.999), eps=spell(1e-30))
  got = _run(tx, shapes, jnp.float32)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_stacking, 'MAX_STACKED_SIZE', 0)  # every leaf alone
    alone = _run(tx, shapes, jnp.float32)
  _compare(got, alone)
