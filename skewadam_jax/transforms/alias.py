"""Full optimizers: `skewadam` (tiered state) and `adampm` (pooled second moment)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Union

import jax
import optax

from skewadam_jax.transforms import adampm as _adampm
from skewadam_jax.structure import axes as _axes
from skewadam_jax.core import checks as _checks
from skewadam_jax.estimators import pooling as _pooling
from skewadam_jax.structure import hidden as _hidden
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import traced as _traced
from skewadam_jax.structure import warning as _warning
from skewadam_jax.transforms import presets as _presets
from skewadam_jax.transforms import tier as _tier
from skewadam_jax.transforms import tiers as _tiered
from skewadam_jax.transforms import plan as _plan
from skewadam_jax.structure import paths as _paths
from skewadam_jax.core import tree as _tree
from skewadam_jax.structure.vocabulary import HIDDEN
from skewadam_jax.structure.vocabulary import UNDECIDED


def _chain(where: str, *transforms: optax.GradientTransformation
           ) -> optax.GradientTransformationExtraArgs:
  """`optax.chain(*transforms)` whose `update` says which argument is wrong if `state` and
  `params` are swapped, where optax's chain would say "The number of updates and states
  has to be the same in chain!" (it counts the params' entries as states). The check
  reads types only (`check_update_order`): no cost in the step."""
  chained = optax.chain(*transforms)
  is_state = lambda s: isinstance(s, tuple) and len(s) == len(transforms)  # noqa: E731

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any
                ) -> tuple[Any, Any]:
    _checks.check_update_order(updates, state, params, is_state, where)
    return chained.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(chained.init, update_fn)


def _given_batch_axes(batch_axes: Callable[..., Any], params: Any, labels: Any) -> Any:
  """The user's `batch_axes` function on `params`; one that takes a `param_labels`
  argument (`sj.moe_batch_axes`, a `functools.partial` of it) gets the labels in use."""
  try:
    parameters = inspect.signature(batch_axes).parameters
  except (TypeError, ValueError):  # no signature to read (a builtin): params only
    return batch_axes(params)
  if 'param_labels' in parameters or any(
      p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
    return batch_axes(params, param_labels=labels)
  return batch_axes(params)


def tier_labeler(tiers: Mapping[str, _tier.Tier], param_labels: Any = None
                 ) -> Callable[[Any], Any]:
  """A validating labeler: params -> full label tree whose labels all name a tier."""

  def labeler(params: Any) -> Any:
    if isinstance(param_labels, _traced.Structure):  # the hidden tier from the roles
      labels = param_labels.labels_for(tiers)
    elif param_labels is None and HIDDEN in tiers:
      labels = _hidden.hidden_param_labels(params)
    else:
      labels = _labels.resolve_labels(params, param_labels)
    return _labels.expand_labels(params, labels, tiers)

  return labeler


def skewadam(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    *,
    tiers: Optional[Mapping[str, _tier.Tier]] = None,
    param_labels: Union[Any, Callable[[Any], Any], None] = None,
    batch_axes: Union[Any, Callable[[Any], Any], None] = None,
    mask: Union[Any, Callable[[Any], Any], None] = None,
) -> optax.GradientTransformation:
  r"""SkewAdam: Adam with optimizer state allocated by parameter tier.

  Each leaf is labelled with a tier (`moe_param_labels` by default) and updated by
  that tier's rule (`scale_by_tiers`: one state, with one step count, for every tier);
  then decoupled weight decay (on the leaves of tiers that opt in and that `mask`
  selects) and the learning rate apply, exactly as the reference implementation::

    p <- p - lr * (u + wd * p)

  The published tiers keep float32 momentum and a factored second moment on the
  dense backbone, only a factored second moment per expert on the expert bank, and
  an exact second moment (no decay) on the router: 1.29 GiB of state instead of
  AdamW's 50.55 GiB on the published 6.78B MoE.

  Args:
    learning_rate: a float or an optax schedule.
    b1: first-moment decay rate.
    b2: second-moment decay rate.
    eps: floor on the second moment (or Adam's eps for tiers with `eps_mode='adam'`).
    weight_decay: decoupled weight decay rate (applied to tiers with
      `apply_weight_decay`).
    tiers: tier name -> `Tier`; default `PUBLISHED_TIERS` (backbone/experts/router).
      Ours: `ADAM_ROUTER_TIERS` (an Adam router, which keeps every expert in use),
      `ADAM_EPS_TIERS` (additive eps everywhere, for AdamW's learning rate),
      `MUON_TIERS` (Muon's orthogonalised momentum on the hidden matrices) and
      `MUON_CODED_TIERS` (the same with Muon's per-expert momentum; the experts' and
      hidden matrices' momenta in 6-bit blockwise codes, the backbone's in 8-bit:
      `Tier(mu_codec=sj.Blockwise(...))`).
    param_labels: a pytree of tier names matching the params, or a function of the
      params returning one; default `moe_param_labels` (`hidden_param_labels` when
      `tiers` has a `'hidden'` tier, as `MUON_TIERS` does). A function is called on the
      params at `init` and on the updates at `update`, so it must label both alike. Or
      the `sj.trace_structure` of the model: its labels and batch axes, and with a
      `'hidden'` tier the backbone leaves the computation shows to be hidden matrices
      (not embeddings, output layers, biases or gains) get it; the leaves it leaves
      undecided get the tier `'undecided'` under every policy (added to `tiers` unless
      they name it): no orthogonalisation, nothing shared across any of their axes (an
      exact second moment, an uncoded momentum, no update clip;
      `sj.Tier` otherwise the policy's `backbone`).
    batch_axes: each leaf's batch axes, the axes that index independent matrices (the
      expert axis, a scanned layer axis, wherever it sits): a tree of int tuples
      matching the params, or a function of the params returning one; default
      `moe_batch_axes` (from paths, shapes and labels). Factored statistics and the
      clip are per batch slice; see `scale_by_tiered_adam`.
    mask: which leaves weight decay applies to, as in `optax.adamw`: a pytree of bools
      matching the params (or a prefix of them), or a function of the params returning
      one. A leaf decays only if `mask` selects it and its tier's
      `apply_weight_decay` is set; default: every leaf of a tier that decays.

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, skewadam_jax as sj
    >>> params = {'embed': jnp.ones((16, 8)), 'moe': {'router': jnp.zeros((8, 4)),
    ...           'experts': {'w1': jnp.ones((4, 8, 16))}}}
    >>> tx = sj.skewadam(3e-4, weight_decay=0.1)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    Where Should Optimizer State Live? Tiered State Allocation for Memory-Efficient
    Mixture-of-Experts Training, arXiv 2607.19058.
  """
  _checks.check_learning_rate(learning_rate)
  _checks.check_non_negative('weight_decay', weight_decay, schedule=True)
  tiers_given = _presets.check_tiers(tiers)
  # As the user wrote it: the fix an `UnsureLabelWarning` prints keeps it.
  policy = _presets.policy_of(tiers)
  tiers = tiers_given
  if isinstance(param_labels, _traced.Structure):
    if batch_axes is None:
      batch_axes = param_labels.batch_axes
    if param_labels.undecided and UNDECIDED not in tiers:
      # The same safe rule under every policy: nothing shared across an axis that the
      # analysis could not clear (a policy naming the tier itself keeps its own).
      tiers[UNDECIDED] = _tier.undecided_tier(tiers)
  labeler = tier_labeler(tiers, param_labels)
  # The built-in labeler reports unsure subtrees (a stack or a bank?) itself.
  labeler_reports = param_labels is None or isinstance(param_labels, _labels.Labeler)
  if batch_axes is not None and not _tree.is_function(batch_axes):
    batch_axes_tree = batch_axes
    batch_axes = lambda params: batch_axes_tree  # noqa: E731

  def plan_fn(tree: Any, explain: bool) -> _plan.Plan:
    # Labels and batch axes come from the whole tree (structure sees a router beside its
    # experts, every leaf of a scanned stack).
    labels = labeler(tree)
    if batch_axes is None:
      axes = _axes.batch_axes_tree(tree, labels, labels_reported=labeler_reports)
    else:
      axes = _given_batch_axes(batch_axes, tree, labels)
    reasons = None
    if explain:  # the labeler's notes; it reported what it is unsure of already
      with _warning.silenced():
        _, reasons = _labels.labels_and_notes(tree, param_labels)
    return _plan.plan_leaves(tiers, tree, jax.tree_util.tree_leaves(labels),
                             _paths.leaf_batch_axes(axes, tree), reasons)

  tiers_tx = _tiered.tiers_transform(tiers, plan_fn, b1, b2, eps, 'sj.scale_by_tiers',
                                     described=True)

  def decay_mask(params: Any) -> Any:
    flags = jax.tree.map(lambda label: tiers[label].apply_weight_decay, labeler(params))
    if mask is None:
      return flags
    user = mask(params) if _tree.is_function(mask) else mask
    # The user's mask may be a prefix of the params, as optax.masked allows.
    return jax.tree.map(lambda m, sub: jax.tree.map(lambda flag: bool(m) and flag, sub),
                        user, flags)

  chain = _chain(
      'sj.skewadam',
      tiers_tx,
      optax.add_decayed_weights(weight_decay, decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )
  # The tiers and the decay mask label the same tree: one warning per call if unsure.
  return chain._replace(init=_warning.reported_once(chain.init, policy),
                        update=_warning.reported_once(chain.update, policy))


def adampm(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Union[Any, Callable[[Any], Any], None] = None,
    group_size: int = 8,
    axis: int = -1,
    group_axis: Optional[int] = None,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
) -> optax.GradientTransformation:
  r"""AdamPM: AdamW whose second moment is pooled over groups of `group_size`.

  `scale_by_grouped_second_moment`, then decoupled weight decay and the learning
  rate, as `optax.adamw`::

    p <- p - lr * ((m / bc1) / (sqrt(expand(nu / bc2) + eps_root) + eps) + wd * p)

  Same learning rate and betas as Adam; the second moment takes 1/group_size of
  Adam's memory. The arguments after `eps` are keyword-only and named (and ordered) as
  `optax.adamw`'s.

  Args:
    learning_rate: a float or an optax schedule.
    b1: first-moment decay rate.
    b2: second-moment decay rate.
    eps: added to the denominator, as in Adam.
    eps_root: added to the bias-corrected second moment inside the square root, as in
      `optax.adamw`.
    mu_dtype: storage dtype of the first moment (default the params').
    weight_decay: decoupled weight decay rate.
    mask: which leaves weight decay applies to (a pytree of bools or a function of
      the params), as in `optax.adamw`.
    group_size: elements per pooled group (static int).
    axis: axis to pool along (static; negative allowed); the default is the last
      axis, i.e. along rows. Under `optax.inject_hyperparams`, name it in
      `static_args` when you pass it.
    group_axis: the same option as `Tier` spells it; None: `axis` decides.
    nu_dtype: storage dtype of the pooled second moment (default the params').

  Returns:
    An `optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> tx = sj.adampm(1e-3, weight_decay=0.1, group_size=8)
    >>> state = tx.init({'w': jnp.zeros((4, 20))})  # nu has shape (4, 3)

  References:
    AdamPM: Adam with a pooled second moment (Beihang University preprint).
    Loshchilov & Hutter, Decoupled Weight Decay Regularization, 2019.
  """
  _checks.check_learning_rate(learning_rate)
  _checks.check_non_negative('weight_decay', weight_decay, schedule=True)
  group_axis, axis_arg = _pooling.pooled_axis(axis, group_axis, 'adampm')
  return _chain(
      'sj.adampm',
      _adampm.grouped_adam(b1, b2, eps, eps_root, mu_dtype, group_size, group_axis,
                           nu_dtype, axis_arg),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
