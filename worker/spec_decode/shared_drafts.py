"""Drafts proposed on rank 0 reach every tensor-parallel rank by one broadcast, so all ranks verify the same tokens."""

from __future__ import annotations

import torch

from worker.parallel_state import TensorParallelGroup
from worker.request_state import RequestState


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
