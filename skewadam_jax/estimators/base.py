"""The interface of a second-moment estimator, and what every estimator shares.

A SkewAdam tier combines a first-moment rule (momentum on or off) with one
second-moment estimator. The estimator owns everything about its statistics: how
they are initialised from a parameter, how a gradient updates them, how they rescale
the update `u = x * num_scale / D` (including a memory-safe RMS clip), the
sharding of each statistic, and its name in reports. The built-in estimators are
`Exact` (Adam's `v`), `Factored` (Adafactor's row/column statistics) and `Grouped`
(AdamPM's pooled `v`); a user estimator subclasses `SecondMoment` and is passed to
`Tier(second_moment=...)` (see docs/estimators.md).

Statistics live in the `v_row`, `v_col` and `v` fields of `TieredAdamState`: an
estimator's `init` returns a dict from some of those field names to the leaf's
statistics (an array, or any pytree of arrays), and fields it does not use hold
`optax.MaskedNode`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from skewadam_jax.core import xla as _xla

STAT_FIELDS = ('v_row', 'v_col', 'v')

Stats = Mapping[str, Any]  # field name (one of STAT_FIELDS) -> statistics of one leaf
Spec = tuple[Any, ...]  # a parameter's PartitionSpec, one entry per dimension


class Step(NamedTuple):
  """What an estimator's `update` needs of the current step, besides its own state."""
  b2: Any  # decay rate of the statistics (a float, or traced under inject_hyperparams)
  bc2: jax.Array  # shape=(), float32: 1 - b2^t
  eps: Any  # the floor on the second moment ('floor'), or Adam's additive eps ('adam')
  num_scale: jax.Array  # shape=(), float32: 1/bc1 with momentum, times sqrt(bc2) ('floor')
  floor: bool  # static: eps_mode == 'floor'
  clip: Optional[float]  # static: RMS clip threshold, or None
  x_is_grad: bool  # static: the numerator `x` is the gradient itself (no momentum)
  path: str  # the parameter's path, for error messages
  # shape=(), float32: num_scale without the floor mode's sqrt(bc2) (1/bc1 with momentum,
  # 1 without or in Nesterov's form); None: num_scale / sqrt(bc2) ('floor'), num_scale.
  bc1_scale: Optional[jax.Array] = None


class SecondMoment(abc.ABC):
  """A second-moment estimator: statistics of `g^2` that rescale an update.

  Subclass it to add an estimator (a frozen dataclass with its static options works
  well, as the built-in ones do). With `x` the numerator (the stored momentum, or the
  gradient without momentum) and `s = step.num_scale`, `update` returns::

    u = x * s / D                         eps_mode 'floor' (D from the floored statistic)
    u = x * s / (sqrt(v_hat) + eps)       eps_mode 'adam'  (v_hat bias-corrected by bc2)
    u = u / max(1, rms(u) / clip)         when step.clip is set (rms per matrix)

  Attributes:
    name: the estimator's name in `label_table` and reports.
    per_shape: whether `init` and `update` depend on the leaf's shapes and this
      object's (hashable) options only, never on `path` (which then only names the leaf
      in errors). The tier then traces the update once per shape and caches the
      statistics' shapes per shape, as for the built-in `Exact`, `Factored` and
      `Grouped`; otherwise it traces `update` once per leaf.
    stacks: whether leaves of one shape may share one call of `update` vmapped over
      their stacked arrays (`per_shape` too, and `update` a function of its arguments
      item by item, as any `jax.vmap`-able function is): the tier then stacks the
      gradients, numerators and statistics of small leaves with equal shapes, dtypes
      and options inside the step and runs one call per group, so that each of the
      update's reductions is one kernel for the group (transforms/stacking.py). The
      state keeps one entry per leaf. True for `Exact`, `Factored` and `Grouped`.
    reduces_matrices: whether `update` reduces over each matrix's axes (row and column
      statistics, an orthogonalisation), so that it needs whole matrices: inside
      `shard_map` a leaf of such an estimator with no batch axes must not vary over
      the manual mesh axes (`check_whole_matrices`). False for elementwise rules.
  """

  name: str = 'second moment'
  per_shape: bool = False
  stacks: bool = False
  reduces_matrices: bool = False

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> SecondMoment:
    """The estimator a leaf of `shape` gets (e.g. `Factored` gives 1-D leaves `Exact`).

    `batch_axes` are the leaf's axes that index independent matrices (a scanned layer
    axis, the expert axis), sorted and non-negative, as the tier normalised them (the
    default layout is every axis before the last two; None, from a direct call, means
    it too). An estimator must keep its statistics and its clip separate along them
    (`Layout` gives the axes to reduce over). The default ignores them (override it to
    honour them).
    """
    del shape, batch_axes
    return self

  @abc.abstractmethod
  def init(self, param: Any, path: str) -> Stats:
    """Zero statistics for `param`, built from it (so that they inherit its sharding)."""

  @abc.abstractmethod
  def update(self, g: jax.Array, stats: Stats, x: jax.Array, step: Step
             ) -> tuple[jax.Array, Stats]:
    """The float32 update `u` of one leaf and its new statistics."""

  def shared(self, x: jax.Array, step: Step) -> Optional[Shared]:
    """`update` split around work that leaves of one group do in one call, or None.

    A stateless estimator (`init` returns `{}`) whose update is `finish(f(operand))` for
    a per-item function `f` batched on the operand's axis 0 (e.g. `Orthogonal`'s
    Newton-Schulz iteration of each matrix) may return `Shared(operand, group, finish)`:
    the tier then runs `group.run` once for the operands of every leaf whose `group`
    is equal (and of the smaller groups it `hosts`), instead of once per leaf. The
    default, None, runs `update` for the leaf alone.
    """
    del x, step
    return None

  def specs(self, spec: Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Mapping[str, Any]:
    """The PartitionSpec of each statistic of a parameter of `shape` sharded as `spec`.

    `spec` has one entry per dimension; `mesh` (None if unknown) gives the number of
    shards per mesh axis; `path` names the parameter in errors (raise a `ValueError`
    for a sharding the estimator cannot work with). Returns a dict with `init`'s keys,
    each a PartitionSpec or a pytree of them matching `init`'s statistics. The default
    keeps `spec` for statistics of the parameter's shape and replicates the others.
    """
    del mesh
    stats = jax.eval_shape(lambda: self.init(jnp.zeros(shape, jnp.float32), path))
    return {k: jax.tree.map(
        lambda a: PartitionSpec(*spec) if tuple(a.shape) == tuple(shape) else PartitionSpec(),
        v) for k, v in stats.items()}


def default_batch_axes(ndim: int) -> tuple[int, ...]:
  """The batch axes a leaf gets unless told otherwise: every axis before the last two."""
  return tuple(range(max(ndim - 2, 0)))


def normalise_batch_axes(batch_axes: Any, shape: tuple[int, ...], path: str
                         ) -> tuple[int, ...]:
  """`batch_axes` checked against `shape`, as sorted non-negative ints.

  None gives the default layout (every axis before the last two). The tier normalises
  each leaf's batch axes once, naming the leaf by its path in errors; estimators get
  the explicit tuple.

  Raises:
    TypeError: if `batch_axes` is not None or a sequence of ints.
    ValueError: if an axis is out of range for the leaf or repeated.
  """
  if batch_axes is None:
    return default_batch_axes(len(shape))
  if isinstance(batch_axes, (str, bytes)) or not hasattr(batch_axes, '__iter__'):
    raise TypeError(f'`batch_axes` of {path} must be a tuple of ints (or None for the '
                    f'default), got {batch_axes!r}.')
  axes = tuple(batch_axes)
  if not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
    raise TypeError(f'`batch_axes` of {path} must be a tuple of ints, got {batch_axes!r}.')
  ndim = len(shape)
  if any(not -ndim <= a < ndim for a in axes):
    raise ValueError(f'`batch_axes` {axes} of {path} are out of range for its shape '
                     f'{tuple(shape)}: allowed axes are {-ndim}..{ndim - 1}.')
  normal = tuple(sorted(a % ndim for a in axes))
  if len(set(normal)) != len(normal):
    raise ValueError(f'`batch_axes` {axes} of {path} name an axis twice.')
  return normal


@dataclasses.dataclass(frozen=True)
class Layout:
  """A leaf's geometry: the batch axes that index its independent matrices (a scanned
  layer axis, the expert axis), and the matrix axes, the others: its rows, then its
  column axis (the last of them). Every per-matrix reduction of an estimator (its
  statistics, the RMS clip) reduces over `matrix`.

  Attributes:
    ndim: the leaf's number of dimensions.
    batch: the batch axes, sorted and non-negative.
  """
  ndim: int
  batch: tuple[int, ...]

  @classmethod
  def of(cls, ndim: int, batch_axes: Optional[tuple[int, ...]] = None) -> Layout:
    """The layout of a leaf with `batch_axes` (sorted, non-negative; None: default)."""
    return cls(ndim, default_batch_axes(ndim) if batch_axes is None else tuple(batch_axes))

  @property
  def matrix(self) -> tuple[int, ...]:
    """The axes of each matrix (of each vector, or of the scalar, for ndim < 2)."""
    return tuple(a for a in range(self.ndim) if a not in self.batch)

  @property
  def rows(self) -> tuple[int, ...]:
    """The row axes: the matrix axes but the last."""
    return self.matrix[:-1]

  @property
  def col(self) -> int:
    """The column axis: the last matrix axis."""
    return self.matrix[-1]

  def matrix_size(self, shape: tuple[int, ...]) -> int:
    """Elements per matrix of a leaf of `shape`."""
    return math.prod(shape[a] for a in self.matrix)


def check_whole_matrices(path: str, arrays: tuple[jax.Array, ...], layout: Layout,
                         what: str) -> None:
  """Raises inside `shard_map` where a leaf's per-matrix reduction would see a block.

  Inside `shard_map` each device holds its block of every argument sharded over a
  manual mesh axis, and a value's type names the manual axes over which it varies
  (`jax.typeof(x).manual_axis_type.varying`), not which of its axes is split. A leaf
  with no batch axes that varies is split on a matrix axis (or is an unaveraged
  gradient): `what` (an update that reduces over whole matrices) would reduce over the
  local block, silently unlike one device. A leaf with batch axes may vary because its
  batch is split (each device its own experts), which needs nothing whole, so it is
  not checked.
  """
  if layout.batch:
    return
  varying = set()
  for x in arrays:
    varying |= varying_axes(x)
  if varying:
    raise ValueError(
        f'{path}: inside shard_map this leaf varies over the manual mesh axes '
        f'{sorted(varying)}, so each device holds only a block of it (or, replicated, a '
        f'gradient not yet averaged), but {what} reduces over whole matrices. Shard only '
        'the batch axes (experts, layers) of such leaves inside shard_map, average '
        'replicated gradients first (jax.lax.pmean), or run the update under jax.jit with '
        'the shardings, which gathers what it needs (docs/sharding.md).')


def varying_axes(x: Any) -> set[str]:
  """The manual mesh axes `x` varies over (empty outside `shard_map`)."""
  try:
    t = jax.typeof(x)
  except (AttributeError, TypeError):
    return set()
  manual = getattr(t, 'manual_axis_type', None)  # jax >= 0.9; before it, `vma`
  return set(getattr(manual, 'varying', None) or getattr(t, 'vma', None) or ())


def clip_divisor(u_of: Callable[..., jax.Array], operands: tuple[Any, ...], layout: Layout,
                 clip: float) -> jax.Array:
  """`max(1, rms(u) / clip)`, rms per matrix of `layout` (keeping its axes).

  `u = u_of(*operands)` is recomputed inside the reduction from operands passed through
  an optimisation barrier on the CPU: without it XLA:CPU materialises the full-size `u` that feeds
  both this reduction and the final elementwise pass. Scalars that `u_of` uses must be
  operands too, or XLA materialises their full-size broadcast, shared by both passes.
  """
  u = u_of(*_xla.cpu_barrier(operands))
  rms = _xla.sqrt(jnp.mean(u * u, axis=layout.matrix, keepdims=True))
  return jnp.maximum(1.0, rms / clip)


def clipped(u_of: Callable[..., jax.Array], operands: tuple[Any, ...], layout: Layout,
            clip: Optional[float]) -> jax.Array:
  """`u = u_of(*operands)`, RMS-clipped per matrix of `layout` when `clip` is set."""
  u = u_of(*operands)
  if clip is not None:
    u = u / clip_divisor(u_of, operands, layout, clip)
  return u


class SharedGroup(abc.ABC):
  """Who may share a call of `SecondMoment.shared` work: equal groups (hashable, e.g. a
  frozen dataclass of the items' shape and the options that fix the computation) share
  one `run`.

  Attributes:
    item_size: elements per item (e.g. `R * C` of a matrix): a host group is never
      smaller than the groups it takes in.
  """

  item_size: int = 1

  def hosts(self, other: SharedGroup) -> bool:
    """Whether this group's call may take `other`'s items too (e.g. zero-padded to this
    group's item shape, giving the same result per item). Default: only equal groups."""
    return other == self

  @abc.abstractmethod
  def run(self, operands: Sequence[jax.Array], key: jax.Array) -> list[jax.Array]:
    """The per-item work of every operand (each `[n_i, ...]`, of this group or one it
    hosts), in one call; `key`: a runtime scalar (the step count) that keeps per-leaf
    offsets out of the compiled constants. Returns one result per operand."""

  def run_one(self, operand: jax.Array) -> jax.Array:
    """The work of one operand on its own (a `Shared` with `alone`)."""
    return self.run([operand], jnp.zeros([], jnp.float32))[0]


class Shared(NamedTuple):
  """One leaf's update, waiting for work that it shares with other leaves
  (`SecondMoment.shared`)."""
  operand: jax.Array  # [n, ...]: the leaf's items, batched on axis 0
  group: SharedGroup  # equal groups (or hosted ones) share one `group.run`
  finish: Callable[[jax.Array], jax.Array]  # `run`'s result for `operand` -> the update u
  # Run on its own (`group.run_one`), not shared: e.g. items sharded where they lie.
  alone: bool = False
