"""Drafters that run on rank 0 (a draft model, an EAGLE head): their KV in the target's slot space, and drafts that
reach every tensor-parallel rank by one broadcast, so all ranks verify the same tokens."""

from __future__ import annotations

import torch
from torch import nn

from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.input_buffers import InputBuffers
from pagerail.worker.kv_cache import allocate_kv_caches, bytes_per_block
from pagerail.worker.parallel_state import TensorParallelGroup
from pagerail.worker.request_state import RequestState


class RankZeroDrafter:
    """What a drafting model on rank 0 needs around it: its per-request states, its input buffers and attention
    settings, and its KV cache (allocated in the target's slot space, counted in the cache sizing)."""

    def __init__(self, tp: TensorParallelGroup, device: torch.device, k: int) -> None:
        self.tp, self.device, self.k = tp, device, k
        # Set on rank 0 only (see bind).
        self.model: nn.Module | None = None
        # Per request on rank 0: the drafter's own view (tokens, blocks, how far its KV is written).
        self._states: dict[int, RequestState] = {}

    def bind(self, model: nn.Module, dtype: torch.dtype, block_size: int) -> None:
        """Rank 0: draft with `model`."""
        self.model, self.dtype, self.block_size = model, dtype, block_size
        self.settings = AttentionSettings.for_model(model, self.device, dtype, block_size)
        self.buffers = InputBuffers(block_size, self.device)

    def bytes_per_block(self) -> int:
        """What the drafter's KV adds to each block of this rank (0 off rank 0)."""
        model = self.model
        if model is None:
            return 0
        return bytes_per_block(
            model.num_layers, model.num_kv_heads_per_rank, model.head_dim, self.block_size, self.dtype
        )

    def allocate(self, num_blocks: int) -> None:
        """The drafter's KV cache, in the target's slot space of `num_blocks` blocks."""
        model = self.model
        if model is None:
            return
        caches = allocate_kv_caches(
            model.num_layers,
            num_blocks,
            self.block_size,
            model.num_kv_heads_per_rank,
            model.head_dim,
            self.dtype,
            self.device,
        )
        for layer, cache in zip(model.attention_layers(), caches, strict=True):
            layer.kv_cache = cache

    def forget(self, state: RequestState) -> None:
        own = self._states.pop(state.handle, None)
        if own is not None and self.model is not None:
            self.buffers.release(own)


def share_drafts(
    tp: TensorParallelGroup, device: torch.device, k: int, count: int, drafts: list[list[int]] | None
) -> list[list[int]]:
    """Rank 0's `drafts` (up to `k` per request, `count` requests) on every rank; None off rank 0."""
    if tp.size == 1:
        return drafts
    table = torch.full((count, k), -1, dtype=torch.long)
    if drafts is not None:
        for row, tokens in enumerate(drafts):
            table[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    table = tp.broadcast(table.to(device)).cpu()
    return [[t for t in row.tolist() if t >= 0] for row in table]


def append_drafts(wanted: list[RequestState], drafts: list[list[int]]) -> list[RequestState]:
    """Put each request's drafts after its next token, as the step computes them; the requests that got some."""
    for state, tokens in zip(wanted, drafts, strict=True):
        if tokens:
            state.drafts = tokens
            state.token_ids.extend(tokens)
            state.num_scheduled_tokens = 1 + len(tokens)
    return [state for state in wanted if state.drafts]
