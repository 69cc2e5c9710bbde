"""Multi-process training: two `jax.distributed` processes on localhost give the numbers
of one process.

tests/support/multihost_runs.py runs as two processes of 4 CPU devices each, joined by
`jax.distributed` with gloo collectives into one (2, 4) ('data', 'expert') mesh, and
as a single process of 8 devices on the same mesh (and on one device). The expert
stacks are sharded `P('expert', None, 'data')`, so SkewAdam's factored statistics
reduce across the two processes. Real multi-host code paths (the coordinator,
`make_array_from_callback` filling only local shards, `process_allgather`) that the
8-device single-process tests in tests/integrations/test_sharding.py never reach.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import multihost_runs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'tests' / 'support' / 'multihost_runs.py'
TIMEOUT_S = 240
NAMES = tuple(multihost_runs.OPTIMIZERS)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _launch(out: Path) -> None:
  """Starts the two distributed processes and the single-process run together; fails
  with their output if any exits non-zero or all have not finished in TIMEOUT_S."""
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)  # the script sets the device count itself
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
  port = str(_free_port())
  argvs = {'process 0': ['0', port], 'process 1': ['1', port], 'single': ['single', '-']}
  procs: dict[str, tuple[subprocess.Popen, Path]] = {}
  for label, args in argvs.items():
    log = out / f"{label.replace(' ', '_')}.log"
    with log.open('w') as f:
      procs[label] = (subprocess.Popen([sys.executable, str(SCRIPT), *args, str(out)],
                                       env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT),
                      log)
  deadline = time.monotonic() + TIMEOUT_S
  failed: list[str] = []
  try:
    while any(p.poll() is None for p, _ in procs.values()):
      failed = [label for label, (p, _) in procs.items() if p.poll() not in (None, 0)]
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.2)
    failed = [label for label, (p, _) in procs.items() if p.poll() != 0]
  finally:
    for p, _ in procs.values():
      if p.poll() is None:
        p.kill()
      p.wait()
  if failed:
    logs = '\n'.join(f'--- {label} (rc={procs[label][0].returncode}):\n'
                     + procs[label][1].read_text()[-6000:] for label in failed)
    pytest.fail(f'multi-host runs failed or timed out after {TIMEOUT_S} s:\n{logs}')


def _load(path: Path) -> dict[str, np.ndarray]:
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
  assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
  return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) if a[k].size else 0.0
             for k in a)


def _bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
  return a.keys() == b.keys() and all(
      a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.fixture(scope='module')
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
  out = tmp_path_factory.mktemp('multihost')
  _launch(out)
  return {
      'multi': json.loads((out / 'multi.json').read_text()),
      'single': json.loads((out / 'single.json').read_text()),
      **{f'{run}_{name}': _load(out / f'{run}_{name}.npz')
         for run in ('multi', 'single', 'one_device') for name in NAMES},
  }


@pytest.mark.slow
def test_two_processes_form_one_mesh_over_gloo(runs):
  info = runs['multi']
  assert info['process_count'] == 2
  assert info['device_count'] == 8 and info['local_device_count'] == 4
  assert info['collectives'] == 'gloo'
  assert info['data_rows_processes'] == [[0], [1]]  # `data` reductions cross processes
  assert runs['single']['process_count'] == 1 and runs['single']['device_count'] == 8
  for name in NAMES:
    assert info[f'multi_{name}_w1_local_shards'] == 4  # half of the 8 shards
    assert info[f'multi_{name}_w1_shard_shape'] == [1, 32, 32]
    assert info[f'multi_{name}_donated'] is True


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_two_processes_match_one_process(runs, name):
  multi, single = runs[f'multi_{name}'], runs[f'single_{name}']
  assert len(multi) > len(multihost_runs.LEAVES)  # params and every state leaf
  init = {'params' + k: v for k, v in multihost_runs.flat(multihost_runs.init_params()).items()}
  moved = _max_diff({k: multi[k] for k in init}, init)
  assert moved > 1e-2, moved  # the 5 steps really moved the params
  diff = _max_diff(multi, single)
  assert diff <= 1e-6, diff
  if name == 'adampm':  # pooled within shards: no cross-shard reduction at all
    assert _bitwise_equal(multi, single), diff
  # Unsharded on one device the reductions run in another order still.
  assert _max_diff(multi, runs[f'one_device_{name}']) <= 1e-6
