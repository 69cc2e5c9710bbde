"""Stacks and banks from shapes alone: trees whose names say nothing.

No path below holds `expert`, `router`, `gate`, `moe`, `layer` or `scan`. Each tree
reproduces a layout that the name rules got silently wrong; every leaf must get its
right tier and batch axes, or be named in a warning (`strict=True` then raises). The
count of leaves that are wrong *and* unreported must be 0.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, HealthCheck, settings
from hypothesis import strategies as st

import skewadam_jax as sj
from skewadam_jax.structure import paths as _paths

V, D, H, F = 64, 16, 24, 32
SIZES = [(2, 4), (6, 4)]  # (R, E): the repeat length below and above the expert count
FORBIDDEN = re.compile('expert|router|gate|moe|layer|scan')


def _z(*shape: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def _scanned(r: int, e: int, *, moe: bool = True, sel: str = 'w_sel') -> tuple[Any, dict]:
  """A scanned stack under `body`: every leaf carries a leading repeat axis R; the
  feed-forward is a router [R, d, E] beside banks [R, E, d, f] (or a dense MLP)."""
  ffn = ({sel: _z(r, D, e), 'bank': {'w_in': _z(r, e, D, F), 'w_out': _z(r, e, F, D)}}
         if moe else {'w_in': _z(r, D, F), 'w_out': _z(r, F, D)})
  tree = {'tok': {'table': _z(V, D)},
          'body': {'pre': {'scale': _z(r, D)},
                   'mix': {'q': _z(r, D, H), 'k': _z(r, D, H), 'v': _z(r, D, H),
                           'o': _z(r, H, D)},
                   'post': {'scale': _z(r, D)},
                   'ffn': ffn},
          'final': {'scale': _z(D)}}
  expected = {'tok/table': ('backbone', ()), 'final/scale': ('backbone', ())}
  for name in ('pre/scale', 'post/scale', 'mix/q', 'mix/k', 'mix/v', 'mix/o'):
    expected[f'body/{name}'] = ('backbone', (0,))
  if moe:
    expected[f'body/ffn/{sel}'] = ('router', (0,))
    expected['body/ffn/bank/w_in'] = ('experts', (0, 1))
    expected['body/ffn/bank/w_out'] = ('experts', (0, 1))
  else:
    expected['body/ffn/w_in'] = ('backbone', (0,))
    expected['body/ffn/w_out'] = ('backbone', (0,))
  return tree, expected


def _siblings(r: int, e: int) -> tuple[Any, dict]:
  """The scanned stack with the router and the banks as sibling leaves of `ffn`."""
  tree, expected = _scanned(r, e)
  ffn = tree['body']['ffn']
  tree['body']['ffn'] = {'w_sel': ffn['w_sel'], **ffn['bank']}
  for name in ('w_in', 'w_out'):
    expected[f'body/ffn/{name}'] = expected.pop(f'body/ffn/bank/{name}')
  return tree, expected


def _siblings_with_dense(r: int, e: int) -> tuple[Any, dict]:
  """The sibling layout with more leaves in the router's module: a router bias [R, E],
  a dense kernel [R, d, d] and a scale [R, d] (routing nothing: backbone)."""
  tree, expected = _siblings(r, e)
  tree['body']['ffn'].update(w_sel_b=_z(r, e), w_mix=_z(r, D, D), w_scale=_z(r, D))
  expected.update({'body/ffn/w_sel_b': ('router', (0,)),
                   'body/ffn/w_mix': ('backbone', (0,)),
                   'body/ffn/w_scale': ('backbone', (0,))})
  return tree, expected


def _scanned_axis1(r: int, e: int) -> tuple[Any, dict]:
  """The scanned stack with its layer axis at position 1 (Linen's
  `nn.scan(variable_axes={'params': 1})`): norm scales [d, R], projections [d, R, h],
  a router [d, R, E] in its own module and banks [E, R, d, f]."""
  tree = {'tok': {'table': _z(V, D)},
          'body': {'pre': {'scale': _z(D, r)},
                   'mix': {'q': _z(D, r, H), 'k': _z(D, r, H), 'o': _z(H, r, D)},
                   'ffn': {'sel': {'kernel': _z(D, r, e)}, 'w_in': _z(e, r, D, F),
                           'w_out': _z(e, r, F, D)}},
          'final': {'scale': _z(D)}}
  expected = {'tok/table': ('backbone', ()), 'final/scale': ('backbone', ()),
              'body/pre/scale': ('backbone', (1,)), 'body/mix/q': ('backbone', (1,)),
              'body/mix/k': ('backbone', (1,)), 'body/mix/o': ('backbone', (1,)),
              'body/ffn/sel/kernel': ('router', (1,)),
              'body/ffn/w_in': ('experts', (0, 1)), 'body/ffn/w_out': ('experts', (0, 1))}
  return tree, expected


def _unrolled(r: int, e: int) -> tuple[Any, dict]:
  """R unrolled blocks; each has a router kernel [d, E] called `proj` beside a bank
  under `mlp/` ([E, d, f] and [E, f, d]), named like a dense MLP."""
  tree: dict[str, Any] = {'tok': {'table': _z(V, D)}, 'final': {'scale': _z(D)}}
  expected = {'tok/table': ('backbone', ()), 'final/scale': ('backbone', ())}
  for i in range(r):
    tree[f'blk_{i}'] = {'pre': {'scale': _z(D)}, 'mix': {'q': _z(D, H), 'o': _z(H, D)},
                        'proj': {'kernel': _z(D, e), 'bias': _z(e)},
                        'mlp': {'w_in': _z(e, D, F), 'b_in': _z(e, F),
                                'w_out': _z(e, F, D)}}
    expected.update({f'blk_{i}/pre/scale': ('backbone', ()),
                     f'blk_{i}/mix/q': ('backbone', ()), f'blk_{i}/mix/o': ('backbone', ()),
                     f'blk_{i}/proj/kernel': ('router', ()),
                     f'blk_{i}/proj/bias': ('router', ()),
                     f'blk_{i}/mlp/w_in': ('experts', (0,)),
                     f'blk_{i}/mlp/b_in': ('experts', (0,)),
                     f'blk_{i}/mlp/w_out': ('experts', (0,))})
  return tree, expected


def _report(tree: Any) -> tuple[dict[str, sj.LeafReport], str]:
  """label_table rows by path, and the text of every unsure-label warning."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    rows = {r.path: r for r in sj.label_table(sj.skewadam(1e-3), tree)}
  text = '\n'.join(str(w.message) for w in caught
                   if issubclass(w.category, sj.UnsureLabelWarning))
  return rows, text


def _silently_wrong(rows: dict[str, sj.LeafReport], text: str,
                    expected: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
  """Leaves whose tier or batch axes are wrong and that no warning or note names."""
  out = []
  for path, (tier, axes) in expected.items():
    row = rows[path]
    wrong = row.tier != tier or row.batch_axes != axes
    warned = row.note.startswith('UNSURE') or re.search(rf'(^|\W){re.escape(path)}\W', text)
    if wrong and not warned:
      out.append(f'{path}: {row.tier} {row.batch_axes} (expected {tier} {axes})')
  return out


LAYOUTS = {'scanned': _scanned, 'scanned_dense': lambda r, e: _scanned(r, e, moe=False),
           'scanned_axis1': _scanned_axis1, 'siblings': _siblings,
           'siblings_with_dense': _siblings_with_dense, 'unrolled': _unrolled}


@pytest.mark.parametrize('r,e', SIZES, ids=[f'R{r}E{e}' for r, e in SIZES])
@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_no_leaf_is_silently_wrong(layout, r, e):
  tree, expected = LAYOUTS[layout](r, e)
  paths = [p for p in expected]
  assert not [p for p in paths if FORBIDDEN.search(p)]  # the names say nothing
  assert len(paths) == len(jax.tree_util.tree_leaves(tree))
  rows, text = _report(tree)
  assert _silently_wrong(rows, text, expected) == []


@pytest.mark.parametrize('r,e', SIZES, ids=[f'R{r}E{e}' for r, e in SIZES])
@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_every_leaf_is_right_and_nothing_is_reported(layout, r, e):
  """These layouts are clear from shapes: right, quietly, and `strict` agrees."""
  tree, expected = LAYOUTS[layout](r, e)
  rows, text = _report(tree)
  got = {p: (rows[p].tier, rows[p].batch_axes) for p in expected}
  assert got == expected
  assert text == ''
  sj.make_labeler(strict=True)(tree)


@pytest.mark.parametrize('r', [2, 4, 6])
def test_the_expert_count_is_never_read_from_the_repeat_axis(r):
  """A router named `router` [R, d, E] beside banks [R, E, d, f]: E = 4 whatever R."""
  tree, expected = _scanned(r, 4, sel='router')
  rows, _ = _report(tree)
  assert rows['body/ffn/bank/w_in'].tier == 'experts'
  assert rows['body/ffn/bank/w_out'].tier == 'experts'
  assert rows['body/ffn/router'].tier == 'router'
  assert 'leading axis' not in ''.join(r.note for r in rows.values())
  assert {p: (rows[p].tier, rows[p].batch_axes) for p in expected} == expected


def test_the_bank_named_like_a_dense_mlp_gets_the_expert_state():
  """The state of the unrolled MoE: about 0.29x AdamW's (0.57x with the bank in the
  backbone, as the name rules alone had it)."""
  tree, _ = _unrolled(2, 4)
  skew = sj.memory_report(sj.skewadam(1e-3), tree).total_state_bytes
  adamw = sj.memory_report(optax.adamw(1e-3), tree).total_state_bytes
  dense = sj.make_labeler([('mlp', 'backbone'), ('proj', 'backbone')])
  as_dense = sj.memory_report(sj.skewadam(1e-3, param_labels=dense), tree,
                              param_labels=dense).total_state_bytes
  assert skew / adamw < 0.35 < 0.5 < as_dense / adamw


def test_a_stack_and_a_bank_that_could_be_confused_are_reported():
  """[6, 4, d, f] banks beside an unstacked router [d, 4]: axis 0 reads as a stack of
  6 layers, axis 1 as 4 experts, and only a rule can say which is meant."""
  tree = {'tok': {'table': _z(V, D)},
          'blk': {'proj': {'kernel': _z(D, 4)},
                  'grp': {'w_in': _z(6, 4, D, F), 'w_out': _z(6, 4, F, D)}}}
  with pytest.warns(sj.UnsureLabelWarning,
                    match=r'blk/grp/\*\* \(blk/grp/w_in(.|\n)*could be confused'):
    rows = {r.path: r for r in sj.label_table(sj.skewadam(1e-3), tree)}
  assert rows['blk/grp/w_in'].note.startswith('UNSURE')
  with pytest.raises(ValueError, match='could be confused'):
    sj.make_labeler(strict=True)(tree)
  # The rule the message suggests settles the tiers, quietly.
  fixed = sj.make_labeler([('blk/grp', 'experts'), ('blk/proj', 'router')], strict=True)
  assert fixed(tree)['blk']['grp']['w_in'] == 'experts'


def test_the_suggested_batch_axes_rule_keeps_the_users_labels():
  """The batch-axes fix the report prints, pasted beside the user's own labeler, gets
  that labeler's labels (a `batch_axes` function that takes `param_labels` is passed
  them), so the bank keeps its experts' tier and both of its axes."""
  tree = {'tok': {'table': _z(V, D)},
          'blk': {'proj': {'kernel': _z(D, 4)},
                  'grp': {'w_in': _z(6, 4, D, F), 'w_out': _z(6, 4, F, D)}}}
  with pytest.warns(sj.UnsureLabelWarning) as caught:
    sj.label_table(sj.skewadam(1e-3), tree)
  text = '\n'.join(str(w.message) for w in caught)
  found = re.search(r"batch_axes=(lambda p, param_labels: sj\.moe_batch_axes\(.*?\]\))", text)
  assert found, text
  pasted = eval(found.group(1).replace('<layer and expert axes>', '0, 1'),  # noqa: S307
                {'sj': sj})
  labels = sj.make_labeler([('blk/grp', 'experts'), ('blk/proj', 'router')], strict=True)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    rows = {r.path: r for r in sj.label_table(
        sj.skewadam(1e-3, param_labels=labels, batch_axes=pasted), tree)}
  assert rows['blk/grp/w_in'].tier == rows['blk/grp/w_out'].tier == 'experts'
  assert rows['blk/grp/w_in'].batch_axes == rows['blk/grp/w_out'].batch_axes == (0, 1)


def test_one_module_sharing_a_length_no_one_else_has_is_reported_whole():
  """One module's leaves share a leading length 4 that no leaf outside has and no router
  maps to: a stack of 4 layers or a bank of 4 experts. The rank-2 leaves (a scale and a
  bias, no batch axis by default) are named in the report too, not only the kernels."""
  tree = {'tok': {'table': _z(V, D)},
          'body': {'s': _z(4, D), 'w': _z(4, D, F), 'b': _z(4, F), 'm': _z(4, D, D)},
          'out': _z(D, V)}
  rows, text = _report(tree)
  assert re.search(r'body/\*\* \(body/b, body/m, body/s, body/w\)', text), text
  assert {p for p, r in rows.items() if r.note.startswith('UNSURE')} == {
      'body/s', 'body/w', 'body/b', 'body/m'}
  with pytest.raises(ValueError, match=r'body/\*\*'):
    sj.make_labeler(strict=True)(tree)
  # The rules the message suggests settle it, quietly.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    labeler = sj.make_labeler([('body', 'experts')], strict=True)
    labels = labeler(tree)
    axes = sj.moe_batch_axes(tree, labeler, rules=[('body/**', (0,))])
  assert set(labels['body'].values()) == {'experts'}
  assert axes['body'] == {'s': (0,), 'w': (0,), 'b': (0,), 'm': (0,)}


def test_a_subtree_sharing_a_feature_width_is_no_stack():
  """q, k and v [d, heads, head_dim] share d and head_dim with leaves outside them:
  neither is a layer axis, and nothing is reported."""
  tree = {'tok': {'table': _z(V, D)},
          'blk': {'attn': {'qkv': {'q': _z(D, 4, 8), 'k': _z(D, 2, 8), 'v': _z(D, 2, 8)},
                           'o': _z(4, 8, D)},
                  'ln': _z(D)}}
  rows, text = _report(tree)
  assert text == ''
  assert {p: r.batch_axes for p, r in rows.items() if '/qkv/' in p} == {
      'blk/attn/qkv/q': (), 'blk/attn/qkv/k': (), 'blk/attn/qkv/v': ()}  # head axes stay
  assert all(r.tier == 'backbone' for r in rows.values())


def test_skewadam_trains_the_nameless_scanned_moe():
  tree, expected = _scanned(6, 4)
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.1, s.dtype), tree)
  tx = sj.skewadam(1e-2)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  # The banks are factored per layer and expert: rows [R, E, d] and [R, E, f].
  tiered = state[0]
  banks = [p for p, (tier, _) in expected.items() if tier == 'experts']
  v_row = dict(_paths.flatten_with_paths(tiered.v_row)[0])
  mu = dict(_paths.flatten_with_paths(tiered.mu)[0])
  assert sorted(v_row[p].shape for p in banks) == [(6, 4, D), (6, 4, F)]
  assert not any(p in mu for p in banks)  # no momentum in the experts tier
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree_util.tree_leaves(updates))
  assert len(expected) == len(jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize('layout', ['scanned', 'siblings'])
def test_a_repeat_length_equal_to_the_expert_count_is_no_confusion(layout):
  """R == E == 4: the norms [R, d] show which axis stacks the layers."""
  tree, expected = LAYOUTS[layout](4, 4)
  rows, text = _report(tree)
  assert {p: (rows[p].tier, rows[p].batch_axes) for p in expected} == expected
  assert text == ''


# ---------------------------------------------------------------------------- traced models


def _default_labels_and_axes(params: Any) -> tuple[dict[str, tuple[str, tuple[int, ...]]],
                                                     str]:
  """The name-free default (`moe_param_labels`, `moe_batch_axes`, no function given):
  (tier, batch axes) by normalised path, and the text of every unsure-label warning."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    labels = sj.moe_param_labels(params)
    axes = sj.moe_batch_axes(params)
  text = '\n'.join(str(w.message) for w in caught
                   if issubclass(w.category, sj.UnsureLabelWarning))
  flat_labels, treedef = jax.tree_util.tree_flatten_with_path(labels)
  got = {}
  for (path, tier), leaf_axes in zip(flat_labels, treedef.flatten_up_to(axes)):
    got['/'.join(_paths.path_segments(path))] = (tier, tuple(leaf_axes))
  return got, text


# The cases of tests/support/structure_models.py (imported when used: it needs Equinox and a recent
# Flax, which the minimum-versions run, selecting only fast tests, does not install).
TRACED_CASES = ('eqx', 'linen', 'nested', 'nnx', 'ragged')
# One small model per pattern the tracer follows (Pallas-like grouped matmuls, ids from
# jnp.repeat, scaled router inputs, stacked pairs, ...): the default must not be silent
# on them either. On the list models (`units`, `units_top`: a bank stored as Python lists
# of separate [D, F] and [F, D] matrices beside a [D, E] router) it can only report: shapes
# do not tell those units from dense layers, only the computation does.
PATTERN_CASES = ('capacity', 'choice', 'consts', 'ids', 'kernel', 'pairs', 'scaled', 'split',
                 'units', 'units_top')


@pytest.fixture(scope='module', params=TRACED_CASES + PATTERN_CASES)
def traced_case(request):
  pytest.importorskip('equinox')
  import structure_models  # noqa: PLC0415
  assert sorted(structure_models.CASES) == list(TRACED_CASES)
  assert sorted(structure_models.PATTERNS) == sorted(PATTERN_CASES)
  cases = {**structure_models.CASES, **structure_models.PATTERNS}
  return cases[request.param]()


@pytest.mark.slow  # builds a model (seconds of eager init)
def test_the_default_on_the_traced_structure_models_is_right_or_reported(traced_case):
  """The name-free MoE models of `test_structure` (their truth is hand-written):
  without a function, every leaf is right or named in a warning."""
  case = traced_case
  got, text = _default_labels_and_axes(case.params)
  right, warned, silent = [], [], []
  for path, tier in case.tiers.items():
    expected = (tier, case.axes[path])
    if got[path] == expected:
      right.append(path)
    elif re.search(rf'(^|\W){re.escape(path)}\W', text):
      warned.append(path)
    else:
      silent.append(f'{path}: {got[path]} (expected {expected})')
  print(f'{case.name}: leaves={len(case.tiers)} right={len(right)} '
        f'wrong-but-warned={len(warned)} silent-wrong={len(silent)}')
  assert silent == []


# ---------------------------------------------------------------------------- container names


def _moe_layer(r: int = 3, e: int = 4, nameless: bool = False
               ) -> dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]]:
  """The leaves of one MoE layer stacked over R layers: name -> (shape, tier, batch
  axes); `nameless`: leaves that say nothing (the router found by its shape alone)."""
  layer = {'wq': ((r, D, D), 'backbone', (0,)), 'norm': ((r, D), 'backbone', (0,)),
           'router': ((r, D, e), 'router', (0,)), 'w1': ((r, e, D, F), 'experts', (0, 1)),
           'w2': ((r, e, F, D), 'experts', (0, 1))}
  return dict(zip('abcde', layer.values())) if nameless else layer


def _moe_layers(containers: tuple[str, ...], layer: dict[str, Any]
                ) -> tuple[Any, dict[str, tuple[str, tuple[int, ...]]]]:
  """An embedding [V, d] beside a scanned stack of MoE layers put under `containers`
  (the root when empty), and the expected (tier, batch axes) by path."""
  stack = {name: _z(*shape) for name, (shape, _, _) in layer.items()}
  for name in reversed(containers):
    stack = {name: stack}
  prefix = ''.join(f'{c}/' for c in containers)
  expected = {f'{prefix}{name}': (tier, axes) for name, (_, tier, axes) in layer.items()}
  return {'emb': _z(V, D), **stack}, {'emb': ('backbone', ()), **expected}


CONTAINERS = [(), ('blocks',), ('stack',), ('body',), ('blk',), ('xq7',), ('t0k3n',),
              ('model', 'zq'), ('a', 'b', 'c')]


@pytest.mark.parametrize('layer', ['named', 'nameless'])
@pytest.mark.parametrize('containers', CONTAINERS, ids=['root' if not c else '/'.join(c)
                                                        for c in CONTAINERS])
def test_container_names_do_not_decide(containers, layer):
  """A scanned stack of MoE layers gets the same tiers and batch axes whatever its
  containers are called, at the root too: the layer axis is read from the router [L, d,
  E] and bank [L, E, d, f] inside the stack, not from a module name; `wq` [L, d, d] is
  no bank and the stacked norm [L, d] keeps its layer axis. No warning where the leaves
  are named as usual."""
  tree, expected = _moe_layers(containers, _moe_layer(nameless=layer == 'nameless'))
  got, text = _default_labels_and_axes(tree)
  assert got == expected
  _assert_quiet_unless_nameless(text, containers, layer == 'nameless')


def _assert_quiet_unless_nameless(text: str, containers: tuple[str, ...], nameless: bool
                                  ) -> None:
  """Named leaves: no warning. Nameless ones: one finding (in the warning of each call),
  on the vector `b` [R, d] beside the router, which may scale the router's input or be a
  norm (it stays backbone)."""
  if not nameless:
    assert text == ''
    return
  lines = sorted({line for line in text.splitlines() if line.startswith('  - ')})
  assert len(lines) == 1 and lines[0].startswith(f"  - {''.join(f'{c}/' for c in containers)}b ")
  assert "if it scales the router's input" in lines[0]


_RULES = sj.DEFAULT_RULES + sj.DENSE_RULES
_TOKEN = st.text('abcdfhjklpqrstvwxyz0123456789_', min_size=1, max_size=8).filter(
    lambda name: not any(_paths.match_path(pattern, name) for pattern, _ in _RULES))


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(containers=st.lists(_TOKEN, max_size=3), nameless=st.booleans(),
       r=st.integers(2, 8), e=st.integers(2, 8))
def test_random_container_names_do_not_decide(containers, nameless, r, e):
  """Any container names that no rule matches, any R and E (R == E too): the same
  answer as at the root."""
  tree, expected = _moe_layers(tuple(containers), _moe_layer(r, e, nameless))
  got, text = _default_labels_and_axes(tree)
  assert got == expected
  _assert_quiet_unless_nameless(text, tuple(containers), nameless)
