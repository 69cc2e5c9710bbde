"""How far the bfloat16 Newton-Schulz iteration is from the float32 one, over random matrices.

Each draw is a bank of 1 to 4 matrices of 2 to 129 rows and columns (12 shapes, so the
draws share their compiles) with a Gaussian spectrum, one decaying over three decades
along the rows or the columns, or a scale from 1e-6 to 1e6, in turn. Per matrix: the
relative Frobenius distance of its factor from the float32 iteration's
(`newton_schulz(x, ns_dtype='float32')`) and the largest distance between their sorted
singular values. Three bfloat16 iterations:

* `library`: `newton_schulz(x, ns_dtype='bfloat16')`, each step `(a I + A (b I + c A)) X`
  as three products that accumulate in float32 and write bfloat16;
* `written out`: the quintic as written, `a X + (b A + c A A) X`, every product
  accumulated and written in float32, the sums in float32, `X` rounded once per step
  (the library's iteration before the products took the linear terms; its GPU
  program moves twice the bytes);
* `Muon reference`: every product and sum in bfloat16, as Muon's reference code.

  python benchmarks/ns_bfloat16.py               # 360 draws
  python benchmarks/ns_bfloat16.py --draws 40

Writes results/ns_bfloat16.{json,md,png} under benchmarks/ (`--out` to change).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import _common  # also puts the repo root on sys.path
from _common import RESULTS
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from skewadam_jax.estimators import newton_schulz as ns

SPECTRA = ('gaussian', 'decaying rows', 'decaying columns', 'scaled')


def _wide(f: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
  """`f` of bfloat16 wide matrices applied to `x` of any orientation, normalised first."""
  def g(x: jax.Array) -> jax.Array:
    tall = x.shape[-2] > x.shape[-1]
    y = jnp.swapaxes(x, -1, -2) if tall else x
    norm = jnp.sqrt(jnp.sum(y * y, axis=(-2, -1), keepdims=True))
    y = f((y / (norm + 1e-8)).astype(jnp.bfloat16))
    return jnp.swapaxes(y, -1, -2) if tall else y
  return g


@_wide
def written_out(x: jax.Array) -> jax.Array:
  a, b, c = ns.NS_COEFFS
  dot32 = lambda p, q: jnp.matmul(p, q, preferred_element_type=jnp.float32)  # noqa: E731
  for _ in range(5):
    gram = dot32(x, jnp.swapaxes(x, -1, -2))
    g16 = gram.astype(jnp.bfloat16)
    poly = b * gram + c * dot32(g16, g16)
    x = (a * x.astype(jnp.float32) + dot32(poly.astype(jnp.bfloat16), x)).astype(jnp.bfloat16)
  return x


@_wide
def muon_reference(x: jax.Array) -> jax.Array:
  a, b, c = ns.NS_COEFFS
  for _ in range(5):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x


ITERATIONS = {'library': lambda x: ns.newton_schulz(x, ns_dtype='bfloat16'),
              'written out': written_out, 'Muon reference': muon_reference}


def draw(rng: np.random.Generator, shape: tuple[int, ...], spectrum: str) -> np.ndarray:
  x = rng.standard_normal(shape)
  if spectrum == 'decaying rows':
    x = x * np.geomspace(1, 1e-3, shape[-2])[:, None]
  elif spectrum == 'decaying columns':
    x = x * np.geomspace(1, 1e-3, shape[-1])
  elif spectrum == 'scaled':
    x = x * 10.0 ** rng.uniform(-6, 6)
  return x


def distances(draws: int, seed: int) -> dict[str, dict[str, list[float]]]:
  rng = np.random.default_rng(seed)
  shapes = [(int(rng.integers(1, 5)), int(rng.integers(2, 130)), int(rng.integers(2, 130)))
            for _ in range(12)]
  reference = jax.jit(lambda x: ns.newton_schulz(x, ns_dtype='float32'))
  fns = {k: jax.jit(f) for k, f in ITERATIONS.items()}
  out: dict[str, dict[str, list[float]]] = {k: {'rel': [], 'sv': []} for k in fns}
  for i in tqdm(range(draws), desc='draws'):
    x = jnp.asarray(draw(rng, shapes[i % len(shapes)], SPECTRA[i % len(SPECTRA)]),
                    jnp.float32)
    want = np.asarray(reference(x), np.float64)
    sv_want = np.linalg.svd(want, compute_uv=False)
    for k, fn in fns.items():
      got = np.asarray(fn(x).astype(jnp.float32), np.float64)
      rel = np.linalg.norm(got - want, axis=(-2, -1)) / np.linalg.norm(want, axis=(-2, -1))
      sv = np.abs(np.linalg.svd(got, compute_uv=False) - sv_want).max(axis=-1)
      out[k]['rel'] += rel.tolist()
      out[k]['sv'] += sv.tolist()
  return out


def summary(d: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
  base = np.median(d['library']['rel'])
  return [{'iteration': k, 'matrices': len(v['rel']),
           'rel_max': max(v['rel']), 'rel_median': float(np.median(v['rel'])),
           'sv_max': max(v['sv']), 'sv_median': float(np.median(v['sv'])),
           'rel_median_vs_library': float(np.median(v['rel']) / base)}
          for k, v in d.items()]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument('--draws', type=int, default=360, help='random banks of matrices')
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--out', default=str(RESULTS), help='directory for the JSON, markdown, PNG')
  args = ap.parse_args()
  d = distances(args.draws, args.seed)
  rows = summary(d)
  table = _common.markdown_table(
      ['bfloat16 iteration', 'matrices', 'rel. Frobenius max', 'median', 'x library',
       'singular values max', 'median'],
      [[r['iteration'], r['matrices'], f"{r['rel_max']:.4f}", f"{r['rel_median']:.4f}",
        f"{r['rel_median_vs_library']:.2f}", f"{r['sv_max']:.4f}", f"{r['sv_median']:.4f}"]
       for r in rows], align='lrrrrrr')
  m = _common.machine()
  md = '\n'.join([
      '## Newton-Schulz in bfloat16 against float32', '', f'`{_common.command()}`', '',
      _common.machine_line(m), '',
      f'{args.draws} random banks (seed {args.seed}); per matrix, the distance of each '
      'bfloat16 factor from the float32 one: relative Frobenius norm, and the largest '
      'distance between sorted singular values. The test bounds '
      '(tests/estimators/test_orthogonal.py) are 0.1 and 0.15.', '', table, ''])
  out = Path(args.out)
  _common.write_json(out / 'ns_bfloat16.json',
                     {'command': _common.command(), 'machine': m, 'draws': args.draws,
                      'seed': args.seed, 'rows': rows, 'distances': d})
  (out / 'ns_bfloat16.md').write_text(md)
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  for ax, key, bound, label in ((axes[0], 'rel', 0.1, 'relative Frobenius distance'),
                                (axes[1], 'sv', 0.15, 'largest singular-value distance')):
    bins = np.geomspace(1e-4, 0.3, 40)
    for k, v in d.items():
      ax.hist(np.clip(v[key], 1e-4, None), bins=bins, histtype='step', lw=1.4, label=k)
    ax.axvline(bound, color='red', ls='--', lw=0.8, label=f'test bound {bound}')
    ax.set_xscale('log')
    ax.set_xlabel(f'{label} from the float32 factor')
    ax.set_ylabel('matrices')
  axes[0].legend(fontsize=8)
  fig.suptitle(f'bfloat16 Newton-Schulz against float32, {args.draws} random banks')
  fig.tight_layout()
  fig.savefig(out / 'ns_bfloat16.png', dpi=120)
  print(md)


if __name__ == '__main__':
  main()
