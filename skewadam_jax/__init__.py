"""skewadam-jax: memory-efficient Adam variants for Mixture-of-Experts training.

SkewAdam (optimizer state allocated by parameter tier) and AdamPM (a second moment
pooled over groups of neighbouring elements), as composable optax transformations.

One flat namespace, as optax's: `import skewadam_jax as sj`, then `sj.<name>`. The
public names are `__all__`, grouped as the code is (the optimizers and their rules;
tiers and estimators; labels and batch axes; reports; sharding and checkpoints;
helpers); each group below says why a user needs it. Modules whose names start with an
underscore are internal.
"""

# The two optimizers, drop-ins for optax.adamw.
from skewadam_jax.transforms.alias import adampm
from skewadam_jax.transforms.alias import skewadam
# Their scaling rules, to compose in your own optax chain.
from skewadam_jax.transforms.adampm import scale_by_grouped_second_moment
from skewadam_jax.transforms.tiers import scale_by_tiered_adam
from skewadam_jax.transforms.tiers import scale_by_tiers
# Tier configuration: the published policy, ours, and how to change or add a tier.
from skewadam_jax.transforms.presets import PUBLISHED_TIERS
from skewadam_jax.transforms.presets import ADAM_EPS_TIERS
from skewadam_jax.transforms.presets import ADAM_ROUTER_TIERS
from skewadam_jax.transforms.presets import MUON_CODED_TIERS
from skewadam_jax.transforms.presets import MUON_TIERS
from skewadam_jax.transforms.tier import Tier
# State types, to inspect or checkpoint the state (`state.v_row`, `tree_get`).
from skewadam_jax.transforms.adampm import GroupedSecondMomentState
from skewadam_jax.transforms.tiers import TieredAdamState
# Second-moment estimators: the built-in ones, and the interface of your own.
from skewadam_jax.estimators.exact import Exact
from skewadam_jax.estimators.factored import Factored
from skewadam_jax.estimators.grouped import Grouped
from skewadam_jax.estimators.orthogonal import Orthogonal
from skewadam_jax.estimators.base import SecondMoment
from skewadam_jax.estimators.base import Shared
from skewadam_jax.estimators.base import SharedGroup
from skewadam_jax.estimators.base import Step
from skewadam_jax.estimators.newton_schulz import NewtonSchulzGroup
# State codecs: a tier's momentum stored as blockwise low-bit codes (`Tier(mu_codec=...)`).
from skewadam_jax.estimators.codec import Blockwise
from skewadam_jax.estimators.codec import Coded
from skewadam_jax.estimators.codec import StateCodec
# Labels: which tier each parameter gets, and your own rules.
from skewadam_jax.structure.name_rules import DEFAULT_RULES
from skewadam_jax.structure.name_rules import DENSE_RULES
from skewadam_jax.structure.labels import Labeler
from skewadam_jax.structure.labels import make_labeler
from skewadam_jax.structure.labels import moe_param_labels
from skewadam_jax.structure.hidden import hidden_param_labels
# The warning a guessed label raises (filter it, or make it an error, by its class).
from skewadam_jax.structure.warning import UnsureLabelWarning
# Batch axes: which axes of each leaf index independent matrices (experts, layers).
from skewadam_jax.structure.axes import moe_batch_axes
# Structure from the computation: tiers and batch axes read from the traced forward pass.
from skewadam_jax.structure.traced import Structure
from skewadam_jax.structure.traced import trace_structure
# Reports: what each leaf gets and costs, read from the optimizer before training
# (nothing is allocated).
from skewadam_jax.structure.labels import LeafReport
from skewadam_jax.reports.memory import label_table
from skewadam_jax.reports.memory import LabelTable
from skewadam_jax.reports.memory import memory_report
from skewadam_jax.reports.memory import MemoryReport
from skewadam_jax.reports.memory import TierMemory
from skewadam_jax.reports.memory import optimizer_state_bytes
from skewadam_jax.reports.memory import state_bytes
# Sharding: the state's shardings from the params' (jit out_shardings, Orbax targets).
from skewadam_jax.integrations.sharding import sharded_abstract_state
from skewadam_jax.integrations.sharding import state_shardings
# Checkpoints: does a saved state match the optimizer's (before restoring it)?
from skewadam_jax.integrations.checkpoint import check_checkpoint_matches
from skewadam_jax.integrations.checkpoint import checkpoint_mismatches
from skewadam_jax.integrations.sealing import check_checkpoint
from skewadam_jax.integrations.sealing import describe_state
from skewadam_jax.integrations.sealing import seal_checkpoint
from skewadam_jax.integrations.relayout import relayout_state
from skewadam_jax.integrations.relayout import saved_layout_target
# AdamPM's pooling, to analyse a second moment as AdamPM sees it.
from skewadam_jax.estimators.pooling import expand_groups
from skewadam_jax.estimators.pooling import groupmean
# bf16 weights: unbiased stochastic rounding of the update.
from skewadam_jax.transforms.rounding import apply_updates_stochastic
from skewadam_jax.transforms.rounding import stochastic_round

__version__ = '0.1.0'

__all__ = (
    # The optimizers, and their scaling rules.
    'adampm',
    'skewadam',
    'scale_by_grouped_second_moment',
    'scale_by_tiered_adam',
    'scale_by_tiers',
    # Tiers: the policies and one tier's configuration.
    'ADAM_EPS_TIERS',
    'ADAM_ROUTER_TIERS',
    'MUON_CODED_TIERS',
    'MUON_TIERS',
    'PUBLISHED_TIERS',
    'Tier',
    # State types.
    'GroupedSecondMomentState',
    'TieredAdamState',
    # Second-moment estimators, and the interface of your own.
    'Exact',
    'Factored',
    'Grouped',
    'NewtonSchulzGroup',
    'Orthogonal',
    'SecondMoment',
    'Shared',
    'SharedGroup',
    'Step',
    # State codecs.
    'Blockwise',
    'Coded',
    'StateCodec',
    # Labels, batch axes and structure: which tier and which batch axes each leaf gets.
    'DEFAULT_RULES',
    'DENSE_RULES',
    'Labeler',
    'Structure',
    'UnsureLabelWarning',
    'hidden_param_labels',
    'make_labeler',
    'moe_batch_axes',
    'moe_param_labels',
    'trace_structure',
    # Reports, read from the optimizer: label_table(tx, params), memory_report(tx, params).
    'LabelTable',
    'LeafReport',
    'MemoryReport',
    'TierMemory',
    'label_table',
    'memory_report',
    'optimizer_state_bytes',
    'state_bytes',
    # Sharding and checkpoints.
    'check_checkpoint',
    'check_checkpoint_matches',
    'checkpoint_mismatches',
    'describe_state',
    'relayout_state',
    'saved_layout_target',
    'seal_checkpoint',
    'sharded_abstract_state',
    'state_shardings',
    # Helpers: AdamPM's pooling, stochastic rounding for bf16 weights.
    'apply_updates_stochastic',
    'expand_groups',
    'groupmean',
    'stochastic_round',
)
