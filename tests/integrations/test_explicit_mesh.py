"""Every preset on Explicit and Auto meshes: the update of one device, placed as the
parameter.

In-process, an Explicit mesh of the one CPU device reproduces the failures that
crashed the first update (the orthogonal estimator's reshape of a kernel sharded on
its heads, the Gram products of a matrix sharded on its contracting axis, the shared
Newton-Schulz buffer). `tests/support/mesh_runs.py` runs the same cases on a 2 x 4 Explicit mesh
of 8 simulated CPU devices (the orthogonal presets, which failed them), with the
straddle case, and the generator of
`mesh_cases.cases()` (1-8 devices, 1-3 axes, Explicit and Auto, random specs on expert
banks, scanned stacks, attention kernels, norms; every preset) in one subprocess: 20
cases in the fast tier, 200 more in the slow one. Bounds: `mesh_cases.ULPS` (factored,
pooled, exact statistics) and `mesh_cases.ORTHOGONAL_ULPS` (Newton-Schulz), in ulp of
each leaf's largest magnitude; with the bfloat16 iteration (a GPU's default, named in
the `muon_coded_bf16` preset) `mesh_cases.ORTHOGONAL_BF16_REL_FROBENIUS` per
orthogonalised leaf; codes equal. The same generator in the other modes
(`jax.set_mesh` over an Auto mesh, the update inside `jax.shard_map`), some of
them resumed from an Orbax checkpoint taken after the first step (bitwise equal to the
uninterrupted run): 4 cases in the fast tier, 60 in the slow one.
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
import ulp

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'tests' / 'support' / 'mesh_runs.py'
FAST_CASES, SLOW_CASES = 20, 200
FAST_MODES, SLOW_MODES = 4, 60


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


def _hidden_in_shard_map(spec: dict[str, P]):
  """`tx.update` of MUON_TIERS inside `jax.shard_map` on a 1-device mesh, the params at
  `spec` (default replicated): a hidden matrix `w: [16, 32]` and an expert bank
  `bank: [4, 16, 32]` (batch axis 0); the state at `sj.state_shardings`' specs."""
  mesh = jax.make_mesh((1,), ('y',), axis_types=(AxisType.Auto,))
  tx = sj.skewadam(1e-3, tiers=sj.MUON_TIERS, param_labels={'w': 'hidden', 'bank': 'experts'},
                   batch_axes={'w': (), 'bank': (0,)})
  specs = {'w': spec.get('w', P()), 'bank': spec.get('bank', P())}
  shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  rng = np.random.default_rng(0)
  params = jax.device_put({'w': rng.standard_normal((16, 32), np.float32),
                           'bank': rng.standard_normal((4, 16, 32), np.float32)}, shardings)
  state_sh = sj.state_shardings(tx, params, shardings)
  state = jax.jit(tx.init, out_shardings=state_sh)(params)
  s_specs = jax.tree.map(lambda sh: sh.spec, state_sh)
  update = jax.shard_map(tx.update, mesh=mesh, in_specs=(specs, s_specs, specs),
                         out_specs=(specs, s_specs))
  return jax.jit(update)(params, state, params)[0]


def test_shard_map_refuses_a_matrix_split_on_its_own_axes():
  # Newton-Schulz of a block is not the block of Newton-Schulz: the library says so
  # instead of returning the local block's polar factor.
  with pytest.raises(ValueError, match=r"w: inside shard_map this leaf varies over the "
                     r"manual mesh axes \['y'\].*its orthogonal update reduces over whole"):
    _hidden_in_shard_map({'w': P('y', None)})


def test_shard_map_runs_banks_split_on_experts_and_replicated_matrices():
  # Expert parallelism inside shard_map: the bank varies over 'y', so it is iterated on
  # its own (a Newton-Schulz buffer shared with `w` would make `w`'s update vary too, and
  # shard_map would refuse its replicated out_spec); `w` then leaves the shared buffer.
  want = _hidden_in_shard_map({})
  got = _hidden_in_shard_map({'bank': P('y', None, None)})
  for k in want:
    ulp.assert_within_ulp(np.asarray(got[k]), np.asarray(want[k]), np.float32,
                          ulps=mc.ORTHOGONAL_ULPS, err_msg=k)


def test_eight_devices_issue_cases_and_generated_meshes(tmp_path):
  report = _subprocess(tmp_path, 'fast', str(FAST_CASES), str(FAST_MODES), '0')
  assert report['devices'] == 8
  issue = report['issue']
  errors = {k: v['error'] for k, v in issue.items() if 'error' in v}
  assert not errors, errors
  assert issue['straddle/muon_coded']['straddle']
  ran = {k for k, v in issue.items() if not v['straddle']}
  assert {f'{c}/{p}' for c in ('reshape', 'contracting', 'shared_buffer')
          for p in mc.ORTHOGONAL} <= ran
  assert issue['contracting/muon_coded']['code_bytes'] > 0  # codes compared, equal
  _check_generated(report['cases'], FAST_CASES)
  modes = report['modes']
  assert len(modes) == FAST_MODES
  assert {c['mode'] for c in modes} <= {'set_mesh', 'shard_map'}


@pytest.mark.slow
def test_generated_meshes_slow(tmp_path):
  _check_generated(_subprocess(tmp_path, 'generate', str(SLOW_CASES), '1')['cases'], SLOW_CASES)


@pytest.mark.slow
def test_generated_modes_and_orbax_resume_slow(tmp_path):
  cases = _subprocess(tmp_path, 'modes', str(SLOW_MODES), '2')['cases']
  assert len(cases) == SLOW_MODES
  ran = [c for c in cases if not c['straddle'] and not c['refused']]
  # Each mode runs and matches one device; shard_map refuses some cases; resumed runs
  # (bitwise, checked in run_case) happen in both modes.
  assert {c['mode'] for c in ran} == {'set_mesh', 'shard_map'}
  assert any(c.get('refused') for c in cases)
  assert {c['mode'] for c in ran if c['resumed']} == {'set_mesh', 'shard_map'}
  inside = {c['preset'] for c in ran if c['mode'] == 'shard_map'}
  assert {'muon', 'muon_coded'} <= inside and len(inside) >= 3, inside


def _check_generated(cases: list[dict], n: int) -> None:
  assert len(cases) == n
  ran = [c for c in cases if not c['straddle']]
  # The generator reaches what it is for: both mesh types, several devices, every preset.
  assert {c['explicit'] for c in ran} == {True, False}
  assert max(c['devices'] for c in ran) >= 4
  assert {c['preset'] for c in ran} == set(mc.PRESETS)
  assert len(ran) >= n // 2, f'{n - len(ran)} of {n} cases straddled'
