"""A speculating step's sampled rows: which request and position each row is, and what each request keeps."""

from __future__ import annotations

from proto import step_pb2
from worker.request_state import RequestState
from worker.sampler import SamplerOutput
from worker.spec_decode.verify import accepted_tokens


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
