"""How the library's modules import each other, read from their source with `ast`.

* every import of one library module by another is at module level (none inside a
  function, where it would hide a dependency from the reader and from this test);
* no module reads another's private names (`_module._name`), and no `noqa: SLF001`
  silences that: what modules share is a public name of the module that owns it;
* the batch-axes decision (`_axes`) and the path engine (`_paths`) sit below the
  transforms they feed: neither imports `_tiered` or `_alias`, even through others;
* the modules import each other without a cycle.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path
import tokenize

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'skewadam_jax'
SOURCES = {p.stem: p.read_text() for p in sorted(PACKAGE.glob('*.py'))}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _imports(source: str) -> list[tuple[str, str, bool]]:
  """(imported library module, name bound to it or '', inside a function or class)."""
  tree = ast.parse(source)
  parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

  def scoped(node: ast.AST) -> bool:
    while node in parents:
      node = parents[node]
      if isinstance(node, SCOPES):
        return True
    return False

  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      module = node.module or ''
      if node.level:  # relative: within the package
        module = 'skewadam_jax' + ('.' + module if module else '')
      if module == 'skewadam_jax':
        out += [(a.name, a.asname or a.name, scoped(node)) for a in node.names]
      elif module.startswith('skewadam_jax.'):
        out.append((module.split('.')[1], '', scoped(node)))
    elif isinstance(node, ast.Import):
      out += [(a.name.split('.')[1], '', scoped(node)) for a in node.names
              if a.name.startswith('skewadam_jax.')]
  return out


def _private_reads(source: str) -> list[str]:
  """`module._name` reads of another library module's private names, and `from
  skewadam_jax._module import _name`."""
  tree = ast.parse(source)
  modules = {bound for _, bound, _ in _imports(source) if bound}
  out = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and node.attr.startswith('_')
        and not node.attr.startswith('__')):
      out.append(f'{node.value.id}.{node.attr} (line {node.lineno})')
    if (isinstance(node, ast.ImportFrom) and (node.module or '').startswith('skewadam_jax.')):
      out += [f'{node.module}.{a.name} (line {node.lineno})' for a in node.names
              if a.name.startswith('_')]
  return out


def _silenced(source: str) -> list[str]:
  """Comments that silence ruff's private-member rule (SLF001)."""
  tokens = tokenize.generate_tokens(io.StringIO(source).readline)
  return [f'line {t.start[0]}: {t.string}' for t in tokens
          if t.type == tokenize.COMMENT and 'SLF001' in t.string]


def _graph() -> dict[str, set[str]]:
  return {name: {m for m, _, _ in _imports(src) if m in SOURCES and m != name}
          for name, src in SOURCES.items()}


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for m in graph[todo.pop()] - seen:
      seen.add(m)
      todo.append(m)
  return seen


def test_the_checks_see_what_they_look_for():
  bad = ('from skewadam_jax import _labels\n'
         'def f(x):\n'
         '  from skewadam_jax import _tiered\n'
         '  return _labels._shape(x)  # noqa: SLF001\n')
  assert _imports(bad) == [('_labels', '_labels', False), ('_tiered', '_tiered', True)]
  assert _private_reads(bad) == ['_labels._shape (line 4)']
  assert _silenced(bad) == ['line 4: # noqa: SLF001']
  assert _private_reads('from skewadam_jax._labels import _Leaf\n') == [
      'skewadam_jax._labels._Leaf (line 1)']
  assert _closure({'a': {'b'}, 'b': {'c'}, 'c': set()}, 'a') == {'b', 'c'}


@pytest.mark.parametrize('name', sorted(SOURCES))
def test_library_modules_import_each_other_at_module_level(name):
  late = [module for module, _, scoped in _imports(SOURCES[name]) if scoped]
  assert not late, f'{name}.py imports {late} inside a function or class'


@pytest.mark.parametrize('name', sorted(SOURCES))
def test_no_module_reads_anothers_private_names(name):
  assert not _private_reads(SOURCES[name]), name
  assert not _silenced(SOURCES[name]), name


@pytest.mark.parametrize('low', ['_axes', '_paths'])
def test_batch_axes_sit_below_the_transforms(low):
  below = _closure(_graph(), low)
  assert not below & {'_tiered', '_alias'}, f'{low} imports {sorted(below)}'


def test_modules_import_each_other_without_a_cycle():
  graph = _graph()
  cyclic = sorted(name for name in graph if name in _closure(graph, name))
  assert not cyclic
