"""A small decoder-only MoE language model (Flax NNX) and byte-level data for examples."""
