"""How the library's modules import each other, read from their source with `ast`.

The package is in layers, one folder each, and a module imports only from its own
layer or the layers below (`LAYERS`, bottom first):

* `core`: pytree helpers, argument checks, XLA facts;
* `estimators`: what a tier remembers (second-moment estimators, their geometry);
* `structure`: what each parameter is (its vocabulary of tiers and roles, paths, boxes,
  name rules, shape rules, stacks, unsure reports, labels, batch axes, the traced
  analysis);
* `transforms`: how a tier steps (`Tier`, `scale_by_tiers`, AdamPM, the aliases);
* `reports`: what a user sees (traced `init`, label table, memory report);
* `integrations`: sharding specs, Orbax checkpoints.

Besides the layering:

* every import of one library module by another is at module level (none inside a
  function, where it would hide a dependency from the reader and from this test);
* no module reads another's private names (`_module._name`), and no `noqa: SLF001`
  silences that: what modules share is a public name of the module that owns it;
* the modules import each other without a cycle;
* every module is of a size one can read: at most `MAX_MODULE_LINES` lines, no class
  over `MAX_CLASS_LINES`;
* code names a tier through the constants of `structure.vocabulary`, never a literal
  (`tier == 'router'`, `{'backbone': ...}`): a tier name is spelled in one place.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path
import tokenize

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'skewadam_jax'
MAX_MODULE_LINES = 420  # about 400: a module holds one idea
MAX_CLASS_LINES = 250
LAYERS = ('core', 'estimators', 'structure', 'transforms', 'reports', 'integrations')


def _dotted(path: Path) -> str:
  """'structure.labels' for skewadam_jax/structure/labels.py ('' for the root __init__)."""
  parts = list(path.relative_to(PACKAGE).with_suffix('').parts)
  if parts[-1] == '__init__':
    parts.pop()
  return '.'.join(parts)


SOURCES = {_dotted(p): p.read_text() for p in sorted(PACKAGE.rglob('*.py'))}
MODULES = sorted(name for name in SOURCES if name)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _imports(source: str, package: str = '') -> list[tuple[str, str, bool]]:
  """(imported library module, dotted below skewadam_jax; name bound to it or ''; inside
  a function or class). `package` is the importing module's package, for relative
  imports."""
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
        base = ['skewadam_jax'] + [p for p in package.split('.') if p]
        base = base[:len(base) - (node.level - 1)]
        module = '.'.join(base + ([module] if module else []))
      if module == 'skewadam_jax' or module.startswith('skewadam_jax.'):
        below = module[len('skewadam_jax.'):] if module != 'skewadam_jax' else ''
        for a in node.names:
          name = f'{below}.{a.name}' if below else a.name
          if name in SOURCES or not below:  # a module (or a package's name)
            out.append((name, a.asname or a.name, scoped(node)))
          else:  # a name from a module
            out.append((below, '', scoped(node)))
    elif isinstance(node, ast.Import):
      out += [(a.name[len('skewadam_jax.'):], '', scoped(node)) for a in node.names
              if a.name.startswith('skewadam_jax.')]
  return out


def _private_reads(source: str) -> list[str]:
  """`module._name` reads of another library module's private names, and `from
  skewadam_jax.<module> import _name`."""
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


def _package(name: str) -> str:
  return name if SOURCES.get(name) is not None and (PACKAGE / name.replace('.', '/')).is_dir() \
      else name.rpartition('.')[0]


def _graph() -> dict[str, set[str]]:
  return {name: {m for m, _, _ in _imports(SOURCES[name], _package(name))
                 if m in SOURCES and m != name and m}
          for name in MODULES}


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for m in graph.get(todo.pop(), set()) - seen:
      seen.add(m)
      todo.append(m)
  return seen


def _layer(name: str) -> int:
  return LAYERS.index(name.split('.')[0])


def test_the_checks_see_what_they_look_for():
  bad = ('from skewadam_jax.structure import labels as _labels\n'
         'def f(x):\n'
         '  from skewadam_jax.transforms import tiers as _tiered\n'
         '  return _labels._shape(x)  # noqa: SLF001\n')
  assert _imports(bad) == [('structure.labels', '_labels', False),
                           ('transforms.tiers', '_tiered', True)]
  assert _private_reads(bad) == ['_labels._shape (line 4)']
  assert _silenced(bad) == ['line 4: # noqa: SLF001']
  assert _private_reads('from skewadam_jax.structure.labels import _Leaf\n') == [
      'skewadam_jax.structure.labels._Leaf (line 1)']
  assert _imports('from skewadam_jax.core.tree import abstract_leaf\n') == [
      ('core.tree', '', False)]
  assert _imports('from . import paths\n', 'structure') == [('structure.paths', 'paths', False)]
  assert _closure({'a': {'b'}, 'b': {'c'}, 'c': set()}, 'a') == {'b', 'c'}


def test_every_module_sits_in_a_layer():
  assert {name.split('.')[0] for name in MODULES} == set(LAYERS)


@pytest.mark.parametrize('name', MODULES)
def test_modules_import_only_from_their_layer_or_below(name):
  graph = _graph()
  higher = sorted(m for m in graph[name] if _layer(m) > _layer(name))
  assert not higher, f'{name} imports {higher} from a higher layer'


@pytest.mark.parametrize('name', MODULES)
def test_library_modules_import_each_other_at_module_level(name):
  late = [module for module, _, scoped in _imports(SOURCES[name], _package(name)) if scoped]
  assert not late, f'{name}.py imports {late} inside a function or class'


@pytest.mark.parametrize('name', MODULES)
def test_no_module_reads_anothers_private_names(name):
  assert not _private_reads(SOURCES[name]), name
  assert not _silenced(SOURCES[name]), name


def test_modules_import_each_other_without_a_cycle():
  graph = _graph()
  cyclic = sorted(name for name in graph if name in _closure(graph, name))
  assert not cyclic


@pytest.mark.parametrize('name', MODULES)
def test_modules_and_classes_are_of_a_readable_size(name):
  source = SOURCES[name]
  assert source.count('\n') <= MAX_MODULE_LINES, f'{name}: {source.count(chr(10))} lines'
  big = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
         if isinstance(node, ast.ClassDef)
         and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
  assert not big, f'{name}: {big}'


BUILTIN_ESTIMATORS_AND_CODECS = {'Exact', 'Factored', 'Grouped', 'Orthogonal', 'Blockwise'}


def test_the_plan_is_the_only_carrier_of_decisions():
  # docs/architecture.md: the tier step reads an estimator's or codec's protocol, never
  # its type, and no context variable carries a decision from `init` to the reports.
  tier_leaf = ast.parse((PACKAGE / 'transforms' / 'tier_leaf.py').read_text())
  named = {n.id for n in ast.walk(tier_leaf) if isinstance(n, ast.Name)}
  named |= {n.attr for n in ast.walk(tier_leaf) if isinstance(n, ast.Attribute)}
  assert not named & BUILTIN_ESTIMATORS_AND_CODECS, named & BUILTIN_ESTIMATORS_AND_CODECS
  for layer in ('transforms', 'reports', 'integrations'):
    for path in (PACKAGE / layer).glob('*.py'):
      assert 'contextvars' not in path.read_text(), path


TIER_NAMES = frozenset({'backbone', 'experts', 'router', 'hidden', 'undecided'})


def _tier_literals(source: str) -> list[str]:
  """Tier names written as string literals where code decides with them: compared
  (`tier == 'router'`, `tier in ('experts', 'router')`), as the tier of a `(pattern,
  tier)` rule, a dict key or a subscript (`{'backbone': Tier()}`, `tiers['router']`), or
  passed to a call. Prose (docstrings, messages) is no such place."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      values = [node.left, *node.comparators]
    elif isinstance(node, ast.Dict):
      values = [k for k in node.keys if k is not None]
    elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
      values = node.elts[1:]
    elif isinstance(node, ast.Subscript):
      values = [node.slice]
    elif isinstance(node, ast.Call):
      values = [*node.args, *(k.value for k in node.keywords)]
    else:
      continue
    for value in values:
      elts = value.elts if isinstance(value, (ast.Tuple, ast.List, ast.Set)) else [value]
      out += [f'{e.value!r} (line {e.lineno})' for e in elts
              if isinstance(e, ast.Constant) and e.value in TIER_NAMES]
  return out


def test_the_tier_literal_check_sees_what_it_looks_for():
  assert _tier_literals("x = tier == 'router' or t in ('experts', 'a')\n") == [
      "'router' (line 1)", "'experts' (line 1)"]
  assert _tier_literals("r = ('*mlp*', 'backbone')\nd = {'hidden': 1}\nt['undecided']\n") == [
      "'backbone' (line 1)", "'hidden' (line 2)", "'undecided' (line 3)"]
  assert not _tier_literals('"""A \'router\' tier."""\nr = (\'experts\', ROUTER)\n')


@pytest.mark.parametrize('name', [m for m in MODULES if m != 'structure.vocabulary'])
def test_tier_names_in_code_come_from_the_vocabulary(name):
  # One vocabulary (structure/vocabulary.py): a module decides with its constants, so
  # that a tier name means one thing everywhere and is spelled in one place.
  assert not _tier_literals(SOURCES[name]), name
