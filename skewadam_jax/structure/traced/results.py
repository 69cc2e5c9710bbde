"""What `trace_structure` returns: a tier and batch axes per leaf, with the evidence."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from skewadam_jax.estimators import orthogonal as _orthogonal
from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure.vocabulary import BACKBONE
from skewadam_jax.structure.vocabulary import HIDDEN
from skewadam_jax.structure.vocabulary import HIDDEN_MATRIX
from skewadam_jax.structure.vocabulary import OTHER
from skewadam_jax.structure.vocabulary import UNDECIDED


@dataclasses.dataclass(frozen=True)
class LeafStructure:
  """What the computation says about one parameter leaf."""
  path: str
  shape: tuple[int, ...]
  tier: str  # 'backbone' | 'experts' | 'router'
  batch_axes: tuple[int, ...]  # expert axis and scanned-layer axes, sorted
  evidence: str  # why, in words
  expert_axis: Optional[int] = None
  layer_axes: tuple[int, ...] = ()
  role: str = OTHER  # what it does: a role of `vocabulary` (HIDDEN_MATRIX, EMBEDDING, ...)
  role_evidence: str = ''  # the equation (the user's line) that decided it ('': the tier's)


@dataclasses.dataclass(frozen=True)
class RoutingDecision:
  """One routing decision found in the program."""
  primitive: str  # 'top_k', 'argmax', 'sort', ...
  num_experts: int  # E, the length of the axis selected over
  routers: tuple[str, ...]  # paths of the router parameters
  experts: tuple[str, ...]  # paths of the expert banks dispatched by it


@dataclasses.dataclass(frozen=True)
class Structure:
  """Tiers and batch axes of every parameter leaf, read from the traced computation.

  Attributes:
    labels: a pytree like the params of tier names (`'backbone'`, `'experts'`,
      `'router'`; None at leaves that are not arrays), for `sj.skewadam(...,
      param_labels=...)` and `sj.memory_report(..., param_labels=...)`;
      `sj.label_table(tx, params)` shows what the skewadam built from them gives.
    batch_axes: a pytree like the params of sorted int tuples, for `sj.skewadam(...,
      batch_axes=...)` (a `Structure` passed as `param_labels` brings them itself).
    leaves: one `LeafStructure` per array leaf, in flattening order.
    decisions: the routing decisions that dispatch tokens to an expert bank.
    undecided: path -> reason, for leaves the analysis could not decide. `labels`
      has them `backbone` (with no batch axes beyond scanned layers); passed as
      `sj.skewadam(..., param_labels=structure)`, under every policy they get the tier
      `'undecided'` with the safe rule (`labels_for`): no orthogonalisation, nothing
      shared across any of their axes (an exact second moment, an uncoded momentum, no
      update clip).
  """
  labels: Any
  batch_axes: Any
  leaves: tuple[LeafStructure, ...]
  decisions: tuple[RoutingDecision, ...]
  undecided: dict[str, str]

  def labels_for(self, tiers: Any) -> Any:
    """`labels` for a tier policy: with an `'undecided'` tier (which `sj.skewadam` adds
    to every policy, with the safe rule `transforms.tier.undecided_tier`), the undecided
    leaves get it, whatever their tier; with a `'hidden'` tier (`sj.MUON_TIERS`), the
    other backbone leaves whose role is a hidden matrix get it (not embeddings, output
    layers, biases or gains, whatever their names and shapes), unless a side of their
    matrix is 1 (a gate `[d, 1]`: a vector, `orthogonal.has_matrix`)."""
    undecided = set(self.undecided) if UNDECIDED in tiers else set()
    hidden = set()
    if HIDDEN in tiers:
      hidden = {leaf.path for leaf in self.leaves
                if leaf.tier == BACKBONE and leaf.role == HIDDEN_MATRIX
                and _orthogonal.has_matrix(leaf.shape, leaf.batch_axes)}
    if not undecided and not hidden:
      return self.labels
    flat, treedef = jax.tree_util.tree_flatten(self.labels, is_leaf=lambda x: x is None)
    order = iter(leaf.path for leaf in self.leaves)

    def label(x: Any) -> Any:
      if x is None:
        return x
      path = next(order)
      return UNDECIDED if path in undecided else HIDDEN if path in hidden else x

    return jax.tree_util.tree_unflatten(treedef, [label(x) for x in flat])

  @property
  def roles(self) -> dict[str, str]:
    """Path -> role, for every array leaf."""
    return {leaf.path: leaf.role for leaf in self.leaves}

  @property
  def by_path(self) -> dict[str, LeafStructure]:
    """The leaves keyed by their normalised path."""
    return {leaf.path: leaf for leaf in self.leaves}

  def format(self) -> str:
    """An aligned text table: path, shape, tier, batch axes, role and evidence per leaf."""
    header = ('path', 'shape', 'tier', 'batch axes', 'role', 'evidence')
    body = [(x.path, 'x'.join(map(str, x.shape)) or '()', x.tier,
             ','.join(map(str, x.batch_axes)) or '-', x.role,
             x.evidence + (f' (role: {x.role_evidence})' if x.role_evidence else ''))
            for x in self.leaves]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(5)]
    fmt = '  '.join(f'{{:<{w}}}' for w in widths) + '  {}'
    lines = [fmt.format(*header), fmt.format(*('-' * w for w in widths), '-' * 8)]
    lines += [fmt.format(*row).rstrip() for row in body]
    counts = {t: sum(x.tier == t for x in self.leaves) for t in _vocabulary.MOE_TIERS}
    lines.append(f'{len(self.leaves)} leaves: ' + ', '.join(f'{n} {t}' for t, n in
                                                            counts.items()))
    for d in self.decisions:
      lines.append(f'routing: {d.primitive} over E={d.num_experts} experts; router '
                   f'{", ".join(d.routers)}; experts {", ".join(d.experts)}')
    for path, why in self.undecided.items():
      lines.append(f'UNDECIDED {path}: {why}')
    return '\n'.join(lines)
