"""Independent NumPy float64 reference of the update rules in docs/update-rules.md.

Nothing here imports skewadam_jax: every rule is re-derived from that statement of the
rules, so that the tests compare two independent implementations.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np


def ref_groupmean(x: np.ndarray, s: int, axis: Optional[int]) -> np.ndarray:
  """Mean over runs of `s` along `axis`; the short last group is padded with its mean."""
  if axis is None:
    return x.copy()
  x = np.moveaxis(x, axis, -1)
  n = x.shape[-1]
  k = -(-n // s)
  out = np.empty(x.shape[:-1] + (k,), dtype=x.dtype)
  for j in range(k):
    out[..., j] = x[..., j * s:min(n, (j + 1) * s)].mean(axis=-1)
  return np.moveaxis(out, -1, axis)


def ref_expand(nu: np.ndarray, s: int, axis: Optional[int], n: int) -> np.ndarray:
  """Repeats each group value `s` times along `axis` and crops to `n`."""
  if axis is None:
    return nu.copy()
  return np.take(np.repeat(nu, s, axis=axis), np.arange(n), axis=axis)


def leaf_axis(ndim: int, axis: int) -> Optional[int]:
  """Grouping axis of a leaf: None for 0-d, 0 for 1-D, else `axis` made positive."""
  if ndim == 0:
    return None
  if ndim == 1:
    return 0
  return axis % ndim


class RefAdamPM:
  """AdamPM (docs/update-rules.md, "AdamPM") on one leaf, in float64, with AdamW-style decay."""

  def __init__(self, shape, b1=0.9, b2=0.999, eps=1e-8, s=8, axis=-1):
    self.b1, self.b2, self.eps, self.s = b1, b2, eps, s
    self.axis = leaf_axis(len(shape), axis)
    self.m = np.zeros(shape)
    self.nu = ref_groupmean(np.zeros(shape), s, self.axis)
    self.t = 0

  def update(self, g: np.ndarray) -> np.ndarray:
    g = np.asarray(g, np.float64)
    self.t += 1
    self.m = self.b1 * self.m + (1 - self.b1) * g
    self.nu = self.b2 * self.nu + (1 - self.b2) * ref_groupmean(g * g, self.s, self.axis)
    bc1, bc2 = 1 - self.b1**self.t, 1 - self.b2**self.t
    n = g.shape[self.axis] if self.axis is not None else 1
    return (self.m / bc1) / (np.sqrt(ref_expand(self.nu / bc2, self.s, self.axis, n))
                             + self.eps)


class RefTier:
  """One SkewAdam tier (docs/update-rules.md, "SkewAdam") on one leaf, in float64."""

  def __init__(self, shape, *, momentum=True, second_moment='factored', clip=1.0,
               eps_mode='floor', group_size=8, group_axis=-1, b1=0.9, b2=0.999,
               eps=1e-8):
    self.shape = tuple(shape)
    self.momentum, self.clip, self.eps_mode = momentum, clip, eps_mode
    self.b1, self.b2, self.eps, self.s = b1, b2, eps, group_size
    nd = len(shape)
    if second_moment == 'factored' and nd >= 2:
      self.kind = 'factored'
      self.r = np.zeros(self.shape[:-1])
      self.c = np.zeros(self.shape[:-2] + self.shape[-1:])
    elif second_moment == 'grouped' and nd >= 1:
      self.kind = 'grouped'
      self.axis = leaf_axis(nd, group_axis)
      self.v = ref_groupmean(np.zeros(shape), group_size, self.axis)
    else:
      self.kind = 'exact'
      self.v = np.zeros(shape)
    self.m = np.zeros(shape)
    self.t = 0
    self.clipped = 0  # steps on which the RMS clip engaged (for the tests' coverage)
    self.floored = 0  # steps on which the eps floor engaged somewhere in the leaf

  def update(self, g: np.ndarray) -> np.ndarray:
    g = np.asarray(g, np.float64)
    b1, b2, eps = self.b1, self.b2, self.eps
    self.t += 1
    bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
    if self.kind == 'factored':
      self.r = b2 * self.r + (1 - b2) * (g * g).mean(axis=-1)
      self.c = b2 * self.c + (1 - b2) * (g * g).mean(axis=-2)
      rn = self.r / np.maximum(self.r.mean(axis=-1, keepdims=True), 1e-15)
      vfull = rn[..., :, None] * self.c[..., None, :]
    elif self.kind == 'grouped':
      self.v = b2 * self.v + (1 - b2) * ref_groupmean(g * g, self.s, self.axis)
      vfull = ref_expand(self.v, self.s, self.axis, g.shape[self.axis])
    else:
      self.v = b2 * self.v + (1 - b2) * g * g
      vfull = self.v
    if self.momentum:
      self.m = b1 * self.m + (1 - b1) * g
    if self.eps_mode == 'floor':
      num = self.m * math.sqrt(bc2) / bc1 if self.momentum else g * math.sqrt(bc2)
      if self.kind == 'factored':
        d = (np.sqrt(np.maximum(rn, eps))[..., :, None]
             * np.sqrt(np.maximum(self.c, eps))[..., None, :])
      else:
        d = np.sqrt(np.maximum(vfull, eps))
      if self.kind == 'factored':
        self.floored += bool((rn < eps).any() or (self.c < eps).any())
      else:
        self.floored += bool((vfull < eps).any())
      u = num / d
    else:
      num = self.m / bc1 if self.momentum else g
      u = num / (np.sqrt(vfull / bc2) + eps)
    if self.clip is not None:
      if u.ndim >= 2:
        rms = np.sqrt((u * u).mean(axis=(-2, -1), keepdims=True))
      else:
        rms = np.sqrt((u * u).mean())
      self.clipped += bool((rms > self.clip).any())
      u = u / np.maximum(1.0, rms / self.clip)
    return u


class RefAdam:
  """Plain Adam (Kingma & Ba) on one leaf, in float64."""

  def __init__(self, shape, b1=0.9, b2=0.999, eps=1e-8):
    self.b1, self.b2, self.eps = b1, b2, eps
    self.m, self.v, self.t = np.zeros(shape), np.zeros(shape), 0

  def update(self, g):
    g = np.asarray(g, np.float64)
    self.t += 1
    self.m = self.b1 * self.m + (1 - self.b1) * g
    self.v = self.b2 * self.v + (1 - self.b2) * g * g
    return (self.m / (1 - self.b1**self.t)) / (np.sqrt(self.v / (1 - self.b2**self.t))
                                               + self.eps)


def ref_train(params: dict, grads_fn, make_rule, steps: int, lr: float, wd: float = 0.0,
              decay: Optional[dict] = None) -> dict:
  """Runs `steps` of `p <- p - lr * (u + wd * p)` per leaf of a flat dict of arrays.

  Args:
    params: flat dict name -> float64 array.
    grads_fn: (step, params) -> flat dict of gradients.
    make_rule: (name, shape) -> object with `update(g)`.
    steps: number of steps.
    lr: learning rate.
    wd: decoupled weight decay rate.
    decay: name -> whether decay applies (default all).

  Returns:
    The final parameters.
  """
  params = {k: np.asarray(v, np.float64).copy() for k, v in params.items()}
  rules = {k: make_rule(k, v.shape) for k, v in params.items()}
  for step in range(steps):
    grads = grads_fn(step, params)
    for k in params:
      u = rules[k].update(grads[k])
      w = wd if (decay is None or decay.get(k, True)) else 0.0
      params[k] = params[k] - lr * (u + w * params[k])
  return params


def ref_newton_schulz(x: np.ndarray, coeffs=(3.4445, -4.7750, 2.0315), steps: int = 5,
                      eps: float = 1e-8) -> np.ndarray:
  """Muon's quintic Newton-Schulz iteration on one matrix, in float64.

  X = x / (||x||_F + eps); then `steps` times X <- a X + (b A + c A^2) X with A = X X^T,
  run on x^T (and transposed back) when x has more rows than columns.
  """
  a, b, c = coeffs
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (np.sqrt((x * x).sum()) + eps)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


class RefOrthogonalTier:
  """A tier with an orthogonalised update (docs/update-rules.md, "Orthogonal") on one leaf.

  Momentum (optionally optax's Nesterov form), then each matrix of the batch axes'
  slices (the last non-batch axis its columns, the other non-batch axes its rows)
  orthogonalised by `ref_newton_schulz` and scaled by `rms_scale * sqrt(max(R, C))`
  (or `sqrt(max(1, C / R))` when `rms_scale` is None). Leaves with fewer than two
  non-batch axes are not handled here (the library gives them a fallback).
  """

  def __init__(self, shape, *, momentum=True, nesterov=False, b1=0.9, rms_scale=0.2,
               batch_axes=None, ns_steps=5):
    self.shape = tuple(shape)
    nd = len(shape)
    self.batch = tuple(range(nd - 2)) if batch_axes is None else tuple(batch_axes)
    self.matrix = tuple(a for a in range(nd) if a not in self.batch)
    assert len(self.matrix) >= 2
    self.momentum, self.nesterov, self.b1 = momentum, nesterov, b1
    self.rms_scale, self.ns_steps = rms_scale, ns_steps
    self.m = np.zeros(shape)
    self.t = 0

  def update(self, g: np.ndarray) -> np.ndarray:
    g = np.asarray(g, np.float64)
    b1 = self.b1
    self.t += 1
    if self.momentum:
      self.m = b1 * self.m + (1 - b1) * g
      if self.nesterov:
        x = b1 * self.m / (1 - b1**(self.t + 1)) + (1 - b1) * g / (1 - b1**self.t)
      else:
        x = self.m / (1 - b1**self.t)
    else:
      x = g
    perm = self.batch + self.matrix
    xt = np.transpose(x, perm)
    bshape = xt.shape[:len(self.batch)]
    r = int(np.prod(xt.shape[len(self.batch):-1]))
    c = xt.shape[-1]
    mats = xt.reshape((-1, r, c))
    scale = (self.rms_scale * math.sqrt(max(r, c)) if self.rms_scale is not None
             else math.sqrt(max(1.0, c / r)))
    out = np.stack([scale * ref_newton_schulz(m, steps=self.ns_steps) for m in mats])
    out = out.reshape(bshape + xt.shape[len(self.batch):])
    return np.transpose(out, np.argsort(perm))
