"""State codecs: a full-size statistic stored as low-bit codes and one scale per block.

A tier with `Tier(mu_codec=...)` keeps its momentum encoded between steps. Inside the
step the tier decodes it to float32, applies the moving average, computes the update
from that float32 momentum and encodes it again (as 8-bit Adam does, Dettmers et al.
2021), so no full-size float32 momentum is stored between steps; the codes' error
enters only through the next step's decode.

`Blockwise` is the built-in codec. The leaf is cut into blocks of `block_size`
elements, each block inside one matrix of the leaf (one slice of its batch axes: an
expert's, a layer's matrix; `Layout`). A block covers the trailing matrix axes in
row-major order: along the column axis `C` if `block_size` divides it, or whole rows of
`C` and a part of the next row axis up, and so on. Each block keeps its absolute maximum
`s` (float32) and each element a `bits`-bit code of `x / s`::

  linear  (absmax):  code = round(Q x / s) + Q,   x' = (code - Q) (s / Q),   Q = 2^(b-1) - 1
  dynamic (Dettmers' dynamic-exponent map T, 2^b sorted values in [-1, 1]):
                     code = argmin_k |x / s - T_k|  (ties to the larger),   x' = T[code] s

Round to nearest, deterministic (`jnp.round`: halves to even), by default; with
`rounding='stochastic'` (linear map) `code = floor(Q x / s + u) + Q`, `u ~ U[0, 1)`, an
unbiased rounding whose seed the tier derives from the step count and the leaf's path.
The linear map's error is at most `s / (2 Q)` per element of a block (`s / 254` at 8
bits, `s / 14` at 4 bits, plus float32 rounding; `s / Q` when stochastic); the dynamic
map spends its codes on exponents (`b - 1` exponent bits: 10^-6 .. 1 at 8 bits,
10^-2 .. 1 at 4 bits), so small elements of a block keep their relative precision
(Li et al. 2023 use it for a 4-bit first moment).

Layout of the stored `Coded(codes, scales)`: both have the parameter's rank, so a
parameter's PartitionSpec (and its Flax axis names) carries over unchanged.

* `codes` (uint8): the parameter's shape at 8 bits; at 4 bits two codes per byte along
  the column axis (length `ceil(C / 2)`): element `2i` in the low nibble, `2i + 1` in
  the high nibble, an odd `C`'s last high nibble zero; at any other width `b` (2 .. 7)
  bit planes along the column axis (length `ceil(C / 8) b`): each group of 8 codes as
  `b` bytes, byte `k` holding bit `k` of the group's code `j` at bit `j` (a `C` that 8
  does not divide padded with zero codes);
* `scales` (float32): each axis `n` shortened to `n / e`, `e` the block's extent along
  it (1 on batch axes).

8 bits in blocks of 256: 1.016 B per element (AdamW's momentum: 4 B); 5 bits in blocks
of 256: 0.641 B; 4 bits in blocks of 64: 0.5625 B.

References:
  Dettmers, Lewis, Shleifer & Zettlemoyer, 8-bit Optimizers via Block-wise
  Quantization, arXiv 2110.02861, 2021.
  Li, Chen & Zhu, Memory Efficient Optimizers with 4-bit States, arXiv 2309.01507, 2023.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from skewadam_jax.core import checks as _checks
from skewadam_jax.estimators import base as _base
from skewadam_jax.estimators import blocks as _blocks

MAPPINGS = ('linear', 'dynamic')
BITS = tuple(range(2, 9))  # 2 .. 8 bits per code
FITS = ('exact', 'nearest')
ROUNDINGS = ('nearest', 'stochastic')
MAX_LISTED_SIZES = 12  # block sizes an error lists before it says how many more fit


class Coded(NamedTuple):
  """A statistic stored by `Blockwise`: codes and one scale per block (see module doc)."""
  codes: jax.Array  # uint8, the parameter's shape; 4-bit: column axis ceil(C / 2).
  scales: jax.Array  # float32, each axis n -> n / (block extent along it).


class StateCodec(abc.ABC):
  """How a tier stores a full-size statistic (its momentum) between steps.

  A codec is static configuration (a frozen dataclass works well). The tier calls
  `for_leaf` once per leaf, then `init`, and inside each step `decode` and `encode`;
  the reports call `specs`.

  Attributes:
    name: the codec's name in reports.
    per_shape: whether `init` depends on the leaf's shape and this object's (hashable)
      options only, never on `path` (which then only names the leaf in errors): the
      tier caches the coded momentum's shapes per shape, as for `Blockwise`.
  """

  name: str = 'codec'
  per_shape: bool = False

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> Optional[StateCodec]:
    """The codec bound to a leaf of `shape` with `batch_axes` (sorted, non-negative), or
    None: that leaf keeps its momentum as a float32 array."""
    del shape, batch_axes
    return self

  def for_shard(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]],
                size: int) -> Optional[StateCodec]:
    """`for_leaf` of one device's shard, of `shape`, of a parameter of `size` elements
    (inside `shard_map` the update sees shards): a decision on the parameter's size is
    made on `size`, so that every shard keeps the state `init` made for the whole
    parameter. Default: `for_leaf(shape, batch_axes)`."""
    del size
    return self.for_leaf(shape, batch_axes)

  @abc.abstractmethod
  def init(self, param: Any, path: str) -> Any:
    """The encoded zeros of `param`'s shape (a pytree of arrays), built from `param` so
    that they inherit its sharding. Raises a ValueError naming `path` if the leaf does
    not fit the codec."""

  @abc.abstractmethod
  def encode(self, x: jax.Array, seed: Optional[jax.Array] = None) -> Any:
    """`x` (float32, the bound leaf's shape) encoded: a pytree of `init`'s structure.
    `seed`: a uint32 scalar for a codec that rounds stochastically (`needs_seed`), else
    None."""

  @property
  def needs_seed(self) -> bool:
    """Whether `encode` draws random numbers (the tier then passes a seed that is a
    function of the step count and the leaf's path, so a resumed run draws the same)."""
    return False

  @abc.abstractmethod
  def decode(self, stored: Any) -> jax.Array:
    """The float32 array of the bound leaf's shape that `stored` encodes."""

  def specs(self, spec: _base.Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Any:
    """The PartitionSpec of each array `init` makes, for a parameter sharded as `spec`
    (one entry per dimension); the default replicates them."""
    del spec, mesh
    stored = jax.eval_shape(lambda: self.init(jnp.zeros(shape, jnp.float32), path))
    return jax.tree.map(lambda _: PartitionSpec(), stored)


@jax.custom_vjp
def _no_derivative(scales: jax.Array) -> jax.Array:
  """The scales of new codes, refusing a derivative: the codes beside them are
  integers, so a derivative through a stored coded momentum would flow through its
  scales alone and be silently wrong (measured:
  benchmarks/RESULTS.md, "Numbers behind the library's choices").
  One step's update is computed from the float32 momentum, not from these,
  so `jax.grad` of an update with respect to its gradient stays exact."""
  return scales


def _no_derivative_fwd(scales: jax.Array) -> tuple[jax.Array, None]:
  return scales, None


def _no_derivative_bwd(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
  raise TypeError(
      'jax.grad through a coded momentum (sj.Blockwise codes in the optimizer state): the '
      'codes are integers and have no derivative. Differentiate one step\'s update with '
      'respect to its gradient (exact), or give the tier a float32 momentum '
      '(`mu_codec=None`) to differentiate through the state across steps.')


_no_derivative.defvjp(_no_derivative_fwd, _no_derivative_bwd)


# ------------------------------------------------------------------------------ the maps


@dataclasses.dataclass(frozen=True)
class Blockwise(StateCodec):
  """Blockwise low-bit codes with one float32 absmax scale per block (see module doc).

  Attributes:
    bits: 2 to 8 bits per code: 8 one code per byte, 4 two codes per byte, any other
      width as bit planes (8 codes in `bits` bytes); `bits / 8` bytes per element.
    block_size: elements per block (static); it must fit every leaf of the tier: the
      block lies inside one matrix (one slice of the batch axes) and, along each axis,
      divides it or covers it whole (`init` lists the sizes that fit). Even at 4 bits.
    mapping: `'linear'` (absmax, `2^(b-1) - 1` levels each side of 0) or `'dynamic'`
      (Dettmers' dynamic-exponent map).
    fit: what a leaf that `block_size` does not fit gets: `'exact'` refuses it at
      `init` (a ValueError listing the sizes that fit); `'nearest'` gives it the fitting
      size nearest to `block_size` on a log scale (the smaller on a tie), e.g. 228 for
      a `[2048, 10944]` matrix at 256, so that one codec serves any model's widths.
      `memory_report` counts the bytes of the sizes chosen.
    rounding: `'nearest'` (deterministic round to nearest) or `'stochastic'` (linear map
      only: `floor(Q x / s + u)`, `u ~ U[0, 1)`, an unbiased rounding, so that a small
      `(1 - b1) g` is not rounded away step after step; the key is a function of the
      step count and the leaf's path, the numbers a hash of each element's position).
    min_size: leaves with fewer elements keep a float32 momentum (`for_leaf` returns
      None), as bitsandbytes' `min_8bit_size`: the codes of a norm's gain or a bias
      save a few bytes and cost the step kernels compiled for its shape alone. Default
      0: every leaf is coded.
    shape: the bound leaf's shape (`for_leaf` sets it), or None.
    batch_axes: the bound leaf's batch axes (`for_leaf` sets them), or None (default).

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> codec = sj.Blockwise(bits=4, block_size=64)
    >>> tx = sj.scale_by_tiered_adam(tier=sj.Tier(mu_codec=codec))
    >>> state = tx.init({'w': jnp.zeros((8, 128))})
    >>> state.mu['w'].codes.shape, state.mu['w'].scales.shape
    ((8, 64), (8, 2))

  References:
    Dettmers et al., 8-bit Optimizers via Block-wise Quantization, arXiv 2110.02861.
    Li et al., Memory Efficient Optimizers with 4-bit States, arXiv 2309.01507.
  """

  bits: int = 8
  block_size: int = 256
  mapping: str = 'linear'
  fit: str = 'exact'
  rounding: str = 'nearest'
  min_size: int = 0
  shape: Optional[tuple[int, ...]] = None
  batch_axes: Optional[tuple[int, ...]] = None
  per_shape = True  # the path only names the leaf in errors

  def __post_init__(self):
    _checks.check_positive_int('bits', self.bits)
    if self.bits not in BITS:
      raise ValueError(f'`bits` of sj.Blockwise must be one of {BITS}, got {self.bits!r}.')
    _checks.check_positive_int('block_size', self.block_size)
    if self.bits == 4 and self.block_size % 2:
      raise ValueError(f'`block_size` of a 4-bit sj.Blockwise must be even (two codes per '
                       f'byte), got {self.block_size}.')
    _checks.check_choice('mapping', self.mapping, MAPPINGS)
    _checks.check_choice('fit', self.fit, FITS)
    _checks.check_choice('rounding', self.rounding, ROUNDINGS)
    if self.rounding == 'stochastic' and self.mapping != 'linear':
      raise ValueError("`rounding='stochastic'` of sj.Blockwise needs `mapping='linear'`, "
                       f'got mapping={self.mapping!r}.')
    if not (isinstance(self.min_size, int) and not isinstance(self.min_size, bool)
            and self.min_size >= 0):
      raise ValueError('`min_size` of sj.Blockwise must be a non-negative int (leaves with '
                       f'fewer elements keep a float32 momentum), got {self.min_size!r}.')
    if self.shape is not None:
      object.__setattr__(self, 'shape', tuple(int(n) for n in self.shape))
    if self.batch_axes is not None:
      object.__setattr__(self, 'batch_axes', tuple(int(a) for a in self.batch_axes))

  @property
  def name(self) -> str:  # type: ignore[override]
    return f'{self.bits}-bit {self.mapping}/{self.block_size}'

  def for_leaf(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]] = None
               ) -> Optional[Blockwise]:
    return self.for_shard(shape, batch_axes, math.prod(shape))

  def for_shard(self, shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]],
                size: int) -> Optional[Blockwise]:
    batch_axes = _base.Layout.of(len(shape), batch_axes).batch
    shape = tuple(shape)
    if size < self.min_size:  # the whole parameter's size
      return None
    if (shape, batch_axes) == (self.shape, self.batch_axes):
      return self
    return dataclasses.replace(self, shape=shape, batch_axes=batch_axes)

  # The bound leaf's geometry.

  def _bound(self, shape: tuple[int, ...], path: str) -> Blockwise:
    if self.shape == tuple(shape):
      return self
    # Called on a codec used directly (not through a tier): `min_size` does not apply.
    return dataclasses.replace(self, shape=tuple(shape), batch_axes=_base.Layout.of(
        len(shape), self.batch_axes).batch)

  def _extents(self, path: str = 'leaf') -> tuple[int, ...]:
    shape = self.shape if self.shape is not None else ()
    extents = _blocks.block_extents(shape, self.batch_axes, self.block_size)
    if extents is not None:
      return extents
    layout = _base.Layout.of(len(shape), self.batch_axes)
    sizes = _blocks.fitting_block_sizes(shape, self.batch_axes, even=self.bits == 4)
    if self.fit == 'nearest' and sizes:
      size = min(sizes, key=lambda n: (abs(np.log(n / self.block_size)), n))
      return _blocks.block_extents(shape, self.batch_axes, size)
    listed = ', '.join(map(str, sizes[:MAX_LISTED_SIZES]))
    if len(sizes) > MAX_LISTED_SIZES:
      listed += f' and {len(sizes) - MAX_LISTED_SIZES} more up to {sizes[-1]}'
    matrix = tuple(shape[a] for a in layout.matrix)
    raise ValueError(
        f'`block_size`={self.block_size} of sj.Blockwise does not fit parameter {path} '
        f'of shape {shape} (batch axes {layout.batch}, matrices of shape {matrix}): a block '
        'lies inside one matrix and, along each axis from the last, divides it or covers '
        f'it whole. Allowed block sizes for this leaf: {listed or "none"}.')

  def _pack_axis(self) -> Optional[int]:
    """The axis codes are packed along: the column axis (None for a 0-d leaf)."""
    layout = _base.Layout.of(len(self.shape), self.batch_axes)
    return layout.matrix[-1] if layout.matrix else None

  def _scales_shape(self, extents: tuple[int, ...]) -> tuple[int, ...]:
    """The stored scales' shape: each axis n shortened to n / e."""
    return tuple(n // e for n, e in zip(self.shape, extents))

  def _code_of_zero(self) -> int:
    q = 2**(self.bits - 1) - 1
    if self.mapping == 'linear':
      return q
    return int(np.flatnonzero(_blocks.dynamic_map(self.bits) == 0)[0])

  # The codec.

  def init(self, param: Any, path: str) -> Coded:
    codec = self._bound(tuple(param.shape), path)
    extents = codec._extents(path)
    placed = _blocks.explicit_spec(param)
    if placed is not None:  # an Explicit mesh: blocks that straddle shards raise here
      codec.specs(placed.entries, codec.shape, placed.mesh, path)
    if not _blocks.inherits_sharding(param):
      codes = _blocks.packed_constant(codec.shape, codec._pack_axis(), codec.bits,
                                      codec._code_of_zero())
      return Coded(codes, jnp.zeros(codec._scales_shape(extents), jnp.float32))
    # Built from the parameter, so that the state is placed as it is, axis by axis.
    zeros = jnp.zeros_like(param, dtype=jnp.float32)
    scales = _blocks.reshape(zeros, _blocks.split_shape(codec.shape, extents),
                             _blocks.outer(_blocks.explicit_spec(zeros)))
    scales = scales.sum(axis=tuple(range(1, 2 * len(extents), 2)))
    codes = jnp.full_like(param, codec._code_of_zero(), dtype=jnp.uint8)
    return Coded(_blocks.pack_codes(codes, codec._pack_axis(), codec.bits), scales)

  @property
  def needs_seed(self) -> bool:
    return self.rounding == 'stochastic'

  def encode(self, x: jax.Array, seed: Optional[jax.Array] = None) -> Coded:
    if self.needs_seed and seed is None:
      raise ValueError("sj.Blockwise(rounding='stochastic').encode needs a uint32 `seed`.")
    codec = self._bound(tuple(x.shape), 'leaf')
    extents = codec._extents()
    spec = _blocks.explicit_spec(x)
    blocks = _blocks.reshape(x.astype(jnp.float32), _blocks.split_shape(x.shape, extents),
                             _blocks.outer(spec))
    inner = tuple(range(1, 2 * x.ndim, 2))
    absmax = jnp.max(jnp.abs(blocks), axis=inner, keepdims=True)
    # A NaN or an Inf in a block makes its scale NaN, so that the whole block decodes
    # to NaN from then on, as a float32 momentum keeps its NaN: spelled out because a
    # max reduction may skip NaN (XLA:CPU's does under jit) and an Inf scale would
    # code the block's finite values as 0.
    finite = jax.lax.expand_dims(jax.lax.reduce_and(jax.lax.is_finite(blocks), inner), inner)
    absmax = jax.lax.select(finite, absmax, jax.lax.full_like(absmax, np.nan))
    # lax, not jnp.where / jnp.round: those are jitted functions, traced and lowered
    # again for every leaf's shape (the same operations).
    y = blocks / jax.lax.select(absmax > 0, absmax, jax.lax.full_like(absmax, 1.0))
    # A non-finite block's codes: those of 0, the same on every platform (a float NaN
    # cast to uint8 is not), which its NaN scale decodes to NaN.
    y = jax.lax.select(jax.lax.broadcast_in_dim(finite, y.shape, tuple(range(y.ndim))), y,
                       jax.lax.full_like(y, 0.0))
    if self.mapping == 'linear':
      q = 2**(self.bits - 1) - 1
      if self.needs_seed:  # floor(y q + u) lies in [-q, q] since |y| <= 1 and u < 1
        u = _blocks.dither(tuple(x.shape), jnp.asarray(seed, jnp.uint32))
        u = _blocks.reshape(u, blocks.shape, _blocks.outer(spec))
        codes = (jnp.floor(y * q + u) + q).astype(jnp.uint8)
      else:
        codes = (jax.lax.round(y * q, jax.lax.RoundingMethod.TO_NEAREST_EVEN) + q
                 ).astype(jnp.uint8)
    else:
      mids = _blocks.midpoints(_blocks.dynamic_map(self.bits))
      codes = _blocks.nearest(y, mids, self.bits).astype(jnp.uint8)
    codes = _blocks.reshape(codes, tuple(x.shape), spec)
    codes = _blocks.pack_codes(codes, codec._pack_axis(), self.bits)
    scales = _blocks.reshape(absmax, absmax.shape[::2] if x.ndim else (), spec)
    return Coded(codes, _no_derivative(scales))

  def decode(self, stored: Coded) -> jax.Array:
    if self.shape is None:
      raise ValueError('sj.Blockwise.decode needs the leaf\'s shape: bind it with '
                       '`codec.for_leaf(shape, batch_axes)` first.')
    codes, scales = stored
    axis = self._pack_axis()
    if axis is not None:
      codes = _blocks.unpack_codes(codes, axis, self.shape[axis], self.bits)
    extents = self._extents()
    spec = _blocks.explicit_spec(codes)
    codes = _blocks.reshape(codes, _blocks.split_shape(self.shape, extents), _blocks.outer(spec))
    scales = _blocks.reshape(scales, tuple(d for n, e in zip(self.shape, extents)
                                    for d in (n // e, 1)), _blocks.outer(spec))
    if self.mapping == 'linear':
      q = 2**(self.bits - 1) - 1
      values = (codes.astype(jnp.float32) - q) * (scales / q)
    else:
      table = jnp.asarray(_blocks.dynamic_map(self.bits))
      values = _blocks.lookup(table, codes.astype(jnp.int32)) * scales
    return _blocks.reshape(values, self.shape, spec)

  def specs(self, spec: _base.Spec, shape: tuple[int, ...], mesh: Optional[Mesh], path: str
            ) -> Coded:
    """The parameter's spec for the codes and the scales (both keep its rank), if every
    shard holds whole blocks (and whole bytes of packed codes); a ValueError otherwise."""
    codec = self._bound(tuple(shape), path)
    extents = codec._extents(path)
    pack = codec._pack_axis()
    group = _blocks.pack_group(codec.bits)
    for axis, (n, e) in enumerate(zip(shape, extents)):
      shards = _blocks.shards(spec[axis], mesh)
      if shards == 1:
        continue
      per_shard = n // shards if n % shards == 0 else None
      packed = axis == pack and group > 1
      if per_shard is None or per_shard % e or (packed and per_shard % group):
        need = f'a multiple of {e}' + (f' (and of {group}: whole bytes)' if packed else '')
        raise ValueError(
            f'Parameter {path} of shape {tuple(shape)} is sharded over mesh axis '
            f'{spec[axis]!r} into {shards} shards along axis {axis}, but its {codec.name} '
            f'momentum needs {need} elements of that axis per shard (whole blocks of '
            f'{codec.block_size}). Choose a block size or a sharding that keeps blocks '
            'within shards.')
    return Coded(PartitionSpec(*spec), PartitionSpec(*spec))
