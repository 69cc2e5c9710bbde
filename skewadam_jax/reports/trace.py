"""One abstract trace of an optimizer's `init`, and the plans of the transforms in it.

The reports (`label_table`, `memory_report`, `state_shardings`, `describe_state`) read
the optimizer that was built, not a description of it repeated by hand: `trace_init`
runs `jax.eval_shape(tx.init, params)` once (nothing is allocated), and finds, by
walking `tx` (`planners`), every transform that plans its leaves
(`transforms.plan.Planner`, exposed as `init.planner`), whatever wraps it
(`optax.chain`, `inject_hyperparams`, `MultiSteps`, `apply_if_finite`, `masked`,
`partition`). Each planner's plan of the params is matched with its state in the trace
(a node of its `state_type`, the params it saw read off that node's masked slots), so
each of those state leaves knows its parameter, its field and its `LeafPlan`. Leaves
no plan covers (other optax transforms' state) are matched to their parameter by the
state walk (`reports.walk`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Mapping, Optional

import jax
import optax

from skewadam_jax.structure import boxes as _flax
from skewadam_jax.structure import paths as _paths
from skewadam_jax.transforms import plan as _plan
from skewadam_jax.reports import walk as _walk


@dataclasses.dataclass(frozen=True)
class Planned:
  """Where a state leaf sits in a plan: leaf `index` of `plan`, its state `field`, and
  its position `item` in that field's pytree (a coded momentum's codes and scales)."""
  plan: _plan.Plan
  index: int
  field: str
  item: int


@dataclasses.dataclass(frozen=True)
class StateLeaf:
  """One leaf of the traced state."""
  leaf: jax.ShapeDtypeStruct
  param: Optional[int]  # index of the parameter leaf it belongs to; None: bookkeeping
  planned: Optional[Planned]  # where a plan covers it


@dataclasses.dataclass(frozen=True)
class Trace:
  """The abstract state of `tx.init(params)`, and what made each of its leaves."""
  state: Any  # the abstract state (`jax.ShapeDtypeStruct` leaves, Flax boxes kept)
  leaves: tuple[StateLeaf, ...]  # one per leaf of `state`, in `jax.tree.leaves` order
  paths: tuple[str, ...]  # the parameters' normalised paths, in flattening order
  # parameter path -> its `LeafPlan` under the first described planner (a skewadam's)
  tiers: Mapping[str, _plan.LeafPlan]
  has_tiers: bool = False  # whether `tx` holds a described planner (one with no leaf too)


def _cells(fn: Any) -> dict[str, Any]:
  """The closure of a function by variable name (empty cells left out)."""
  out = {}
  for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
    try:
      out[name] = cell.cell_contents
    except ValueError:  # an empty cell
      pass
  return out


def planners(tx: Any) -> list[_plan.Planner]:
  """The planners of the transforms inside `tx`, in the order their states appear.

  Walks what a transform's `init` holds: `init.planner`, the transforms and functions
  its closure holds (`optax.chain`, `masked`, `partition`, `apply_if_finite`), a
  `MultiSteps`' `inner_opt`, and an `inject_hyperparams`' inner transform (rebuilt from
  its factory and hyperparameters, as its `init` builds it).
  """
  found: list[_plan.Planner] = []
  seen: set[int] = set()

  def visit(obj: Any, depth: int) -> None:
    if obj is None or id(obj) in seen or depth > 64:
      return
    seen.add(id(obj))
    planner = getattr(obj, 'planner', None)
    if isinstance(planner, _plan.Planner):
      found.append(planner)
      return
    if isinstance(obj, optax.GradientTransformation):
      visit(obj.init, depth + 1)
    elif isinstance(obj, (tuple, list)):
      for x in obj:
        visit(x, depth + 1)
    elif isinstance(obj, dict):  # in the order jax flattens a dict: its keys sorted
      try:
        keys = sorted(obj)
      except TypeError:
        keys = list(obj)
      for k in keys:
        visit(obj[k], depth + 1)
    elif isinstance(obj, functools.partial):
      visit(obj.func, depth + 1)
      visit(obj.args, depth + 1)
      visit(obj.keywords, depth + 1)
    elif inspect.ismethod(obj):
      visit(obj.__self__, depth + 1)
    elif inspect.isfunction(obj):
      visit(getattr(obj, '__wrapped__', None), depth + 1)
      cells = _cells(obj)
      if callable(cells.get('inner_factory')) and 'other_hps' in cells:
        # optax.inject_hyperparams builds its inner transform in `init`, from these.
        schedules = {k: getattr(f, 'schedule_fn', f)
                     for k, f in cells.get('sched_hps', {}).items()}
        visit(cells['inner_factory'](**cells['other_hps'], **cells.get('numeric_hps', {}),
                                     **schedules), depth + 1)
        return
      for value in cells.values():
        visit(value, depth + 1)
    elif hasattr(obj, 'inner_opt'):  # optax.MultiSteps
      visit(obj.inner_opt, depth + 1)

  visit(tx, 0)
  return found


def _seen_params(node: Any, params: Any, params_def: Any) -> Any:
  """The params a transform's `init` saw, from its state `node`: a parameter whose every
  field holds an `optax.MaskedNode` was masked out (`optax.masked`, `partition`)."""
  fields = [params_def.flatten_up_to(f) for f in _flax.unbox(tuple(node))
            if _follows(f, params_def)]
  if not fields:
    return params
  masked = [all(isinstance(col[j], optax.MaskedNode) for col in fields)
            for j in range(params_def.num_leaves)]
  if not any(masked):
    return params
  leaves = params_def.flatten_up_to(_flax.unbox(params))
  return params_def.unflatten([optax.MaskedNode() if m else x for m, x in zip(masked, leaves)])


def _follows(field: Any, params_def: Any) -> bool:
  try:
    params_def.flatten_up_to(field)
  except (ValueError, TypeError):
    return False
  return True


def trace_init(tx: optax.GradientTransformation, params: Any, *, explain: bool = False
               ) -> Trace:
  """`jax.eval_shape(tx.init, params)`, with the plan of each state leaf a transform
  plans (see module doc); with `explain`, the plans give each leaf's reason (only the
  label table reads it: the params are labelled once more for the notes)."""
  state = jax.eval_shape(tx.init, params)
  paths = tuple(path for path, _ in _paths.flatten_with_paths(params)[0])
  params_def = jax.tree_util.tree_structure(_flax.unbox(params))
  found = planners(tx)
  types = tuple({p.state_type for p in found})
  nodes = [n for n in jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, types)) if isinstance(n, types)] if types else []
  planned: dict[int, tuple[int, Planned]] = {}
  tiers: dict[str, _plan.LeafPlan] = {}
  for planner in found:
    node = next((n for n in nodes if isinstance(n, planner.state_type)), None)
    if node is None:
      continue
    nodes.remove(node)
    seen = _seen_params(node, params, params_def)
    plan = planner.plan(seen, explain=explain)
    # The parameter of each leaf of the plan: the positions not masked out.
    stepped = [j for j, x in enumerate(params_def.flatten_up_to(_flax.unbox(seen)))
               if not isinstance(x, optax.MaskedNode)]
    for k, j in enumerate(stepped):
      if planner.described:
        tiers.setdefault(paths[j], plan.leaves[k])
    for field in node._fields:
      if field != 'mu' and field not in plan.stat_keys:
        continue
      column = params_def.flatten_up_to(_flax.unbox(getattr(node, field)))
      for k, j in enumerate(stepped):
        for item, leaf in enumerate(jax.tree.leaves(column[j])):
          planned[id(leaf)] = (j, Planned(plan, k, field, item))
  walked = _walk.param_of_leaves(_flax.unbox(state), _flax.unbox(params))
  leaves = []
  for leaf, param in zip(jax.tree.leaves(_flax.unbox(state)), walked):
    entry = planned.get(id(leaf))
    leaves.append(StateLeaf(leaf, param, None) if entry is None
                  else StateLeaf(leaf, entry[0], entry[1]))
  return Trace(state, tuple(leaves), paths, tiers, any(p.described for p in found))
