"""`import skewadam_jax` stays light: no optional heavy package is imported with it.

Flax boxes are detected only when Flax is already loaded (`structure/boxes.py` reads
`sys.modules`), Orbax is the checkpoint examples', matplotlib the reports' plots, and
`jax.extend` (which imports Pallas) is imported when the first step is traced.
benchmarks/import_time.py measures the time.
"""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

ROOT = Path(__file__).resolve().parents[1]
NOT_ON_IMPORT = ('flax', 'orbax', 'matplotlib', 'equinox', 'jax.extend', 'jax._src.pallas',
                 'tqdm')


def _loaded_after(code: str) -> dict[str, list[str]]:
  """For each of `NOT_ON_IMPORT`, its modules in `sys.modules` after `code` runs in a
  fresh interpreter (the repository first on the path)."""
  probe = (f'import json, sys; sys.path.insert(0, {str(ROOT)!r}); {code}; '
           f'print(json.dumps({{p: sorted(m for m in sys.modules if m == p or '
           f'm.startswith(p + ".")) for p in {NOT_ON_IMPORT!r}}}))')
  out = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True,
                       check=True, cwd=ROOT)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_loads_no_heavy_optional_package():
  loaded = _loaded_after('import skewadam_jax')
  assert {p: ms for p, ms in loaded.items() if ms} == {}


def test_flax_boxes_are_still_unboxed_when_flax_is_imported_first():
  code = ('import jax.numpy as jnp; from flax import nnx; import skewadam_jax as sj; '
          'p = {"w": nnx.Param(jnp.ones((4, 8)))}; '
          'assert sj.skewadam(1e-3).init(p) is not None')
  assert _loaded_after(code)['flax']


def test_a_traced_step_still_has_the_cpu_barriers():
  """The barrier primitives are made when the first step is traced (`jax.extend`
  imported then), and the step holds them as before."""
  code = ('import jax, jax.numpy as jnp; import skewadam_jax as sj; '
          'p = {"w": jnp.ones((4, 8))}; tx = sj.skewadam(1e-3); '
          'text = str(jax.make_jaxpr(tx.update)(p, tx.init(p), p)); '
          'assert "skewadam_cpu_barrier" in text and "skewadam_cpu_fusion_boundary" in text, '
          'text; jax.jit(tx.update)(p, tx.init(p), p)')
  assert _loaded_after(code)['jax.extend']
