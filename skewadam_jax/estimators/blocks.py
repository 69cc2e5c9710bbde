"""The blockwise geometry and the code maps of `codec.Blockwise`.

Where blocks lie in a leaf (`block_extents`: inside one matrix of its `Layout`, along
the trailing matrix axes in row-major order), the block sizes that fit, the dynamic-
exponent table and nearest-value search, the packing of two 4-bit codes per byte, and
the reshapes that keep an Explicit mesh's sharding.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from skewadam_jax.estimators import base as _base


@functools.cache
def dynamic_map(bits: int) -> np.ndarray:
  """Dettmers' signed dynamic-exponent map with `bits - 1` exponent bits: 2^bits sorted
  float32 values in [-1, 1], 0 and 1 among them (bitsandbytes' `create_dynamic_map(
  signed=True, max_exponent_bits=bits - 1, total_bits=bits)`).

  For exponent `i` in `0 .. bits - 2`, the `2^i` midpoints of `linspace(0.1, 1, 2^i + 1)`
  times `10^(i - bits + 2)`, each with both signs; then 0 and 1.
  """
  exponent_bits = bits - 1
  values: list[float] = []
  for i in range(exponent_bits):
    bounds = np.linspace(0.1, 1.0, 2**i + 1)
    means = (bounds[:-1] + bounds[1:]) / 2.0
    values += list(10.0**(i - exponent_bits + 1) * means)
    values += list(-10.0**(i - exponent_bits + 1) * means)
  values += [0.0, 1.0]
  assert len(values) == 2**bits
  table = np.sort(np.asarray(values, np.float64)).astype(np.float32)
  table.setflags(write=False)
  return table


def midpoints(table: np.ndarray) -> np.ndarray:
  """The decision thresholds of round-to-nearest on a sorted float32 table (float32)."""
  return ((table[:-1] + table[1:]) / np.float32(2)).astype(np.float32)


def nearest(y: jax.Array, mids: np.ndarray, bits: int) -> jax.Array:
  """The number of `mids` <= `y` (`searchsorted(mids, y, side='right')`): the index of
  the nearest table value, ties to the larger. A binary search of `bits` elementwise
  steps on the 2^bits - 1 thresholds: no [n, 2^bits] comparison is built."""
  mids = jnp.asarray(mids)
  code = jnp.zeros_like(y, dtype=jnp.int32)
  for k in reversed(range(bits)):
    candidate = code + (1 << k)
    code = jnp.where(y >= lookup(mids, candidate - 1), candidate, code)
  return code


def lookup(table: jax.Array, index: jax.Array) -> jax.Array:
  """`table[index]` for a small replicated table, placed like `index` (under an Explicit
  mesh a gather must name its output's sharding)."""
  placed = explicit_spec(index)
  if placed is None:
    return table[index]
  return table.at[index].get(out_sharding=NamedSharding(
      placed.mesh, PartitionSpec(*placed.entries)))


def fmix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser (uint32 -> uint32, a bijection that mixes every
  input bit into every output bit)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def dither(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
  """Uniform float32 numbers in [0, 1) for the elements of `shape`, a hash of each
  element's row-major position and `seed` (uint32).

  A counter-based hash, not `jax.random`: a few integer operations that fuse into the
  encoding (threefry doubled the compile time of a coded tier's step), and like
  threefry a function of the position only, so any sharding draws the same numbers.
  Positions are taken modulo 2^32 (a leaf of more elements repeats its pattern there).
  """
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(
        stride % 2**32)
    stride *= shape[axis]
  bits = fmix32(index * jnp.uint32(0x9E3779B1) + seed.astype(jnp.uint32))
  return (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)


# ------------------------------------------------------------------------------ geometry


def block_extents(shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]],
                  block_size: int) -> Optional[tuple[int, ...]]:
  """Each axis's extent in a block of `block_size` elements (1 on batch axes), or None if
  no block of that size fits: a block covers the trailing matrix axes in row-major
  order, so along each axis it must divide the axis or cover it whole."""
  layout = _base.Layout.of(len(shape), batch_axes)
  extents = [1] * len(shape)
  if not math.prod(shape):  # no element: every block size fits, none is stored
    return tuple(extents)
  rest = block_size
  for axis in reversed(layout.matrix):
    if rest == 1:
      break
    n = shape[axis]
    if rest >= n:
      if rest % n:
        return None
      extents[axis], rest = n, rest // n
    else:
      if n % rest:
        return None
      extents[axis], rest = rest, 1
  return tuple(extents) if rest == 1 else None


@functools.lru_cache(maxsize=1024)
def fitting_block_sizes(shape: tuple[int, ...], batch_axes: Optional[tuple[int, ...]],
                        even: bool = False) -> tuple[int, ...]:
  """Every block size that fits a leaf (`block_extents` not None), ascending; `even`:
  only even ones (4-bit codes). Cached: a model repeats few shapes."""
  layout = _base.Layout.of(len(shape), batch_axes)
  size = layout.matrix_size(shape)
  divisors = set()
  for d in range(1, math.isqrt(size) + 1):
    if size % d == 0:
      divisors.update((d, size // d))
  return tuple(sorted(d for d in divisors if (not even or d % 2 == 0)
                      and block_extents(shape, batch_axes, d) is not None))


def split_shape(shape: tuple[int, ...], extents: tuple[int, ...]) -> tuple[int, ...]:
  """`shape` with each axis `n` split into `(n / e, e)`."""
  return tuple(d for n, e in zip(shape, extents) for d in (n // e, e))


def inherits_sharding(param: Any) -> bool:
  """Whether a codec's `init` builds the state from `param`, so that it inherits its
  placement: a concrete array (on its devices), or a traced one whose type names a mesh
  (under `jax.set_mesh`; the state's type then matches what a step returns). A traced
  parameter without a mesh (under `jax.eval_shape`, or `jit` outside a mesh) gets the
  same arrays built directly, which traces fewer operations."""
  if not isinstance(param, jax.core.Tracer):
    return True
  try:
    mesh = jax.typeof(param).sharding.mesh
  except (AttributeError, TypeError):  # a jax whose types carry no sharding
    return False
  return not getattr(mesh, 'empty', True)


class Placed(NamedTuple):
  """Where an array lies under an Explicit mesh: the mesh and one spec entry per axis."""
  mesh: Any
  entries: tuple[Any, ...]


def explicit_spec(x: jax.Array) -> Optional[Placed]:
  """The mesh and spec of `x`'s type under an Explicit mesh, else None.

  Under an Explicit mesh a reshape of a sharded axis must name its output's sharding.
  Every reshape here splits an axis into (outer, inner) or merges them back, with whole
  blocks (and bytes) per shard (`Blockwise.specs` checks it): the outer part keeps the
  axis's sharding.
  """
  try:
    sharding = jax.typeof(x).sharding
  except (AttributeError, TypeError):
    return None
  spec, mesh = getattr(sharding, 'spec', None), getattr(sharding, 'mesh', None)
  if spec is None or mesh is None:
    return None
  entries = tuple(spec) + (None,) * (x.ndim - len(tuple(spec)))
  return Placed(mesh, entries) if any(e is not None for e in entries) else None


def reshape(x: jax.Array, shape: tuple[int, ...], placed: Optional[Placed]) -> jax.Array:
  """`x.reshape(shape)`, naming the output's sharding under an Explicit mesh."""
  if placed is None:
    return x.reshape(shape)
  return jax.lax.reshape(x, shape, out_sharding=NamedSharding(
      placed.mesh, PartitionSpec(*placed.entries)))


def outer(placed: Optional[Placed]) -> Optional[Placed]:
  """The placement of each axis split into (outer, inner): the outer part keeps it."""
  return None if placed is None else placed._replace(
      entries=tuple(d for e in placed.entries for d in (e, None)))


def _split(x: jax.Array, axis: int, size: int) -> jax.Array:
  """`x` with `axis` (padded with zeros to a multiple of `size`) split into
  `(n / size, size)`; the outer part keeps the axis' placement."""
  n = x.shape[axis]
  if n % size:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -n % size)
    x = jnp.pad(x, pad)
  spec = explicit_spec(x)
  split = None if spec is None else spec._replace(
      entries=spec.entries[:axis + 1] + (None,) + spec.entries[axis + 1:])
  return reshape(x, x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:],
                 split)


def _prefix(x: jax.Array, n: int, axis: int) -> jax.Array:
  """The first `n` elements of `x` along `axis` (no slice op when that is all of it)."""
  return x if x.shape[axis] == n else jax.lax.slice_in_dim(x, 0, n, 1, axis)


def pack_nibbles(codes: jax.Array, axis: int) -> jax.Array:
  """4-bit codes (uint8 < 16) packed two per byte along `axis`: element `2i` in the low
  nibble, `2i + 1` in the high one; an odd length gets a zero high nibble last."""
  pairs = _split(codes, axis, 2)
  low = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
  high = jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
  return low | (high << 4)


def unpack_nibbles(packed: jax.Array, axis: int, n: int) -> jax.Array:
  """The `n` 4-bit codes along `axis` that `pack_nibbles` packed."""
  spec = explicit_spec(packed)
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
  shape = packed.shape[:axis] + (2 * packed.shape[axis],) + packed.shape[axis + 1:]
  return _prefix(reshape(pairs, shape, spec), n, axis)


PLANE_GROUP = 8  # codes per group of the bit-plane layout: one byte per bit of a code


def _gather_bits(x: jax.Array, axis: int, out: int) -> jax.Array:
  """The bit-plane transpose along `axis` (of length m): byte `i` (i < `out`) of the
  result holds bit `i` of each of the m bytes along `axis`, the j-th at bit j. Packing is
  this with the 8 codes of a group and `out` = bits; unpacking with the `bits` planes
  and `out` = 8."""
  m = x.shape[axis]
  rest = (1,) * (x.ndim - axis - 1)
  # NumPy constants: nothing to trace per call.
  bit = np.arange(out, dtype=np.uint8).reshape((1, out) + rest)
  place = np.arange(m, dtype=np.uint8).reshape((m, 1) + rest)
  # One broadcast and one sum over the m bytes (their bits never overlap, so the sum is
  # their bitwise or), not a sum per output byte: a step decodes in several fused
  # kernels, each of which would repeat `out` reductions.
  return jnp.sum(((jnp.expand_dims(x, axis + 1) >> bit) & 1) << place, axis=axis,
                 dtype=jnp.uint8)


def pack_planes(codes: jax.Array, axis: int, bits: int) -> jax.Array:
  """`bits`-bit codes (uint8 < 2^bits) packed as bit planes along `axis`: the codes in
  groups of 8 (a length that 8 does not divide padded with zero codes), each group
  stored as `bits` bytes, byte k holding bit k of the group's codes, code j at bit j.
  Length along `axis`: `ceil(n / 8) * bits`, so exactly `bits / 8` bytes per code."""
  spec = explicit_spec(codes)
  planes = _gather_bits(_split(codes, axis, PLANE_GROUP), axis + 1, bits)
  shape = planes.shape[:axis] + (planes.shape[axis] * bits,) + planes.shape[axis + 2:]
  return reshape(planes, shape, spec)


def unpack_planes(packed: jax.Array, axis: int, n: int, bits: int) -> jax.Array:
  """The `n` codes along `axis` that `pack_planes` packed."""
  spec = explicit_spec(packed)
  codes = _gather_bits(_split(packed, axis, bits), axis + 1, PLANE_GROUP)
  shape = codes.shape[:axis] + (codes.shape[axis] * PLANE_GROUP,) + codes.shape[axis + 2:]
  return _prefix(reshape(codes, shape, spec), n, axis)


def pack_codes(codes: jax.Array, axis: Optional[int], bits: int) -> jax.Array:
  """Codes stored at their width along `axis`: 8 bits one per byte, 4 bits two per byte
  (`pack_nibbles`), any other width as bit planes (`pack_planes`); a 0-d leaf
  (`axis` None) keeps one byte."""
  if axis is None or bits == 8:
    return codes
  return pack_nibbles(codes, axis) if bits == 4 else pack_planes(codes, axis, bits)


def unpack_codes(packed: jax.Array, axis: Optional[int], n: int, bits: int) -> jax.Array:
  """The `n` codes along `axis` that `pack_codes` stored."""
  if axis is None or bits == 8:
    return packed
  return unpack_nibbles(packed, axis, n) if bits == 4 else unpack_planes(packed, axis, n, bits)


def packed_constant(shape: tuple[int, ...], axis: Optional[int], bits: int, code: int
                    ) -> jax.Array:
  """The stored (packed along `axis`) codes of a leaf of `shape` whose every code is
  `code`. Where whole groups fill the packed axis each packed row repeats one group's
  bytes: one broadcast of a constant row, rather than packing a full array while
  tracing."""
  if axis is None or bits == 8:
    return jnp.full(shape, code, jnp.uint8)
  n, group = shape[axis], pack_group(bits)
  if n % group:  # a padded last group: pack it as it is stored
    return pack_codes(jnp.full(shape, code, jnp.uint8), axis, bits)
  # Whole groups: `bits / 8` bytes per code along the packed axis.
  packed = shape[:axis] + (n * bits // 8,) + shape[axis + 1:]
  if bits == 4:
    return jnp.full(packed, code | code << 4, jnp.uint8)
  planes = np.asarray([0xFF if code >> k & 1 else 0 for k in range(bits)], np.uint8)
  row = np.tile(planes, n // group).reshape((-1,) + (1,) * (len(shape) - axis - 1))
  return jnp.broadcast_to(row, packed)


def pack_group(bits: int) -> int:
  """Codes per whole run of bytes along the packed axis: a shard must hold a multiple."""
  return {8: 1, 4: 2}.get(bits, PLANE_GROUP)


def shards(entry: Any, mesh: Optional[Mesh]) -> int:
  """Number of shards a spec entry splits an axis into (1 if unknown)."""
  if mesh is None or entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([mesh.shape[name] for name in names], dtype=np.int64))

