"""`sj.hidden_param_labels` from names and shapes: right on conventional names and quiet,
loud on the 2-D matrices no name tells from an embedding or an output head.

Names are drawn by hypothesis where the input space is open: random tokens (from letters
that spell no pattern of `structure.hidden`) and the conventional names of real models.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, HealthCheck, settings
from hypothesis import strategies as st

import skewadam_jax as sj
import trees
from skewadam_jax.structure import paths as _paths

FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# Random module names: letters that spell no embedding, head, block, conv, bias or scale
# pattern (no vowels, no `f`, `l`, `m`, `p`, `w`), and no digits (numbered siblings).
TOKENS = st.text('bcdgjkqrtvxz', min_size=1, max_size=6)
EMBEDDINGS = ('embed', 'embedding', 'wte', 'tok_embeddings', 'embed_tokens', 'embedder',
              'token_embedder/embedding', 'word_embeddings/embedding')
HEADS = ('lm_head', 'output', 'unembed', 'head', 'classifier', 'logits_dense/kernel',
         'lm_head/kernel', 'output/weight')
BLOCK_MATRICES = ('attn/q_proj/kernel', 'self_attn/o_proj/kernel', 'attention/wq',
                  'mlp/kernel', 'mlp/wi_0/kernel', 'feed_forward/w1', 'ffn/w2',
                  'mlp/down_proj/weight', 'attn/c_proj/kernel', 'shared_expert/up_proj')


_tree = trees.abstract_tree


def _labels(params: Any) -> tuple[dict[str, str], list[str]]:
  """Labels by path, and the messages of the `UnsureLabelWarning`s raised."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    labels = sj.hidden_param_labels(params)
  flat, _ = jax.tree_util.tree_flatten_with_path(labels)
  messages = [str(w.message) for w in caught if issubclass(w.category, sj.UnsureLabelWarning)]
  return {_paths.path_str(p): x for p, x in flat}, messages


@FAST
@given(names=st.lists(TOKENS, min_size=4, max_size=4, unique=True),
       d=st.integers(2, 24), extra=st.integers(1, 40))
def test_matrices_that_names_cannot_tell_apart_are_backbone_and_reported(names, d, extra):
  """`{a: [V, d], b: {c: [d, d]}, z: [d, V]}` under random names: an embedding and a head
  or three hidden matrices alike. Backbone (safe for either), in one warning that names
  them and gives the trace as the fix."""
  a, b, c, z = names
  v = d + extra
  got, messages = _labels(_tree({a: (v, d), f'{b}/{c}': (d, d), z: (d, v)}))
  assert got == {a: 'backbone', f'{b}/{c}': 'backbone', z: 'backbone'}
  assert len(messages) == 1, messages
  line = messages[0].splitlines()[1]
  for path in (a, f'{b}/{c}', z):
    assert f'{path} [' in line
  assert "labelled 'backbone'" in line
  assert 'sj.trace_structure(loss_fn, params, batch)' in messages[0]


@FAST
@given(embed=st.sampled_from(EMBEDDINGS), head=st.sampled_from(HEADS + (None,)),
       blocks=st.lists(st.sampled_from(BLOCK_MATRICES), min_size=1, max_size=4, unique=True),
       layers=st.integers(0, 3), d=st.integers(2, 16), extra=st.integers(1, 40))
def test_conventional_names_are_right_and_quiet(embed, head, blocks, layers, d, extra):
  """Embeddings and heads (by name, or an untied head by the vocabulary's size) stay
  backbone, the matrices of attention and MLP blocks are hidden, with no warning:
  alone, or in a list of layers."""
  v = 2 * d + extra  # no block matrix [d, 2 d] has the vocabulary's size
  paths = {embed: (v, d), 'final_norm/scale': (d,)}
  if head is not None:
    paths[head] = (v, d) if head.endswith('weight') else (d, v)
  prefixes = [f'layers/{i}/' for i in range(layers)] or ['']
  for prefix in prefixes:
    paths.update({prefix + b: (d, 2 * d) for b in blocks})
    paths[prefix + 'norm/scale'] = (d,)
  got, messages = _labels(_tree(paths))
  assert messages == []
  want = {p: 'hidden' if any(p.endswith(b) for b in blocks) else 'backbone' for p in paths}
  assert got == want


@FAST
@given(names=st.lists(TOKENS, min_size=4, max_size=4, unique=True),
       layers=st.integers(2, 4), d=st.integers(2, 16))
def test_matrices_repeated_across_layers_are_hidden_whatever_their_names(names, layers, d):
  """An embedding or a head is used once per model: the same matrix in every numbered
  layer is hidden (a list or `block_0 .. block_n`); the ends stay unsure."""
  a, b, c, z = names
  paths = {a: (d + 7, d), z: (d, 3)}
  for i in range(layers):
    paths.update({f'{b}/{i}/{c}': (d, d), f'{b}_{i}/{c}': (d, 2 * d)})
  got, messages = _labels(_tree(paths))
  assert {p for p, x in got.items() if x == 'hidden'} == set(paths) - {a, z}
  assert len(messages) == 1 and f'{a} [' in messages[0] and f'{z} [' in messages[0]


def test_a_pure_jax_mlp_keeps_its_input_and_output_layers_off_the_hidden_tier():
  """`[(W, b), ...]`: the middle layers repeat, the first and last are used once."""
  sizes = [(784, 64), (64, 64), (64, 64), (64, 10)]
  params = [(jnp.zeros(s), jnp.zeros(s[1])) for s in sizes]
  with pytest.warns(sj.UnsureLabelWarning, match=r'0/0 \[784, 64\], 3/0 \[64, 10\]'):
    labels = sj.hidden_param_labels(params)
  assert [w for w, _ in labels] == ['backbone', 'hidden', 'hidden', 'backbone']


@pytest.mark.parametrize('path, shape, tier', [
    ('mlp/shared_expert_gate/kernel', (16, 1), 'backbone'),  # one column: a vector
    ('mlp/out_gate/kernel', (3, 16, 1), 'backbone'),  # [L, d, 1]
    ('mlp/row', (1, 16), 'backbone'),
    ('attn/key/bias', (4, 8), 'backbone'),  # a bias per head, not a matrix
    ('attn/conv1d/kernel', (4, 1, 24), 'backbone'),  # depthwise [k, 1, C]
    ('attn/conv1d/weight', (24, 1, 4), 'backbone'),  # depthwise, PyTorch [C, 1, k]
    ('mixer/conv/kernel', (24, 4), 'backbone'),  # [C, k]: taps, no input channels
    ('mlp/conv/kernel', (3, 16, 16), 'hidden'),  # a full convolution [k, in, out]
    ('attn/key/kernel', (16, 1, 8), 'hidden'),  # one kv head: [d, 1, head_dim]
])
def test_what_has_no_matrix_to_orthogonalise_is_not_hidden(path, shape, tier):
  got, messages = _labels(_tree({path: shape, 'embed': (40, 16)}))
  assert (got[path], messages) == (tier, [])


@pytest.mark.parametrize('preset', ['MUON_TIERS', 'MUON_CODED_TIERS'])
def test_the_code_the_warning_suggests_gives_the_hidden_matrices(preset):
  """The fix, run as printed with the user's loss, params and batch, keeps the user's
  policy (by its public name): the roles decide, with no warning."""
  params = {'a': jnp.ones((32, 8)), 'b': {'c': jnp.ones((8, 8))}, 'z': jnp.ones((8, 32))}

  def loss_fn(p, ids):
    return jnp.mean((p['a'][ids] @ p['b']['c'] @ p['z']) ** 2)

  with pytest.warns(sj.UnsureLabelWarning) as record:
    sj.label_table(sj.skewadam(1e-3, tiers=getattr(sj, preset)), params)
  message = str(record[0].message)
  code = '\n'.join(line[4:] for line in message.split('\n\n')[1].splitlines())
  assert f'tiers=sj.{preset}, param_labels=trace' in code
  namespace = {'sj': sj, 'loss_fn': loss_fn, 'params': params,
               'batch': jnp.zeros((4,), jnp.int32), 'learning_rate': 1e-3}
  with warnings.catch_warnings():
    warnings.simplefilter('error', sj.UnsureLabelWarning)
    exec(code, namespace)  # noqa: S102 (the printed fix, run as printed)
    rows = sj.label_table(namespace['tx'], params)
  assert {r.path: r.tier for r in rows} == {'a': 'backbone', 'b/c': 'hidden', 'z': 'backbone'}
