"""skewadam-jax: memory-efficient Adam variants for Mixture-of-Experts training.

SkewAdam (optimizer state allocated by parameter tier) and AdamPM (a second moment
pooled over groups of neighbouring elements), as composable optax transformations.
"""

from skewadam_jax._alias import adampm
from skewadam_jax._alias import skewadam
from skewadam_jax._alias import tier_labeler
from skewadam_jax._exact import Exact
from skewadam_jax._factored import Factored
from skewadam_jax._factored import row_col_means
from skewadam_jax._grouped import expand_groups
from skewadam_jax._grouped import Grouped
from skewadam_jax._grouped import GroupedSecondMomentState
from skewadam_jax._grouped import grouped_shape
from skewadam_jax._grouped import groupmean
from skewadam_jax._grouped import num_groups
from skewadam_jax._grouped import scale_by_grouped_second_moment
from skewadam_jax._labels import DEFAULT_RULES
from skewadam_jax._labels import DEFAULT_TIER
from skewadam_jax._labels import expand_labels
from skewadam_jax._labels import label_for_path
from skewadam_jax._labels import LeafReport
from skewadam_jax._labels import make_labeler
from skewadam_jax._labels import match_path
from skewadam_jax._labels import moe_param_labels
from skewadam_jax._memory import abstract_state
from skewadam_jax._memory import format_label_table
from skewadam_jax._memory import label_table
from skewadam_jax._memory import memory_report
from skewadam_jax._memory import MemoryReport
from skewadam_jax._memory import optimizer_state_bytes
from skewadam_jax._memory import state_bytes
from skewadam_jax._memory import state_bytes_by_label
from skewadam_jax._memory import TierMemory
from skewadam_jax._memory import tree_bytes
from skewadam_jax._rounding import apply_updates_stochastic
from skewadam_jax._rounding import stochastic_round
from skewadam_jax._second_moment import SecondMoment
from skewadam_jax._second_moment import Step
from skewadam_jax._sharding import sharded_abstract_state
from skewadam_jax._sharding import state_shardings
from skewadam_jax._tiered import EPS_MODES
from skewadam_jax._tiered import PUBLISHED_TIERS
from skewadam_jax._tiered import scale_by_tiered_adam
from skewadam_jax._tiered import SECOND_MOMENTS
from skewadam_jax._tiered import Tier
from skewadam_jax._tiered import TieredAdamState

__version__ = '0.1.0'

__all__ = (
    'DEFAULT_RULES',
    'DEFAULT_TIER',
    'EPS_MODES',
    'Exact',
    'Factored',
    'Grouped',
    'GroupedSecondMomentState',
    'LeafReport',
    'MemoryReport',
    'PUBLISHED_TIERS',
    'SECOND_MOMENTS',
    'SecondMoment',
    'Step',
    'Tier',
    'TierMemory',
    'TieredAdamState',
    'abstract_state',
    'adampm',
    'apply_updates_stochastic',
    'expand_groups',
    'expand_labels',
    'format_label_table',
    'grouped_shape',
    'groupmean',
    'label_for_path',
    'label_table',
    'make_labeler',
    'match_path',
    'memory_report',
    'moe_param_labels',
    'num_groups',
    'optimizer_state_bytes',
    'row_col_means',
    'scale_by_grouped_second_moment',
    'scale_by_tiered_adam',
    'sharded_abstract_state',
    'skewadam',
    'state_bytes',
    'state_bytes_by_label',
    'state_shardings',
    'stochastic_round',
    'tier_labeler',
    'tree_bytes',
)
