"""skewadam-jax: memory-efficient Adam variants for Mixture-of-Experts training.

SkewAdam (optimizer state allocated by parameter tier) and AdamPM (a second moment
pooled over groups of neighbouring elements), as composable optax transformations.
Each public name below says why a user needs it; everything else is internal.
"""

# The two optimizers, drop-ins for optax.adamw.
from skewadam_jax._alias import adampm
from skewadam_jax._alias import skewadam
# Their scaling rules, to compose in your own optax chain.
from skewadam_jax._adampm import scale_by_grouped_second_moment
from skewadam_jax._tiered import scale_by_tiered_adam
from skewadam_jax._tiered import scale_by_tiers
# Tier configuration: the published policy, ours, and how to change or add a tier.
from skewadam_jax._tiered import PUBLISHED_TIERS
from skewadam_jax._tiered import ADAM_EPS_TIERS
from skewadam_jax._tiered import ADAM_ROUTER_TIERS
from skewadam_jax._tiered import MUON_TIERS
from skewadam_jax._tiered import Tier
# State types, to inspect or checkpoint the state (`state.v_row`, `tree_get`).
from skewadam_jax._adampm import GroupedSecondMomentState
from skewadam_jax._tiered import TieredAdamState
# Second-moment estimators: the built-in ones, and the interface of your own.
from skewadam_jax._exact import Exact
from skewadam_jax._factored import Factored
from skewadam_jax._grouped import Grouped
from skewadam_jax._orthogonal import Orthogonal
from skewadam_jax._second_moment import SecondMoment
from skewadam_jax._second_moment import Step
# Labels: which tier each parameter gets, and your own rules.
from skewadam_jax._labels import DEFAULT_RULES
from skewadam_jax._labels import make_labeler
from skewadam_jax._labels import moe_param_labels
from skewadam_jax._hidden import hidden_param_labels
# Batch axes: which axes of each leaf index independent matrices (experts, layers).
from skewadam_jax._axes import moe_batch_axes
# Structure from the computation: tiers and batch axes read from the traced forward pass.
from skewadam_jax._structure import Structure
from skewadam_jax._structure import trace_structure
# Reports: what each leaf gets and costs, before training (nothing is allocated).
from skewadam_jax._labels import LeafReport
from skewadam_jax._memory import format_label_table
from skewadam_jax._memory import label_table
from skewadam_jax._memory import memory_report
from skewadam_jax._memory import MemoryReport
from skewadam_jax._memory import optimizer_state_bytes
from skewadam_jax._memory import state_bytes
# Sharding: the state's shardings from the params' (jit out_shardings, Orbax targets).
from skewadam_jax._sharding import sharded_abstract_state
from skewadam_jax._sharding import state_shardings
# Checkpoints: does a saved state match the optimizer's (before restoring it)?
from skewadam_jax._checkpoint import check_checkpoint_matches
from skewadam_jax._checkpoint import checkpoint_mismatches
# AdamPM's pooling, to analyse a second moment as AdamPM sees it.
from skewadam_jax._grouped import expand_groups
from skewadam_jax._grouped import groupmean
# bf16 weights: unbiased stochastic rounding of the update.
from skewadam_jax._rounding import apply_updates_stochastic
from skewadam_jax._rounding import stochastic_round

__version__ = '0.1.0'

__all__ = (
    'ADAM_EPS_TIERS',
    'ADAM_ROUTER_TIERS',
    'DEFAULT_RULES',
    'Exact',
    'Factored',
    'Grouped',
    'GroupedSecondMomentState',
    'LeafReport',
    'MUON_TIERS',
    'MemoryReport',
    'Orthogonal',
    'PUBLISHED_TIERS',
    'SecondMoment',
    'Step',
    'Structure',
    'Tier',
    'TieredAdamState',
    'adampm',
    'apply_updates_stochastic',
    'check_checkpoint_matches',
    'checkpoint_mismatches',
    'expand_groups',
    'format_label_table',
    'groupmean',
    'hidden_param_labels',
    'label_table',
    'make_labeler',
    'memory_report',
    'moe_batch_axes',
    'moe_param_labels',
    'optimizer_state_bytes',
    'scale_by_grouped_second_moment',
    'scale_by_tiered_adam',
    'scale_by_tiers',
    'sharded_abstract_state',
    'skewadam',
    'state_bytes',
    'state_shardings',
    'stochastic_round',
    'trace_structure',
)
