"""Hidden matrices: the backbone leaves an orthogonalised (Muon) tier is meant for.

Muon orthogonalises the hidden layers' weight matrices only; embeddings, output heads,
norms and biases keep an Adam-like rule (Jordan et al. 2024). `hidden_param_labels`
splits the `backbone` tier of `moe_param_labels` accordingly: a backbone leaf becomes
`hidden` when

1. its non-batch part is a matrix (two or more axes once the batch axes of
   `moe_batch_axes` are set aside: `[in, out]`, a scanned `[L, in, out]`, an attention
   kernel `[d, heads, head_dim]`), and
2. it is not embedding-like: no path segment names an embedding (`EMBEDDING_PATTERNS`:
   `*embed*`, `wte`, `wpe`, `lm_head`, `*vocab*`, `*logits*`), and none of its matrix
   axes has the vocabulary's size `V`: the first axis of a table `[V, d]` so named,
   where `V > d` (the largest such, if several). So an untied output head `[d, V]` is
   found by its shape whatever it is called.

A positional table `[max_len, d]` is found by its name only (its shape is a hidden
one's), as is an embedding whose vocabulary is no larger than the width. Only paths and
shapes are used, so `init` and `update` see the same labels.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

from skewadam_jax.structure import axes as _axes
from skewadam_jax.structure import labels as _labels
from skewadam_jax.structure import paths as _paths
from skewadam_jax.structure import rules as _rules
from skewadam_jax.estimators import base as _second_moment

HIDDEN_TIER = 'hidden'
# Path segments (case-insensitive globs) that name an embedding or an output head.
EMBEDDING_PATTERNS = ('*embed*', 'wte', 'wpe', 'lm_head', '*vocab*', '*logits*')


def _named_embedding(segs: tuple[str, ...]) -> bool:
  return any(fnmatch.fnmatchcase(s.lower(), p) for s in segs for p in EMBEDDING_PATTERNS)


def hidden_param_labels(params: Any, param_labels: Any = None) -> Any:
  """`moe_param_labels` (or `param_labels`) with the backbone's hidden matrices `hidden`.

  The tier name a Muon-style policy (`sj.MUON_TIERS`) gives its orthogonalised tier;
  `sj.skewadam` and `sj.label_table` use these labels by default when `tiers` has a
  `'hidden'` tier. Pass it as `param_labels` to `sj.memory_report` for a per-tier
  breakdown with the hidden tier apart.

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
    ...                         'norm': jnp.zeros((8,)), 'out': jnp.zeros((8, 64))})
    {'embed': 'backbone', 'mlp': 'hidden', 'norm': 'backbone', 'out': 'backbone'}
  """
  labels = _labels.resolve_labels(params, param_labels)
  leaves, treedef = _paths.leaves_of(params)
  flat_labels = treedef.flatten_up_to(labels)
  axes = treedef.flatten_up_to(_axes.moe_batch_axes(params, labels))
  vocab = _vocab_size([x.shape for x in leaves if _named_embedding(x.segs)])
  out = []
  for leaf, label, ax in zip(leaves, flat_labels, axes):
    matrix = _second_moment.Layout.of(len(leaf.shape), tuple(ax)).matrix
    hidden = (label == _rules.DEFAULT_TIER and len(matrix) >= 2
              and not _named_embedding(leaf.segs)
              and (vocab is None or vocab not in [leaf.shape[a] for a in matrix]))
    out.append(HIDDEN_TIER if hidden else label)
  return treedef.unflatten(out)


def _vocab_size(shapes: list[tuple[int, ...]]) -> Optional[int]:
  """The largest `V` of the named tables `[V, d]` with `V > d` (token tables), or None."""
  sizes = [s[0] for s in shapes if len(s) == 2 and s[0] > s[1]]
  return max(sizes) if sizes else None
