"""Run `sj.trace_structure` on the real MoE models that record.py builds; score it.

Run inside the virtualenv of ONE library (see README.md beside this file), from the
repository root, then (any Python with jax) rebuild the markdown from all results:

    $VENVS/gemma/bin/python tools/real_trees/trace_check.py --library gemma
    $VENVS/easydel/bin/python tools/real_trees/trace_check.py --library easydel
    $VENVS/maxtext/bin/python tools/real_trees/trace_check.py --library maxtext
    $VENVS/maxtext/bin/python tools/real_trees/trace_check.py --library maxtext \
        --override megablox=False    # jax.lax.ragged_dot instead of the Pallas kernel
    python tools/real_trees/trace_check.py --report

Every model is built as record.py builds it (record.py's config dicts, the same
constructor calls, abstractly: nothing is allocated), and `fn(params, tokens)` is the loss that the
library's trainer differentiates, on the same params tree that record.py records:

* gemma (kauldron trainer): `model.apply({'params': params}, tokens)` and a softmax
  cross-entropy on the logits;
* EasyDeL (`trainers/trainer/_fn.py`): `state.merge(tree)`, i.e. `nnx.merge(graphdef,
  params, graphother)`, then `module.compute_loss(labels=..., **prepare_inputs_for_call)`;
* MaxText NNX (`train.train_step`): `nnx.merge(graphdef, params, rest)` and
  `train.loss_fn(model, config, data, ...)`; the boxed Linen tree: `model.apply(
  variables, tokens, positions, ...)` and a cross-entropy.

The non-parameter state (RNG keys and counts) is passed abstractly as a further
argument. `sj.trace_structure(fn, params, tokens, ...)` runs on `jax.ShapeDtypeStruct`s
only, and each leaf's traced tier and batch axes are compared with the hand judgements in
`tests/data/real_trees/<library>_<model>.json`, matched by path (the README's paths;
`trace_structure` normalises them the same way: key strings joined with '/', the trailing
`value` dropped).

Writes `benchmarks/results/real_trees_traced/<library>[_<override>].json` and rebuilds
`benchmarks/results/real_trees_traced.md` from every library's JSON present.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import types
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import record  # noqa: E402  (sets JAX_PLATFORMS=cpu before jax is imported)

REPO = record.REPO
sys.path.insert(0, REPO)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import skewadam_jax as sj  # noqa: E402

DATA = record.DEFAULT_OUT
RESULTS = os.path.join(REPO, 'benchmarks', 'results')
JSON_DIR = os.path.join(RESULTS, 'real_trees_traced')
MARKDOWN = os.path.join(RESULTS, 'real_trees_traced.md')
COMMANDS = {
    'gemma': '$VENVS/gemma/bin/python tools/real_trees/trace_check.py --library gemma',
    'easydel': '$VENVS/easydel/bin/python tools/real_trees/trace_check.py --library easydel',
    'maxtext': '$VENVS/maxtext/bin/python tools/real_trees/trace_check.py --library maxtext',
}


class Case(types.SimpleNamespace):
  """One model to trace: `fn(params, *args)`, abstract `params` and `args`, a context."""
  fn: Callable[..., Any]
  params: Any
  args: tuple
  context: Any


def xent(logits: Any, tokens: Any) -> Any:
  """Mean next-token softmax cross-entropy (the trainers' language-model loss)."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


# --------------------------------------------------------------------------- builders


def gemma_case(name: str) -> Case:
  """gemma: record.py's model, `model.apply` on the Linen 'params' collection."""
  import dataclasses

  from gemma import gm
  from gemma.gm.nn.gemma4 import _modules

  spec = record.GEMMA_MODELS[name]
  attn = (_modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL)
  cfg = dataclasses.replace(gm.nn.Gemma4_26B_A4B.config, attention_types=attn,
                            vision_encoder=None, audio_encoder=None, **spec['config'])
  model = gm.nn.Gemma4_26B_A4B(config=cfg)
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))

  def fn(params, tokens):
    return xent(model.apply({'params': params}, tokens).logits, tokens)

  return Case(fn=fn, params=variables['params'], args=(tokens,),
              context=contextlib.nullcontext())


def easydel_case(name: str) -> Case:
  """EasyDeL: record.py's lazy model; the trainer's merge + compute_loss."""
  from flax import nnx

  spec = record.EASYDEL_MODELS[name]
  mod = importlib.import_module(f'easydel.modules.{spec["module"]}')
  cfg = getattr(mod, spec['config_cls'])(**{**record.ED_COMMON, **spec['config']})
  model = getattr(mod, spec['model_cls']).lazy_init(
      config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, precision=None,
      rngs=nnx.Rngs(0))
  graphdef, graphstate, graphother = model.split_module()

  def fn(params, tokens, other):
    module = model.merge_module(graphdef, params, other)  # EasyDeLState.merge(tree)
    batch = module.prepare_inputs_for_call(input_ids=tokens,
                                           attention_mask=jnp.ones_like(tokens))
    outputs, _ = module.compute_loss(labels=tokens, **batch)
    return outputs.loss

  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  return Case(fn=fn, params=graphstate, args=(tokens, graphother), context=model.mesh)


def maxtext_case(name: str, overrides: tuple[str, ...] = ()) -> Case:
  """MaxText: record.py's config and abstract model; `train.loss_fn` (or Linen apply).

  `overrides` ('key=value') are appended to record.py's command line (e.g.
  `megablox=False`: jax.lax.ragged_dot instead of the Pallas megablox kernel).
  """
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train
  from maxtext.utils import maxtext_utils, model_creation_utils
  from maxtext.utils.globals import MAXTEXT_PKG_DIR

  spec = record.MAXTEXT_MODELS[name]
  values = {**record.MT_COMMON, **spec['config']}
  argv = [None, os.path.join(MAXTEXT_PKG_DIR, 'configs', 'base.yml'),
          f'model_name={spec["model_name"]}', f'scan_layers={spec["scan"]}',
          'attention=dot_product', 'skip_jax_distributed_system=True',
          'override_model_config=True'] + [f'{k}={v}' for k, v in values.items()]
  config = pyconfig.initialize(argv + list(overrides))
  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
  shape = (config.micro_batch_size_to_train_on, config.max_target_length)
  tokens = jax.ShapeDtypeStruct(shape, jnp.int32)

  def batch(tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    ones = jnp.ones_like(tokens)
    return dict(inputs=tokens, inputs_position=positions, inputs_segmentation=ones,
                targets=tokens, targets_segmentation=ones)

  if spec.get('linen'):
    model = model_creation_utils.create_model(config, mesh)
    variables = maxtext_utils.get_abstract_param(model, config)

    def linen_fn(params, tokens):
      data = batch(tokens)
      logits, _ = model.apply(params, data['inputs'], data['inputs_position'],
                              decoder_segment_ids=data['inputs_segmentation'],
                              enable_dropout=False, mutable='intermediates')
      return xent(logits, tokens)

    return Case(fn=linen_fn, params=variables, args=(tokens,), context=mesh)

  _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def fn(params, tokens, rest):
    # train.train_step's diff_wrapper: merge, then loss_fn(local_model, config, data, ...).
    local_model = nnx.merge(graphdef, params, rest, copy=True)
    loss, _ = train.loss_fn(local_model, config, batch(tokens), None, None, is_train=True)
    return loss

  return Case(fn=fn, params=params, args=(tokens, rest), context=mesh)


CASES = {'gemma': gemma_case, 'easydel': easydel_case, 'maxtext': maxtext_case}


# --------------------------------------------------------------------------- scoring

# An installed package's file named from its site-packages directory on: the source
# lines in the evidence and undecided reasons, without the machine's paths.
SITE = re.compile(r'(?:/[^\s():"\']+)*/(?:site|dist)-packages/')


def portable(obj: Any) -> Any:
  """`obj` (JSON-able) with each installed file's path relative to its site-packages."""
  return json.loads(SITE.sub('', json.dumps(obj)))



def evidence_lines(structure: Any, paths: set[str]) -> list[str]:
  """`Structure.format()`'s header, the rows of `paths`, and its closing lines."""
  lines = structure.format().split('\n')
  n = len(structure.leaves)
  rows = lines[2:2 + n]
  keep = [row for row, leaf in zip(rows, structure.leaves) if leaf.path in paths]
  return (lines[:2] + keep if keep else []) + lines[2 + n:]


def score(library: str, name: str, overrides: tuple[str, ...] = ()) -> dict:
  """Traces one model and compares every leaf with its recorded judgement."""
  with open(os.path.join(DATA, f'{library}_{name}.json')) as f:
    expected = {leaf['path']: leaf for leaf in json.load(f)['leaves']}
  case = CASES[library](name, *([overrides] if overrides else []))
  row: dict[str, Any] = {'model': f'{library}_{name}' + ''.join(f' ({o})' for o in overrides),
                         'leaves': len(expected)}
  t0 = time.time()
  with case.context:
    structure = sj.trace_structure(case.fn, case.params, *case.args)
  row['trace_s'] = round(time.time() - t0, 1)
  traced = structure.by_path
  if set(traced) != set(expected):
    raise AssertionError(f'{row["model"]}: traced paths differ from the recorded ones: '
                         f'only traced {sorted(set(traced) - set(expected))}, only '
                         f'recorded {sorted(set(expected) - set(traced))}')
  wrong = []
  for path, want in expected.items():
    got = traced[path]
    bad_tier = got.tier != want['tier']
    bad_axes = tuple(got.batch_axes) != tuple(want['batch_axes'])
    if bad_tier or bad_axes:
      wrong.append({'path': path, 'shape': want['shape'],
                    'tier': [want['tier'], got.tier], 'batch_axes':
                    [want['batch_axes'], list(got.batch_axes)], 'wrong_tier': bad_tier,
                    'wrong_axes': bad_axes, 'evidence': got.evidence,
                    'undecided': structure.undecided.get(path)})
  # The hidden set a Muon policy takes from the trace, and the role of every backbone
  # leaf left out of it (embeddings, output layers, biases and gains, ...).
  hidden_labels = jax.tree_util.tree_leaves(structure.labels_for(sj.MUON_TIERS))
  hidden = [leaf.path for leaf, lab in zip(structure.leaves, hidden_labels) if lab == 'hidden']
  row['hidden'] = hidden
  row['backbone_not_hidden'] = {leaf.path: leaf.role for leaf, lab in
                                zip(structure.leaves, hidden_labels)
                                if lab == 'backbone'}
  row.update(
      right=len(expected) - len(wrong), wrong_tier=sum(w['wrong_tier'] for w in wrong),
      wrong_axes=sum(w['wrong_axes'] for w in wrong), undecided=len(structure.undecided),
      wrong=wrong, undecided_leaves=dict(structure.undecided),
      decisions=[f'{d.primitive} over E={d.num_experts}: router {", ".join(d.routers)}; '
                 f'experts {", ".join(d.experts)}' for d in structure.decisions],
      format=evidence_lines(structure, {w['path'] for w in wrong}))
  return portable(row)


def versions(library: str) -> dict[str, str]:
  out = {library: importlib.metadata.version(library)}
  extra = {'easydel': ['eformer'], 'gemma': ['kauldron'], 'maxtext': []}[library]
  for p in extra + ['jax', 'jaxlib', 'flax']:
    out[p] = importlib.metadata.version(p)
  out['python'] = '.'.join(map(str, sys.version_info[:3]))
  return out


def skewadam_revision() -> str:
  """The last commit that touched skewadam_jax/, and whether the tree differs from it."""
  def git(*a: str) -> subprocess.CompletedProcess:
    return subprocess.run(['git', '-C', REPO, *a], capture_output=True, text=True)
  rev = git('log', '-1', '--format=%h', '--', 'skewadam_jax').stdout.strip() or 'unknown'
  dirty = git('status', '--porcelain', '--', 'skewadam_jax').stdout.strip()
  return rev + (' (with uncommitted changes)' if dirty else '')


# --------------------------------------------------------------------------- report


def table(rows: list[dict], total: bool = False) -> list[str]:
  """The markdown table of `rows`, with an `all` row if `total`."""
  out = ['| model | leaves | traced right | wrong tier | wrong batch axes | undecided | note |',
         '| --- | ---: | ---: | ---: | ---: | ---: | --- |']
  for r in rows:
    if 'failed' in r:
      out.append(f'| {r["model"]} | {r["leaves"]} | - | - | - | - | failed: {r["failed"]} |')
      continue
    out.append(f'| {r["model"]} | {r["leaves"]} | {r["right"]} | {r["wrong_tier"]} | '
               f'{r["wrong_axes"]} | {r["undecided"]} |  |')
  if total:
    done = [r for r in rows if 'failed' not in r]
    t = {k: sum(r[k] for r in done)
         for k in ('leaves', 'right', 'wrong_tier', 'wrong_axes', 'undecided')}
    failed = len(rows) - len(done)
    out.append(f'| **all** | {t["leaves"]} | {t["right"]} | {t["wrong_tier"]} | '
               f'{t["wrong_axes"]} | {t["undecided"]} | '
               f'{f"{failed} of {len(rows)} models failed" if failed else ""} |')
  return out


def details(rows: list[dict]) -> list[str]:
  """Per model: its wrong leaves with the traced evidence, then `format()`'s excerpt."""
  lines = []
  for r in rows:
    if r.get('failed') or not (r['wrong'] or r['undecided']):
      continue
    lines += [f'#### {r["model"]}', '']
    if r['wrong']:
      lines += ['| leaf | shape | tier: recorded / traced | batch axes: recorded / traced '
                '| evidence |', '| --- | --- | --- | --- | --- |']
      for w in r['wrong']:
        lines.append(f'| `{w["path"]}` | {w["shape"]} | {w["tier"][0]} / {w["tier"][1]} | '
                     f'{w["batch_axes"][0]} / {w["batch_axes"][1]} | {w["evidence"]} |')
      lines.append('')
    lines += ['```'] + r['format'] + ['```', '']
  return lines


NOTES_MARK = '<!-- notes: kept when this file is rebuilt -->'


def hidden_sets(rows: list[dict[str, Any]]) -> list[str]:
  """Per model, the hidden matrices a Muon policy takes from the trace and the roles
  of the backbone leaves it leaves out."""
  if not any('hidden' in r for r in rows):
    return []
  out = ['### Hidden matrices from the trace (`trace.labels_for(sj.MUON_TIERS)`)', '',
         'The backbone leaves whose role is a hidden matrix (orthogonalised by a Muon '
         'policy), and the roles of the other backbone leaves (Adam-like tier).', '',
         '| model | hidden | other backbone leaves by role |', '| --- | ---: | --- |']
  for r in rows:
    if 'hidden' not in r:
      continue
    roles: dict[str, int] = {}
    for role in r['backbone_not_hidden'].values():
      roles[role] = roles.get(role, 0) + 1
    out.append(f"| {r['model']} | {len(r['hidden'])} | "
               + ', '.join(f'{k} {v}' for k, v in sorted(roles.items())) + ' |')
  return out + ['']


def write_markdown() -> str:
  """Rebuilds the markdown from every JSON result; keeps the notes after NOTES_MARK."""
  results = {}
  for path in sorted(glob.glob(os.path.join(JSON_DIR, '*.json'))):
    if os.path.basename(path).startswith('cost_'):  # trace_cost.py's, beside these
      continue
    with open(path) as f:
      results[os.path.basename(path)[:-5]] = portable(json.load(f))
  default = [k for k in results if k in CASES]
  variants = [k for k in results if k not in CASES]
  lines = ['## `sj.trace_structure` on the recorded real MoE trees',
           '',
           'Each model of `tests/data/real_trees` that could be rebuilt is built as '
           '`tools/real_trees/record.py` builds it (tiny, random init, abstract), its '
           'trainer\'s loss `fn(params, tokens)` is traced by `sj.trace_structure` on '
           '`jax.ShapeDtypeStruct`s, and every leaf\'s traced tier and batch axes are '
           'compared with the hand judgement recorded in the JSON (see the docstring of '
           '`tools/real_trees/trace_check.py`). "traced right": tier and batch axes both '
           'equal; a leaf can be wrong in both columns; "undecided": leaves listed in '
           '`Structure.undecided`, right or wrong.',
           '',
           'Commands, from the repository root (`$VENVS`: the virtualenvs made as '
           '`tools/real_trees/README.md` says; `python tools/real_trees/trace_check.py '
           '--report` rebuilds this file from the JSON files in '
           '`benchmarks/results/real_trees_traced/`):',
           '']
  for res in results.values():
    v = ', '.join(f'{k} {x}' for k, x in res['versions'].items())
    lines.append(f'* `{res["command"]}`: {v}; skewadam_jax at {res["skewadam_jax"]}; '
                 f'wall {res["wall_s"]} s')
  lines += ['', '### With each library\'s default configuration', '']
  rows = [r for k in default for r in results[k]['rows']]
  lines += table(rows, total=True) + ['']
  for key in variants:
    res = results[key]
    lines += [f'### `{res["command"].split("trace_check.py ")[1]}`', '']
    lines += table(res['rows'], total=True) + ['']
  lines += hidden_sets([r for k in default for r in results[k]['rows']])
  lines += ['### Wrong and undecided leaves', '']
  for key in default + variants:
    lines += details(results[key]['rows'])
  notes = ''
  if os.path.exists(MARKDOWN):
    with open(MARKDOWN) as f:
      text = f.read()
    if NOTES_MARK in text:
      notes = text[text.index(NOTES_MARK):]
  with open(MARKDOWN, 'w') as f:
    f.write('\n'.join(lines).rstrip() + '\n\n' + (notes or NOTES_MARK + '\n'))
  return MARKDOWN


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--library', choices=sorted(CASES))
  p.add_argument('--models', default='', help='comma-separated subset (default: all)')
  p.add_argument('--override', action='append', default=[],
                 help='MaxText only: key=value appended to its config (repeatable)')
  p.add_argument('--report', action='store_true', help='only rebuild the markdown')
  args = p.parse_args(argv)
  if args.report:
    print(write_markdown())
    return 0
  if not args.library:
    p.error('--library or --report is required')
  if args.override and args.library != 'maxtext':
    p.error('--override is for --library maxtext')
  overrides = tuple(args.override)
  models = {'easydel': record.EASYDEL_MODELS, 'maxtext': record.MAXTEXT_MODELS,
            'gemma': record.GEMMA_MODELS}[args.library]
  names = [m for m in args.models.split(',') if m] or list(models)
  t0 = time.time()
  rows = []
  for name in names:
    try:
      row = score(args.library, name, overrides)
    except Exception as e:  # pylint: disable=broad-except
      row = {'model': f'{args.library}_{name}' + ''.join(f' ({o})' for o in overrides),
             'failed': f'{type(e).__name__}: {e}'[:300],
             'leaves': '-'}
      print(f'FAILED {row["model"]}: {row["failed"]}', file=sys.stderr)
    rows.append(row)
    print('\n'.join(table([row])[2:]), flush=True)
    if row.get('wrong') or row.get('undecided'):
      print('\n'.join(row['format']), flush=True)
  print('\n'.join(table(rows, total=True)))
  os.makedirs(JSON_DIR, exist_ok=True)
  command = COMMANDS[args.library] + (f' --models {args.models}' if args.models else '')
  command += ''.join(f' --override {o}' for o in overrides)
  stem = '_'.join([args.library] + [o.replace('=', '-') for o in overrides])
  out = {'library': stem, 'command': command, 'versions': versions(args.library),
         'skewadam_jax': skewadam_revision(), 'wall_s': round(time.time() - t0),
         'rows': rows}
  with open(os.path.join(JSON_DIR, f'{stem}.json'), 'w') as f:
    json.dump(out, f, indent=1)
  print(write_markdown())
  return 1 if any('failed' in r for r in rows) else 0


if __name__ == '__main__':
  sys.exit(main())
