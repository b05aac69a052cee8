"""Attention backends: each turns a step's staged inputs into the AttentionMetadata its kernels read."""
