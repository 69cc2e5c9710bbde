"""Structure from the computation: tiers and batch axes read from the traced program.

`trace_structure` traces a forward or loss function to a jaxpr and follows every
parameter leaf through it (see `analysis` for the rules).
"""

from skewadam_jax.structure.traced.analysis import BACKBONE
from skewadam_jax.structure.traced.analysis import EXPERTS
from skewadam_jax.structure.traced.analysis import LeafStructure
from skewadam_jax.structure.traced.analysis import ROUTER
from skewadam_jax.structure.traced.analysis import RoutingDecision
from skewadam_jax.structure.traced.analysis import Structure
from skewadam_jax.structure.traced.analysis import trace_structure

__all__ = ['BACKBONE', 'EXPERTS', 'LeafStructure', 'ROUTER', 'RoutingDecision', 'Structure',
           'trace_structure']
