"""What one step hands the model (the flat token batch and its attention metadata) and the decode gather workspace."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagerail.worker.layers.attention import AttentionMetadata
from pagerail.worker.request_state import RequestState


class GatherWorkspace:
    """Two reusable buffers the decode attention gathers K and V blocks into, grown on demand."""

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_kv_heads = num_kv_heads
        self.block_shape = (block_size, head_dim)
        self.dtype = dtype
        self.device = device
        self._storage = torch.empty(0, dtype=dtype, device=device)

    def buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_block = self.num_kv_heads * self.block_shape[0] * self.block_shape[1]
        needed = 2 * num_blocks * per_block
        if self._storage.numel() < needed:
            # Grow geometrically so a slowly lengthening batch does not reallocate every step.
            self._storage = torch.empty(max(needed, 2 * self._storage.numel()), dtype=self.dtype, device=self.device)
        keys = self._storage[: needed // 2].view(self.num_kv_heads, num_blocks, *self.block_shape)
        values = self._storage[needed // 2 : needed].view(self.num_kv_heads, num_blocks, *self.block_shape)
        return keys, values


@dataclass
class FlatBatch:
    """Model inputs for one step. Row order: every decode (one token each), then prefill chunks."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    # Requests in row order, and for those that sample, the row of their last token.
    ordered: list[RequestState]
    sample_states: list[RequestState]
    sample_rows: torch.Tensor
