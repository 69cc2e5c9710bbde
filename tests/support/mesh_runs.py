"""Explicit and Auto meshes of up to 8 simulated CPU devices, for test_explicit_mesh.py.

  python tests/support/mesh_runs.py issue OUT             # the three failures of Explicit meshes
  python tests/support/mesh_runs.py generate N SEED OUT   # N cases of mesh_cases.cases()
  python tests/support/mesh_runs.py both N SEED OUT       # both, in one process
  python tests/support/mesh_runs.py modes N SEED OUT      # N cases under jax.set_mesh (Auto) or
                                                  # inside shard_map, some resumed
                                                  # from an Orbax checkpoint
  python tests/support/mesh_runs.py fast N M SEED OUT     # issue, N of generate, M of modes

One process runs every case (compiling is most of the time; starting JAX once is the
rest). Each mode writes OUT/<mode>.json; `generate` fails (hypothesis prints the
falsifying case) on the first case whose sharded update differs from one device's.
"""

from __future__ import annotations

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                           + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import json  # noqa: E402
from pathlib import Path  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

import mesh_cases as mc  # noqa: E402  (beside this file)


def issue() -> dict:
  """The issue's cases on a 2 x 4 Explicit mesh, for the orthogonal presets that failed
  them (the others, and Auto meshes: `generate`)."""
  out = {}
  for name, case in mc.issue_cases((2, 4)).items():
    if case.preset not in mc.ORTHOGONAL:
      continue
    try:
      out[name] = mc.run_case(case)
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
      out[name] = {'error': f'{type(e).__name__}: {str(e)[:500]}'}
  return out


MODES = ('set_mesh', 'shard_map')  # the `modes` runner's (`generate`: jit)


def generate(n: int, seed: int, modes: tuple[str, ...] = ('jit',), resume: bool = False
             ) -> dict:
  """`n` generated cases, the presets' shares run one preset after the other (so that
  every preset runs whatever the draws, and a failing case is reported as it ran)."""
  from hypothesis import given, HealthCheck, Phase, seed as hseed, settings  # noqa: PLC0415
  done: list[dict] = []
  presets = sorted(mc.PRESETS)
  for i, preset in enumerate(presets):
    share = n // len(presets) + (i < n % len(presets))
    if not share:
      continue

    @hseed(seed)
    @settings(max_examples=share, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=mc.cases(modes=modes, resume=resume, presets=(preset,)))
    def check(case: mc.Case) -> None:
      start = time.perf_counter()
      result = mc.run_case(case)
      done.append({**result, 'preset': case.preset, 'explicit': case.explicit,
                   'mode': case.mode, 'resume': case.resume,
                   'devices': int(jax.numpy.prod(jax.numpy.array(case.mesh_shape))),
                   'axes': len(case.mesh_shape), 'seconds': time.perf_counter() - start})

    check()
  return {'cases': done}


def main(argv: list[str]) -> None:
  warnings.simplefilter('ignore')  # label warnings: the cases label every leaf on purpose
  mode, out = argv[0], Path(argv[-1])
  if mode == 'both':  # one process for the issue's cases and N generated
    result = {'issue': issue(), **generate(int(argv[1]), int(argv[2]))}
  elif mode == 'fast':  # the fast tier: the issue's cases, N generated, M in other modes
    result = {'issue': issue(), **generate(int(argv[1]), int(argv[3])),
              'modes': generate(int(argv[2]), int(argv[3]), MODES, resume=True)['cases']}
  elif mode == 'modes':
    result = generate(int(argv[1]), int(argv[2]), MODES, resume=True)
  else:
    result = issue() if mode == 'issue' else generate(int(argv[1]), int(argv[2]))
  result['devices'] = len(jax.devices())
  (out / f'{mode}.json').write_text(json.dumps(result, indent=1))


if __name__ == '__main__':
  main(sys.argv[1:])
