"""The benchmarks' own measuring helpers (benchmarks/_common.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import skewadam_jax as sj

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmarks'))
import _common  # noqa: E402


def _tree():
  return {'experts': jnp.zeros((8, 64, 96)), 'embed': jnp.zeros((300, 64)),
          'norm': jnp.zeros((64,)), 'router': jnp.zeros((64, 8))}


@pytest.mark.parametrize('make', [lambda: optax.adamw(1e-3), lambda: sj.skewadam(1e-3),
                                  lambda: sj.adampm(1e-3, group_size=8)],
                         ids=['adamw', 'skewadam', 'adampm'])
def test_kernel_bytes_equal_xla_cost_analysis(make):
  # gpu_compile.py counts bytes from the optimised HLO because a compile-only GPU
  # executable has no cost analysis; on the CPU both counts must agree (XLA counts a
  # scalar operand once per use inside a fusion, which is noise beside the arrays).
  tx = make()
  params = _tree()

  def step(p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  compiled = jax.jit(step, donate_argnums=(0, 2)).lower(
      params, params, tx.init(params)).compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  kernel_bytes, kernels = _common.hlo_kernel_bytes(compiled.as_text())
  assert kernels > 0
  assert kernel_bytes == pytest.approx(ca['bytes accessed'], rel=1e-3)
  assert kernel_bytes > 3 * sum(x.nbytes for x in jax.tree.leaves(params))


def test_kernel_bytes_of_a_copy():
  x = jnp.zeros((256, 128), jnp.float32)
  compiled = jax.jit(jnp.negative, donate_argnums=0).lower(x).compile()
  kernel_bytes, kernels = _common.hlo_kernel_bytes(compiled.as_text())
  assert (kernel_bytes, kernels) == (2 * x.nbytes, 1)


def test_compile_only_device_rejects_unknown_target():
  with pytest.raises(ValueError, match='`target` must be one of'):
    _common.compile_only_device('h999')
