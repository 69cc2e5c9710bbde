"""The bottom layer: pytree helpers, argument checks and XLA facts, used by every other layer.

Internal: the public API is `import skewadam_jax as sj`.
"""
