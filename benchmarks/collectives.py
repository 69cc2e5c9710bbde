"""Collectives of one optimizer step on an 8-device mesh, read from the compiled HLO.

For each layout of the parameters of a small MoE LM (`examples/moe_lm`'s model, 8
experts) over one mesh axis `x` of 8 simulated CPU devices, and each optimizer, the
jitted step `tx.update` + `optax.apply_updates` (params and state donated) is compiled
and the collectives of its optimised HLO are counted by kind, with their bytes:

* `fsdp`: every matrix sharded on its first matrix axis (rows; a bank `[E, d, f]` on
  `d`), 1-D leaves replicated;
* `tp`: every matrix sharded on its last axis (columns; a bank on `f`);
* `ep`: expert banks sharded on the expert axis, every other matrix as in `fsdp`.

A leaf whose axis does not divide by 8 stays replicated on it. Optimizers: SkewAdam with
`PUBLISHED_TIERS`, `MUON_TIERS` and `MUON_CODED_TIERS`, AdamPM (group 8), `optax.adamw`
and `optax.contrib.muon`; Muon is given the matrices that `MUON_TIERS` orthogonalises
(the hidden matrices and the expert banks, as batches of `[d, f]`) and runs Adam on the
rest, so both orthogonalise the same matrices. Meshes (`MESHES`): `explicit`, the
shardings in the arrays' types (`jax.jit(tx.init)` places the state), under
`jax.set_mesh`; `auto`, Auto axes with the state's shardings from `sj.state_shardings`
given to `jit` as in/out shardings, under `jax.set_mesh`; `auto-unset`, the same
without a mesh in context (the library then cannot name the mesh).

How collectives are counted: every instruction whose opcode is a collective (or its
asynchronous `-start`; a `-done` is not counted again) in the ENTRY computation and in
every computation it calls (`call`, `conditional` branches, async wrappers). A `while`
counts its body and condition `known_trip_count` times, the trip count XLA proved
constant and wrote into the loop's backend config; a loop without one is counted once
and listed in the JSON (`loops_without_trip_count`). Bytes per op: the larger of its
operands' and its result's bytes on one device (the gathered result of an all-gather,
the reduced array of an all-reduce, the input of a reduce-scatter).

The goals (checked in the table): the Muon presets move no more collective bytes than
`optax.contrib.muon`, and gather each sharded orthogonalised leaf at most once per step
(all-gathers: at most one per such leaf, their bytes at most those leaves' float32
bytes).

  python benchmarks/collectives.py                          # every layout and optimizer
  python benchmarks/collectives.py --config tiny --layouts fsdp --optimizers skewadam-muon
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import re
import time
from typing import Any

import _common
from _common import RESULTS

KINDS = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')
LAYOUTS = ('fsdp', 'tp', 'ep')
MESHES = ('explicit', 'auto', 'auto-unset')
MESH_TITLES = {'explicit': 'Explicit mesh (jax.set_mesh)',
               'auto': 'Auto mesh, set in context (jax.set_mesh)',
               'auto-unset': 'Auto mesh, jit shardings only (no mesh in context)'}
OPTIMIZERS = ('adamw', 'muon', 'skewadam', 'skewadam-muon', 'skewadam-muon-coded', 'adampm')
MUON_PRESETS = ('skewadam-muon', 'skewadam-muon-coded')
LABELS = {'adamw': 'optax.adamw', 'muon': 'optax.contrib.muon',
          'skewadam': 'SkewAdam (PUBLISHED_TIERS)', 'skewadam-muon': 'SkewAdam (MUON_TIERS)',
          'skewadam-muon-coded': 'SkewAdam (MUON_CODED_TIERS)', 'adampm': 'AdamPM (s = 8)'}
# 'small' is the CPU demo's model with 8 experts (one per device under `ep`); 'tiny' the
# unit tests' model, for the test that keeps this script running.
CONFIGS = {'small': {'n_experts': 8}, 'tiny': {'n_experts': 8}}
DEVICES = 8
_OP_NAME = re.compile(r'op_name="([^"]*)"')


# ------------------------------------------------------------------------ counting


def hlo_collectives(hlo_text: str) -> dict[str, Any]:
  """Collectives of a compiled module per kind, loops unrolled (see the module doc).

  Returns:
    `{kind: {'count', 'bytes'}}` for every kind of `KINDS`, plus `'ops'` (each
    collective: kind, times per step, bytes per run, result type, op_name) and
    `'loops_without_trip_count'`.
  """
  comps, entry = _common.hlo_computations(hlo_text)
  out: dict[str, Any] = {k: {'count': 0, 'bytes': 0} for k in KINDS}
  ops: list[dict[str, Any]] = []
  unknown: list[str] = []

  def walk(name: str, times: int) -> None:
    sizes: dict[str, int] = {}
    for iname, type_text, opcode, rest in comps.get(name, ()):
      sizes[iname] = _common._hlo_type_bytes(type_text)
      kind = opcode[:-len('-start')] if opcode.endswith('-start') else opcode
      called = _common.HLO_CALLED.findall(rest)
      if kind in KINDS:
        operands = re.findall(r'%([\w.\-]+)', rest.split('), ', 1)[0])
        moved = sum(sizes.get(a, 0) for a in operands)
        result = sizes[iname] - (moved if opcode.endswith('-start') else 0)
        nbytes = max(moved, result)
        out[kind]['count'] += times
        out[kind]['bytes'] += times * nbytes
        op_name = _OP_NAME.search(rest)
        ops.append({'kind': kind, 'times': times, 'bytes': nbytes, 'type': type_text,
                    'op_name': op_name.group(1) if op_name else ''})
      elif opcode == 'while':
        trip = _common.HLO_TRIP.search(rest)
        if trip is None:
          unknown.append(iname)
        n = int(trip.group(1)) if trip else 1
        for _, callee in called:
          walk(callee, times * n)
      elif opcode in ('call', 'conditional', 'async-start'):
        for _, callee in called:
          walk(callee, times)
        for callee in re.findall(r'branch_computations=\{([^}]*)\}', rest):
          for c in re.findall(r'%?([\w.\-]+)', callee):
            walk(c, times)

  walk(entry, 1)
  out['ops'] = ops
  out['loops_without_trip_count'] = unknown
  return out


# ------------------------------------------------------------------------ the step


def param_tree(config: str) -> dict[str, Any]:
  """The model's parameters as a flat dict of float32 `ShapeDtypeStruct`s by path."""
  import jax
  import jax.numpy as jnp

  from examples.moe_lm.model import _param_leaves, abstract_params, get_config
  cfg = get_config(config, **CONFIGS[config])
  return {p: jax.ShapeDtypeStruct(x.shape, jnp.float32)
          for p, x in _param_leaves(abstract_params(cfg))}


def orthogonalised(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
  """The leaves `MUON_TIERS` orthogonalises, with their batch axes (from its label table)."""
  import skewadam_jax as sj
  table = sj.label_table(sj.skewadam(1e-3, tiers=sj.MUON_TIERS), params)
  return {r.path: tuple(r.batch_axes) for r in table.rows if r.second_moment == 'orthogonal'}


def spec(layout: str, path: str, shape: tuple[int, ...], banks: set[str]) -> tuple[Any, ...]:
  """The PartitionSpec entries of one leaf under `layout` (module doc)."""
  entries: list[Any] = [None] * len(shape)
  if len(shape) < 2:
    return tuple(entries)
  if layout == 'ep' and path in banks:
    axis = 0
  elif layout == 'tp':
    axis = len(shape) - 1
  else:
    axis = len(shape) - 2
  if shape[axis] % DEVICES == 0:
    entries[axis] = 'x'
  return tuple(entries)


def _optimizer(name: str, params: dict[str, Any], hidden: dict[str, tuple[int, ...]]):
  import optax
  from optax import contrib
  import skewadam_jax as sj
  lr, wd = 3e-4, 0.1

  def muon():
    dims = {p: (contrib.MuonDimensionNumbers(len(x.shape) - 2, len(x.shape) - 1)
                if p in hidden else None) for p, x in params.items()}
    return contrib.muon(lr, weight_decay=wd, muon_weight_dimension_numbers=dims)

  return {'adamw': lambda: optax.adamw(lr, weight_decay=wd),
          'muon': muon,
          'skewadam': lambda: sj.skewadam(lr, weight_decay=wd),
          'skewadam-muon': lambda: sj.skewadam(lr, weight_decay=wd, tiers=sj.MUON_TIERS),
          'skewadam-muon-coded': lambda: sj.skewadam(lr, weight_decay=wd,
                                                     tiers=sj.MUON_CODED_TIERS),
          'adampm': lambda: sj.adampm(lr, weight_decay=wd, group_size=8)}[name]()


def compiled_step(tx: Any, params: dict[str, Any], specs: dict[str, tuple[Any, ...]],
                  mesh_type: str) -> str:
  """The optimised HLO text of the donated step `tx.update` + `apply_updates` on the
  8-device mesh (`mesh_type`, one of `MESHES`), params and gradients placed by `specs`."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import optax
  import skewadam_jax as sj

  explicit = mesh_type == 'explicit'
  in_context = mesh_type != 'auto-unset'
  kind = AxisType.Explicit if explicit else AxisType.Auto
  mesh = jax.make_mesh((DEVICES,), ('x',), axis_types=(kind,),
                       devices=jax.devices()[:DEVICES])
  p_sh = {k: NamedSharding(mesh, P(*s)) for k, s in specs.items()}

  def step(p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  zeros = jax.device_put({k: jnp.zeros(x.shape, x.dtype) for k, x in params.items()}, p_sh)
  if explicit:
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(zeros)
      return jax.jit(step, donate_argnums=(0, 2)).lower(zeros, zeros, state).compile().as_text()
  s_sh = sj.state_shardings(tx, params, p_sh)
  state = jax.jit(tx.init, out_shardings=s_sh)(zeros)
  jitted = jax.jit(step, in_shardings=(p_sh, p_sh, s_sh), out_shardings=(p_sh, s_sh),
                   donate_argnums=(0, 2))
  if not in_context:
    return jitted.lower(zeros, zeros, state).compile().as_text()
  with jax.set_mesh(mesh):
    return jitted.lower(zeros, zeros, state).compile().as_text()


def measure(config: str, layouts=LAYOUTS, meshes=MESHES, optimizers=OPTIMIZERS,
            progress: bool = True) -> list[dict[str, Any]]:
  """One record per (layout, mesh, optimizer): the collectives, or the error raised."""
  from tqdm import tqdm

  params = param_tree(config)
  hidden = orthogonalised(params)
  banks = {p for p, axes in hidden.items() if axes}
  jobs = [(lay, m, o) for lay in layouts for m in meshes for o in optimizers]
  records = []
  for layout, mesh, opt in tqdm(jobs, disable=not progress, desc='compile'):
    specs = {p: spec(layout, p, x.shape, banks) for p, x in params.items()}
    # A sharded orthogonalised leaf: one with a sharded matrix axis (not a batch axis).
    sharded = {p: 4 * int(_size(params[p].shape)) for p, axes in hidden.items()
               if any(e is not None and a not in axes for a, e in enumerate(specs[p]))}
    record: dict[str, Any] = {'layout': layout, 'mesh': mesh, 'optimizer': opt,
                              'sharded_hidden_leaves': len(sharded),
                              'sharded_hidden_bytes': sum(sharded.values())}
    start = time.perf_counter()
    try:
      text = compiled_step(_optimizer(opt, params, hidden), params, specs,
                           mesh)
    except Exception as e:  # noqa: BLE001 - the error is the record's result
      record['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:300]}'
    else:
      record.update(hlo_collectives(text))
      record['total_bytes'] = sum(record[k]['bytes'] for k in KINDS)
      record['total_count'] = sum(record[k]['count'] for k in KINDS)
    record['compile_s'] = round(time.perf_counter() - start, 2)
    records.append(record)
  _add_goals(records)
  return records


def _size(shape: tuple[int, ...]) -> int:
  n = 1
  for d in shape:
    n *= d
  return n


def _add_goals(records: list[dict[str, Any]]) -> None:
  """Marks each Muon preset's record with the two goals (module doc): `goal_bytes` (no
  more bytes than optax.contrib.muon on the same layout; on the same mesh type, or on
  the Auto mesh where Muon does not compile, named in `goal_bytes_against`; None where
  no Muon record compiled) and `goal_one_gather`."""
  muon = {(r['layout'], r['mesh']): r for r in records
          if r['optimizer'] == 'muon' and 'error' not in r}
  for r in records:
    if r['optimizer'] not in MUON_PRESETS or 'error' in r:
      continue
    against = r['mesh'] if (r['layout'], r['mesh']) in muon else 'auto'
    ref = muon.get((r['layout'], against))
    r['goal_bytes'] = None if ref is None else r['total_bytes'] <= ref['total_bytes']
    r['goal_bytes_against'] = None if ref is None else against
    gathers = r['all-gather']
    r['goal_one_gather'] = (gathers['count'] <= r['sharded_hidden_leaves']
                            and gathers['bytes'] <= r['sharded_hidden_bytes'])


# ------------------------------------------------------------------------ report


def table(records: list[dict[str, Any]]) -> str:
  """The markdown table: per layout, mesh and optimizer, count / bytes of each kind."""
  short = {'all-gather': 'all-gather', 'all-reduce': 'all-reduce',
           'reduce-scatter': 'reduce-scatter', 'all-to-all': 'all-to-all',
           'collective-permute': 'permute'}
  header = (['layout', 'mesh', 'optimizer'] + [f'{short[k]} n / bytes' for k in KINDS]
            + ['total bytes', 'goals (bytes, one gather)'])
  rows = []
  for r in records:
    if 'error' in r:
      rows.append([r['layout'], r['mesh'], LABELS[r['optimizer']]] + ['-'] * len(KINDS)
                  + ['-', f"error: {r['error'][:80]}"])
      continue
    goals = ''
    if 'goal_bytes' in r:
      mark = {True: 'met', False: 'NOT met', None: 'n/a'}
      versus = r['goal_bytes_against']
      versus = f' (vs {versus})' if versus not in (None, r['mesh']) else ''
      goals = f"{mark[r['goal_bytes']]}{versus}, {mark[r['goal_one_gather']]}"
    rows.append([r['layout'], r['mesh'], LABELS[r['optimizer']]]
                + [f"{r[k]['count']} / {r[k]['bytes']:,}" for k in KINDS]
                + [f"{r['total_bytes']:,}", goals])
  return _common.markdown_table(header, rows, 'lll' + 'r' * (len(KINDS) + 1) + 'l')


def plot(records: list[dict[str, Any]], path) -> None:
  """Grouped bars: total collective bytes per layout (one panel per mesh type)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  meshes = [m for m in MESHES if any(r['mesh'] == m for r in records)]
  layouts = [lay for lay in LAYOUTS if any(r['layout'] == lay for r in records)]
  opts = [o for o in OPTIMIZERS if any(r['optimizer'] == o for r in records)]
  fig, axes = plt.subplots(1, len(meshes), figsize=(6.5 * len(meshes), 4.5), sharey=True,
                           squeeze=False)
  width = 0.8 / len(opts)
  for ax, mesh in zip(axes[0], meshes):
    for i, opt in enumerate(opts):
      vals = []
      for lay in layouts:
        r = next((r for r in records if (r['layout'], r['mesh'], r['optimizer'])
                  == (lay, mesh, opt)), None)
        vals.append(np.nan if r is None or 'error' in r else max(r['total_bytes'], 1))
      xs = np.arange(len(layouts)) + (i - (len(opts) - 1) / 2) * width
      ax.bar(xs, vals, width, label=LABELS[opt])
      for x, v in zip(xs, vals):
        if np.isnan(v):
          ax.text(x, 1, 'error', rotation=90, ha='center', va='bottom', fontsize=7)
    ax.set_xticks(range(len(layouts)), layouts)
    ax.set_yscale('log')
    ax.set_title(MESH_TITLES[mesh])
    ax.grid(axis='y', alpha=0.3)
  axes[0][0].set_ylabel('collective bytes per step and device (log; 1 = none)')
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='lower center', ncol=len(opts), fontsize=8)
  fig.suptitle('Collectives of one optimizer step (update + apply), compiled HLO')
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='small', choices=sorted(CONFIGS))
  parser.add_argument('--layouts', nargs='+', default=list(LAYOUTS), choices=LAYOUTS)
  parser.add_argument('--meshes', nargs='+', default=list(MESHES), choices=MESHES)
  parser.add_argument('--optimizers', nargs='+', default=list(OPTIMIZERS), choices=OPTIMIZERS)
  parser.add_argument('--out', default='collectives', help='<results>/<out>.{json,md,png}')
  parser.add_argument('--results', default=str(RESULTS), help='the folder written to')
  args = parser.parse_args(argv)
  results = Path(args.results)
  records = measure(args.config, args.layouts, args.meshes, args.optimizers)
  md = table(records)
  print(md)
  payload = {'command': _common.command(), 'machine': _common.machine(),
             'config': args.config, 'records': records}
  _common.write_json(results / f'{args.out}.json', payload)
  (results / f'{args.out}.md').write_text(
      f'{_common.machine_line(payload["machine"])}\n\n`{payload["command"]}`\n\n{md}\n')
  plot(records, results / f'{args.out}.png')
  print(f'wrote {results}/{args.out}.{{json,md,png}}')


if __name__ == '__main__':
  # Before JAX starts (every JAX import here is inside a function): 8 CPU devices.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                             + ' --xla_force_host_platform_device_count=8').strip()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  main()
