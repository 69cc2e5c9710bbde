"""The public namespace: every name in `__all__` imports, and nothing else is public."""

from __future__ import annotations

import importlib
import types
import typing

import jax
import optax

import skewadam_jax as sj


def test_every_name_in_all_imports():
  assert len(sj.__all__) == len(set(sj.__all__))
  for name in sj.__all__:
    assert getattr(sj, name) is not None, name
  namespace: dict = {}
  exec('from skewadam_jax import *', namespace)  # the star import itself
  assert set(namespace) - {'__builtins__'} == set(sj.__all__)


# The layer packages (internal: `import skewadam_jax as sj` and `sj.<name>` is the API).
LAYERS = {'core', 'estimators', 'structure', 'transforms', 'reports', 'integrations'}


def test_no_private_module_or_other_name_leaks():
  public = {name for name in vars(sj) if not name.startswith('_')}
  assert public - LAYERS == set(sj.__all__), (public - LAYERS) ^ set(sj.__all__)
  for name in public & LAYERS:
    assert isinstance(getattr(sj, name), types.ModuleType), name
    assert 'Internal' in getattr(sj, name).__doc__, name
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


def test_factories_type_their_hyperparameters_as_optax_does():
  # The optimizers' arguments are typed as optax.adamw's and scale_by_adam's (a rate
  # may be a schedule, a decay an array under inject_hyperparams), and the hints
  # resolve, so a type checker or IDE shows what each argument takes.
  expected = {
      'learning_rate': optax.ScalarOrSchedule,
      'weight_decay': optax.ScalarOrSchedule,
      'b1': jax.typing.ArrayLike,
      'b2': jax.typing.ArrayLike,
      'eps': jax.typing.ArrayLike,
      'eps_root': jax.typing.ArrayLike,
      'mu_dtype': typing.Optional[jax.typing.DTypeLike],
      'nu_dtype': typing.Optional[jax.typing.DTypeLike],
  }
  factories = (sj.skewadam, sj.adampm, sj.scale_by_tiers, sj.scale_by_tiered_adam,
               sj.scale_by_grouped_second_moment)
  for factory in factories:
    hints = typing.get_type_hints(getattr(factory, '__wrapped__', factory))
    for name, hint in expected.items():
      if name in hints:
        assert hints[name] == hint, (factory.__name__, name, hints[name])
    assert {'b1', 'b2', 'eps'} <= set(hints), factory.__name__


def test_api_table_names_every_public_name_with_real_arguments():
  # docs/api.md's table: every public name is in its first column, and each
  # `name(arg, ...)` there lists real parameters of `name`, in the signature's order
  # (a table row may leave rarely used ones out).
  import inspect
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'api.md').read_text()
  first = ' '.join(line.split(' | ')[0] for line in text.splitlines()
                   if line.startswith('| `'))
  missing = [n for n in sj.__all__ if not re.search(rf'`{n}\b|, {n}\b|\({n}\)', first)]
  assert not missing, missing
  for name, args in re.findall(r'`(\w+)\(([^`]*)\)`', first):
    assert name in sj.__all__, name
    documented = [a.split('=')[0].strip().lstrip('*') for a in args.split(',')]
    documented = [a for a in documented if a and a not in ('', '...')]
    real = list(inspect.signature(getattr(sj, name)).parameters)
    positions = [real.index(a) if a in real else -1 for a in documented]
    assert -1 not in positions and positions == sorted(positions), (name, documented, real)
