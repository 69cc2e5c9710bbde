"""The example and benchmark scripts' command lines, and the checkpointing demo."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
import subprocess
import sys
from types import ModuleType

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / 'benchmarks'):
  if str(p) not in sys.path:
    sys.path.insert(0, str(p))

SCRIPTS = (
    'examples.moe_lm.train', 'examples.quickstart', 'examples.sharded_moe',
    'examples.pmap_data_parallel', 'examples.checkpointing', 'adampm_fidelity',
    'gpu_compile', 'memory', 'peak_memory', 'quality', 'quickstart_check', 'step_time',
)

# Example runs: the slow tier (`pytest -m slow`).
pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def modules() -> dict[str, ModuleType]:
  """Every script, imported (not run); their import-time `XLA_FLAGS` edits undone."""
  jax.devices()  # the backend (and its device count) is fixed before any script sets flags
  saved = os.environ.get('XLA_FLAGS')
  try:
    return {name: importlib.import_module(name) for name in SCRIPTS}
  finally:
    if saved is None:
      os.environ.pop('XLA_FLAGS', None)
    else:
      os.environ['XLA_FLAGS'] = saved


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
  """The parser's visible options (not `--help`, not the hidden ones)."""
  return [a for a in parser._actions
          if a.option_strings and a.help != argparse.SUPPRESS
          and not isinstance(a, argparse._HelpAction)]


# ----------------------------------------------------------------- one spelling, both work

# script -> (option in hyphen style, a value for it or None for a switch)
MULTI_WORD = {
    'examples.moe_lm.train': [('--batch-size', '4'), ('--seq-len', '16'),
                              ('--weight-decay', '0.5'), ('--eval-every', '7'),
                              ('--eval-batches', '3'), ('--data-dir', '/tmp/text')],
    'examples.quickstart': [('--batch-size', '4')],
    'examples.sharded_moe': [('--batch-size', '4'), ('--seq-len', '16'),
                             ('--weight-decay', '0.5'), ('--group-size', '4'),
                             ('--data-dir', '/tmp/text')],
    'examples.pmap_data_parallel': [('--batch-size', '4'), ('--seq-len', '16'),
                                    ('--weight-decay', '0.5'), ('--data-dir', '/tmp/text')],
    'adampm_fidelity': [('--batch-size', '4')],
    'quality': [('--batch-size', '4'), ('--warmup-frac', '0.2'), ('--eval-every', '7'),
                ('--eval-batches', '3')],
    'step_time': [('--state-dtype', 'float32'), ('--no-by-tier', None)],
    'quickstart_check': [('--batch-size', '4'), ('--eval-batches', '3')],
}


@pytest.mark.parametrize('name', sorted(MULTI_WORD))
def test_hyphen_and_underscore_spellings_parse_alike(modules, name):
  parser = modules[name].build_parser()
  for flag, value in MULTI_WORD[name]:
    alias = flag.replace('-', '_').replace('__', '--', 1)
    args = [] if value is None else [value]
    hyphen = vars(parser.parse_args([flag, *args]))
    underscore = vars(parser.parse_args([alias, *args]))
    assert hyphen == underscore, (flag, alias)
    assert hyphen != vars(parser.parse_args([])), flag  # the option took effect


@pytest.mark.parametrize('name', SCRIPTS)
def test_every_option_is_hyphenated_with_an_underscore_alias(modules, name):
  for action in _options(modules[name].build_parser()):
    first, *aliases = action.option_strings
    assert '_' not in first, first
    if '-' in first[2:]:
      assert '--' + first[2:].replace('-', '_') in aliases, first


def test_sharded_moe_keeps_its_documented_underscore_commands(modules):
  args = modules['examples.sharded_moe'].parse_args(
      ['--ckpt_dir', '/tmp/ckpt', '--save_at', '10', '--batch_size', '4', '--data_dir', '/d'])
  assert (args.ckpt_dir, args.save_at, args.batch_size, args.data_dir) == (
      '/tmp/ckpt', 10, 4, '/d')


# ----------------------------------------------------------------- --help shows defaults


@pytest.mark.parametrize('name', SCRIPTS)
def test_help_explains_every_option_and_shows_its_default(modules, name, monkeypatch):
  monkeypatch.setenv('COLUMNS', '2000')  # no wrapping (it would split `paper-6.78b`)
  parser = modules[name].build_parser()
  assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter
  text = ' '.join(parser.format_help().split())  # unwrapped
  for action in _options(parser):
    assert action.help, action.option_strings
    # Switches (`store_true` / `store_false`) say what they do; their default is implied.
    if action.default is not None and action.nargs != 0:
      assert f'(default: {action.default})' in text, action.option_strings


# ----------------------------------------------------------------- checkpoint flags


@pytest.mark.parametrize('argv', [['--resume', '3'], ['--save-at', '3'], ['--save_at', '3']])
def test_sharded_moe_needs_a_checkpoint_dir(modules, capsys, argv):
  with pytest.raises(SystemExit) as exit_info:
    modules['examples.sharded_moe'].parse_args(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert '--ckpt-dir' in err and argv[0].replace('_', '-') in err


def test_sharded_moe_rejects_a_save_step_it_never_reaches(modules, capsys):
  with pytest.raises(SystemExit):
    modules['examples.sharded_moe'].parse_args(
        ['--ckpt_dir', '/tmp/c', '--steps', '5', '--save_at', '6'])
  assert '--save-at 6 is never reached' in capsys.readouterr().err


def test_sharded_moe_accepts_resume_with_a_checkpoint_dir(modules):
  args = modules['examples.sharded_moe'].parse_args(
      ['--ckpt-dir', '/tmp/c', '--resume', '3', '--save-at', '5'])
  assert (args.ckpt_dir, args.resume, args.save_at) == ('/tmp/c', 3, 5)


# ----------------------------------------------------------------- checkpointing demo


def test_checkpointing_demo_restores_bitwise(modules, tmp_path, capsys):
  ckpt = modules['examples.checkpointing']
  out = ckpt.main(['--dir', str(tmp_path / 'ckpt'), '--steps', '2'])
  saved, restored = out['saved'], out['restored']
  assert out['mismatched'] == []
  assert (tmp_path / 'ckpt').is_dir()
  assert jax.tree.structure(restored) == jax.tree.structure(saved)
  leaves = jax.tree.leaves(saved)
  assert len(leaves) > 10
  for a, b in zip(leaves, jax.tree.leaves(restored)):
    assert isinstance(b, jax.Array) and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Two updates happened, so the state is not the all-zero init.
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(saved['opt_state'])
             if np.issubdtype(np.asarray(x).dtype, np.floating))
  text = capsys.readouterr().out
  assert 'bitwise equal' in text and str(tmp_path / 'ckpt') in text


def test_checkpointing_helpers_keep_their_signatures(modules):
  # Code written against the helpers keeps working: the leading parameters stay as they
  # were, and whatever was added since is optional.
  import inspect
  ckpt = modules['examples.checkpointing']
  for fn, leading in ((ckpt.save_checkpoint, ['path', 'tree']),
                      (ckpt.abstract_target,
                       ['tx', 'abstract_params', 'param_shardings', 'mesh']),
                      (ckpt.restore_checkpoint, ['path', 'target'])):
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:len(leading)]] == leading, fn.__name__
    for p in params[len(leading):]:
      assert p.default is not inspect.Parameter.empty, (fn.__name__, p.name)
  # The description the sealed checkpoint is compared with is what was added.
  assert 'description' in inspect.signature(ckpt.save_checkpoint).parameters
  assert 'description' in inspect.signature(ckpt.restore_checkpoint).parameters


def test_checkpointing_script_prints_its_help():
  # Run as a script, as the README shows it: it must say what it does.
  proc = subprocess.run([sys.executable, str(ROOT / 'examples' / 'checkpointing.py'), '--help'],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith('usage:') and '--dir' in proc.stdout


# ----------------------------------------------------------------- the Quickstart check


def test_quickstart_check_candidates_parse_with_their_own_lr(modules):
  qc = modules['quickstart_check']
  assert qc.parse_candidate('adamw', 3e-4) == ('adamw', 3e-4)
  assert qc.parse_candidate('skewadam@1e-3', 3e-4) == ('skewadam', 1e-3)
  for bad in ('nope', 'adamw@x', 'adamw@-1', 'adamw@0'):
    with pytest.raises(ValueError, match='candidate'):
      qc.parse_candidate(bad, 3e-4)
  with pytest.raises(SystemExit):
    qc.main(['--candidates', 'nope'])


def test_quickstart_check_compares_candidates_from_one_init(modules, tmp_path, capsys):
  import json
  qc = modules['quickstart_check']
  rows = qc.main(['--preset', 'tiny', '--steps', '4', '--warmup', '1', '--early', '2',
                  '--batch-size', '4', '--eval-batches', '1', '--candidates', 'skewadam',
                  'adamw', '--out', str(tmp_path / 'qs')])
  assert [r['candidate'] for r in rows] == ['skewadam @ 0.0003', 'adamw @ 0.0003']
  # The same initial weights and first batch: the same loss before any update.
  assert rows[0]['train_ce_first'] == pytest.approx(rows[1]['train_ce_first'], rel=1e-6)
  assert rows[1]['vs_baseline_pct'] == 0.0
  assert rows[0]['vs_baseline_pct'] == pytest.approx(
      100 * (rows[0]['final_val_loss'] / rows[1]['final_val_loss'] - 1))
  assert rows[0]['state_bytes'] < rows[1]['state_bytes']
  md = (tmp_path / 'qs.md').read_text()
  assert md.strip() in capsys.readouterr().out
  assert f'| {rows[0]["final_val_loss"]:.4f} |' in md
  saved = json.loads((tmp_path / 'qs.json').read_text())
  assert [r['final_val_loss'] for r in saved['rows']] == pytest.approx(
      [r['final_val_loss'] for r in rows])
  assert [r['candidate'] for r in saved['runs']] == [r['candidate'] for r in rows]
