"""jax's primitive objects, found by module and name: the rule table's keys.

The analysis keys its rules and properties by the primitive objects jax defines (`lax.add_p`),
as jax's own interpreters do (`batching.primitive_batchers[add_p]`), never by a
primitive's name: a user's primitive that happens to be called `add` has no rule. jax
moves and renames primitives between versions (`pjit_p` became `jit_p`, `jax._src.prng`
became `jax._src.random.prng`): `find` skips a module or a name this jax does not have,
so the table lists every spelling it knows. Every module named here is one `import jax`
loads, except the ones only `rules.RULES` reads (Pallas), found at its first read.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from jax._src import core as _core
from jax._src.interpreters import batching as _batching

# The modules that define the primitives the analysis reads.
LAX = 'jax._src.lax.lax'
SLICING = 'jax._src.lax.slicing'
SPECIAL = 'jax._src.lax.special'
LINALG = 'jax._src.lax.linalg'
CONTROL = 'jax._src.lax.control_flow'
PARALLEL = 'jax._src.lax.parallel'
AD_UTIL = 'jax._src.ad_util'
CHECKPOINT = 'jax._src.ad_checkpoint'
CORE = 'jax._src.core'
PJIT = 'jax._src.pjit'


def find(module: str, *names: str) -> tuple[Any, ...]:
  """The primitives `module` defines under `names` (`'add_p'`), those this jax has.

  Args:
    module: a jax module, `'jax._src.lax.lax'`.
    *names: the attributes holding the primitives, every spelling jax has used.

  Returns:
    The primitive objects found, in the order of `names`, without repeats.
  """
  try:
    found = importlib.import_module(module)
  except ImportError:  # a module of another jax version
    return ()
  prims = [getattr(found, name, None) for name in names]
  return tuple(dict.fromkeys(p for p in prims if isinstance(p, _core.Primitive)))


def batched_elementwise(*modules: str) -> frozenset:
  """The primitives `modules` define that jax batches as elementwise ops.

  jax registers the batching rule of an elementwise primitive with
  `batching.defbroadcasting` (operands broadcast to one shape) or
  `batching.defvectorized` (one operand): those batchers are partials of
  `broadcast_batcher` and `vectorized_batcher`. Read once per module, after jax defined
  them (an empty set if this jax keeps its batchers otherwise).
  """
  return frozenset().union(*(_batched_elementwise(m) for m in modules))


@functools.cache
def _batched_elementwise(module: str) -> frozenset:
  try:
    found = importlib.import_module(module)
  except ImportError:
    return frozenset()
  table = getattr(_batching, 'fancy_primitive_batchers', None)
  if not isinstance(table, dict):
    table = getattr(_batching, 'primitive_batchers', {})
  kinds = tuple(f for f in (getattr(_batching, 'broadcast_batcher', None),
                            getattr(_batching, 'vectorized_batcher', None)) if f is not None)
  prims = (p for p in vars(found).values() if isinstance(p, _core.Primitive))
  return frozenset(p for p in prims if isinstance(table, dict) and isinstance(
      table.get(p), functools.partial) and table[p].func in kinds)
