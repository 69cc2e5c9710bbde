"""The labeler on the recorded parameter trees of real MoE models (EasyDeL, MaxText, gemma).

`tests/data/real_trees/*.json` hold every leaf's path, shape, dtype, logical axis names
and hand-judged tier (see `tools/real_trees/README.md`); the trees are rebuilt here from
`jax.ShapeDtypeStruct`s, so no library is needed. `tools/real_trees/score.py` prints
the same comparison as a table.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import skewadam_jax as sj
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import paths as _paths

import real_trees  # tests/support

FILES = real_trees.FILES
_record = real_trees.record
_nest = real_trees.nest
_abstract = real_trees.abstract


def _by_path(labels: Any) -> dict[str, str]:
  flat, _ = jax.tree_util.tree_flatten_with_path(labels)
  return {_paths.path_str(p): label for p, label in flat}


def _label_quietly(labeler, tree: Any) -> dict[str, str]:
  """Labels by path; fails if the labeler warns (every recorded leaf is judged clearly)."""
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    return _by_path(labeler(tree))


def _summary(name: str, got: dict[str, str], expected: dict[str, str]) -> str:
  wrong = [p for p in expected if got.get(p) != expected[p]]
  lines = [f'{name}: {len(expected)} leaves, {len(wrong)} wrong tiers']
  lines += [f'  {p}: {got.get(p)} (hand-judged {expected[p]})' for p in wrong]
  return '\n'.join(lines)


@pytest.fixture(params=FILES, ids=[f.stem for f in FILES])
def record(request) -> dict[str, Any]:
  return _record(request.param)


def test_every_recorded_tree_is_there():
  assert len(FILES) == 17  # 16 models, and MaxText Mixtral's boxed Linen tree


def test_every_leaf_gets_its_hand_judged_tier(record):
  tree = _nest(record['leaves'], _abstract)
  expected = {leaf['path']: leaf['tier'] for leaf in record['leaves']}
  got = _label_quietly(sj.make_labeler(), tree)
  assert got == expected, _summary(record['model'], got, expected)
  # The default labeler of skewadam / memory_report is the same.
  assert _by_path(_labels.resolve_labels(tree)) == expected


def test_trailing_value_segment_changes_nothing(record):
  """`init` sees boxes (paths ending in `value`), `update` the pure arrays."""
  plain = _nest(record['leaves'], _abstract)
  boxed = _nest(record['leaves'], lambda leaf: {'value': _abstract(leaf)})
  assert _label_quietly(sj.make_labeler(), boxed) == _label_quietly(sj.make_labeler(), plain)


def test_axis_names_confirm_and_never_change_the_function_labels(record):
  """With the recorded names on NNX variables (as MaxText attaches them)."""
  expected = {leaf['path']: leaf['tier'] for leaf in record['leaves']}

  def variable(leaf):
    names = leaf['axis_names']
    if names is None:
      return nnx.Param(_abstract(leaf))
    return nnx.Param(_abstract(leaf), out_sharding=tuple(names))

  with nnx.use_eager_sharding(False):
    state = _nest(record['leaves'], variable)
  got = _label_quietly(sj.make_labeler(), state)
  assert got == expected, _summary(record['model'], got, expected)
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    labels = sj.moe_param_labels(state, use_axis_names=True)
  assert _by_path(labels) == expected, _summary(record['model'], _by_path(labels), expected)


def test_skewadam_holds_less_state_than_adamw(record):
  tree = _nest(record['leaves'], lambda leaf: jax.ShapeDtypeStruct(tuple(leaf['shape']),
                                                                   jnp.float32))
  skew = sj.memory_report(sj.skewadam(1e-3), tree).total_state_bytes
  adamw = sj.memory_report(optax.adamw(1e-3), tree).total_state_bytes
  assert 0 < skew < adamw, f"{record['model']}: SkewAdam {skew:,} B >= AdamW {adamw:,} B"


# ---------------------------------------------------------------------------- unsure leaves


MYSTERY = {'embed': {'embedding': jnp.zeros((16, 8))},
           'layers_0': {'mystery_block': {'w_in': jnp.zeros((4, 8, 12))},
                        'ln': {'scale': jnp.zeros(8)}}}


def test_unrecognised_3d_leaf_warns_with_its_path():
  with pytest.warns(sj.UnsureLabelWarning, match='layers_0/mystery_block/w_in') as rec:
    labels = sj.moe_param_labels(MYSTERY)
  assert len(rec) == 1  # once per labeler call, not per leaf
  assert labels['layers_0']['mystery_block']['w_in'] == 'backbone'  # lossless default
  with pytest.warns(sj.UnsureLabelWarning):
    rows = {r.path: r for r in sj.label_table(sj.skewadam(1e-3), MYSTERY)}
  assert rows['layers_0/mystery_block/w_in'].note.startswith('UNSURE: rank-3 leaf')
  assert rows['embed/embedding'].note == ''


def test_strict_mode_raises_naming_the_path_and_make_labeler():
  with pytest.raises(ValueError, match=r"layers_0/mystery_block/w_in(.|\n)*"
                                       r"sj\.make_labeler\(\[\('layers_0/mystery_block/w_in'"):
    sj.moe_param_labels(MYSTERY, strict=True)
  tx = sj.skewadam(1e-3, param_labels=sj.make_labeler(strict=True))
  with pytest.raises(ValueError, match='mystery_block/w_in'):
    tx.init(MYSTERY)
  # The rule the message suggests settles it, quietly.
  fixed = sj.make_labeler([('layers_0/mystery_block/w_in', 'backbone')], strict=True)
  assert fixed(MYSTERY)['layers_0']['mystery_block']['w_in'] == 'backbone'


def test_no_warning_on_the_recorded_trees_with_strict_mode(record):
  tree = _nest(record['leaves'], _abstract)
  sj.make_labeler(strict=True)(tree)
