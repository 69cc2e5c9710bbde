"""The benchmarks' own measuring helpers (benchmarks/_common.py), adampm_fidelity.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / 'benchmarks'))
import _common  # noqa: E402


def _tree():
  return {'experts': jnp.zeros((8, 64, 96)), 'embed': jnp.zeros((300, 64)),
          'norm': jnp.zeros((64,)), 'router': jnp.zeros((64, 8))}


@pytest.mark.parametrize('make', [lambda: optax.adamw(1e-3), lambda: sj.skewadam(1e-3),
                                  lambda: sj.adampm(1e-3, group_size=8)],
                         ids=['adamw', 'skewadam', 'adampm'])
def test_kernel_bytes_equal_xla_cost_analysis(make):
  # gpu_compile.py counts bytes from the optimised HLO because a compile-only GPU
  # executable has no cost analysis; on the CPU both counts must agree (XLA counts a
  # scalar operand once per use inside a fusion, which is noise beside the arrays).
  tx = make()
  params = _tree()

  def step(p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  compiled = jax.jit(step, donate_argnums=(0, 2)).lower(
      params, params, tx.init(params)).compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  kernel_bytes, kernels = _common.hlo_kernel_bytes(compiled.as_text())
  assert kernels > 0
  assert kernel_bytes == pytest.approx(ca['bytes accessed'], rel=1e-3)
  assert kernel_bytes > 3 * sum(x.nbytes for x in jax.tree.leaves(params))


def test_kernel_bytes_of_a_copy():
  x = jnp.zeros((256, 128), jnp.float32)
  compiled = jax.jit(jnp.negative, donate_argnums=0).lower(x).compile()
  kernel_bytes, kernels = _common.hlo_kernel_bytes(compiled.as_text())
  assert (kernel_bytes, kernels) == (2 * x.nbytes, 1)


@pytest.mark.parametrize('rows', [1, 5])
def test_kernel_bytes_of_an_in_place_update_are_the_slice_as_xla_counts_them(rows):
  # A fusion writing a slice of a donated buffer runs in place: it moves the slice, not
  # the buffer (16 MiB here), as XLA's cost analysis counts it; gpu_compile.py's loops
  # write their chunks so.
  import gpu_compile
  buf, upd = jnp.zeros((64, 256, 256)), jnp.ones((rows, 256, 256))
  f = jax.jit(lambda b, u, i: jax.lax.dynamic_update_slice(b, jnp.tanh(u) * 2, (i, 0, 0)),
              donate_argnums=0)
  compiled = f.lower(buf, upd, 3).compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  kernel_bytes, kernels = _common.hlo_kernel_bytes(compiled.as_text())
  assert kernels == 1
  assert kernel_bytes == pytest.approx(ca['bytes accessed'], rel=1e-3)
  assert kernel_bytes == pytest.approx(2 * upd.nbytes, rel=1e-3)
  assert gpu_compile.hlo_costs(compiled.as_text())['bytes'] == kernel_bytes


@pytest.mark.parametrize('n,trip', [(64, 3), (96, 40)])
def test_hlo_costs_unroll_loops_and_count_dots(n, trip):
  # gpu_compile.py's plans count a loop's body once per trip and the dots' flops
  # (optax.contrib.muon runs Newton-Schulz in a loop); XLA's cost analysis counts a body
  # once, so the expected figures are worked out here: 2 n^3 per matmul and trip.
  import gpu_compile
  x = jax.ShapeDtypeStruct((n, n), jnp.float32)

  def f(a):
    return jax.lax.fori_loop(0, trip, lambda i, y: jnp.tanh(y @ a), a)

  text = jax.jit(f).lower(x).compile().as_text()
  costs = gpu_compile.hlo_costs(text)
  assert costs['flops'] == trip * 2 * n ** 3
  loops = ' while(' in text
  assert costs['kernels'] >= (trip if loops else 1)
  assert costs['bytes'] >= trip * 3 * n * n * 4  # each trip reads y and a, writes y


@pytest.mark.parametrize('make', [lambda: optax.adamw(1e-3), lambda: sj.skewadam(1e-3)],
                         ids=['adamw', 'skewadam'])
def test_hlo_costs_equal_kernel_bytes_without_loops(make):
  import gpu_compile
  tx = make()
  params = _tree()

  def step(p, g, s):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  text = jax.jit(step, donate_argnums=(0, 2)).lower(
      params, params, tx.init(params)).compile().as_text()
  costs = gpu_compile.hlo_costs(text)
  assert (costs['bytes'], costs['kernels']) == _common.hlo_kernel_bytes(text)
  assert costs['flops'] == 0


def test_roofline_adds_launches_to_the_larger_bound():
  import gpu_compile
  t = gpu_compile.roofline_s(4.8e12, 0.0, 0)
  assert t == pytest.approx(1.0)
  t = gpu_compile.roofline_s(0.0, 2 * gpu_compile.BF16_FLOPS_PER_S, 10)
  assert t == pytest.approx(2.0 + 10 * gpu_compile.LAUNCH_S)


def test_compile_only_device_rejects_unknown_target():
  with pytest.raises(ValueError, match='`target` must be one of'):
    _common.compile_only_device('h999')


# ----------------------------------------------------------------- adampm_fidelity.py


def test_fidelity_shadow_is_adampm_on_both_axes():
  # The shadow update from Adam's moments equals the library's AdamPM on the same
  # gradients, pooled along the output (-1) and the input (-2) axis; groups that do not
  # divide the axis (12 = 8 + 4), 1-D and 0-d leaves included.
  import adampm_fidelity as fid

  params = {'experts': jnp.zeros((4, 16, 12)), 'kernel': jnp.zeros((24, 16)),
            'scale': jnp.zeros((12,)), 'scalar': jnp.zeros(())}
  adam = optax.scale_by_adam(fid.B1, fid.B2, fid.EPS)
  key = jax.random.key(0)
  for axis in fid.AXES:
    tx = sj.scale_by_grouped_second_moment(fid.B1, fid.B2, fid.EPS, group_size=8, axis=axis)

    @jax.jit
    def step(grads, a_state, s_state, axis=axis, tx=tx):
      _, a_state = adam.update(grads, a_state)
      ref, s_state = tx.update(grads, s_state)
      got = jax.tree.map(lambda m, v: fid.pooled_update(m, v, a_state.count, 8, axis),
                         a_state.mu, a_state.nu)
      return got, ref, a_state, s_state

    a_state, s_state = adam.init(params), tx.init(params)
    for i in range(3):
      grads = {name: jax.random.normal(jax.random.fold_in(key, 10 * i + j), p.shape)
               for j, (name, p) in enumerate(params.items())}
      got, ref, a_state, s_state = step(grads, a_state, s_state)
      for name in params:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f'{name}, axis {axis}')


def test_fidelity_width_config():
  import adampm_fidelity as fid

  assert fid.width_config('small', None) == fid.model_lib.get_config('small')
  cfg = fid.width_config('small', 64)
  assert (cfg.d_model, cfg.d_ff, cfg.d_expert, cfg.head_dim) == (64, 64, 64, 16)
  base = fid.model_lib.get_config('small')
  assert (cfg.n_layers, cfg.n_experts, cfg.n_heads, cfg.max_len) == (
      base.n_layers, base.n_experts, base.n_heads, base.max_len)
  with pytest.raises(ValueError, match='multiple of n_heads'):
    fid.width_config('small', 66)
  assert fid.pool_axis(0, -2) is None and fid.pool_axis(1, -2) == 0
  assert fid.pool_axis(3, -2) == 1 and fid.pool_axis(2, -1) == 1


@pytest.mark.slow
def test_fidelity_width_series_writes_table_json_and_plot(tmp_path, capsys, monkeypatch):
  # `--widths` with both axes: one tiny width (each width compiles the MoE model's step,
  # which dominates the run, so the step is compiled at -O0), three steps.
  import adampm_fidelity as fid

  monkeypatch.setattr(fid, 'COMPILER_OPTIONS', {'xla_backend_optimization_level': 0})
  fid.main(['--preset', 'tiny', '--widths', '16', '--axes', '-1', '-2',
            '--group-sizes', '1', '8', '--steps', '3', '--batch-size', '2',
            '--out', str(tmp_path)])
  md = (tmp_path / 'adampm_fidelity_widths.md').read_text()
  assert md in capsys.readouterr().out
  table = [line for line in md.splitlines() if line.startswith('| 16 |')]
  assert len(table) == 2 and '-1 (output)' in table[0] and '-2 (input)' in table[1]
  assert '| s=8 | 10th pct (s=8) | steps > 0.993 (s=8) | s=8, last 30% of steps |' in md
  result = json.loads((tmp_path / 'adampm_fidelity_widths.json').read_text())
  (run,) = result['runs']
  model = run['model']
  assert run['width'] == 16 and len(run['loss']) == 3
  assert (model['d_model'], model['d_ff'], model['d_expert'], model['head_dim']) == (
      16, 16, 16, 4)
  for axis in ('-1', '-2'):
    by_axis = run['by_axis'][axis]
    assert by_axis['identity_max_rel_err'] < 1e-5
    rows = {r['s']: r for r in by_axis['rows']}
    assert rows[1]['median'] == pytest.approx(1.0, abs=1e-6)
    assert 0.0 < rows[8]['median'] < 1.0
    assert len(by_axis['whole_model_cosine']['8']) == 3
  assert (tmp_path / 'adampm_fidelity_widths.png').stat().st_size > 0


@pytest.mark.skipif(jax.default_backend() != 'cpu', reason="XLA:CPU's LLVM IR dump")
def test_compile_time_counts_the_steps_generated_code():
  # One fresh process with `--xla_dump_to`: the step's LLVM modules and IR, and only the
  # step's (the start-up compile is another module). AdamPM's update adds kernels to
  # AdamW's on the same model step, so its counts are at least AdamW's.
  import compile_time
  adamw = compile_time.generated_code('adamw', 'model', 'small')
  adampm = compile_time.generated_code('adampm', 'model', 'small')
  assert 50 < adamw['llvm_modules'] <= adampm['llvm_modules']
  assert 100 < adamw['llvm_ir_kb'] < adampm['llvm_ir_kb']


@pytest.mark.skipif(jax.default_backend() != 'cpu', reason="XLA:CPU's compile timers")
def test_compile_time_phases_are_the_steps_compile():
  # XLA's timers of the step's compile only (the start-up compile's come first and are
  # left out): passes, of which copy insertion, and a backend that compiles the kernels.
  import compile_time
  phases = compile_time.xla_phases('adamw', 'model', 'small')
  assert set(phases) == set(compile_time.PHASES) | {'compile_cpu_s', 'other_lines'}
  assert 0 < phases['copy_insertion_ms'] < phases['hlo_passes_ms']
  assert 0 < phases['kernels_ms'] and 0 < phases['backend_ms']
  # Only the timers' files log at VLOG level 1: with every file on, XLA's dataflow
  # analysis alone wrote hundreds of thousands of lines and doubled the timed compile.
  assert phases['other_lines'] < 100 and 0 < phases['compile_cpu_s']


def test_compile_time_kernel_cost_compiles_one_jit_per_count():
  import compile_time
  for op in compile_time.KERNEL_OPS:
    out = compile_time.kernel_cost((1, 3), op)
    assert [n for n, _ in out] == [1, 3]
    assert all(seconds > 0 for _, seconds in out)


def test_compile_time_model_step_traces_the_optimizer_init_only():
  # The model's parts are built once, outside the timed region; the step's arguments
  # hold the optimizer's abstract state, traced from its `init` on the model's params.
  import compile_time
  parts = compile_time.model_parts('small')
  tx = compile_time.OPTIMIZERS['adamw']()
  _, args = compile_time.model_step(tx, parts)
  assert args[0] is parts[1]
  want = jax.eval_shape(tx.init, parts[1])
  assert jax.tree.structure(args[1]) == jax.tree.structure(want)


def test_codec_compile_times_the_coded_leaves_of_the_policy():
  # The leaves are those MUON_CODED_TIERS codes in the example model, each with its own
  # bound codec; one leaf per distinct (shape, codec) is that many leaves; the coded
  # update holds the decode and encode that the float32 average does not.
  import codec_compile
  leaves = codec_compile.coded_leaves()
  assert leaves and all(isinstance(c, sj.Blockwise) and c.shape == s for s, c, _ in leaves)
  shapes = {(s, c) for s, c, _ in leaves}
  assert {c.bits for _, c in shapes} == {6, 8} and len(shapes) < len(leaves)
  samples = {v: codec_compile.compile_sample(v) for v in codec_compile.VARIANTS}
  plain, coded, one = (samples[v] for v in codec_compile.VARIANTS)
  assert plain['leaves'] == coded['leaves'] == len(leaves)
  assert one['leaves'] == one['shapes'] == coded['shapes'] == len(shapes)
  assert plain['hlo_instructions'] < one['hlo_instructions'] < coded['hlo_instructions']
  assert all(s['compile_cpu_s'] > 0 for s in samples.values())


_LOOP_HLO = '''HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %x = f32[4,8] get-tuple-element(%p), index=1
  %g = f32[32,8] all-gather(%x), dimensions={0}, metadata={op_name="jit(f)/dot_general"}
  %r = f32[4,8] all-reduce(%x), to_apply=%add
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %r)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %w = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body, TRIP
  %v = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body
  ROOT %s = (f32[4,8], f32[16,8]) all-gather-start(%x), dimensions={0}
}
'''.replace('TRIP', 'backend_config={"known_trip_count":{"n":"5"}}')


def test_collectives_count_a_loop_body_once_per_trip():
  import collectives
  got = collectives.hlo_collectives(_LOOP_HLO)
  # 5 trips + 1 (the loop without a trip count, listed) + the async start outside.
  assert got['all-gather']['count'] == 5 + 1 + 1
  assert got['all-gather']['bytes'] == 6 * 32 * 8 * 4 + 16 * 8 * 4  # start: its result
  assert got['all-reduce'] == {'count': 6, 'bytes': 6 * 4 * 8 * 4}
  assert got['loops_without_trip_count'] == ['v']
  assert [o['op_name'] for o in got['ops']][:1] == ['jit(f)/dot_general']


def test_collectives_script_gathers_each_sharded_matrix_once(tmp_path):
  # benchmarks/collectives.py end to end on the unit tests' model (8 simulated CPU
  # devices, a subprocess): MUON_TIERS on FSDP and EP, on an Explicit mesh and on an
  # Auto mesh set in context, where `Orthogonal` asks XLA for whole matrices through the
  # iteration (without it XLA gathered every Gram product's operands, every iteration)
  # and iterates each bank on its own (in a shared buffer, XLA gathered the
  # expert-parallel banks too).
  import os
  import subprocess
  root = Path(__file__).resolve().parents[2]
  env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run(
      [sys.executable, str(root / 'benchmarks' / 'collectives.py'), '--config', 'tiny',
       '--layouts', 'fsdp', 'ep', '--meshes', 'explicit', 'auto', '--optimizers',
       'skewadam-muon',
       '--results', str(tmp_path), '--out', 'c'],
      env=env, cwd=root, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert '| fsdp | explicit | SkewAdam (MUON_TIERS) |' in proc.stdout
  records = json.loads((tmp_path / 'c.json').read_text())['records']
  assert (tmp_path / 'c.png').stat().st_size > 0
  assert [(r['layout'], r['mesh']) for r in records] == [
      ('fsdp', 'explicit'), ('fsdp', 'auto'), ('ep', 'explicit'), ('ep', 'auto')]
  for r in records:
    assert 'error' not in r, r
    # attention 4 x 2 blocks, dense MLP 3, banks 3 (EP: the banks on their expert axis,
    # orthogonalised where they lie)
    assert r['sharded_hidden_leaves'] == (14 if r['layout'] == 'fsdp' else 11)
    # (On the Auto mesh XLA moves one attention kernel's shards with a 1 KB all-to-all
    # before gathering it; before the banks iterated on their own, 25 KB, and the banks
    # were gathered: 245,760 B.)
    assert r['all-to-all']['count'] == 0 or r['mesh'] == 'auto'
    assert r['goal_one_gather'], r['all-gather']
    assert r['all-gather']['bytes'] == r['sharded_hidden_bytes']  # each gathered whole once
    assert r['loops_without_trip_count'] == []


def test_dead_experts_table_has_one_column_per_evaluation():
  # A 300-step run evaluated at steps 100 and 300: the fractions of DEAD_AT that land on
  # the same evaluation give one column, not a repeated one.
  import quality
  runs = [{'evals': [{'step': s, 'dead_experts': [d], 'router_norm': [n]}
                     for s, d, n in ((100, 2, 1.0), (300, 1, 2.0))]}]
  points = quality._router_over_training(runs, 300)
  assert [at for at, _, _ in points] == [100, 300]
  assert points == [(100, 2.0, 1.0), (300, 1.0, 2.0)]


def test_same_program_tells_the_same_program_from_another():
  # benchmarks/same_program.py: one program written in two places (different source
  # lines, so different metadata and stack frames) is the same; a changed constant is not.
  import same_program  # noqa: PLC0415

  def one(x):
    return jnp.tanh(x) * 2.0 + 1.0

  def two(x):
    y = jnp.tanh(x)
    return y * 2.0 + 1.0

  def other(x):
    return jnp.tanh(x) * 3.0 + 1.0

  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  texts = [jax.jit(f).lower(x).compile().as_text() for f in (one, two, other)]
  norm = [same_program.normalised_hlo(t) for t in texts]
  assert norm[0] == norm[1] and norm[0] != norm[2]
  assert 'metadata=' not in norm[0] and 'FileNames' not in norm[0]
  assert same_program.kernel_count(texts[0]) == 1  # one loop fusion


def test_ns_bfloat16_distances_rank_the_iterations():
  # benchmarks/ns_bfloat16.py on a few draws: the library's iteration within the tests'
  # bound, Muon's reference (every product and sum in bfloat16) further off at the median.
  import ns_bfloat16
  rows = {r['iteration']: r for r in ns_bfloat16.summary(ns_bfloat16.distances(8, 0))}
  assert rows['library']['matrices'] == rows['Muon reference']['matrices'] > 8
  assert rows['library']['rel_max'] <= 0.1 and rows['library']['sv_max'] <= 0.15
  assert rows['Muon reference']['rel_median_vs_library'] > 1.5
