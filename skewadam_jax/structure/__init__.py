"""What each parameter is: paths and containers, names, stacks and banks, batch axes,
hidden matrices, and the traced analysis of the computation, all in the words of
`vocabulary` (tier names, roles). Imports `core` and `estimators` (their layout
geometry).

Internal: the public API is `import skewadam_jax as sj`.
"""
