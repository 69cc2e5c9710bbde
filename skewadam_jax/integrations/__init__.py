"""Where the library plugs in: sharding specs of the state and Orbax checkpoints.
Imports the layers below.

Internal: the public API is `import skewadam_jax as sj`.
"""
