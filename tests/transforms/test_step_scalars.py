"""The step count's functions of every tier (`transforms.step_scalars`): their values
against float64 formulas, and one kernel for all of them."""

import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax as sj
from skewadam_jax.transforms import step_scalars


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    b1s=st.lists(st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99]), min_size=1, max_size=3),
    b2=st.sampled_from([0.9, 0.99, 0.999, 0.9999]),
    t=st.integers(1, 20000),
    kinds=st.lists(st.tuples(st.booleans(), st.booleans(), st.sampled_from(['floor', 'adam'])),
                   min_size=1, max_size=3))
def test_tier_scalars_are_the_bias_corrections_each_tier_uses(b1s, b2, t, kinds):
  """Every entry of the one-kernel table against its formula in float64. Each `1 - b^t`
  is computed in float32, as it always was, so it carries the float32 rounding of `b^t`
  (an ulp of a value near 1, many ulp of a small difference): the bound is that, as a
  relative error, plus a few ulp for the root and the quotient."""
  tiers = [sj.Tier(momentum=m, nesterov=m and n, eps_mode=e, b1=b)
           for (m, n, e), b in zip(kinds, b1s * 3)]
  table = jax.jit(lambda t_: step_scalars.tier_scalars(tiers, 0.9, b2, t_))(jnp.float32(t))

  def rel(b, k):  # relative error of float32's 1 - b^k from rounding b^k (2 ulp of it)
    p = np.float64(np.float32(b)) ** k
    return 2 * float(np.spacing(np.float32(p))) / (1.0 - p) if p < 1 else 0.0

  def close(got, want, *rels):
    tol = (sum(rels) + 8 * 2.0**-24) * abs(want)
    assert abs(float(got) - want) <= tol, (float(got), want, tol)

  bc2 = 1.0 - np.float64(np.float32(b2)) ** t
  close(table[id(tiers[0])].bc2, bc2, rel(b2, t))
  for tier in tiers:
    b = np.float64(np.float32(tier.b1))
    bc1 = 1.0 - b ** t
    corrected = tier.momentum and not tier.nesterov
    scale = 1.0 / bc1 if corrected else 1.0
    r1 = rel(tier.b1, t) if corrected else 0.0
    got = table[id(tier)]
    close(got.bc1_scale, scale, r1)
    if tier.eps_mode == 'floor':
      close(got.num_scale, scale * np.sqrt(bc2), r1, rel(b2, t))
    else:
      close(got.num_scale, scale, r1)
    if tier.nesterov:
      close(got.x_coeffs[0], b / (1.0 - b ** (t + 1)), rel(tier.b1, t + 1))
      close(got.x_coeffs[1], (1.0 - np.float64(tier.b1)) / bc1, rel(tier.b1, t))


@pytest.mark.skipif(jax.default_backend() != 'cpu', reason='counts XLA:CPU kernels')
@pytest.mark.parametrize('policy', ['PUBLISHED_TIERS', 'MUON_TIERS', 'MUON_CODED_TIERS'])
def test_the_step_counts_functions_compile_to_one_kernel(policy):
  """The bias corrections of every tier (powers of the step count, their quotients and
  roots) are computed by one fused kernel, not one kernel each: no other fusion of the
  optimised step holds a power."""
  params = {'blocks': {'attn': {'kernel': jnp.ones((16, 32))}, 'norm': {'scale': jnp.ones(32)},
                       'moe': {'router': {'kernel': jnp.ones((32, 4))},
                               'experts': {'w1': jnp.ones((4, 32, 64))}}},
            'embed': {'embedding': jnp.ones((64, 32))}}
  tx = sj.skewadam(1e-3, tiers=getattr(sj, policy), param_labels=sj.moe_param_labels)
  state = tx.init(params)
  hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  fused = [c for c in hlo.split('\n\n') if c.lstrip().startswith('%fused')]
  with_power = [c.split(' ', 1)[0] for c in fused if _step_count_powers(c)]
  assert len(with_power) == 1, with_power


def _step_count_powers(computation: str) -> int:
  """The `power`s of an HLO computation whose exponent is not a constant (square
  roots of small operands are `x ** 0.5`, `core.xla.sqrt`)."""
  defs = dict(re.findall(r'(%[\w.\-]+) = \S+ (.*)', computation))

  def constant(name: str) -> bool:
    op = defs.get(name, '')
    if op.startswith('broadcast('):
      return constant(re.match(r'broadcast\((%[\w.\-]+)', op).group(1))
    return op.startswith('constant(')

  return sum(not constant(exponent) for exponent in
             re.findall(r' power\(%[\w.\-]+, (%[\w.\-]+)\)', computation))
