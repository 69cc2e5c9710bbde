"""Hidden matrices: the backbone leaves an orthogonalised (Muon) tier is meant for.

Muon orthogonalises the hidden layers' weight matrices only; embeddings, output heads,
norms and biases keep an Adam-like rule (Jordan et al. 2024). `hidden_param_labels`
splits the `backbone` tier of `moe_param_labels` accordingly, from paths and shapes
(`sj.trace_structure` reads the same from what the model computes). A backbone leaf is

1. **not hidden** when it holds no matrix worth orthogonalising: fewer than two axes
   beside the batch axes of `moe_batch_axes`, or a side of 1 (a gate `[d, 1]`:
   `orthogonal.has_matrix`); when it is named a bias or a scale (`bias [heads,
   head_dim]`); when it is a per-channel convolution filter (under a `*conv*` module,
   with no input-channel axis, or one of length 1: a depthwise `[k, 1, C]` or `[C, k]`,
   whose taps are no feature space); when a path segment names an embedding
   (`EMBEDDING_PATTERNS`: `*embed*`, `wte`, `wpe`, `lm_head`, `*vocab*`, `*logits*`;
   `pre_logits` is a block, below);
2. **hidden** when a module of its path names a part of a block (`BLOCK_PATTERNS`:
   attention, MLP, a shared expert, a `*_proj`ection, `pre_logits`) or its own name an
   attention projection (`PROJECTION_NAMES`: `wq`, `query`, ...), or when it is repeated across
   layers (scanned axes, or the same shape at the same path in numbered siblings,
   `layers/0` and `layers/1`, `block_0` and `block_1`): an embedding or an output head
   is used once per model; or when it has three matrix axes or more (an attention
   kernel `[d, heads, head_dim]`, a convolution): embeddings and heads are 2-D;
3. **not hidden** when its own module names an output head (`HEAD_PATTERNS`: `head`,
   `*_head`, `output`, `classifier`);
4. otherwise **unsure**: a 2-D matrix used once that no name tells from an embedding or
   an output layer (`{'a': [V, d], 'z': [d, V]}`, a bare `w`, `proj` or `table`); a
   side as long as the vocabulary never decides alone (a hidden `[d, f]` may have
   `f == V`). It
   stays `backbone`, the Adam-like rule that suits either, and is reported in the
   call's one `UnsureLabelWarning`, whose fix is the roles of `sj.trace_structure`.

Only paths and shapes are used, so `init` and `update` see the same labels.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from skewadam_jax.estimators import orthogonal as _orthogonal
from skewadam_jax.structure import axes as _axes
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure import warning as _warning
from skewadam_jax.structure.vocabulary import DEFAULT_TIER
from skewadam_jax.structure.vocabulary import HIDDEN

# Path segments (case-insensitive globs) that name an embedding or an output head.
EMBEDDING_PATTERNS = ('*embed*', 'wte', 'wpe', 'lm_head', '*vocab*', '*logits*')
# A leaf's own module (case-insensitive globs) that names an output head. Only its own:
# `output` is also a module of BERT's attention and MLP blocks (`output/dense`).
HEAD_PATTERNS = ('head', '*_head', 'output', 'classifier')
# Path segments of the blocks whose matrices are hidden: attention and MLP blocks (the
# dense modules of the name rules), shared experts and the projections in them
# (`q_proj`, `down_proj`, `out_proj`, GPT-2's `c_proj`).
BLOCK_PATTERNS = (*_vocabulary.ATTENTION_MODULES, *_vocabulary.MLP_MODULES,
                  '*shared_expert*', '*_proj', 'pre_logits', 'prelogits')
# A leaf's own name that names an attention projection (`wq` of Mixtral and T5 layers,
# DenseGeneral's `query`): hidden wherever it is stored (a flat layer dict too).
PROJECTION_NAMES = ('wq', 'wk', 'wv', 'wo', 'wqkv', 'query', 'key', 'value')
# The names a module gives its own matrix: the module is the segment before them.
_PARAM_NAMES = ('kernel', 'weight', 'w', 'embedding')
# Unsure leaves named in the warning line; the others are counted (a leaf the warning
# does not name is not reported: a generated ViT with random names has ~20).
_SHOWN = 64


def _matches(segment: str, patterns: Sequence[str]) -> bool:
  return any(_paths.match_path(p, (segment,)) for p in patterns)


def _named_embedding(segs: tuple[str, ...]) -> bool:
  # (`pre_logits` is the hidden dense before the logits, not the logits' layer)
  return any(_matches(s.lower(), EMBEDDING_PATTERNS) and not _matches(
      s.lower(), BLOCK_PATTERNS) for s in segs)


def _module(segs: tuple[str, ...]) -> str:
  """The leaf's own module: `lm_head` of `lm_head/kernel`, `output` of a bare `output`."""
  return segs[-2] if len(segs) > 1 and segs[-1] in _PARAM_NAMES else (segs or ('',))[-1]


def _per_channel_filter(leaf: _paths.Leaf, core: tuple[int, ...]) -> bool:
  """A convolution kernel (axes `core` besides the scanned ones) with no input-channel
  axis, or one of length 1 (depthwise): `[*taps, in, out]`, `[out, in, *taps]` as a
  PyTorch `weight`."""
  if not any('conv' in s for s in leaf.segs[:-1] + (_module(leaf.segs),)):
    return False
  if len(core) < 3:
    return True  # [C, k] or [k, C]: one tap axis, one channel axis
  return leaf.shape[core[1] if _vocabulary.is_torch_layout(leaf.segs) else core[-2]] == 1


def _unnumbered(segment: str) -> str:
  """`#` for a list index, `block_#` for `block_3`: what numbered siblings share."""
  found = _vocabulary.NUMBERED_SIBLING.match(segment)
  if found is None:
    return segment
  return '#' if found.group(1) is None else f'{found.group(1)}_#'


def _repeated(leaves: list[_paths.Leaf]) -> list[bool]:
  """Whether each leaf is one of a stack of layers: scanned axes, or the same shape at
  the same path in another numbered sibling (paths are unique, so a leaf shares its key
  only through a numbered segment)."""
  keys = [(tuple(_unnumbered(s) for s in leaf.segs), leaf.shape) for leaf in leaves]
  counts: dict[Any, int] = {}
  for key in keys:
    counts[key] = counts.get(key, 0) + 1
  return [bool(leaf.scan) or counts[key] > 1 for leaf, key in zip(leaves, keys)]


def _reading(leaf: _paths.Leaf, repeated: bool) -> Optional[bool]:
  """True: a hidden matrix; False: not one; None: names and shapes cannot tell."""
  batch = tuple(sorted(leaf.axes or ()))
  if not _orthogonal.has_matrix(leaf.shape, batch) or _vocabulary.is_vector(leaf.segs):
    return False
  core = tuple(a for a in range(len(leaf.shape)) if a not in leaf.scan)
  if _per_channel_filter(leaf, core) or _named_embedding(leaf.segs):
    return False
  named = any(_matches(s, BLOCK_PATTERNS) for s in leaf.segs) or _matches(
      _module(leaf.segs).lower(), PROJECTION_NAMES)
  wide = [a for a in core if leaf.shape[a] > 1]  # a table [1, T, d] is 2-D
  if repeated or len(wide) >= 3 or named:
    return True
  # A side as long as the vocabulary's (`V`) never decides alone: a hidden matrix may
  # have it (`f == V`), so an unnamed `[d, V]` used once stays unsure.
  return False if _matches(_module(leaf.segs), HEAD_PATTERNS) else None


@_warning.reported_once
def hidden_param_labels(params: Any, param_labels: Any = None) -> Any:
  """`moe_param_labels` (or `param_labels`) with the backbone's hidden matrices `hidden`.

  The tier name a Muon-style policy (`sj.MUON_TIERS`) gives its orthogonalised tier;
  `sj.skewadam` and `sj.label_table` use these labels by default when `tiers` has a
  `'hidden'` tier. Pass it as `param_labels` to `sj.memory_report` for a per-tier
  breakdown with the hidden tier apart. A 2-D matrix used once whose names say neither
  (an embedding or output layer, or a hidden matrix) stays `backbone` and is reported
  in one `sj.UnsureLabelWarning`; `sj.trace_structure` reads it from the computation.

  Args:
    params: a pytree of arrays, `jax.ShapeDtypeStruct`s or Flax variables.
    param_labels: the labels to split (a label tree or labeler function); default
      `moe_param_labels`.

  Returns:
    A pytree like `params` of tier names: `backbone` leaves that are hidden matrices
    (see the module docstring for the rule) become `hidden`, the others are unchanged.

  Example:
    >>> import jax.numpy as jnp, skewadam_jax as sj
    >>> sj.hidden_param_labels({'embed': jnp.zeros((64, 8)), 'mlp': jnp.zeros((8, 32)),
    ...                         'norm': jnp.zeros((8,)), 'head': jnp.zeros((8, 64))})
    {'embed': 'backbone', 'head': 'backbone', 'mlp': 'hidden', 'norm': 'backbone'}
  """
  labels = _labels.resolve_labels(params, param_labels)
  leaves, treedef = _axes.decide(params, labels)  # batch axes, scanned axes
  out, unsure = [], []
  flat = treedef.flatten_up_to(labels)
  biases = _general_biases([x for x, label in zip(leaves, flat)
                            if label == DEFAULT_TIER], leaves)
  for i, (leaf, label, again) in enumerate(zip(leaves, flat, _repeated(leaves))):
    hidden = None
    if label == DEFAULT_TIER:
      hidden = False if i in biases else _reading(leaf, again)
      if hidden is None:
        unsure.append(leaf)
    out.append(HIDDEN if hidden else label)
  if unsure:
    _warning.report([_unsure_line(unsure)], strict=False)
  return treedef.unflatten(out)


def _general_biases(backbone: list[_paths.Leaf], leaves: list[_paths.Leaf]) -> set[int]:
  """The leaves shaped like the trailing axes of a backbone kernel with more axes in their
  module (DenseGeneral's bias `[heads, head_dim]` beside its kernel `[d, heads,
  head_dim]`): biases, whatever they are called."""
  kernels: dict[tuple[str, ...], set[tuple[int, ...]]] = {}
  for leaf in backbone:
    if len(leaf.core) >= 3:
      kernels.setdefault(leaf.segs[:-1], set()).add(leaf.core[-2:])
  return {i for i, leaf in enumerate(leaves)
          if len(leaf.core) == 2 and leaf.core in kernels.get(leaf.segs[:-1], ())}


def _unsure_line(leaves: list[_paths.Leaf]) -> str:
  """One line for every unsure matrix (one per leaf would push others out)."""
  shown = ', '.join(f'{x.path} {list(x.shape)}' for x in leaves[:_SHOWN])
  if len(leaves) > _SHOWN:
    shown += f' and {len(leaves) - _SHOWN} more'
  return (f"{shown}: 2-D matrices used once (not repeated across layers) that no name "
          'marks as an embedding, an output head or a part of an attention or MLP '
          'block: a hidden matrix, or an embedding or output layer that Muon must not '
          "orthogonalise, which names and shapes cannot tell apart; labelled 'backbone' "
          "(the Adam-like rule, safe for either), not hidden; if one is a hidden matrix, "
          f"label it: sj.make_labeler([({leaves[0].path!r}, {HIDDEN!r})]) (in "
          'sj.hidden_param_labels, as below), or give the trace below with your policy, '
          'which reads every one from the computation')
