"""Tests of the example MoE language model (`examples/moe_lm`) and its byte-level data."""

from __future__ import annotations

from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from examples.moe_lm import data as moe_data  # noqa: E402
from examples.moe_lm import model as moe_model  # noqa: E402

PAPER_TOTAL = 6_784_327_680
PAPER_BACKBONE = 341_352_448
PAPER_EXPERTS = 6_442_450_944
PAPER_ROUTER = 524_288


def _jit_call(module, x, *, train=False, key=None):
  """`module(x, train=train, rngs=key)` under `nnx.jit` (eager op-by-op is slow on CPU)."""
  return nnx.jit(lambda m, x, key: m(x, train=train, rngs=key))(module, x, key)


def _flat(state) -> dict[str, jax.ShapeDtypeStruct]:
  """`path -> leaf` with '/'-joined paths and no trailing `value`."""
  return dict(moe_model._param_leaves(state))


@pytest.fixture(scope='module')
def paper_params():
  return moe_model.abstract_params(moe_model.PRESETS['paper-6.78b'])


@pytest.fixture(scope='module')
def stdlib_data():
  return moe_data.ByteDataset.load(seq_len=32, batch_size=8, seed=0)


# ------------------------------------------------------------------ the published model


def test_paper_preset_is_abstract(paper_params):
  leaves = jax.tree_util.tree_leaves(paper_params)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_paper_preset_has_published_parameter_count(paper_params):
  assert moe_model.count_params(paper_params) == PAPER_TOTAL


def test_paper_preset_tier_split_by_path(paper_params):
  sizes = {'experts': 0, 'router': 0, 'rest': 0}
  for path, leaf in _flat(paper_params).items():
    tier = 'experts' if 'experts' in path else 'router' if 'router' in path else 'rest'
    sizes[tier] += int(np.prod(leaf.shape))
  assert sizes == {'experts': PAPER_EXPERTS, 'router': PAPER_ROUTER, 'rest': PAPER_BACKBONE}
  assert moe_model.param_counts(paper_params) == {
      'backbone': PAPER_BACKBONE, 'experts': PAPER_EXPERTS, 'router': PAPER_ROUTER}


def test_paper_preset_shapes(paper_params):
  flat = _flat(paper_params)
  assert flat['embed/embedding'].shape == (50304, 4096)
  assert flat['pos_embed'].shape == (256, 4096)
  assert flat['blocks/0/attn/k_proj/kernel'].shape == (4096, 1024)
  assert flat['blocks/0/mlp/w3/kernel'].shape == (4096, 4096)
  assert flat['blocks/1/moe/experts/w1'].shape == (128, 4096, 4096)
  assert flat['blocks/1/moe/experts/w3'].shape == (128, 4096, 4096)
  assert flat['blocks/1/moe/router/kernel'].shape == (4096, 128)
  assert not any(path.endswith('/bias') and 'norm' not in path for path in flat)


def test_paper_preset_dtypes_bf16_except_norms_and_router(paper_params):
  for path, leaf in _flat(paper_params).items():
    parts = path.split('/')
    fp32 = 'router' in parts or any(part.endswith('norm') for part in parts)
    assert leaf.dtype == (jnp.float32 if fp32 else jnp.bfloat16), path


# ------------------------------------------------------------------------------ routing


def test_routing_weights_sum_to_one():
  logits = jax.random.normal(jax.random.key(0), (64, 8)) * 3.0
  weights, _, probs = moe_model.route(logits, top_k=2)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
  assert bool(jnp.all(weights > 0))


def test_routing_picks_distinct_top_experts():
  logits = jax.random.normal(jax.random.key(1), (64, 8))
  weights, indices, probs = moe_model.route(logits, top_k=3)
  idx = np.asarray(indices)
  assert all(len(set(row)) == 3 for row in idx)
  # The chosen experts are the three most probable ones, best first.
  np.testing.assert_array_equal(idx, np.argsort(-np.asarray(probs), axis=-1)[:, :3])
  top = np.take_along_axis(np.asarray(probs), idx, axis=-1)
  np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.slow
def test_aux_loss_is_at_floor_under_uniform_routing():
  # Zero router weights and no noise: every token sees probability 1/E for every expert.
  cfg = moe_model.get_config('tiny')
  layer = moe_model.MoE(cfg, rngs=nnx.Rngs(0))
  assert not np.any(np.asarray(layer.router.kernel[...]))
  x = jax.random.normal(jax.random.key(2), (2, 16, cfg.d_model))
  _, stats = _jit_call(layer, x)
  np.testing.assert_allclose(stats['mean_prob'], 1.0 / cfg.n_experts, rtol=1e-6)
  np.testing.assert_allclose(stats['aux_loss'], 0.05, rtol=1e-6)
  np.testing.assert_allclose(stats['token_frac'].sum(), 1.0, rtol=1e-6)


def test_aux_loss_floor_does_not_depend_on_assignments():
  probs = jnp.full((10, 4), 0.25)
  indices = jnp.array([[0, 1]] * 10)  # maximally imbalanced token fractions
  np.testing.assert_allclose(moe_model.load_balance_loss(probs, indices, 0.05), 0.05, rtol=1e-6)


def test_aux_loss_collapsed_router_costs_coef_times_experts():
  probs = jnp.zeros((10, 4)).at[:, 0].set(1.0)
  indices = jnp.zeros((10, 1), jnp.int32)
  np.testing.assert_allclose(moe_model.load_balance_loss(probs, indices, 0.05), 0.2, rtol=1e-6)


def _health(indices: jax.Array, n_experts: int) -> dict[str, float]:
  h = moe_model.load_health(moe_model.token_fractions(indices, n_experts))
  return {k: float(v) for k, v in h.items()}


def test_load_health_of_a_uniform_load():
  # Every expert gets exactly 1/E of the T * k assignments.
  health = _health(jnp.array([[0, 1], [2, 3]] * 8), 4)
  assert health == pytest.approx({'load_max_x_uniform': 1.0, 'load_min_x_uniform': 1.0,
                                  'dead_experts': 0, 'load_entropy_ratio': 1.0})


def test_load_health_of_a_collapsed_load():
  health = _health(jnp.zeros((16, 1), jnp.int32), 4)
  assert health == pytest.approx({'load_max_x_uniform': 4.0, 'load_min_x_uniform': 0.0,
                                  'dead_experts': 3, 'load_entropy_ratio': 0.0})


def test_aux_loss_is_blind_to_a_collapse_that_load_health_sees():
  # Uniform router probabilities, but every token goes to experts 0 and 1: the Switch
  # loss sits at its floor while half of the experts are dead.
  probs = jnp.full((32, 8), 1 / 8)
  indices = jnp.array([[0, 1]] * 32)
  coef = 0.05
  aux_over_floor = float(moe_model.load_balance_loss(probs, indices, coef)) / coef
  assert aux_over_floor == pytest.approx(1.0, abs=1e-6)
  health = _health(indices, 8)
  assert health['dead_experts'] == 6
  assert health['load_max_x_uniform'] == pytest.approx(4.0)
  assert health['load_entropy_ratio'] == pytest.approx(np.log(2) / np.log(8))


def test_load_health_per_layer_and_dead_threshold():
  # Layer 0 balanced; layer 1 has one expert at 5% of uniform (dead) and one at 20% (not).
  frac = np.array([[0.25, 0.25, 0.25, 0.25], [0.0125, 0.05, 0.4375, 0.5]])
  health = moe_model.load_health(frac)
  assert all(v.shape == (2,) for v in health.values())
  np.testing.assert_array_equal(health['dead_experts'], [0, 1])
  np.testing.assert_allclose(health['load_min_x_uniform'], [1.0, 0.05])
  np.testing.assert_allclose(health['load_max_x_uniform'], [1.0, 2.0])
  assert health['load_entropy_ratio'][0] == pytest.approx(1.0)
  assert 0 < health['load_entropy_ratio'][1] < 1


@pytest.mark.slow
def test_moe_stats_report_top1_prob_and_router_norm():
  cfg = moe_model.get_config('tiny')
  layer = moe_model.MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(6), (2, 16, cfg.d_model))
  _, stats = _jit_call(layer, x)
  # Zero router: probabilities are uniform and the kernel has norm 0.
  np.testing.assert_allclose(stats['top1_prob'], 1 / cfg.n_experts, rtol=1e-6)
  assert float(stats['router_norm']) == 0.0
  kernel = jax.random.normal(jax.random.key(7), layer.router.kernel.shape)
  layer.router.kernel[...] = kernel
  _, stats = _jit_call(layer, x)
  np.testing.assert_allclose(stats['router_norm'], np.linalg.norm(np.asarray(kernel)),
                             rtol=1e-5)
  probs = jax.nn.softmax(layer.router(x.reshape(-1, cfg.d_model)), axis=-1)
  np.testing.assert_allclose(stats['top1_prob'], jnp.mean(jnp.max(probs, -1)), rtol=1e-5)


def test_z_loss_of_zero_logits():
  loss = moe_model.router_z_loss(jnp.zeros((5, 8)), 1e-4)
  np.testing.assert_allclose(loss, 1e-4 * np.log(8.0) ** 2, rtol=1e-6)


def _dense_moe_reference(layer: moe_model.MoE, x: jax.Array) -> jax.Array:
  """All experts on all tokens, mixed by the top-k combine weights (no capacity)."""
  tokens = x.reshape(-1, x.shape[-1])
  weights, indices, _ = moe_model.route(layer.router(tokens), layer.cfg.top_k)
  combine = jnp.sum(jax.nn.one_hot(indices, layer.cfg.n_experts) * weights[..., None], axis=1)
  w1, w2, w3 = (w[...] for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3))
  h = jax.nn.silu(jnp.einsum('td,edf->tef', tokens, w1)) * jnp.einsum('td,edf->tef', tokens, w2)
  out = jnp.einsum('tef,efd->ted', h, w3)
  return jnp.einsum('ted,te->td', out, combine).reshape(x.shape)


def test_gather_dispatch_matches_dense_reference():
  cfg = moe_model.get_config('tiny', capacity_factor=None)
  layer = moe_model.MoE(cfg, rngs=nnx.Rngs(0))
  layer.router.kernel[...] = jax.random.normal(jax.random.key(3), layer.router.kernel.shape)
  x = jax.random.normal(jax.random.key(4), (2, 16, cfg.d_model))
  y, stats = _jit_call(layer, x)
  expected = nnx.jit(_dense_moe_reference)(layer, x)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
  assert float(stats['drop_frac']) == 0.0


def test_dispatch_drops_second_choices_first_and_respects_capacity():
  # Every token picks expert 0 first and expert 1 second; capacity 3 of 4 tokens.
  indices = jnp.array([[0, 1]] * 4)
  slot, keep = moe_model.dispatch_slots(indices, n_experts=2, capacity=3)
  np.testing.assert_array_equal(keep, [True, True, True, False, True, True, True, False])
  np.testing.assert_array_equal(slot, [0, 1, 2, 6, 3, 4, 5, 6])


def test_router_noise_only_in_training():
  cfg = moe_model.get_config('tiny')
  layer = moe_model.MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(5), (2, 16, cfg.d_model))
  call = nnx.jit(lambda m, x, key, train: m(x, train=train, rngs=key), static_argnums=3)
  # With the router at its zero init, only the noise can spread the tokens in training;
  # without it, ties send every token to experts 0 and 1.
  _, stats_eval = call(layer, x, jax.random.key(0), False)
  np.testing.assert_allclose(stats_eval['token_frac'], [0.5, 0.5, 0.0, 0.0])
  _, stats_a = call(layer, x, jax.random.key(0), True)
  _, stats_a_again = call(layer, x, jax.random.key(0), True)
  _, stats_b = call(layer, x, jax.random.key(1), True)
  np.testing.assert_array_equal(stats_a['token_frac'], stats_a_again['token_frac'])
  assert not np.allclose(stats_a['token_frac'], stats_b['token_frac'])
  assert np.all(np.asarray(stats_a['token_frac']) > 0)


@pytest.mark.slow
def test_bf16_model_keeps_norms_and_router_fp32():
  cfg = moe_model.get_config('tiny', param_dtype='bfloat16')
  model = moe_model.MoELM(cfg, rngs=nnx.Rngs(0))
  flat = _flat(nnx.state(model, nnx.Param))
  assert flat['blocks/1/moe/router/kernel'].dtype == jnp.float32
  assert flat['final_norm/scale'].dtype == jnp.float32
  assert flat['blocks/1/moe/experts/w1'].dtype == jnp.bfloat16
  logits, aux = _jit_call(model, jnp.zeros((2, 8), jnp.int32))
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
  assert bool(jnp.isfinite(aux['aux_loss']))


# --------------------------------------------------------------------------------- data


def test_no_file_in_both_splits(stdlib_data):
  train, val = set(stdlib_data.train_files), set(stdlib_data.val_files)
  assert train and val and not train & val
  assert not any(part in ('test', 'tests', 'site-packages') for f in train | val
                 for part in f.parts)
  assert len(stdlib_data.train) > 1_000_000


def test_split_is_a_function_of_the_path():
  files = [Path(f'pkg/mod_{i}.py') for i in range(200)]
  train, val = moe_data.split_files(files, 0.1)
  train_rev, val_rev = moe_data.split_files(files[::-1], 0.1)
  assert set(val) == set(val_rev) and set(train) == set(train_rev)
  assert 5 <= len(val) <= 40


def test_train_batches_reproducible_from_seed(stdlib_data):
  again = moe_data.ByteDataset(**{**vars(stdlib_data)})
  other_seed = moe_data.ByteDataset(**{**vars(stdlib_data), 'seed': 1})
  b = stdlib_data.train_batch(7)
  assert b.shape == (8, 33) and b.dtype == np.int32
  np.testing.assert_array_equal(b, again.train_batch(7))
  assert not np.array_equal(b, stdlib_data.train_batch(8))
  assert not np.array_equal(b, other_seed.train_batch(7))


def test_validation_batches_are_fixed(stdlib_data):
  first, second = stdlib_data.val_batches(3), stdlib_data.val_batches(3)
  assert len(first) == 3
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)


def test_any_directory_with_suffixes(tmp_path):
  for i in range(6):
    (tmp_path / f'doc_{i}.md').write_text(f'# Title {i}\n' + 'some text. ' * 20)
    (tmp_path / f'notes_{i}.txt').write_text('plain notes ' * 20)
  (tmp_path / 'tests').mkdir()
  (tmp_path / 'tests' / 'skip.txt').write_text('excluded')
  (tmp_path / 'image.png').write_bytes(b'\x89PNG')
  ds = moe_data.ByteDataset.load(tmp_path, seq_len=16, batch_size=2, suffixes=('.txt', '.md'))
  files = set(ds.train_files) | set(ds.val_files)
  assert len(files) == 12 and not set(ds.train_files) & set(ds.val_files)
  assert ds.val_files
  assert moe_data.decode(ds.train_batch(0)[0]).isprintable()


# ----------------------------------------------------------------------------- training


@pytest.mark.slow
def test_short_adam_run_lowers_loss(stdlib_data):
  cfg = moe_model.get_config('tiny')
  model = moe_model.MoELM(cfg, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    grad_fn = nnx.value_and_grad(moe_model.loss_fn, has_aux=True)
    (loss, metrics), grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return loss, metrics

  losses = []
  # loss_fn(train=True) without a key: the router noise comes from the model's own
  # streams, which nnx.jit advances.
  for step in range(30):
    loss, metrics = train_step(model, optimizer, jnp.asarray(stdlib_data.train_batch(step)))
    losses.append(float(metrics['ce']))
  assert np.isfinite(losses).all()
  assert np.mean(losses[:3]) > 5.0  # about log(256) = 5.55 at init
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.5
  # The router trained too, and stays near balance.
  assert float(metrics['aux']) < 2 * float(metrics['aux_floor'])
