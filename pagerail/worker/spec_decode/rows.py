"""A speculating step's sampled rows: which request and position each row is, and what each request keeps."""

from __future__ import annotations

import torch

from pagerail.proto import step_pb2
from pagerail.worker.request_state import RequestState
from pagerail.worker.sampler import SamplerOutput
from pagerail.worker.spec_decode.verify import accepted_tokens


def row_states(states: list[RequestState]) -> list[RequestState]:
    """Each sampled row's request: a speculating request once per row (its next token, then each draft)."""
    rows: list[RequestState] = []
    for state in states:
        rows.extend([state] * (1 + len(state.drafts)) if state.drafts else (state,))
    return rows


def row_offsets(states: list[RequestState]) -> list[int]:
    """Each sampled row's distance from its request's next token (0 for every row of a plain request)."""
    offsets: list[int] = []
    for state in states:
        offsets.extend(range(1 + len(state.drafts)) if state.drafts else (0,))
    return offsets


def split_runs(states: list[RequestState], row_tokens: list[int]) -> list[list[int]]:
    """Per request, the tokens it emits this step: one for a plain request, the kept run for a speculating one."""
    runs, at = [], 0
    for state in states:
        if state.drafts:
            count = 1 + len(state.drafts)
            runs.append(accepted_tokens(state.drafts, row_tokens[at : at + count]))
            at += count
        else:
            runs.append([row_tokens[at]])
            at += 1
    return runs


def write_result(
    result: step_pb2.StepResult,
    states: list[RequestState],
    runs: list[list[int]],
    sampled: SamplerOutput | None,
    with_logprobs: bool,
) -> None:
    """Plain requests answer in handles/token_ids, speculating ones in the spec_* fields (see step.proto)."""
    at = 0
    for state, run in zip(states, runs, strict=True):
        rows = 1 + len(state.drafts) if state.drafts else 1
        if state.drafts:
            result.spec_handles.append(state.handle)
            result.spec_counts.append(len(run))
            result.spec_num_drafts.append(len(state.drafts))
            result.spec_token_ids.extend(run)
            if with_logprobs:
                for row in range(at, at + len(run)):
                    lp = sampled.logprobs[row]
                    result.spec_logprobs.append(lp if lp is not None else 0.0)
                    result.spec_top_logprobs.add(token_ids=sampled.top_ids[row], logprobs=sampled.top_logprobs[row])
        else:
            result.handles.append(state.handle)
            result.token_ids.append(run[0])
            if with_logprobs:
                lp = sampled.logprobs[at]
                result.logprobs.append(lp if lp is not None else 0.0)
                result.top_logprobs.add(token_ids=sampled.top_ids[at], logprobs=sampled.top_logprobs[at])
        at += rows


def speculating_history(penalties, per_row: list[RequestState], offsets: list[int], seen: bool, counts: bool):
    """The penalties' token history for a step with drafts, one row per sampled row: a draft row's history holds
    the request's tokens and the drafts before that row, as plain decoding would have had them by then.

    The penalty table is synced with each request's own tokens (its drafts set aside), then each draft row adds
    the drafts ahead of it."""
    from pagerail.worker.sampler import TokenHistory

    unique = list({id(state): state for state in per_row}.values())
    stashed = []
    for state in unique:
        if state.drafts:
            stashed.append((state, state.token_ids[-len(state.drafts) :]))
            del state.token_ids[-len(state.drafts) :]
    try:
        base = penalties.history(unique, seen=seen, output_counts=counts)
    finally:
        for state, drafts in stashed:
            state.token_ids.extend(drafts)
    where = {id(state): index for index, state in enumerate(unique)}
    index = torch.tensor([where[id(state)] for state in per_row], dtype=torch.long, device=penalties.device)
    output_counts = base.output_counts.index_select(0, index) if counts else None
    seen_rows = base.seen.index_select(0, index) if seen else None
    rows, tokens = [], []
    for row, (state, offset) in enumerate(zip(per_row, offsets, strict=True)):
        for token in state.drafts[:offset] if offset else ():
            rows.append(row)
            tokens.append(token)
    if rows:
        at = torch.tensor([rows, tokens], dtype=torch.long, device=penalties.device)
        if output_counts is not None:
            ones = torch.ones(len(rows), dtype=output_counts.dtype, device=at.device)
            output_counts.index_put_((at[0], at[1]), ones, accumulate=True)
        if seen_rows is not None:
            seen_rows.index_put_((at[0], at[1]), torch.ones((), dtype=torch.bool, device=at.device))
    return TokenHistory(output_counts, seen_rows)
