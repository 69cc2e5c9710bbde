"""What a user sees before training: the traced `init`, the label table and the memory
report. Imports the layers below.

Internal: the public API is `import skewadam_jax as sj`.
"""
