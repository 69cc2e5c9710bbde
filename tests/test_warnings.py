"""The suite runs with deprecation warnings raised from the library's own modules as
errors (pyproject.toml's `filterwarnings`), and asking for a warning still works."""

from __future__ import annotations

import warnings

import pytest

import skewadam_jax as sj


def _warn_from(module: str, category: type[Warning]) -> None:
  """Warns as if from a line of `module` (what the filters match on)."""
  warnings.warn_explicit('going away', category, f'{module.replace(".", "/")}.py', 1,
                         module=module)


@pytest.mark.parametrize('module', ['skewadam_jax', 'skewadam_jax.structure.boxes'])
@pytest.mark.parametrize('category', [DeprecationWarning, FutureWarning])
def test_deprecation_warnings_raised_from_the_library_are_errors(category, module):
  with pytest.raises(category, match='going away'):
    _warn_from(module, category)
  # Unless a test asks for them.
  with pytest.warns(category, match='going away'):
    _warn_from(module, category)
  if category is DeprecationWarning:
    with pytest.deprecated_call(match='going away'):
      _warn_from(module, category)


def test_other_warnings_and_other_modules_stay_warnings():
  with warnings.catch_warnings(record=True) as caught:  # the suite's filters, recorded
    _warn_from('skewadam_jax.structure.labels', sj.UnsureLabelWarning)  # intended
    _warn_from('flax.nnx.variablelib', DeprecationWarning)  # a dependency's own
    _warn_from('skewadam_jax_examples', FutureWarning)  # not a module of the package
  assert [w.category for w in caught] == [sj.UnsureLabelWarning, DeprecationWarning,
                                          FutureWarning]


def test_a_script_read_from_stdin_gets_the_warning_not_an_error():
  # `python -` gives `__main__` a loader that cannot return source lines; the warning
  # (attributed to the user's line) must still be shown, not raise ImportError.
  import subprocess
  import sys
  script = ('import jax.numpy as jnp, skewadam_jax as sj\n'
            "tree = {'blk': {'w': jnp.zeros((4, 8, 16)), 'u': jnp.zeros((4, 16, 8)),"
            " 's': jnp.zeros((4, 8))}, 'out': jnp.zeros((8, 32))}\n"
            'sj.label_table(sj.skewadam(1e-3), tree)\n'
            "print('done')\n")
  proc = subprocess.run([sys.executable, '-'], input=script, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == 'done'
  assert 'UnsureLabelWarning' in proc.stderr, proc.stderr[-2000:]
