"""Sharded updates against one device, for tests/integrations/test_explicit_mesh.py and
mesh_runs.py.

A case is a mesh (its axis sizes and type, Explicit or Auto), MoE-shaped leaves (expert
banks `[E, d, f]`, scanned stacks `[L, E, d, f]`, 3-D attention kernels `[d, h, k]`,
norms `[d]`, a router), a PartitionSpec per leaf and a preset. `run_case` trains two
steps on fixed gradients on one device and on the mesh and compares: updates within
`ULPS` float32 ulp (`ulp.assert_within_ulp`), coded momentum codes equal, every update
placed as its parameter (Explicit), the state placed as `sj.state_shardings` says.
Where blocks or groups would straddle shards, both meshes must raise the library's
ValueError (from `sj.state_shardings`; on an Explicit mesh from `init` too).

A case's `mode` says how the update runs on the mesh: `jit` (Explicit: under
`jax.set_mesh`, shardings in the types; Auto: `jit` in/out shardings, no mesh in
context), `set_mesh` (Auto: the same under `jax.set_mesh`, where the orthogonal
estimator asks XLA for whole matrices), or `shard_map` (`tx.update` inside
`jax.shard_map` with the params' specs and `sj.state_shardings`' specs for the state:
each device updates its blocks). Inside `shard_map` the library cannot see which axis
of a block is split, so the generator shards only the batch axes of expert banks and
stacks there (and, in two cases of three, replicates the other leaves, as expert
parallelism does); a leaf without batch axes whose tier reduces over whole matrices
(factored or orthogonal statistics, the RMS clip) and is sharded at all must raise the
library's ValueError (`shard_map_refusals`), and every other case must match one device.
With `resume`, the state is saved after the first step with Orbax on the mesh,
restored onto `sj.sharded_abstract_state` and trained on: the updates and the final
state must be bitwise those of the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from examples.moe_lm.optimizers import with_ns_dtype
import skewadam_jax as sj
import ulp

# The bound on |sharded - single| per leaf, in ulp of the leaf's largest magnitude
# (`ulp.assert_within_ulp`'s second criterion), or elementwise. Factored and pooled
# statistics reduce over sharded axes in another order: a few ulp (the frozen fixtures'
# bound). An orthogonalised leaf goes through 5 Newton-Schulz iterations whose Gram
# products XLA sums in another order on a mesh (and, on one device, in a padded shared
# buffer): the iteration carries those roundings to about 1e-5 of the matrix's scale.
ULPS = ulp.FLOAT32_ULPS
ORTHOGONAL_ULPS = 256
# With the bfloat16 iteration (the presets' default on a GPU, named here: the CPU's
# default is float32), a product summed in another order rounds some elements of the
# iterate to the neighbouring bfloat16 (2^16 float32 ulp of their magnitude), and the
# later steps carry those flips to other elements: no elementwise bound holds, so an
# orthogonalised leaf's update is compared as a whole, by its relative Frobenius
# distance from the single device's. Both are the bfloat16 iteration, each within 0.1 of
# the float32 one (tests/estimators/test_orthogonal.py); measured between them: at most
# 0.031 (15 generated cases, 12 that ran; the issue cases of test_explicit_mesh.py).
ORTHOGONAL_BF16_REL_FROBENIUS = 0.05
STEPS = 2


TIERS = {'published': sj.PUBLISHED_TIERS, 'muon': sj.MUON_TIERS,
         'muon_coded': sj.MUON_CODED_TIERS,
         'muon_coded_bf16': {k: with_ns_dtype(t, 'bfloat16')
                             for k, t in sj.MUON_CODED_TIERS.items()}}
# The presets whose hidden matrices are orthogonalised.
ORTHOGONAL = ('muon', 'muon_coded', 'muon_coded_bf16')
PRESETS = {
    **{name: (lambda t=t: sj.skewadam(1e-2, weight_decay=0.1, tiers=t))
       for name, t in TIERS.items()},
    'adampm': lambda: sj.adampm(1e-2, weight_decay=0.1, group_size=8),
}
# kind -> (label, batch axes); the hidden tier's label falls back to 'backbone'.
KINDS = {'bank': ('experts', (0,)), 'stack': ('experts', (0, 1)), 'attn': ('hidden', ()),
         'norm': ('backbone', ()), 'router': ('router', ())}


class Case(NamedTuple):
  mesh_shape: tuple[int, ...]
  explicit: bool
  preset: str
  shapes: dict[str, tuple[int, ...]]  # leaf name -> shape; the kind is the name's prefix
  specs: dict[str, tuple[Any, ...]]  # leaf name -> spec entries
  seed: int
  mode: str = 'jit'  # one of MODES (module doc)
  resume: bool = False  # save after step 1 with Orbax, restore, continue (module doc)


MODES = ('jit', 'set_mesh', 'shard_map')
SHARD_MAP_WORDS = ('inside shard_map', 'reduces over whole matrices')


AXES = ('a', 'b', 'c')


def make_mesh(case: Case) -> jax.sharding.Mesh:
  n = int(np.prod(case.mesh_shape))
  kind = AxisType.Explicit if case.explicit else AxisType.Auto
  return jax.make_mesh(case.mesh_shape, AXES[:len(case.mesh_shape)],
                       axis_types=(kind,) * len(case.mesh_shape), devices=jax.devices()[:n])


def labels_and_axes(case: Case) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
  hidden = case.preset in ORTHOGONAL
  labels, axes = {}, {}
  for name in case.shapes:
    label, batch = KINDS[name.split('_')[0]]
    labels[name] = label if (label != 'hidden' or hidden) else 'backbone'
    axes[name] = batch
  return labels, axes


def make_tx(case: Case):
  if case.preset == 'adampm':
    return PRESETS['adampm']()
  labels, axes = labels_and_axes(case)
  return sj.skewadam(1e-2, weight_decay=0.1, tiers=TIERS[case.preset], param_labels=labels,
                     batch_axes=axes)


def host_arrays(case: Case) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
  rng = np.random.default_rng(case.seed)
  params = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in case.shapes.items()}
  grads = [{k: rng.standard_normal(s).astype(np.float32) * 1e-2 for k, s in case.shapes.items()}
           for _ in range(STEPS)]
  return params, grads


def _train(tx, params, grads, state, update=None, between=None):
  """`update` (default `jit(tx.update)`) on each gradient; `between(state)` after the
  first step, if given, replaces the state (a checkpoint's round trip)."""
  update = jax.jit(tx.update) if update is None else update
  updates = []
  for i, g in enumerate(grads):
    u, state = update(g, state, params)
    updates.append(u)
    if i == 0 and between is not None:
      state = between(state)
  return updates, state


def _orbax_round_trip(tx, params, p_sh):
  """`state -> state` saved with Orbax in a temporary folder and restored onto
  `sj.sharded_abstract_state` (the shardings the params' give the state)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  target = sj.sharded_abstract_state(tx, jax.eval_shape(lambda: params), p_sh)

  def between(state):
    with tempfile.TemporaryDirectory() as root:
      ckptr = ocp.StandardCheckpointer()
      ckptr.save(f'{root}/1', state)
      ckptr.wait_until_finished()
      return ocp.StandardCheckpointer().restore(f'{root}/1', target)
  return between


def single(case: Case) -> tuple[list[Any], Any]:
  """The updates and final state on one device, no mesh."""
  tx = make_tx(case)
  params, grads = host_arrays(case)
  dev = jax.devices()[0]
  params, grads = jax.device_put((params, grads), dev)
  return _train(tx, params, grads, jax.jit(tx.init)(params))


def sharded(case: Case) -> tuple[list[Any], Any, dict[str, Any]]:
  """The updates and final state on the case's mesh, and what was checked on the way.

  Raises the library's ValueError where the specs make blocks or groups straddle."""
  tx = make_tx(case)
  mesh = make_mesh(case)
  params, grads = host_arrays(case)
  p_sh = {k: NamedSharding(mesh, P(*s)) for k, s in case.specs.items()}
  want = sj.state_shardings(tx, params, p_sh)  # raises on a straddle, any mesh type
  facts: dict[str, Any] = {}
  in_context = case.explicit or case.mode in ('set_mesh', 'shard_map')
  with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
    params, grads = jax.device_put((params, grads), (p_sh, [p_sh] * len(grads)))
    if case.explicit:
      state = jax.jit(tx.init)(params)
      facts['state_specs_match'] = all(
          _same_placement(a.sharding, b, a.ndim)
          for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)))
    else:
      state = jax.jit(tx.init, out_shardings=want)(params)
    if case.mode == 'shard_map':
      p_specs = {k: P(*s) for k, s in case.specs.items()}
      s_specs = jax.tree.map(lambda sh: sh.spec, want)
      update = jax.jit(jax.shard_map(tx.update, mesh=mesh, in_specs=(p_specs, s_specs, p_specs),
                                     out_specs=(p_specs, s_specs)))
    elif case.explicit:
      update = jax.jit(tx.update)
    else:
      update = jax.jit(tx.update, in_shardings=(p_sh, want, p_sh), out_shardings=(p_sh, want))
    start = state
    updates, state = _train(tx, params, grads, state, update)
    if case.explicit:
      facts['update_specs_match'] = all(
          _same_placement(u[k].sharding, p_sh[k], u[k].ndim) for u in updates for k in u)
    if case.resume:
      again = _train(tx, params, grads, start, update, _orbax_round_trip(tx, params, p_sh))
      facts['resumed_bitwise'] = all(
          np.array_equal(np.asarray(a), np.asarray(b))
          for a, b in zip(jax.tree.leaves((updates, state)), jax.tree.leaves(again)))
  return updates, state, facts


def shard_map_refusals(case: Case) -> set[str]:
  """The leaves the library must refuse inside `shard_map`: sharded, with no batch axes,
  under a tier that reduces over whole matrices (its estimator's statistics or
  orthogonalisation, or its RMS clip). AdamPM's pooling and Adam's rule are local."""
  if case.mode != 'shard_map' or case.preset == 'adampm':
    return set()
  tiers = TIERS[case.preset]
  labels, axes = labels_and_axes(case)
  out = set()
  for name, shape in case.shapes.items():
    if axes[name] or all(e is None for e in case.specs[name]):
      continue
    tier = tiers[labels[name]]
    if (tier.estimator.for_leaf(shape, axes[name]).reduces_matrices
        or tier.clip_threshold is not None):
      out.add(name)
  return out


def _same_placement(a: Any, b: Any, ndim: int) -> bool:
  """Whether shardings `a` and `b` put the same elements on the same devices: a spec
  that names a mesh axis of size 1 places as one that names none (jax drops such a name
  from some results, e.g. AdamPM's pooled statistic of a [16, 4, 8] kernel split on a
  size-1 axis)."""
  return a.is_equivalent_to(b, ndim)


def scale_ulps(got: np.ndarray, want: np.ndarray) -> float:
  """max |got - want| in ulp of want's largest magnitude (float32)."""
  if not want.size:
    return 0.0
  spacing = np.spacing(np.float32(np.max(np.abs(want))))
  return float(np.max(np.abs(got.astype(np.float64) - want)) / spacing)


def compare(case: Case, got: tuple[list[Any], Any], want: tuple[list[Any], Any]
            ) -> dict[str, Any]:
  """Asserts updates and float state within the bound, codes (uint8 state) equal; returns
  the largest distance seen (in ulp of each leaf's largest magnitude) and the number of
  code bytes compared."""
  orthogonal = case.preset in ORTHOGONAL
  labels, _ = labels_and_axes(case)
  worst, worst_rel, codes = 0.0, 0.0, 0
  for i, (u, w) in enumerate(zip(got[0], want[0])):
    for k in w:
      a, b = np.asarray(u[k]), np.asarray(w[k])
      if not (orthogonal and KINDS[k.split('_')[0]][0] != 'router'):
        ulp.assert_within_ulp(a, b, np.float32, ulps=ULPS, err_msg=f'update {i} {k}')
      elif (case.preset == 'muon_coded_bf16'
            and isinstance(TIERS[case.preset][labels[k]].estimator, sj.Orthogonal)):
        rel = float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))
        assert rel <= ORTHOGONAL_BF16_REL_FROBENIUS, f'update {i} {k}: {rel}'
        worst_rel = max(worst_rel, rel)
        continue
      else:
        ulp.assert_within_ulp(a, b, np.float32, ulps=ORTHOGONAL_ULPS, err_msg=f'update {i} {k}')
      worst = max(worst, scale_ulps(a, b))
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    a, b = np.asarray(a), np.asarray(b)
    if b.dtype == np.uint8:
      np.testing.assert_array_equal(a, b, err_msg='codes')
      codes += b.size
    else:
      ulp.assert_within_ulp(a, b, b.dtype, ulps=ULPS, err_msg='state')
  return {'worst_ulp': worst, 'worst_rel_frobenius': worst_rel, 'code_bytes': codes}


STRADDLE_WORDS = ('straddle', 'whole blocks')


def run_case(case: Case) -> dict[str, Any]:
  """One case end to end (see the module doc); raises AssertionError on a mismatch."""
  refusals = shard_map_refusals(case)
  try:
    got = sharded(case)
  except ValueError as e:
    msg = str(e)
    if all(w in msg for w in SHARD_MAP_WORDS):
      assert msg.split(':')[0] in refusals, f'refused {msg[:200]}; expected {sorted(refusals)}'
      return {'straddle': False, 'refused': True}
    assert any(w in msg for w in STRADDLE_WORDS), f'not the library message: {msg[:300]}'
    if case.explicit:  # jit(tx.init) must raise the same message as state_shardings
      tx, mesh = make_tx(case), make_mesh(case)
      params, _ = host_arrays(case)
      p_sh = {k: NamedSharding(mesh, P(*s)) for k, s in case.specs.items()}
      with jax.set_mesh(mesh):
        try:
          jax.jit(tx.init)(jax.device_put(params, p_sh))
        except ValueError as again:
          assert str(again) == msg, (str(again)[:300], msg[:300])
        else:
          raise AssertionError('init ran where sj.state_shardings raised') from None
    return {'straddle': True}
  assert not refusals, f'ran inside shard_map with {sorted(refusals)} sharded'
  facts = got[2]
  assert facts.get('state_specs_match', True), 'state placed unlike sj.state_shardings'
  assert facts.get('update_specs_match', True), 'an update not placed as its parameter'
  assert facts.get('resumed_bitwise', True), 'the resumed run differs from the uninterrupted'
  return {'straddle': False, 'refused': False, 'resumed': 'resumed_bitwise' in facts,
          **compare(case, got[:2], single(case))}


# ------------------------------------------------------------------------ the generator


def cases(max_devices: int = 8, modes: tuple[str, ...] = ('jit',), resume: bool = False,
          presets: tuple[str, ...] = tuple(sorted(PRESETS))):
  """A hypothesis strategy of `Case`s: 1-3 mesh axes over 1..max_devices devices, run in
  one of `modes` (`set_mesh` draws an Auto mesh) with one of `presets`; with `resume`, a
  drawn part of them check an Orbax resume."""
  from hypothesis import strategies as st  # noqa: PLC0415

  @st.composite
  def draw(draw):
    n_axes = draw(st.integers(1, 3))
    sizes: list[int] = []
    for _ in range(n_axes):
      room = max_devices // int(np.prod(sizes or [1]))
      sizes.append(draw(st.sampled_from([s for s in (1, 2, 4, 8, 3) if s <= room])))
    d = draw(st.sampled_from((16, 32, 48)))
    f = draw(st.sampled_from((32, 64, 128)))
    e = draw(st.sampled_from((2, 4, 8)))
    shapes = {'router_w': (d, e), 'norm_scale': (d,)}
    kinds = draw(st.sets(st.sampled_from(('bank', 'stack', 'attn')), min_size=1))
    if 'bank' in kinds:
      shapes['bank_w1'] = (e, d, f)
    if 'stack' in kinds:
      shapes['stack_w2'] = (draw(st.sampled_from((2, 3))), e, f, d)
    if 'attn' in kinds:
      shapes['attn_q'] = (d, draw(st.sampled_from((2, 4, 8))), draw(st.sampled_from((8, 16))))
    specs = {}
    for name, shape in shapes.items():
      entries: list[list[str]] = [[] for _ in shape]
      for axis in AXES[:len(sizes)]:
        dim = draw(st.integers(-1, len(shape) - 1))  # -1: this mesh axis unused
        if dim >= 0:
          entries[dim].append(axis)
      spec = []
      for dim, names in zip(shape, entries):
        count = int(np.prod([sizes[AXES.index(a)] for a in names] or [1]))
        spec.append(None if not names or dim % count else
                    names[0] if len(names) == 1 else tuple(names))
      specs[name] = tuple(spec)
    mode = draw(st.sampled_from(modes))
    if mode == 'shard_map':  # only batch axes of banks and stacks (module doc)
      # Expert parallelism (the other leaves replicated) in 2 cases of 3: the rest refuse.
      local = draw(st.sampled_from((True, True, False)))
      for name, spec in specs.items():
        batch = KINDS[name.split('_')[0]][1]
        if batch or local:
          specs[name] = tuple(e if a in batch else None for a, e in enumerate(spec))
    explicit = False if mode == 'set_mesh' else draw(st.booleans())
    return Case(tuple(sizes), explicit, draw(st.sampled_from(presets)),
                shapes, specs, draw(st.integers(0, 2**16)), mode,
                draw(st.booleans()) if resume else False)

  return draw()


def issue_cases(mesh_shape: tuple[int, ...]) -> dict[str, Case]:
  """The issue's failures as cases on an Explicit mesh of `mesh_shape` (1 or 2 axes):
  an attention kernel `[32, 4, 8]` sharded on its heads (the orthogonal estimator's
  reshape); an expert bank sharded on experts and columns (the Gram products'
  contracting axis); a whole tree whose matrices share one Newton-Schulz buffer (its
  dynamic_update_slice); and 6-bit codes in blocks that straddle column shards."""
  a = AXES[0]
  b = AXES[1] if len(mesh_shape) > 1 else AXES[0]
  two = len(mesh_shape) > 1
  model = {'router_w': (64, 8), 'norm_scale': (64,), 'attn_q': (64, 4, 8),
           'bank_w1': (8, 64, 512), 'stack_w2': (2, 8, 512, 64)}
  model_specs = {'router_w': (), 'norm_scale': (), 'attn_q': (None, b, None),
                 'bank_w1': (b, None, a) if two else (None, None, a),
                 'stack_w2': (None, b, a, None) if two else (None, None, a, None)}
  out = {}
  for preset in sorted(PRESETS):
    out[f'reshape/{preset}'] = Case(mesh_shape, True, preset, {
        'router_w': (32, 4), 'norm_scale': (32,), 'attn_q': (32, 4, 8)},
        {'router_w': (), 'norm_scale': (), 'attn_q': (None, b, None)}, 0)
    out[f'contracting/{preset}'] = Case(mesh_shape, True, preset, {
        'router_w': (64, 8), 'norm_scale': (64,), 'bank_w1': (8, 64, 512)},
        {'router_w': (), 'norm_scale': (), 'bank_w1': (b, None, a) if two else (None, None, a)},
        1)
    out[f'shared_buffer/{preset}'] = Case(mesh_shape, True, preset, model, model_specs, 2)
  # 64 columns split in two: 32 per shard, where a block of 6-bit codes covers 64.
  out['straddle/muon_coded'] = Case(mesh_shape, True, 'muon_coded', {
      'router_w': (32, 8), 'norm_scale': (32,), 'bank_w1': (8, 32, 64)},
      {'router_w': (), 'norm_scale': (), 'bank_w1': (b, None, a) if two else (None, None, a)},
      3)
  return out
