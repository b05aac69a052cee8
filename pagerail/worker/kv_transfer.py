"""KV blocks leaving and entering a rank whole, for a request that moves to another replica: read as this rank's
KV heads, gathered into every head of the layer, and written into the receiving ranks' host slots as their heads.
The two replicas may split the heads over different tensor-parallel sizes."""

from __future__ import annotations

import torch


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """The KV heads a rank holds: a share of them, or one replicated head when there are fewer heads than ranks
    (as QKVParallelLinear splits them)."""
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank // (tp_size // num_kv_heads)]


def read_blocks(caches: list[torch.Tensor], block_ids: list[int], block_size: int) -> torch.Tensor:
    """[n, layers, 2, heads of this rank, block_size, head_dim] on the CPU, from caches of layers shaped
    [2, heads, num_blocks * block_size, head_dim]."""
    device = caches[0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    layers = []
    for cache in caches:
        two, heads, slots, head_dim = cache.shape
        blocks = cache.view(two, heads, slots // block_size, block_size, head_dim).index_select(2, index)
        layers.append(blocks.permute(2, 0, 1, 3, 4))  # [n, 2, heads, block_size, head_dim]
    return torch.stack(layers, dim=1).cpu()


def gather_heads(shards: list[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """Every rank's read_blocks (in rank order) → [n, layers, 2, num_kv_heads, block_size, head_dim]."""
    first = shards[0]
    full = torch.empty((*first.shape[:3], num_kv_heads, *first.shape[4:]), dtype=first.dtype)
    for rank, shard in enumerate(shards):
        heads = kv_heads_of_rank(num_kv_heads, len(shards), rank)
        full[:, :, :, heads] = shard
    return full
