"""Optimizer-state memory of every optimizer on four model shapes, from abstract shapes.

Nothing is allocated: parameters are `jax.ShapeDtypeStruct`s and the state comes from
`jax.eval_shape(tx.init, params)`. Bytes count floating-point state leaves only (step
counters and other integer leaves are excluded), split per tier by
`skewadam_jax.memory_report` (backbone / experts / router as labelled by
`moe_param_labels`).

Models (weights in bf16 except norms and routers, as published):

* `paper-6.78b`: the published SkewAdam MoE (examples/moe_lm, `abstract_params`).
* `mixtral-8x7b`: Mixtral-8x7B-shaped (32 layers, d 4096, 8 experts of 14336, top-2,
  GQA 32/8, RMSNorm, untied head, vocab 32000).
* `deepseek-moe-16b`: DeepSeek-MoE-16B-shaped (28 layers, d 2048, layer 0 dense with
  10944; 64 fine-grained routed experts of 1408 plus 2 shared experts (one 2816-wide
  MLP), vocab 102400, untied head). Shared experts see every token, so they are
  labelled backbone (`moe_param_labels` matches the segment `experts`, not
  `shared_experts`).
* `llama-1.3b`: the LLaMA-1.3B used for AdamPM (24 layers, d 2048, intermediate 5461
  (not divisible by 8), 32 heads, vocab 32000, untied head): dense, so SkewAdam puts
  everything in its backbone tier.

State dtypes. Mixed-precision training keeps optimizer state in float32 (the published
AdamW figure, 50.55 GiB = 6,784,327,680 params x 8 B, is float32 m and v), while
`optax.adamw` on bf16 parameters would store bf16 m and v. So every optax baseline
(AdamW, Adafactor, Lion, Muon) and AdamPM is initialised on a float32 copy of the
abstract parameters; SkewAdam keeps float32 state by construction (`Tier.mu_dtype`, and
float32 statistics) and is initialised on the bf16 parameters themselves. The column
"optax defaults on bf16" shows what the baselines store with their default dtypes.

  python benchmarks/memory.py            # writes benchmarks/results/memory.{json,md,png}
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any, Callable

import _common
from _common import GIB, RESULTS

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import muon

import skewadam_jax as sj
from examples import _cli
from examples.moe_lm import optimizers as opt_lib
from examples.moe_lm.model import abstract_params, get_config

LR = 1e-3
BF16, F32 = jnp.bfloat16, jnp.float32

# The published figures (SkewAdam paper, arXiv 2607.19058): bytes where it gives them exactly.
PUBLISHED = {
    ('paper-6.78b', 'skewadam'): ('1.29 GiB (1,380,800,000 B)', 1_380_800_000),
    ('paper-6.78b', 'adamw'): ('50.55 GiB (6,784,327,680 x 8 B)', 54_274_621_440),
    ('paper-6.78b', 'muon'): ('25.27 GiB', 25.27 * GIB),
    ('paper-6.78b', 'lion'): ('25.27 GiB', 25.27 * GIB),
    ('paper-6.78b', 'adafactor'): ('~0.01 GiB', 0.01 * GIB),
}


# ----------------------------------------------------------------------------- models


def _sds(shape: tuple[int, ...], dtype: Any = BF16) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _attention(d: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
  return {'q_proj': {'kernel': _sds((d, heads * head_dim))},
          'k_proj': {'kernel': _sds((d, kv_heads * head_dim))},
          'v_proj': {'kernel': _sds((d, kv_heads * head_dim))},
          'o_proj': {'kernel': _sds((heads * head_dim, d))}}


def _swiglu(d: int, ff: int) -> dict[str, Any]:
  return {'gate_proj': {'kernel': _sds((d, ff))}, 'up_proj': {'kernel': _sds((d, ff))},
          'down_proj': {'kernel': _sds((ff, d))}}


def _experts(e: int, d: int, ff: int) -> dict[str, Any]:
  """HF-style stacked experts: w1 (gate), w3 (up) `[E, d, ff]`, w2 (down) `[E, ff, d]`."""
  return {'w1': _sds((e, d, ff)), 'w3': _sds((e, d, ff)), 'w2': _sds((e, ff, d))}


def _decoder(vocab: int, d: int, layers: list[dict[str, Any]]) -> dict[str, Any]:
  return {'embed_tokens': {'embedding': _sds((vocab, d))},
          'layers': {str(i): layer for i, layer in enumerate(layers)},
          'norm': {'scale': _sds((d,), F32)},
          'lm_head': {'kernel': _sds((d, vocab))}}


def mixtral_8x7b() -> dict[str, Any]:
  d, e, ff = 4096, 8, 14336

  def layer():
    return {'input_layernorm': {'scale': _sds((d,), F32)},
            'self_attn': _attention(d, 32, 8, 128),
            'post_attention_layernorm': {'scale': _sds((d,), F32)},
            'block_sparse_moe': {'gate': {'kernel': _sds((d, e), F32)},
                                 'experts': _experts(e, d, ff)}}
  return _decoder(32000, d, [layer() for _ in range(32)])


def deepseek_moe_16b() -> dict[str, Any]:
  d, e, ff, shared = 2048, 64, 1408, 2

  def layer(i):
    out = {'input_layernorm': {'scale': _sds((d,), F32)},
           'self_attn': _attention(d, 16, 16, 128),
           'post_attention_layernorm': {'scale': _sds((d,), F32)}}
    if i == 0:
      out['mlp'] = _swiglu(d, 10944)
    else:
      out['mlp'] = {'gate': {'kernel': _sds((d, e), F32)},
                    'experts': _experts(e, d, ff),
                    'shared_experts': _swiglu(d, shared * ff)}
    return out
  return _decoder(102400, d, [layer(i) for i in range(28)])


def llama_1_3b() -> dict[str, Any]:
  d, ff = 2048, 5461

  def layer():
    return {'input_layernorm': {'scale': _sds((d,), F32)},
            'self_attn': _attention(d, 32, 32, 64),
            'post_attention_layernorm': {'scale': _sds((d,), F32)},
            'mlp': _swiglu(d, ff)}
  return _decoder(32000, d, [layer() for _ in range(24)])


def paper_6_78b() -> Any:
  return nnx.to_pure_dict(abstract_params(get_config('paper-6.78b')))


MODELS: dict[str, Callable[[], Any]] = {
    'paper-6.78b': paper_6_78b,
    'mixtral-8x7b': mixtral_8x7b,
    'deepseek-moe-16b': deepseek_moe_16b,
    'llama-1.3b': llama_1_3b,
}


# ----------------------------------------------------------------------------- optimizers


def _skewadam_variant(**expert_or_backbone: sj.Tier) -> optax.GradientTransformation:
  tiers = dict(sj.PUBLISHED_TIERS)
  tiers.update(expert_or_backbone)
  return sj.skewadam(LR, tiers=tiers)


def _example(variant: str) -> optax.GradientTransformation:
  """SkewAdam with the quality sweep's coded policy `skewadam-muon-coded-<variant>`
  (examples/moe_lm/optimizers.py), so that both count the same tiers."""
  return sj.skewadam(LR, tiers=opt_lib.skewadam_tiers(f'skewadam-muon-coded-{variant}'))


# The coded policies of the quality sweep (`skewadam-muon-coded-<variant>` in
# examples/moe_lm/optimizers.py) that the tables list: name -> (label, variant).
_EXAMPLE_CODED = {
    'muon-coded-all': ('MUON_CODED_TIERS with every leaf coded (the norms too)',
                       '6bit-8bit-backbone-nearest'),
    'muon-coded-8bit': ('first MUON_CODED_TIERS, 8-bit hidden and expert momentum '
                        '(blocks of 256)', '8bit'),
    'muon-coded-4bit-experts': ('first MUON_CODED_TIERS (fp32 backbone, 8-bit hidden, '
                                '4-bit experts)', '4bit-experts-stochastic'),
    'muon-coded-4bit': ('first MUON_CODED_TIERS, 4-bit hidden and expert momentum '
                        '(blocks of 64)', '4bit'),
    'muon-coded-4bit32-experts': ('first MUON_CODED_TIERS, experts 4-bit in blocks of 32',
                                  '4bit32-experts-stochastic'),
    'muon-coded-5bit-experts': ('first MUON_CODED_TIERS, experts 5-bit in blocks of 256',
                                '5bit-experts-stochastic'),
    'muon-coded-6bit-experts': ('first MUON_CODED_TIERS, experts 6-bit in blocks of 256',
                                '6bit-experts-stochastic'),
    'muon-coded-6bit-experts-5bit-rest': ('first MUON_CODED_TIERS, experts 6-bit, backbone '
                                          'and hidden 5-bit (blocks of 256)',
                                          '6bit-experts-5bit-rest'),
}


# name -> (label, factory, float32 state?). "float32 state" optimizers are initialised on
# a float32 copy of the parameters (see the module docstring).
OPTIMIZERS: dict[str, tuple[str, Callable[[], optax.GradientTransformation], bool]] = {
    'adamw': ('AdamW (fp32 m, v)', lambda: optax.adamw(LR), True),
    'adafactor': ('Adafactor (optax default: factored, no momentum)',
                  lambda: optax.adafactor(LR), True),
    'lion': ('Lion (fp32 momentum)', lambda: optax.lion(LR), True),
    'muon': ('Muon (optax.contrib.muon; fp32 momentum; Adam for 1-D)',
             lambda: muon(LR, muon_weight_dimension_numbers=_common.muon_dims), True),
    'adampm4': ('AdamPM s = 4', lambda: sj.adampm(LR, group_size=4), True),
    'adampm8': ('AdamPM s = 8', lambda: sj.adampm(LR, group_size=8), True),
    'adampm16': ('AdamPM s = 16', lambda: sj.adampm(LR, group_size=16), True),
    'skewadam': ('SkewAdam (published tiers)', lambda: sj.skewadam(LR), False),
    'skewadam-bf16-momentum': (
        'SkewAdam, bf16 backbone momentum',
        lambda: _skewadam_variant(backbone=sj.PUBLISHED_TIERS['backbone'].replace(
            mu_dtype=BF16)), False),
    'skewadam-grouped-experts': (
        'SkewAdam, experts grouped (s = 8) instead of factored',
        lambda: _skewadam_variant(experts=sj.PUBLISHED_TIERS['experts'].replace(
            second_moment='grouped', group_size=8)), False),
    'muon-tiers': ('SkewAdam MUON_TIERS (no expert momentum)',
                   lambda: sj.skewadam(LR, tiers=sj.MUON_TIERS), True),
    'muon-tiers-fp32-expert-momentum': (
        'MUON_CODED_TIERS with fp32 momentum (no codes)',
        lambda: sj.skewadam(LR, tiers=_common.uncoded(sj.MUON_CODED_TIERS)), True),
    'muon-coded': ('MUON_CODED_TIERS (6-bit experts and hidden, 8-bit backbone, '
                   'fp32 under 4096 elements)',
                   lambda: sj.skewadam(LR, tiers=sj.MUON_CODED_TIERS), True),
    **{name: (label, functools.partial(_example, variant), True)
       for name, (label, variant) in _EXAMPLE_CODED.items()},
}


def to_f32(params: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, F32), params)


def measure(params: Any, name: str) -> dict[str, Any]:
  label, make, f32_state = OPTIMIZERS[name]
  tx = make()
  # Grouped by the same labels for every optimizer, the hidden matrices on their own.
  report = sj.memory_report(tx, to_f32(params) if f32_state else params,
                            param_labels=sj.hidden_param_labels)
  default_bytes = sj.optimizer_state_bytes(tx, params)  # optax defaults on bf16 params
  n = report.total_params
  return {
      'label': label,
      'state_bytes': report.total_state_bytes,
      'state_gib': report.total_state_bytes / GIB,
      'bytes_per_param': report.total_state_bytes / n,
      'by_tier': {t.tier: t.state_bytes for t in report.tiers},
      'state_bytes_optax_defaults_on_bf16': default_bytes,
  }


def run(model_names: list[str]) -> dict[str, Any]:
  out = {}
  for m in model_names:
    params = MODELS[m]()
    rep = sj.memory_report(optax.identity(), params, param_labels=sj.hidden_param_labels)
    tiers = {t.tier: {'params': t.params, 'param_bytes': t.param_bytes} for t in rep.tiers}
    t0 = time.perf_counter()
    rows = {name: measure(params, name) for name in OPTIMIZERS}
    out[m] = {'params': rep.total_params, 'param_bytes': rep.total_param_bytes,
              'tiers': tiers, 'optimizers': rows, 'seconds': time.perf_counter() - t0}
  return out


# ----------------------------------------------------------------------------- report


def check_published(res: dict[str, Any]) -> list[str]:
  """The two figures the paper gives exactly (SkewAdam and AdamW, 6.78B), as pass/fail lines."""
  lines = []
  if 'paper-6.78b' in res:
    rows = res['paper-6.78b']['optimizers']
    for name, want in (('skewadam', 1_380_800_000), ('adamw', 54_274_621_440)):
      got = rows[name]['state_bytes']
      lines.append(f"{'PASS' if got == want else 'FAIL'}: 6.78B {name} state = {got:,} B "
                   f'(required {want:,} B)')
  return lines


def adampm_claim(res: dict[str, Any]) -> list[str]:
  """AdamPM's "-29% parameters + state" on LLaMA-1.3B (params, m, v all float32)."""
  if 'llama-1.3b' not in res:
    return []
  r = res['llama-1.3b']
  params_f32 = 4 * r['params']
  adam = params_f32 + r['optimizers']['adamw']['state_bytes']
  lines = []
  for s in (4, 8, 16):
    pm = params_f32 + r['optimizers'][f'adampm{s}']['state_bytes']
    lines.append(f'AdamPM s = {s} on llama-1.3b: params + state {pm / GIB:.3f} GiB vs AdamW '
                 f'{adam / GIB:.3f} GiB: {100 * (pm / adam - 1):+.2f}% '
                 f'(ideal (1 - 1/s) / 3 = {-100 * (1 - 1 / s) / 3:+.2f}%)')
  return lines


def markdown(res: dict[str, Any]) -> str:
  parts = []
  for m, r in res.items():
    tiers = ', '.join(f"{k} {v['params']:,}" for k, v in r['tiers'].items())
    parts += [f"### {m}: {r['params']:,} parameters ({r['param_bytes'] / GIB:.2f} GiB of "
              f'weights)', '', f'Parameters per tier: {tiers}.', '']
    header = ['optimizer', 'state bytes', 'GiB', 'B/param', 'of AdamW', 'backbone', 'hidden',
              'experts', 'router',
              'optax defaults on bf16 (GiB)', 'published']
    rows = []
    for name, o in r['optimizers'].items():
      pub = PUBLISHED.get((m, name), ('', None))[0]
      t = o['by_tier']
      rows.append([o['label'], f"{o['state_bytes']:,}", f"{o['state_gib']:.3f}",
                   f"{o['bytes_per_param']:.3f}",
                   f"{o['state_bytes'] / r['optimizers']['adamw']['state_bytes']:.1%}",
                   *(f"{t[k] / GIB:.3f}" if k in t else '-'
                     for k in ('backbone', 'hidden', 'experts', 'router')),
                   f"{o['state_bytes_optax_defaults_on_bf16'] / GIB:.3f}", pub])
    parts += [_common.markdown_table(header, rows), '']
  return '\n'.join(parts)


def plot(res: dict[str, Any], path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  models = list(res)
  names = list(OPTIMIZERS)
  fig, ax = plt.subplots(figsize=(15, 5))
  width = 0.8 / len(names)
  cmap = plt.get_cmap('tab20')
  for j, name in enumerate(names):
    vals = [res[m]['optimizers'][name]['state_gib'] for m in models]
    ax.bar(np.arange(len(models)) + (j - len(names) / 2 + 0.5) * width, vals, width,
           label=OPTIMIZERS[name][0], color=cmap(j))
  ax.set_xticks(range(len(models)),
                [f"{m}\n({res[m]['params'] / 1e9:.2f}B params)" for m in models])
  ax.set_yscale('log')
  ax.set_ylabel('optimizer state (GiB, log scale)')
  ax.set_title('Optimizer state from jax.eval_shape (floating-point leaves only)')
  ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  """The command line."""
  ap = _cli.parser(__doc__.split('\n\n')[0])
  _cli.option(ap, '--models', nargs='*', default=list(MODELS), choices=list(MODELS),
              help='model configurations to account')
  _cli.option(ap, '--out', default=str(RESULTS), help='directory for the JSON, markdown, PNG')
  return ap


def main() -> None:
  args = build_parser().parse_args()
  res = run(args.models)
  checks = check_published(res) + adampm_claim(res)
  payload = {'command': _common.command(), 'machine': _common.machine(),
             'checks': checks, 'models': res}
  out = _common.Path(args.out)
  _common.write_json(out / 'memory.json', payload)
  md = '\n'.join(['## Optimizer state memory (jax.eval_shape, nothing allocated)', '',
                  f"`{payload['command']}`", '', *[f'* {c}' for c in checks], '',
                  markdown(res)])
  (out / 'memory.md').write_text(md)
  plot(res, out / 'memory.png')
  print(md)
  if any(c.startswith('FAIL') for c in checks):
    raise SystemExit(1)


if __name__ == '__main__':
  main()
