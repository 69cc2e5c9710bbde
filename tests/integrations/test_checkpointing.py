"""Crash-safe checkpoints: resume equals an uninterrupted run, damaged steps are skipped,
and a checkpoint of another optimizer is refused with a message naming what differs."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import skewadam_jax as sj
from examples import checkpointing

ROOT = Path(__file__).resolve().parents[2]

# MoE-shaped paths, so that `moe_param_labels` gives every SkewAdam tier.
SHAPES = {
    'blocks/0/attn/q_proj/kernel': (16, 16),
    'blocks/0/attn_norm/scale': (16,),
    'blocks/1/moe/router/kernel': (16, 4),
    'blocks/1/moe/experts/w1': (4, 16, 32),
}


def _params() -> dict:
  rng = np.random.default_rng(0)
  out: dict = {}
  for path, shape in SHAPES.items():
    node = out
    *parents, leaf = path.split('/')
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = jnp.asarray(0.1 * rng.standard_normal(shape), jnp.float32)
  return out


def _grads(params, step):
  """Pseudo-gradients that are a function of (params, step) only."""
  return jax.tree.map(lambda p: jnp.sin(7.0 * p * (step + 1.0)) + 0.01 * step, params)


def _target(tx, params):
  return checkpointing.abstract_target(tx, jax.eval_shape(lambda: params))


_STEPS: dict = {}
# One instance each, so that each step compiles once for the whole module.
SKEWADAM = sj.skewadam(1e-2, weight_decay=0.1)
ADAMPM = sj.adampm(1e-2, group_size=8)


def _train(tx, directory, steps, *, stop_after=None, every=2, use_async=True, log=None):
  """Trains to `steps` with checkpoints, resuming from `directory`; returns the final
  `{'params', 'opt_state'}` (or, a crash, the state after `stop_after` steps of this
  call, whatever the checkpoints hold)."""
  params = _params()
  opt_state = tx.init(params)
  ckpt = checkpointing.TrainCheckpointer(directory, every=every, use_async=use_async,
                                         log=log or (lambda line: None))
  restored = ckpt.restore(_target(tx, params))
  start = 0
  if restored is not None:
    start, state, _ = restored
    params, opt_state = state['params'], state['opt_state']
  if id(tx) not in _STEPS:  # one compilation per optimizer
    _STEPS[id(tx)] = (tx, jax.jit(lambda p, s, t: _apply(tx, p, s, t), donate_argnums=(0, 1)))
  step_fn = _STEPS[id(tx)][1]
  for i in range(start, steps):
    params, opt_state = step_fn(params, opt_state, jnp.float32(i))
    ckpt.save(i + 1, {'params': params, 'opt_state': opt_state}, force=i + 1 == steps)
    if stop_after is not None and i + 1 - start == stop_after:
      ckpt.wait()
      return {'params': params, 'opt_state': opt_state}
  ckpt.close()
  return {'params': params, 'opt_state': opt_state}


def _apply(tx, params, opt_state, t):
  updates, opt_state = tx.update(_grads(params, t), opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _steps(directory: Path) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _array_file(step_dir: Path) -> Path:
  """The largest array data file of a step."""
  files = [p for p in (step_dir / 'state').rglob('*') if p.is_file() and '/d/' in p.as_posix()]
  return max(files, key=lambda p: p.stat().st_size)


# ----------------------------------------------------------------------------- resume


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory) -> dict:
  """`{'params', 'opt_state'}` after 6 SkewAdam steps without a crash.

  Also restores them once, so that the one-time costs (compiling the step, Orbax's
  first restore) are paid here rather than by the first test.
  """
  directory = tmp_path_factory.mktemp('full')
  full = _train(SKEWADAM, directory, 6)
  assert checkpointing.mismatches(full, _train(SKEWADAM, directory, 6)) == []
  return full


@pytest.mark.parametrize('use_async', [True, False], ids=['async', 'sync'])
def test_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, uninterrupted, use_async):
  _train(SKEWADAM, tmp_path, 6, stop_after=3, use_async=use_async)  # dies after step 3
  assert _steps(tmp_path) == [2]  # step 3 was never saved
  resumed = _train(SKEWADAM, tmp_path, 6, use_async=use_async)
  assert checkpointing.mismatches(uninterrupted, resumed) == []
  assert _steps(tmp_path)[-1] == 6


def test_a_finished_run_restores_its_last_step_and_trains_no_more(tmp_path):
  full = _train(SKEWADAM, tmp_path, 4)
  lines: list[str] = []
  again = _train(SKEWADAM, tmp_path, 4, log=lines.append)
  assert checkpointing.mismatches(full, again) == []
  assert any('restored step 4' in line for line in lines)


def test_every_saved_step_has_a_manifest_of_its_files(tmp_path):
  _train(SKEWADAM, tmp_path, 4)
  for step in _steps(tmp_path):
    assert checkpointing.verify_step(tmp_path / str(step)) is None
    assert (tmp_path / str(step) / checkpointing.MANIFEST).is_file()


def test_the_three_newest_steps_are_kept_by_default(tmp_path):
  # docs/checkpointing.md: `keep` (3) steps are kept, so a damaged newest step has a
  # previous one to fall back to.
  _train(SKEWADAM, tmp_path, 10, every=2)
  assert _steps(tmp_path) == [6, 8, 10]


def test_temporary_directory_of_an_unfinished_save_is_never_restored(tmp_path):
  tx = SKEWADAM
  _train(tx, tmp_path, 4)
  # What a kill during an async save leaves: a copy of a step under Orbax's tmp name.
  os.rename(tmp_path / '4', tmp_path / '4.orbax-checkpoint-tmp-123')
  lines: list[str] = []
  restored = checkpointing.TrainCheckpointer(tmp_path, every=2, log=lines.append).restore(
      _target(tx, _params()))
  assert restored[0] == 2


# ----------------------------------------------------------------------------- damage


def _damage(step_dir: Path, how: str) -> None:
  f = _array_file(step_dir)
  data = bytearray(f.read_bytes())
  if how == 'truncate':
    f.write_bytes(bytes(data[:len(data) // 2]))
  elif how == 'flip':
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
  elif how == 'no_manifest':
    (step_dir / checkpointing.MANIFEST).unlink()
  elif how == 'delete':
    f.unlink()


@pytest.mark.parametrize('how,why', [('truncate', 'truncated'), ('flip', 'corrupted bytes'),
                                     ('no_manifest', 'incomplete'), ('delete', 'missing')])
def test_damaged_latest_step_is_named_skipped_and_the_previous_one_restored(
    tmp_path, uninterrupted, how, why):
  _train(SKEWADAM, tmp_path / 'run', 6, stop_after=4)  # killed after step 4 was saved
  _damage(tmp_path / 'run' / '4', how)
  lines: list[str] = []
  resumed = _train(SKEWADAM, tmp_path / 'run', 6, log=lines.append)
  assert any('step 4' in line and why in line for line in lines), lines
  assert any('restored step 2' in line for line in lines), lines
  assert (tmp_path / 'run' / checkpointing.DAMAGED_DIR / '4').is_dir()  # kept for a look
  assert checkpointing.mismatches(uninterrupted, resumed) == []


def test_no_intact_step_stops_with_an_error_naming_the_steps(tmp_path):
  tx = SKEWADAM
  _train(tx, tmp_path, 2, every=2)
  _damage(tmp_path / '2', 'flip')
  ckpt = checkpointing.TrainCheckpointer(tmp_path, every=2, log=lambda line: None)
  with pytest.raises(RuntimeError, match=r'No intact checkpoint.*step\(s\) 2'):
    ckpt.restore(_target(tx, _params()))
  assert (tmp_path / '2').is_dir()  # left in place: a rerun refuses again


def test_explicit_step_that_is_damaged_is_an_error(tmp_path):
  tx = SKEWADAM
  _train(tx, tmp_path, 4, every=2)
  _damage(tmp_path / '2', 'truncate')
  ckpt = checkpointing.TrainCheckpointer(tmp_path, every=2, log=lambda line: None)
  with pytest.raises(RuntimeError, match='step 2'):
    ckpt.restore(_target(tx, _params()), step=2)
  with pytest.raises(RuntimeError, match='No checkpoint of step 3'):
    ckpt.restore(_target(tx, _params()), step=3)


def test_bad_checkpointer_arguments_are_value_errors(tmp_path):
  with pytest.raises(ValueError, match='every'):
    checkpointing.TrainCheckpointer(tmp_path, every=0)
  with pytest.raises(ValueError, match='keep'):
    checkpointing.TrainCheckpointer(tmp_path, every=1, keep=0)


# ----------------------------------------------------------------------------- mismatch


def _labels_all_backbone(params):
  return jax.tree.map(lambda _: 'backbone', params)


OTHERS = {
    'optimizer': (sj.adampm(1e-2), r'optimizer state type differs: the checkpoint holds '
                  r'state fields count, mu, v, v_row, v_col; this optimizer builds state '
                  r'fields count, mu, nu'),
    'tier policy': (sj.skewadam(1e-2, tiers=sj.ADAM_ROUTER_TIERS),
                    r"blocks/1/moe/router/kernel: the checkpoint keeps its state in "
                    r"\(v\), this optimizer in \(mu, v\)"),
    'labels': (sj.skewadam(1e-2, param_labels=_labels_all_backbone),
               r"blocks/1/moe/experts/w1: the checkpoint keeps its state in "
               r"\(v_row, v_col\), this optimizer in \(mu, v_row, v_col\)"),
    'mu dtype': (sj.skewadam(1e-2, tiers={
        **sj.PUBLISHED_TIERS, 'backbone': sj.PUBLISHED_TIERS['backbone'].replace(
            mu_dtype=jnp.bfloat16)}),
        r'dtype differs at opt_state/0/mu/blocks/0/attn/q_proj/kernel: checkpoint float32, '
        r'optimizer bfloat16'),
}


@pytest.mark.parametrize('other', sorted(OTHERS))
def test_restoring_with_another_optimizer_names_what_differs(tmp_path, other):
  _train(SKEWADAM, tmp_path, 2, every=2)
  tx, message = OTHERS[other]
  ckpt = checkpointing.TrainCheckpointer(tmp_path, every=2, log=lambda line: None)
  with pytest.raises(ValueError, match=message) as err:
    ckpt.restore(_target(tx, _params()))
  assert 'partial_restore' not in str(err.value) and 'step 2' in str(err.value)


def test_restoring_with_another_group_size_names_the_shapes(tmp_path):
  params = _params()
  saver = checkpointing.TrainCheckpointer(tmp_path, every=2, log=lambda line: None)
  saver.save(2, {'params': params, 'opt_state': ADAMPM.init(params)})
  saver.close()
  ckpt = checkpointing.TrainCheckpointer(tmp_path, every=2, log=lambda line: None)
  with pytest.raises(ValueError, match=r'shape differs at opt_state/0/nu/blocks/1/moe/experts/'
                     r'w1: checkpoint \(4, 16, 4\), optimizer \(4, 16, 8\)'):
    ckpt.restore(_target(sj.adampm(1e-2, group_size=4), _params()))


def test_restoring_other_params_names_the_leaf(tmp_path):
  _train(SKEWADAM, tmp_path, 2, every=2)
  params = _params()
  params['blocks']['0']['attn_norm']['scale'] = jnp.ones((8,))
  ckpt = checkpointing.TrainCheckpointer(tmp_path, every=2, log=lambda line: None)
  with pytest.raises(ValueError, match=r'shape differs at params/blocks/0/attn_norm/scale: '
                     r'checkpoint \(16,\), optimizer \(8,\)'):
    ckpt.restore(_target(sj.skewadam(1e-2), params))


def test_mismatches_of_the_same_optimizer_are_empty():
  params = _params()
  for tx in (sj.skewadam(1e-2), sj.adampm(1e-2), optax.adamw(1e-2)):
    state = jax.eval_shape(tx.init, params)
    assert sj.checkpoint_mismatches(state, state) == []
    sj.check_checkpoint_matches(state, state)


def test_mismatches_read_orbax_metadata_objects(tmp_path):
  tx = sj.skewadam(1e-2)
  params = _params()
  tree = {'params': params, 'opt_state': tx.init(params)}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'c', tree)
  checkpointer.wait_until_finished()
  metadata = ocp.StandardCheckpointer().metadata(tmp_path / 'c')
  assert sj.checkpoint_mismatches(jax.eval_shape(lambda: tree), metadata) == []
  with pytest.raises(ValueError, match='the checkpoint holds state fields count, mu, v, v_row'):
    sj.check_checkpoint_matches(
        {'params': params, 'opt_state': sj.adampm(1e-2).init(params)}, metadata)


def test_a_state_of_partitioned_tiers_names_each_parameters_tier():
  """A checkpoint of tiers composed with `optax.partition` (SkewAdam's state before it
  kept one state for every tier) names the tier of each parameter whose state differs."""
  params = _params()
  labels = sj.moe_param_labels(params)
  partitioned = optax.partition(
      {name: sj.scale_by_tiered_adam(tier=tier) for name, tier in sj.PUBLISHED_TIERS.items()},
      labels)
  saved = jax.eval_shape(partitioned.init, params)
  want = jax.eval_shape(sj.scale_by_tiers(sj.PUBLISHED_TIERS, labels).init, params)
  lines = sj.checkpoint_mismatches(want, saved)
  assert lines[0].startswith('the checkpoint holds this state in another layout')
  assert lines[1] == ('optimizer state type differs: the checkpoint holds tiers backbone, '
                      'experts, router; state fields count, mu, v, v_row, v_col; this '
                      'optimizer builds state fields count, mu, v, v_row, v_col')
  assert ("parameter blocks/1/moe/experts/w1: the checkpoint keeps its state in tier "
          "'experts' (v_row, v_col), this optimizer in (v_row, v_col)") in lines


# ------------------------------------------------------------------ another layout


def _partitioned_skewadam(params, learning_rate=1e-2, weight_decay=0.1):
  """SkewAdam as a chain of its tiers under `optax.partition`: its earlier layout, and
  how users who compose `scale_by_tiered_adam` per tier build it."""
  labels = sj.moe_param_labels(params)
  decays = jax.tree.map(lambda label: sj.PUBLISHED_TIERS[label].apply_weight_decay, labels)
  return optax.chain(
      optax.partition({name: sj.scale_by_tiered_adam(tier=tier)
                       for name, tier in sj.PUBLISHED_TIERS.items()}, labels),
      optax.add_decayed_weights(weight_decay, decays),
      optax.scale_by_learning_rate(learning_rate))


def _train_steps(tx, params, opt_state, start, stop):
  step = jax.jit(lambda p, s, t: _apply(tx, p, s, t))
  for i in range(start, stop):
    params, opt_state = step(params, opt_state, jnp.float32(i))
  return params, opt_state


def _save(path, params, opt_state):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, {'params': params, 'opt_state': opt_state})
  checkpointer.wait_until_finished()


def test_a_checkpoint_of_partitioned_tiers_resumes_in_one_state(tmp_path):
  """A checkpoint written with the tiers under `optax.partition` restores into
  `skewadam`'s one state, and training goes on exactly as it would have."""
  old = _partitioned_skewadam(_params())
  params, opt_state = _train_steps(old, _params(), old.init(_params()), 0, 3)
  _save(tmp_path / 'c', params, opt_state)
  expected, _ = _train_steps(old, params, opt_state, 3, 6)

  target = _target(SKEWADAM, _params())
  metadata = ocp.StandardCheckpointer().metadata(tmp_path / 'c')
  with pytest.raises(ValueError, match=r'Differences:\n  - the checkpoint holds this state '
                     r'in another layout .*sj.relayout_state\(restored, target\)'):
    sj.check_checkpoint_matches(target, metadata)
  as_saved = ocp.StandardCheckpointer().restore(tmp_path / 'c')  # nested dicts and lists
  state = sj.relayout_state(as_saved, target)
  assert jax.tree.structure(state) == jax.tree.structure(target)
  assert int(state['opt_state'][0].count) == 3
  got, _ = _train_steps(SKEWADAM, state['params'], state['opt_state'], 3, 6)
  jax.tree.map(np.testing.assert_array_equal, got, expected)

  # Onto the checkpoint's layout with this run's shardings, then converted: the same.
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  sharded = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                         target)
  onto = sj.saved_layout_target(sharded, metadata)
  restored = ocp.StandardCheckpointer().restore(tmp_path / 'c', onto)
  again = sj.relayout_state(restored, sharded)
  jax.tree.map(np.testing.assert_array_equal, again, state)
  assert all(x.sharding == sharding for x in jax.tree.leaves(again))


def test_a_checkpoint_in_one_state_restores_into_partitioned_tiers(tmp_path):
  params, opt_state = _train_steps(SKEWADAM, _params(), SKEWADAM.init(_params()), 0, 2)
  _save(tmp_path / 'c', params, opt_state)
  old = _partitioned_skewadam(_params())
  target = _target(old, _params())
  state = sj.relayout_state(ocp.StandardCheckpointer().restore(tmp_path / 'c'), target)
  counts = [inner.inner_state.count for inner in state['opt_state'][0].inner_states.values()]
  assert [int(c) for c in counts] == [2, 2, 2]  # one count per tier, from the one state
  got, _ = _train_steps(old, state['params'], state['opt_state'], 2, 4)
  expected, _ = _train_steps(SKEWADAM, params, opt_state, 2, 4)
  jax.tree.map(np.testing.assert_array_equal, got, expected)


def test_another_state_is_not_relaid_out(tmp_path):
  params = _params()
  _save(tmp_path / 'c', params, ADAMPM.init(params))
  as_saved = ocp.StandardCheckpointer().restore(tmp_path / 'c')
  with pytest.raises(ValueError, match=r'`sj.relayout_state\(restored, target\)`: the '
                     r'checkpoint does not hold this state in another layout(.|\n)*'
                     r'opt_state/0/v_row/blocks/0/attn/q_proj/kernel: not in the checkpoint'):
    sj.relayout_state(as_saved, _target(SKEWADAM, params))
  with pytest.raises(ValueError, match=r'opt_state/0/nu/blocks/1/moe/experts/w1: the '
                     r'checkpoint has \(4, 16, 4\) float32, this optimizer \(4, 16, 16\) '
                     r'float32'):
    sj.relayout_state(as_saved, _target(sj.adampm(1e-2, group_size=2), params))
  assert 'another layout' not in ' '.join(sj.checkpoint_mismatches(
      _target(SKEWADAM, params), ocp.StandardCheckpointer().metadata(tmp_path / 'c')))


def test_step_counts_that_differ_between_tiers_are_an_error():
  old = _partitioned_skewadam(_params())
  state = old.init(_params())
  inner = state[0].inner_states
  inner['router'] = inner['router']._replace(
      inner_state=inner['router'].inner_state._replace(count=jnp.int32(5)))
  with pytest.raises(ValueError, match=r'0/inner_states/backbone/inner_state/count and '
                     r'0/inner_states/router/inner_state/count are one value'):
    sj.relayout_state(state, jax.eval_shape(SKEWADAM.init, _params()))


def test_long_mismatch_lists_are_cut_with_a_count():
  params = {f'layer{i}': {'kernel': jnp.zeros((4, 8))} for i in range(10)}
  saved = jax.eval_shape(sj.adampm(1e-2, group_size=8).init, params)
  want = jax.eval_shape(sj.adampm(1e-2, group_size=4).init, params)
  lines = sj.checkpoint_mismatches(want, saved)
  assert len(lines) == sj.integrations.saved_tree.MAX_LISTED + 1 and lines[-1] == '... and 4 more'


# ----------------------------------------------------------------------------- examples


# The calibration step: a fresh process that imports the library and compiles and runs a
# small SkewAdam step, the work every launch of the crash harness starts with.
# CALIBRATION_IDLE_S: its seconds measured on a 2-core machine running one other heavy
# job (the crash harness on one core): 9.0 s. Each launch there gets SLOW_TEST_IDLE_S,
# the whole test three times that; a slower machine gets them in proportion.
CALIBRATION = ('import time; t = time.perf_counter(); import jax, jax.numpy as jnp, '
               'skewadam_jax as sj; tx = sj.skewadam(1e-3, tiers=sj.MUON_CODED_TIERS); '
               "p = {'moe': {'experts': {'w1': jnp.ones((4, 64, 128))}, "
               "'router': {'kernel': jnp.ones((64, 4))}}}; s = tx.init(p); "
               'jax.block_until_ready(jax.jit(tx.update)(p, s, p)); '
               'print(time.perf_counter() - t)')
CALIBRATION_IDLE_S = 9.0
SLOW_TEST_IDLE_S = 600.0


def _calibration_seconds() -> float:
  """This machine's seconds for the calibration step now, in a fresh process."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  out = subprocess.run([sys.executable, '-c', CALIBRATION], env=env, capture_output=True,
                       text=True, check=True)
  return float(out.stdout.split()[-1])


def _scaled_timeout(measured_s: float, base_s: float) -> float:
  """`base_s` scaled by how much slower than idle the calibration step ran (`measured_s`
  against `CALIBRATION_IDLE_S`), never below `base_s`."""
  return base_s * max(1.0, measured_s / CALIBRATION_IDLE_S)


def _calibrated_timeout(base_s: float = SLOW_TEST_IDLE_S) -> float:
  """`base_s` scaled by how much slower than idle this machine runs the calibration
  step now (never below `base_s`): a busy machine gets the time it needs."""
  return _scaled_timeout(_calibration_seconds(), base_s)


def _run(args: list[str], cwd: Path, timeout: float = SLOW_TEST_IDLE_S
         ) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_the_calibrated_timeout_grows_with_a_slower_machine():
  measured = _calibration_seconds()
  assert 0.0 < measured < 10 * SLOW_TEST_IDLE_S
  assert _calibrated_timeout(100.0) >= 100.0
  # An idle or faster machine gets the base; a slower one proportionally more.
  assert _scaled_timeout(CALIBRATION_IDLE_S / 2, 100.0) == 100.0
  assert _scaled_timeout(CALIBRATION_IDLE_S, 100.0) == 100.0
  assert _scaled_timeout(2 * CALIBRATION_IDLE_S, 100.0) == 200.0
  assert _scaled_timeout(3 * measured + CALIBRATION_IDLE_S, 100.0) > 100.0


@pytest.mark.slow
@pytest.mark.parametrize('target', ['moe_lm', 'sharded_moe'])
def test_examples_resume_bitwise_after_sigkill(tmp_path, target):
  """tools/crash_resume.py on an example (the committed code): 3 kills."""
  out = tmp_path / 'out'
  timeout = _calibrated_timeout()
  r = _run([str(ROOT / 'tools' / 'crash_resume.py'), '--target', target, '--kills', '3',
            '--steps', '12', '--every', '3', '--out', str(out), '--work', str(tmp_path / 'w'),
            '--launch-timeout', str(timeout)], ROOT, timeout=3 * timeout)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
  s = json.loads((out / 'crash_resume.json').read_text())['results'][0]['summary']
  assert s['kills'] == 3 and s['bitwise_equal'] and s['partial_resumes'] == 0
  assert s['steps_from_partial'] == 0 and s['resumes_wrong'] == 0, s
  # A kill during start-up or the first save leaves nothing to resume from; after every
  # other kill the restart resumes (unless it was itself killed before it said).
  assert s['resumes'] == s['resumes_due'] and s['resumes_due'] >= 1, s


@pytest.mark.slow
def test_two_process_run_resumes_bitwise_after_one_process_is_killed(tmp_path):
  """tools/crash_resume.py --multihost-kills 1: one `jax.distributed` process killed
  during a save, both restarted, the final params + state bitwise the uninterrupted."""
  out = tmp_path / 'out'
  timeout = _calibrated_timeout()
  r = _run([str(ROOT / 'tools' / 'crash_resume.py'), '--target', 'none', '--multihost-kills',
            '1', '--out', str(out), '--work', str(tmp_path / 'w'), '--launch-timeout',
            str(timeout)], ROOT, timeout=3 * timeout)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
  mh = json.loads((out / 'crash_resume_multihost.json').read_text())['multihost']
  assert mh['bitwise_equal'] and mh['arrays_compared'] > 10
  killed = [la for la in mh['launches'] if la['killed_at_save']]
  assert len(killed) == 1 and killed[0]['resumed_from'] > 0


def test_plain_restore_helper_refuses_another_optimizer(tmp_path):
  params = _params()
  checkpointing.save_checkpoint(tmp_path / 'c', {'params': params,
                                                 'opt_state': SKEWADAM.init(params)})
  with pytest.raises(ValueError, match='optimizer state type differs'):
    checkpointing.restore_checkpoint(tmp_path / 'c', _target(ADAMPM, params))
  restored = checkpointing.restore_checkpoint(tmp_path / 'c', _target(SKEWADAM, params))
  assert checkpointing.mismatches(restored['params'], params) == []


# A checkpoint of the Adam-router tiers (the router keeps `mu` and `v`) restored with the
# published tiers (the router keeps `v`; its `mu` slot is None): the target has one leaf
# fewer than the checkpoint.
ADAM_ROUTER = sj.skewadam(1e-2, tiers=sj.ADAM_ROUTER_TIERS)
FEWER_LEAVES = r'blocks/1/moe/router/kernel: the checkpoint keeps its state in \(mu, v\), ' \
    r'this optimizer in \(v\)'


def test_plain_orbax_restores_a_target_with_fewer_leaves_silently(tmp_path):
  """The hazard that the checks below exist for (docs/checkpointing.md): if Orbax starts
  refusing such a restore, this fails and the doc should say so."""
  params = _params()
  saved = {'params': params, 'opt_state': ADAM_ROUTER.init(params)}
  checkpointing.save_checkpoint(tmp_path / 'c', saved)
  target = _target(SKEWADAM, params)
  restored = ocp.StandardCheckpointer().restore(os.path.abspath(tmp_path / 'c'), target)
  assert len(jax.tree.leaves(restored)) == len(jax.tree.leaves(saved)) - 1
  assert jax.tree.structure(restored) == jax.tree.structure(target)
  metadata = ocp.StandardCheckpointer().metadata(os.path.abspath(tmp_path / 'c'))
  assert any('(mu, v)' in line for line in sj.checkpoint_mismatches(target, metadata))
  # The other way round, too: the target's array slot comes back None.
  checkpointing.save_checkpoint(tmp_path / 'p', {'params': params,
                                                 'opt_state': SKEWADAM.init(params)})
  restored = ocp.StandardCheckpointer().restore(os.path.abspath(tmp_path / 'p'),
                                                _target(ADAM_ROUTER, params))
  assert restored['opt_state'][0].mu['blocks']['1']['moe']['router']['kernel'] is None


def test_restoring_a_target_with_fewer_leaves_names_what_differs(tmp_path):
  params = _params()
  saver = checkpointing.TrainCheckpointer(tmp_path / 'run', every=2, log=lambda line: None)
  saver.save(2, {'params': params, 'opt_state': ADAM_ROUTER.init(params)})
  saver.close()
  ckpt = checkpointing.TrainCheckpointer(tmp_path / 'run', every=2, log=lambda line: None)
  with pytest.raises(ValueError, match=FEWER_LEAVES) as err:
    ckpt.restore(_target(SKEWADAM, params))
  assert 'step 2' in str(err.value)
  checkpointing.save_checkpoint(tmp_path / 'c', {'params': params,
                                                 'opt_state': ADAM_ROUTER.init(params)})
  with pytest.raises(ValueError, match=FEWER_LEAVES):
    checkpointing.restore_checkpoint(tmp_path / 'c', _target(SKEWADAM, params))


def test_crash_harness_trains_every_preset_by_name(tmp_path):
  """`--optimizer NAME`: every tier preset, AdamPM and the AdamW baseline."""
  sys.path.insert(0, str(ROOT / 'tools'))
  try:
    import crash_resume
  finally:
    sys.path.remove(str(ROOT / 'tools'))
  from examples.moe_lm import optimizers as opt_lib
  assert set(crash_resume.PRESETS) == {'skewadam', 'muon', 'muon-coded', 'adampm', 'adamw'}
  assert crash_resume.PRESETS['muon-coded'] == opt_lib.RECOMMENDED
  assert crash_resume.PRESETS['adamw'] == opt_lib.BASELINE
  for name, train_name in crash_resume.PRESETS.items():
    args = crash_resume.build_parser().parse_args(['--optimizer', name])
    cmd = crash_resume.command('moe_lm', args, tmp_path, tmp_path, tmp_path)
    assert cmd[cmd.index('--optimizer') + 1] == train_name in opt_lib.OPTIMIZERS
  with pytest.raises(ValueError, match='--optimizer must be one of'):
    crash_resume.main(['--target', 'moe_lm', '--optimizer', 'sgd', '--out', str(tmp_path)])
  with pytest.raises(ValueError, match='use --target moe_lm'):
    crash_resume.main(['--target', 'sharded_moe', '--optimizer', 'muon-coded'])


@pytest.mark.slow
def test_recommended_policy_resumes_bitwise_after_sigkill(tmp_path):
  """tools/crash_resume.py --optimizer muon-coded (sj.MUON_CODED_TIERS): 3 kills."""
  out = tmp_path / 'out'
  timeout = _calibrated_timeout()
  r = _run([str(ROOT / 'tools' / 'crash_resume.py'), '--target', 'moe_lm', '--optimizer',
            'muon-coded', '--kills', '3', '--steps', '12', '--every', '3', '--out', str(out),
            '--work', str(tmp_path / 'w'), '--launch-timeout', str(timeout)], ROOT,
           timeout=3 * timeout)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
  result = json.loads((out / 'crash_resume.json').read_text())['results'][0]
  s = result['summary']
  assert 'muon-coded' in result['optimizer'] and s['kills'] == 3 and s['bitwise_equal'], s
  assert s['partial_resumes'] == 0 and s['resumes_wrong'] == 0, s
  assert s['corruptions_detected'] == s['corruptions'], s
