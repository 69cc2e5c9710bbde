"""The recorded parameter trees of real MoE models (`tests/data/real_trees/*.json`):
reading a record, and nesting its leaves into a tree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

DATA = Path(__file__).resolve().parents[1] / 'data' / 'real_trees'
FILES = sorted(DATA.glob('*.json'))


def record(path: Path) -> dict[str, Any]:
  with open(path) as f:
    return json.load(f)


def nest(leaves: list[dict[str, Any]], make) -> dict[str, Any]:
  """Nested dicts from the '/'-split paths, with `make(leaf)` at each leaf."""
  tree: dict[str, Any] = {}
  for leaf in leaves:
    *parents, name = leaf['path'].split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = make(leaf)
  return tree


def abstract(leaf: dict[str, Any]) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(leaf['shape']), jnp.dtype(leaf['dtype']))
