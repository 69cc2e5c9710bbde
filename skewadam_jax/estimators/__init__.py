"""What a tier remembers: second-moment estimators (exact, factored, grouped, orthogonal)
and the interface and geometry they share. Imports only `core`.

Internal: the public API is `import skewadam_jax as sj`.
"""
