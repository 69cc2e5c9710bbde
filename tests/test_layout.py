"""tests/ mirrors the package: a folder per layer, helpers apart from tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / 'tests'
PACKAGE = ROOT / 'skewadam_jax'
# Folders of tests/ that are not layers of the package: the scripts' tests, shared
# helpers and recorded data.
NOT_LAYERS = {'examples', 'benchmarks', 'support', 'data'}
# Tests of the whole project rather than of one layer.
PROJECT_WIDE = {'test_docs.py', 'test_import_time.py', 'test_imports.py', 'test_layout.py',
                'test_public_api.py', 'test_readme.py', 'test_warnings.py'}


def _folders(root: Path) -> list[Path]:
  return sorted(p for p in root.rglob('*') if p.is_dir() and p.name != '__pycache__'
                and not any(part.startswith('.') for part in p.relative_to(root).parts))


def test_every_test_folder_is_a_package_folder_or_named_apart():
  for folder in _folders(TESTS):
    rel = folder.relative_to(TESTS)
    if rel.parts[0] in NOT_LAYERS:
      continue
    assert (PACKAGE / rel / '__init__.py').is_file(), (
        f'tests/{rel.as_posix()}/ mirrors no folder of skewadam_jax/')


def test_every_package_folder_with_modules_has_its_tests():
  for folder in _folders(PACKAGE):
    rel = folder.relative_to(PACKAGE)
    modules = [p for p in folder.glob('*.py') if p.name != '__init__.py']
    if not modules or rel.parts[-1] == 'rules':
      continue  # the traced rules are tested as the interpreter they make up
    assert list((TESTS / rel).glob('test_*.py')), (
        f'skewadam_jax/{rel.as_posix()}/ has no tests/{rel.as_posix()}/test_*.py')


def test_helpers_live_apart_from_tests():
  for path in TESTS.rglob('*.py'):
    rel = path.relative_to(TESTS)
    if rel.parts[0] in ('support', 'data') or path.name in ('__init__.py', 'conftest.py'):
      continue
    assert path.name.startswith('test_'), (
        f'tests/{rel.as_posix()} is a helper: move it to tests/support/')
    if len(rel.parts) == 1:
      assert path.name in PROJECT_WIDE, (
          f'tests/{path.name} tests one layer: move it to the folder of that layer')
