"""From the analysis' findings to a tier and batch axes per leaf, with the evidence.

* a **router** produces the logits of a decision that dispatches tokens (its axes reach
  the expert axis), or reaches the outputs only through those logits (a scale of the
  router's input);
* an **expert bank** has an axis of length E that meets an expert-indexed axis (see the
  rules); that axis is a batch axis;
* a **unit stored apart** reaches the outputs only through masks of one expert id:
  experts, one matrix; a stacked parameter applied unit by unit under such masks is a
  bank along the axis taken apart;
* **scanned layers** and **stacked matrices** (every piece of an axis taken apart) give
  batch axes whatever the tier;
* everything else is backbone, and undecided (with the reason) where the analysis could
  not see: a leaf never read, one reaching a primitive with no rule or a call it cannot
  enter, one feeding a selection that decides nothing, one meeting the tokens of a
  decision whose expert axis cannot be told.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from skewadam_jax.structure import vocabulary as _vocabulary
from skewadam_jax.structure.traced import analysis as _analysis
from skewadam_jax.structure.traced import info as _info
from skewadam_jax.structure.traced import results as _results


def decide(analysis: _analysis.Analysis, paths: list[str], shapes: list[tuple[int, ...]],
            used: list[bool], treedef: Any, pidx: list[int], n_leaves: int) -> _results.Structure:
  """Turns the analysis' findings into a tier and batch axes per leaf."""
  confirmed = sorted(analysis.confirmed())
  gated = {leaf: {dec: set(ids) for dec, ids in decs.items()}
           for leaf, decs in analysis.gated().items()}
  for leaf, decs in analysis.joined.items():  # units joined against an expert axis
    for dec, ids in decs.items():
      gated.setdefault(leaf, {}).setdefault(dec, set()).update(ids)
  routers: dict[int, set[int]] = {}  # leaf -> confirmed decisions it routes
  candidates: dict[int, set[int]] = {}
  for dec, key in enumerate(analysis.order):
    for leaf, _ in analysis.decisions[key].routers:
      (routers if dec in confirmed else candidates).setdefault(leaf, set()).add(dec)
  # A leaf feeding the logits whose every way to the outputs goes through them (a scale
  # of the router's input) acts on the routing only: router, whatever its axes.
  banked = {leaf for leaf, _ in analysis.banks}
  inputs: dict[int, set[int]] = {}  # leaf -> confirmed decisions it only routes
  for dec in confirmed:
    for leaf in analysis.decision(dec).deps:
      if (leaf in analysis.out_deps and leaf not in analysis.out_free
          and leaf not in routers and leaf not in banked):
        inputs.setdefault(leaf, set()).add(dec)
  rows, undecided = [], {}
  blind = {leaf: f'{prim} (at {line})' for (prim, line), leaves in analysis.blind.items()
           for leaf in leaves}
  # A leaf axis meeting values routed by a decision that dispatches nothing visible.
  lost = {leaf: (axis, analysis.decision(min(decs - set(confirmed))))
          for (leaf, axis), decs in sorted(analysis.near.items()) if decs - set(confirmed)}
  for k, (path, shape) in enumerate(zip(paths, shapes)):
    scanned = sorted(a for (leaf, a) in analysis.scans if leaf == k)
    mapped = sorted(a for (leaf, a) in analysis.mapped if leaf == k and a not in scanned)
    layers = tuple(sorted(scanned + mapped))
    found = {a: why for (leaf, a), why in analysis.banks.items()
             if leaf == k and a not in layers}
    notes = []
    if scanned:
      notes.append(f'scanned over axis {_info.axis_list(scanned)} (length '
                   f'{", ".join(str(analysis.scans[(k, a)]) for a in scanned)})')
    if mapped:
      notes.append(f'axis {_info.axis_list(mapped)} runs along the routing decisions made '
                   'per slice (stacked layers applied at once, a vmap)')
    expert_axis = None
    # An axis all of whose pieces are taken (or taken at a loop counter) stacks
    # separate matrices; one row read out of a table does not.
    pieces = sorted(a for (leaf, a), got in analysis.pieces.items() if leaf == k and (
        None in got or got >= set(range(shape[a]))))
    units = {v for decs in gated.get(k, {}).values() for v in decs}
    masker = analysis.decision(min(gated[k])) if units else None
    per_unit = [a for a in pieces if masker and shape[a] == masker.num_experts]
    if k in routers:
      tier = _vocabulary.ROUTER
      decs = sorted(routers[k])
      d = analysis.decision(decs[0])
      notes.insert(0, f'produces the logits of {d.primitive} over E={d.num_experts} experts')
    elif k in inputs:
      tier = _vocabulary.ROUTER
      d = analysis.decision(min(inputs[k]))
      notes.insert(0, f'reaches the outputs only through the logits of {d.primitive} over '
                   f'E={d.num_experts} experts')
    elif found:
      tier = _vocabulary.EXPERTS
      expert_axis = max(sorted(found), key=lambda a: sum(len(v) for v in found[a].values()))
      reasons = sorted(found[expert_axis])
      notes.insert(0, f'axis {expert_axis} (E={shape[expert_axis]}) ' + '; '.join(reasons))
      if len(found) > 1:
        undecided[path] = (f'axes {_info.axis_list(found)} all index experts; chose axis '
                           f'{expert_axis}')
    elif masker and (len(units) > 1 or None in units) and len(per_unit) == 1:
      # A stacked bank applied unit by unit in a loop (`w[e]` masked by `ids == e`).
      tier, expert_axis = _vocabulary.EXPERTS, per_unit[0]
      notes.insert(0, f'axis {expert_axis} (E={masker.num_experts}) taken apart into '
                   f'units, reaching the outputs only through masks of {masker.primitive}\'s '
                   'expert ids')
    elif len(units) == 1 and None not in units:
      # One unit of a bank stored as separate leaves: experts, one matrix (no expert axis).
      tier = _vocabulary.EXPERTS
      d = analysis.decision(min(gated[k]))
      how = ('is joined at position {} of an axis that meets the experts of {}'
             if k in analysis.joined else
             'reaches the outputs only for tokens whose {1} id is {0}')
      notes.insert(0, how.format(units.pop(), d.primitive) +
                   f' (one unit of E={d.num_experts})')
    else:
      tier = _vocabulary.BACKBONE
      notes.insert(0, 'dense')
      why = _why_undecided(analysis, k, shape, used[k], candidates, blind, lost, units,
                           gated)
      if why:
        undecided[path] = why
    if pieces:
      notes.append(f'axis {_info.axis_list(pieces)} taken apart into single pieces (separate '
                   'matrices)')
    axes = set(layers) | set(pieces) | ({expert_axis} if expert_axis is not None else set())
    role, why = _role(analysis, k, tier, len(shape) - len(axes))
    rows.append(_results.LeafStructure(path=path, shape=shape, tier=tier,
                                       batch_axes=tuple(sorted(axes)),
                                       evidence='; '.join(notes), expert_axis=expert_axis,
                                       layer_axes=layers, role=role, role_evidence=why))
  labels: list[Any] = [None] * n_leaves
  batch_axes: list[Any] = [None] * n_leaves
  for i, row in zip(pidx, rows):
    labels[i], batch_axes[i] = row.tier, row.batch_axes
  decisions = []
  for dec in confirmed:
    d = analysis.decision(dec)
    decisions.append(_results.RoutingDecision(
        primitive=d.primitive, num_experts=d.num_experts,
        routers=tuple(paths[k] for k in sorted(set(routers) | set(inputs))
                      if dec in routers.get(k, inputs.get(k, ()))),
        experts=tuple(sorted({paths[leaf] for (leaf, _), why in analysis.banks.items()
                              if any(dec in v for v in why.values())
                              and rows[leaf].tier == _vocabulary.EXPERTS} |
                             {paths[leaf] for leaf, decs in gated.items()
                              if dec in decs and rows[leaf].tier == _vocabulary.EXPERTS}))))
  return _results.Structure(labels=jax.tree_util.tree_unflatten(treedef, labels),
                   batch_axes=jax.tree_util.tree_unflatten(treedef, batch_axes),
                   leaves=tuple(rows), decisions=tuple(decisions), undecided=undecided)



def _why_undecided(analysis: _analysis.Analysis, k: int, shape: tuple[int, ...], used: bool,
                   candidates: dict[int, set[int]], blind: dict[int, str],
                   lost: dict[int, tuple[int, _analysis.Decision]],
                   units: set[Optional[int]], gated: dict[int, dict[int, set[Optional[int]]]]
                   ) -> Optional[str]:
  """Why a leaf labelled backbone may be wrong (None: it is dense, as far as the
  analysis can see)."""
  if not used:
    return 'fn never reads it'
  if k in candidates:
    d = analysis.decision(min(candidates[k]))
    if d.unclear:
      return f'produces the scores of {d.primitive}, whose {d.unclear}'
    return (f'produces the logits of {d.primitive} over {d.num_experts} that dispatches '
            'no parameter: not a router?')
  if k in analysis.opaque:
    return ('reaches ' + ', '.join(sorted(analysis.opaque[k])) +
            ', which the analysis does not see into')
  if k in blind:
    return (f'feeds {blind[k]}, a selection among values computed from parameters that '
            'makes no routing decision (no expert axis can be told)')
  if units:
    d = analysis.decision(min(gated[k]))
    ids = ', '.join(sorted('?' if v is None else str(v) for v in units))
    how = ('is joined against the experts of {} at several positions'
           if k in analysis.joined else
           'reaches the outputs only through masks of {}\'s expert ids')
    return how.format(d.primitive) + f' (ids {ids}): which unit it is cannot be told'
  if k in analysis.unclear:
    return analysis.unclear[k]
  if k in lost:
    a, d = lost[k]
    return (f'axis {a} (E={shape[a]}) meets values routed by {d.primitive} over '
            f'E={d.num_experts} experts, which dispatches no parameter the analysis can '
            'see: a bank whose expert axis it lost?')
  return None


def _role(analysis: _analysis.Analysis, k: int, tier: str, ndim: int) -> tuple[str, str]:
  """What leaf `k` does, and the equation that says so.

  Routers and banks by their tier (a vector among them is the router's bias or a
  per-expert vector); a backbone leaf is an embedding when rows of it are gathered, the
  output layer when its contraction with activations makes the outputs (nothing
  contracted after it), a hidden matrix when otherwise contracted with activations with
  a matrix left beside its batch axes (a convolution of the raw inputs only, ViT's
  patches, is the input layer: an embedding), and a bias or gain when added to or multiplying
  activations elementwise.

  Args:
    analysis: the finished analysis.
    k: the leaf.
    tier: its tier.
    ndim: its number of axes besides its batch axes.

  Returns:
    (role, evidence).
  """
  uses = {use: line for (leaf, use), line in analysis.uses.items() if leaf == k}
  if tier == _vocabulary.ROUTER:
    return (_vocabulary.ROUTER_MATRIX if ndim >= 2 else _vocabulary.ROUTER_BIAS), ''
  if tier == _vocabulary.EXPERTS:
    return (_vocabulary.EXPERT_BANK if ndim >= 2 else _vocabulary.EXPERT_VECTOR), ''
  if 'gathered' in uses:
    return _vocabulary.EMBEDDING, f'rows gathered at {uses["gathered"]}'
  if 'input' in uses and 'contracted' not in uses:  # the first layer: never hidden
    return _vocabulary.EMBEDDING, f'a convolution of the raw inputs at {uses["input"]}'
  if 'contracted' in uses and k in analysis.out_last:
    return _vocabulary.OUTPUT_LAYER, (f'contracted with activations at {uses["contracted"]}, '
                                   'nothing contracted after it')
  if 'contracted' in uses and ndim >= 2:
    return _vocabulary.HIDDEN_MATRIX, f'contracted with activations at {uses["contracted"]}'
  if 'aligned' in uses:
    return _vocabulary.BIAS_GAIN, f'applied elementwise to activations at {uses["aligned"]}'
  return _vocabulary.OTHER, ''
