"""Helpers shared by the benchmarks: machine description, output files, tables."""

from __future__ import annotations

import json
import os
import platform
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
