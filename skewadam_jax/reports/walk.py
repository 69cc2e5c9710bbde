"""Which state subtrees follow the params: the one walk that every report shares.

An optax state mixes subtrees with the params' structure (Adam's `mu` and `nu`, each
field of SkewAdam's state, `MultiSteps`' accumulated gradients, Adafactor's factored
`v_row`/`v_col`/`v`) with bookkeeping that follows nothing (step counts, injected
hyperparameters). `param_of_leaves` finds, for every leaf of a state, the parameter
whose subtree holds it, knowing no state layout: a state node follows the params when
the params' treedef is a prefix of its own, so that each parameter position holds

* an array (of any shape: reduced factored statistics, pooled moments, Adafactor's
  `(1,)` placeholders),
* a pytree of arrays (a statistic stored as a pytree, e.g. an 8-bit code and its
  scales), or
* an empty node (`None`, `optax.MaskedNode`) where the parameter keeps nothing,

and no parameter position holds a subtree that follows the params itself (an
`optax.chain` state is a tuple too: a params tuple of the same length must not match
it). So `optax.partition`'s per-tier states (with `MaskedNode` in the other tiers'
slots) and one state whose fields hold `None` in absent slots are walked alike.

Flax boxes are part of a treedef, and a reduced statistic's box names other axes than
its parameter's: callers pass unboxed trees (`structure.boxes.unbox`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax


def _children(node: Any) -> Optional[list[Any]]:
  """The immediate pytree children of `node`; None if `node` is a leaf."""
  leaves = jax.tree_util.tree_leaves(node)
  if len(leaves) == 1 and leaves[0] is node:
    return None
  children, _ = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
  return children


def _positions(node: Any, params_def: Any) -> Optional[list[Any]]:
  """`node`'s subtree at each parameter position, if `node` follows the params."""
  if params_def.num_nodes == 1 and params_def.num_leaves == 1:
    # A lone-array params tree: only a lone array follows it (else every node would).
    return [node] if _children(node) is None else None
  try:
    subtrees = params_def.flatten_up_to(node)
  except (ValueError, TypeError):
    return None
  if any(_holds_params(sub, params_def) for sub in subtrees):
    return None
  return subtrees


def _holds_params(node: Any, params_def: Any) -> bool:
  """Whether a subtree of `node` (other than a leaf) follows the params."""
  children = _children(node)
  if not children:
    return False
  return _positions(node, params_def) is not None or any(
      _holds_params(child, params_def) for child in children)


def param_of_leaves(state: Any, params: Any) -> list[Optional[int]]:
  """For each leaf of `state` (in `jax.tree.leaves` order), the index of the parameter
  leaf whose subtree holds it, or None for leaves that follow no parameter.

  Args:
    state: an optimizer state (abstract or concrete, unboxed).
    params: the parameters it was built for (unboxed); only their structure is read.

  Returns:
    A list with one entry per state leaf.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> params = {'b': jnp.zeros(3), 'w': jnp.zeros((3, 2))}
    >>> param_of_leaves(optax.adam(1e-3).init(params), params)
    [None, 0, 1, 0, 1]
  """
  params_def = jax.tree_util.tree_structure(params)
  out: list[Optional[int]] = []

  def visit(node: Any) -> None:
    positions = _positions(node, params_def)
    if positions is not None:
      for i, sub in enumerate(positions):
        out.extend([i] * len(jax.tree_util.tree_leaves(sub)))
      return
    children = _children(node)
    if children is None:
      out.append(None)
      return
    for child in children:
      visit(child)

  visit(state)
  return out
