"""Flax boxes (`_flax`): one order of the NNX metadata keys for reading and writing."""

from __future__ import annotations

from flax import linen as nn
from flax import nnx
import jax.numpy as jnp

from skewadam_jax.structure import boxes as _flax


def _param(**metadata):
  with nnx.use_eager_sharding(False):
    return nnx.Param(jnp.zeros((2, 3)), **metadata)


def test_names_are_read_from_the_first_key_they_are_written_to():
  # A Variable may hold both spellings (`replace` adds the old one beside Flax 0.12's).
  box = _param(out_sharding=('a', 'b')).replace(sharding_names=('x', 'y'))
  assert _flax.NNX_KEYS[0] == 'out_sharding'
  assert _flax.box_names(box) == ('a', 'b')
  renamed = _flax.with_names(box, ('p', None))
  assert renamed.get_metadata('out_sharding') == ('p', None)
  assert renamed.get_metadata('sharding_names') == ('p', None)  # every key it holds
  assert _flax.box_names(renamed) == ('p', None)


def test_boxes_without_names_are_left_alone():
  bare = _param()
  assert _flax.box_names(bare) is None
  assert _flax.with_names(bare, ('a', 'b')) is bare
  assert _flax.box_names(jnp.zeros(3)) is None


def test_linen_boxes_and_paths_of_names():
  tree = {'dense': {'kernel': nn.Partitioned(jnp.zeros((2, 3)), ('embed', 'mlp'))},
          'nnx': {'w': _param(out_sharding=('exp', None))}, 'plain': jnp.zeros(2)}
  assert _flax.box_names(tree['dense']['kernel']) == ('embed', 'mlp')
  assert _flax.with_names(tree['dense']['kernel'], ('embed',)).names == ('embed',)
  assert _flax.axis_names_by_path(tree) == {('dense', 'kernel'): ('embed', 'mlp'),
                                           ('nnx', 'w'): ('exp', None)}
  unboxed = _flax.unbox(tree)
  assert unboxed['dense']['kernel'].shape == (2, 3) and unboxed['nnx']['w'].shape == (2, 3)
