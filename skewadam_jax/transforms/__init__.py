"""How a tier steps: `Tier`, `scale_by_tiers`, AdamPM's scaling, the optimizers (aliases)
and stochastic rounding. Imports the layers below.

Internal: the public API is `import skewadam_jax as sj`.
"""
