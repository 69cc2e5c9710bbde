"""The public namespace: every name in `__all__` imports, and nothing else is public."""

from __future__ import annotations

import importlib
import types

import skewadam_jax as sj


def test_every_name_in_all_imports():
  assert len(sj.__all__) == len(set(sj.__all__))
  for name in sj.__all__:
    assert getattr(sj, name) is not None, name
  namespace: dict = {}
  exec('from skewadam_jax import *', namespace)  # the star import itself
  assert set(namespace) - {'__builtins__'} == set(sj.__all__)


def test_no_private_module_or_other_name_leaks():
  public = {name for name in vars(sj) if not name.startswith('_')}
  assert public == set(sj.__all__), public ^ set(sj.__all__)
  for name in sj.__all__:
    value = getattr(sj, name)
    assert not isinstance(value, types.ModuleType), name
    module = getattr(value, '__module__', None)
    # Defined in the library (re-exported from an internal module), never re-exported
    # from another package.
    assert module is None or module.startswith('skewadam_jax'), (name, module)


def test_names_the_docs_tell_users_to_use():
  # Filtering the unsure-label warning, making a labeler, the dense rules.
  assert issubclass(sj.UnsureLabelWarning, UserWarning)
  assert isinstance(sj.make_labeler(), sj.Labeler)
  assert sj.DENSE_RULES and all(len(rule) == 2 for rule in sj.DENSE_RULES)
  assert importlib.import_module('skewadam_jax').__version__
