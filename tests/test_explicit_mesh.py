"""Every preset on Explicit and Auto meshes: the update of one device, placed as the
parameter.

In-process, an Explicit mesh of the one CPU device reproduces the failures that
crashed the first update (the orthogonal estimator's reshape of a kernel sharded on
its heads, the Gram products of a matrix sharded on its contracting axis, the shared
Newton-Schulz buffer). `tests/mesh_runs.py` runs the same cases on a 2 x 4 Explicit mesh
of 8 simulated CPU devices (the orthogonal presets, which failed them), with the
straddle case, and the generator of
`mesh_cases.cases()` (1-8 devices, 1-3 axes, Explicit and Auto, random specs on expert
banks, scanned stacks, attention kernels, norms; every preset) in one subprocess: 20
cases in the fast tier, 200 more in the slow one. Bounds: `mesh_cases.ULPS` (factored,
pooled, exact statistics) and `mesh_cases.ORTHOGONAL_ULPS` (Newton-Schulz), in ulp of
each leaf's largest magnitude; codes equal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import mesh_cases as mc
import skewadam_jax as sj

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'tests' / 'mesh_runs.py'
FAST_CASES, SLOW_CASES = 20, 200


def _subprocess(tmp_path: Path, *args: str) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([sys.executable, str(SCRIPT), *args, str(tmp_path)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=3000)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return json.loads((tmp_path / f'{args[0]}.json').read_text())


ONE_DEVICE = {k: c for k, c in mc.issue_cases((1,)).items() if not k.startswith('straddle')}


@pytest.mark.parametrize('name', sorted(ONE_DEVICE))
def test_one_device_explicit_mesh_matches_no_mesh(name):
  result = mc.run_case(ONE_DEVICE[name])
  assert not result['straddle'], name  # one shard never splits a block


def test_issue_attention_kernel_update_keeps_its_sharding():
  # The issue's first reproduction, as a user writes it: q [32, 4, 8] at P(None, 'y', None).
  mesh = jax.make_mesh((1,), ('y',), axis_types=(AxisType.Explicit,))
  tx = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS, param_labels={'q': 'hidden'},
                   batch_axes={'q': ()})
  with jax.set_mesh(mesh):
    q = {'q': jax.device_put(np.ones((32, 4, 8), np.float32),
                             NamedSharding(mesh, P(None, 'y', None)))}
    state = jax.jit(tx.init)(q)
    updates, _ = jax.jit(tx.update)(q, state, q)
  assert updates['q'].sharding.spec == P(None, 'y', None)
  assert np.all(np.isfinite(np.asarray(updates['q'])))


def test_eight_devices_issue_cases_and_generated_meshes(tmp_path):
  report = _subprocess(tmp_path, 'both', str(FAST_CASES), '0')
  assert report['devices'] == 8
  issue = report['issue']
  errors = {k: v['error'] for k, v in issue.items() if 'error' in v}
  assert not errors, errors
  assert issue['straddle/muon_coded']['straddle']
  ran = {k for k, v in issue.items() if not v['straddle']}
  assert {f'{c}/{p}' for c in ('reshape', 'contracting', 'shared_buffer')
          for p in ('muon', 'muon_coded')} <= ran
  assert issue['contracting/muon_coded']['code_bytes'] > 0  # codes compared, equal
  _check_generated(report['cases'], FAST_CASES)


@pytest.mark.slow
def test_generated_meshes_slow(tmp_path):
  _check_generated(_subprocess(tmp_path, 'generate', str(SLOW_CASES), '1')['cases'], SLOW_CASES)


def _check_generated(cases: list[dict], n: int) -> None:
  assert len(cases) == n
  ran = [c for c in cases if not c['straddle']]
  # The generator reaches what it is for: both mesh types, several devices, every preset.
  assert {c['explicit'] for c in ran} == {True, False}
  assert max(c['devices'] for c in ran) >= 4
  assert {c['preset'] for c in ran} == set(mc.PRESETS)
  assert len(ran) >= n // 2, f'{n - len(ran)} of {n} cases straddled'
