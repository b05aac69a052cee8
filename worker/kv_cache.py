"""Sizes this rank's KV cache shard from its memory budget and allocates it, one tensor per layer."""

from __future__ import annotations

import torch

from worker.host_memory import zeros_on_huge_pages

DEFAULT_CPU_KV_BYTES = 2 << 30


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """K and V for `block_size` tokens across every layer of this rank's shard."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def memory_budget(device: torch.device, kv_cache_memory_bytes: int | None) -> int | None:
    """Bytes this rank may spend on its KV cache; None on a GPU, whose budget a profiling forward measures."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    if device.type == "cuda":
        return None  # see worker.memory_profile
    return DEFAULT_CPU_KV_BYTES


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One [2, kv_heads, num_blocks * block_size, head_dim] tensor per layer; slot = block * block_size + offset."""
    shape = (2, num_kv_heads, num_blocks * block_size, head_dim)
    if device.type == "cpu":
        return [zeros_on_huge_pages(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
