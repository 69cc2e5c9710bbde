"""A checkpoint that says what wrote it and whether its files are intact.

Orbax's metadata gives a checkpoint's shapes and dtypes, not what the arrays mean: a
coded momentum saved under one codec mapping reads as noise under another of the same
bits and block size, and nothing in the tree tells them apart. Nor does Orbax check
the bytes it reads: a flipped byte in an array file restores silently.

`seal_checkpoint(path, description)`, called once the save is complete, writes into
the checkpoint directory

* `skewadam_state.json`: `describe_state(tx, params)`, what the optimizer gives each
  parameter (its shape, tier, second-moment estimator with all its parameters, and
  the codec of its momentum: bits, block size, mapping, fit, rounding, min size);
* `integrity.sha256.json`: the size and sha256 of every file (every array's bytes lie
  in them), written last and atomically, so a checkpoint without it is unsealed.

`check_checkpoint(path)`, called before restoring, verifies every file against the
manifest (a ValueError `damaged: <file> ...` for a file missing, truncated or with
other bytes) and returns the saved description, which `check_checkpoint_matches(...,
description=..., saved_description=...)` compares with this optimizer's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from skewadam_jax.reports import trace as _trace
from skewadam_jax.structure import boxes as _boxes

MANIFEST = 'integrity.sha256.json'
DESCRIPTION = 'skewadam_state.json'
FORMAT = 'skewadam_jax.state_description.v1'
# Orbax's CheckpointManager rewrites a step's metadata (timestamps) after the files are
# final: it holds no arrays, and is only required to be JSON.
UNHASHED = ('_CHECKPOINT_METADATA',)
# Fields of a bound estimator or codec that are not options: the leaf's shape is
# compared on its own (a parameter of another shape is not another codec).
_NOT_OPTIONS = ('shape',)


def _jsonable(x: Any) -> Any:
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return describe_object(x)
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  if isinstance(x, np.generic):
    return x.item()
  try:
    return str(np.dtype(x))
  except TypeError:
    return repr(x)


def describe_object(obj: Any) -> Optional[dict[str, Any]]:
  """An estimator's or codec's type and options as JSON values (None for None)."""
  if obj is None:
    return None
  out: dict[str, Any] = {'type': type(obj).__name__}
  if dataclasses.is_dataclass(obj):
    for f in dataclasses.fields(obj):
      if f.compare and f.name not in _NOT_OPTIONS:
        out[f.name] = _jsonable(getattr(obj, f.name))
  else:
    out['repr'] = repr(obj)
  return out


def describe_state(tx: Any, params: Any) -> dict[str, Any]:
  """What the `skewadam` in `tx` gives each parameter, as JSON values; nothing allocated.

  Args:
    tx: the optimizer (a `skewadam` anywhere inside it; other optimizers describe no
      parameter, their state's shapes say what they are).
    params: the params (arrays or `jax.ShapeDtypeStruct`s).

  Returns:
    `{'format': ..., 'params': {path: {'shape', 'tier', 'second_moment', 'mu_codec'}}}`,
    the estimator and the codec as `{'type': class name, option: value, ...}` (the
    codec None for a momentum stored as an array).
  """
  trace = _trace.trace_init(tx, params)
  shapes = dict(zip(trace.paths, (tuple(getattr(p, 'shape', ())) for p in
                                  _leaves(params))))
  out = {}
  for path, rec in trace.tiers.items():
    out[path] = {'shape': list(shapes.get(path, ())), 'tier': rec.tier,
                 'second_moment': describe_object(rec.estimator),
                 'mu_codec': describe_object(rec.codec)}
  return json.loads(json.dumps({'format': FORMAT, 'params': out}))


def _leaves(params: Any) -> list[Any]:
  return jax.tree.leaves(_boxes.unbox(params))


def _option_diffs(ours: Optional[dict], theirs: Optional[dict]) -> str:
  if ours is None or theirs is None:
    return (f'checkpoint {"none" if theirs is None else theirs["type"]}, optimizer '
            f'{"none" if ours is None else ours["type"]}')
  keys = list(dict.fromkeys([*theirs, *ours]))
  return ', '.join(f'{k} checkpoint {theirs.get(k)!r}, optimizer {ours.get(k)!r}'
                   for k in keys if theirs.get(k) != ours.get(k))


def description_mismatches(description: dict[str, Any], saved: dict[str, Any]
                           ) -> dict[str, list[str]]:
  """`{parameter path: what differs}` between two `describe_state` results (parameters
  on one side only are left to the tree's comparison)."""
  ours, theirs = description.get('params', {}), saved.get('params', {})
  out: dict[str, list[str]] = {}
  for path, mine in ours.items():
    other = theirs.get(path)
    if other is None:
      continue
    what = []
    if mine['shape'] != other['shape']:
      what.append(f'its shape differs: checkpoint {tuple(other["shape"])}, optimizer '
                  f'{tuple(mine["shape"])}')
    if mine['tier'] != other['tier']:
      what.append(f'its tier differs: checkpoint {other["tier"]!r}, optimizer '
                  f'{mine["tier"]!r}')
    if mine['mu_codec'] != other['mu_codec']:
      what.append("its momentum's codec differs: " + _option_diffs(mine['mu_codec'],
                                                                  other['mu_codec']))
    if mine['second_moment'] != other['second_moment']:
      what.append('its second-moment estimator differs: '
                  + _option_diffs(mine['second_moment'], other['second_moment']))
    if what:
      out[path] = what
  return out


# ------------------------------------------------------------------------ integrity


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with path.open('rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
  tmp = path.with_name(path.name + '.tmp')
  with tmp.open('w') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)  # readers see no file or the whole one


def seal_checkpoint(path: str | os.PathLike[str],
                    description: Optional[dict[str, Any]] = None) -> None:
  """Writes the description (if given) and the integrity manifest into a checkpoint.

  Call it after the save is complete (`StandardCheckpointer.wait_until_finished()`),
  once, in one process.

  Args:
    path: the checkpoint directory (every file under it is hashed).
    description: `describe_state(tx, params)` of the optimizer that wrote it.

  Example:
    >>> ckptr.save(path, {'params': params, 'opt_state': opt_state})  # doctest: +SKIP
    >>> ckptr.wait_until_finished()  # doctest: +SKIP
    >>> sj.seal_checkpoint(path, sj.describe_state(tx, params))  # doctest: +SKIP
  """
  path = Path(path)
  if not path.is_dir():
    raise ValueError(f'`path` of sj.seal_checkpoint must be a checkpoint directory; {path} '
                     'is not one (seal it after the save has finished).')
  if description is not None:
    if description.get('format') != FORMAT:
      raise ValueError('`description` of sj.seal_checkpoint must be '
                       '`sj.describe_state(tx, params)`, got a dict without its format.')
    _write_atomically(path / DESCRIPTION, json.dumps(description, indent=0))
  files = {p.relative_to(path).as_posix(): {'bytes': p.stat().st_size, 'sha256': _sha256(p)}
           for p in sorted(path.rglob('*'))
           if p.is_file() and p.name != MANIFEST and p.name not in UNHASHED
           and not p.name.endswith('.tmp')}
  _write_atomically(path / MANIFEST, json.dumps({'files': files}, indent=0))


def checkpoint_damage(path: str | os.PathLike[str]) -> Optional[str]:
  """Why the checkpoint's files are not those sealed (`damaged: <file> ...`), or None."""
  path = Path(path)
  try:
    files = json.loads((path / MANIFEST).read_text())['files']
  except FileNotFoundError:
    return (f'damaged: {MANIFEST} is missing (not sealed by sj.seal_checkpoint after the '
            'save, or the save did not finish)')
  except (ValueError, KeyError, TypeError):
    return f'damaged: {MANIFEST} is unreadable (truncated or corrupted)'
  for name, want in files.items():
    file = path / name
    if not file.is_file():
      return f'damaged: {name} is missing'
    size = file.stat().st_size
    if size != want['bytes']:
      return f'damaged: {name} has {size} bytes, {want["bytes"]} were written (truncated?)'
    if _sha256(file) != want['sha256']:
      return f'damaged: {name} does not match its sha256 (corrupted bytes)'
  for file in sorted(path.rglob('*')):
    if file.name in UNHASHED and file.is_file():
      try:
        json.loads(file.read_text())
      except ValueError:
        return (f'damaged: {file.relative_to(path).as_posix()} is not valid JSON '
                '(truncated or corrupted)')
  return None


def check_checkpoint(path: str | os.PathLike[str]) -> Optional[dict[str, Any]]:
  """Verifies a sealed checkpoint's files; returns its description (None if none saved).

  Call it before restoring (every process may): it reads every file once.

  Args:
    path: the checkpoint directory `seal_checkpoint` sealed.

  Returns:
    The `describe_state` saved with it, for `check_checkpoint_matches(target, metadata,
    description=sj.describe_state(tx, params), saved_description=...)`.

  Raises:
    ValueError: `Checkpoint <path> is damaged: <file> ...`, a file missing (the
      manifest itself included), truncated or with other bytes than were written.
  """
  why = checkpoint_damage(path)
  if why is not None:
    raise ValueError(f'Checkpoint {path} is {why}; not restoring it.')
  try:
    return json.loads((Path(path) / DESCRIPTION).read_text())
  except FileNotFoundError:
    return None
