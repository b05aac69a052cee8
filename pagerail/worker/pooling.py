"""Embedding requests on a rank: their prompt's final hidden states pooled into one vector per request.

An embedding request computes its prompt like any prefill (chunked or not); the rows of its prompt positions
are pooled as they are computed ("mean" keeps a running sum across chunks, "cls" keeps the first position's row),
and the step that computes the prompt's last position answers the vector ("last": that row itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagerail.proto import step_pb2
from pagerail.worker.request_state import RequestState


def pool_prompt_rows(
    ordered: list[RequestState],
    hidden: torch.Tensor,
    result: step_pb2.StepResult,
    classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Pool this step's prompt rows of every embedding request (rows follow `ordered`, each request owning
    num_scheduled_tokens consecutive rows); a request whose prompt ends in this step gets its vector in `result`.
    `classify` (a classifier's head): the vector is instead its logits over the first row. Call before the step
    advances the states."""
    row = 0
    for state in ordered:
        first, count = state.num_computed_tokens, state.num_scheduled_tokens
        stop = min(first + count, state.num_prompt_tokens)
        if state.pooling and stop > first:
            _pool(state, hidden[row : row + stop - first], first, result, classify)
        row += count


def _pool(state: RequestState, rows: torch.Tensor, first: int, result: step_pb2.StepResult, classify) -> None:
    """One request's prompt rows of this step (positions `first` on); its vector into `result` once they end it."""
    end = state.num_prompt_tokens
    if classify is not None:
        if first == 0:  # an encoder's prompt is whole in one step
            result.pooled.add(handle=state.handle, values=classify(rows[:1]).float()[0].tolist())
        return
    rows = rows.float()
    if first == 0:  # the prompt starts over (first chunk, or recomputed after preemption)
        state.pooled = rows[0].clone() if state.pooling == "cls" else None
    if state.pooling == "mean":
        total = rows.sum(dim=0)
        state.pooled = total if state.pooled is None else state.pooled + total
    if first + rows.shape[0] == end:
        vector = rows[-1] if state.pooling == "last" else state.pooled
        if state.pooling == "mean":
            vector = vector / end
        result.pooled.add(handle=state.handle, values=vector.tolist())
