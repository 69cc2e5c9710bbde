"""The traced interpreter's rule table against jax's primitives.

Every primitive that jax's `lax` package (with the autodiff, random and control-flow
modules) defines either has a rule (`RULES`, keyed by the primitive objects) or is
listed in `WITHOUT_RULE` (by name), where the analysis leaves the leaves it touches
undecided (safe, warned). The table is keyed by the objects, not their names: a
primitive of the user's that has a ruled primitive's name has no rule.
"""

from __future__ import annotations

import importlib
import pkgutil

import jax
import jax.numpy as jnp
import pytest

import skewadam_jax as sj

from skewadam_jax.structure.traced import rules

_EXTRA_MODULES = ('jax._src.ad_util', 'jax._src.ad_checkpoint', 'jax._src.custom_derivatives',
                  'jax._src.pjit', 'jax._src.random', 'jax._src.shard_map',
                  'jax._src.callback', 'jax._src.debugging', 'jax._src.core')


def _jax_primitives() -> dict[str, str]:
  """Primitive name -> the module that defines it."""
  from jax.extend.core import Primitive
  import jax._src.lax as lax_package
  names = [m.name for m in pkgutil.walk_packages(lax_package.__path__, 'jax._src.lax.')]
  found: dict[str, str] = {}
  for name in names + list(_EXTRA_MODULES):
    try:
      module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a backend-specific module of this jax
      continue
    for value in vars(module).values():
      if isinstance(value, Primitive):
        found.setdefault(value.name, name)
  return found


def _ruled() -> set[str]:
  return {prim.name for prim in rules.RULES}


def test_the_table_is_keyed_by_primitive_objects():
  from jax.extend.core import Primitive
  assert all(isinstance(prim, Primitive) for prim in rules.RULES)
  assert jax.lax.add_p in rules.RULES and jax.lax.dot_general_p in rules.RULES


def test_a_primitive_named_like_a_ruled_one_has_no_rule():
  """A user's primitive called `add` is not `lax.add_p`: its leaves are undecided, with
  the warning naming it (a table keyed by names would read it as an elementwise add)."""
  from jax.extend.core import Primitive
  fake = Primitive('add')
  fake.def_abstract_eval(lambda x, y: x)

  def forward(p, x):
    h = x @ p['w']
    return fake.bind(h, h * p['b'])  # operands of one shape: elementwise, were it `add_p`

  p = {'w': jnp.zeros((8, 4)), 'b': jnp.zeros((4,))}
  with pytest.warns(sj.UnsureLabelWarning, match='no rule reads the primitive `add`'):
    s = sj.trace_structure(forward, p, jax.ShapeDtypeStruct((6, 8), jnp.float32))
  assert set(s.undecided) == {'w', 'b'}


def test_every_primitive_has_a_rule_or_is_left_undecided_by_design():
  found = _jax_primitives()
  assert len(found) > 150  # the walk found jax's primitives
  unknown = sorted(set(found) - _ruled() - rules.WITHOUT_RULE)
  if unknown and jax.__version__ != rules.REVIEWED_FOR_JAX:
    # A newer (or older) jax: its primitives are not yet read against the table. They go
    # to NO_RULE (undecided, warned) until they are; the skip says which.
    pytest.skip(f'rule table reviewed for jax {rules.REVIEWED_FOR_JAX}; jax '
                f'{jax.__version__} adds {unknown}')
  assert not unknown, [(n, found[n]) for n in unknown]


def test_no_primitive_both_has_a_rule_and_is_listed_without_one():
  assert not _ruled() & rules.WITHOUT_RULE


def test_the_listed_primitives_exist_in_the_reviewed_jax():
  if jax.__version__ != rules.REVIEWED_FOR_JAX:
    pytest.skip(f'rule table reviewed for jax {rules.REVIEWED_FOR_JAX}')
  assert not sorted(rules.WITHOUT_RULE - set(_jax_primitives()))


def _recorded(an) -> str:
  """Everything the analysis records (findings applied), as one comparable string."""
  return repr((an.decisions, an.order, an.banks, an.scans, an.mapped, an.opaque, an.unknown,
               an.blind, an.pieces, an.uses, an.near, an.joined, an.unclear, an.joins,
               sorted(map(str, an.memo))))


def test_rules_return_findings_and_never_change_the_analysis(monkeypatch):
  """Every rule that enters no body leaves the analysis as it found it: what it finds
  comes back as findings, which the driver applies (`findings.record`)."""
  import moe_programs as mp

  from skewadam_jax.structure.traced import analysis
  from skewadam_jax.structure.traced import findings

  table = rules.TABLE
  called = set()

  def checked(rule):
    def run(an, eqn, ins):
      before = _recorded(an)
      result = rule(an, eqn, ins)
      assert _recorded(an) == before, eqn.primitive
      assert isinstance(result, findings.Result), eqn.primitive
      called.add(eqn.primitive)
      return result
    return run

  wrapped = {p: r if p in table.follows_bodies else checked(r) for p, r in table.rules.items()}
  monkeypatch.setattr(rules, 'TABLE', analysis.Table(wrapped, table.no_rule,
                                                     table.follows_bodies,
                                                     table.keeps_positions), raising=False)
  for seed in range(6):
    program = mp.build(mp.spec_from_seed(seed))
    sj.trace_structure(program.fn, program.params, *program.args)
  assert {jax.lax.dot_general_p, jax.lax.top_k_p, jax.lax.reshape_p} <= called


def test_the_property_tables_name_ruled_primitives():
  table = rules.TABLE
  assert table.follows_bodies <= set(table.rules)
  assert table.keeps_positions <= set(table.rules)
  assert jax.lax.scan_p in table.follows_bodies and jax.lax.add_p in table.keeps_positions
  assert jax.lax.slice_p not in table.keeps_positions  # a slice may move positions


def test_the_elementwise_primitives_are_read_from_jax_batchers():
  """jax's own elementwise primitives (batched by broadcasting or as vectorised ops)
  have the elementwise rule, whatever jax version: the set is derived, not listed; the
  conversions of extended dtypes jax batches alike are left without a rule."""
  from skewadam_jax.structure.traced.rules import elementwise

  prims = elementwise.primitives()
  for prim in (jax.lax.add_p, jax.lax.exp_p, jax.lax.tanh_p, jax.lax.ne_p, jax.lax.erf_p,
               jax.lax.select_n_p, jax.lax.convert_element_type_p):
    assert rules.RULES[prim] is elementwise.elementwise, prim
  assert not {p.name for p in prims} & rules.WITHOUT_RULE
