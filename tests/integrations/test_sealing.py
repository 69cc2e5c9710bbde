"""Sealed checkpoints: the optimizer's description and a sha256 of every file, written at
save and checked at restore, on every route the docs show; mismatch reports of one line
per parameter."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import skewadam_jax as sj
from examples import checkpointing


def _moe(experts: int = 8) -> dict:
  return {'embed': jnp.zeros((256, 64)),
          'moe': {'router': {'kernel': jnp.zeros((64, experts))},
                  'experts': {'w1': jnp.zeros((experts, 64, 128))}}}


def _coded(**expert_codec) -> dict:
  """MUON_CODED_TIERS with the experts' codec options changed."""
  codec = sj.MUON_CODED_TIERS['experts'].mu_codec
  return {**sj.MUON_CODED_TIERS, 'experts': sj.MUON_CODED_TIERS['experts'].replace(
      mu_codec=sj.Blockwise(**{**dict(bits=codec.bits, block_size=codec.block_size,
                                      mapping=codec.mapping, fit=codec.fit,
                                      rounding=codec.rounding, min_size=codec.min_size),
                               **expert_codec}))}


def _mismatches(tx_ours, tx_saved, ours=None, saved=None):
  ours, saved = ours or _moe(), saved or _moe()
  return sj.checkpoint_mismatches(
      jax.eval_shape(tx_ours.init, ours), jax.eval_shape(tx_saved.init, saved),
      description=sj.describe_state(tx_ours, ours),
      saved_description=sj.describe_state(tx_saved, saved))


# One option of the experts' codec changed: every one is named, with both values.
CODEC_CHANGES = {'mapping': 'dynamic', 'rounding': 'stochastic', 'min_size': 32768,
                 'block_size': 128, 'bits': 4, 'fit': 'exact'}


@pytest.mark.parametrize('option', sorted(CODEC_CHANGES))
def test_every_codec_option_that_differs_is_named(option):
  value = CODEC_CHANGES[option]
  recommended = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS)
  other = sj.skewadam(1e-3, tiers=_coded(**{option: value}))
  lines = _mismatches(other, recommended)
  line = next(x for x in lines if x.startswith('parameter moe/experts/w1:'))
  was = getattr(sj.MUON_CODED_TIERS['experts'].mu_codec, option)
  assert f"its momentum's codec differs: {option} checkpoint {was!r}, optimizer {value!r}" \
      in line, lines
  assert sum(x.startswith('parameter moe/experts/w1:') for x in lines) == 1
  assert _mismatches(recommended, recommended) == []


def test_an_estimator_option_that_differs_is_named():
  experts = sj.MUON_CODED_TIERS['experts']
  other = {**sj.MUON_CODED_TIERS, 'experts': experts.replace(
      second_moment=experts.second_moment.__class__(
          ns_steps=3, fallback=experts.second_moment.fallback))}
  lines = _mismatches(sj.skewadam(1e-3, tiers=other),
                      sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS))
  assert lines == ['parameter moe/experts/w1: its second-moment estimator differs: ns_steps '
                   'checkpoint 5, optimizer 3'], lines


def test_another_codec_mapping_is_refused_at_restore(tmp_path):
  """Same bits and block size, another mapping: every shape equal, the codes unreadable."""
  params = _moe()
  saver = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS)
  state = saver.init(params)
  checkpointing.save_checkpoint(tmp_path / 'c', {'params': params, 'opt_state': state},
                                sj.describe_state(saver, params))
  other = sj.skewadam(1e-3, tiers=_coded(mapping='dynamic'))
  target = checkpointing.abstract_target(other, jax.eval_shape(lambda: params))
  with pytest.raises(ValueError, match=r"parameter moe/experts/w1: its momentum's codec "
                     r"differs: mapping checkpoint 'linear', optimizer 'dynamic'"):
    checkpointing.restore_checkpoint(tmp_path / 'c', target, sj.describe_state(other, params))
  # And crash-safe training's route: a step saved with one codec, restored with another.
  ckpt = checkpointing.TrainCheckpointer(tmp_path / 'run', every=1, log=lambda line: None,
                                         use_async=False,
                                         description=sj.describe_state(saver, params))
  ckpt.save(1, {'params': params, 'opt_state': state})
  ckpt.close()
  ckpt = checkpointing.TrainCheckpointer(tmp_path / 'run', every=1, log=lambda line: None,
                                         description=sj.describe_state(other, params))
  with pytest.raises(ValueError, match=r"mapping checkpoint 'linear', optimizer 'dynamic'"):
    ckpt.restore(target)


@pytest.mark.parametrize('described', [False, True])
def test_four_experts_against_eight_is_a_shape_not_a_codec(described):
  tx = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS)
  ours, saved = _moe(8), _moe(4)
  kwargs = ({'description': sj.describe_state(tx, ours),
             'saved_description': sj.describe_state(tx, saved)} if described else {})
  lines = sj.checkpoint_mismatches(
      {'params': ours, 'opt_state': jax.eval_shape(tx.init, ours)},
      {'params': saved, 'opt_state': jax.eval_shape(tx.init, saved)}, **kwargs)
  w1 = [x for x in lines if x.startswith('parameter moe/experts/w1:')]
  assert len(w1) == 1 and 'codec differs' not in w1[0], lines
  assert (('its shape differs: checkpoint (4, 64, 128), optimizer (8, 64, 128)' in w1[0])
          if described else "(the parameter's shape differs)" in w1[0]), w1


def test_another_block_size_without_a_description_still_hints_at_the_codec():
  tx = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS)
  other = sj.skewadam(1e-3, tiers=_coded(block_size=128, fit='exact'))
  lines = sj.checkpoint_mismatches(jax.eval_shape(other.init, _moe()),
                                   jax.eval_shape(tx.init, _moe()))
  assert len(lines) == 1 and lines[0].endswith(
      "(the momentum's codec differs: its bits or block size)"), lines


# ------------------------------------------------------------------ one line per parameter


def test_reports_list_each_parameter_once_and_only_what_differs():
  """A coded checkpoint of boxed (Flax) params against another policy."""
  with nnx.use_eager_sharding(False):
    params = nnx.State({'stack': {'bank': {'down': nnx.Param(jnp.zeros((4, 64, 128)))}},
                        'out': {'bias': nnx.Param(jnp.zeros((64,))),
                                'kernel': nnx.Param(jnp.zeros((64, 256)))}})
  labels = {'stack': {'bank': {'down': 'experts'}},
            'out': {'bias': 'router', 'kernel': 'backbone'}}
  coded = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS, param_labels=labels,
                      batch_axes={'stack': {'bank': {'down': (0,)}},
                                  'out': {'bias': (), 'kernel': ()}})
  plain = sj.skewadam(1e-3, tiers=sj.ADAM_ROUTER_TIERS, param_labels=labels)
  lines = sj.checkpoint_mismatches(jax.eval_shape(plain.init, params),
                                   jax.eval_shape(coded.init, params))
  down = [x for x in lines if 'stack/bank/down' in x]
  assert len(down) == 1 and down[0].startswith('parameter stack/bank/down:'), lines
  assert 'no tier' not in down[0]
  assert not any('out/bias' in x for x in lines), lines  # (mu, v) on both sides
  for line in lines:
    if ': the checkpoint keeps its state in ' in line:
      ckpt_in, opt_in = line.split(': the checkpoint keeps its state in ')[1].split(
          ', this optimizer in ')
      assert ckpt_in != opt_in.split(';')[0], line


def test_label_table_finds_a_skewadam_in_a_chain_of_empty_params():
  tx = optax.chain(optax.clip_by_global_norm(1.0), sj.skewadam(1e-3))
  assert len(sj.label_table(tx, {})) == 0
  assert len(sj.label_table(tx, {'w': jnp.zeros((4, 4))})) == 1
  with pytest.raises(ValueError, match='contains no sj.skewadam'):
    sj.label_table(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), {})


# ------------------------------------------------------------------ integrity


def _sealed(tmp_path) -> tuple[Path, dict, optax.GradientTransformation]:
  params = _moe()
  tx = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS)
  tree = {'params': params, 'opt_state': tx.init(params)}
  checkpointing.save_checkpoint(tmp_path / 'c', tree, sj.describe_state(tx, params))
  return tmp_path / 'c', tree, tx


def _array_file(path: Path) -> Path:
  files = [p for p in path.rglob('*') if p.is_file() and '/d/' in p.as_posix()]
  return max(files, key=lambda p: p.stat().st_size)


DAMAGE = ('flipped', 'truncated', 'deleted _METADATA', 'deleted manifest')


@pytest.mark.parametrize('damage', DAMAGE)
def test_plain_route_names_the_damaged_file(tmp_path, damage):
  path, tree, tx = _sealed(tmp_path)
  target = checkpointing.abstract_target(tx, jax.eval_shape(lambda: tree['params']))
  if damage in ('flipped', 'truncated'):
    victim = _array_file(path)
    data = bytearray(victim.read_bytes())
    if damage == 'flipped':
      data[len(data) // 2] ^= 0x01
    else:
      data = data[:len(data) // 2]
    victim.write_bytes(bytes(data))
    name = victim.relative_to(path).as_posix()
  elif damage == 'deleted _METADATA':
    (path / '_METADATA').unlink()
    name = '_METADATA'
  else:
    (path / sj.integrations.sealing.MANIFEST).unlink()
    name = sj.integrations.sealing.MANIFEST
  with pytest.raises(ValueError, match=f'is damaged: {name} '):
    checkpointing.restore_checkpoint(path, target, sj.describe_state(tx, tree['params']))
  with pytest.raises(ValueError, match=f'damaged: {name} '):
    sj.check_checkpoint(path)


def test_an_intact_sealed_checkpoint_restores_bitwise(tmp_path):
  path, tree, tx = _sealed(tmp_path)
  assert sj.check_checkpoint(path) == sj.describe_state(tx, tree['params'])
  target = checkpointing.abstract_target(tx, jax.eval_shape(lambda: tree['params']))
  restored = checkpointing.restore_checkpoint(path, target, sj.describe_state(tx, tree['params']))
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_seal_refuses_what_is_not_a_description(tmp_path):
  with pytest.raises(ValueError, match='checkpoint directory'):
    sj.seal_checkpoint(tmp_path / 'missing')
  with pytest.raises(ValueError, match='describe_state'):
    sj.seal_checkpoint(tmp_path, {'params': {}})


@pytest.mark.parametrize('bits', [4, 6, 8])
def test_codes_read_with_another_mapping_are_noise(bits):
  # Why the codec is compared at restore: codes of one mapping decoded with another of
  # the same bits and block size keep every shape and give no error, only noise.
  x = jax.random.normal(jax.random.key(0), (64, 256))
  linear = sj.Blockwise(bits=bits, mapping='linear').for_leaf(x.shape, ())
  dynamic = sj.Blockwise(bits=bits, mapping='dynamic').for_leaf(x.shape, ())
  coded = linear.encode(x)
  misread = dynamic.decode(coded)
  assert misread.shape == x.shape
  assert float(jnp.linalg.norm(misread - x) / jnp.linalg.norm(x)) > 0.5
  assert float(jnp.linalg.norm(linear.decode(coded) - x) / jnp.linalg.norm(x)) < 0.2
