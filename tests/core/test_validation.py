"""Bad input fails early with an error that names the argument and the allowed values.

Static arguments are checked at construction, per-leaf ones (axes, dtypes, labels) at
`init`. Numeric hyperparameters are checked only when they are concrete Python/NumPy
numbers, so traced values (`optax.inject_hyperparams`, `jax.jit`) still pass.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sj

# Every public factory that takes b1, b2, eps positionally after its first argument.
FACTORIES = {
    'skewadam': lambda *a, **k: sj.skewadam(1e-3, *a, **k),
    'adampm': lambda *a, **k: sj.adampm(1e-3, *a, **k),
    'scale_by_tiered_adam': sj.scale_by_tiered_adam,
    'scale_by_grouped_second_moment': sj.scale_by_grouped_second_moment,
}
PARAMS = {'embed': jnp.zeros((6, 4)),
          'moe': {'router': jnp.zeros((4, 3)), 'experts': {'w1': jnp.zeros((3, 4, 5))}}}


# ---------------------------------------------------------------------------------------
# Decay rates and eps.


@pytest.mark.parametrize('value', [1.0, -0.1, 1.5, float('nan'), np.float64(1.0)])
@pytest.mark.parametrize('arg', ['b1', 'b2'])
@pytest.mark.parametrize('name', tuple(FACTORIES))
def test_betas_outside_unit_interval_are_rejected(name, arg, value):
  with pytest.raises(ValueError, match=re.escape(f'`{arg}` must be in [0, 1)')):
    FACTORIES[name](**{arg: value})


@pytest.mark.parametrize('name', tuple(FACTORIES))
def test_negative_eps_is_rejected(name):
  with pytest.raises(ValueError, match=re.escape('`eps` must be >= 0, got -1e-08')):
    FACTORIES[name](eps=-1e-8)


@pytest.mark.parametrize('name', tuple(FACTORIES))
def test_boundary_values_are_accepted(name):
  tx = FACTORIES[name](b1=0.0, b2=0.0, eps=0.0)
  tx.init(PARAMS)


@pytest.mark.parametrize('name', ['scale_by_tiered_adam', 'scale_by_grouped_second_moment'])
def test_traced_hyperparameters_are_not_checked(name):
  """Arrays and tracers pass through unchecked: they may be injected or scheduled."""
  g = jnp.ones((4, 8))

  @jax.jit
  def update(b1, b2, eps):
    tx = FACTORIES[name](b1, b2, eps)
    return tx.update(g, tx.init(g))[0]

  u = update(0.9, 0.999, 1e-8)
  assert bool(jnp.all(jnp.isfinite(u)))
  FACTORIES[name](jnp.asarray(0.9), jnp.asarray(0.999), jnp.asarray(1e-8))


# ---------------------------------------------------------------------------------------
# Group size, axes, dtypes.

GROUP_SIZE_FACTORIES = {
    'adampm': lambda gs: sj.adampm(1e-3, group_size=gs),
    'scale_by_grouped_second_moment': lambda gs: sj.scale_by_grouped_second_moment(
        group_size=gs),
    'Tier': lambda gs: sj.Tier(second_moment='grouped', group_size=gs),
}


@pytest.mark.parametrize('value', [0, -3])
@pytest.mark.parametrize('name', tuple(GROUP_SIZE_FACTORIES))
def test_group_size_below_one_is_a_value_error(name, value):
  with pytest.raises(ValueError, match=re.escape(
      f'`group_size` must be a positive int (>= 1), got {value}')):
    GROUP_SIZE_FACTORIES[name](value)


@pytest.mark.parametrize('value', [2.0, '8', True, None])
@pytest.mark.parametrize('name', tuple(GROUP_SIZE_FACTORIES))
def test_group_size_not_an_int_is_a_type_error(name, value):
  with pytest.raises(TypeError, match=r'`group_size` must be a positive Python int'):
    GROUP_SIZE_FACTORIES[name](value)


def test_group_size_array_error_says_to_make_it_static():
  with pytest.raises(TypeError, match=r"`group_size` must be a static positive Python "
                                      r"int.*static_args=\('group_size'"):
    sj.adampm(1e-3, group_size=jnp.asarray(8))


def test_axis_out_of_range_names_the_leaf_and_the_allowed_axes():
  tx = sj.adampm(1e-3, axis=2)
  with pytest.raises(ValueError, match=re.escape(
      '`axis`=2 is out of range for parameter moe/router with 2 dimensions; allowed '
      'values are -2..1')):
    tx.init({'moe': {'router': jnp.zeros((4, 3))}})


def test_group_axis_out_of_range_names_the_tier_option():
  tx = sj.scale_by_tiered_adam(tier=sj.Tier(second_moment='grouped', group_axis=-4))
  with pytest.raises(ValueError, match=re.escape(
      '`group_axis`=-4 is out of range for parameter moe/experts/w1 with 3 dimensions; '
      'allowed values are -3..2')):
    tx.init({'moe': {'experts': {'w1': jnp.zeros((3, 4, 5))}}})


def test_axis_is_ignored_for_leaves_with_fewer_than_two_dimensions():
  """1-D leaves are pooled along their only axis, 0-d leaves not at all."""
  tx = sj.adampm(1e-3, group_size=4, axis=5)
  state = tx.init({'bias': jnp.zeros((10,)), 'scale': jnp.zeros(())})
  nu = optax.tree_utils.tree_get(state, 'nu')
  assert nu['bias'].shape == (3,) and nu['scale'].shape == ()


@pytest.mark.parametrize('value', [1.5, 'last', None])
def test_axis_not_an_int_is_a_type_error(value):
  with pytest.raises(TypeError, match=r'`axis` must be a Python int'):
    sj.adampm(1e-3, axis=value)
  with pytest.raises(TypeError, match=r'`group_axis` must be a Python int'):
    sj.Tier(group_axis=value)


@pytest.mark.parametrize('value', [jnp.int32, 'int8', 'bool'])
def test_non_floating_state_dtype_is_rejected(value):
  with pytest.raises(TypeError, match=r'`mu_dtype` must be a floating dtype'):
    sj.adampm(1e-3, mu_dtype=value)
  with pytest.raises(TypeError, match=r'`nu_dtype` must be a floating dtype'):
    sj.scale_by_grouped_second_moment(nu_dtype=value)
  with pytest.raises(TypeError, match=r'`mu_dtype` must be a floating dtype'):
    sj.Tier(mu_dtype=value)


def test_unknown_dtype_name_is_rejected():
  with pytest.raises(TypeError, match=r'`mu_dtype` must be a floating dtype.*got '
                                      r"'floaty'"):
    sj.adampm(1e-3, mu_dtype='floaty')


# ---------------------------------------------------------------------------------------
# Tier options.


@pytest.mark.parametrize('value', [0, 0.0, -1.0])
def test_clip_threshold_must_be_positive(value):
  with pytest.raises(ValueError, match=r'`clip_threshold` must be a positive float or None'):
    sj.Tier(clip_threshold=value)
  with pytest.raises(ValueError, match=r'`clip_threshold` must be a positive float or None'):
    sj.scale_by_tiered_adam(clip_threshold=value)


def test_clip_threshold_not_a_number_is_a_type_error():
  with pytest.raises(TypeError, match=r'`clip_threshold` must be a positive float or None'):
    sj.Tier(clip_threshold='1.0')


def test_unknown_second_moment_lists_the_allowed_kinds():
  with pytest.raises(ValueError, match=re.escape(
      "`second_moment` must be one of ('exact', 'factored', 'grouped', 'orthogonal'), got "
      "'adafactor'")):
    sj.Tier(second_moment='adafactor')
  with pytest.raises(ValueError, match=r'`second_moment` must be one of'):
    sj.scale_by_tiered_adam(second_moment='full')


def test_unknown_eps_mode_lists_the_allowed_modes():
  with pytest.raises(ValueError, match=re.escape(
      "`eps_mode` must be one of ('floor', 'adam'), got 'additive'")):
    sj.Tier(eps_mode='additive')


@pytest.mark.parametrize('field', ['momentum', 'apply_weight_decay'])
def test_bool_tier_options_must_be_bools(field):
  with pytest.raises(TypeError, match=rf'`{field}` must be a bool'):
    sj.Tier(**{field: 1})


def test_tiers_must_map_names_to_tiers():
  with pytest.raises(TypeError, match=r'`tiers` must be a non-empty mapping'):
    sj.skewadam(1e-3, tiers={})
  with pytest.raises(TypeError, match=r"`tiers\['experts'\]` must be a skewadam_jax.Tier"):
    sj.skewadam(1e-3, tiers={'backbone': sj.Tier(), 'experts': {'momentum': False}})
  with pytest.raises(TypeError, match=r'`tier` must be a skewadam_jax.Tier'):
    sj.scale_by_tiered_adam(tier={'momentum': False})


# ---------------------------------------------------------------------------------------
# Labels.


def test_label_naming_no_tier_lists_the_tier_names():
  labels = {'embed': 'backbone', 'moe': {'router': 'router', 'experts': {'w1': 'expert'}}}
  tx = sj.skewadam(1e-3, param_labels=labels)
  with pytest.raises(ValueError, match=re.escape(
      "`param_labels` names tiers [\"'expert'\"] that are not in `tiers`; allowed tier "
      "names are ['backbone', 'experts', 'router']")):
    tx.init(PARAMS)


def test_labeler_function_naming_no_tier_is_rejected():
  tx = sj.skewadam(1e-3, param_labels=lambda p: jax.tree.map(lambda _: 'dense', p))
  with pytest.raises(ValueError, match=r"names tiers .*'dense'.* allowed tier names are"):
    tx.init(PARAMS)


def test_label_tree_that_does_not_match_the_params_is_rejected():
  labels = {'embed': 'backbone', 'moe': {'router': 'router', 'expertz': 'experts'}}
  tx = sj.skewadam(1e-3, param_labels=labels)
  with pytest.raises(ValueError, match=r'`param_labels` must be a pytree with the same '
                                       r'structure as the params'):
    tx.init(PARAMS)


def test_label_tree_prefix_is_accepted():
  labels = {'embed': 'backbone', 'moe': {'router': 'router', 'experts': 'experts'}}
  state = sj.skewadam(1e-3, param_labels=labels).init(PARAMS)
  v_row = optax.tree_utils.tree_get(state, 'v_row')
  assert v_row['moe']['experts']['w1'].shape == (3, 4)
  assert optax.tree_utils.tree_get(state, 'mu')['moe']['experts']['w1'] is None  # experts


# ---------------------------------------------------------------------------------------
# Leaf dtypes: complex parameters (integer ones: tests/transforms/test_drop_in.py).

ALL = {
    'skewadam': lambda: sj.skewadam(1e-3),
    'adampm': lambda: sj.adampm(1e-3),
    'scale_by_tiered_adam': sj.scale_by_tiered_adam,
    'scale_by_grouped_second_moment': sj.scale_by_grouped_second_moment,
}


@pytest.mark.parametrize('name', tuple(ALL))
def test_complex_parameters_are_rejected_with_the_path(name):
  params = {'embed': jnp.zeros((6, 4)), 'phase': {'kernel': jnp.zeros((4, 4), jnp.complex64)}}
  with pytest.raises(TypeError, match=r'parameter phase/kernel has complex dtype complex64; '
                                      r'only real floating parameters are supported'):
    ALL[name]().init(params)


@pytest.mark.parametrize('name', ['skewadam', 'adampm'])
def test_masked_integer_parameters_pass_through(name):
  params = {'embed': jnp.ones((6, 4)), 'moe': {'router': jnp.ones((4, 3))},
            'step': jnp.asarray(7, jnp.int32), 'ids': jnp.arange(5)}
  is_float = lambda p: jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), p)
  tx = optax.masked(ALL[name](), is_float)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  grads['step'] = jnp.zeros((), jnp.int32)
  grads['ids'] = jnp.zeros(5, jnp.int32)
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert new['step'].dtype == jnp.int32 and int(new['step']) == 7
  np.testing.assert_array_equal(new['ids'], np.arange(5))
  assert float(jnp.max(jnp.abs(new['embed'] - params['embed']))) > 0


# ----------------------------------------------------------------------------- review defects


def test_tier_that_is_not_a_tier_is_a_type_error_even_with_options():
  with pytest.raises(TypeError, match=r'`tier` must be a skewadam_jax.Tier or None, got dict'):
    sj.scale_by_tiered_adam(tier={'momentum': False}, clip_threshold=None)
  with pytest.raises(TypeError, match=r'`tier` must be a skewadam_jax.Tier or None, got dict'):
    sj.scale_by_tiered_adam(tier={'momentum': False})


def test_unknown_tier_option_is_a_type_error_with_a_suggestion():
  with pytest.raises(TypeError, match=r"Unknown Tier option\(s\) \['momentun'\] \(did you mean "
                                      r"'momentum'\?\)"):
    sj.scale_by_tiered_adam(momentun=False)


@pytest.mark.parametrize('make', [sj.skewadam, sj.adampm])
def test_learning_rate_of_the_wrong_type_names_the_argument(make):
  with pytest.raises(TypeError, match=r"`learning_rate` must be a float, a scalar array or an "
                                      r"optax schedule .*got str '3e-4'"):
    make('3e-4')
  make(jnp.asarray(3e-4))  # scalar arrays and schedules are fine
  make(optax.constant_schedule(3e-4))


def test_memory_report_of_something_not_an_optimizer_names_tx():
  with pytest.raises(TypeError, match=r"`tx` must be an optax.GradientTransformation .*got "
                                      r"dict \{"):
    sj.memory_report(PARAMS, 'adam')
  with pytest.raises(TypeError, match=r"`tx` must be an optax.GradientTransformation .*got "
                                      r"str 'adam'"):
    sj.memory_report('adam', PARAMS)
  with pytest.raises(TypeError, match=r'`tx` must be an optax.GradientTransformation'):
    sj.state_shardings('adam', PARAMS, jax.tree.map(lambda _: None, PARAMS))


def test_unknown_tier_names_get_a_suggestion():
  labels = {'embed': 'backbone', 'moe': {'router': 'router', 'experts': {'w1': 'expert'}}}
  with pytest.raises(ValueError, match=r"\(did you mean 'experts'\?\)"):
    sj.skewadam(1e-3, param_labels=labels).init(PARAMS)
  with pytest.raises(ValueError, match=r"got 'factorized' \(did you mean 'factored'\?\)"):
    sj.Tier(second_moment='factorized')


# ---------------------------------------------------------------------------------------
# Hyperparameters of the wrong type, arguments in the wrong order.


@pytest.mark.parametrize('make', [sj.skewadam, sj.adampm])
def test_weight_decay_of_the_wrong_type_names_the_argument(make):
  with pytest.raises(TypeError, match=r"`weight_decay` must be a float, a scalar array or an "
                                      r"optax schedule .*got str '0.1'"):
    make(1e-3, weight_decay='0.1')
  with pytest.raises(ValueError, match=re.escape('`weight_decay` must be >= 0, got -0.1')):
    make(1e-3, weight_decay=-0.1)
  params = {'w': jnp.ones((4, 4))}
  for ok in (0.1, 0, np.float32(0.1), jnp.asarray(0.1), optax.constant_schedule(0.1)):
    tx = make(1e-3, weight_decay=ok)
    jax.eval_shape(tx.update, params, tx.init(params), params)


@pytest.mark.parametrize('arg', ['b1', 'b2', 'eps'])
@pytest.mark.parametrize('name', tuple(FACTORIES))
def test_decay_rates_and_eps_of_the_wrong_type_name_the_argument(name, arg):
  with pytest.raises(TypeError, match=rf"`{arg}` must be a float or a scalar array, got str"):
    FACTORIES[name](**{arg: '0.5'})


@pytest.mark.parametrize('make', [sj.skewadam, sj.adampm])
def test_injected_weight_decay_still_works(make):
  """inject_hyperparams passes weight_decay as an array (a tracer under jit)."""
  static = ('group_size', 'axis') if make is sj.adampm else ()
  tx = optax.inject_hyperparams(make, static_args=static)(learning_rate=1e-3,
                                                          weight_decay=0.1)
  state = tx.init(PARAMS)
  updates, _ = jax.jit(tx.update)(PARAMS, state, PARAMS)
  plain, _ = make(1e-3, weight_decay=0.1).update(
      PARAMS, make(1e-3, weight_decay=0.1).init(PARAMS), PARAMS)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize('tiers', ['x', ['backbone'], {}, 3])
@pytest.mark.parametrize('where', ['skewadam', 'scale_by_tiers'])
def test_tiers_that_are_not_a_mapping_of_tiers_name_tiers(where, tiers):
  call = {'skewadam': lambda: sj.skewadam(1e-3, tiers=tiers),
          'scale_by_tiers': lambda: sj.scale_by_tiers(tiers, None)}[where]
  with pytest.raises(TypeError, match=r'`tiers` must be a non-empty mapping from tier name '
                                      r'\(a str\) to skewadam_jax.Tier'):
    call()


@pytest.mark.parametrize('where', ['skewadam', 'scale_by_tiers'])
def test_each_tier_is_checked_in_a_frozen_preset_copy_as_in_a_dict(where):
  tiers = {**sj.PUBLISHED_TIERS, 'router': 'exact'}
  make = {'skewadam': lambda: sj.skewadam(1e-3, tiers=tiers),
          'scale_by_tiers': lambda: sj.scale_by_tiers(tiers, None)}[where]
  with pytest.raises(TypeError, match=r"`tiers\['router'\]` must be a skewadam_jax.Tier"):
    make()


def _mesh():
  return jax.make_mesh((1,), ('data',))


@pytest.mark.parametrize('swapped,right', [
    (lambda tx: sj.optimizer_state_bytes(PARAMS, tx), lambda tx: sj.optimizer_state_bytes(
        tx, PARAMS)),
    (lambda tx: sj.label_table(PARAMS, tx), lambda tx: sj.label_table(tx, PARAMS)),
    (lambda tx: sj.memory_report(PARAMS, tx), lambda tx: sj.memory_report(tx, PARAMS)),
    (lambda tx: sj.state_shardings(PARAMS, tx, None),
     lambda tx: sj.state_shardings(tx, PARAMS, None)),
    (lambda tx: sj.sharded_abstract_state(PARAMS, tx, None, mesh=_mesh()),
     lambda tx: sj.sharded_abstract_state(tx, PARAMS, None, mesh=_mesh())),
], ids=['optimizer_state_bytes', 'label_table', 'memory_report', 'state_shardings',
        'sharded_abstract_state'])
def test_every_report_refuses_the_swapped_order_naming_tx(swapped, right):
  # One behaviour for every report: params first is a TypeError that names `tx`, says
  # the arguments are swapped and gives the right call; the right call works.
  tx = sj.skewadam(1e-3)
  with pytest.raises(TypeError, match=r'^`tx` must be the optimizer, got dict, .*swapped\. '
                                      r'Call sj\.\w+\(tx, params'):
    swapped(tx)
  assert right(tx) is not None


# ---------------------------------------------------------------------------------------
# Gradients of another shape than their parameter's (checked at trace time).

WIDE = {'w': jnp.ones((256, 64))}
COLUMN = {'w': jnp.ones((256, 1))}


@pytest.mark.parametrize('name', tuple(ALL))
@pytest.mark.parametrize('jit', [False, True])
def test_gradient_of_another_shape_names_the_leaf_and_both_shapes(name, jit):
  tx = ALL[name]()
  state = tx.init(WIDE)
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(ValueError, match=r'The gradient of parameter w has shape \(256, 1\), but '
                                       r'(the parameter|its momentum) has shape \(256, 64\)'):
    update(COLUMN, state, WIDE)


@pytest.mark.parametrize('kind', ['factored', 'exact', 'grouped'])
def test_gradient_shape_is_checked_against_statistics_without_momentum_or_params(kind):
  """No momentum and no params: the statistics' shapes are what the gradient must fit."""
  tx = sj.scale_by_tiered_adam(momentum=False, second_moment=kind)
  state = tx.init(WIDE)
  with pytest.raises(ValueError, match=r'The gradient of parameter w has shape \(256, 1\), '
                                       r'which does not fit its optimizer state'):
    jax.jit(tx.update)(COLUMN, state)
  with pytest.raises(ValueError, match=r'The gradient of parameter w has shape \(256,\)'):
    jax.eval_shape(tx.update, {'w': jnp.ones((256,))}, state)
  jax.eval_shape(tx.update, WIDE, state)  # the right shape passes
