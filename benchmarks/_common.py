"""Helpers shared by the benchmarks: machine description, output files, tables."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'benchmarks' / 'results'
GIB = 1024**3

if str(ROOT) not in sys.path:  # `python benchmarks/x.py` from the repo root
  sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
  """The CPU model name from /proc/cpuinfo (or the platform string)."""
  try:
    for line in Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith('model name'):
        return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
  """CPU, cores (total and usable by this process), memory, library versions."""
  import flax
  import jax
  import jaxlib
  import numpy as np
  import optax

  try:
    mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError):
    mem = 0
  return {
      'cpu': cpu_model(),
      'cores': os.cpu_count(),
      'cores_usable': sorted(os.sched_getaffinity(0)),
      'memory_gib': round(mem / GIB, 1),
      'backend': jax.default_backend(),
      'devices': [str(d) for d in jax.devices()],
      'python': platform.python_version(),
      'versions': {'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
                   'optax': optax.__version__, 'flax': flax.__version__,
                   'numpy': np.__version__},
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
  }


def command() -> str:
  """The command line that ran this script (with a `taskset` note if pinned)."""
  cmd = 'python ' + ' '.join(shlex.quote(a) for a in sys.argv)
  usable, total = len(os.sched_getaffinity(0)), os.cpu_count()
  if usable < (total or usable):
    cores = ','.join(map(str, sorted(os.sched_getaffinity(0))))
    cmd = f'taskset -c {cores} {cmd}'
  return cmd


def write_json(path: Path, payload: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=2, default=str) + '\n')


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
  """`write_json`, but via a temporary file and `os.replace`.

  An interrupted write (Ctrl-C, a killed process) then leaves either the old file or
  the new one, never half a file that a resumable sweep would take for a finished run.
  """
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  tmp.write_text(json.dumps(payload, indent=1, default=str) + '\n')
  os.replace(tmp, path)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: str = '') -> str:
  """A GitHub markdown table; `align` is one char per column: 'l' or 'r' (default r)."""
  align = align or 'l' + 'r' * (len(header) - 1)
  sep = ['---' if a == 'l' else '---:' for a in align]
  lines = ['| ' + ' | '.join(map(str, header)) + ' |', '|' + '|'.join(sep) + '|']
  lines += ['| ' + ' | '.join(map(str, row)) + ' |' for row in rows]
  return '\n'.join(lines)


def machine_line(m: dict[str, Any]) -> str:
  """One line describing the machine and versions, for the top of a report."""
  v = m['versions']
  return (f"{m['cpu']}, {m['cores']} cores ({len(m['cores_usable'])} usable by this "
          f"process), {m['memory_gib']} GiB, backend {m['backend']}; jax {v['jax']}, "
          f"jaxlib {v['jaxlib']}, optax {v['optax']}, flax {v['flax']}")


def load_average() -> list[float]:
  """The machine's 1, 5 and 15 minute load averages (timings on a shared machine are
  only comparable within a run; the load says how noisy it was)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return [float('nan')] * 3


def init_on_float32(tx: Any) -> Any:
  """`params -> tx.init(params as float32)`: float32 optimizer state for any weights.

  The published AdamW baseline keeps float32 m and v for bf16 weights; optax's
  optimizers take their state's dtype from the parameters they are initialised on. Works
  under `jax.jit` (arrays) and `jax.eval_shape` (`ShapeDtypeStruct`s).
  """
  import jax
  import jax.numpy as jnp
  return lambda params: tx.init(jax.tree.map(lambda x: x.astype(jnp.float32), params))


# ------------------------------------------------------------------ compiled-HLO figures

_HLO_ITEMSIZE = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2,
                 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
_HLO_ARRAY = re.compile(r'\b(' + '|'.join(_HLO_ITEMSIZE) + r')\[([\d,]*)\]')
_HLO_INSTR = re.compile(r'\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$')
# Entry-computation instructions that launch no kernel and move no bytes.
_HLO_FREE = frozenset({'parameter', 'tuple', 'get-tuple-element', 'bitcast', 'constant',
                       'after-all', 'partition-id', 'replica-id', 'opt-barrier'})


_HLO_COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$')
# The computations an instruction runs: a loop's body and condition, a fusion's or an
# async op's callee, a reduction's combiner, a call's target.
HLO_CALLED = re.compile(r'(body|condition|calls|to_apply)=%?([\w.\-]+)')
HLO_CALLED_FUSION = re.compile(r'\bcalls=%?([\w.\-]+)')
# XLA's annotation of a `while` whose trip count it proved constant.
HLO_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def hlo_computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str]:
  """The computations of an HLO module's text, each as its parsed instructions.

  Returns:
    `({name: [(instruction, type, opcode, rest of the line), ...]}, entry's name)`.
  """
  comps: dict[str, list[tuple[str, str, str, str]]] = {}
  entry = current = None
  for line in hlo_text.split('\n'):
    if current is None:
      m = _HLO_COMPUTATION.match(line)
      if m:
        current = m.group(1)
        comps[current] = []
        if line.startswith('ENTRY'):
          entry = current
    elif line.startswith('}'):
      current = None
    else:
      m = _HLO_INSTR.match(line)
      if m:
        comps[current].append(m.groups())
  return comps, entry


def _hlo_type_bytes(type_text: str) -> int:
  total = 0
  for dtype, dims in _HLO_ARRAY.findall(type_text):
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    total += n * _HLO_ITEMSIZE[dtype]
  return total


def hlo_in_place_update(comps: dict[str, list[tuple[str, str, str, str]]], name: str
                        ) -> tuple[int, int] | None:
  """(operand index of the buffer, bytes of the update) of a fusion computation `name`
  whose root is a `dynamic-update-slice` into one of its parameters, else None.

  XLA runs such a fusion in place (its result shares the buffer's allocation, or a copy
  kernel of its own comes before it): it writes the updated slice and reads its other
  operands, not the whole buffer, as XLA's own cost analysis counts it.
  """
  insts = comps.get(name, [])
  if not insts or insts[-1][2] != 'dynamic-update-slice':  # the root is printed last
    return None
  types = {i: t for i, t, _, _ in insts}
  params = {i: int(re.match(r'(\d+)', rest).group(1))
            for i, _, op, rest in insts if op == 'parameter'}
  args = re.findall(r'%([\w.\-]+)', insts[-1][3])
  if len(args) < 2 or args[0] not in params:
    return None
  return params[args[0]], _hlo_type_bytes(types[args[1]])


def hlo_instruction_bytes(comps: dict[str, list[tuple[str, str, str, str]]],
                          sizes: dict[str, int], iname: str, rest: str) -> int:
  """Bytes one kernel (instruction `iname`, the rest of its line `rest`) reads and
  writes: its operands and its result, or for an in-place update
  (`hlo_in_place_update`) its other operands and the updated slice. `sizes` holds the
  byte size of every instruction before it in its computation."""
  operands = re.findall(r'%([\w.\-]+)', rest.split('), ', 1)[0])
  callee = HLO_CALLED_FUSION.search(rest)
  in_place = hlo_in_place_update(comps, callee.group(1)) if callee else None
  if in_place is None:
    return sizes[iname] + sum(sizes.get(a, 0) for a in operands)
  buffer, update = in_place
  return update + sum(sizes.get(a, 0) for i, a in enumerate(operands) if i != buffer)


def hlo_kernel_bytes(hlo_text: str) -> tuple[int, int]:
  """Bytes read and written by the kernels of a compiled module's entry computation.

  Every instruction of the optimised ENTRY computation that is not free (parameters,
  tuples, bitcasts, constants, barriers) is one kernel (a fusion, a library call, a
  copy) that reads each operand and writes its result once, but for a fusion that
  updates a slice of a buffer in place, which writes that slice alone
  (`hlo_instruction_bytes`). On the CPU this equals XLA's own
  `cost_analysis()['bytes accessed']` up to a few bytes (XLA counts a scalar operand
  once per use inside a fusion); a compile-only GPU executable has no cost analysis.
  Loops are counted once (the optimizer steps measured here have none).

  Returns:
    `(bytes, kernels)`.
  """
  comps, entry = hlo_computations(hlo_text)
  sizes: dict[str, int] = {}
  total = kernels = 0
  for iname, type_text, opcode, rest in comps[entry]:
    sizes[iname] = _hlo_type_bytes(type_text)
    if opcode in _HLO_FREE:
      continue
    total += hlo_instruction_bytes(comps, sizes, iname, rest)
    kernels += 1
  return total, kernels


GPU_SPECS = ROOT / 'benchmarks' / 'gpu_specs'


def compile_only_device(target: str = 'h200') -> Any:
  """A compile-only (deviceless) XLA:GPU device described by `gpu_specs/<target>.txtpb`.

  Needs JAX's CUDA plugin at jax's own version (`pip install "jax[cuda12]==<jax
  version>"`); no GPU, driver or CUDA install is needed. Programs lowered with a
  sharding on this device compile with XLA:GPU for that target, so their
  `memory_analysis()` and optimised HLO are what that GPU would run; they cannot execute.
  """
  os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')  # no driver to check
  import jax
  from jax.experimental import topologies

  spec = GPU_SPECS / f'{target}.txtpb'
  if not spec.exists():
    choices = sorted(p.stem for p in GPU_SPECS.glob('*.txtpb'))
    raise ValueError(f'`target` must be one of {choices}, got {target!r}.')
  try:
    topo = topologies.get_topology_desc(platform='cuda', topology_name=target,
                                        topology='1x1x1', target_config=spec.read_text())
  except (NotImplementedError, RuntimeError, ValueError) as e:
    raise RuntimeError(
        'A compile-only GPU target needs JAX\'s CUDA plugin at the same version as jax: '
        f'python -m pip install "jax[cuda12]=={jax.__version__}" (no GPU needed). '
        f'Original error: {e}') from e
  return topo.devices[0]


def muon_dims(params: Any) -> Any:
  """`optax.contrib.muon`'s dimension numbers for an MoE tree: every 2-D matrix, and a
  3-D stacked expert bank `[E, in, out]` as a batch of matrices; None (Muon's Adam
  branch) for the rest."""
  import jax
  from optax import contrib

  def dims(x):
    if x.ndim == 2:
      return contrib.MuonDimensionNumbers(0, 1)
    if x.ndim == 3:
      return contrib.MuonDimensionNumbers(1, 2)
    return None
  return jax.tree.map(dims, params)


def uncoded(tiers: Any, names: Sequence[str] = ()) -> dict[str, Any]:
  """`tiers` with the momentum of the tiers `names` (all if none named) in fp32: its
  `mu_codec` removed, the rest of each tier as it is. `uncoded(sj.MUON_CODED_TIERS)` is
  the coded policy's fp32 form, what its codes are measured against."""
  return {k: t.replace(mu_codec=None) if not names or k in names else t
          for k, t in tiers.items()}
