"""The words structure decides in: tier names, roles, the names of layer and expert
axes and modules, and how a kernel's shape gives a router's expert count.

Both routes decide in these words: the names route (`name_rules`, `shape_rules`,
`stacks`, `labels`, `axes`, `hidden`) and the traced route (`traced`), so that a tier or
a role means one thing everywhere and each pattern and heuristic is written once. A
name table read by one decider stays beside it (`name_rules.DEFAULT_RULES`, the
embedding and head globs of `hidden`); the module globs two deciders read are here. The
glob engine they are all matched with is `paths`'.

Example:
  >>> from skewadam_jax.structure import vocabulary as v
  >>> v.kernel_sides((512, 8), torch_layout=False)  # a router kernel [d, E]
  (8, 512)
  >>> v.LAYER_AXIS_NAME.match('moe_layers') is not None
  True
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

# ---------------------------------------------------------------------------- tiers
# What a leaf gets: a tier name that a policy (`sj.PUBLISHED_TIERS`, ...) maps to a rule.

BACKBONE = 'backbone'  # dense weights, which every token reads
EXPERTS = 'experts'  # expert banks, each expert read by the tokens routed to it
ROUTER = 'router'  # the kernel (and its bias, scale) producing the routing logits
HIDDEN = 'hidden'  # the backbone's hidden matrices, orthogonalised by `sj.MUON_TIERS`
# The tier of the leaves the traced route could not decide: `sj.skewadam` adds it to
# every policy, with the safe rule (`transforms.tier.undecided_tier`): nothing shared
# across any axis of the leaf.
UNDECIDED = 'undecided'
DEFAULT_TIER = BACKBONE  # of a leaf nothing recognises: the lossless tier
MOE_TIERS = (BACKBONE, EXPERTS, ROUTER)  # what the labelers decide, in report order

# ---------------------------------------------------------------------------- roles
# What a leaf does in the computation (`sj.Structure.roles`).

HIDDEN_MATRIX = 'hidden matrix'  # multiplied with activations: what Muon is for
EMBEDDING = 'embedding'  # rows gathered by token ids or positions
OUTPUT_LAYER = 'output layer'  # the last contraction before the outputs (the logits)
BIAS_GAIN = 'bias/gain'  # added to or multiplying activations elementwise
ROUTER_MATRIX, ROUTER_BIAS = 'router', 'router bias'
EXPERT_BANK, EXPERT_VECTOR = 'expert bank', 'per-expert vector'
OTHER = 'other'  # none of these (read only by ops that give no role)

# ---------------------------------------------------------------------------- names
# Two vocabularies name a stack of layers, and they are kept apart on purpose: logical
# axis names (MaxText 'layers', 'dense_layers', 'moe_layers', 'local_layers'; pipeline
# 'stage', 'repeat') name an axis, so a singular `layer` is the axis of the layers;
# module names (`layers`, `*_layers`, `scanned_*`, `scan`, `blocks`, `stack(ed)`) name a
# container, where a singular `layer` or a `stage` is one layer, not a stack of them.

LAYER_AXIS_NAME = re.compile(r'^(\w+_)?layers?$|^stages?$|^scan$|^repeats?$')
SCAN_MODULE = re.compile(r'^(\w+_)?layers$|^scanned_\w+$|^scan$|^blocks$|^stack(ed)?$')
# The dense blocks' module names (case-insensitive globs): the name rules make them
# backbone (`name_rules`), and their matrices are hidden ones (`hidden`).
ATTENTION_MODULES = ('*attention*', '*attn*')
MLP_MODULES = ('*mlp*', '*ffn*', '*ffw*', '*feed_forward*', '*feedforward*')
# Logical / mesh axis names that mark an expert axis (MaxText 'exp', Linen boxes).
EXPERT_AXIS_NAMES = frozenset({'exp', 'expert', 'experts', 'num_experts', 'routed_experts'})

# Numbered segments, three readings for three questions. A module per expert
# (`expert_0`, `experts3`): the stem names experts. A unit of a bank kept as separate
# leaves (`0`, `unit_1`): any stem, no leading zeros, so that each index is one unit. A
# numbered sibling of a repeated layer (`block_0`, `01`): any index, the stem (or None
# for a bare index) is what siblings share.
NUMBERED_EXPERT = re.compile(r'^(?P<stem>.*?experts?)[_-]?(?P<idx>\d+)$')
NUMBERED_UNIT = re.compile(r'^(?:(?P<stem>.+?)_)?(?P<idx>0|[1-9][0-9]*)$')
NUMBERED_SIBLING = re.compile(r'^(?:(.*)_)?\d+$')

# ---------------------------------------------------------------------------- kernels
# A router kernel maps the width d to the expert count E: [d, E], or [E, d] in
# PyTorch's `weight` layout. Its E is read one of two ways, each where it fits:
#
# * by layout (`kernel_sides`): E is the output side. Used wherever any kernel may be a
#   router (the candidates of a bank, `router_count`; a kernel beside a bank or a
#   router bias; the routers the axis names route has labelled): the layout is what
#   tells [d, E] from a dense [f, d] whose f happens to be the bank's E;
# * by size (`expert_count`): E is the shorter side (E < d in every MoE). Used for a
#   router already decided (by a name or by structure), whose layout a user may have
#   transposed (a `kernel` stored [E, d]).

TORCH_WEIGHT = 'weight'  # the leaf name of PyTorch's [out, in] layout
NOT_KERNEL = ('bias', 'scale')  # router leaves that carry E on no kernel axis


def is_vector(segs: Sequence[str]) -> bool:
  """Whether a leaf is named like a vector (a scale or a bias), not a kernel."""
  return any(s in segs[-1] for s in NOT_KERNEL)


def is_torch_layout(segs: Sequence[str]) -> bool:
  """Whether a leaf's name says its kernel is stored [out, in] (a PyTorch `weight`)."""
  return segs[-1] == TORCH_WEIGHT


def kernel_sides(shape: Sequence[int], torch_layout: bool) -> tuple[int, int]:
  """(outputs, inputs) of a kernel: the last and first axes, swapped for [out, in]."""
  return (shape[0], shape[-1]) if torch_layout else (shape[-1], shape[0])


def router_count(core: Sequence[int], torch_layout: bool, dims: set[int]
                 ) -> Optional[int]:
  """E if a kernel of core shape `core` maps an axis in `dims` to E outputs, else None."""
  if len(core) != 2:
    return None
  count, other = kernel_sides(core, torch_layout)
  return count if other in dims and other != count else None


def expert_count(core: Sequence[int]) -> Optional[int]:
  """E of a router already decided: the shorter side of its core [d, E] or [E, d]; None
  unless it has two axes (three left are a stack no shape found: its E unknown)."""
  return min(core) if len(core) == 2 else None
