"""The MoE and ViT patterns of real code, one test each, on both routes.

Each test builds one program from `moe_programs`' blocks on its one-layer (or scanned)
baseline and states what the pattern's leaves are: the traced route
(`sj.trace_structure`) is right on every leaf; the default route (names and shapes) is
right, or names the leaf in an `sj.UnsureLabelWarning` (undecided, under the safe rule).

* GShard's top-2 gate (argmax, the first masked out, argmax again, capacity by cumsum);
* expert choice within token groups;
* ViT's tokens: a patch convolution of the raw input (the input layer, never hidden), a
  class token `[1, 1, d]` and a position table `[1, T, d]` (no batch axis), a MAP head
  whose query bias `[H, hd]` is a bias and whose kernels are hidden;
* dispatch and combine built from indices (rows written into `[E, capacity, d]`,
  gathered back) with per-expert biases `[E, f]` (`[L, E, f]` in a scan);
* DenseGeneral attention kernels `[d, H, hd]` and `[H, hd, d]`: hidden, whole;
* a norm on the router's input: its gain `[L, d]` before an expert-choice router is no
  router parameter;
* size coincidences (`head_dim == E`, `E == L`, a width equal to V): a side of length V
  never decides alone (`pre_logits/kernel [d, d]` and a hidden `[d, V]` stay hidden).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest

import moe_programs as mp
import skewadam_jax as sj

BASE = mp.BASELINE


def _spec(**changes) -> mp.Spec:
  return mp._coincide(dataclasses.replace(BASE, **changes))


def _traced(spec: mp.Spec) -> tuple[mp.Program, dict[str, mp.Truth]]:
  """The program and the traced route's reading per path, every leaf asserted right."""
  program = mp.build(spec)
  verdict = mp.check_traced(program)
  assert not verdict.error, verdict.error
  wrong = [f'{p}: got {g}, truth {t}' for p, g, t, o in
           zip(program.paths, verdict.got, program.truth, verdict.outcome) if o != mp.RIGHT]
  assert not wrong, '\n'.join(wrong)
  return program, dict(zip(program.paths, verdict.got))


def _default_right_or_loud(program: mp.Program) -> dict[str, mp.Truth]:
  verdict = mp.check_default(program)
  assert not verdict.failed, '\n'.join(verdict.failures(program))
  return {p: g for p, g, o in zip(program.paths, verdict.got, verdict.outcome)
          if o == mp.RIGHT}


@pytest.mark.parametrize('stacking', ['single', 'scan'])
def test_gshard_top2_gate_with_capacity(stacking):
  """Router `[d, E]` (`[L, d, E]`): router; banks: experts along E (and L)."""
  program, got = _traced(_spec(dispatch='gshard', stacking=stacking))
  lead = (0,) if stacking == 'scan' else ()
  root = 'layers' if stacking == 'scan' else 'layer'
  assert got[f'{root}/moe/router/kernel'] == mp.Truth('router', lead)
  shift = len(lead)
  assert got[f'{root}/moe/experts/w1'] == mp.Truth('experts', lead + (shift,))
  _default_right_or_loud(program)


def test_expert_choice_within_token_groups():
  program, got = _traced(_spec(dispatch='group_choice', expert_bias=True))
  assert got['layer/moe/router/kernel'].tier == 'router'
  assert got['layer/moe/experts/b1'] == mp.Truth('experts', (0,))
  _default_right_or_loud(program)


@pytest.mark.parametrize('dispatch', ['onehot', 'group_choice'])
def test_vit_tokens_and_map_head(dispatch):
  """The patch kernel is the input layer (not hidden); the class token, the position
  table and the probe have no batch axis; the query bias `[H, hd]` is no matrix; the
  MAP head's kernels are hidden; the classifier is the output layer."""
  program, got = _traced(_spec(tokens='vit', dispatch=dispatch))
  assert got['embedding/kernel'] == mp.Truth('backbone', (), False)
  for path in ('cls', 'pos_embedding', 'map_head/probe',
               'map_head/attention/query/bias'):
    assert got[path] == mp.Truth('backbone', (), False), path
  for m in ('query', 'key', 'value', 'out'):
    assert got[f'map_head/attention/{m}/kernel'] == mp.Truth('backbone', (), True)
  assert got['head/kernel'] == mp.Truth('backbone', (), False)
  right = _default_right_or_loud(program)
  for path in ('cls', 'pos_embedding', 'map_head/probe', 'embedding/kernel'):
    assert right[path].axes == (), path


@pytest.mark.parametrize('stacking', ['single', 'scan'])
def test_index_dispatch_with_per_expert_biases(stacking):
  """Tokens written into `[E, capacity, d]` by computed indices and gathered back: the
  per-expert biases `[E, f]` (`[L, E, f]`) are the bank's, along E (and L)."""
  program, got = _traced(_spec(dispatch='index', expert_bias=True, stacking=stacking))
  lead = (0,) if stacking == 'scan' else ()
  root = 'layers' if stacking == 'scan' else 'layer'
  for leaf in ('b1', 'b2', 'w1', 'w2'):
    assert got[f'{root}/moe/experts/{leaf}'] == mp.Truth('experts', lead + (len(lead),))
  _default_right_or_loud(program)


@pytest.mark.parametrize('layout', ['nested', 'flat'])
def test_dense_general_attention_kernels_are_hidden_whole(layout):
  """`[d, H, hd]` and `[H, hd, d]`: hidden matrices with no batch axis (the head axes are
  part of the matrix), wherever stored."""
  program, got = _traced(_spec(attention=True, dense_general=True, layout=layout))
  prefix = 'layer/attn/' if layout == 'nested' else 'layer/'
  for m in ('wq', 'wk', 'wv', 'wo'):
    assert got[prefix + m] == mp.Truth('backbone', (), True)
  right = _default_right_or_loud(program)
  assert all(right[prefix + m].hidden for m in ('wq', 'wo') if prefix + m in right)


def test_norm_gain_before_an_expert_choice_router_is_not_the_routers():
  """A norm gain `[L, d]` whose output the router and the experts read: backbone along L."""
  program, got = _traced(_spec(moe_norm=True, dispatch='expert_choice', stacking='scan'))
  assert got['layers/moe/norm/scale'] == mp.Truth('backbone', (0,), False)
  assert got['layers/moe/router/kernel'] == mp.Truth('router', (0,))
  right = _default_right_or_loud(program)
  assert right['layers/moe/norm/scale'].tier == 'backbone'


@pytest.mark.parametrize('coincide,changes', [
    ('hd=E', {'attention': True, 'dense_general': True}),
    ('H=E', {'attention': True, 'dense_general': True}),
    ('E=L', {'stacking': 'scan', 'attention': True}),
    ('f=V', {'dense_mlp': True, 'shared': True}),
])
def test_size_coincidences(coincide, changes):
  """Sizes that coincide on purpose: the traced route is right on every leaf, the
  default route right or loud."""
  spec = _spec(coincide=coincide, **changes)
  assert spec.coincide == coincide
  program, _ = _traced(spec)
  _default_right_or_loud(program)


def test_a_hidden_matrix_with_a_side_of_length_v_stays_hidden():
  """`f == V`: the dense MLP's `[d, V]` and `[V, d]` are hidden on both routes."""
  program, got = _traced(_spec(coincide='f=V', dense_mlp=True))
  assert program.spec.dims.f == program.spec.dims.V
  for m in ('w1', 'w2'):
    assert got[f'layer/mlp/{m}'] == mp.Truth('backbone', (), True)
  right = _default_right_or_loud(program)
  assert right['layer/mlp/w1'].hidden and right['layer/mlp/w2'].hidden


def test_pre_logits_is_hidden_despite_its_name():
  program, got = _traced(_spec(pre_logits=True))
  assert got['pre_logits/kernel'] == mp.Truth('backbone', (), True)
  assert got['lm_head/kernel'] == mp.Truth('backbone', (), False)
  right = _default_right_or_loud(program)
  assert right['pre_logits/kernel'].hidden


def test_input_layers_are_never_hidden_and_tables_get_no_batch_axis():
  """Gathered rows and a patch convolution of the raw input are input layers; a
  position table `[1, T, d]` and a class token `[1, 1, d]` stack nothing."""
  params = {'pos_embedding': jnp.zeros((1, 5, 8)), 'cls': jnp.zeros((1, 1, 8)),
            'table': jnp.zeros((11, 8))}
  axes = sj.moe_batch_axes(params)
  assert axes == {'pos_embedding': (), 'cls': (), 'table': ()}
  program, got = _traced(_spec(tokens='vit'))
  assert not got['embedding/kernel'].hidden
  _, got = _traced(BASE)
  assert not got['embed/embedding'].hidden


def test_under_muon_tiers_the_vit_trace_orthogonalises_its_hidden_matrices_only():
  """Under MUON_TIERS with the trace: the ViT's patch kernel, tables and query bias are
  not orthogonalised, the MAP head's kernels are."""
  program = mp.build(_spec(tokens='vit'))
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    trace = sj.trace_structure(program.fn, program.params, *program.args)
  params = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), program.params)
  rows = {r.path: r.tier for r in sj.label_table(
      sj.skewadam(1e-3, tiers=sj.MUON_TIERS, param_labels=trace), params)}
  for path in ('embedding/kernel', 'cls', 'pos_embedding', 'map_head/probe',
               'map_head/attention/query/bias', 'head/kernel'):
    assert rows[path] == 'backbone', path
  assert rows['map_head/attention/query/kernel'] == 'hidden'
