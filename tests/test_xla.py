"""core/xla.py: values XLA cannot fold into constants (`opaque_uints`)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from skewadam_jax.core import xla


@settings(max_examples=20, deadline=None)
@given(values=st.lists(st.integers(0, 2**32 - 1), max_size=6),
       key=st.floats(-2.0**100, 2.0**100, width=32))
def test_opaque_values_are_the_values_for_any_key(values, key):
  eager = xla.opaque_uints(values, jnp.float32(key))
  jitted = jax.jit(lambda k: xla.opaque_uints(values, k))(jnp.float32(key))
  for got in (eager, jitted):
    assert [int(v) for v in got] == values
    assert all(v.dtype == jnp.uint32 and v.shape == () for v in got)


def test_opaque_values_are_one_conditional_and_survive_vmap():
  jaxpr = jax.make_jaxpr(lambda k: xla.opaque_uints([3, 1, 4], k))(jnp.float32(0))
  assert [e.primitive.name for e in jaxpr.eqns].count('cond') == 1
  batched = jax.vmap(lambda k: jnp.stack(xla.opaque_uints([3, 1, 4], k)))(
      jnp.arange(5, dtype=jnp.float32))
  np.testing.assert_array_equal(batched, np.tile([3, 1, 4], (5, 1)))
  assert xla.opaque_uints([], jnp.float32(0)) == ()


def test_opaque_values_are_not_constants_of_the_compiled_program():
  # The point of them: a slice at an opaque offset is one kernel for every offset. Here,
  # the weaker fact that holds on every backend: the offsets are not folded into the
  # dynamic slices (XLA would turn a constant-offset dynamic-slice into a slice).
  def f(x, k):
    offsets = xla.opaque_uints([0, 2, 4], k)
    zero = jnp.uint32(0)
    return [jax.lax.dynamic_slice(x, (o, zero), (2, 3)) for o in offsets]
  x = jnp.arange(18.0).reshape(6, 3)
  hlo = jax.jit(f).lower(x, jnp.float32(1)).compile().as_text()
  assert 'dynamic-slice' in hlo
  for i, part in enumerate(jax.jit(f)(x, jnp.float32(1))):
    np.testing.assert_array_equal(part, x[2 * i:2 * i + 2])
