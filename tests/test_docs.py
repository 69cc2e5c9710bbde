"""The docs' test references name tests that exist.

Every `tests/<file>.py` or `tests/<file>.py::<test>[<id>]` in README.md and docs/*.md ties a
claim to the test that holds it; a renamed or deleted test must not leave the claim
pointing at nothing.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
import re

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
# `tests/x.py`, `tests/x.py::test_y`, `tests/x.py::TestC::test_y`, `...::test_y[id]`.
REFERENCE = re.compile(r'tests/([\w/]+\.py)((?:::\w+)*)(?:\[[^\]\s]*\])?')


def _references():
  found = []
  for doc in DOCS:
    for match in REFERENCE.finditer(doc.read_text()):
      found.append((doc.relative_to(ROOT).as_posix(), match.group(1),
                    tuple(n for n in match.group(2).split('::') if n)))
  return found


@functools.cache
def _names(file: str) -> frozenset[tuple[str, ...]]:
  """Every `def`/`class` in a test file, as the `::` path pytest names it by."""
  tree = ast.parse((ROOT / 'tests' / file).read_text())
  names = set()

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(prefix + (child.name,))
        if isinstance(child, ast.ClassDef):
          visit(child, prefix + (child.name,))
      # Tests assigned at module level (`test_x = _make(...)`) count too.
      elif isinstance(child, ast.Assign) and not prefix:
        names.update((t.id,) for t in child.targets if isinstance(t, ast.Name))

  visit(tree, ())
  return frozenset(names)


def test_docs_reference_tests():
  assert len(_references()) > 300, 'the docs tie few claims to tests; the pattern broke?'


@pytest.mark.parametrize(
    'doc,file,names', sorted(set(_references())),
    ids=lambda x: '::'.join(x) if isinstance(x, tuple) else x)
def test_every_referenced_test_exists(doc, file, names):
  assert (ROOT / 'tests' / file).is_file(), f'{doc} names tests/{file}, which is gone'
  if names:
    assert names in _names(file), (
        f'{doc} names tests/{file}::{"::".join(names)}, which tests/{file} does not define')


@pytest.mark.slow
def test_linen_recipe_prints_the_docs_tables():
  # docs/recipes.md pastes the output of tools/recipes/linen_skewadam.py: its label table
  # and both memory reports must be what the script prints now (the losses are left
  # out, as they may differ in the last digit across machines).
  import subprocess
  import sys
  text = (ROOT / 'docs' / 'recipes.md').read_text()
  section = text[text.index('## 3. A plain Flax Linen MoE'):]
  pasted = re.search(r'```\n(path.*?)```', section, re.S).group(1)
  expected = [line.rstrip() for line in pasted.splitlines()
              if line.strip() and not line.startswith('step ')]
  run = subprocess.run([sys.executable, 'tools/recipes/linen_skewadam.py'], cwd=ROOT,
                       capture_output=True, text=True, check=True, timeout=600)
  printed = [line.rstrip() for line in run.stdout.splitlines()]
  missing = [line for line in expected if line not in printed]
  assert not missing, missing
